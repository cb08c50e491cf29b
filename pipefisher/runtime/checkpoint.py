"""Checkpoints of a pipeline run: one shard per worker, a manifest, every file written atomically.

Entry points: :func:`save_checkpoint` and :func:`load_shard` (called by every worker),
:func:`find_latest` and :func:`agree_on_resume` (which checkpoint to continue from),
:class:`CheckpointPolicy` (when to save), :func:`trim_metrics` (metrics.jsonl on resume).
What a shard holds and why resume is exact: :mod:`pipefisher.runtime.state`.

[Note: checkpoint layout]
::

    <checkpoint.dir>/                     default <run output dir>/checkpoints
      step_<n>/                           the state after step n (the "step" of metrics.jsonl,
                                          counted from 0: after n + 1 steps, see below)
        worker_<r>.pt                     worker r's shard: torch.save of tensors and primitives
        sharded_<pipe>.<stage>/           sdp/tp runs: the stage replicas and optimizer moments,
                                          written with torch.distributed.checkpoint by the processes
                                          sharing them ([Note: sharded checkpoint layout] in
                                          ``pipefisher.runtime.sharded_checkpoint``)
        manifest.json                     written last, by rank 0: marks the checkpoint complete

Each worker writes its shard to a temporary file in the same folder, fsyncs it and renames it
into place (``os.replace``), then reports its size and sha256 to rank 0 (``gather_object``: the
barrier). Only when every shard is on disk does rank 0 write ``manifest.json`` the same way. The
manifest holds the step, the world size, a hash of the config fields a checkpoint must agree on
(:data:`MATCHING_FIELDS`) with the fields themselves, the K-FAC refresh interval, the whole
config (to report what else changed) and each shard's file name, size and sha256.

A checkpoint is *complete* when its manifest exists, and *valid* when moreover every shard has
the manifest's size and hash. A run killed while saving leaves a folder without a manifest (or,
when it dies while re-writing a folder it saved before, shards that no longer match): both are
skipped, with a warning naming them, by :func:`find_latest`, which returns the newest valid one.
A shard is read whole, checked against its hash and only then unpickled, with
``torch.load(weights_only=True)``, so nothing is ever half-loaded or unsafely unpickled.

Folder names count steps from 0, as metrics.jsonl and the worker loop do, so
``checkpoint.every_steps=2`` writes ``step_1``, ``step_3``, … (after 2, 4, … steps); the log line
of each save says both (issue 16). Renaming them to the count of steps done would move every
reader of the name (resume messages, tests, bench/convergence.py) off the manifest's ``step``.

[Note: metrics.jsonl on resume]
``resume=auto`` continues in the same run directory (set ``hydra.run.dir`` to the interrupted
run's folder, or point ``checkpoint.dir`` at a fixed place): ``metrics.jsonl`` is kept, minus the
records of steps after the checkpoint (the interrupted run may have logged steps it never saved),
and the resumed steps are appended, so the file reads like one uninterrupted run (when no
checkpoint exists yet, the run starts over and the records of the lost attempt are dropped).
``resume=<path>`` in a new run directory starts a new ``metrics.jsonl`` at step n+1. Each
resumed process is a new wandb run.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.runtime.checkpoint_io import (CHECKPOINT_FORMAT, MANIFEST, MATCHING_FIELDS, CheckpointError, ShardInfo,
                                              _STEP_DIR, atomic_write, check_compatible, checkpoint_root, config_fields,
                                              config_hash, find_latest, list_checkpoints, load_shard, prune_checkpoints,
                                              save_checkpoint, shard_name, step_dir, verify_checkpoint, write_manifest,
                                              write_shard)

__all__ = [
    "CHECKPOINT_FORMAT",
    "MANIFEST",
    "MATCHING_FIELDS",
    "CheckpointError",
    "CheckpointPolicy",
    "ShardInfo",
    "agree_on_resume",
    "atomic_write",
    "check_compatible",
    "checkpoint_root",
    "config_fields",
    "config_hash",
    "find_latest",
    "list_checkpoints",
    "load_shard",
    "prune_checkpoints",
    "resolve_resume",
    "save_checkpoint",
    "shard_name",
    "step_dir",
    "trim_metrics",
    "resume_worker",
    "verify_checkpoint",
    "write_manifest",
    "write_shard",
]

log = logging.getLogger(__name__)


def resolve_resume(cfg: TrainConfig, root: str | os.PathLike) -> Path | None:
    """The checkpoint folder ``cfg.resume`` asks for, verified; None to start afresh.

    ``auto``: the newest valid checkpoint in ``root`` (None when there is none). A path: that
    ``step_<n>`` folder (it must be valid), or the newest valid one in that checkpoint folder.

    Raises:
        CheckpointError: an explicit path holds no valid checkpoint.
    """
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        found = find_latest(root)
        if found is None:
            log.warning("resume=auto: no complete checkpoint in %s; starting at step 0 (to continue an "
                        "interrupted run, give its folder as hydra.run.dir, or a fixed checkpoint.dir)", root)
        return found
    path = Path(cfg.resume)
    if (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        verify_checkpoint(path)
        return path
    found = find_latest(path)
    if found is None:
        raise CheckpointError(f"resume={cfg.resume}: no valid checkpoint (step_<n>/{MANIFEST}) in it; "
                              "use resume=auto or resume=none")
    return found


def agree_on_resume(cfg: TrainConfig, root: Path, rank: int, world_size: int,
                    kfac_interval: int | None) -> tuple[Path, int] | None:
    """Rank 0 picks and checks the checkpoint to resume from; every rank gets the same answer.

    A problem found by rank 0 is raised on every rank, so that no worker waits for the others.

    Returns:
        (checkpoint folder, its step), or None to start at step 0.

    Raises:
        CheckpointError: ``resume=<path>`` holds no valid checkpoint.
        ConfigError: the checkpoint does not fit this run (see :func:`check_compatible`).
    """
    answer: list[Any] = [None, None, None]
    if rank == 0:
        try:
            folder = resolve_resume(cfg, root)
            if folder is not None:
                manifest = verify_checkpoint(folder)
                check_compatible(manifest, cfg, world_size, kfac_interval, folder)
                answer[:2] = [str(folder), int(manifest["step"])]
                newer = [p.name for s, p in list_checkpoints(root) if s > manifest["step"] and (p / MANIFEST).is_file()]
                if newer:
                    log.warning("resuming from %s: the later checkpoints %s in %s belong to the interrupted "
                                "timeline and will be overwritten or pruned", folder, newer, root)
        except (CheckpointError, ConfigError) as err:
            answer[2] = (type(err).__name__, str(err))
    if world_size > 1:
        dist.broadcast_object_list(answer, src=0)
    if answer[2] is not None:
        kind, message = answer[2]
        raise (ConfigError if kind == "ConfigError" else CheckpointError)(message)
    return None if answer[0] is None else (Path(answer[0]), int(answer[1]))



# -- when to save ------------------------------------------------------------------------------


@dataclass
class CheckpointPolicy:
    """When to save: after step n when (n + 1) % ``every_steps`` == 0, after the run's last step,
    and when ``every_minutes`` passed since the last save (or the start). 0 turns a rule off."""

    every_steps: int
    every_minutes: float
    last_step: int
    _since: float = field(default_factory=time.monotonic)

    @property
    def enabled(self) -> bool:
        """Whether any rule is on."""
        return self.every_steps > 0 or self.every_minutes > 0

    def due_by_steps(self, step: int) -> bool:
        """The step rule (and the last step), which every worker evaluates alike."""
        if not self.enabled:
            return False
        return step == self.last_step or (self.every_steps > 0 and (step + 1) % self.every_steps == 0)

    def due_by_time(self, now_s: float | None = None) -> bool:
        """The time rule, on this process's clock (rank 0 decides for all, see the worker loop)."""
        now_s = time.monotonic() if now_s is None else now_s
        return self.every_minutes > 0 and now_s - self._since >= 60.0 * self.every_minutes

    def saved(self, now_s: float | None = None) -> None:
        """Restart the time rule's clock."""
        self._since = time.monotonic() if now_s is None else now_s


# -- metrics --------------------------------------------------------------------------------------


def trim_metrics(path: str | os.PathLike, last_step: int) -> int:
    """Drop the records of steps after ``last_step`` from a ``metrics.jsonl`` (atomically).

    See [Note: metrics.jsonl on resume]. Lines that are not JSON objects with a ``step`` (a
    write cut short) are dropped too.

    Returns:
        How many lines were dropped (0 when the file does not exist).
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record["step"]) <= last_step
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        text = "".join(f"{line}\n" for line in kept).encode()
        atomic_write(path, lambda f: f.write(text))
        log.info("%s: dropped %d records of steps after the checkpoint (step %d)", path, dropped, last_step)
    return dropped


def resume_worker(cfg: TrainConfig, worker: Any, root: Path, output_dir: Path) -> int:
    """Load the checkpoint ``cfg.resume`` asks for into ``worker`` (a collective) and trim
    ``metrics.jsonl`` to it ([Note: metrics.jsonl on resume]).

    Args:
        worker: a :class:`~pipefisher.runtime.pipeline_worker.PipelineWorker`.

    Returns:
        The first step to train (0 when starting afresh).
    """
    rank, world_size = worker.rank, worker.world_size
    metrics = output_dir / "metrics.jsonl"  # tracking.METRICS_FILE
    resumed = agree_on_resume(cfg, root, rank, world_size, worker.kfac_interval)
    if resumed is None:
        if cfg.resume != "none" and rank == 0:  # starting over: records of an unsaved earlier attempt go
            trim_metrics(metrics, -1)
        return 0
    folder, saved_step = resumed
    first = worker.load_checkpoint(folder) + 1
    if rank == 0:
        trim_metrics(metrics, saved_step)
        log.info("resumed from %s: continuing at step %d of %d", folder, first, cfg.steps)
    return first
