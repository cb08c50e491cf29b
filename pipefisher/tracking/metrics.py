"""``metrics.jsonl``: one JSON object per line, appended and flushed as each step finishes.

[Note: non-finite values] JSON has no NaN or Infinity (Python's ``json`` would write the
non-standard tokens ``NaN`` / ``Infinity``, which other readers reject). A diverged loss must still be
recorded, so NaN, +inf and -inf are written as ``null`` and read back as ``None``. A reader that
needs the distinction must log it separately (e.g. ``"loss_is_finite": false``).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

__all__ = ["EVAL_FIELDS", "METRICS_FILE", "MetricsWriter", "read_metrics", "to_python"]

logger = logging.getLogger(__name__)

#: File name used when a directory is given.
METRICS_FILE = "metrics.jsonl"
#: Fields a held-out evaluation adds to the row of the step it follows (``pipefisher.evaluation``).
EVAL_FIELDS = ("eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy", "eval_time_s")


def _resolve(path: str | Path) -> Path:
    """A path ending in ``.jsonl`` is the file itself; any other path is a directory holding it."""
    path = Path(path)
    return path if path.suffix == ".jsonl" else path / METRICS_FILE


def to_python(value: Any) -> Any:
    """Convert tensors, numpy values and containers of them to plain Python values.

    0-d tensors and numpy scalars become ``float`` / ``int`` / ``bool``; larger tensors and arrays
    become (nested) lists; mappings and sequences are converted element-wise; ``str`` and ``None``
    pass through. Non-finite floats are kept (see :class:`MetricsWriter` for how they are written).

    Raises:
        TypeError: for a value with no plain-Python form (the message names its type).
    """
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist") and callable(value.tolist):  # torch.Tensor, numpy array / scalar
        if getattr(value, "is_sparse", False):
            value = value.to_dense()
        if hasattr(value, "detach"):
            value = value.detach().cpu()
        return to_python(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot convert a value of type {type(value).__name__} to JSON")


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value


class MetricsWriter:
    """Append one JSON object per :meth:`write` to ``metrics.jsonl``; a context manager.

    The file is opened for appending, so a resumed run continues the same file. Each line is
    flushed when written, so a crash loses at most the line being written.

    Args:
        path: the ``.jsonl`` file, or a directory (created if missing) that gets ``metrics.jsonl``.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = _resolve(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Append ``record`` as one line.

        Args:
            record: metric name → value (numbers, tensors, numpy values, strings, lists, dicts).
                Non-finite floats are written as ``null`` (see [Note: non-finite values]).

        Returns:
            The record as written (plain Python values).

        Raises:
            TypeError: a value cannot be converted (the message names its key).
            ValueError: the writer is closed.
        """
        if self._file is None:
            raise ValueError(f"MetricsWriter({self.path}) is closed")
        clean: dict[str, Any] = {}
        for key, value in record.items():
            try:
                clean[str(key)] = _finite_or_none(to_python(value))
            except TypeError as err:
                raise TypeError(f"metric {key!r}: {err}") from None
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()
        return clean

    def close(self) -> None:
        """Close the file; further writes raise. Safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read every record of a metrics file, in order.

    A malformed *last* line (a write cut short by a crash) is skipped with a warning; a malformed
    line elsewhere is an error.

    Args:
        path: the ``.jsonl`` file, or the directory holding ``metrics.jsonl``.

    Returns:
        One dict per line; non-finite values come back as ``None``.

    Raises:
        FileNotFoundError: no metrics file at ``path``.
        ValueError: a malformed line before the last (the message gives file and line number).
    """
    file = _resolve(path)
    lines = file.read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                logger.warning("%s:%d: skipping a truncated last line (%s)", file, number, err)
                continue
            raise ValueError(f"{file}:{number}: not a JSON object: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{file}:{number}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records
