"""The batch contract, the shared batch plan, and batch validation.

Every pipeline stage runs in its own process and must see the same micro-batch (the last stage's
labels must match the first stage's inputs), and a resumed run must see the batches it would have
seen. So no stage iterates a loader: each asks for a micro-batch by its coordinates,

    get_micro_batch(source, step, micro_batch, dp_rank, **plan)

and the answer is a pure function of (source seed, step, micro-batch, data-parallel rank). The
plan lays the global sample stream out as

    step 0                                   step 1
    | dp 0: mb 0, mb 1, ... | dp 1: mb 0 ... | dp 0: mb 0 ...
    ^ each micro-batch is `micro_batch_size` consecutive global sample indices

and a source maps a global sample index (any non-negative int; indices past one epoch wrap into
later, differently shuffled epochs) to a sample.

Shape legend: B micro-batch size, S sequence length, P max masked predictions per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = [
    "BATCH_KEYS",
    "BERT_VOCAB_SIZE",
    "CLS_ID",
    "DataError",
    "MASK_ID",
    "PAD_ID",
    "PretrainingSource",
    "SEP_ID",
    "UNK_ID",
    "check_batch",
    "get_micro_batch",
    "micro_batch_indices",
    "stored_positions",
]

# Special token ids as in bert-base-uncased's vocab.txt. `prepare` lays out a trained vocabulary
# the same way ([PAD], [unused0..98], [UNK], [CLS], [SEP], [MASK]), so these hold for it too.
PAD_ID = 0
UNK_ID = 100
CLS_ID = 101
SEP_ID = 102
MASK_ID = 103
BERT_VOCAB_SIZE = 30522

#: Keys of a batch; all values are torch.long.
BATCH_KEYS: tuple[str, ...] = (
    "input_ids",  # (B, S) token ids, 0-padded
    "segment_ids",  # (B, S) 0 for [CLS] A [SEP], 1 for B [SEP], 0 on padding
    "input_mask",  # (B, S) 1 = real token, 0 = padding
    "masked_lm_positions",  # (B, P) positions of masked tokens, 0-padded
    "masked_lm_ids",  # (B, P) original ids at those positions, 0 where padding
    "next_sentence_labels",  # (B,) 1 = sentence B is random, 0 = B continues A
)


class DataError(ValueError):
    """Bad training data or a data setting that does not match the data; the message names the
    file (where there is one), the field, and the fix."""


@runtime_checkable
class PretrainingSource(Protocol):
    """A finite, seeded set of BERT pretraining samples addressed by global index.

    ``get_samples`` must be a pure function of the indices (and the seed the source was built
    with): two independently constructed sources with the same arguments return identical
    tensors. Index ``i`` lies in epoch ``i // len(source)``; each epoch visits every sample once,
    in an order that depends on the seed and the epoch.
    """

    seq_len: int
    max_predictions: int
    vocab_size: int

    def __len__(self) -> int: ...

    def get_samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]: ...


def _check_plan(
    step: int,
    micro_batch: int,
    dp_rank: int,
    micro_batch_size: int,
    num_micro_batches: int,
    dp_width: int,
) -> None:
    for name, value in (
        ("micro_batch_size", micro_batch_size),
        ("num_micro_batches", num_micro_batches),
        ("dp_width", dp_width),
    ):
        if value < 1:
            raise ValueError(f"{name}={value}: must be at least 1")
    if step < 0:
        raise ValueError(f"step={step}: must be non-negative")
    if not 0 <= micro_batch < num_micro_batches:
        raise ValueError(
            f"micro_batch={micro_batch}: must be in [0, num_micro_batches={num_micro_batches})"
        )
    if not 0 <= dp_rank < dp_width:
        raise ValueError(f"dp_rank={dp_rank}: must be in [0, dp_width={dp_width})")


def stored_positions(positions: Sequence[int], size: int) -> np.ndarray:
    """``positions`` as an int64 array, checked to lie in ``[0, size)`` (a source's storage order).

    Raises:
        ValueError: a position outside ``[0, size)``.
    """
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if pos.size and not (0 <= pos.min() and pos.max() < size):
        raise ValueError(f"positions must lie in [0, {size}), got [{int(pos.min())}, {int(pos.max())}]")
    return pos


def micro_batch_indices(
    step: int,
    micro_batch: int,
    dp_rank: int,
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    dp_width: int,
) -> list[int]:
    """Global sample indices of one micro-batch.

    Args:
        step: optimizer step, from 0.
        micro_batch: micro-batch index within the step, in ``[0, num_micro_batches)``.
        dp_rank: data-parallel replica, in ``[0, dp_width)``.
        micro_batch_size: samples per micro-batch.
        num_micro_batches: micro-batches per step per data-parallel replica.
        dp_width: number of data-parallel replicas (pipelines fed different data).

    Returns:
        ``micro_batch_size`` consecutive indices starting at
        ``((step * dp_width + dp_rank) * num_micro_batches + micro_batch) * micro_batch_size``.
        Each step consumes ``micro_batch_size * num_micro_batches * dp_width`` samples, disjoint
        from every other step's.

    Raises:
        ValueError: a coordinate is out of range.
    """
    _check_plan(step, micro_batch, dp_rank, micro_batch_size, num_micro_batches, dp_width)
    base = ((step * dp_width + dp_rank) * num_micro_batches + micro_batch) * micro_batch_size
    return list(range(base, base + micro_batch_size))


def get_micro_batch(
    source: PretrainingSource,
    step: int,
    micro_batch: int,
    dp_rank: int,
    *,
    micro_batch_size: int,
    num_micro_batches: int,
    dp_width: int,
) -> dict[str, torch.Tensor]:
    """The micro-batch at given coordinates; identical in every process that asks.

    Args:
        source: where samples come from (`build_source`).
        step, micro_batch, dp_rank, micro_batch_size, num_micro_batches, dp_width: as in
            `micro_batch_indices`.

    Returns:
        A batch (keys `BATCH_KEYS`, all ``torch.long``) of ``micro_batch_size`` samples.
    """
    indices = micro_batch_indices(
        step,
        micro_batch,
        dp_rank,
        micro_batch_size=micro_batch_size,
        num_micro_batches=num_micro_batches,
        dp_width=dp_width,
    )
    return source.get_samples(indices)


def check_batch(
    batch: Mapping[str, torch.Tensor],
    *,
    seq_len: int,
    max_predictions: int,
    vocab_size: int,
) -> None:
    """Check a batch against the batch contract (keys, dtypes, shapes, value ranges).

    Args:
        batch: the batch to check.
        seq_len: expected S.
        max_predictions: expected P.
        vocab_size: token ids must lie in ``[0, vocab_size)``.

    Raises:
        DataError: naming the first field that breaks the contract.
    """
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise DataError(f"batch is missing fields {missing}; a batch has {list(BATCH_KEYS)}")
    size = batch["next_sentence_labels"].shape[0] if batch["next_sentence_labels"].dim() else -1
    shapes = {
        "input_ids": (size, seq_len),
        "segment_ids": (size, seq_len),
        "input_mask": (size, seq_len),
        "masked_lm_positions": (size, max_predictions),
        "masked_lm_ids": (size, max_predictions),
        "next_sentence_labels": (size,),
    }
    for key, shape in shapes.items():
        t = batch[key]
        if t.dtype != torch.long:
            raise DataError(f"batch field {key!r} has dtype {t.dtype}; expected torch.long")
        if tuple(t.shape) != shape:
            raise DataError(f"batch field {key!r} has shape {tuple(t.shape)}; expected {shape}")
    if size == 0:
        return
    ranges = {
        "input_ids": vocab_size,
        "masked_lm_ids": vocab_size,
        "masked_lm_positions": seq_len,
        "segment_ids": 2,
        "input_mask": 2,
        "next_sentence_labels": 2,
    }
    for key, bound in ranges.items():
        lo, hi = int(batch[key].min()), int(batch[key].max())
        if lo < 0 or hi >= bound:
            raise DataError(
                f"batch field {key!r} has values in [{lo}, {hi}]; expected [0, {bound})"
            )
