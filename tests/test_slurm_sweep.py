"""``train.py -m cluster=slurm`` as a user sees it (issue 24): progress, Ctrl-C, one-line refusals.

The helpers are tested without a cluster; the tests marked slow run sweeps on the local SLURM
(``sudo scripts/slurm/start.sh``; see tests/test_slurm.py), which keeps no accounting.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipefisher.launch import sweep
from pipefisher.launch.sweep import Run, SqueueWatcher, latest_step, progress_line
from tests.slurm_harness import REPO, SUB_ENV, SWEEP_RUN, all_task_logs, require_slurm, shared_sweep

RUN = SWEEP_RUN


def _metrics(folder: Path, steps: int, tail: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(steps))
    (folder / "metrics.jsonl").write_text(rows + tail)


# --- helpers, without a cluster ----------------------------------------------------------------------


def test_latest_step_skips_a_half_written_last_line(tmp_path: Path) -> None:
    _metrics(tmp_path, 3, tail='{"step": 3, "lo')
    assert latest_step(tmp_path / "metrics.jsonl") == 2
    assert latest_step(tmp_path / "missing.jsonl") is None


def test_progress_line_counts_jobs_and_shows_the_steps_of_running_ones(tmp_path: Path) -> None:
    runs = [Run(n, (f"pipeline={m}",), tmp_path / str(n), 5) for n, m in enumerate(["gpipe", "1f1b", "chimera"])]
    _metrics(runs[1].folder, 3)
    _metrics(runs[2].folder, 5)  # done: its steps are not shown
    assert progress_line(["pending", "running", "done"], runs) == \
        "SLURM jobs: 1 pending, 1 running, 1 done of 3; steps: #1 3/5"
    assert progress_line(["pending"] * 3, runs) == "SLURM jobs: 3 pending, 0 running, 0 done of 3"


def test_squeue_watcher_reads_states_and_counts_unlisted_jobs_as_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    watcher = SqueueWatcher(delay_s=10)
    for job in ("7_0", "7_1", "8"):
        watcher.register_job(job)
    assert watcher._make_command() == ["squeue", "-h", "-r", "--states=all", "-o", "%i|%T", "-j", "7,8"]
    listed = subprocess.CompletedProcess([], 0, stdout="7_0|RUNNING\n7_1|CANCELLED\n", stderr="")
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: listed)
    watcher.update()
    assert [watcher.get_state(j, mode="cache") for j in ("7_0", "7_1", "8")] == ["RUNNING", "CANCELLED", "ENDED"]
    assert watcher.is_done("7_1", mode="cache") and watcher.is_done("8", mode="cache")
    assert not watcher.is_done("7_0", mode="cache")


def test_cancel_scancels_the_unfinished_jobs_and_names_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def job(job_id: str, finished: bool) -> SimpleNamespace:
        folder = tmp_path / ".submitit" / job_id
        folder.mkdir(parents=True)
        if finished:
            (folder / "result.pkl").touch()
        return SimpleNamespace(job_id=job_id, _sub_jobs=[], paths=SimpleNamespace(folder=folder,
                                                                                  result_pickle=folder / "result.pkl"))

    jobs = [job("7_0", False), job("7_1", True), job("7_2", False)]
    runs = [Run(n, ("steps=5", f"pipeline={m}"), None, 5) for n, m in enumerate(["gpipe", "1f1b", "chimera"])]
    called, said = [], []
    monkeypatch.setattr(sweep.subprocess, "run", lambda cmd, **k: called.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, "", ""))
    sweep.cancel(jobs, runs, signal.SIGTERM, say=said.append)
    assert called == [["scancel", "7_0", "7_2"]]
    assert said == [f"got SIGTERM: cancelled 2 of 3 SLURM jobs: 7_0 (#0 pipeline=gpipe), 7_2 (#2 pipeline=chimera); "
                    f"task logs in {tmp_path / '.submitit'}/<job id>/"]
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # restored


def _refused(tmp_path: Path, *args: str) -> str:
    """stderr of a ``train.py`` command that must fail in one line, leaving ``tmp_path`` empty."""
    env = {k: v for k, v in SUB_ENV.items() if not k.startswith("SLURM_")}
    res = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())
    return res.stderr.strip()


@pytest.mark.slow
def test_cluster_slurm_without_multirun_is_refused_in_one_line(tmp_path: Path) -> None:
    assert _refused(tmp_path, "cluster=slurm", "steps=2") == (
        "train.py: cluster=slurm submits to SLURM only with -m: python train.py -m cluster=slurm steps=2 "
        "(without cluster=slurm the run trains on this machine)")


@pytest.mark.slow
def test_nodes_that_do_not_divide_the_workers_are_refused_in_one_line(tmp_path: Path) -> None:
    assert _refused(tmp_path, "-m", "cluster=slurm", "cluster.nodes=2", "stages=3") == (
        "train.py: cluster.nodes=2: stages*data_parallel*sdp*tp=3*1*1*1=3 processes (one SLURM task each) must "
        "split evenly over the nodes; use one of [1, 3]")


@pytest.mark.slow
def test_cluster_slurm_without_sbatch_or_srun_is_refused_in_one_line(tmp_path: Path) -> None:
    # A machine without SLURM (PATH holds only the interpreter's folder): submitit would print a
    # 30-line traceback ending in 'Could not detect "srun"' (issue 38, defect 3).
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {k: v for k, v in SUB_ENV.items() if not k.startswith("SLURM_")}
    res = subprocess.run([sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", "device=cpu", "steps=2"],
                         cwd=run_dir,
                         env={**env, "PATH": str(bare)}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr and "Could not detect" not in res.stderr and not list(run_dir.iterdir())
    assert res.stderr.strip() == (
        "train.py: cluster=slurm submits with SLURM's sbatch and srun, but sbatch and srun are not on PATH; run it "
        "on a SLURM login node (or add SLURM's bin folder to PATH), or leave out cluster=slurm to train on this "
        "machine")


def test_missing_slurm_commands_names_only_those_not_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipefisher.launch.slurm import missing_slurm_commands

    fake = tmp_path / "slurm-bin"
    fake.mkdir()
    (fake / "sbatch").write_text("#!/bin/sh\n")
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", str(fake))
    assert missing_slurm_commands() == ["srun"]
    (fake / "srun").write_text("#!/bin/sh\n")
    (fake / "srun").chmod(0o755)
    assert missing_slurm_commands() == []


# --- a real SLURM cluster ----------------------------------------------------------------------------


def _start(sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    """``train.py -m cluster=slurm RUN overrides`` with its output in ``<sweep_dir>.log``."""
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", *RUN, *overrides,
           f"hydra.sweep.dir={sweep_dir}"]
    with open(f"{sweep_dir}.log", "w") as out:
        return subprocess.Popen(cmd, cwd=sweep_dir.parent, env=SUB_ENV, stdout=out, stderr=subprocess.STDOUT)


def _output(sweep_dir: Path) -> str:
    return Path(f"{sweep_dir}.log").read_text()


def _queued(job_ids: list[str]) -> dict[str, str]:
    """``{job id: state}`` of those of ``job_ids`` that squeue lists as pending or running."""
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(job_ids)], capture_output=True,
                         text=True, timeout=30).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def _job_ids(sweep_dir: Path, timeout_s: float = 60) -> list[str]:
    """The job ids of the launcher's ``submitted SLURM jobs …`` line."""
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(r"submitted SLURM jobs? (\S+(?:, \S+)*); task logs in", _output(sweep_dir))):
        assert time.monotonic() < deadline, _output(sweep_dir)
        time.sleep(0.2)
    return found.group(1).split(", ")


def _stop(proc: subprocess.Popen, job_ids: list[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if job_ids:
        subprocess.run(["scancel", *job_ids], check=False, timeout=30)


@pytest.mark.slow
def test_sweep_says_where_the_logs_are_and_its_progress_without_sacct_noise(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # The sweep is shared with tests/test_slurm.py, which checks its job array and tasks.
    require_slurm()
    run = shared_sweep(tmp_path_factory, "pipeline=gpipe,chimera", "steps=3")
    sweep_dir, out = run.dir, run.output
    assert run.returncode == 0, f"{out[-3000:]}\n{all_task_logs(sweep_dir)}"
    found = re.search(r"submitted SLURM jobs? (\S+(?:, \S+)*); task logs in", out)
    assert found, out[-3000:]
    job_ids = found.group(1).split(", ")
    assert "Bypassing sacct error" not in out and out.count("accounting storage is disabled") == 1, out
    assert "this SLURM keeps no job accounting (Slurm accounting storage is disabled): job states come from squeue" \
        in out
    array = job_ids[0].split("_")[0]
    assert job_ids == [f"{array}_0", f"{array}_1"]
    assert "task logs in sweep/.submitit/<job id>/" in out, out
    lines = re.findall(r"SLURM jobs: .*", out)
    assert lines[-1] == "SLURM jobs: 0 pending, 0 running, 2 done of 2", lines
    assert all(json.loads(r)["step"] == i for i, r in enumerate((sweep_dir / "0" / "metrics.jsonl").read_text()
                                                                 .splitlines()))


@pytest.mark.slow
def test_ctrl_c_cancels_the_sweeps_slurm_jobs_and_names_them(tmp_path: Path) -> None:
    # A sweep of two long runs: once both train (squeue: RUNNING, and a progress line shows their
    # steps), SIGINT to the launcher cancels both jobs; they leave squeue within seconds (SLURM's
    # KillWait), and the launcher names them and their logs, exits with 130, without a traceback.
    # cluster.progress_every_s=2: the launcher reads squeue and says the steps every 2 s, not 10.
    require_slurm()
    sweep_dir = tmp_path / "sweep"
    proc = _start(sweep_dir, "pipeline=gpipe,chimera", "steps=100000", "cluster.progress_every_s=2")
    job_ids: list[str] = []
    try:
        job_ids = _job_ids(sweep_dir)
        deadline = time.monotonic() + 180
        while not (set(_queued(job_ids).values()) == {"RUNNING"}
                   and re.search(r"; steps: #0 \d+/100000, #1 \d+/100000", _output(sweep_dir))):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{_output(sweep_dir)[-3000:]}\n{all_task_logs(sweep_dir)}"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert proc.wait(timeout=60) == 128 + signal.SIGINT, _output(sweep_dir)
        while _queued(job_ids):
            assert time.monotonic() - sent < 20, _queued(job_ids)
            time.sleep(0.5)
        print(f"jobs left squeue {time.monotonic() - sent:.1f} s after SIGINT")
    finally:
        _stop(proc, job_ids)
    out = _output(sweep_dir)
    assert (f"got SIGINT: cancelled 2 of 2 SLURM jobs: {job_ids[0]} (#0 pipeline=gpipe), "
            f"{job_ids[1]} (#1 pipeline=chimera); task logs in sweep/.submitit/<job id>/") in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "job states come from squeue every 2 s" in out, out
    assert os.path.isdir(sweep_dir / ".submitit" / job_ids[0])
