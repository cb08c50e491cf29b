"""Task heads on the pretraining encoder (``pipefisher.model``), not a second BERT.

Shape legend:
    B  batch size (sequences)
    S  sequence length (tokens)
    H  hidden size
    C  classes

:class:`FinetuneModel` holds one :class:`~pipefisher.model.BertStage` spanning the embeddings,
every encoder layer and the pooler (its ``bert.*`` parameters keep their Hugging Face names, so
pretraining checkpoints load by name); the pretraining heads (MLM, NSP) are dropped. On top:

* classification: dropout and a Linear on the pooled [CLS] state (``BertForSequenceClassification``);
* span: a Linear H -> 2 on every token's state giving start and end logits
  (``BertForQuestionAnswering``'s ``qa_outputs``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipefisher.model import BertConfig, BertStage

__all__ = ["FinetuneModel"]


def _head_generator(seed: int) -> torch.Generator:
    digest = hashlib.sha256(f"pipefisher-finetune-head:{seed}".encode()).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator


class FinetuneModel(nn.Module):
    """BERT encoder + pooler from :mod:`pipefisher.model` with a classification or span head.

    Args:
        config: the encoder's hyper-parameters.
        kind: ``"classification"`` or ``"span"``.
        num_labels: classes (classification only).
        seed: seed of the encoder's random init (see ``BertStage``) and of the head's.
        recompute: recompute encoder-layer activations in the backward pass.
        classifier_dropout: dropout before the classifier; None = ``config.hidden_dropout``.
    """

    def __init__(
        self,
        config: BertConfig,
        kind: str,
        num_labels: int = 2,
        seed: int = 0,
        recompute: bool = False,
        classifier_dropout: float | None = None,
    ) -> None:
        super().__init__()
        if kind not in ("classification", "span"):
            raise ValueError(f"task.kind={kind!r}: choose classification or span")
        self.kind = kind
        self.config = config
        self.stage = BertStage(config, 0, config.num_pipeline_layers - 1, seed=seed, recompute=recompute)
        self.stage.cls = None  # MLM and NSP heads: pretraining only
        assert self.stage.bert.pooler is not None
        hidden = config.hidden_size
        self.dropout = nn.Dropout(config.hidden_dropout if classifier_dropout is None else classifier_dropout)
        head = nn.Linear(hidden, num_labels if kind == "classification" else 2)
        with torch.no_grad():
            head.weight.normal_(0.0, config.initializer_range, generator=_head_generator(seed))
            head.bias.zero_()
        if kind == "classification":
            self.classifier = head
        else:
            self.qa_outputs = head

    def encoder_state_dict(self) -> dict[str, Tensor]:
        """The encoder's and pooler's weights under their Hugging Face names (``bert.*``)."""
        return dict(self.stage.state_dict())

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        """Logits: [B,C] for classification, [B,S,2] (start, end) for spans."""
        hidden = self.stage.encode(None, batch)  # [B,S,H]
        if self.kind == "classification":
            assert self.stage.bert.pooler is not None
            pooled = self.stage.bert.pooler(hidden)  # [B,H]
            return self.classifier(self.dropout(pooled))  # [B,C]
        return self.qa_outputs(hidden)  # [B,S,2]

    def loss(self, logits: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
        """Mean cross-entropy, fp32: of the labels, or half start + half end position loss.

        Span logits at padding positions are masked out of the softmax.
        """
        logits = logits.float()
        if self.kind == "classification":
            return F.cross_entropy(logits, batch["labels"])
        start, end = self.span_logits(logits, batch["input_mask"])
        return 0.5 * (F.cross_entropy(start, batch["start_positions"]) + F.cross_entropy(end, batch["end_positions"]))

    @staticmethod
    def span_logits(logits: Tensor, input_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Split [B,S,2] logits into start and end [B,S] (fp32), padding positions at -1e4 below."""
        logits = logits.float()
        pad = (input_mask == 0).to(logits.dtype) * -1e4  # [B,S]
        return logits[..., 0] + pad, logits[..., 1] + pad
