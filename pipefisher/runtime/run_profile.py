"""A run's profile: every worker's origin (host, pid, clock), and the files rank 0 writes from
the recorded steps: ``profile.sqlite``, ``timeline.json`` and the timeline picture."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from pipefisher.config import TrainConfig
from pipefisher.profiling import (WorkerOrigin, local_origin, plot_timeline, utilization_table, write_profile,
                                  write_trace_json)
from pipefisher.timeline import Event

__all__ = ["gather_origins", "write_run_profile"]

log = logging.getLogger(__name__)


def gather_origins(rank: int, world_size: int) -> dict[int, WorkerOrigin]:
    """Every worker's :func:`~pipefisher.profiling.local_origin` (host, pid, tid, clock), on rank 0.

    A collective: every rank calls it. Each origin is taken in its worker's own process, so a
    multi-node run records each node's hostname and clock offset, not rank 0's.

    Returns:
        ``{rank: origin}`` on rank 0; empty on the other ranks.
    """
    mine = local_origin()
    if world_size == 1 or not dist.is_initialized():
        return {rank: mine}
    gathered: list[WorkerOrigin] | None = [mine] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return dict(enumerate(gathered)) if gathered is not None else {}


def write_run_profile(cfg: TrainConfig, events: list[Event], num_workers: int, output_dir: Path,
                      device: torch.device, origins: Mapping[int, WorkerOrigin] | None = None) -> list[Path]:
    """Write ``profile.sqlite``, ``timeline.json`` (Perfetto, chrome://tracing) and
    ``timeline.pdf/png`` of a run; log the utilization table (each host on its own clock).

    Args:
        origins: ``{worker: origin}`` from :func:`gather_origins`; hosts, pids and clocks.

    Returns:
        The paths of the pictures.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    oversubscribed = device.type == "cpu" and num_workers > cores
    metadata = {
        "config": asdict(cfg),
        "method": cfg.pipeline.method,
        "num_stages": cfg.stages,
        "num_micro_batches": cfg.num_micro_batches,
        "num_steps": cfg.steps - cfg.profile.warmup_steps,
        "device": str(device),
        "oversubscribed": oversubscribed,
        "cores": cores,
    }
    origins = dict(origins or {})
    ranks = {w: w for w in range(num_workers)}
    hosts = {w: o.host for w, o in origins.items()}
    write_profile(output_dir / "profile.sqlite", events, metadata=metadata, worker_ranks=ranks, origins=origins)
    write_trace_json(output_dir / "timeline.json", events, ranks=ranks, origins=origins,
                     metadata={k: v for k, v in metadata.items() if k != "config"})
    title = (f"{cfg.model.name} {cfg.pipeline.method} D={cfg.stages} N={cfg.num_micro_batches}"
             f" W={cfg.data_parallel} on {device.type}")
    pictures = plot_timeline(events, output_dir / "timeline", title=title, num_workers=num_workers,
                             oversubscribed=oversubscribed, hosts=hosts)
    log.info("profile written to %s (and timeline.json)\n%s", output_dir / "profile.sqlite",
             utilization_table(events, num_workers, oversubscribed=oversubscribed, hosts=hosts))
    return pictures
