"""``init_from=<weights>``: start a run from trained weights only, with a new optimizer state and
learning-rate schedule (NVIDIA's BERT phase 2: sequence 512 from the phase-1 weights).

Entry point: :func:`load_initial_weights`, called by every worker on its stage replicas before the
first step (a resumed run's checkpoint then replaces them: ``resume`` wins over ``init_from``).

[Note: position embeddings beyond phase 1]
NVIDIA's phase 1 already allocates ``max_position_embeddings=512`` rows and trains the first 128,
so its phase 2 takes the table whole. A phase 1 run with a smaller table
(``model.max_position_embeddings=128``) gets the same treatment as far as it can: the learned rows
are copied and the rows beyond them keep this run's own initialization, the values a fresh model
would start with (normal(0, initializer_range) from the embeddings' generator). The log says so.
A table larger than this run's is refused (the rows would be dropped): raise
``model.max_position_embeddings`` instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import Tensor

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.model import BertStage, load_hf_state_dict
from pipefisher.run_spec import bert_config
from pipefisher.runtime.checkpoint_io import CheckpointError
from pipefisher.runtime.saved_weights import SavedWeights, read_saved_weights

__all__ = ["POSITION_EMBEDDINGS_NAME", "check_architecture", "extend_positions", "load_initial_weights"]

log = logging.getLogger(__name__)

POSITION_EMBEDDINGS_NAME = "bert.embeddings.position_embeddings.weight"
# Architecture fields the weights must share with the run, as (BertConfig field, model.* key).
_SAME = (("num_layers", "num_layers"), ("hidden_size", "hidden_size"), ("num_heads", "num_heads"),
         ("intermediate_size", "intermediate_size"), ("vocab_size", "vocab_size"),
         ("type_vocab_size", "type_vocab_size"))


def check_architecture(cfg: TrainConfig, saved: SavedWeights) -> None:
    """Refuse weights of another architecture, naming the first differing ``model.*`` field.

    Raises:
        ConfigError: a field differs, or the weights have more positions than this run's model.
    """
    ours = bert_config(cfg)
    for field, key in _SAME:
        theirs, mine = getattr(saved.config, field), getattr(ours, field)
        if theirs != mine:
            raise ConfigError(f"init_from={cfg.init_from}: model.{key}={mine}, but the weights in {saved.source} "
                              f"have {theirs}; use the model they were trained with (model.{key}={theirs})")
    rows = saved.config.max_position_embeddings
    if rows > ours.max_position_embeddings:
        raise ConfigError(f"init_from={cfg.init_from}: the weights have {rows} positions, "
                          f"model.max_position_embeddings={ours.max_position_embeddings}; set "
                          f"model.max_position_embeddings={rows}")


def extend_positions(learned: Tensor, fresh: Tensor) -> Tensor:
    """The position table ``fresh`` [P_new, H] with its first rows replaced by ``learned`` [P_old, H]
    (P_old <= P_new): see [Note: position embeddings beyond phase 1]."""
    out = fresh.detach().clone()
    out[: learned.shape[0]] = learned.to(out.dtype)
    return out


def load_initial_weights(cfg: TrainConfig, modules: Mapping[object, BertStage], log_here: bool = True) -> SavedWeights:
    """Fill this worker's stage replicas with the weights ``cfg.init_from`` names.

    Args:
        modules: the stage replicas, as built (freshly initialized).
        log_here: log what was loaded (rank 0).

    Returns:
        The weights read.

    Raises:
        ConfigError: nothing readable at ``init_from``, or weights of another architecture
            (naming the field).
    """
    assert cfg.init_from is not None
    try:
        saved = read_saved_weights(cfg.init_from)
    except CheckpointError as err:  # a ConfigError names the field (and the launcher prints it in one line)
        raise ConfigError(f"init_from={cfg.init_from}: {err}") from None
    check_architecture(cfg, saved)
    state = dict(saved.state_dict)
    learned_rows = state[POSITION_EMBEDDINGS_NAME].shape[0]
    taken = 0
    for stage in modules.values():
        source = state
        if stage.bert.embeddings is not None and learned_rows < cfg.model.max_position_embeddings:
            fresh = stage.bert.embeddings.position_embeddings.weight
            source = {**state, POSITION_EMBEDDINGS_NAME: extend_positions(state[POSITION_EMBEDDINGS_NAME], fresh)}
        try:
            with torch.no_grad():
                load_hf_state_dict(stage, source)
        except (KeyError, ValueError) as err:
            raise ConfigError(f"init_from={cfg.init_from}: {err.args[0] if err.args else err}") from None
        taken += len(stage.state_dict())
    if log_here:
        steps = f"after {saved.trained_steps} steps" if saved.trained_steps else "of unknown training"
        at = f" at seq_len {saved.seq_len}" if saved.seq_len else ""
        log.info("init_from: weights %s%s from %s (%d tensors in this worker's stages); new optimizer state and "
                 "learning-rate schedule, step 0 of %d at data.seq_len=%d", steps, at, saved.source, taken, cfg.steps,
                 cfg.data.seq_len)
        if learned_rows < cfg.model.max_position_embeddings:
            log.info("init_from: position embeddings extended from %d to %d rows: rows %d..%d start as a fresh "
                     "model's (the learned %d rows are kept)", learned_rows, cfg.model.max_position_embeddings,
                     learned_rows, cfg.model.max_position_embeddings - 1, learned_rows)
    return saved
