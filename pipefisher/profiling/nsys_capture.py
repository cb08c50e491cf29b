"""What an Nsight Systems export says about its capture: its window and its clock (issue 25).

[Note: the capture window]
nsys writes a range still open when the capture stops with ``end`` = the capture's end, never
NULL. The end is ``ANALYSIS_DETAILS`` (``stopTime``, else ``startTime + duration``) where that table
exists and agrees with the data (no row ends after it); otherwise the latest ``end`` of any NVTX
or CUDA row, and then only where two or more NVTX ranges end there (nsys closes every open range
at the stop; one range that ends last is taken as finished). Timestamps count from the session start, so a range that began before the capture
has a negative ``start``; the capture starts at ``ANALYSIS_DETAILS.startTime``, else 0.

[Note: exported clocks]
From nsys 2023.1 the export's metadata (``EXPORT_META_DATA`` in 2022.1–2023.1,
``META_DATA_EXPORT`` from 2023.4) records ``EXPORT_PARAM_TIME_NORMALIZE`` and
``EXPORT_PARAM_TIME_SHIFT``. An export made with ``--ts-normalize true`` or ``--ts-shift N`` is
already on the clock its user chose: per-rank exports are then not aligned again by their
``TARGET_INFO_SESSION_START_TIME``, and "starts before 0" says nothing.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pipefisher.profiling.types import ProfileError

__all__ = ["Capture", "read_capture"]

_META_TABLES = ("META_DATA_EXPORT", "EXPORT_META_DATA")
_TIMED_TABLES = ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_RUNTIME")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off", "")


@dataclass(frozen=True)
class Capture:
    """One export's capture window and clock ([Note: the capture window], [Note: exported clocks])."""

    start_ns: int | None  # when the capture started, on the file's clock; None: unknown (a shifted export)
    end_ns: int | None  # when it stopped, from ANALYSIS_DETAILS; None: not recorded
    latest_end_ns: int | None  # the latest end of any NVTX or CUDA row; None: no row
    utc_epoch_ns: int | None  # UTC of timestamp 0 (TARGET_INFO_SESSION_START_TIME); None: not recorded
    normalized: bool = False  # exported with --ts-normalize true
    shift_ns: int = 0  # exported with --ts-shift
    ranges_at_latest: int = 0  # NVTX rows that end at latest_end_ns

    @property
    def shifted(self) -> bool:
        """Whether the export's timestamps were moved when it was written (normalized or shifted)."""
        return self.normalized or self.shift_ns != 0


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f'PRAGMA table_info("{table}")')}


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


def _analysis_window(conn: sqlite3.Connection) -> tuple[int | None, int | None]:
    """``(start, end)`` of the capture from ANALYSIS_DETAILS, or Nones."""
    cols = _columns(conn, "ANALYSIS_DETAILS")
    if not cols & {"duration", "stopTime"}:
        return None, None
    pick = [c if c in cols else "NULL" for c in ("startTime", "stopTime", "duration")]
    row = conn.execute(f"SELECT {', '.join(pick)} FROM ANALYSIS_DETAILS LIMIT 1").fetchone()
    if row is None:
        return None, None
    start, stop, duration = (None if v is None else int(v) for v in row)
    end = stop if stop is not None else None if duration is None else (start or 0) + duration
    return start, end


def _latest_end(conn: sqlite3.Connection) -> int | None:
    ends = []
    for table in _TIMED_TABLES:
        if "end" in _columns(conn, table):
            (value,) = conn.execute(f'SELECT max("end") FROM {table}').fetchone()
            if value is not None:
                ends.append(int(value))
    return max(ends) if ends else None


def _utc_epoch(conn: sqlite3.Connection) -> int | None:
    if not _columns(conn, "TARGET_INFO_SESSION_START_TIME") >= {"utcEpochNs"}:
        return None
    got = conn.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME LIMIT 1").fetchone()
    return int(got[0]) if got and got[0] is not None else None


def read_capture(conn: sqlite3.Connection, path: Path) -> Capture:
    """The capture window and clock of an open export.

    Raises:
        ProfileError: an export parameter that cannot be read (names the table and field).
    """
    normalized, shift = _export_params(conn, path)
    start, end = _analysis_window(conn)
    latest = _latest_end(conn)
    if end is not None and latest is not None and latest > end:
        start, end = None, None  # ANALYSIS_DETAILS on another clock than the rows (e.g. not shifted with them)
    shifted = normalized or shift != 0
    if start is None and not shifted:
        start = 0
    at_latest = 0
    if latest is not None and "end" in _columns(conn, "NVTX_EVENTS"):
        (at_latest,) = conn.execute('SELECT count(*) FROM NVTX_EVENTS WHERE "end" = ?', (latest,)).fetchone()
    return Capture(start, end, latest, _utc_epoch(conn), normalized, shift, at_latest)
