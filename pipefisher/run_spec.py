"""What a run's config says about its model and its data: the :class:`~pipefisher.model.BertConfig`
(:func:`bert_config`), the pretraining data source (:func:`data_source`) and how a step's
micro-batches are cut from it (:func:`data_plan`). The worker, the planner's view of a run, the
tests' single-process reference and the benchmarks build from these alone."""

from __future__ import annotations

from pipefisher.config import TrainConfig
from pipefisher.data import PretrainingSource, build_source
from pipefisher.model import BertConfig

__all__ = ["bert_config", "data_source", "data_plan"]


def bert_config(cfg: TrainConfig) -> BertConfig:
    """The model's :class:`BertConfig` from the run config."""
    m = cfg.model
    return BertConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        intermediate_size=m.intermediate_size or 4 * m.hidden_size,
        max_position_embeddings=m.max_position_embeddings,
        type_vocab_size=m.type_vocab_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
    )


def data_source(cfg: TrainConfig) -> PretrainingSource:
    """The run's pretraining data source (identical on every worker: a function of the seed)."""
    return build_source(
        cfg.data.kind,
        path=cfg.data.path,
        seq_len=cfg.data.seq_len,
        max_predictions=cfg.data.max_predictions,
        vocab_size=cfg.model.vocab_size,
        seed=cfg.seed,
        num_samples=cfg.data.num_samples,
    )


def data_plan(cfg: TrainConfig) -> dict[str, int]:
    """Keyword arguments of :func:`pipefisher.data.get_micro_batch` for this run."""
    return {
        "micro_batch_size": cfg.micro_batch_size,
        "num_micro_batches": cfg.num_micro_batches,
        "dp_width": cfg.data_replicas,  # sdp replicas see different data too
    }
