"""A failing worker ends the whole job promptly, with its traceback and a non-zero exit; bad
pipeline shapes fail before any worker starts."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp


from pipefisher.launch import launch_workers
from pipefisher.runtime.checkpoint import load_shard
from pipefisher.tracking import read_metrics
from pipefisher.runtime.worker import run_worker
from tests.conftest import compose_train
from tests.dist_harness import train_jobs
from tests.dist_harness import START_METHOD, start_workers

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


def _failing_worker(index: int, delay_s: float) -> None:
    # Worker 0 fails at once the way a peer of a failed worker does; worker 1, the cause, raises later
    # (as a worker still unwinding after its process group closed).
    if index == 0:
        raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")
    time.sleep(delay_s)
    raise ValueError("the root cause, on worker 1")


@pytest.mark.parametrize("delay_s", [0.0, 1.0])
@pytest.mark.slow
def test_the_root_cause_is_raised_not_the_first_peer_to_notice(delay_s: float) -> None:
    from pipefisher.launch import failures

    assert delay_s < failures.FAILURE_GRACE_S
    context = mp.start_processes(_failing_worker, args=(delay_s,), nprocs=2, join=False, start_method=START_METHOD)
    with pytest.raises(mp.ProcessRaisedException) as err:
        while not failures.join_or_raise(context, 0.25):
            pass
    assert err.value.error_index == 1 and "the root cause, on worker 1" in str(err.value)
    assert not any(p.is_alive() for p in context.processes)


def test_world_size_that_does_not_fit_fails_before_training(tmp_path: Path) -> None:
    cfg = compose_train(["stages=2", "num_micro_batches=2"])
    with pytest.raises(ValueError, match="world size 3 does not fit stages=2 x data_parallel=1"):
        run_worker(cfg, rank=0, world_size=3, output_dir=tmp_path)



# --- NaN / inf: stop naming the step, or skip the step's update -----------------------------------
# What the workers do with a non-finite step, not how the launcher ends a job: the two workers run
# train_worker (what train.py's workers run) from the tests' forkserver ([Note: forkserver] in
# tests/dist_harness), not through two spawned processes that import torch again.


def _train(tmp_path: Path, *overrides: str) -> None:
    """The 2-worker run of ``PIPE + overrides`` into ``tmp_path``; a worker's error is raised here
    (``ProcessRaisedException``, as from :func:`launch_workers`)."""
    cfg = compose_train(PIPE + list(overrides))
    start_workers(train_jobs, ([([cfg, cfg], str(tmp_path), False, None)], str(tmp_path)), 2)


def _states_equal(a: object, b: object) -> bool:
    """Nested dicts/lists of tensors equal (NaN never expected here); K-FAC's fold counter
    ``num_updates`` is left out (a refresh whose curvature was dropped still counts)."""
    if isinstance(a, dict):
        keys = {k for k in a if "num_updates" not in str(k)}
        return (isinstance(b, dict) and keys == {k for k in b if "num_updates" not in str(k)}
                and all(_states_equal(a[k], b[k]) for k in keys))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


@pytest.mark.slow
def test_nonfinite_gradients_stop_the_run_naming_the_step(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException) as err:
        _train(tmp_path, "fault.mode=nan", "fault.rank=0", "fault.step=1")
    assert "step 1: the global gradient norm is nan" in str(err.value)
    assert "on_nonfinite=skip" in str(err.value)  # the message names the way out
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["nvlamb", "kfac"])
def test_skipped_step_leaves_model_optimizer_and_kfac_state_unchanged(tmp_path: Path, optimizer: str) -> None:
    # Worker 0 (stage 0) makes its outputs NaN at step 1: loss, every gradient and the K-FAC
    # curvature of both stages are NaN. With on_nonfinite=skip the step changes no parameter, no
    # optimizer moment and no K-FAC factor, and training goes on with finite losses.
    _train(tmp_path, f"optimizer={optimizer}", "on_nonfinite=skip", "fault.mode=nan", "fault.rank=0",
         "fault.step=1", "checkpoint.every_steps=1", "checkpoint.keep_last=0")
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert rows[1].get("skipped") is True and rows[1]["loss"] is None  # NaN is written as null
    assert all(math.isfinite(r["loss"]) and "skipped" not in r for r in rows[:1] + rows[2:])
    for rank in (0, 1):
        before, after = (load_shard(tmp_path / "checkpoints" / f"step_{s}", rank) for s in (0, 1))
        assert _states_equal(before["modules"], after["modules"])
        assert _states_equal(before["optimizer"]["state"], after["optimizer"]["state"])
        assert _states_equal(before["kfac"], after["kfac"])
        assert before["kfac"] or optimizer == "nvlamb"
        changed = load_shard(tmp_path / "checkpoints" / "step_2", rank)
        assert not _states_equal(after["modules"], changed["modules"]), "step 2 must train again"


@pytest.mark.slow
def test_too_many_skipped_steps_in_a_row_stop_the_run(tmp_path: Path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match=r"step 1: .*non-finite steps in a row: 1 \(max_skipped_steps=0\)"):
        _train(tmp_path, "on_nonfinite=skip", "max_skipped_steps=0", "fault.mode=nan", "fault.rank=1",
               "fault.step=1")


def test_schedule_json_of_another_run_is_refused_before_any_worker_starts(tmp_path: Path, monkeypatch) -> None:
    from pipefisher.launch import local
    from pipefisher.schedules import build_schedule
    from pipefisher.schedules.kfac import assignment_to_json, critical_path_assignment

    started = []
    monkeypatch.setattr(local.mp, "start_processes", lambda *a, **k: started.append(a))
    four_stages = assignment_to_json(critical_path_assignment(build_schedule("gpipe", 4, 4), [6, 6, 6, 6], 2),
                                     tmp_path / "plan_d4.json")
    cfg = compose_train(PIPE + ["optimizer=pipefisher", f"optimizer.schedule={four_stages}"])
    with pytest.raises(ValueError, match=r"plan_d4.json: planned for .*\('gpipe', 4, 4, 1\), but this run is "
                                         r"\('gpipe', 2, 2, 1\); re-plan"):
        launch_workers(cfg, tmp_path)
    other_layers = assignment_to_json(critical_path_assignment(build_schedule("gpipe", 2, 2), [12, 12], 2),
                                      tmp_path / "plan_deeper.json")
    cfg = compose_train(PIPE + ["optimizer=pipefisher", f"optimizer.schedule={other_layers}"])
    with pytest.raises(ValueError, match=r"planned for K-FAC layers per stage \[12, 12\], but this run's stages "
                                         r"hold \[6, 6\]; re-plan for this model and partition"):
        launch_workers(cfg, tmp_path)
    assert not started
