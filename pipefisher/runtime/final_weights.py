"""The weights after a pipeline run's last step, merged from its stages into ``<run>/final/``.

Entry point: :func:`save_final_weights` (a collective: every worker calls it once the run
finished). One replica of each stage (data-parallel group 0, pipe 0: replicas of a stage hold
equal weights) travels to rank 0, which merges the stages by name and writes the folder
(``pipefisher.training.save_final_weights``: Hugging Face's layout, written atomically).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipefisher.runtime.sharding import full_state_dict
from pipefisher.runtime.state import to_cpu
from pipefisher.training import save_final_weights as write_final

__all__ = ["save_final_weights"]


def save_final_weights(worker: Any, output_dir: str | os.PathLike, step: int) -> Path | None:
    """Gather one replica of every stage on rank 0 and write ``<output_dir>/final/`` there.

    Args:
        worker: a :class:`~pipefisher.runtime.pipeline_worker.PipelineWorker`.
        step: the last step trained (0-based).

    Returns:
        The folder on rank 0, None on the other ranks.
    """
    sdp = worker.cfg.sdp  # the sdp (and tp) peers of replica group 0 gather its shards together (a collective)
    placed = worker.schedule.placement.stages_of(worker.schedule_worker)
    owned = {(pipe, stage) for dp, pipe, stage in placed if dp == 0 and pipe == 0 and worker.tp_index == 0}
    gather = sorted((pipe, stage) for dp, pipe, stage in placed if dp < sdp and pipe == 0)
    states = {key: to_cpu(full_state_dict(worker.modules[key])) for key in gather}
    mine: dict[int, dict[str, torch.Tensor]] = {stage: states[(pipe, stage)] for pipe, stage in sorted(owned)}
    gathered: list[Any] | None = [None] * worker.world_size if worker.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if worker.rank != 0:
        return None
    assert gathered is not None
    stages = {stage: state for part in gathered for stage, state in part.items()}
    assert sorted(stages) == list(range(worker.schedule.num_stages)), sorted(stages)
    return write_final(worker.cfg, [stages[s] for s in sorted(stages)], output_dir, step)
