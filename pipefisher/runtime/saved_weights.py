"""Read a run's trained weights, whatever form they were saved in, as one Hugging Face state dict.

Entry point: :func:`read_saved_weights`, behind ``export.py``, ``train.py init_from=`` and
``finetune.py init.checkpoint=``. It takes

* a model folder (``config.json`` + ``model.safetensors``: a run's ``final/`` or an export);
* a checkpoint folder ``step_<n>`` (verified against its manifest; the stage shards of every
  pipeline method, data-parallel and K-FAC runs alike, merged: one replica of each stage; for
  ``sdp``/``tp`` runs the replica's weights are read whole from its DCP folder beside the shards,
  [Note: sharded checkpoint layout] in ``pipefisher.runtime.sharded_checkpoint``);
* a run folder: its ``final/`` when there is one, else its newest valid checkpoint
  (``checkpoints/step_<n>``), or a checkpoint folder holding ``step_<n>`` folders.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from pipefisher.data.hdf5 import vocab_file_near
from pipefisher.model import BertConfig, merge_stage_state_dicts
from pipefisher.model.hf_format import WEIGHTS_FILE, is_model_folder, read_model_folder
from pipefisher.runtime.checkpoint_io import (MANIFEST, CheckpointError, _STEP_DIR, find_latest, list_checkpoints,
                                              load_shard, verify_checkpoint)
from pipefisher.runtime.final_weights import FINAL_DIR
from pipefisher.runtime.sharded_checkpoint import IN_DCP, dcp_folder, read_whole

__all__ = ["FINAL_DIR", "SavedWeights", "merge_checkpoint", "read_saved_weights", "resolve_saved_weights"]

log = logging.getLogger(__name__)

_REPLICA = re.compile(r"^(\d+)\.(\d+)$")  # "<pipe>.<stage>" keys of a shard's modules (state.module_key)
_MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                 "max_position_embeddings", "type_vocab_size", "hidden_dropout", "attention_dropout")
_ACCEPTED = "give a run folder, its final/ folder, a checkpoint step_<n> folder or an export folder"


@dataclass(frozen=True)
class SavedWeights:
    """Trained weights with what is known about them.

    Attributes:
        state_dict: ``BertForPreTraining`` names -> tensors (tied aliases included).
        config: the architecture they belong to.
        vocab: the ``vocab.txt`` they were trained with, when known.
        seq_len: the sequence length they were trained at, when known.
        trained_steps: optimizer steps behind them, when known.
        source: the folder read (a model folder or a ``step_<n>`` checkpoint).
    """

    state_dict: dict[str, Tensor]
    config: BertConfig
    vocab: Path | None
    seq_len: int | None
    trained_steps: int | None
    source: Path


def resolve_saved_weights(path: str | os.PathLike) -> Path:
    """The model folder or checkpoint folder that ``path`` stands for (see the module docstring).

    Raises:
        CheckpointError: nothing readable there, saying what was looked for.
    """
    path = Path(path)
    if path.is_file() and path.name in (WEIGHTS_FILE, "config.json", MANIFEST):
        path = path.parent
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder; {_ACCEPTED}")
    if is_model_folder(path) or (path / MANIFEST).exists() or _STEP_DIR.match(path.name):
        return path
    if is_model_folder(path / FINAL_DIR):
        return path / FINAL_DIR
    for root in (path / "checkpoints", path):
        if list_checkpoints(root):
            found = find_latest(root)
            if found is None:
                raise CheckpointError(f"{root}: no complete checkpoint (every step_<n> lacks its manifest or "
                                      f"a shard); {_ACCEPTED}")
            return found
    raise CheckpointError(f"{path}: no {FINAL_DIR}/ (config.json + {WEIGHTS_FILE}), no checkpoints/step_<n>/ and "
                          f"no {MANIFEST}; {_ACCEPTED}")


def read_saved_weights(path: str | os.PathLike) -> SavedWeights:
    """Read the weights ``path`` stands for (:func:`resolve_saved_weights`), on the CPU.

    Raises:
        CheckpointError: nothing readable, a corrupt or incomplete checkpoint, or stage shards
            that do not make one model; the message names the folder.
    """
    folder = resolve_saved_weights(path)
    if folder != Path(path):
        log.debug("reading the weights in %s", folder)
    if is_model_folder(folder):
        try:
            saved = read_model_folder(folder)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
        seq_len, steps = saved.meta.get("seq_len"), saved.meta.get("trained_steps")
        return SavedWeights(saved.state_dict, saved.config, saved.vocab, seq_len, steps, folder)
    manifest = verify_checkpoint(folder)
    config: dict[str, Any] = manifest.get("config", {})
    return SavedWeights(merge_checkpoint(folder, manifest), _bert_config(config, folder), _vocab_of(config),
                        config.get("data", {}).get("seq_len"), int(manifest["step"]) + 1, folder)


def merge_checkpoint(folder: Path, manifest: dict[str, Any]) -> dict[str, Tensor]:
    """One replica of every stage of a verified checkpoint, merged into one HF-named state dict
    (a sharded replica's weights read whole from its DCP folder)."""
    stages: dict[int, tuple[tuple[int, int], dict[str, Any]]] = {}
    for entry in sorted(manifest["shards"], key=lambda e: e["rank"]):
        shard = load_shard(folder, entry["rank"])
        for key, state in sorted(shard.get("modules", {}).items()):
            match = _REPLICA.match(str(key))
            if match is None:
                raise CheckpointError(f"checkpoint {folder}: stage key {key!r} is not '<pipe>.<stage>'")
            pipe, stage = int(match.group(1)), int(match.group(2))
            stages.setdefault(stage, ((pipe, stage), state))  # replicas of a stage hold equal weights
    missing = sorted(set(range(max(stages, default=-1) + 1)) - set(stages))
    if not stages or missing:
        raise CheckpointError(f"checkpoint {folder}: the shards hold stages {sorted(stages)}, "
                              f"missing {missing or 'all'}")
    try:
        return merge_stage_state_dicts([_whole_weights(folder, *stages[s]) for s in sorted(stages)])
    except ValueError as err:
        raise CheckpointError(f"checkpoint {folder}: the stages do not make one model: {err}") from None


def _whole_weights(folder: Path, key: tuple[int, int], state: dict[str, Any]) -> dict[str, Tensor]:
    """A stage replica's state dict with every IN_DCP placeholder replaced by the tensor its DCP folder holds."""
    placeholders = [n for n, v in state.items() if not isinstance(v, Tensor)]
    if not placeholders:
        return state
    odd = [n for n in placeholders if not (isinstance(state[n], str) and state[n] == IN_DCP)]
    if odd:
        raise CheckpointError(f"checkpoint {folder}: stage replica {key[0]}.{key[1]} holds {odd[0]!r} as a "
                              f"{type(state[odd[0]]).__name__}, not a tensor")
    source = folder / dcp_folder(key)
    if not source.is_dir():
        raise CheckpointError(f"checkpoint {folder}: stage replica {key[0]}.{key[1]} was sharded (sdp/tp) and its "
                              f"weights are in {source.name}/, which is missing")
    whole = read_whole(source, prefix="model.")
    absent = [n for n in placeholders if f"model.{n}" not in whole]
    if absent:
        raise CheckpointError(f"checkpoint {folder}: {source.name}/ lacks model.{absent[0]} "
                              f"({len(absent)} of the replica's {len(placeholders)} weights)")
    return {n: v if isinstance(v, Tensor) else whole[f"model.{n}"] for n, v in state.items()}


def _bert_config(config: dict[str, Any], folder: Path) -> BertConfig:
    model = config.get("model", {})
    missing = [k for k in _MODEL_FIELDS if k not in model]
    if missing:
        raise CheckpointError(f"checkpoint {folder}: its manifest's config lacks model.{missing[0]}")
    return BertConfig(**{k: model[k] for k in _MODEL_FIELDS})


def _vocab_of(config: dict[str, Any]) -> Path | None:
    """The vocab.txt beside the run's hdf5 shards, if the run read shards and the file is there."""
    data = config.get("data", {})
    if data.get("kind") != "hdf5" or not data.get("path"):
        return None
    return vocab_file_near(data["path"])
