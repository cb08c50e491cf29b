"""Initial weights for fine-tuning: our pretraining runs and checkpoints, or a Hugging Face state dict.

Accepted (``init.checkpoint``), every file read with ``torch.load(weights_only=True)`` or safetensors:

* a folder, alone: a pretraining run folder (its ``final/`` weights, else its newest checkpoint),
  its ``final/``, a checkpoint's ``step_<n>`` folder (verified against its manifest; the stage
  shards of any pipeline method merged) or an export / HF model folder (``config.json`` +
  ``model.safetensors``): :func:`~pipefisher.runtime.saved_weights.read_saved_weights`;
* one file per pipeline stage (each a ``BertStage.state_dict()``), merged with
  :func:`~pipefisher.model.merge_stage_state_dicts` (which also checks the tied word-embedding /
  decoder copies agree);
* a pretraining checkpoint's worker shard files (``worker_<r>.pt``), whose ``"modules"`` entry maps
  ``"<pipe>.<stage>"`` to a stage replica's state dict: one replica of each stage (the lowest pipe
  index: replicas are equal) is merged as above (a sharded run's shards hold no weights, only
  placeholders for its DCP folders: give its ``step_<n>`` folder instead);
* one merged state dict (``.pt`` or ``.safetensors``), or a Hugging Face ``BertForPreTraining`` /
  ``BertForSequenceClassification`` state dict (``bert.``-prefixed names), or a ``BertModel`` one
  (no prefix: ``embeddings.*``, ``encoder.*``, ``pooler.*``).

A file may also hold the state dict under ``"model"`` or ``"state_dict"``, and a ``module.``
prefix (DistributedDataParallel) is dropped. Only ``bert.*`` weights are used: the task head
always starts fresh. The model's vocabulary size is taken from the checkpoint; its depth and
width must match ``model`` (the error says which group to pick). Every ``bert.*`` weight of the
model must be in the checkpoint under its name and shape, and every ``bert.*`` name of the
checkpoint must be one of the model's: otherwise the run is refused, naming the keys (issue 24:
a checkpoint that silently half-loads trains from noise). The log says how many tensors it took.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from pipefisher.config import ConfigError
from pipefisher.finetune.heads import FinetuneModel
from pipefisher.model import WORD_EMBEDDINGS_NAME, load_hf_state_dict, merge_stage_state_dicts
from pipefisher.runtime.checkpoint_io import CheckpointError
from pipefisher.runtime.saved_weights import read_saved_weights
from pipefisher.runtime.sharded_checkpoint import IN_DCP

__all__ = ["COLLAPSED_SPREAD", "checkpoint_layers", "cls_spread", "load_checkpoint", "load_encoder_weights",
           "warn_if_collapsed"]

log = logging.getLogger(__name__)

_BERT_MODEL_ROOTS = ("embeddings.", "encoder.", "pooler.")
_LAYER = re.compile(r"^bert\.encoder\.layer\.(\d+)\.")
_POOLER = ("bert.pooler.dense.weight", "bert.pooler.dense.bias")
_IGNORED_BUFFERS = ("position_ids", "token_type_ids")  # HF's embedding buffers: not weights
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
        obj = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, map_location="cpu",
                                                                                 weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises several types; the message says which file
        raise ConfigError(f"init.checkpoint: {path} cannot be read as a weights-only torch or safetensors file: "
                          f"{err}") from None
    modules = obj.get("modules") if isinstance(obj, Mapping) else None
    if isinstance(modules, Mapping):
        found = []
        for key, state in modules.items():
            match = _REPLICA.match(str(key))
            if match is None:
                raise ConfigError(f"init.checkpoint: {path}: 'modules' key {key!r} is not '<pipe>.<stage>'")
            if isinstance(state, Mapping) and IN_DCP in state.values():  # [Note: sharded checkpoint layout]
                raise ConfigError(f"init.checkpoint: {path} is a worker shard of a sharded (sdp/tp) run, whose "
                                  f"weights are in the DCP folders beside it; give its folder alone: "
                                  f"init.checkpoint=[{path.parent}]")
            found.append(((int(match.group(1)), int(match.group(2))), _check_tensors(path, state)))
        return found
    for key in ("model", "state_dict"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    return [(None, _check_tensors(path, obj))]


def _read_folder(paths: Sequence[str | Path]) -> dict[str, Tensor]:
    """The whole model a folder holds (see the module docstring); the folder must come alone."""
    if len(paths) > 1:
        raise ConfigError(f"init.checkpoint={list(map(str, paths))}: a folder holds a whole model; give it alone "
                          "(or list one file per stage)")
    try:
        saved = read_saved_weights(paths[0])
    except CheckpointError as err:
        raise ConfigError(f"init.checkpoint: {err}") from None
    log.info("init.checkpoint: reading %s (%s)", saved.source,
             f"after {saved.trained_steps} pretraining steps" if saved.trained_steps else "pretraining steps unknown")
    return saved.state_dict


def load_checkpoint(paths: Sequence[str | Path]) -> dict[str, Tensor]:
    """Read and merge ``init.checkpoint`` files (or shard folders) into one ``bert.``-prefixed state dict.

    Raises:
        ConfigError: a file cannot be read, is not a state dict, or the stages do not merge.
    """
    if any(Path(p).is_dir() for p in paths):
        return _read_folder(paths)
    entries = [entry for path in map(Path, paths) for entry in _read_state_dicts(path)]
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


def _fit_problems(own: Mapping[str, Tensor], source: Mapping[str, Tensor]) -> list[str]:
    """What keeps ``source`` (``bert.``-names) from loading into ``own``: missing, unexpected, wrong shapes."""
    missing = [k for k in own if k not in source]
    unexpected = [k for k in source if k.startswith("bert.") and k not in own and not k.endswith(_IGNORED_BUFFERS)]
    shapes = [f"{k} {tuple(source[k].shape)} (model {tuple(v.shape)})" for k, v in own.items()
              if k in source and tuple(source[k].shape) != tuple(v.shape)]
    problems = []
    for label, keys in (("missing", missing), ("not in the model", unexpected), ("of another shape", shapes)):
        if keys:
            problems.append(f"{len(keys)} {label}: {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}")
    return problems


def load_encoder_weights(model: FinetuneModel, state_dict: Mapping[str, Tensor]) -> list[str]:
    """Copy the checkpoint's encoder (and pooler) weights into ``model``: every one, or refuse.

    Args:
        model: the model, built with the checkpoint's vocabulary size.
        state_dict: from :func:`load_checkpoint`.

    Returns:
        Names left at their random init: the pooler, when the checkpoint has none (a
        ``BertModel`` saved without pooling layer), else nothing.

    Raises:
        ConfigError: the checkpoint's depth differs from ``model``, or its ``bert.*`` weights do
            not match the model's name for name and shape (one line naming the keys).
    """
    layers = checkpoint_layers(state_dict)
    if layers != model.config.num_layers:
        raise ConfigError(
            f"model.num_layers={model.config.num_layers} but init.checkpoint has {layers} encoder layers; "
            f"pick the model group the checkpoint was trained with (e.g. model.num_layers={layers})"
        )
    own = model.stage.state_dict()
    source = dict(state_dict)
    left_random = []
    if not any(name in source for name in _POOLER):
        source.update({name: own[name] for name in _POOLER})
        left_random = list(_POOLER)
        log.warning("init.checkpoint has no pooler; the pooler starts from random weights")
    problems = _fit_problems(own, source)
    if problems:
        c = model.config
        raise ConfigError(f"init.checkpoint does not fit model (L={c.num_layers}, H={c.hidden_size}, FFN "
                          f"{c.intermediate_size}): {'; '.join(problems)}; give a checkpoint of this model, or the "
                          "model group it was trained with")
    load_hf_state_dict(model.stage, source)
    heads = sum(1 for k in state_dict if k.startswith("cls."))
    others = sum(1 for k in state_dict if not k.startswith(("bert.", "cls.")))
    log.info("init.checkpoint: took %d tensors, every encoder weight (embeddings, %d layers%s); left aside %d "
             "pretraining-head tensors (cls.*)%s; the task head starts fresh", len(own) - len(left_random),
             model.config.num_layers, "" if left_random else ", pooler", heads,
             f" and {others} other tensors" if others else "")
    return left_random


#: [CLS] spread (:func:`cls_spread`) below which the encoder is taken to ignore its input. Measured on
#: bert-tiny and the toy task's first 32 sequences: random init 1.6e-2; after 30 chimera steps on
#: synthetic data 2.6e-3 (the toy task then learns); after 300 such steps 3.8e-5 (fine-tuning stays
#: at chance: issue 24). The threshold sits about a factor 9 from either.
COLLAPSED_SPREAD = 3e-4


@torch.no_grad()
def cls_spread(model: FinetuneModel, batch: Mapping[str, Tensor]) -> float:
    """How much the encoder's [CLS] output varies across the sequences of ``batch``: its standard
    deviation over the batch (mean over H) relative to its mean magnitude (eval mode, no dropout)."""
    was_training = model.training
    model.eval()
    try:
        cls = model.stage.encode(None, batch)[:, 0].float()  # [B,H]
    finally:
        model.train(was_training)
    return float(cls.std(0).mean() / cls.abs().mean().clamp_min(1e-12))


def warn_if_collapsed(model: FinetuneModel, batch: Mapping[str, Tensor]) -> float:
    """Warn when the loaded encoder gives every sequence of ``batch`` the same [CLS] output (a
    pretraining that learned only token frequencies, as on synthetic random tokens): fine-tuning
    from it tends to stay at chance. Returns the spread."""
    spread = cls_spread(model, batch)
    if spread < COLLAPSED_SPREAD:
        log.warning("init.checkpoint: the encoder's [CLS] output is the same for every input (relative spread "
                    "%.1e across the first %d training sequences, below %.0e; a random init gives about 1e-2): its "
                    "pretraining learned no input features (data=synthetic tokens are random), so fine-tuning from it "
                    "is likely to stay at chance; pretrain on text (data=hdf5) or fewer steps, or fine-tune from a "
                    "random init", spread, len(next(iter(batch.values()))), COLLAPSED_SPREAD)
    return spread
