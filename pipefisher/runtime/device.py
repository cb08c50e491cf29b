"""A worker's device: which kind a run's ``device`` names, its GPU (one per local worker), its CPU
threads, and the bf16 autocast of ``precision=bf16``."""

from __future__ import annotations

import os

import torch

from pipefisher.config import ConfigError, TrainConfig

__all__ = ["device_type", "check_local_gpus", "resolve_device", "set_cpu_threads", "autocast_context"]


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


def autocast_context(cfg: TrainConfig, device: torch.device):
    """bf16 autocast when ``precision=bf16``, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
