"""What an Nsight Systems export says about its capture: its window and its clock (issue 25).

[Note: the capture window]
nsys writes a range still open when the capture stops with ``end`` = the capture's end, never
NULL. Where ``ANALYSIS_DETAILS`` exists its window is read on the clock of the rows
([Note: the two clocks]); the capture ends at that window's end unless some row ends after it (the
table is then on another clock, e.g. not moved with the rows by ``--ts-shift``). Without it, the
end is the latest ``end`` of any NVTX or CUDA row, and then only where two or more NVTX ranges end
there (nsys closes every open range at the stop; one range that ends last is taken as finished).
A range that began before the capture starts before the window's start.

[Note: the two clocks]
``ANALYSIS_DETAILS(duration, startTime, stopTime)`` gives the capture's start and stop on the
session's clock (0 = when nsys started the session; 7–42 s later in the exports we know of, the
capture began). The rows are not always on that clock (issue 38, defect 2):

- exports written by nsys 2022.4, 2023.1 and 2024.2 count every NVTX and CUDA row from the
  capture's start: all of them lie in [0, duration] and the last range ends exactly at
  ``duration``, while ``startTime`` is seconds later. Read on the session clock, every range
  before ``startTime`` "began before the capture" and whole steps vanish;
- exports written by nsys 2026.2 put the rows on the session clock, in [startTime, stopTime].

The clock is decided from the rows, and from the export's ``EXPORT_PRODUCT_VERSION`` where both
fit. Rows here are NVTX ranges (event types 59, 60) and CUDA kernels and runtime calls with an end;
marks and domain-create rows (eventType 75: negative ``start``, NULL ``end``, written when the
process made its domain, before any capture) say nothing about the window. Then:

- a row that ends after ``duration`` is on the session clock (the capture clock stops there);
- a row that ends before ``startTime`` is on the capture clock (nsys records no range that ended
  before the capture);
- both: neither window holds the rows (the table is on a third clock); none: the export's version
  decides (up to 2024.2: capture clock; from 2026.2: session clock; another or none: the session
  clock, with a log line saying so).

On the capture clock the window is [0, duration] and timestamp 0 is ``startTime`` after the
session's start, so its UTC is ``utcEpochNs + startTime`` (what aligns per-rank exports).

[Note: exported clocks]
From nsys 2023.1 the export's metadata (``EXPORT_META_DATA`` in 2022.1–2023.1,
``META_DATA_EXPORT`` from 2023.4) records ``EXPORT_PARAM_TIME_NORMALIZE`` and
``EXPORT_PARAM_TIME_SHIFT``. An export made with ``--ts-normalize true`` or ``--ts-shift N`` is
already on the clock its user chose: per-rank exports are then not aligned again by their
``TARGET_INFO_SESSION_START_TIME``, and "starts before 0" says nothing.
"""

from __future__ import annotations

import logging
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pipefisher.profiling.types import ProfileError

__all__ = ["CAPTURE_CLOCK", "SESSION_CLOCK", "Capture", "export_version", "read_capture"]

log = logging.getLogger(__name__)

_META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
_TIMED_TABLES = ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")
_RANGE_TYPES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange: what the window bounds ([Note: the two clocks])
SESSION_CLOCK, CAPTURE_CLOCK = "session", "capture"
_LAST_CAPTURE_CLOCK = (2024, 2)  # newest version seen counting rows from the capture's start
_FIRST_SESSION_CLOCK = (2026, 2)  # oldest version seen putting rows on the session clock
_VERSION_RE = re.compile(r"^\s*(\d{4})\.(\d+)")


@dataclass(frozen=True)
class Capture:
    """One export's capture window and clock ([Note: the capture window], [Note: exported clocks])."""

    start_ns: int | None  # when the capture started, on the file's clock; None: unknown (a shifted export)
    end_ns: int | None  # when it stopped, from ANALYSIS_DETAILS; None: not recorded
    latest_end_ns: int | None  # the latest end of any NVTX or CUDA row; None: no row
    utc_epoch_ns: int | None  # UTC of the file's timestamp 0; None: not recorded
    normalized: bool = False  # exported with --ts-normalize true
    shift_ns: int = 0  # exported with --ts-shift
    ranges_at_latest: int = 0  # NVTX rows that end at latest_end_ns
    clock: str = SESSION_CLOCK  # what the rows count from ([Note: the two clocks])
    version: str | None = None  # EXPORT_PRODUCT_VERSION, e.g. "2024.2.1.106"; None: not recorded

    @property
    def shifted(self) -> bool:
        """Whether the export's timestamps were moved when it was written (normalized or shifted)."""
        return self.normalized or self.shift_ns != 0


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}


def export_version(conn: sqlite3.Connection) -> str | None:
    """``EXPORT_PRODUCT_VERSION`` of the export's metadata (``META_DATA_EXPORT`` / ``EXPORT_META_DATA``)."""
    for table in _META_TABLES:
        if _columns(conn, table) >= {"name", "value"}:
            got = conn.execute(f"SELECT value FROM {table} WHERE name = 'EXPORT_PRODUCT_VERSION' LIMIT 1").fetchone()
            if got and got[0] is not None:
                return str(got[0]).strip()
    return None


def _version_key(version: str | None) -> tuple[int, int] | None:
    m = _VERSION_RE.match(version or "")
    return None if m is None else (int(m[1]), int(m[2]))


def _export_params(conn: sqlite3.Connection, path: Path) -> tuple[bool, int]:
    """``(normalized, shift_ns)`` from the export's metadata; (False, 0) when not recorded."""
    normalized, shift = False, 0
    for table in _META_TABLES:
        if not _columns(conn, table) >= {"name", "value"}:
            continue
        rows = conn.execute(f"SELECT name, value FROM {table} WHERE name IN "
                            f"('EXPORT_PARAM_TIME_NORMALIZE', 'EXPORT_PARAM_TIME_SHIFT')").fetchall()
        for name, value in rows:
            text = str(value if value is not None else "").strip().lower()
            if name == "EXPORT_PARAM_TIME_NORMALIZE":
                if text not in _TRUE + _FALSE:
                    raise ProfileError(f"{path}: {table}.{name}={value!r} is neither true nor false; export the "
                                       f"report again with 'nsys export --type sqlite'")
                normalized = normalized or text in _TRUE
            else:
                try:
                    shift = shift or int(float(text or 0))
                except ValueError:
                    raise ProfileError(f"{path}: {table}.{name}={value!r} is not a number of ns; export the "
                                       f"report again with 'nsys export --type sqlite'") from None
    return normalized, shift


def _analysis_details(conn: sqlite3.Connection) -> tuple[int | None, int | None, int | None]:
    """``(startTime, stopTime, duration)`` of ANALYSIS_DETAILS (each None where not recorded)."""
    cols = _columns(conn, "ANALYSIS_DETAILS")
    if not cols & {"duration", "stopTime"}:
        return None, None, None
    pick = [c if c in cols else "NULL" for c in ("startTime", "stopTime", "duration")]
    row = conn.execute(f"SELECT {', '.join(pick)} FROM ANALYSIS_DETAILS LIMIT 1").fetchone()
    if row is None:
        return None, None, None
    start, stop, duration = (None if v is None else int(v) for v in row)
    return start, stop, duration


def _row_filter(conn: sqlite3.Connection, table: str) -> str:
    """SQL condition for the rows of ``table`` that bound a capture: ranges (not marks or domain creates)."""
    if table == "NVTX_EVENTS" and "eventType" in _columns(conn, table):
        return f'"end" IS NOT NULL AND eventType IN {_RANGE_TYPES}'
    return '"end" IS NOT NULL'


def _latest_end(conn: sqlite3.Connection) -> int | None:
    ends = []
    for table in _TIMED_TABLES:
        if "end" in _columns(conn, table):
            (value,) = conn.execute(f'SELECT max("end") FROM {table}').fetchone()
            if value is not None:
                ends.append(int(value))
    return max(ends) if ends else None


def _earliest_end(conn: sqlite3.Connection) -> int | None:
    """The earliest end of an NVTX range or CUDA row ([Note: the two clocks])."""
    ends = []
    for table in _TIMED_TABLES:
        if "end" in _columns(conn, table):
            (value,) = conn.execute(f'SELECT min("end") FROM {table} WHERE {_row_filter(conn, table)}').fetchone()
            if value is not None:
                ends.append(int(value))
    return min(ends) if ends else None


def _utc_epoch(conn: sqlite3.Connection) -> int | None:
    if not _columns(conn, "TARGET_INFO_SESSION_START_TIME") >= {"utcEpochNs"}:
        return None
    got = conn.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
    return int(got[0]) if got and got[0] is not None else None


def _clock(start: int, stop: int, duration: int, earliest: int | None, latest: int | None,
           version: str | None, shifted: bool, path: Path) -> str | None:
    """The clock of an export's rows by [Note: the two clocks]; None: neither window holds them."""
    after = latest is not None and latest > duration  # impossible on the capture clock
    before = earliest is not None and earliest < start  # impossible on the session clock
    if shifted:  # moved by the user: only a window that holds the rows is theirs ([Note: exported clocks])
        return None if before or (latest is not None and latest > stop) else SESSION_CLOCK
    if after != before:
        return SESSION_CLOCK if after else CAPTURE_CLOCK
    if after:
        return None
    key = _version_key(version)
    if key is not None and key <= _LAST_CAPTURE_CLOCK:
        return CAPTURE_CLOCK
    if key is None or key < _FIRST_SESSION_CLOCK:
        log.info("%s: its rows fit both the capture clock [0, %d] and the session clock [%d, %d] of "
                 "ANALYSIS_DETAILS, and nsys %s is not one whose clock is known; read on the session clock",
                 path, duration, start, stop, version or "(version not recorded)")
    return SESSION_CLOCK


def read_capture(conn: sqlite3.Connection, path: Path) -> Capture:
    """The capture window and clock of an open export ([Note: the two clocks]).

    Raises:
        ProfileError: an export parameter that cannot be read (names the table and field).
    """
    normalized, shift = _export_params(conn, path)
    version = export_version(conn)
    shifted = normalized or shift != 0
    begin, stop, duration = _analysis_details(conn)
    latest = _latest_end(conn)
    utc = _utc_epoch(conn)
    if stop is None and duration is not None:
        stop = (begin or 0) + duration
    if duration is None and stop is not None:
        duration = stop - (begin or 0)
    clock: str | None = SESSION_CLOCK
    if begin and duration is not None:
        clock = _clock(begin, stop, duration, _earliest_end(conn), latest, version, shifted,  # type: ignore[arg-type]
                       path)
    start, end = begin, stop
    if clock == CAPTURE_CLOCK:
        start, end = 0, duration
        utc = None if utc is None else utc + begin  # type: ignore[operator]
    elif clock is None or (end is not None and latest is not None and latest > end):
        start, end = None, None  # ANALYSIS_DETAILS on another clock than the rows (e.g. not shifted with them)
    if start is None and not shifted:
        start = 0
    at_latest = 0
    if latest is not None and "end" in _columns(conn, "NVTX_EVENTS"):
        (at_latest,) = conn.execute('SELECT count(*) FROM NVTX_EVENTS WHERE "end" = ?', (latest,)).fetchone()
    return Capture(start, end, latest, utc, normalized, shift, at_latest, clock or SESSION_CLOCK, version)
