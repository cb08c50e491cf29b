"""GPU spans of NVTX ranges: the kernels each range launched, from an Nsight Systems export.

On a GPU the CPU range of an op ends when its kernels are queued, long before they run, so an
op's time is its kernels' time (DESIGN.md, "profile.sqlite"). A kernel
(``CUPTI_ACTIVITY_KIND_KERNEL``) is joined to the runtime call that launched it
(``CUPTI_ACTIVITY_KIND_RUNTIME``) on ``correlationId`` and, where the export has ``globalPid``, on
the process (correlation ids are unique per process only).

[Note: which range a kernel belongs to]
The innermost given range that encloses its launch call *on the launching thread*; nested
non-action ranges are transparent. A thread that pushed no given range (PyTorch's autograd
thread ``pt_autograd_N`` launches every backward kernel while the main thread sits in
``loss.backward()`` inside the B range) lends its launches to the innermost given range of any
thread of the same process that encloses the call (issue 15, item 3).
"""

from __future__ import annotations

import bisect
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from pipefisher.profiling.types import ProfileError

__all__ = ["TID_MASK", "gpu_spans", "has_kernels", "process_key"]

TID_MASK = (1 << 24) - 1
_KERNEL, _RUNTIME = "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME"


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}


def process_key(global_tid: int) -> int:
    """A thread's process as nsys serializes it: ``globalTid`` with the tid bits zero
    (what a kernel's ``globalPid`` holds)."""
    return global_tid & ~TID_MASK


def has_kernels(conn: sqlite3.Connection) -> bool:
    """Whether the export holds CUDA kernels with their runtime calls (what ``gpu=auto`` asks)."""
    if not (_columns(conn, _KERNEL) and _columns(conn, _RUNTIME)):
        return False
    return conn.execute(f"SELECT 1 FROM {_KERNEL} LIMIT 1").fetchone() is not None


class _Index:
    """Ranges of one thread (or process) by start, with the running max of ends so the backward
    walk from a call time stops early."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.items: list[tuple[int, int]] = []  # (row, end)
        self.max_end: list[int] = []

    def add(self, row: int, start: int, end: int) -> None:  # callers add in start order
        self.starts.append(start)
        self.items.append((row, end))
        self.max_end.append(max(end, self.max_end[-1]) if self.max_end else end)

    def innermost(self, t: int) -> int | None:
        """The row of the latest-starting range with start <= ``t`` < end (half-open, so a
        zero-length range, or one that ends as the next begins, takes no launch)."""
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.max_end[i] > t:
            row, end = self.items[i]
            if end > t:
                return row
            i -= 1
        return None


def gpu_spans(conn: sqlite3.Connection, ranges: Sequence[tuple[int, int, int, int]],
              path: Path) -> dict[int, tuple[int, int]]:
    """GPU span of each range: [first kernel start, last kernel end] of the kernels it launched.

    Args:
        conn: an open export.
        ranges: ``(row, global_tid, start, end)`` of the CPU ranges.
        path: the file, for messages.

    Returns:
        ``{row: (gpu_start, gpu_end)}`` for the ranges that launched at least one kernel
        ([Note: which range a kernel belongs to]).

    Raises:
        ProfileError: the export has no kernel or runtime table.
    """
    kcols, rcols = _columns(conn, _KERNEL), _columns(conn, _RUNTIME)
    for table, cols in ((_KERNEL, kcols), (_RUNTIME, rcols)):
        if not cols:
            raise ProfileError(f"{path}: table {table} is missing, so there are no GPU spans; "
                               f"profile with 'nsys profile --trace=cuda,nvtx', or read with gpu=False")
    same_process = f" AND k.globalPid = (r.globalTid & ~{TID_MASK})" if "globalPid" in kcols else ""
    launches = conn.execute(
        f"SELECT r.globalTid, r.start, k.start, k.end FROM {_KERNEL} AS k "
        f"JOIN {_RUNTIME} AS r ON r.correlationId = k.correlationId" + same_process
    ).fetchall()
    per_tid: dict[int, _Index] = {}
    per_process: dict[int, _Index] = {}
    for row, gtid, start, end in sorted(ranges, key=lambda r: (r[2], -r[3])):
        per_tid.setdefault(gtid, _Index()).add(row, start, end)
        per_process.setdefault(process_key(gtid), _Index()).add(row, start, end)
    spans: dict[int, tuple[int, int]] = {}
    for gtid, call_start, k_start, k_end in launches:
        index = per_tid.get(gtid) or per_process.get(process_key(gtid))
        row = index.innermost(call_start) if index is not None else None
        if row is not None:
            lo, hi = spans.get(row, (k_start, k_end))
            spans[row] = (min(lo, k_start), max(hi, k_end))
    return spans
