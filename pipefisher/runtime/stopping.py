"""After each step: save a checkpoint when due, and stop every worker together on a signal.

See [Note: stopping on a signal] in ``pipefisher.runtime.preemption``: the stop flag rides on the
step's loss all-reduce, so every worker learns of it at the same step; SLURM's signal always
saves (the requeued job resumes); Ctrl-C and SIGTERM save with checkpointing on, or once the run
trained for ``checkpoint.on_stop_after_s`` (rank 0's clock).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipefisher.config import TrainConfig
from pipefisher.runtime import preemption
from pipefisher.runtime.checkpoint import CheckpointPolicy, step_dir

__all__ = ["StopPolicy", "requeue_from_rank0"]

log = logging.getLogger(__name__)


class StopPolicy:
    """Checkpoints when due and the agreed stop of one worker (every worker holds one).

    Args:
        worker: the :class:`~pipefisher.runtime.pipeline_worker.PipelineWorker`.
        root: the checkpoint folder.
    """

    def __init__(self, cfg: TrainConfig, worker: Any, root: Path) -> None:
        self.cfg, self.worker, self.root = cfg, worker, root
        self.policy = CheckpointPolicy(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes, last_step=cfg.steps - 1)
        self.started = time.monotonic()  # training time of this attempt
        self.preempted: tuple[int, Path | None] | None = None  # (step, checkpoint or None) once stopped

    def after_step(self, step: int, row: dict[str, Any]) -> bool:
        """Save when due; on an agreed stop, save if the rules say so and return True (a collective).

        ``row`` (the step's metrics) gets ``"preempted": True`` when the run stops here.
        """
        worker, cfg = self.worker, self.cfg
        saved = self._checkpoint_due(step)
        if saved:
            worker.save_checkpoint(self.root, step)
            self.policy.saved()
        if not (worker.stop_agreed and step < cfg.steps - 1):
            return False
        keep = (saved or worker.watch_preemption or cfg.checkpoint.enabled
                or self._trained_long_enough(time.monotonic() - self.started))
        folder = step_dir(self.root, step) if saved else worker.save_checkpoint(self.root, step) if keep else None
        if worker.rank == 0:
            log.warning("stop signal: stopped after step %d of %d, checkpoint: %s", step, cfg.steps, folder or "none")
        self.preempted = (step, folder)
        row["preempted"] = True
        return True

    def _checkpoint_due(self, step: int) -> bool:
        """Whether every worker saves after ``step``; the time rule follows rank 0's clock."""
        due = self.policy.due_by_steps(step)
        if self.policy.every_minutes > 0:
            flag = torch.tensor([float(due or self.policy.due_by_time())], device=self.worker.device)
            dist.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def _trained_long_enough(self, trained_s: float) -> bool:
        """Whether a run stopped by Ctrl-C or SIGTERM saves: rank 0 trained for
        ``checkpoint.on_stop_after_s`` (a collective: every worker calls it)."""
        limit = self.cfg.checkpoint.on_stop_after_s
        flag = torch.tensor([float(0 <= limit <= trained_s)], device=self.worker.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())


def requeue_from_rank0(rank: int, step: int, folder: Path | None) -> None:
    """Worker 0 requeues the SLURM job; every worker learns whether it worked.

    Raises:
        RequeueError: on every worker, when the job was not requeued (the checkpoint is kept).
    """
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            preemption.requeue(step, folder)
        except preemption.RequeueError as err:
            outcome[0] = str(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise preemption.RequeueError(outcome[0])
