"""Read Nsight Systems SQLite exports (``nsys export --type sqlite``) into timeline events.

This module knows the Nsight Systems layout; ``pipefisher.profiling.sqlite`` writes our own
``profile.sqlite`` in the same layout and adds run metadata, so :func:`read_nsys` also reads ours
(without the metadata). The tables used:

- ``NVTX_EVENTS(start, end, text, textId, globalTid, eventType, …)``: one row per NVTX range or
  mark, times in ns. The name is in ``text`` or, for registered strings, in ``StringIds.value``
  through ``textId``. Only ranges (eventType 59 = NvtxPushPopRange, 60 = NvtxStartEndRange) whose
  name parses as one of our action names (``0F2``, ``3B5@1``, ``STEP``, …, see
  ``pipefisher.schedules.ir``) become events; other ranges are ignored and counted in a log line.
  A mark ``rank=N`` (eventType 34) names its process's rank (``pipefisher.profiling.nvtx``).
- ``CUPTI_ACTIVITY_KIND_RUNTIME`` / ``CUPTI_ACTIVITY_KIND_KERNEL``: GPU spans
  (``pipefisher.profiling.nsys_gpu``), used when ``gpu=True``, or with ``gpu="auto"`` when the
  export has kernels.
- ``TARGET_INFO_SESSION_START_TIME(utcEpochNs, …)``: the UTC time of a capture's timestamp 0, to
  put several per-rank exports on one clock.

[Note: globalTid]
Nsight Systems serializes a thread as ``globalTid = (hw << 48) | (pid << 24) | tid`` (24 bits
each for pid and tid); a kernel's ``globalPid`` is the launching process's ``globalTid`` with the
tid bits zero.

[Note: steps of an nsys export]
Workers come from [Note: ranks of an nsys export] (``nsys_ranks``). An action's step is the
number of ``STEP`` ranges its worker ended before the action started (0 when none was recorded;
ties at one instant are broken by record order). A range named like an action that encloses
another action range of its thread (a user's ``STEP`` around a whole iteration) is not an action:
it is dropped from the events, and its ends count steps only where the worker recorded no
optimizer ``STEP`` range (issue 15, item 8). Steps below ``warmup_steps`` are dropped, as
``profile.py`` drops them from its own profiles (item 4); so is every step from the first one with
an action range that never ended (end NULL: the capture stopped inside it).
"""

from __future__ import annotations

import bisect
import glob
import logging
import re
import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipefisher.profiling.nsys_gpu import TID_MASK, gpu_spans, has_kernels, process_key
from pipefisher.profiling.nsys_ranks import RangeOrigin, assign_workers
from pipefisher.profiling.nvtx import RANK_MARK_RE
from pipefisher.profiling.types import Profile, ProfileError, WorkerInfo
from pipefisher.schedules.ir import Action
from pipefisher.timeline import Event

__all__ = [
    "KFAC_KINDS",
    "NVTX_MARK",
    "NVTX_PUSH_POP_RANGE",
    "NVTX_RANGE_EVENT_TYPES",
    "Profile",
    "ProfileError",
    "WorkerInfo",
    "expand_paths",
    "gpu_spans",
    "open_database",
    "parse_action_name",
    "pid_of",
    "read_nsys",
    "resolve_gpu",
    "table_columns",
]

log = logging.getLogger(__name__)

NVTX_MARK = 34
NVTX_PUSH_POP_RANGE = 59
NVTX_START_END_RANGE = 60
NVTX_RANGE_EVENT_TYPES: tuple[int, ...] = (NVTX_PUSH_POP_RANGE, NVTX_START_END_RANGE)
GpuArg = bool | str  # True, False or "auto"

# Action kinds the K-FAC passes will add to the IR. Names with these kinds are recognized already,
# so profiles recorded by a newer executor still read; once ``ActionKind`` has them,
# ``Action.from_str`` parses them first.
KFAC_KINDS: frozenset[str] = frozenset({"CURV_A", "CURV_B", "SYNC_FACTOR", "INVERT", "PRECOND"})
_KFAC_RE = re.compile(
    rf"^(?P<stage>\d+)?(?P<kind>{'|'.join(sorted(KFAC_KINDS, key=len, reverse=True))})"
    rf"(?P<mb>\d+)?(?:@(?P<pipe>\d+))?$"
)
_PREFIX_RE = re.compile(r"^(?:w|rank)(?P<worker>\d+)[:/]\s*", re.IGNORECASE)
_REEXPORT = "export the report again: nsys export --type sqlite --force-overwrite true REPORT.nsys-rep"


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
    return (global_tid >> 24) & TID_MASK


def table_columns(conn: sqlite3.Connection, table: str) -> set[str]:
    """Column names of ``table``; empty if it does not exist."""
    return {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}


def open_database(path: str | Path) -> sqlite3.Connection:
    """Open ``path`` read-only and check that it is an SQLite database.

    Raises:
        ProfileError: the file is missing, empty or not an SQLite database.
    """
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: no such profile file; pass the profile.sqlite of a run or an "
                           f"'nsys export --type sqlite' output")
    if path.stat().st_size == 0:
        raise ProfileError(f"{path}: the file is empty (0 bytes), so the export did not finish; {_REEXPORT}")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        conn.execute("SELECT name FROM sqlite_master LIMIT 1").fetchall()
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise ProfileError(f"{path}: not an SQLite database ({exc}); export an .nsys-rep with "
                           f"'nsys export --type sqlite {path.with_suffix('.nsys-rep').name}'") from exc
    return conn


def damaged(path: Path, exc: sqlite3.DatabaseError) -> ProfileError:
    """The one-line error for a database that opened but fails when read (a corrupt page)."""
    return ProfileError(f"{path}: the database is damaged ({exc}); {_REEXPORT}")


def expand_paths(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Files named by a path, a comma-separated list, a glob, or a sequence of those.

    Raises:
        ProfileError: a glob that matches nothing, or no file named at all.
    """
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for item in items:
        whole = not isinstance(item, str) or Path(item).exists()  # a file name may hold a comma
        parts = [str(item)] if whole else str(item).split(",")
        for part in (p.strip() for p in parts):
            if not part:
                continue
            if any(c in part for c in "*?["):
                found = sorted(Path(p) for p in glob.glob(part))
                if not found:
                    raise ProfileError(f"{part}: no file matches this pattern; pass per-rank exports as a glob "
                                       f"(e.g. 'report_rank*.sqlite') or a comma-separated list of files")
                out += [p for p in found if p not in out]
            elif Path(part) not in out:
                out.append(Path(part))
    if not out:
        raise ProfileError(f"{paths!r}: no profile file given; pass a profile.sqlite or nsys exports")
    return out


def resolve_gpu(conn: sqlite3.Connection, gpu: GpuArg) -> bool:
    """``gpu`` as a bool: ``"auto"`` is True exactly when the export holds CUDA kernels."""
    value = str(gpu).lower()
    if value not in ("true", "false", "auto"):
        raise ValueError(f"gpu={gpu!r}: choose auto (kernel time when the export has CUDA kernels), true or false")
    return has_kernels(conn) if value == "auto" else value == "true"


@dataclass(frozen=True)
class _Range:
    """One NVTX range that names an action (``end`` None: it never ended)."""

    key: tuple[int, int]  # (file index, NVTX_EVENTS rowid)
    name: str
    kind: str
    start: int
    end: int | None
    global_tid: int
    prefix_worker: int | None


@dataclass
class _File:
    """What one export holds for us."""

    path: Path
    ranges: list[_Range]
    ignored: int
    marks: dict[int, int]  # process_key -> rank
    utc_epoch_ns: int | None
    gpu: bool
    spans: dict[tuple[int, int], tuple[int, int]]


def _name_sql(conn: sqlite3.Connection, cols: set[str]) -> tuple[str, str]:
    text = "n.text" if "text" in cols else "NULL"
    if "textId" in cols and table_columns(conn, "StringIds") >= {"id", "value"}:
        return f"COALESCE({text}, s.value)", "LEFT JOIN StringIds AS s ON s.id = n.textId"
    return text, ""


def _check_names(conn: sqlite3.Connection, cols: set[str], path: Path) -> None:
    """Ranges that name themselves through textId must find the name (item 9)."""
    if "textId" not in cols:
        return
    where = "n.textId IS NOT NULL" + (" AND n.text IS NULL" if "text" in cols else "")
    if not table_columns(conn, "StringIds") >= {"id", "value"}:
        n = conn.execute(f"SELECT count(*) FROM NVTX_EVENTS AS n WHERE {where}").fetchone()[0]
        if n:
            raise ProfileError(f"{path}: {n} NVTX row(s) name themselves through textId, but the StringIds "
                               f"table is missing, so the export is incomplete; {_REEXPORT}")
        return
    lost = conn.execute(f"SELECT DISTINCT n.textId FROM NVTX_EVENTS AS n LEFT JOIN StringIds AS s "
                        f"ON s.id = n.textId WHERE {where} AND s.id IS NULL LIMIT 4").fetchall()
    if lost:
        ids = ", ".join(str(r[0]) for r in lost[:3])
        raise ProfileError(f"{path}: NVTX textId value(s) {ids} are missing from StringIds, so the export is "
                           f"incomplete; {_REEXPORT}")


def _read_file(path: Path, index: int, gpu: GpuArg) -> _File:
    conn = open_database(path)
    try:
        cols = table_columns(conn, "NVTX_EVENTS")
        missing = {"start", "end", "globalTid"} - cols
        if not cols or missing:
            what = "has no NVTX_EVENTS table" if not cols else \
                f"table NVTX_EVENTS lacks column(s) {', '.join(sorted(missing))}"
            raise ProfileError(f"{path}: {what}; record NVTX ranges with 'nsys profile --trace=nvtx,cuda' "
                               f"(the executor names each action's range) and export with "
                               f"'nsys export --type sqlite'")
        _check_names(conn, cols, path)
        name_sql, join = _name_sql(conn, cols)
        etype = "n.eventType" if "eventType" in cols else "NULL"
        rows = conn.execute(
            f"SELECT n.rowid, {name_sql}, n.start, n.end, n.globalTid, {etype} FROM NVTX_EVENTS AS n {join} "
            f"ORDER BY n.start, n.rowid").fetchall()
        ranges, marks, ignored = [], {}, 0
        for row, name, start, end, gtid, event_type in rows:
            name = (name or "").strip()
            mark = RANK_MARK_RE.match(name)
            if mark is not None:
                marks[process_key(int(gtid or 0))] = int(mark["rank"])
                continue
            if event_type is not None and event_type not in NVTX_RANGE_EVENT_TYPES:
                continue
            m = _PREFIX_RE.match(name)
            bare = name[m.end():] if m else name
            parsed = parse_action_name(bare)
            if parsed is None or (end is not None and end < start):
                ignored += 1
                continue
            ranges.append(_Range((index, row), bare, parsed[0], int(start), None if end is None else int(end),
                                 int(gtid or 0), int(m["worker"]) if m else None))
        utc = None
        if table_columns(conn, "TARGET_INFO_SESSION_START_TIME") >= {"utcEpochNs"}:
            got = conn.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
            utc = int(got[0]) if got and got[0] is not None else None
        use_gpu = resolve_gpu(conn, gpu)
        spans: dict[tuple[int, int], tuple[int, int]] = {}
        if use_gpu:
            closed = [(r.key[1], r.global_tid, r.start, r.end) for r in ranges if r.end is not None]
            spans = {(index, row): span for row, span in gpu_spans(conn, closed, path).items()}
    except sqlite3.DatabaseError as exc:
        raise damaged(path, exc) from None
    finally:
        conn.close()
    return _File(path, ranges, ignored, marks, utc, use_gpu, spans)


def _enclosing(ranges: Sequence[_Range]) -> set[tuple[int, int]]:
    """Keys of ranges that enclose another action range of their thread (not actions themselves)."""
    out = set()
    by_thread: dict[tuple[int, int], list[_Range]] = defaultdict(list)
    for r in ranges:
        by_thread[(r.key[0], r.global_tid)].append(r)
    for rs in by_thread.values():
        rs.sort(key=lambda r: (r.start, -(r.end or r.start)))
        starts = [r.start for r in rs]
        for r in rs:
            length = r.end - r.start
            i = bisect.bisect_left(starts, r.start)
            while i < len(rs) and rs[i].start <= r.end:
                o = rs[i]
                if o is not r and 0 < o.end - o.start < length and o.end <= r.end:
                    out.add(r.key)
                    break
                i += 1
    return out


def _steps(ranges: Sequence[_Range], worker_of: dict[tuple[int, int], int],
           delimiters: Sequence[_Range]) -> dict[tuple[int, int], int]:
    """``{key: step}``: the worker's step delimiters that ended before the range started.

    A delimiter counts for a range only if it also comes first in (start, end, key) order, so that
    a zero-length range recorded just before a zero-length STEP at the same instant stays in its step.
    """
    def order(r: _Range) -> tuple[int, int, tuple[int, int]]:
        return (r.start, r.end if r.end is not None else r.start, r.key)

    steps: dict[int, list[_Range]] = defaultdict(list)
    for r in delimiters:
        steps[worker_of[r.key]].append(r)
    ends: dict[int, list[int]] = {}
    for w, rs in steps.items():
        rs.sort(key=lambda r: (r.end, order(r)))
        ends[w] = [r.end for r in rs]
    out = {}
    for r in ranges:
        w = worker_of[r.key]
        n = bisect.bisect_right(ends.get(w, []), r.start)
        while n and order(steps[w][n - 1]) >= order(r):  # ties at r.start that come after r
            n -= 1
        out[r.key] = n
    return out


def _delimiters(ranges: Sequence[_Range], enclosing: set[tuple[int, int]],
                worker_of: dict[tuple[int, int], int]) -> list[_Range]:
    """Per worker: its optimizer STEP ranges, or its enclosing STEP ranges if it has none."""
    chosen: dict[int, list[_Range]] = defaultdict(list)
    enclosing_steps: dict[int, list[_Range]] = defaultdict(list)
    for r in ranges:
        if r.kind == "STEP" and r.end is not None:
            (enclosing_steps if r.key in enclosing else chosen)[worker_of[r.key]].append(r)
    return [r for w in set(chosen) | set(enclosing_steps) for r in (chosen.get(w) or enclosing_steps[w])]


def _clock_offsets(files: Sequence[_File]) -> tuple[list[int], list[str]]:
    """Per file, ns to add to put it on the first capture's clock (TARGET_INFO_SESSION_START_TIME)."""
    if len(files) == 1:
        return [0], []
    utc = [f.utc_epoch_ns for f in files]
    if any(u is None for u in utc):
        lacking = [str(f.path) for f in files if f.utc_epoch_ns is None][:3]
        note = (f"{', '.join(lacking)}: no TARGET_INFO_SESSION_START_TIME, so the exports' clocks are taken as one; "
                f"export with a current nsys")
        log.warning("%s", note)
        return [0] * len(files), [note]
    base = min(utc)  # type: ignore[type-var]
    return [u - base for u in utc], []  # type: ignore[operator]


def read_nsys(paths: str | Path | Sequence[str | Path], *, gpu: GpuArg = "auto",
              warmup_steps: int = 0) -> Profile:
    """Read the action ranges of one Nsight Systems SQLite export, or of one export per rank.

    Args:
        paths: an ``nsys export --type sqlite`` file (or our own ``profile.sqlite``, whose metadata
            this reader ignores), a comma-separated list or glob of them, or a sequence of those.
        gpu: True: an event spans its action's kernels, [first kernel start, last kernel end],
            instead of its CPU range (an action that launched no kernel keeps its CPU range);
            ``"auto"``: True for an export with CUDA kernels; False: CPU ranges.
        warmup_steps: steps to drop from the start ([Note: steps of an nsys export]).

    Returns:
        A :class:`Profile` with ``source="nsys"``, events sorted by start time; workers from
        [Note: ranks of an nsys export], steps from [Note: steps of an nsys export]; several
        exports are put on one clock by their session start times.

    Raises:
        ProfileError: a missing, empty, damaged or non-SQLite file, no NVTX_EVENTS table, names
            lost with StringIds, no range named like an action, nothing left after the warm-up or
            after unfinished steps, or (``gpu=True``) no CUPTI kernel/runtime tables.
    """
    files_in = expand_paths(paths)
    files = [_read_file(p, i, gpu) for i, p in enumerate(files_in)]
    where = str(files_in[0]) if len(files_in) == 1 else f"{len(files_in)} exports ({files_in[0]}, …)"
    ranges = [r for f in files for r in f.ranges]
    closed = [r for r in ranges if r.end is not None]
    ignored = sum(f.ignored for f in files)
    if not closed:
        open_ = len(ranges)
        raise ProfileError(
            f"{where}: table NVTX_EVENTS has no {'finished ' if open_ else ''}range named like an action "
            f"('0F2', '3B5@1', 'STEP', …; {ignored} other range(s){f', {open_} never ended' if open_ else ''}); "
            + ("capture whole steps (let the run finish the profiled steps)" if open_ else
               "run the executor with NVTX ranges enabled under 'nsys profile --trace=nvtx,cuda'"))
    marks = {(i, key): rank for i, f in enumerate(files) for key, rank in f.marks.items()}
    worker_of, workers, notes = assign_workers(
        {r.key: RangeOrigin(r.key[0], r.global_tid, r.prefix_worker) for r in ranges}, marks, files_in)
    enclosing = _enclosing(closed)
    step_of = _steps(ranges, worker_of, _delimiters(closed, enclosing, worker_of))
    if enclosing:
        names = sorted({r.name for r in closed if r.key in enclosing})
        log.info("%s: %d range(s) named like an action (%s) enclose other actions: read as step brackets, "
                 "not actions", where, len(enclosing), ", ".join(names[:3]))
    unfinished = [step_of[r.key] for r in ranges if r.end is None]
    last_step = min(unfinished) if unfinished else None
    if last_step is not None:
        notes.append(f"{len(unfinished)} action range(s) never ended (the capture stopped inside step "
                     f"{last_step}): steps from {last_step} on are dropped")
        log.warning("%s: %s", where, notes[-1])
    offsets, clock_notes = _clock_offsets(files)
    notes += clock_notes
    events, no_kernel = [], 0
    for f_index, f in enumerate(files):
        for r in f.ranges:
            if r.end is None or r.key in enclosing:
                continue
            step = step_of[r.key]
            if step < warmup_steps or (last_step is not None and step >= last_step):
                continue
            span = f.spans.get(r.key)
            if f.gpu and span is None:
                no_kernel += 1
            start, end = span if span is not None else (r.start, r.end)
            off = offsets[f_index]
            events.append(Event(worker_of[r.key], r.name, r.kind, start + off, end + off, step))
    if not events:
        steps = len({step_of[r.key] for r in closed})
        if last_step is not None and last_step <= warmup_steps:
            why = (f"no complete step is left ({len(unfinished)} action range(s) never ended: NVTX_EVENTS.end "
                   f"is NULL); capture whole steps (let the run finish the profiled steps)")
        else:
            why = (f"warmup_steps={warmup_steps} skips every step of the {steps} it holds (steps are counted "
                   f"by STEP ranges); profile more steps or pass warmup_steps=0")
        raise ProfileError(f"{where}: {why}")
    if ignored:
        log.info("%s: ignored %d NVTX range(s) not named like an action", where, ignored)
    if no_kernel:
        log.info("%s: %d action range(s) launched no kernel and keep their CPU range", where, no_kernel)
    if warmup_steps:
        log.info("%s: dropped the first %d (warm-up) step(s)", where, warmup_steps)
    events.sort(key=lambda e: (e.start_ns, e.worker, e.end_ns))
    return Profile(events=events, metadata={}, workers=workers, source="nsys",
                   gpu=any(f.gpu for f in files), notes=notes)
