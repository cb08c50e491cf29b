"""Initial weights for fine-tuning: our pretraining checkpoints or a Hugging Face state dict.

Accepted (``init.checkpoint``), every file read with ``torch.load(weights_only=True)``:

* one file per pipeline stage (each a ``BertStage.state_dict()``), merged with
  :func:`~pipefisher.model.merge_stage_state_dicts` (which also checks the tied word-embedding /
  decoder copies agree);
* a pretraining checkpoint's worker shards (``worker_<r>.pt``, or their ``step_<n>`` folder),
  whose ``"modules"`` entry maps ``"<pipe>.<stage>"`` to a stage replica's state dict: one
  replica of each stage (the lowest pipe index: replicas are equal) is merged as above;
* one merged state dict, or a Hugging Face ``BertForPreTraining`` / ``BertForSequenceClassification``
  state dict (``bert.``-prefixed names), or a ``BertModel`` one (no prefix: ``embeddings.*``,
  ``encoder.*``, ``pooler.*``).

A file may also hold the state dict under ``"model"`` or ``"state_dict"``, and a ``module.``
prefix (DistributedDataParallel) is dropped. Only ``bert.*`` weights are used: the task head
always starts fresh. The model's vocabulary size is taken from the checkpoint; its depth and
width must match ``model`` (the error says which group to pick).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipefisher.config import ConfigError
from pipefisher.finetune.heads import FinetuneModel
from pipefisher.model import WORD_EMBEDDINGS_NAME, load_hf_state_dict, merge_stage_state_dicts

__all__ = ["checkpoint_layers", "load_checkpoint", "load_encoder_weights"]

log = logging.getLogger(__name__)

_BERT_MODEL_ROOTS = ("embeddings.", "encoder.", "pooler.")
_LAYER = re.compile(r"^bert\.encoder\.layer\.(\d+)\.")
_POOLER = ("bert.pooler.dense.weight", "bert.pooler.dense.bias")
_REPLICA = re.compile(r"^(\d+)\.(\d+)$")


def _check_tensors(path: Path, obj: Any) -> dict[str, Tensor]:
    if not isinstance(obj, Mapping) or not obj:
        raise ConfigError(f"init.checkpoint: {path} holds a {type(obj).__name__}, not a state dict (name -> tensor)")
    bad = [k for k, v in obj.items() if not isinstance(v, Tensor)]
    if bad:
        raise ConfigError(f"init.checkpoint: {path}: entries {bad[:5]} are not tensors; save a model's state_dict()")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in obj.items()}


def _read_state_dicts(path: Path) -> list[tuple[tuple[int, int] | None, dict[str, Tensor]]]:
    """The state dicts in one file: ``[(None, sd)]``, or ``[((pipe, stage), sd), ...]`` for a worker shard."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types; the message says which file
        raise ConfigError(f"init.checkpoint: {path} cannot be read as a weights-only torch file: {err}") from None
    modules = obj.get("modules") if isinstance(obj, Mapping) else None
    if isinstance(modules, Mapping):
        found = []
        for key, state in modules.items():
            match = _REPLICA.match(str(key))
            if match is None:
                raise ConfigError(f"init.checkpoint: {path}: 'modules' key {key!r} is not '<pipe>.<stage>'")
            found.append(((int(match.group(1)), int(match.group(2))), _check_tensors(path, state)))
        return found
    for key in ("model", "state_dict"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    return [(None, _check_tensors(path, obj))]


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    """Files to read: a directory stands for its ``worker_*.pt`` shards."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            shards = sorted(p.glob("worker_*.pt"))
            if not shards:
                raise ConfigError(f"init.checkpoint: {p} is a directory without worker_*.pt shards")
            files.extend(shards)
        else:
            files.append(p)
    return files


def load_checkpoint(paths: Sequence[str | Path]) -> dict[str, Tensor]:
    """Read and merge ``init.checkpoint`` files (or shard folders) into one ``bert.``-prefixed state dict.

    Raises:
        ConfigError: a file cannot be read, is not a state dict, or the stages do not merge.
    """
    entries = [entry for path in _expand(paths) for entry in _read_state_dicts(path)]
    replicas = {key: sd for key, sd in entries if key is not None}
    state_dicts = [sd for key, sd in entries if key is None]
    first_pipe: dict[int, int] = {}
    for pipe, stage in sorted(replicas):
        first_pipe.setdefault(stage, pipe)
    state_dicts += [replicas[(pipe, stage)] for stage, pipe in sorted(first_pipe.items())]
    if len(state_dicts) == 1:
        merged = state_dicts[0]
    else:
        try:
            merged = merge_stage_state_dicts(state_dicts)
        except ValueError as err:
            raise ConfigError(f"init.checkpoint={list(map(str, paths))}: the stage files do not merge: {err}") from None
    if not any(k.startswith("bert.") for k in merged):
        merged = {(f"bert.{k}" if k.startswith(_BERT_MODEL_ROOTS) else k): v for k, v in merged.items()}
    if WORD_EMBEDDINGS_NAME not in merged:
        raise ConfigError(
            f"init.checkpoint={list(map(str, paths))}: no {WORD_EMBEDDINGS_NAME} (nor embeddings.word_embeddings.weight); "
            "with per-stage files, list every stage's file"
        )
    return merged


def checkpoint_layers(state_dict: Mapping[str, Tensor]) -> int:
    """Encoder layers in a ``bert.``-prefixed state dict (1 + the largest layer index)."""
    indices = [int(m.group(1)) for k in state_dict if (m := _LAYER.match(k))]
    return max(indices) + 1 if indices else 0


def load_encoder_weights(model: FinetuneModel, state_dict: Mapping[str, Tensor]) -> list[str]:
    """Copy the checkpoint's encoder (and pooler) weights into ``model``.

    Args:
        model: the model, built with the checkpoint's vocabulary size.
        state_dict: from :func:`load_checkpoint`.

    Returns:
        Names left at their random init: the pooler, when the checkpoint has none (a
        ``BertModel`` saved without pooling layer), else nothing.

    Raises:
        ConfigError: the checkpoint's depth or a tensor's shape differs from ``model``, or a
            stage's weights are missing (the message lists them).
    """
    layers = checkpoint_layers(state_dict)
    if layers != model.config.num_layers:
        raise ConfigError(
            f"model.num_layers={model.config.num_layers} but init.checkpoint has {layers} encoder layers; "
            f"pick the model group the checkpoint was trained with (e.g. model.num_layers={layers})"
        )
    source = dict(state_dict)
    left_random = []
    if not all(name in source for name in _POOLER):
        own = model.stage.state_dict()
        for name in _POOLER:
            source[name] = own[name]
        left_random = list(_POOLER)
        log.warning("init.checkpoint has no pooler; the pooler starts from random weights")
    try:
        load_hf_state_dict(model.stage, source)
    except (KeyError, ValueError) as err:
        message = err.args[0] if err.args else str(err)
        raise ConfigError(f"init.checkpoint does not fit model={model.config.hidden_size}-wide "
                          f"{model.config.num_layers}-layer BERT: {message}") from None
    return left_random
