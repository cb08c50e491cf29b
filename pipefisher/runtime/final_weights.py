"""The weights after a pipeline run's last step, merged from its stages into ``<run>/final/``.

Entry point: :func:`save_final_weights` (a collective: every worker calls it once the run
finished). One replica of each stage (data-parallel group 0, pipe 0: replicas of a stage hold
equal weights) travels to rank 0, which merges the stages by name and writes the folder
(:func:`write_final_weights`: Hugging Face's layout, written atomically).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipefisher.config import TrainConfig
from pipefisher.data.hdf5 import vocab_file_near
from pipefisher.model import merge_stage_state_dicts
from pipefisher.model.hf_format import write_model_folder
from pipefisher.run_spec import bert_config
from pipefisher.runtime.sharding import full_state_dict
from pipefisher.runtime.state import to_cpu

__all__ = ["FINAL_DIR", "save_final_weights", "write_final_weights"]

log = logging.getLogger(__name__)

FINAL_DIR = "final"  # <run>/final/: the weights after the last step


def write_final_weights(cfg: TrainConfig, state_dicts: list[dict[str, torch.Tensor]], output_dir: str | os.PathLike,
                        step: int) -> Path:
    """Write the trained model to ``<output_dir>/final/`` in Hugging Face's layout
    (``pipefisher.model.hf_format``): the stages' state dicts merged, the architecture, and the
    ``vocab.txt`` beside the run's hdf5 shards when there is one.

    Args:
        state_dicts: one state dict per stage (any order), or the full model's.
        step: the last step trained (0-based, as metrics.jsonl counts).

    Returns:
        The folder.
    """
    vocab = vocab_file_near(cfg.data.path) if cfg.data.kind == "hdf5" and cfg.data.path else None
    meta = {"trained_steps": step + 1, "seq_len": cfg.data.seq_len, "max_predictions": cfg.data.max_predictions}
    folder = write_model_folder(Path(output_dir) / FINAL_DIR, merge_stage_state_dicts(state_dicts), bert_config(cfg),
                                vocab=vocab, meta=meta)
    log.info("final weights (after %d steps) in %s: config.json, model.safetensors%s; export or fine-tune from "
             "this run folder", step + 1, folder, ", vocab.txt" if vocab else "")
    return folder


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
    return write_final_weights(worker.cfg, [stages[s] for s in sorted(stages)], output_dir, step)
