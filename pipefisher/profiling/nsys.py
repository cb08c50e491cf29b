"""Read Nsight Systems SQLite exports (``nsys export --type sqlite``) into timeline events.

Why one module: every function here reads one part of the same Nsight Systems SQLite layout (tables, string
ids, thread ids, clocks) for the one reader :func:`read_nsys`; the GPU spans and the capture window already
live in ``nsys_gpu`` and ``nsys_capture``.

This module knows the Nsight Systems layout; ``pipefisher.profiling.sqlite`` writes our own
``profile.sqlite`` in the same layout and adds run metadata, so :func:`read_nsys` also reads ours
(without the metadata). The tables used:

- ``NVTX_EVENTS(start, end, text, textId, globalTid, eventType, …)``: one row per NVTX range or
  mark, times in ns. The name is in ``text`` or, for registered strings, in ``StringIds.value``
  through ``textId``. Only ranges (eventType 59 = NvtxPushPopRange, 60 = NvtxStartEndRange) whose
  name parses as one of our action names (``0F2``, ``3B5@1``, ``STEP``, …, see
  ``pipefisher.schedules.ir``), or that a name map reads as one (``ranges=``, see
  ``pipefisher.profiling.range_names``), become events; other ranges are ignored and counted in a
  log line. A mark ``rank=N`` (eventType 34) names its process's rank (``pipefisher.profiling.nvtx``).
- ``CUPTI_ACTIVITY_KIND_RUNTIME`` / ``CUPTI_ACTIVITY_KIND_KERNEL``: GPU spans
  (``pipefisher.profiling.nsys_gpu``), used when ``gpu=True``, or with ``gpu="auto"`` when the
  export has kernels.
- ``TARGET_INFO_SESSION_START_TIME(utcEpochNs, …)``, ``ANALYSIS_DETAILS`` and the export's
  metadata: the capture's window and clock (``pipefisher.profiling.nsys_capture``), to find ranges
  the capture cut off and to put several per-rank exports on one clock.

[Note: globalTid]
Nsight Systems serializes a thread as ``globalTid = (hw << 48) | (pid << 24) | tid`` (24 bits
each for pid and tid); a kernel's ``globalPid`` is the launching process's ``globalTid`` with the
tid bits zero.

Steps follow [Note: steps of an nsys export] and [Note: partial steps] (``nsys_steps``); steps
below ``warmup_steps`` are dropped, as ``profile.py`` drops them from its own profiles (issue 15,
item 4).
"""

from __future__ import annotations

import glob
import logging
import re
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipefisher.profiling.nsys_capture import Capture, read_capture
from pipefisher.profiling.nsys_gpu import TID_MASK, gpu_spans, has_kernels, process_key
from pipefisher.profiling.nsys_ranks import RangeOrigin, assign_workers
from pipefisher.profiling.nsys_steps import ActionRange, delimiters, enclosing, partial_steps, steps_of
from pipefisher.profiling.nvtx import RANK_MARK_RE
from pipefisher.profiling.range_names import MappedName, RangeNames, action_name, compile_patterns, match_name
from pipefisher.profiling.types import Profile, ProfileError, WorkerInfo
from pipefisher.schedules.ir import Action, ActionKind
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
Key = tuple[int, int]  # (file index, NVTX_EVENTS rowid)

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


@dataclass
class _File:
    """What one export holds for us."""

    path: Path
    ranges: list[ActionRange]
    mapped: dict[Key, MappedName]  # ranges read through a name map: their names wait for the worker
    ignored: Counter[str]  # names of NVTX ranges not read as actions
    marks: dict[int, int]  # process_key -> rank
    capture: Capture
    gpu: bool
    spans: dict[Key, tuple[int, int]]


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


def _action_of(name: str, names: RangeNames, patterns: list[re.Pattern[str]]
               ) -> tuple[str, str, int | None, MappedName | None] | None:
    """``(name, kind, prefix worker, mapped)`` of a range name, or None when it names no action."""
    if not patterns:  # our grammar
        m = _PREFIX_RE.match(name)
        bare = name[m.end():] if m else name
        parsed = parse_action_name(bare)
        return None if parsed is None else (bare, parsed[0], int(m["worker"]) if m else None, None)
    mapped = match_name(name, names, patterns)
    return None if mapped is None else (name, mapped.kind, None, mapped)


def _cut_off(rows: list[ActionRange], capture: Capture) -> set[Key]:
    """Ranges that end at the capture's end: still open when it stopped ([Note: the capture window])."""
    if capture.end_ns is not None:
        return {r.key for r in rows if r.end is not None and r.end >= capture.end_ns}
    if capture.latest_end_ns is None or capture.ranges_at_latest < 2:
        return set()
    last = [r for r in rows if r.end == capture.latest_end_ns]
    # Without ANALYSIS_DETAILS the capture's end is the latest end of anything recorded; the STEP
    # that closes a whole capture may end there too, so only a cut action proves the stop.
    return set() if all(r.kind == "STEP" for r in last) else {r.key for r in last}


def _read_file(path: Path, index: int, gpu: GpuArg, names: RangeNames) -> _File:
    patterns = compile_patterns(names)
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
        capture = read_capture(conn, path) if not table_columns(conn, "PIPEFISHER_WORKERS") else \
            Capture(None, None, None, read_capture(conn, path).utc_epoch_ns)  # ours: whole actions only
        ranges, mapped, marks, ignored = [], {}, {}, Counter()
        for row, name, start, end, gtid, event_type in rows:
            name = (name or "").strip()
            mark = RANK_MARK_RE.match(name)
            if mark is not None:
                marks[process_key(int(gtid or 0))] = int(mark["rank"])
                continue
            if event_type is not None and event_type not in NVTX_RANGE_EVENT_TYPES:
                continue
            found = _action_of(name, names, patterns)
            if found is None or (end is not None and end < start):
                ignored[name] += 1
                continue
            action, kind, prefix, spec = found
            early = capture.start_ns is not None and start < capture.start_ns
            ranges.append(ActionRange((index, row), action, kind, int(start), None if end is None else int(end),
                                      int(gtid or 0), prefix, early))
            if spec is not None:
                mapped[(index, row)] = spec
        cut = _cut_off(ranges, capture)
        ranges = [replace(r, end=None) if r.key in cut else r for r in ranges]
        use_gpu = resolve_gpu(conn, gpu)
        spans: dict[Key, tuple[int, int]] = {}
        if use_gpu:
            closed = [(r.key[1], r.global_tid, r.start, r.end) for r in ranges if r.end is not None]
            spans = {(index, row): span for row, span in gpu_spans(conn, closed, path).items()}
    except sqlite3.DatabaseError as exc:
        raise damaged(path, exc) from None
    finally:
        conn.close()
    return _File(path, ranges, mapped, ignored, marks, capture, use_gpu, spans)


def _clock_offsets(files: Sequence[_File]) -> tuple[list[int], list[str]]:
    """Per file, ns to add to put it on the first capture's clock (TARGET_INFO_SESSION_START_TIME),
    none for exports already moved to one ([Note: exported clocks] in ``nsys_capture``)."""
    if len(files) == 1:
        return [0], []
    moved = [f.capture.shifted for f in files]
    if all(moved):
        return [0] * len(files), []
    if any(moved):
        a = next(f.path for f in files if f.capture.shifted)
        b = next(f.path for f in files if not f.capture.shifted)
        raise ProfileError(f"{a} was exported with --ts-normalize or --ts-shift (its export metadata's "
                           f"EXPORT_PARAM_TIME_*) and {b} without, so their clocks differ; export every rank "
                           f"the same way, e.g. 'nsys export --type sqlite --ts-normalize true' for each")
    utc = [f.capture.utc_epoch_ns for f in files]
    if any(u is None for u in utc):
        lacking = [str(f.path) for f in files if f.capture.utc_epoch_ns is None][:3]
        note = (f"{', '.join(lacking)}: no TARGET_INFO_SESSION_START_TIME, so the exports' clocks are taken as one; "
                f"export with a current nsys, or with --ts-normalize true")
        log.warning("%s", note)
        return [0] * len(files), [note]
    base = min(utc)  # type: ignore[type-var]
    return [u - base for u in utc], []  # type: ignore[operator]


def _named(files: Sequence[_File], worker_of: dict[Key, int], names: RangeNames) -> list[_File]:
    """Files with the names of mapped ranges in our grammar, their stage taken from the worker
    ([Note: stages of mapped names] in ``range_names``)."""
    if not any(f.mapped for f in files):
        return list(files)
    num_workers = len(set(worker_of.values()))
    out = []
    for f in files:
        rs = [replace(r, name=action_name(f.mapped[r.key], worker_of[r.key], num_workers, names.chunk_stages))
              if r.key in f.mapped else r for r in f.ranges]
        out.append(replace(f, ranges=_full_backwards(rs, f.mapped, worker_of)))
    return out


def _full_backwards(ranges: list[ActionRange], mapped: dict[Key, MappedName],
                    worker_of: dict[Key, int]) -> list[ActionRange]:
    """A mapped ``I`` with no ``W`` of its worker, stage and micro-batch before the next such ``I``
    is a full backward ``B`` (Megatron's combined backward has the split one's name)."""
    by_key: dict[tuple[int, int | None, int | None, int], list[ActionRange]] = defaultdict(list)
    for r in ranges:
        if r.key in mapped and r.kind in ("I", "W"):
            a = Action.from_str(r.name)
            by_key[(worker_of[r.key], a.stage, a.micro_batch, a.pipe)].append(r)
    full = set()
    for rs in by_key.values():
        rs.sort(key=lambda r: (r.start, r.key))
        full |= {r.key for i, r in enumerate(rs) if r.kind == "I" and (i + 1 == len(rs) or rs[i + 1].kind != "W")}
    return [replace(r, kind="B", name=str(replace(Action.from_str(r.name), kind=ActionKind.BACKWARD)))
            if r.key in full else r for r in ranges]


def _no_actions(where: str, files: Sequence[_File], names: RangeNames, open_: int) -> ProfileError:
    """The error for a capture with no finished range named like an action: the names it did find."""
    ignored = sum((f.ignored for f in files), Counter())
    top = ", ".join(f"{n!r} ×{c}" for n, c in ignored.most_common(5)) or "none"
    grammar = f"the ranges={names.name} patterns" if names.patterns else "'0F2', '3B5@1', 'STEP', …"
    if open_:
        fix = "capture whole steps (let the run finish the profiled steps)"
    else:
        fix = ("for a run of this repository's executor, profile it under 'nsys profile --trace=nvtx,cuda'; for "
               "another runtime's names, map them with ranges= (ranges=megatron_zb for Megatron's zero-bubble "
               "fork, or your own file in conf/ranges/)")
    return ProfileError(
        f"{where}: table NVTX_EVENTS has no {'finished ' if open_ else ''}range named like an action ({grammar}; "
        f"{sum(ignored.values())} other range(s), most frequent: {top}"
        f"{f'; {open_} never ended' if open_ else ''}); {fix}")


def read_nsys(paths: str | Path | Sequence[str | Path], *, gpu: GpuArg = "auto",
              warmup_steps: int = 0, names: RangeNames | None = None) -> Profile:
    """Read the action ranges of one Nsight Systems SQLite export, or of one export per rank.

    Args:
        paths: an ``nsys export --type sqlite`` file (or our own ``profile.sqlite``, whose metadata
            this reader ignores), a comma-separated list or glob of them, or a sequence of those.
        gpu: True: an event spans its action's kernels, [first kernel start, last kernel end],
            instead of its CPU range (an action that launched no kernel keeps its CPU range);
            ``"auto"``: True for an export with CUDA kernels; False: CPU ranges.
        warmup_steps: steps to drop from the start ([Note: steps of an nsys export]); the first
            step the capture touches is step 0, partial or not.
        names: how range names map to actions (``pipefisher.profiling.range_names``); None: ours.

    Returns:
        A :class:`Profile` with ``source="nsys"``, events sorted by start time; workers from
        [Note: ranks of an nsys export], steps from [Note: steps of an nsys export] less
        [Note: partial steps]; several exports are put on one clock by their session start
        times unless exported on one already ([Note: exported clocks]).

    Raises:
        ProfileError: a missing, empty, damaged or non-SQLite file, no NVTX_EVENTS table, names
            lost with StringIds, no range named like an action (the message lists the names
            found), nothing left after the warm-up or the partial steps, exports on mixed clocks,
            or (``gpu=True``) no CUPTI kernel/runtime tables.
        ValueError: a name map that does not compile.
    """
    names = names or RangeNames()
    files_in = expand_paths(paths)
    files = [_read_file(p, i, gpu, names) for i, p in enumerate(files_in)]
    where = str(files_in[0]) if len(files_in) == 1 else f"{len(files_in)} exports ({files_in[0]}, …)"
    ranges = [r for f in files for r in f.ranges]
    if not any(r.end is not None for r in ranges):
        raise _no_actions(where, files, names, len(ranges))
    marks = {(i, key): rank for i, f in enumerate(files) for key, rank in f.marks.items()}
    worker_of, workers, notes = assign_workers(
        {r.key: RangeOrigin(r.key[0], r.global_tid, r.prefix_worker) for r in ranges}, marks, files_in)
    files = _named(files, worker_of, names)
    ranges = [r for f in files for r in f.ranges]
    brackets = enclosing(ranges)
    steps = delimiters(ranges, brackets, worker_of)
    step_of = steps_of(ranges, worker_of, steps)
    if brackets:
        found = sorted({r.name for r in ranges if r.key in brackets})
        log.info("%s: %d range(s) named like an action (%s) enclose other actions: read as step brackets, "
                 "not actions", where, len(brackets), ", ".join(found[:3]))
    partial = partial_steps(ranges, step_of, worker_of, steps, brackets)
    if partial.dropped:
        notes.append(partial.describe())
        log.warning("%s: %s", where, notes[-1])
    offsets, clock_notes = _clock_offsets(files)
    notes += clock_notes
    events, no_kernel = [], 0
    for f_index, f in enumerate(files):
        for r in f.ranges:
            step = step_of[r.key]
            if r.end is None or r.key in brackets or r.early or step < warmup_steps or step in partial.dropped:
                continue
            span = f.spans.get(r.key)
            if f.gpu and span is None:
                no_kernel += 1
            start, end = span if span is not None else (r.start, r.end)
            off = offsets[f_index]
            events.append(Event(worker_of[r.key], r.name, r.kind, start + off, end + off, step))
    if not events:
        whole = partial.num_steps - len(partial.dropped)
        if whole <= 0 or all(s < warmup_steps for s in range(partial.num_steps) if s not in partial.dropped):
            if whole <= 0:
                why = (f"no complete step is left ({partial.describe()}); capture whole steps (let the run "
                       f"finish the profiled steps)")
            else:
                why = (f"warmup_steps={warmup_steps} skips every step of the {partial.num_steps} it holds (steps "
                       f"are counted by STEP ranges){f'; {partial.describe()}' if partial.dropped else ''}; "
                       f"profile more steps or pass warmup_steps=0")
        else:
            why = "no action range is left"
        raise ProfileError(f"{where}: {why}")
    ignored = sum(sum(f.ignored.values()) for f in files)
    if ignored:
        log.info("%s: ignored %d NVTX range(s) not named like an action", where, ignored)
    if no_kernel:
        log.info("%s: %d action range(s) launched no kernel and keep their CPU range", where, no_kernel)
    if warmup_steps:
        log.info("%s: dropped the first %d (warm-up) step(s)", where, warmup_steps)
    events.sort(key=lambda e: (e.start_ns, e.worker, e.end_ns))
    return Profile(events=events, metadata={}, workers=workers, source="nsys",
                   gpu=any(f.gpu for f in files), notes=notes)
