"""``export.py``: a run's trained weights -> a Hugging Face model folder.

``python export.py from=<run folder | final/ | step_<n> checkpoint | export> out=<folder>`` writes
``config.json``, ``model.safetensors`` (``BertForPreTraining`` names, the stage shards of any
pipeline method merged) and ``vocab.txt`` when the run had one, so that
``transformers.BertForPreTraining.from_pretrained(out)`` gives our model's MLM and NSP logits.
What ``from`` accepts: :mod:`pipefisher.runtime.saved_weights`; the folder's layout:
:mod:`pipefisher.model.hf_format`.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipefisher.config import refuse_unknown_keys
from pipefisher.model.hf_format import write_model_folder
from pipefisher.runtime.checkpoint_io import CheckpointError
from pipefisher.runtime.saved_weights import read_saved_weights

__all__ = ["ExportConfig", "export_main", "export_weights"]

log = logging.getLogger(__name__)


@dataclass
class ExportConfig:
    """What ``export.py`` reads and where it writes (``from_`` is the key ``from``)."""

    from_: str = "???"  # key `from`: a run folder, its final/, a checkpoint step_<n> folder or an export folder
    out: str = "???"  # the model folder to write (replaced when it exists)


def export_weights(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the weights ``source`` stands for as a Hugging Face model folder ``out``.

    Raises:
        CheckpointError: nothing readable at ``source`` (the message says what was looked for).
    """
    saved = read_saved_weights(source)
    meta = {"trained_steps": saved.trained_steps, "seq_len": saved.seq_len, "exported_from": str(saved.source)}
    folder = write_model_folder(out, saved.state_dict, saved.config, vocab=saved.vocab,
                                meta={k: v for k, v in meta.items() if v is not None})
    files = ", ".join(sorted(p.name for p in folder.iterdir()))
    c = saved.config
    log.info("exported %s (L=%d, H=%d, vocab %d, %d positions%s) to %s: %s", saved.source, c.num_layers,
             c.hidden_size, c.vocab_size, c.max_position_embeddings,
             f", {saved.trained_steps} steps" if saved.trained_steps else "", folder, files)
    if saved.vocab is None:
        log.info("no vocab.txt: the run read no hdf5 shards with a vocab.txt beside them; add the vocabulary "
                 "it was trained with before using the folder with a tokenizer")
    return folder


def _schema() -> DictConfig:
    return OmegaConf.create({"from": ExportConfig.from_, "out": ExportConfig.out})


ConfigStore.instance().store(name="export_schema", node=_schema())


@hydra.main(config_path="conf", config_name="export", version_base="1.3")
def _export(dcfg: DictConfig) -> None:
    missing = [k for k in ("from", "out") if OmegaConf.is_missing(dcfg, k)]
    try:
        if missing:
            raise CheckpointError(f"{missing[0]}= is required: python export.py from=<run folder or checkpoint> "
                                  "out=<folder>")
        export_weights(str(dcfg["from"]), str(dcfg.out))
    except CheckpointError as err:
        raise SystemExit(f"export.py: {err}") from None


def export_main() -> None:
    """``export.py``: refuse unknown keys naming the closest one, then export."""
    refuse_unknown_keys(sys.argv[1:], "export.py", ExportConfig, rename={"from_": "from"})
    _export()
