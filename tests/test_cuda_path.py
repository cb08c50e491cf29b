"""CUDA-path defects that a CPU can still catch (issue 25): who chooses a GPU, and when."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.launch import launch_workers
from pipefisher.launch import local as local_launch
from pipefisher.launch.gpus import GpuRequestError, check_gpu_request, signal_delay_note
from pipefisher.runtime.build import kfac_assignment, schedule_for
from pipefisher.runtime.device import device_type, resolve_device
from pipefisher.runtime.worker import run_worker
from pipefisher.tracking import read_metrics
from tests import cuda_standin
from tests.conftest import REPO, compose_train
from tests.dist_harness import START_METHOD


@pytest.fixture
def four_gpus(monkeypatch):
    """A stand-in for a node with 4 GPUs that records every ``torch.cuda.set_device`` call."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(int(index)))
    return calls


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_planning_pipefishers_work_chooses_no_gpu(four_gpus, device) -> None:
    """Defect 1: ``kfac_assignment`` called ``resolve_device(cfg.device)`` without the local rank, which
    moved every worker to cuda:0 after it had chosen its own GPU."""
    cfg = compose_train(["optimizer=pipefisher", "stages=2", "num_micro_batches=4", f"device={device}"])
    assignment = kfac_assignment(cfg, schedule_for(cfg))
    assert assignment.interval >= 1
    assert four_gpus == []  # only the worker's own resolve_device(cfg.device, local_rank) may choose


def test_device_type_follows_the_device_setting(four_gpus, monkeypatch) -> None:
    assert device_type("cuda") == device_type("auto") == "cuda"
    assert device_type("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_type("auto") == "cpu"
    assert four_gpus == []


# --------------------------------------------------------------------------------------------
# A whole worker lifecycle on a stand-in node of 4 GPUs (tests/cuda_standin.py)
# --------------------------------------------------------------------------------------------

LIFECYCLE = ["optimizer=pipefisher", "pipeline=1f1b", "stages=4", "num_micro_batches=4", "device=auto",
             "model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
             "data.seq_len=16", "data.max_predictions=3", "steps=4", "checkpoint.every_steps=1",
             "cluster.worker_timeout_s=120"]
PREEMPT_AFTER = 1  # rank 0 gets SLURM's warning during step 1: all stop, save and requeue after it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lifecycle_worker(local_rank: int, cfg: TrainConfig, out_dir: str, ports: list[int]) -> None:
    """One worker of a SLURM job on a node of 4 stand-in GPUs: train, get preempted after step 1
    (checkpoint, requeue), then run as the requeued job (resume) to the end."""
    torch.set_num_threads(1)
    from pipefisher.runtime import preemption
    from pipefisher.runtime.worker import run_worker

    os.environ.update(MASTER_ADDR="127.0.0.1", SLURM_JOB_ID="4242")
    requeued: list[str] = []
    preemption._requeue = requeued.append  # scontrol's stand-in: record instead of requeueing
    polls = itertools.count()
    preemption.requested = lambda: local_rank == 0 and next(polls) >= PREEMPT_AFTER
    results = []
    with cuda_standin.install(4) as cuda:
        for attempt, port in enumerate(ports):
            os.environ.update(MASTER_PORT=str(port), SLURM_RESTART_COUNT=str(attempt))
            if attempt:
                preemption.requested = lambda: False
            result = run_worker(cfg, local_rank, 4, out_dir, local_rank=local_rank, local_world_size=4,
                                requeue_here=True)
            results.append({k: result.get(k) for k in ("step", "preempted")})
    Path(out_dir, f"standin_rank{local_rank}.json").write_text(json.dumps(
        {"calls": cuda.calls, "backends": cuda.backends, "requeued": requeued, "results": results}))


@pytest.fixture(scope="module")
def standin_lifecycle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    """Ranks 0..3 of one node through build, PipeFisher planning, steps, checkpoints, preemption
    with requeue, and the requeued job's resume; per rank what its stand-in recorded."""
    out = tmp_path_factory.mktemp("standin")
    with cuda_standin.install(4):  # device=auto composes to a CUDA run only where CUDA is visible
        cfg = compose_train(LIFECYCLE)
    mp.start_processes(_lifecycle_worker, args=(cfg, str(out), [_free_port(), _free_port()]), nprocs=4,
                       join=True, start_method="spawn")
    return out, {r: json.loads((out / f"standin_rank{r}.json").read_text()) for r in range(4)}


@pytest.mark.slow
def test_every_local_rank_touches_only_its_own_gpu_through_a_whole_lifecycle(standin_lifecycle) -> None:
    """Defect 1 and its consequences: each rank's set_device, tensors, stream events, syncs, memory
    statistics, generator state and NCCL object collectives all target cuda:<local rank>."""
    _, ranks = standin_lifecycle
    for rank, seen in ranks.items():
        calls = [tuple(c) for c in seen["calls"]]
        assert [d for what, d in calls if what == "set_device"] == [rank, rank]  # once per attempt
        assert {d for _, d in calls} == {rank}, sorted({c for c in calls if c[1] != rank})
        assert seen["backends"] == ["nccl", "nccl"]
        kinds = {what for what, _ in calls}
        for kind in ("tensor:_parse_to", "event.record", "stream.synchronize", "synchronize",
                     "max_memory_allocated", "get_rng_state", "set_rng_state", "pin_memory",
                     "dist.gather_object", "dist.all_gather_object", "dist.broadcast_object_list", "dist.barrier"):
            assert kind in kinds, f"rank {rank} never made a {kind} call: the lifecycle missed a path"


@pytest.mark.slow
def test_standin_lifecycle_checkpoints_requeues_and_resumes(standin_lifecycle) -> None:
    out, ranks = standin_lifecycle
    for seen in ranks.values():  # stopped after step 1; the requeued attempt ran steps 2 and 3
        assert seen["results"] == [{"step": 1, "preempted": True}, {"step": 3, "preempted": None}]
    assert len(ranks[0]["requeued"]) == 1 and "after step 1" in ranks[0]["requeued"][0]
    assert all(not ranks[r]["requeued"] for r in (1, 2, 3))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_3"]  # keep_last=2


# --------------------------------------------------------------------------------------------
# Refusals before any worker starts, each one line naming the fix
# --------------------------------------------------------------------------------------------


@pytest.fixture
def two_gpus():
    """A node of 2 stand-in GPUs."""
    with cuda_standin.install(2) as cuda:
        yield cuda


def test_more_local_workers_than_gpus_is_refused_before_any_process_starts(two_gpus, tmp_path, monkeypatch) -> None:
    """Was: ``local_rank % device_count`` put ranks 2 and 3 on GPUs 0 and 1 beside ranks 0 and 1."""
    cfg = compose_train(["stages=4", "num_micro_batches=4", "model.num_layers=4", "device=auto"])
    started: list[Any] = []
    monkeypatch.setattr(local_launch, "_run_local_workers", lambda *a: started.append(a))
    with pytest.raises(ConfigError, match=r"device=auto: 4 workers on this node but 2 GPU\(s\) visible.*device=cpu"):
        launch_workers(cfg, tmp_path)
    assert started == [] and two_gpus.calls == []


def test_a_worker_without_a_gpu_of_its_own_refuses_before_joining(two_gpus, tmp_path) -> None:
    """torchrun/SLURM workers: every worker of an overfull node refuses (not only ranks >= GPUs),
    before the process group; ``resolve_device`` never maps two ranks to one GPU."""
    cfg = compose_train(["stages=4", "num_micro_batches=4", "model.num_layers=4", "device=cuda"])
    with pytest.raises(ConfigError, match="4 workers on this node but 2 GPU"):
        run_worker(cfg, rank=0, world_size=4, output_dir=tmp_path, local_rank=0, local_world_size=4)
    with pytest.raises(ConfigError, match="3 workers on this node but 2 GPU"):
        resolve_device("cuda", local_rank=2)
    assert two_gpus.backends == [] and two_gpus.calls == []
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert two_gpus.calls == [("set_device", 1)]


def test_device_cuda_without_cuda_is_refused_when_the_config_is_composed(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^device='cuda': no CUDA device is visible; use device=cpu or device=auto$"):
        compose_train(["device=cuda"])
    assert compose_train(["device=auto"]).device == "auto"  # auto falls back to the CPU, as documented


@pytest.mark.parametrize(("device", "gpus", "tasks", "refused"), [
    ("auto", None, 2, "without hydra.launcher.gpus_per_node.*gpus_per_node=2 .*or device=cpu"),
    ("cuda", None, 4, "without hydra.launcher.gpus_per_node.*gpus_per_node=4 "),
    ("auto", 2, 4, r"gpus_per_node=2 is fewer than the 4 workers per node.*gpus_per_node=4"),
    ("auto", 4, 4, None),
    ("cuda", 8, 4, None),
    ("cpu", None, 4, None),
])
def test_slurm_gpu_request_gives_each_worker_a_gpu(device, gpus, tasks, refused) -> None:
    if refused is None:
        check_gpu_request(device, gpus, tasks)
    else:
        with pytest.raises(GpuRequestError, match=refused):
            check_gpu_request(device, gpus, tasks)


@pytest.mark.slow
def test_slurm_run_with_device_auto_and_no_gpu_request_is_refused_before_submitting(tmp_path) -> None:
    """The real command: one line on stderr, status 1, nothing submitted (no .submitit folder). (A
    partition no cluster has: were the check to let it through, sbatch refuses it.)"""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "-m", "cluster=slurm", "stages=2", "steps=1", "wandb.mode=disabled",
         "cluster.partition=pf-no-such-partition", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "hydra.launcher.gpus_per_node=2" in lines[0] and "device=cpu" in lines[0], proc.stderr
    assert not (sweep / ".submitit").exists()


# --------------------------------------------------------------------------------------------
# A dead worker is noticed by the launcher, whatever its peers wait in (NCCL kernels included)
# --------------------------------------------------------------------------------------------


def _dies_or_waits(index: int) -> None:
    """Worker 0 is killed after 1 s; worker 1 waits forever and notices nothing (as a survivor
    blocked in an NCCL kernel does: no process group, no connection to close)."""
    if index == 0:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)


@pytest.mark.slow
def test_launcher_notices_a_killed_worker_by_its_exit_not_by_its_peers() -> None:
    context = mp.start_processes(_dies_or_waits, nprocs=2, join=False, start_method=START_METHOD)
    start = time.monotonic()
    try:
        with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with signal SIGKILL"):
            local_launch._wait_for_workers(context, grace_s=5.0)
        assert time.monotonic() - start < 30  # the spawn and 1 s; worker_timeout_s (600 s) plays no part
    finally:
        local_launch.kill_workers(context)
    assert not any(p.is_alive() for p in context.processes)


@pytest.mark.parametrize(("device", "optimizer", "hidden", "delay", "warned"), [
    ("cpu", "pipefisher", 768, 120, True),
    ("cpu", "kfac", 1024, 300, True),
    ("cpu", "kfac", 768, 900, False),  # long enough
    ("cpu", "nvlamb", 768, 120, False),  # no inversions
    ("cpu", "kfac", 128, 120, False),  # bert-tiny: seconds per step
    ("cuda", "pipefisher", 768, 120, False),  # on a GPU a step takes seconds
])
def test_signal_delay_shorter_than_a_cpu_kfac_step_is_warned(device, optimizer, hidden, delay, warned) -> None:
    note = signal_delay_note(device, optimizer, hidden, delay)
    assert (note is not None) == warned
    if warned:
        assert f"signal_delay_s={delay}" in note and "raise hydra.launcher.signal_delay_s" in note
