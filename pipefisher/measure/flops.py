"""Model FLOPs of BERT pretraining, as PaLM's MFU counts them (Chowdhery et al. 2022, appendix B).

[Note: model FLOPs]
2 FLOPs per multiply-add of the model's matrix products, nothing else (T = B·S tokens)::

    per encoder layer   Q, K, V, attention output   4 · 2·T·H·H
                        FFN in, FFN out             2 · 2·T·H·F        (F = intermediate size)
                        scores QKᵀ, probs·V         2 · 2·B·S·S·H      (all heads together)
    pooler ([CLS] only)                             2·B·H·H
    NSP classifier                                  2·B·H·2
    MLM head at the P masked slots only             2·B·P·H·H + 2·B·P·H·V   (transform, decoder)

Embedding lookups, biases, LayerNorm, softmax, GELU, dropout and the losses count 0. This is
exactly what ``torch.utils.flop_counter.FlopCounterMode`` counts for ``BertStage`` (its
mm/addmm/bmm; tests/test_measure.py checks every size). The count is the partitioner's
(``pipefisher.model.partition.layer_costs``) without its embeddings term. A training step is 3 × forward (the
backward multiplies twice per forward product); recomputation re-runs forwards but adds no model
FLOPs, so MFU does not reward it (hardware FLOPs would).
"""

from __future__ import annotations

from pipefisher.model.config import BertConfig
from pipefisher.model.partition import layer_costs

__all__ = ["forward_flops", "train_step_flops"]


def forward_flops(bert: BertConfig, batch: int, seq_len: int, max_predictions: int) -> int:
    """Model FLOPs of one forward pass ([Note: model FLOPs]).

    Args:
        bert: the architecture (H, L, F, V).
        batch: B, sequences in the pass.
        seq_len: S, tokens per sequence.
        max_predictions: P, MLM slots per sequence (the head runs on all P, padding included).

    Returns:
        FLOPs, rounded to an integer (exact while below 2**53).
    """
    if batch < 1 or seq_len < 1 or max_predictions < 0:
        raise ValueError(f"batch={batch}, seq_len={seq_len}, max_predictions={max_predictions}: "
                         "need batch ≥ 1, seq_len ≥ 1, max_predictions ≥ 0")
    # The partitioner's per-sequence count of the same products; its first entry (the embeddings'
    # element-wise work) is no model FLOP.
    return round(batch * sum(layer_costs(bert, seq_len, max_predictions)[1:]))


def train_step_flops(bert: BertConfig, global_batch: int, seq_len: int, max_predictions: int) -> int:
    """Model FLOPs of one training step: 3 × ``forward_flops`` of the global batch.

    Args:
        bert: the architecture.
        global_batch: sequences per optimizer step, over all micro-batches and data-parallel copies.
        seq_len: S.
        max_predictions: P.

    Returns:
        FLOPs of forward + backward; recomputation is not counted ([Note: model FLOPs]).
    """
    return 3 * forward_flops(bert, global_batch, seq_len, max_predictions)
