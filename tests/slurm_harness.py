"""Helpers of the tests that run real jobs on the local SLURM cluster (tests/test_slurm*.py).

The cluster is the one ``scripts/slurm/start.sh [--nodes N]`` starts (as root; ``.ci/run`` starts
two nodes). What a test that needs it does (:func:`slurm_plan`, issue 40, item 3):

- a cluster with enough nodes up answers: use it;
- SLURM is installed (a ``slurmctld`` binary) but not running, or with too few nodes: as root,
  start it (``start.sh --nodes 2``, once per session: the two nodes every SLURM test can use);
  otherwise fail, naming the command that starts it;
- SLURM is not installed: skip, saying so and how to install it (``sudo scripts/slurm/start.sh``);
  ``python -m pytest -q`` then passes on a machine without SLURM;
- ``PIPEFISHER_SKIP_SLURM=1``: skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
START = "scripts/slurm/start.sh"
# Subprocesses (and the SLURM jobs, which inherit the environment) import this checkout, installed or not.
SUB_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "WANDB_MODE": "offline"}
UP_STATES = ("idle", "mix", "alloc")
#: A tiny two-worker run (two SLURM tasks), as the sweeps of tests/test_slurm*.py submit it.
SWEEP_RUN = ["model=bert-tiny", "stages=2", "num_micro_batches=2", "micro_batch_size=2", "data.seq_len=32",
             "progress=false", "device=cpu", "wandb.mode=offline", "hydra.launcher.timeout_min=5"]


#: Nodes a test session starts (``.ci/run`` starts as many): every SLURM test runs on them.
START_NODES = 2
# Where Debian puts the daemons, which a non-root PATH may leave out.
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")
_start_failed: dict[int, str] = {}  # nodes asked of start.sh this session -> why it failed (not retried)


@dataclass(frozen=True)
class SlurmState:
    """What the harness sees of SLURM on this machine."""

    skip_requested: bool  # PIPEFISHER_SKIP_SLURM=1
    installed: bool  # a slurmctld binary exists
    nodes: dict[str, str] | None  # sinfo's {node: state}, None when no controller answered
    root: bool  # this process may run start.sh

    @property
    def up(self) -> int:
        return sum(state in UP_STATES for state in (self.nodes or {}).values())


def slurm_plan(state: SlurmState, min_nodes: int = 1) -> tuple[str, str]:
    """What a test that needs ``min_nodes`` SLURM nodes does: ``("use" | "start" | "skip" | "fail",
    the reason, one line naming the fix)``."""
    if state.skip_requested:
        return "skip", "PIPEFISHER_SKIP_SLURM=1"
    if state.nodes is not None and state.up >= min_nodes:
        return "use", f"{state.up} SLURM node(s) up"
    how = f"sudo {START}" + (f" --nodes {max(min_nodes, START_NODES)}" if max(min_nodes, START_NODES) > 1 else "")
    seen = (f"{state.up} SLURM node(s) up ({state.nodes or 'none'}), {min_nodes} needed" if state.nodes is not None
            else "the SLURM controller does not answer")
    if not state.installed:
        if state.nodes is not None:  # a controller elsewhere (a cluster's login node) with too few nodes
            return "fail", f"{seen}: run the tests where {min_nodes} node(s) are up"
        return "skip", (f"SLURM is not installed (no slurmctld): `{how}` installs and starts a local cluster "
                        f"of {max(min_nodes, START_NODES)} nodes for these tests")
    if state.root:
        return "start", f"{seen}: starting it with `{START} --nodes {max(min_nodes, START_NODES)}`"
    return "fail", f"{seen}: run `{how}` (as root), or set PIPEFISHER_SKIP_SLURM=1"


def _sinfo() -> dict[str, str] | None:
    """``{node: state}`` as ``sinfo -N`` reports them, or None when no controller answers."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode:
        return None
    return dict(line.split() for line in out.stdout.splitlines() if line.strip())


def slurm_state() -> SlurmState:
    """This machine's :class:`SlurmState` (asks ``sinfo`` unless the tests are told to skip SLURM)."""
    skip = os.environ.get("PIPEFISHER_SKIP_SLURM") == "1"
    sbin = os.pathsep.join([os.environ.get("PATH", ""), *_SBIN])
    return SlurmState(skip_requested=skip, installed=shutil.which("slurmctld", path=sbin) is not None,
                      nodes=None if skip else _sinfo(), root=os.geteuid() == 0)


def _start(nodes: int, script: Path) -> str:
    """Run ``script --nodes nodes`` (idempotent); "" when it worked, else the reason. A start that
    failed is not tried again in this session: every later test fails at once with its reason."""
    if nodes in _start_failed:
        return _start_failed[nodes]
    try:
        done = subprocess.run([str(script), "--nodes", str(nodes)], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        _start_failed[nodes] = str(e)
        return _start_failed[nodes]
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        _start_failed[nodes] = f"exit status {done.returncode}: {' | '.join(tail)}"
        return _start_failed[nodes]
    return ""


def slurm_nodes(min_nodes: int = 1, script: Path = REPO / START) -> dict[str, str]:
    """``{node: state}`` as ``sinfo -N`` reports them, after starting the cluster where
    :func:`slurm_plan` says so; skips or fails the test (one line) where it says so."""
    state = slurm_state()
    action, why = slurm_plan(state, min_nodes)
    if action == "skip":
        pytest.skip(why)
    if action == "fail":
        pytest.fail(why, pytrace=False)
    if action == "start":
        failed = _start(max(min_nodes, START_NODES), script)
        state = slurm_state()
        if failed or state.up < min_nodes:
            pytest.fail(f"{why}, which did not bring {min_nodes} node(s) up ({failed or state.nodes}); "
                        f"see /var/log/slurm/", pytrace=False)
    return dict(state.nodes or {})


def require_slurm(min_nodes: int = 1) -> list[str]:
    """The up nodes of the SLURM cluster (at least ``min_nodes``), in ``sinfo`` order; starts,
    skips or fails as :func:`slurm_nodes` does, and fails (not skips) when there are fewer. A node
    still completing an earlier test's job ("comp") is waited for, up to a minute: that state
    passes by itself."""
    nodes = slurm_nodes(min_nodes)
    deadline = time.monotonic() + 60
    while any(state.startswith("comp") for state in nodes.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = _sinfo() or {}
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


@dataclass(frozen=True)
class SweepRun:
    """A finished ``train.py -m cluster=slurm`` sweep: its folder (``<cwd>/sweep``), the launcher's
    exit status and its output (stdout and stderr)."""

    dir: Path
    returncode: int
    output: str


_sweeps: dict[tuple[str, ...], SweepRun] = {}


def shared_sweep(tmp_path_factory: pytest.TempPathFactory, *overrides: str, timeout_s: float = 240) -> SweepRun:
    """``train.py -m cluster=slurm SWEEP_RUN overrides``, run once per test session and shared by
    the tests that inspect the same sweep (e.g. the job array that tests/test_slurm.py checks and
    the progress lines that tests/test_slurm_sweep.py checks); the launcher runs in the sweep
    folder's parent, so that it names the task logs ``sweep/.submitit/<job id>/``."""
    if overrides not in _sweeps:
        sweep = tmp_path_factory.mktemp("shared-sweep") / "sweep"
        cmd = [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *SWEEP_RUN, *overrides,
               f"hydra.sweep.dir={sweep}"]
        log = Path(f"{sweep}.log")
        with log.open("w") as out:
            proc = subprocess.Popen(cmd, cwd=sweep.parent, env=SUB_ENV, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            ids = sorted({d.split("_")[0] for d in array_jobs(sweep / ".submitit")})
            if ids:
                subprocess.run(["scancel", *ids], check=False, timeout=30)
        _sweeps[overrides] = SweepRun(sweep, proc.returncode, log.read_text())
    return _sweeps[overrides]
