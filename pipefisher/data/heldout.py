"""Held-out evaluation data: the same micro-batches at every evaluation, in every process.

A held-out micro-batch is addressed by its index alone: micro-batch ``k`` holds the samples at
storage positions ``k*B .. k*B+B-1`` of the held-out source (``get_stored_samples``: no epoch
shuffle, no seed), so it does not depend on the step, the training order, the run's seed or the
pipeline placement, and every stage's process reads the same one.

Where the held-out samples come from:

- hdf5: shards of documents training never saw: ``data.eval_path``, or the ``heldout/`` folder
  that ``pipefisher-prepare --holdout-fraction F`` writes beside the training shards
  (`heldout_path`; the split is by document, `split_documents`).
- synthetic: the training language (same ``language_seed`` and sizes) sampled at ids from
  `HELDOUT_FIRST_ID` = 2**62 on, with a fixed generator key word 0. A training source's sample ids
  are ``perm_e(r) < num_samples <= 2**62`` in every epoch, so no training sample, for any seed and
  any number of steps, is drawn from a held-out sample's (key, id) Philox stream.

Entry points: `build_eval_source`, `eval_micro_batch`, `num_eval_micro_batches` (and
`check_eval_batches` to refuse too large an ``eval.batches`` before workers start).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from pipefisher.data.batches import DataError, PretrainingSource
from pipefisher.data.hdf5 import SHARD_SUFFIXES, Hdf5Source, check_widths
from pipefisher.data.synthetic import HELDOUT_FIRST_ID, SyntheticSource

__all__ = [
    "HELDOUT_DIR",
    "HeldoutSource",
    "build_eval_source",
    "check_eval_batches",
    "eval_micro_batch",
    "heldout_path",
    "num_eval_micro_batches",
    "split_documents",
]

#: Folder beside the training shards where ``pipefisher-prepare --holdout-fraction`` writes.
HELDOUT_DIR = "heldout"
_HELDOUT_SYNTHETIC_SEED = 0  # Philox key word 0 of held-out synthetic samples, whatever the run's seed
_FIX_PREPARE = "python -m pipefisher.data.prepare ... --holdout-fraction 0.05"


@runtime_checkable
class HeldoutSource(PretrainingSource, Protocol):
    """A `PretrainingSource` that also reads samples in a fixed storage order."""

    def get_stored_samples(self, positions: Sequence[int]) -> dict[str, torch.Tensor]: ...


def heldout_path(train_path: str | Path) -> Path | None:
    """The held-out shards `pipefisher-prepare` wrote beside training shards, if any.

    Args:
        train_path: the training shards' directory, or one shard file in it.

    Returns:
        ``<dir>/heldout`` when it is a directory holding ``*.hdf5``/``*.h5`` files, else ``None``.
    """
    p = Path(train_path)
    folder = (p if p.is_dir() else p.parent) / HELDOUT_DIR
    if folder.is_dir() and any(q.is_file() and q.suffix in SHARD_SUFFIXES for q in folder.iterdir()):
        return folder
    return None


def split_documents(num_documents: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded document-level split: about ``fraction`` of the documents (at least one when
    ``fraction > 0``) are held out.

    Args:
        num_documents: documents in input order.
        fraction: in ``[0, 1)``.
        seed: the preparation's ``--seed``; the same seed gives the same split.

    Returns:
        ``(train, heldout)``: sorted, disjoint document indices covering ``range(num_documents)``.

    Raises:
        ValueError: ``fraction`` outside ``[0, 1)``.
        DataError: holding out leaves no training document.
    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"--holdout-fraction {fraction!r}: must lie in [0, 1) "
                         "(e.g. 0.05; 0 = no held-out split)")
    k = max(1, round(fraction * num_documents)) if fraction > 0 else 0
    if k and num_documents - k < 1:
        raise DataError(f"--holdout-fraction {fraction}: the input has {num_documents} document(s), "
                        f"and holding out {k} leaves none for training; give more text (a blank line "
                        "separates documents) or use --holdout-fraction 0")
    held = sorted(random.Random(f"holdout:{seed}").sample(range(num_documents), k))
    chosen = set(held)
    return [d for d in range(num_documents) if d not in chosen], held


def build_eval_source(
    kind: str,
    *,
    path: str | None,
    eval_path: str | None,
    seq_len: int,
    max_predictions: int,
    vocab_size: int,
    seed: int,
    num_samples: int,
    **kw: Any,
) -> HeldoutSource:
    """The held-out source of a run (arguments as `pipefisher.data.build_source` gets them).

    Args:
        kind: ``"synthetic"`` or ``"hdf5"``.
        path: the training shards (hdf5), where ``heldout/`` is looked for without ``eval_path``.
        eval_path: held-out shards (file or directory); hdf5 only.
        seq_len, max_predictions, vocab_size: as the model expects; held-out shards must match.
        seed: the run's seed. The held-out samples do not depend on it (runs with different seeds
            are evaluated on the same batches); hdf5 sources need one but are read unshuffled.
        num_samples: synthetic: size of the held-out set; ignored for hdf5 (every stored sample).
        **kw: kind-specific options, the same as training's (synthetic: ``language_seed``,
            ``num_topics``, ...: the same language; hdf5: ``cache_shards``).

    Returns:
        A `HeldoutSource`; read it with `eval_micro_batch`.

    Raises:
        DataError: no held-out shards (the message names ``data.eval_path`` and
            ``--holdout-fraction``), ``eval_path`` with synthetic data, or shards whose S, P or
            token ids do not match.
        ValueError: unknown kind.
    """
    if kind == "synthetic":
        if eval_path:
            raise DataError(f"data.eval_path={eval_path!r}: synthetic data has its own held-out stream; "
                            "unset data.eval_path, or use data=hdf5")
        return SyntheticSource(seq_len, max_predictions, vocab_size, _HELDOUT_SYNTHETIC_SEED, num_samples,
                               first_sample_id=HELDOUT_FIRST_ID, **kw)
    if kind == "hdf5":
        if eval_path:
            if not Path(eval_path).exists():
                raise DataError(f"data.eval_path={eval_path!r}: no such file or directory; give held-out "
                                f"shards, or unset it to use the heldout/ folder `{_FIX_PREPARE}` writes")
            where: Path | None = Path(eval_path)
        else:
            where = heldout_path(path) if path else None
        if where is None:
            raise DataError(f"data.path={path!r} has no {HELDOUT_DIR}/ folder of held-out shards beside "
                            "it; set data.eval_path=<held-out shards>, or prepare the data again with "
                            f"`{_FIX_PREPARE}`")
        source = Hdf5Source(where, seed, vocab_size=vocab_size, **kw)
        check_widths(source, seq_len, max_predictions)
        return source
    raise ValueError(f"unknown data source kind {kind!r}; valid kinds: ['synthetic', 'hdf5']")


def num_eval_micro_batches(source: HeldoutSource, micro_batch_size: int) -> int:
    """How many distinct held-out micro-batches of ``micro_batch_size`` the source holds."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size}: must be at least 1")
    return len(source) // micro_batch_size


def check_eval_batches(source: HeldoutSource, batches: int, micro_batch_size: int) -> None:
    """Refuse an ``eval.batches`` the held-out set cannot fill (call it before workers start).

    Raises:
        DataError: naming ``eval.batches``, the micro-batches the set holds and the fixes.
    """
    have = num_eval_micro_batches(source, micro_batch_size)
    if batches > have:
        where = getattr(source, "path", "the synthetic held-out set")
        raise DataError(f"eval.batches={batches}: the held-out set ({where}, {len(source)} samples) "
                        f"holds {have} micro-batches of micro_batch_size={micro_batch_size}; use "
                        f"eval.batches<={have}, or hold out more documents (`{_FIX_PREPARE}`)")


def eval_micro_batch(source: HeldoutSource, index: int, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """The ``index``-th held-out micro-batch: storage positions ``index*B .. index*B+B-1``.

    Args:
        source: from `build_eval_source`.
        index: in ``[0, num_eval_micro_batches(source, micro_batch_size))``.
        micro_batch_size: B.

    Returns:
        A batch as `pipefisher.data.get_micro_batch` returns it (keys `BATCH_KEYS`, ``torch.long``).

    Raises:
        DataError: the held-out set holds fewer than ``index + 1`` micro-batches.
    """
    if index < 0:
        raise ValueError(f"index={index}: must be non-negative")
    check_eval_batches(source, index + 1, micro_batch_size)
    start = index * micro_batch_size
    return source.get_stored_samples(range(start, start + micro_batch_size))
