"""Reader for NVIDIA-format BERT pretraining shards (one hdf5 file per shard).

Each shard holds (DESIGN.md, "NVIDIA pretraining hdf5"):

    input_ids             int32 (N, S)   0-padded token ids
    input_mask            int8  (N, S)   1 = real token
    segment_ids           int8  (N, S)   0 = [CLS] A [SEP], 1 = B [SEP]
    masked_lm_positions   int32 (N, P)   0-padded
    masked_lm_ids         int32 (N, P)   0 where padding
    next_sentence_labels  int8  (N,)     1 = sentence B is random

Any integer dtype is accepted on read. Global sample index ``i`` lies in epoch
``e = i // len(source)``; epoch ``e`` visits the shards in a seeded order ``perm(seed, e)``
and the samples of each shard in a seeded order ``perm(seed, e, shard)``, so a sample's location
is a pure function of (seed, i): two processes (two pipeline stages) agree without talking, and a
resumed run needs only its step. Consecutive indices stay within a shard, so only the current
shard (and the next, across a boundary) is held in memory.
`Hdf5Source.get_stored_samples` reads in storage order instead (shards by name, rows in file
order), with no seed: the fixed order of held-out batches (`pipefisher.data.heldout`).

Shard metadata (fields, dtypes, shapes) is checked for every shard when the source is built, so a
bad file stops a run before workers start; values (token ids below the vocabulary size, positions
below S, 0/1 flags) are checked, with vectorized min/max, when a shard is first loaded
(`Hdf5Source.check_all` loads and checks every shard up front).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

from pipefisher.data.batches import BATCH_KEYS, BERT_VOCAB_SIZE, DataError, stored_positions

__all__ = ["NVIDIA_DTYPES", "SHARD_SUFFIXES", "Hdf5Source", "check_widths", "find_shards", "vocab_file_near"]

log = logging.getLogger(__name__)

#: Field dtypes as NVIDIA's preparation writes them (and as `pipefisher-prepare` does).
NVIDIA_DTYPES: dict[str, type[np.integer]] = {
    "input_ids": np.int32,
    "input_mask": np.int8,
    "segment_ids": np.int8,
    "masked_lm_positions": np.int32,
    "masked_lm_ids": np.int32,
    "next_sentence_labels": np.int8,
}
#: File name endings taken as shards when a directory is given.
SHARD_SUFFIXES: tuple[str, ...] = (".hdf5", ".h5")

# Field -> its second dimension (S or P), None for 1-D fields.
_WIDTH = {
    "input_ids": "S",
    "input_mask": "S",
    "segment_ids": "S",
    "masked_lm_positions": "P",
    "masked_lm_ids": "P",
    "next_sentence_labels": None,
}
_FIX_PREPARE = (
    "prepare the data again with `pipefisher-prepare` (python -m pipefisher.data.prepare)"
)


@dataclass(frozen=True)
class _ShardInfo:
    path: Path
    num_samples: int
    seq_len: int
    max_predictions: int


def find_shards(path_or_dir: str | Path) -> list[Path]:
    """The shard files at a path: the file itself, or a directory's ``*.hdf5``/``*.h5`` files.

    Args:
        path_or_dir: one shard file or a directory of shards (not searched recursively).

    Returns:
        Shard paths, sorted by name.

    Raises:
        DataError: the path does not exist or the directory holds no shards.
    """
    path = Path(path_or_dir)
    if not path.exists():
        raise DataError(
            f"{path}: no such file or directory (data.path); point it at a directory of *.hdf5 "
            f"shards or one shard file, or {_FIX_PREPARE}"
        )
    if path.is_file():
        return [path]
    shards = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SHARD_SUFFIXES)
    if not shards:
        raise DataError(
            f"{path}: directory holds no shards (*{' / *'.join(SHARD_SUFFIXES)}); point data.path "
            f"at the directory the shards were written to, or {_FIX_PREPARE}"
        )
    return shards


def _inspect(path: Path) -> _ShardInfo:
    """Check one shard's fields, dtypes and shapes without reading its values."""
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file ({e}); {_FIX_PREPARE}") from e
    with f:
        missing = [k for k in NVIDIA_DTYPES if not isinstance(f.get(k), h5py.Dataset)]
        if missing:
            raise DataError(
                f"{path}: missing dataset(s) {missing} (found {sorted(f.keys())}); an NVIDIA "
                f"pretraining shard has {list(NVIDIA_DTYPES)}; {_FIX_PREPARE}"
            )
        sizes: dict[str, int] = {}
        n: int | None = None
        for key, width in _WIDTH.items():
            ds = f[key]
            if ds.dtype.kind not in "iu":
                raise DataError(
                    f"{path}: field {key!r} has dtype {ds.dtype}; it must be an integer type "
                    f"({np.dtype(NVIDIA_DTYPES[key]).name}); {_FIX_PREPARE}"
                )
            want_rank = 1 if width is None else 2
            if ds.ndim != want_rank:
                raise DataError(
                    f"{path}: field {key!r} has shape {ds.shape}; expected rank {want_rank} "
                    f"({'(N,)' if width is None else f'(N, {width})'}); {_FIX_PREPARE}"
                )
            if n is None:
                n = ds.shape[0]
            elif ds.shape[0] != n:
                raise DataError(
                    f"{path}: field {key!r} has {ds.shape[0]} samples but 'input_ids' has {n}; "
                    f"all fields must have the same N; {_FIX_PREPARE}"
                )
            if width is not None:
                if sizes.setdefault(width, ds.shape[1]) != ds.shape[1]:
                    first = next(k for k, w in _WIDTH.items() if w == width)
                    raise DataError(
                        f"{path}: field {key!r} has width {ds.shape[1]} but {first!r} has "
                        f"{sizes[width]}; the {width} fields must agree; {_FIX_PREPARE}"
                    )
    assert n is not None
    if sizes["S"] < 1 or sizes["P"] < 1:
        raise DataError(
            f"{path}: fields have S={sizes['S']}, P={sizes['P']}; both must be >= 1; "
            f"{_FIX_PREPARE}"
        )
    return _ShardInfo(path, n, sizes["S"], sizes["P"])


def _check_values(
    path: Path, arrays: dict[str, np.ndarray], vocab_size: int, seq_len: int
) -> None:
    """Range-check a loaded shard (vectorized: one min and max per field)."""
    bounds = {
        "input_ids": (vocab_size, "token id"),
        "masked_lm_ids": (vocab_size, "token id"),
        "masked_lm_positions": (seq_len, "position"),
        "input_mask": (2, "flag"),
        "segment_ids": (2, "flag"),
        "next_sentence_labels": (2, "flag"),
    }
    for key, (bound, what) in bounds.items():
        a = arrays[key]
        if a.size == 0:
            continue
        lo, hi = int(a.min()), int(a.max())
        if lo >= 0 and hi < bound:
            continue
        bad = int(np.argmax(((a < 0) | (a >= bound)).reshape(a.shape[0], -1).any(axis=1)))
        value = lo if lo < 0 else hi
        if what == "token id":
            fix = (
                f"the shards were made with a larger vocabulary than vocab_size={vocab_size}: "
                f"set the model's vocab_size to at least {hi + 1}, or {_FIX_PREPARE} using the "
                "model's vocab.txt"
            ) if lo >= 0 else f"the file is corrupt; {_FIX_PREPARE}"
        elif what == "position":
            fix = f"positions must index the sequence [0, {seq_len}); {_FIX_PREPARE}"
        else:
            fix = f"values must be 0 or 1; {_FIX_PREPARE}"
        raise DataError(
            f"{path}: field {key!r} has {what} {value} (sample {bad}) outside [0, {bound}); {fix}"
        )


def vocab_file_near(path: str | os.PathLike) -> Path | None:
    """The ``vocab.txt`` beside hdf5 shards (in ``path`` when it is a folder, else in its folder), as
    `pipefisher-prepare` writes it; None when there is none."""
    path = Path(path)
    vocab = (path if path.is_dir() else path.parent) / "vocab.txt"
    return vocab if vocab.is_file() else None


def _vocab_size_near(path: Path) -> int | None:
    vocab = vocab_file_near(path)
    if vocab is None:
        return None
    with vocab.open(encoding="utf-8") as f:
        return sum(1 for _ in f)


class Hdf5Source:
    """NVIDIA-format hdf5 shards as a `PretrainingSource`.

    Args:
        path_or_dir: one shard file, or a directory of ``*.hdf5``/``*.h5`` shards.
        seed: seeds the shard order and the sample order within each shard, per epoch.
        vocab_size: token ids must be below it; ``None`` takes the line count of a
            ``vocab.txt`` beside the shards (as `pipefisher-prepare` writes), else 30522.
        cache_shards: loaded shards kept in memory (least recently used is dropped).

    Raises:
        DataError: missing path, no shards, a shard with a missing field, a non-integer dtype,
            a wrong rank or inconsistent N, or S/P differing between shards.
    """

    def __init__(
        self,
        path_or_dir: str | Path,
        seed: int,
        vocab_size: int | None = None,
        *,
        cache_shards: int = 2,
    ) -> None:
        if cache_shards < 1:
            raise ValueError(f"cache_shards={cache_shards}: must be at least 1")
        self.path = Path(path_or_dir)
        self.seed = seed
        infos = [_inspect(p) for p in find_shards(self.path)]
        first = infos[0]
        for info in infos[1:]:
            for name in ("seq_len", "max_predictions"):
                if getattr(info, name) != getattr(first, name):
                    raise DataError(
                        f"{info.path}: {name}={getattr(info, name)} (width of "
                        f"{'input_ids' if name == 'seq_len' else 'masked_lm_positions'}) but "
                        f"{first.path} has {getattr(first, name)}; all shards of one run must "
                        f"agree: keep one phase's shards per directory"
                    )
        empty = [i.path.name for i in infos if i.num_samples == 0]
        if empty:
            log.warning("%s: skipping %d empty shard(s): %s", self.path, len(empty), empty)
        infos = [i for i in infos if i.num_samples > 0]
        if not infos:
            raise DataError(f"{self.path}: every shard is empty; {_FIX_PREPARE}")
        if vocab_size is None:
            vocab_size = _vocab_size_near(self.path)
            if vocab_size is None:
                vocab_size = BERT_VOCAB_SIZE
            log.info("%s: checking token ids against vocab_size=%d", self.path, vocab_size)
        else:
            used = _vocab_size_near(self.path)
            if used is not None and used < vocab_size:
                log.warning("%s: model.vocab_size=%d but the shards' vocab.txt has %d tokens: %d rows of the "
                            "embedding and the decoder are never used (and cost memory and time); set "
                            "model.vocab_size=%d", self.path, vocab_size, used, vocab_size - used, used)
        self.vocab_size = vocab_size
        self.seq_len = first.seq_len
        self.max_predictions = first.max_predictions
        self.shards: list[Path] = [i.path for i in infos]
        self._sizes = np.array([i.num_samples for i in infos], dtype=np.int64)
        self._total = int(self._sizes.sum())
        self._cache_shards = cache_shards
        self._cache: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._orders: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        log.info(
            "%s: %d shard(s), %d samples, S=%d, P=%d",
            self.path, len(self.shards), self._total, self.seq_len, self.max_predictions,
        )

    def __len__(self) -> int:
        return self._total

    @property
    def shard_sizes(self) -> list[int]:
        """Samples in each shard, in `shards` order."""
        return self._sizes.tolist()

    def _order(self, epoch: int, shard: int) -> np.ndarray:
        """Seeded permutation: of the shards (``shard == -1``) or of one shard's samples."""
        key = (epoch, shard)
        order = self._orders.get(key)
        if order is None:
            n = len(self.shards) if shard < 0 else int(self._sizes[shard])
            order = np.random.default_rng([self.seed % 2**63, epoch, shard + 1]).permutation(n)
            self._orders[key] = order
            while len(self._orders) > 2 * self._cache_shards + 2:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(key)
        return order

    def _load(self, shard: int) -> dict[str, np.ndarray]:
        arrays = self._cache.get(shard)
        if arrays is not None:
            self._cache.move_to_end(shard)
            return arrays
        path = self.shards[shard]
        log.debug("loading shard %s", path)
        try:
            with h5py.File(path, "r") as f:
                arrays = {k: f[k][()] for k in NVIDIA_DTYPES}
        except (OSError, KeyError) as e:
            raise DataError(f"{path}: could not read the shard ({e}); {_FIX_PREPARE}") from e
        _check_values(path, arrays, self.vocab_size, self.seq_len)
        self._cache[shard] = arrays
        while len(self._cache) > self._cache_shards:
            self._cache.popitem(last=False)
        return arrays

    def check_all(self) -> None:
        """Load and range-check every shard now (slow on a full corpus; for `prepare` and tests).

        Raises:
            DataError: the first shard with an out-of-range value.
        """
        for shard in range(len(self.shards)):
            self._load(shard)

    def locate(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Where global sample indices live.

        Args:
            indices: non-negative global sample indices.

        Returns:
            ``(shard, row)``: int64 arrays of shard number (into `shards`) and row in that file.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be non-negative, got {int(idx.min())}")
        epochs, offsets = np.divmod(idx, self._total)
        shard = np.empty_like(idx)
        row = np.empty_like(idx)
        for epoch in np.unique(epochs).tolist():
            sel = epochs == epoch
            order = self._order(epoch, -1)  # shard visiting order of this epoch
            ends = np.cumsum(self._sizes[order])
            k = np.searchsorted(ends, offsets[sel], side="right")
            shard[sel] = order[k]
            row[sel] = offsets[sel] - (ends[k] - self._sizes[order[k]])
        for s in np.unique(shard).tolist():
            sel = shard == s
            for epoch in np.unique(epochs[sel]).tolist():
                both = sel & (epochs == epoch)
                row[both] = self._order(epoch, s)[row[both]]
        return shard, row

    def get_samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples at global indices (index ``>= len(self)`` wraps into later epochs).

        Args:
            indices: non-negative global sample indices.

        Returns:
            A batch (see `pipefisher.data.batches.BATCH_KEYS`), all ``torch.long``.

        Raises:
            DataError: a shard loaded for the first time holds out-of-range values.
        """
        return self._gather(*self.locate(indices))

    def get_stored_samples(self, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples in storage order, without any shuffle: position ``r`` counts rows through
        the shards in `shards` order (the fixed order held-out batches use).

        Args:
            positions: in ``[0, len(self))``.

        Returns:
            A batch (see `pipefisher.data.batches.BATCH_KEYS`), all ``torch.long``.

        Raises:
            ValueError: a position outside ``[0, len(self))``.
            DataError: a shard loaded for the first time holds out-of-range values.
        """
        pos = stored_positions(positions, self._total)
        ends = np.cumsum(self._sizes)
        shard = np.searchsorted(ends, pos, side="right")
        return self._gather(shard, pos - (ends[shard] - self._sizes[shard]))

    def _gather(self, shard: np.ndarray, row: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows ``row`` of shards ``shard`` (int64 arrays of one length) as a batch."""
        widths = {"S": (self.seq_len,), "P": (self.max_predictions,), None: ()}
        out = {k: np.zeros((shard.size, *widths[_WIDTH[k]]), dtype=np.int64) for k in BATCH_KEYS}
        for s in np.unique(shard).tolist():
            sel = shard == s
            arrays = self._load(s)
            for k in BATCH_KEYS:
                out[k][sel] = arrays[k][row[sel]]
        return {k: torch.from_numpy(v) for k, v in out.items()}


def check_widths(source: Hdf5Source, seq_len: int, max_predictions: int) -> None:
    """Refuse shards whose S or P differ from what the model expects.

    Raises:
        DataError: naming the shards, the width found, and the two fixes.
    """
    for name, field, want, have in (
        ("seq_len", "input_ids", seq_len, source.seq_len),
        ("max_predictions", "masked_lm_positions", max_predictions, source.max_predictions),
    ):
        if want != have:
            raise DataError(
                f"{source.path}: the shards have {name}={have} (width of {field!r}) but the config "
                f"asks for {name}={want}; set {name}={have}, or prepare the data again with "
                f"--{name.replace('_', '-')} {want}"
            )
