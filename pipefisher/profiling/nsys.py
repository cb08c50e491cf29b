"""Read an Nsight Systems SQLite export (``nsys export --type sqlite``) into timeline events.

This module knows the Nsight Systems layout; ``pipefisher.profiling.sqlite`` writes our own
``profile.sqlite`` in the same layout and adds run metadata, so :func:`read_nsys` also reads ours
(without the metadata). The tables used:

- ``NVTX_EVENTS(start, end, text, textId, globalTid, eventType, …)``: one row per NVTX range,
  times in ns. The name is in ``text`` or, for registered strings, in ``StringIds.value`` through
  ``textId``. Only ranges (eventType 59 = NvtxPushPopRange, 60 = NvtxStartEndRange) whose name
  parses as one of our action names (``0F2``, ``3B5@1``, ``STEP``, …, see
  ``pipefisher.schedules.ir``) become events; other ranges are ignored and counted in a log line.
- ``CUPTI_ACTIVITY_KIND_RUNTIME(start, end, globalTid, correlationId, …)``: CUDA API calls and
  ``CUPTI_ACTIVITY_KIND_KERNEL(start, end, correlationId, globalPid, …)``: the kernels they
  launched, for GPU spans (``gpu=True``).

[Note: globalTid]
Nsight Systems serializes a thread as ``globalTid = (hw << 48) | (pid << 24) | tid`` (24 bits
each for pid and tid); a kernel's ``globalPid`` is the launching process's ``globalTid`` with the
tid bits zero. Correlation ids are unique per process only, so kernels are joined to their runtime
call on ``correlationId`` *and* process where the export has ``globalPid``.

[Note: workers and steps of an nsys export]
An action range's worker is, in this order of preference:
1. a name prefix ``w{worker}:`` or ``rank{worker}:`` (e.g. ``w2:0F1``), if every action range has one;
2. its process, if action ranges come from more than one process (one process per worker, the
   way ``pipefisher.launch`` runs): distinct pids map to workers 0, 1, … in pid order;
3. its thread otherwise (all workers as threads of one process): distinct globalTids in order.
An action's step is the number of ``STEP`` ranges its worker ended before the action started
(0 when no STEP range was recorded; ties at one instant are broken by record order).
"""

from __future__ import annotations

import bisect
import logging
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipefisher.schedules.ir import Action
from pipefisher.timeline import Event

__all__ = [
    "KFAC_KINDS",
    "NVTX_RANGE_EVENT_TYPES",
    "Profile",
    "ProfileError",
    "WorkerInfo",
    "gpu_spans",
    "open_database",
    "parse_action_name",
    "pid_of",
    "read_nsys",
    "table_columns",
]

log = logging.getLogger(__name__)

NVTX_PUSH_POP_RANGE = 59
NVTX_START_END_RANGE = 60
NVTX_RANGE_EVENT_TYPES: tuple[int, ...] = (NVTX_PUSH_POP_RANGE, NVTX_START_END_RANGE)

# Action kinds the K-FAC passes will add to the IR. Names with these kinds are recognized already,
# so profiles recorded by a newer executor still read; once ``ActionKind`` has them,
# ``Action.from_str`` parses them first.
KFAC_KINDS: frozenset[str] = frozenset({"CURV_A", "CURV_B", "SYNC_FACTOR", "INVERT", "PRECOND"})
_KFAC_RE = re.compile(
    rf"^(?P<stage>\d+)?(?P<kind>{'|'.join(sorted(KFAC_KINDS, key=len, reverse=True))})"
    rf"(?P<mb>\d+)?(?:@(?P<pipe>\d+))?$"
)
_PREFIX_RE = re.compile(r"^(?:w|rank)(?P<worker>\d+)[:/]\s*", re.IGNORECASE)

_TID_BITS = 24
_TID_MASK = (1 << _TID_BITS) - 1


class ProfileError(ValueError):
    """A profile database cannot be read; the message names the file, the table and the fix."""


@dataclass(frozen=True)
class WorkerInfo:
    """Where one worker's events came from.

    Attributes:
        worker: worker index (``Event.worker``).
        rank: torch.distributed rank of the worker's process.
        global_tid: the Nsight Systems ``globalTid`` its ranges carry (see [Note: globalTid]).
        host: host name, or None when unknown.
    """

    worker: int
    rank: int
    global_tid: int
    host: str | None = None


@dataclass
class Profile:
    """The contents of a profile database.

    Attributes:
        events: timeline events, in the order they were written (our files) or by start time.
        metadata: run metadata (``PIPEFISHER_META``; empty for an nsys export).
        workers: per-worker origin, keyed by worker index.
        source: ``"pipefisher"`` for a file written by ``write_profile``, ``"nsys"`` otherwise.
    """

    events: list[Event]
    metadata: dict[str, Any] = field(default_factory=dict)
    workers: dict[int, WorkerInfo] = field(default_factory=dict)
    source: str = "pipefisher"

    @property
    def num_workers(self) -> int:
        """Number of workers: those in the worker map and those with events."""
        return len(set(self.workers) | {e.worker for e in self.events})


def parse_action_name(text: str) -> tuple[str, int | None] | None:
    """The kind and micro-batch of an action name, or None if ``text`` is not one.

    Args:
        text: an NVTX range name, e.g. ``"0F2"``, ``"3B5@1"``, ``"STEP"``, ``"1CURV_A2"``.

    Returns:
        ``(kind, micro_batch)``, e.g. ``("F", 2)``; None for any other text.
    """
    try:
        action = Action.from_str(text)
    except ValueError:
        m = _KFAC_RE.match(text.strip())
        if m is None:
            return None
        return m["kind"], None if m["mb"] is None else int(m["mb"])
    return action.kind.value, action.micro_batch


def pid_of(global_tid: int) -> int:
    """The process id serialized in an Nsight Systems ``globalTid``."""
    return (global_tid >> _TID_BITS) & _TID_MASK


def open_database(path: str | Path) -> sqlite3.Connection:
    """Open ``path`` read-only and check that it is an SQLite database.

    Raises:
        ProfileError: the file is missing or is not an SQLite database.
    """
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file; pass the profile.sqlite of a run or an "
                           f"'nsys export --type sqlite' output")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        conn.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise ProfileError(f"{path}: not an SQLite database ({exc}); export an .nsys-rep with "
                           f"'nsys export --type sqlite {path.with_suffix('.nsys-rep').name}'") from exc
    return conn


def table_columns(conn: sqlite3.Connection, table: str) -> set[str]:
    """Column names of ``table``; empty if it does not exist."""
    return {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}


@dataclass(frozen=True)
class _Range:
    """One NVTX range that names an action."""

    row: int  # NVTX_EVENTS rowid
    name: str
    kind: str
    start: int
    end: int
    global_tid: int
    prefix_worker: int | None


def _action_ranges(conn: sqlite3.Connection, path: Path) -> tuple[list[_Range], int]:
    """The action ranges of ``NVTX_EVENTS`` and the number of other ranges ignored."""
    cols = table_columns(conn, "NVTX_EVENTS")
    missing = {"start", "end", "globalTid"} - cols
    if not cols or missing:
        what = "has no NVTX_EVENTS table" if not cols else \
            f"table NVTX_EVENTS lacks column(s) {', '.join(sorted(missing))}"
        raise ProfileError(f"{path}: {what}; record NVTX ranges with 'nsys profile --trace=nvtx,cuda' "
                           f"(the executor names each action's range) and export with "
                           f"'nsys export --type sqlite'")
    text = "n.text" if "text" in cols else "NULL"
    use_ids = "textId" in cols and table_columns(conn, "StringIds") >= {"id", "value"}
    name_sql = f"COALESCE({text}, s.value)" if use_ids else text
    join = "LEFT JOIN StringIds AS s ON s.id = n.textId" if use_ids else ""
    where = "n.end IS NOT NULL"
    if "eventType" in cols:
        where += f" AND n.eventType IN ({', '.join(map(str, NVTX_RANGE_EVENT_TYPES))})"
    rows = conn.execute(
        f"SELECT n.rowid, {name_sql}, n.start, n.end, n.globalTid FROM NVTX_EVENTS AS n {join} "
        f"WHERE {where} ORDER BY n.start, n.rowid"
    ).fetchall()
    ranges, ignored = [], 0
    for row, name, start, end, gtid in rows:
        name = (name or "").strip()
        m = _PREFIX_RE.match(name)
        bare = name[m.end():] if m else name
        parsed = parse_action_name(bare)
        if parsed is None or end < start:
            ignored += 1
            continue
        ranges.append(_Range(row, bare, parsed[0], int(start), int(end), int(gtid or 0),
                             int(m["worker"]) if m else None))
    return ranges, ignored


def _worker_map(ranges: list[_Range]) -> tuple[dict[int, int], dict[int, WorkerInfo]]:
    """``{NVTX rowid: worker}`` and the worker map, by [Note: workers and steps of an nsys export]."""
    if ranges and all(r.prefix_worker is not None for r in ranges):
        worker_of = {r.row: r.prefix_worker for r in ranges}
        first_tid: dict[int, int] = {}
        for r in ranges:
            first_tid.setdefault(r.prefix_worker, r.global_tid)  # type: ignore[arg-type]
        infos = {w: WorkerInfo(w, w, t) for w, t in sorted(first_tid.items())}
        return worker_of, infos
    by_pid = len({pid_of(r.global_tid) for r in ranges}) > 1
    key = (lambda g: g & ~_TID_MASK) if by_pid else (lambda g: g)
    keys = sorted({key(r.global_tid) for r in ranges})
    index = {k: i for i, k in enumerate(keys)}
    worker_of = {r.row: index[key(r.global_tid)] for r in ranges}
    infos = {}
    for r in ranges:
        w = worker_of[r.row]
        if w not in infos:
            infos[w] = WorkerInfo(w, w, r.global_tid)
    return worker_of, dict(sorted(infos.items()))


def _steps(ranges: list[_Range], worker_of: dict[int, int]) -> dict[int, int]:
    """``{NVTX rowid: step}``: the worker's STEP ranges that ended before the range started.

    A STEP counts for a range only if it also comes first in (start, end, rowid) order, so that a
    zero-length range recorded just before a zero-length STEP at the same instant stays in its step.
    """
    def key(r: _Range) -> tuple[int, int, int]:
        return (r.start, r.end, r.row)

    steps: dict[int, list[_Range]] = {}
    for r in ranges:
        if r.kind == "STEP":
            steps.setdefault(worker_of[r.row], []).append(r)
    ends: dict[int, list[int]] = {}
    for w, rs in steps.items():
        rs.sort(key=lambda r: (r.end, key(r)))
        ends[w] = [r.end for r in rs]
    out = {}
    for r in ranges:
        w = worker_of[r.row]
        n = bisect.bisect_right(ends.get(w, []), r.start)
        while n and key(steps[w][n - 1]) >= key(r):  # ties at r.start that come after r
            n -= 1
        out[r.row] = n
    return out


def gpu_spans(conn: sqlite3.Connection, ranges: list[tuple[int, int, int, int]],
              path: Path) -> dict[int, tuple[int, int]]:
    """GPU span of each range: [first kernel start, last kernel end] of the kernels it launched.

    A kernel belongs to the innermost given range that encloses its runtime API call on the same
    globalTid (nested non-action ranges are transparent).

    Args:
        conn: an open export.
        ranges: ``(row, global_tid, start, end)`` of the CPU ranges.
        path: the file, for messages.

    Returns:
        ``{row: (gpu_start, gpu_end)}`` for the ranges that launched at least one kernel.

    Raises:
        ProfileError: the export has no kernel or runtime table.
    """
    kcols = table_columns(conn, "CUPTI_ACTIVITY_KIND_KERNEL")
    rcols = table_columns(conn, "CUPTI_ACTIVITY_KIND_RUNTIME")
    for table, cols in (("CUPTI_ACTIVITY_KIND_KERNEL", kcols), ("CUPTI_ACTIVITY_KIND_RUNTIME", rcols)):
        if not cols:
            raise ProfileError(f"{path}: table {table} is missing, so there are no GPU spans; "
                               f"profile with 'nsys profile --trace=cuda,nvtx', or read with gpu=False")
    same_process = f" AND k.globalPid = (r.globalTid & ~{_TID_MASK})" if "globalPid" in kcols else ""
    launches = conn.execute(
        "SELECT r.globalTid, r.start, k.start, k.end FROM CUPTI_ACTIVITY_KIND_KERNEL AS k "
        "JOIN CUPTI_ACTIVITY_KIND_RUNTIME AS r ON r.correlationId = k.correlationId" + same_process
    ).fetchall()
    # Per thread: ranges by start, with the running max of ends to stop the backward walk early.
    per_tid: dict[int, tuple[list[int], list[tuple[int, int, int]], list[int]]] = {}
    for row, gtid, start, end in sorted(ranges, key=lambda r: (r[1], r[2], -r[3])):
        starts, items, max_end = per_tid.setdefault(gtid, ([], [], []))
        starts.append(start)
        items.append((row, start, end))
        max_end.append(max(end, max_end[-1]) if max_end else end)
    spans: dict[int, tuple[int, int]] = {}
    for gtid, call_start, k_start, k_end in launches:
        if gtid not in per_tid:
            continue
        starts, items, max_end = per_tid[gtid]
        i = bisect.bisect_right(starts, call_start) - 1
        while i >= 0 and max_end[i] >= call_start:
            row, _, end = items[i]
            if end >= call_start:  # innermost enclosing range: the latest start that encloses
                lo, hi = spans.get(row, (k_start, k_end))
                spans[row] = (min(lo, k_start), max(hi, k_end))
                break
            i -= 1
    return spans


def read_nsys(path: str | Path, *, gpu: bool = False) -> Profile:
    """Read the action ranges of an Nsight Systems SQLite export.

    Args:
        path: an ``nsys export --type sqlite`` file (or our own ``profile.sqlite``, whose metadata
            this reader ignores).
        gpu: if True, an event spans its action's kernels, [first kernel start, last kernel end],
            instead of its CPU range; actions that launched no kernel are dropped (logged).

    Returns:
        A :class:`Profile` with ``source="nsys"``, events sorted by start time; workers and steps
        as in [Note: workers and steps of an nsys export].

    Raises:
        ProfileError: not an SQLite file, no NVTX_EVENTS table, no range named like an action, or
            (``gpu=True``) no CUPTI kernel/runtime tables.
    """
    path = Path(path)
    conn = open_database(path)
    try:
        ranges, ignored = _action_ranges(conn, path)
        if not ranges:
            raise ProfileError(
                f"{path}: table NVTX_EVENTS has no range named like an action ('0F2', '3B5@1', "
                f"'STEP', …; {ignored} other range(s)); run the executor with NVTX ranges enabled "
                f"under 'nsys profile --trace=nvtx,cuda'")
        worker_of, workers = _worker_map(ranges)
        step_of = _steps(ranges, worker_of)
        spans = {r.row: (r.start, r.end) for r in ranges}
        if gpu:
            spans = gpu_spans(conn, [(r.row, r.global_tid, r.start, r.end) for r in ranges], path)
    finally:
        conn.close()
    if ignored:
        log.info("%s: ignored %d NVTX range(s) not named like an action", path, ignored)
    if gpu and len(spans) < len(ranges):
        log.info("%s: %d of %d action range(s) launched no kernel and have no GPU span",
                 path, len(ranges) - len(spans), len(ranges))
    events = [Event(worker_of[r.row], r.name, r.kind, *spans[r.row], step_of[r.row])
              for r in ranges if r.row in spans]
    events.sort(key=lambda e: (e.start_ns, e.worker, e.end_ns))
    return Profile(events=events, metadata={}, workers=workers, source="nsys")
