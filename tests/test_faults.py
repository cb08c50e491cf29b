"""A failing worker ends the whole job promptly, with its traceback and a non-zero exit; bad
pipeline shapes fail before any worker starts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from pipefisher.launch import launch_workers
from pipefisher.runtime.worker import run_worker
from tests.conftest import compose_train

PIPE = ["stages=2", "num_micro_batches=2", "steps=4", "data.seq_len=16", "cluster.worker_timeout_s=20"]


def _run(tmp_path: Path, *overrides: str) -> float:
    cfg = compose_train(PIPE + list(overrides))
    start = time.monotonic()
    launch_workers(cfg, tmp_path)
    return time.monotonic() - start


@pytest.mark.slow
def test_exception_in_one_worker_ends_the_job_with_its_traceback(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as err:
        _run(tmp_path, "fault.mode=raise", "fault.rank=1", "fault.step=1")
    assert "injected fault on worker 1 at step 1" in str(err.value)
    assert "Traceback" in str(err.value) and "inject_fault" in str(err.value)
    assert time.monotonic() - start < 120, "the job must not wait for the peer's timeout"


@pytest.mark.slow
def test_killed_worker_ends_the_job(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with signal SIGKILL"):
        _run(tmp_path, "fault.mode=kill", "fault.rank=0", "fault.step=1")


@pytest.mark.slow
def test_stalled_worker_is_caught_by_the_process_group_timeout(tmp_path: Path) -> None:
    # Worker 1 sleeps forever; worker 0's receive times out after cluster.worker_timeout_s and
    # the launcher then terminates the sleeper.
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as err:
        _run(tmp_path, "fault.mode=stall", "fault.rank=1", "fault.step=1", "cluster.worker_timeout_s=5")
    assert "Process 0" in str(err.value)
    assert time.monotonic() - start < 120


def test_world_size_that_does_not_fit_fails_before_training(tmp_path: Path) -> None:
    cfg = compose_train(["stages=2", "num_micro_batches=2"])
    with pytest.raises(ValueError, match="world size 3 does not fit stages=2 x data_parallel=1"):
        run_worker(cfg, rank=0, world_size=3, output_dir=tmp_path)

