"""The preemption signal is recorded, not fatal; a requeued job resumes. (The whole path runs on
a real SLURM in tests/test_slurm.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from pipefisher.runtime import preemption


@pytest.fixture(autouse=True)
def _restore_handlers():
    before = signal.getsignal(preemption.PREEMPTION_SIGNAL)
    yield
    preemption.uninstall()
    signal.signal(preemption.PREEMPTION_SIGNAL, before)


def test_signal_is_recorded_and_the_previous_handler_comes_back() -> None:
    seen = []
    signal.signal(preemption.PREEMPTION_SIGNAL, lambda s, f: seen.append(s))
    preemption.install()
    preemption.install()  # idempotent: the saved handler stays the original one
    assert not preemption.requested()
    os.kill(os.getpid(), preemption.PREEMPTION_SIGNAL)
    assert preemption.requested() and seen == []  # recorded, the old handler not called
    preemption.uninstall()
    assert not preemption.requested()
    os.kill(os.getpid(), preemption.PREEMPTION_SIGNAL)
    assert seen == [preemption.PREEMPTION_SIGNAL]


def test_requeued_job_resumes_automatically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert preemption.resume_mode("none", True) == "none"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert preemption.requeued_attempt() == 2
    assert preemption.resume_mode("none", True) == "auto"
    assert preemption.resume_mode("none", False) == "none"  # cluster.requeue=false
    assert preemption.resume_mode("/ckpt/step_4", True) == "/ckpt/step_4"  # an explicit choice stays


def test_requeue_outside_slurm_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert not preemption.in_slurm_job()
    with pytest.raises(preemption.RequeueError, match="not inside a SLURM job"):
        preemption.requeue(3, "/ckpt/step_3")
