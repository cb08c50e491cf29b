"""Ctrl-C and SIGTERM stop a pipeline run promptly and cleanly (issue 16, item 3): every worker
stops, the launcher names the step and the last checkpoint and exits with 130 or 143, nothing
is left running, and a checkpoint saved on the way out is one ``resume=auto`` continues from.

The end-to-end tests run ``train.py`` as a user does, in a subprocess, and signal it while it
trains (see [Note: Ctrl-C and SIGTERM to the launcher] in ``pipefisher.launch.local``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipefisher.runtime import preemption
from pipefisher.tracking import read_metrics
from tests.conftest import REPO, TINY

# Long enough never to finish while the test runs; 1F1B over two workers, two micro-batches.
RUN = ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "cluster.worker_timeout_s=120", *TINY]
STOP_TIMEOUT_S = 60  # "promptly": generous, the machine may be busy (tiny steps take milliseconds)
START_TIMEOUT_S = 240  # until the first step's metrics row (interpreter and torch start-up, niced)


def _start(run_dir: Path, *overrides: str, new_session: bool = False,
           run: list[str] = RUN, wandb_mode: str = "disabled") -> tuple[subprocess.Popen, Path]:
    log = run_dir.with_suffix(".log")
    env = {**os.environ, "WANDB_MODE": wandb_mode, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "train.py", *run, "steps=100000", *overrides,
                                 f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=new_session)
    return proc, log


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, log: Path, step: int = 0) -> None:
    """Wait until rank 0 wrote the metrics row of ``step``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"train.py ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        if metrics.is_file() and any(r.get("step", -1) >= step for r in read_metrics(metrics)):
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no metrics row for step {step} after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (workers, the resource tracker, their helpers)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += sorted(children - found)
            found |= children
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return not re.search(r"^State:\s+Z", status, re.M)


def _stop(proc: subprocess.Popen, log: Path, send: Callable[[], None], workers: int = 2) -> tuple[int, str, set[int]]:
    """Send a signal with ``send()``; return the exit status, the output and the processes that
    were below the launcher before the signal."""
    below = _descendants(proc.pid)
    assert len(below) >= workers, f"expected {workers} workers below the launcher, found {below}"
    send()
    try:
        code = proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in below | {proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"train.py still ran {STOP_TIMEOUT_S} s after the signal:\n{log.read_text()[-3000:]}")
    return code, log.read_text(), below


def _assert_nothing_left(below: set[int]) -> None:
    deadline = time.monotonic() + 10  # the resource tracker leaves when it sees the launcher gone
    while time.monotonic() < deadline and any(_running(p) for p in below):
        time.sleep(0.2)
    left = {p: Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ") for p in below if _running(p)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the launcher: {left}"


# --- the recording of signals, without processes --------------------------------------------------


def _interrupt_checkpoint(out: str) -> tuple[int, Path]:
    """(step, folder) of the checkpoint an interrupted train.py names in its last words."""
    found = re.search(r"interrupted at step (\d+); last checkpoint: (\S+)", out)
    assert found, out[-3000:]
    return int(found.group(1)), Path(found.group(2))


def _assert_resume_continues(run_dir: Path, run: list[str], step: int) -> None:
    """``train.py <run> resume=auto`` in the same run directory continues after ``step`` and finishes."""
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    again = subprocess.run([sys.executable, "train.py", *run, f"steps={step + 3}", "resume=auto",
                            f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=START_TIMEOUT_S)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"continuing at step {step + 1}" in again.stdout + again.stderr
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")][-3:] == [step, step + 1, step + 2]


@pytest.fixture()
def _restore_handlers():
    before = {s: signal.getsignal(s) for s in preemption.INTERRUPT_SIGNALS}
    yield
    preemption.uninstall()
    for s, h in before.items():
        signal.signal(s, h)


@pytest.mark.usefixtures("_restore_handlers")
@pytest.mark.parametrize("inherited", [signal.default_int_handler, signal.SIG_IGN],
                         ids=["sigint-default", "sigint-ignored"])
def test_interrupt_signals_are_recorded_and_a_second_one_says_stop_now(inherited) -> None:
    # Whatever SIGINT's disposition was when the process started (SIG_IGN under nohup, a script's
    # background job, some CI runners), install() records it and uninstall() puts that back.
    saved = signal.signal(signal.SIGINT, inherited)
    try:
        _record_then_restore(inherited)
    finally:
        signal.signal(signal.SIGINT, saved)


def _record_then_restore(inherited) -> None:
    preemption.install(preemption.INTERRUPT_SIGNALS)
    assert not preemption.interrupted() and preemption.received() is None
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.requested() and preemption.interrupted() and not preemption.repeated()
    assert preemption.received() == signal.SIGTERM
    assert preemption.exit_code(preemption.received()) == 143
    os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: the launcher kills the workers at once
    assert preemption.repeated() and preemption.received() == signal.SIGTERM
    assert preemption.exit_code(signal.SIGINT) == 130
    preemption.uninstall()
    assert not preemption.interrupted() and signal.getsignal(signal.SIGINT) is inherited


def test_a_worker_started_meanwhile_ignores_sigint_until_it_records_it() -> None:
    probe = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    before = signal.getsignal(signal.SIGINT)
    with preemption.interrupts_ignored_by_children():
        child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "True"
    assert signal.getsignal(signal.SIGINT) is before


# --- train.py, signalled while it trains ----------------------------------------------------------


@pytest.mark.slow
def test_sigint_to_the_launcher_stops_every_worker_and_exits_130(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir)
    _wait_for_step(proc, run_dir, log)
    code, out, below = _stop(proc, log, lambda: os.kill(proc.pid, signal.SIGINT))
    assert code == 130, out[-3000:]
    assert re.search(r"interrupted at step \d+; last checkpoint: none", out), out[-3000:]
    assert "stop signal: stopped after step" in out  # the workers agreed, not killed after the grace period
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    _assert_nothing_left(below)


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_every_worker_and_exits_130(tmp_path: Path) -> None:
    # Ctrl-C in a terminal signals the whole foreground process group: launcher and workers at once.
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, new_session=True)
    _wait_for_step(proc, run_dir, log)
    code, out, below = _stop(proc, log, lambda: os.killpg(proc.pid, signal.SIGINT))
    assert code == 130, out[-3000:]
    assert re.search(r"interrupted at step \d+; last checkpoint: none", out), out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    _assert_nothing_left(below)


@pytest.mark.slow
def test_sigterm_with_checkpointing_on_saves_the_stop_step_and_exits_143(tmp_path: Path) -> None:
    # The saved step is one resume=auto continues from: the checkpoint is written by the same
    # save_checkpoint as the on_stop_after_s one of the process-group test below, which resumes it.
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "checkpoint.every_steps=100000")
    _wait_for_step(proc, run_dir, log)
    code, out, below = _stop(proc, log, lambda: os.kill(proc.pid, signal.SIGTERM))
    assert code == 143, out[-3000:]
    step, folder = _interrupt_checkpoint(out)
    assert folder == run_dir / "checkpoints" / f"step_{step}" and (folder / "manifest.json").is_file()
    assert read_metrics(run_dir / "metrics.jsonl")[-1]["step"] == step
    _assert_nothing_left(below)


@pytest.mark.slow
def test_a_second_sigint_kills_workers_that_do_not_reach_the_step_end(tmp_path: Path) -> None:
    # Worker 1 hangs in step 2, so the workers never agree to stop; the second signal ends them.
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "fault.mode=stall", "fault.rank=1", "fault.step=2")
    _wait_for_step(proc, run_dir, log, step=1)
    time.sleep(1)  # worker 1 is in its stall now

    def twice() -> None:
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1)
        os.kill(proc.pid, signal.SIGINT)

    code, out, below = _stop(proc, log, twice)
    assert code == 130, out[-3000:]
    assert "stopping the workers now (second signal)" in out, out[-3000:]
    assert "interrupted at step 1; last checkpoint: none" in out, out[-3000:]
    _assert_nothing_left(below)


@pytest.mark.slow
def test_sigterm_to_single_process_training_exits_143_naming_the_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, run=list(TINY))  # stages=1: trains in the launcher process itself
    _wait_for_step(proc, run_dir, log)
    code, out, below = _stop(proc, log, lambda: os.kill(proc.pid, signal.SIGTERM), workers=0)
    assert code == 143, out[-3000:]
    assert re.search(r"interrupted at step \d+; last checkpoint: none", out), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    _assert_nothing_left(below)


def test_stop_grace_default_and_bad_values() -> None:
    from pipefisher.config import ConfigError
    from pipefisher.launch.local import STOP_GRACE_S as DEFAULT
    from tests.conftest import compose_train

    assert compose_train([]).cluster.stop_grace_s == DEFAULT == 20.0
    with pytest.raises(ConfigError, match=r"cluster.stop_grace_s.*> 0"):
        compose_train(["cluster.stop_grace_s=0"])


STOP_GRACE_S = 8.0  # the grace-period test's cluster.stop_grace_s (tiny steps: 3 of them stay below it)


@pytest.mark.slow
def test_workers_that_do_not_reach_the_step_end_are_killed_after_the_grace_period(tmp_path: Path) -> None:
    # One SIGINT, and worker 1 hangs in step 2: the launcher waits cluster.stop_grace_s (8 s here, its
    # default 20 s: test_stop_grace_default_and_bad_values), then kills both.
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "fault.mode=stall", "fault.rank=1", "fault.step=2", f"cluster.stop_grace_s={STOP_GRACE_S:g}")
    _wait_for_step(proc, run_dir, log, step=1)
    time.sleep(1)
    below = _descendants(proc.pid)
    os.kill(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=STOP_GRACE_S + STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for pid in below | {proc.pid}:
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"train.py still ran {STOP_GRACE_S + STOP_TIMEOUT_S} s after SIGINT:\n{log.read_text()[-3000:]}")
    out = log.read_text()
    assert code == 130, out[-3000:]
    assert f"stopping the workers now (still running {STOP_GRACE_S:.0f} s after SIGINT)" in out, out[-3000:]
    assert "interrupted at step 1; last checkpoint: none" in out, out[-3000:]
    _assert_nothing_left(below)


@pytest.mark.slow
@pytest.mark.parametrize("wandb_mode", ["disabled", "offline"])
def test_sigterm_to_the_process_group_checkpoints_exits_143_and_resume_auto_continues(tmp_path: Path,
                                                                                       wandb_mode: str) -> None:
    # `timeout`, `kill -- -PGID` and job managers signal every process of the group: the workers (and
    # wandb's service) get SIGTERM directly, and must stop with the launcher after the agreed step
    # (issue 40, item 2). on_stop_after_s=0: a run that trained long enough to save on a stop. The
    # resume runs once, after the `disabled` case: its command (RUN, wandb disabled) is the same for both.
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "checkpoint.on_stop_after_s=0", f"wandb.mode={wandb_mode}", new_session=True,
                       wandb_mode=wandb_mode)
    _wait_for_step(proc, run_dir, log)
    code, out, below = _stop(proc, log, lambda: os.killpg(proc.pid, signal.SIGTERM))
    assert code == 143, out[-3000:]
    assert "ended with an error while stopping" not in out and "Traceback" not in out, out[-3000:]
    assert "stop signal: stopped after step" in out, out[-3000:]  # the workers agreed on the step
    step, folder = _interrupt_checkpoint(out)
    assert folder == run_dir / "checkpoints" / f"step_{step}" and (folder / "manifest.json").is_file()
    _assert_nothing_left(below)
    if wandb_mode == "disabled":
        _assert_resume_continues(run_dir, RUN, step)


@pytest.mark.slow
def test_sigterm_to_one_worker_alone_stops_the_run_together_and_exits_143(tmp_path: Path) -> None:
    # `kill <worker pid>`: the signalled worker takes part in the agreed stop; the launcher, which got
    # no signal, learns of the stop from rank 0's preempted.json and ends as after its own SIGTERM.
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "checkpoint.on_stop_after_s=0")
    _wait_for_step(proc, run_dir, log)
    worker = min(p for p in _descendants(proc.pid)
                 if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text())  # a spawned worker
    code, out, below = _stop(proc, log, lambda: os.kill(worker, signal.SIGTERM))
    assert code == 143, out[-3000:]
    assert "a worker got a stop signal: the workers stopped together" in out, out[-3000:]
    step, folder = _interrupt_checkpoint(out)
    assert folder == run_dir / "checkpoints" / f"step_{step}" and (folder / "manifest.json").is_file()
    _assert_nothing_left(below)
