"""BERT pretraining data: the batch plan every pipeline stage shares, and its sources.

Entry points: `build_source` (config -> `PretrainingSource`) and `get_micro_batch` (the same
micro-batch in every stage's process, from (seed, step, micro-batch, dp rank) alone); for
held-out evaluation `build_eval_source` and `eval_micro_batch` (`pipefisher.data.heldout`).
Sources: `SyntheticSource` (generated, learnable, no files) and `Hdf5Source` (NVIDIA-format
shards). ``pipefisher-prepare`` (`pipefisher.data.prepare`) makes shards from text.
"""

from __future__ import annotations

from typing import Any

from pipefisher.data.batches import (
    BATCH_KEYS,
    BERT_VOCAB_SIZE,
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    UNK_ID,
    DataError,
    PretrainingSource,
    check_batch,
    get_micro_batch,
    micro_batch_indices,
)
from pipefisher.data.hdf5 import NVIDIA_DTYPES, Hdf5Source, check_widths, find_shards
from pipefisher.data.heldout import (
    HELDOUT_DIR,
    HeldoutSource,
    build_eval_source,
    check_eval_batches,
    eval_micro_batch,
    heldout_path,
    num_eval_micro_batches,
    split_documents,
)
from pipefisher.data.synthetic import HELDOUT_FIRST_ID, SyntheticSource

__all__ = [
    "BATCH_KEYS",
    "BERT_VOCAB_SIZE",
    "CLS_ID",
    "HELDOUT_DIR",
    "HELDOUT_FIRST_ID",
    "MASK_ID",
    "NVIDIA_DTYPES",
    "PAD_ID",
    "SEP_ID",
    "SOURCE_KINDS",
    "UNK_ID",
    "DataError",
    "Hdf5Source",
    "HeldoutSource",
    "PretrainingSource",
    "SyntheticSource",
    "build_eval_source",
    "build_source",
    "check_batch",
    "check_eval_batches",
    "eval_micro_batch",
    "find_shards",
    "get_micro_batch",
    "heldout_path",
    "micro_batch_indices",
    "num_eval_micro_batches",
    "split_documents",
]

#: Kinds accepted by `build_source`.
SOURCE_KINDS: tuple[str, ...] = ("synthetic", "hdf5")


def build_source(
    kind: str,
    *,
    path: str | None,
    seq_len: int,
    max_predictions: int,
    vocab_size: int,
    seed: int,
    **kw: Any,
) -> PretrainingSource:
    """Build a pretraining source from config values (before any worker starts, to fail early).

    Args:
        kind: ``"synthetic"`` (generated on the fly, learnable structure) or ``"hdf5"``
            (NVIDIA-format shards made by ``pipefisher-prepare`` or NVIDIA's scripts).
        path: hdf5 file or directory of shards; required for ``"hdf5"``, ignored otherwise.
        seq_len: S the model expects; hdf5 shards must match it.
        max_predictions: P the model expects; hdf5 shards must match it.
        vocab_size: the model's vocabulary size; every token id must be below it.
        seed: seeds the sample order (and, for synthetic data, the samples themselves).
        **kw: kind-specific options: `SyntheticSource`'s ``num_samples``, ``num_topics``, ...;
            `Hdf5Source`'s ``cache_shards`` (``num_samples`` is ignored there: an epoch is
            every sample of the shards).

    Returns:
        A `PretrainingSource`.

    Raises:
        ValueError: unknown kind (the message lists the valid ones) or bad option value.
        TypeError: an option the kind does not take.
        DataError: the data is missing or malformed, or does not match S, P or the vocabulary.
    """
    if kind == "synthetic":
        return SyntheticSource(seq_len, max_predictions, vocab_size, seed, **kw)
    if kind == "hdf5":
        if not path:
            raise DataError(
                "data kind 'hdf5' needs a path: set data.path to a directory of *.hdf5 shards "
                "(make them with `pipefisher-prepare`) or use kind 'synthetic'"
            )
        # `num_samples` sizes a synthetic epoch; a config passes it whatever the kind, and for
        # shards the epoch is the number of samples they hold.
        kw.pop("num_samples", None)
        source = Hdf5Source(path, seed, vocab_size=vocab_size, **kw)
        check_widths(source, seq_len, max_predictions)
        return source
    raise ValueError(f"unknown data source kind {kind!r}; valid kinds: {list(SOURCE_KINDS)}")
