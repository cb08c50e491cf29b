"""A model folder in Hugging Face's layout: ``config.json``, ``model.safetensors``, ``vocab.txt``.

Entry points: :func:`write_model_folder` (atomically, from a merged HF-named state dict) and
:func:`read_model_folder`; :func:`hf_config_dict` / :func:`bert_config_from_hf` translate the
architecture. ``transformers.BertForPreTraining.from_pretrained(folder)`` loads such a folder, and
so do ``finetune.py init.checkpoint=[folder]`` and ``train.py init_from=folder``.

[Note: tied weights in the file]
The MLM decoder is the word-embedding matrix and ``cls.predictions.decoder.bias`` is
``cls.predictions.bias`` (HF's aliases, which :func:`~pipefisher.model.merge_stage_state_dicts`
fills in). safetensors refuses tensors that share memory, and HF's own ``save_pretrained`` leaves
the aliases out as well (it ties them again on load), so the file holds each tensor once and
:func:`read_model_folder` adds the aliases back.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import Tensor

from pipefisher.atomic import fsync_path, usual_file_mode
from pipefisher.model.bert import (_HF_DECODER_BIAS_NAME, _PREDICTIONS_BIAS_NAME, DECODER_WEIGHT_NAME,
                                   WORD_EMBEDDINGS_NAME, merge_stage_state_dicts)
from pipefisher.model.config import BertConfig

__all__ = ["CONFIG_FILE", "VOCAB_FILE", "WEIGHTS_FILE", "ModelFolder", "bert_config_from_hf", "hf_config_dict",
           "is_model_folder", "read_model_folder", "write_model_folder"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "vocab.txt"
_CANONICAL = {DECODER_WEIGHT_NAME: WORD_EMBEDDINGS_NAME, _HF_DECODER_BIAS_NAME: _PREDICTIONS_BIAS_NAME}
_ALIASES = tuple(_CANONICAL)  # [Note: tied weights in the file]
_META_KEY = "pipefisher"  # our own entries in config.json (HF keeps unknown keys as attributes)


@dataclass(frozen=True)
class ModelFolder:
    """What a model folder holds: HF-named weights (aliases included), the architecture, the
    vocabulary file when there is one, and our own notes (``trained_steps``, ``seq_len``, ``source``)."""

    state_dict: dict[str, Tensor]
    config: BertConfig
    vocab: Path | None
    meta: dict[str, Any]


def hf_config_dict(config: BertConfig, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of a ``BertForPreTraining`` with this architecture (plus ``meta`` under ``pipefisher``)."""
    out = {"architectures": ["BertForPreTraining"], "model_type": "bert", **config.hf_config_kwargs(),
           "pad_token_id": 0, "position_embedding_type": "absolute", "tie_word_embeddings": True}
    if meta:
        out[_META_KEY] = dict(meta)
    return out


def bert_config_from_hf(data: Mapping[str, Any], where: str = CONFIG_FILE) -> BertConfig:
    """The :class:`BertConfig` of a Hugging Face BERT ``config.json``.

    Raises:
        ValueError: a key is missing, or the model is not one our BERT computes (activation,
            position embedding type), naming the key.
    """
    if data.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{where}: hidden_act={data['hidden_act']!r}; this BERT uses exact GELU (gelu)")
    if data.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}: position_embedding_type={data['position_embedding_type']!r}; only absolute")
    names = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
             "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
             "max_position_embeddings": "max_position_embeddings", "type_vocab_size": "type_vocab_size",
             "hidden_dropout": "hidden_dropout_prob", "attention_dropout": "attention_probs_dropout_prob",
             "layer_norm_eps": "layer_norm_eps", "initializer_range": "initializer_range"}
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)}; not a BERT config.json")
    return BertConfig(**{ours: data[theirs] for ours, theirs in names.items() if theirs in data})


def is_model_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding ``config.json`` and ``model.safetensors``."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def write_model_folder(folder: str | os.PathLike, state_dict: Mapping[str, Tensor], config: BertConfig,
                       vocab: str | os.PathLike | None = None, meta: Mapping[str, Any] | None = None) -> Path:
    """Write a model folder so that it appears whole or not at all.

    The files go to a new sibling folder, are fsynced, and the folder is renamed into place; a
    folder already there is moved aside first and deleted after (a crash in between leaves the
    old one beside, never a half-written one under the name).

    Args:
        folder: where the folder goes (created; replaced when it exists).
        state_dict: merged HF names -> tensors (``merge_stage_state_dicts``), any device.
        config: the architecture.
        vocab: a ``vocab.txt`` to copy in, or None.
        meta: our notes for ``config.json`` (e.g. ``trained_steps``, ``seq_len``).

    Returns:
        The folder.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # plain mkdir: the umask applies (a shared file system's group can read it)
    try:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items() if k not in _ALIASES}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config_dict(config, meta), indent=2) + "\n", encoding="utf-8")
        if vocab is not None:
            shutil.copyfile(vocab, tmp / VOCAB_FILE)
        mode = usual_file_mode()
        for path in tmp.iterdir():
            os.chmod(path, mode)  # safetensors writes 0600: give the files the usual umask's mode
            fsync_path(path)
        old = None
        if folder.exists():
            old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(folder, old)
        os.replace(tmp, folder)
        fsync_path(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def read_model_folder(folder: str | os.PathLike) -> ModelFolder:
    """Read a folder written by :func:`write_model_folder` (or HF's ``save_pretrained`` of a BERT).

    Raises:
        ValueError: a file is missing or unreadable, naming it.
    """
    folder = Path(folder)
    if not is_model_folder(folder):
        raise ValueError(f"{folder}: no {CONFIG_FILE} and {WEIGHTS_FILE}; not a model folder")
    try:
        data = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder}: unreadable {CONFIG_FILE} or {WEIGHTS_FILE} ({err})") from None
    except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
        raise ValueError(f"{folder}/{WEIGHTS_FILE}: not a safetensors file ({err})") from None
    config = bert_config_from_hf(data, str(folder / CONFIG_FILE))
    for alias, canonical in _CANONICAL.items():  # a file that kept the other name of a tied pair
        if canonical not in tensors and alias in tensors:
            tensors[canonical] = tensors[alias]
    merged = merge_stage_state_dicts([{k: v for k, v in tensors.items() if k not in _ALIASES}])
    vocab = folder / VOCAB_FILE
    meta = data.get(_META_KEY) if isinstance(data.get(_META_KEY), dict) else {}
    return ModelFolder(merged, config, vocab if vocab.is_file() else None, dict(meta))
