"""Helpers of the tests that run real jobs on the local SLURM cluster (tests/test_slurm*.py).

The cluster is the one ``scripts/slurm/start.sh [--nodes N]`` starts (as root; ``.ci/run`` starts
two nodes). Without one the tests fail, on purpose; on a developer machine without SLURM,
``PIPEFISHER_SKIP_SLURM=1`` skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
START = "scripts/slurm/start.sh"
# Subprocesses (and the SLURM jobs, which inherit the environment) import this checkout, installed or not.
SUB_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "WANDB_MODE": "offline"}
UP_STATES = ("idle", "mix", "alloc")


def slurm_nodes() -> dict[str, str]:
    """``{node: state}`` as ``sinfo -N`` reports them; fails the test when SLURM does not answer."""
    if os.environ.get("PIPEFISHER_SKIP_SLURM") == "1":
        pytest.skip("PIPEFISHER_SKIP_SLURM=1")
    if shutil.which("sinfo") is None:
        pytest.fail(f"SLURM is not installed (no sinfo on PATH): run `sudo {START}` first "
                    "(or set PIPEFISHER_SKIP_SLURM=1 on a machine without SLURM)", pytrace=False)
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the SLURM controller does not answer: run `sudo {START}`", pytrace=False)
    if out.returncode:
        pytest.fail(f"the SLURM controller does not answer ({out.stderr.strip()}): run `sudo {START}`", pytrace=False)
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def require_slurm(min_nodes: int = 1) -> list[str]:
    """The up nodes of the SLURM cluster (at least ``min_nodes``), in ``sinfo`` order; fails the test
    (not skips) when there are fewer. A node still completing an earlier test's job ("comp") is
    waited for, up to a minute: that state passes by itself."""
    nodes = slurm_nodes()
    deadline = time.monotonic() + 60
    while any(state.startswith("comp") for state in nodes.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = slurm_nodes()
    up = [n for n, state in nodes.items() if state in UP_STATES]
    if len(up) < min_nodes:
        how = f"sudo {START}" + (f" --nodes {min_nodes}" if min_nodes > 1 else "")
        pytest.fail(f"{len(up)} SLURM node(s) up ({nodes or 'none'}), {min_nodes} needed: run `{how}`", pytrace=False)
    return up


def scontrol_job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` of one job (the first record) as a dict."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def job_records(job_id: str, timeout_s: float = 60) -> list[dict[str, str]]:
    """``scontrol show job`` records of ``job_id`` (one per array task) once all have ended.

    Hydra returns when submitit has the results; the SLURM job may still be completing.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
        records = [dict(kv.split("=", 1) for kv in line.split() if "=" in kv) for line in out.stdout.splitlines()]
        if (records and all(r.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for r in records)) \
                or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def array_jobs(submitit_dir: Path) -> list[str]:
    """submitit's per-job folders ``<array job id>_<task id>`` (``<id>/`` holds the batch script)."""
    if not submitit_dir.exists():
        return []
    return sorted(p.name for p in submitit_dir.iterdir() if p.is_dir() and re.fullmatch(r"\d+_\d+", p.name))


def submitit_job_id(sweep: Path) -> str:
    """The SLURM job id of the single (non-array) job of a ``-m`` run in ``sweep``."""
    return next(d.name for d in (sweep / ".submitit").iterdir() if d.is_dir() and d.name.isdigit())


def task_log(sweep: Path, job_id: str, task: int) -> str:
    """stdout and stderr of SLURM task ``task`` of submitit job ``job_id``."""
    return "".join(p.read_text() for p in sorted((sweep / ".submitit" / job_id).glob(f"{job_id}_{task}_log.*")))


def all_task_logs(sweep: Path, tail: int = 3000) -> str:
    return "\n".join(f"== {p}\n{p.read_text()[-tail:]}" for p in sorted((sweep / ".submitit").glob("*/*_log.*")))


def wait_for_rows(metrics: Path, rows: int, alive: Callable[[], bool], timeout_s: float = 180) -> None:
    """Wait until ``metrics`` (metrics.jsonl) holds ``rows`` steps."""
    deadline = time.monotonic() + timeout_s
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert alive() and time.monotonic() < deadline, "the job did not start training"
        time.sleep(0.2)


def release_requeued(job_id: str, alive: Callable[[], bool], timeout_s: float = 120) -> None:
    """Wait until SLURM requeued ``job_id``, then let it start now (SLURM holds a requeued job back
    for about two minutes through its BeginTime). Not in the second of the requeue: slurmd compares
    the new launch credential with the old one's revocation time in whole seconds and would refuse
    it ("Job credential revoked")."""
    deadline = time.monotonic() + timeout_s
    while (info := scontrol_job(job_id)).get("Restarts", "0") == "0" or info.get("JobState") != "PENDING":
        assert alive() and time.monotonic() < deadline, f"job {job_id} was not requeued: {info}"
        time.sleep(0.2)
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=30)


def preempt(job_id: str, alive: Callable[[], bool]) -> None:
    """Send SLURM's warning signal (USR2, as before a time limit or a preemption) to every task of
    ``job_id``, then let its requeued copy start (:func:`release_requeued`)."""
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    release_requeued(job_id, alive)


def losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if line.strip()]
