"""The BERT architecture's hyper-parameters and the standard sizes (DESIGN.md, "BERT sizes").

This is the model's own runtime config: plain Python, no Hydra. The Hydra schema (``pipefisher.config``)
builds one of these, e.g. ``BertConfig.from_size(cfg.model.size, vocab_size=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["BertConfig", "BertSize", "BERT_SIZES"]


class BertSize(NamedTuple):
    """One row of the BERT size table: L layers / H hidden / A attention heads (FFN is 4H)."""

    num_layers: int
    hidden_size: int
    num_heads: int


# DESIGN.md, "BERT sizes" (Turc et al. 2019 for the small ones; Devlin et al. 2019 for base/large).
BERT_SIZES: dict[str, BertSize] = {
    "tiny": BertSize(2, 128, 2),
    "mini": BertSize(4, 256, 4),
    "small": BertSize(4, 512, 8),
    "medium": BertSize(8, 512, 8),
    "base": BertSize(12, 768, 12),
    "large": BertSize(24, 1024, 16),
}


def tp_splits(num_heads: int, ffn_width: int, tp: int) -> bool:
    """Whether tensor parallel over ``tp`` ranks gives each rank whole heads and an equal part of the
    FFN width (Megatron's split)."""
    return num_heads % tp == 0 and ffn_width % tp == 0


@dataclass
class BertConfig:
    """BERT hyper-parameters; defaults are bert-base.

    Attributes:
        vocab_size: V, number of word-piece tokens (30522 for the uncased English vocabulary).
        hidden_size: H, width of every hidden state.
        num_layers: L, number of encoder layers.
        num_heads: A, attention heads per layer; must divide ``hidden_size``.
        intermediate_size: FFN inner width; ``None`` means 4H.
        max_position_embeddings: longest sequence the position table covers.
        type_vocab_size: number of segment ids (2: sentence A / sentence B).
        hidden_dropout: dropout probability on embeddings and on each sub-layer's output.
        attention_dropout: dropout probability on the attention probabilities.
        layer_norm_eps: LayerNorm epsilon.
        initializer_range: standard deviation of the normal initialization of weights.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int | None = None
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_heads={self.num_heads}: choose num_heads dividing hidden_size"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"model.{name}={value!r} must be in [0, 1)")

    @classmethod
    def from_size(cls, size: str, **overrides: Any) -> BertConfig:
        """Build the config of a named size.

        Args:
            size: a key of ``BERT_SIZES`` ("tiny", "mini", "small", "medium", "base", "large").
            **overrides: any other field, e.g. ``vocab_size=1000`` or ``hidden_dropout=0.0``.

        Returns:
            The config, with the FFN width 4H unless ``intermediate_size`` is overridden.

        Raises:
            ValueError: unknown size name (the message lists the valid ones).
        """
        if size not in BERT_SIZES:
            raise ValueError(f"model.size={size!r} is unknown: use one of {sorted(BERT_SIZES)}")
        row = BERT_SIZES[size]
        fields: dict[str, Any] = {
            "num_layers": row.num_layers,
            "hidden_size": row.hidden_size,
            "num_heads": row.num_heads,
        }
        fields.update(overrides)
        return cls(**fields)

    @property
    def head_size(self) -> int:
        """Width of one attention head, H / A."""
        return self.hidden_size // self.num_heads

    @property
    def num_pipeline_layers(self) -> int:
        """L + 2: embeddings, the L encoder layers, the heads (see ``pipefisher.model.bert``)."""
        return self.num_layers + 2

    def splits_over(self, tp: int) -> bool:
        """Whether tensor parallel over ``tp`` ranks divides the heads and the FFN width (Megatron's split)."""
        return tp_splits(self.num_heads, self.intermediate_size or 4 * self.hidden_size, tp)

    def hf_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for an equivalent ``transformers.BertConfig`` (exact GELU)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "gelu",
            "hidden_dropout_prob": self.hidden_dropout,
            "attention_probs_dropout_prob": self.attention_dropout,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
            "layer_norm_eps": self.layer_norm_eps,
            "initializer_range": self.initializer_range,
        }
