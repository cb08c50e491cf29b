"""A worker's device: which kind a run's ``device`` names, its GPU (one per local worker), its CPU
threads, and the bf16 autocast of ``precision=bf16``."""

from __future__ import annotations

import os

import torch

from pipefisher.config import ConfigError, TrainConfig

__all__ = ["device_type", "check_local_gpus", "resolve_device", "set_cpu_threads", "set_flush_denormal",
           "autocast_context"]


def device_type(name: str) -> str:
    """``"cuda"`` or ``"cpu"``: the kind of device :func:`resolve_device` gives for ``name``, without
    choosing a GPU (``resolve_device`` calls ``torch.cuda.set_device``; a worker calls it once, with its
    local rank)."""
    return "cpu" if name == "cpu" or (name == "auto" and not torch.cuda.is_available()) else "cuda"


def check_local_gpus(name: str, local_workers: int) -> None:
    """Refuse more workers on this machine than GPUs it shows: each worker needs a GPU of its own.

    Raises:
        ConfigError: naming the counts and the fix (no-op for a CPU run).
    """
    count = torch.cuda.device_count() if device_type(name) == "cuda" else local_workers
    if local_workers > count:
        raise ConfigError(f"device={name}: {local_workers} workers on this node but {count} GPU(s) visible; each "
                          "worker needs its own GPU: run at most that many workers per node (stages*data_parallel, "
                          "or more cluster.nodes), or device=cpu")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` → the local CUDA device when one is visible, else CPU; a worker's GPU is
    ``cuda:<local_rank>`` (set as the current device).

    Raises:
        ConfigError: ``local_rank`` has no GPU of its own (two ranks would share one).
    """
    if device_type(name) == "cpu":
        return torch.device("cpu")
    check_local_gpus(name, local_rank + 1)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def set_cpu_threads(num_processes: int) -> int:
    """Give this process ``cores // processes`` intra-op threads (at least 1); returns the count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, num_processes))
    torch.set_num_threads(threads)
    return threads


def set_flush_denormal(flush: bool, device: torch.device) -> bool:
    """On CPU, flush subnormal floats to zero in this process when ``flush`` (a run's ``cpu_flush_denormal``), else
    keep IEEE subnormals; returns whether they are flushed (False on CUDA, where subnormals cost nothing and nothing
    is set, and where the CPU lacks the SSE3 flag).

    [Note: subnormals on CPU]
    After some tens of steps BERT's smallest attention probabilities (and what they multiply in the backward)
    fall below float32's smallest normal number, 1.2e-38. x86 cores handle such subnormal operands in microcode,
    and every step slowed by 29–45 % from then on (bert-tiny, GPipe, N=4 and 8, steps 63 to 88 of a run on a
    2-core Xeon with AMX: 230 → 297–336 ms; with flushing, 230–245 ms throughout; no parameter, gradient or
    optimizer state was subnormal). Flushing turns results and operands below 1.2e-38 into zeros; such a value
    changes a sum only where the sum's other terms are all below about 2e-31 (half a unit in the last place of
    anything larger), and the default 300-step run ended at the same loss to every printed digit either way
    (docs/measuring.md). The setting is per process: every worker sets it when its ``PipelineWorker`` is built,
    so train.py, the benchmarks and ``measure.collectives`` time the same arithmetic; finetune.py sets it from its
    own ``cpu_flush_denormal``."""
    if device.type != "cpu":
        return False
    return bool(torch.set_flush_denormal(bool(flush))) and bool(flush)


def autocast_context(cfg: TrainConfig, device: torch.device):
    """bf16 autocast when ``precision=bf16``, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
