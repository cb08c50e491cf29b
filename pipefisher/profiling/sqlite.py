"""``profile.sqlite``: a run's timeline in the Nsight Systems export layout, plus run metadata.

Writing our profiles in the layout of ``nsys export --type sqlite`` (DESIGN.md, "profile.sqlite")
lets one reader serve both: :func:`read_profile` reads our files exactly and hands real exports to
:func:`pipefisher.profiling.nsys.read_nsys`.

[Note: profile.sqlite layout]
Tables shared with Nsight Systems (times in ns)::

    StringIds(id INTEGER PRIMARY KEY, value TEXT)          one row per distinct action name
    NVTX_EVENTS(start, end, eventType, rangeId, category,  one row per event; eventType 59
                color, text, globalTid, endGlobalTid,      (NvtxPushPopRange); the name through
                textId, domainId, …)                       textId (text is NULL)

Worker w is written as a fake process: pid = tid = FAKE_PID_BASE + w, and, as nsys serializes it,
``globalTid = pid << 24 | tid``. Our own tables::

    PIPEFISHER_META(key TEXT PRIMARY KEY, value TEXT)       run metadata, each value JSON
    PIPEFISHER_WORKERS(worker, rank, globalTid, host)       worker → rank (and host) map
    PIPEFISHER_EVENTS(nvtxRowId INTEGER PRIMARY KEY, step, kind)
                                                            the rest of each Event; nvtxRowId is
                                                            the rowid of its NVTX_EVENTS row

``PRAGMA user_version`` holds :data:`FORMAT_VERSION`. Metadata values go through JSON, so tuples
come back as lists and dict keys as strings.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipefisher.profiling.nsys import (
    NVTX_PUSH_POP_RANGE,
    Profile,
    ProfileError,
    WorkerInfo,
    gpu_spans,
    open_database,
    read_nsys,
    table_columns,
)
from pipefisher.timeline import Event

__all__ = ["FAKE_PID_BASE", "FORMAT_VERSION", "META_KEYS", "global_tid_of_worker", "read_profile",
           "write_profile"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FAKE_PID_BASE = 100_000  # worker w is process FAKE_PID_BASE + w (pids fit in nsys's 24 bits)
# Metadata keys the run writes (others are kept too): the composed config, the pipeline method,
# stages, micro-batches, steps, device and whether there were more workers than cores (then CPU
# bubble figures mean little, DESIGN.md "Conventions").
META_KEYS: tuple[str, ...] = ("config", "method", "num_stages", "num_micro_batches", "num_steps",
                              "device", "oversubscribed")

_SCHEMA = """
CREATE TABLE StringIds (id INTEGER NOT NULL PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (
    start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL, rangeId INTEGER,
    category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER,
    textId INTEGER REFERENCES StringIds(id), domainId INTEGER, uint64Value INTEGER,
    int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT
);
CREATE TABLE PIPEFISHER_META (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE PIPEFISHER_WORKERS (
    worker INTEGER PRIMARY KEY, rank INTEGER NOT NULL, globalTid INTEGER NOT NULL UNIQUE, host TEXT
);
CREATE TABLE PIPEFISHER_EVENTS (
    nvtxRowId INTEGER PRIMARY KEY REFERENCES NVTX_EVENTS(rowid), step INTEGER NOT NULL,
    kind TEXT NOT NULL
);
"""


def global_tid_of_worker(worker: int) -> int:
    """The Nsight Systems ``globalTid`` our files give ``worker`` ([Note: profile.sqlite layout])."""
    pid = FAKE_PID_BASE + worker
    if not 0 <= worker or pid >= 1 << 24:
        raise ValueError(f"worker {worker} out of range for profile.sqlite: 0 <= worker < "
                         f"{(1 << 24) - FAKE_PID_BASE}")
    return pid << 24 | pid


def _json_metadata(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise ValueError(f"metadata key {key!r} is not a string; profile metadata keys are strings")
        try:
            rows.append((key, json.dumps(value, sort_keys=True)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metadata[{key!r}] cannot be stored as JSON ({exc}); convert it "
                             f"first, e.g. OmegaConf.to_container(cfg, resolve=True)") from exc
    return rows


def write_profile(path: str | Path, events: Sequence[Event], *, metadata: Mapping[str, Any],
                  worker_ranks: Mapping[int, int] | None = None,
                  worker_hosts: Mapping[int, str] | None = None) -> None:
    """Write ``events`` and run metadata to ``path`` atomically ([Note: profile.sqlite layout]).

    The file is built beside ``path`` under a temporary name and moved into place with
    ``os.replace``, so a reader never sees half a profile and an existing file is replaced whole.

    Args:
        path: destination, conventionally ``profile.sqlite`` in the run's output directory.
        events: timeline events (any order; read back in this order).
        metadata: JSON-serializable run metadata, see :data:`META_KEYS`.
        worker_ranks: ``{worker: rank}``; a worker not listed has rank = worker.
        worker_hosts: ``{worker: host name}``; unknown hosts are stored as NULL.

    Raises:
        ValueError: a metadata value is not JSON-serializable, or an event is malformed
            (negative worker, end before start).
    """
    path = Path(path)
    worker_ranks = dict(worker_ranks or {})
    worker_hosts = dict(worker_hosts or {})
    meta_rows = _json_metadata(metadata)
    for e in events:
        if e.end_ns < e.start_ns:
            raise ValueError(f"event {e} ends before it starts; cannot write it to {path}")
    workers = sorted({e.worker for e in events} | set(worker_ranks) | set(worker_hosts))
    tids = {w: global_tid_of_worker(w) for w in workers}
    string_ids: dict[str, int] = {}
    for e in events:
        string_ids.setdefault(e.name, len(string_ids) + 1)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        conn = sqlite3.connect(tmp)
        try:
            with conn:
                conn.executescript(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
                conn.executemany("INSERT INTO StringIds(id, value) VALUES (?, ?)",
                                 [(i, s) for s, i in string_ids.items()])
                conn.executemany(
                    "INSERT INTO NVTX_EVENTS(rowid, start, end, eventType, globalTid, endGlobalTid, "
                    "textId) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    [(i, e.start_ns, e.end_ns, NVTX_PUSH_POP_RANGE, tids[e.worker], tids[e.worker],
                      string_ids[e.name]) for i, e in enumerate(events, start=1)])
                conn.executemany("INSERT INTO PIPEFISHER_EVENTS(nvtxRowId, step, kind) VALUES (?, ?, ?)",
                                 [(i, e.step, e.kind) for i, e in enumerate(events, start=1)])
                conn.executemany("INSERT INTO PIPEFISHER_WORKERS VALUES (?, ?, ?, ?)",
                                 [(w, worker_ranks.get(w, w), tids[w], worker_hosts.get(w))
                                  for w in workers])
                conn.executemany("INSERT INTO PIPEFISHER_META VALUES (?, ?)", meta_rows)
        finally:
            conn.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("wrote %d events of %d workers to %s", len(events), len(workers), path)


def _is_ours(conn: sqlite3.Connection) -> bool:
    return bool(table_columns(conn, "PIPEFISHER_META"))


def _read_ours(conn: sqlite3.Connection, path: Path, gpu: bool) -> Profile:
    for table in ("PIPEFISHER_EVENTS", "PIPEFISHER_WORKERS", "NVTX_EVENTS", "StringIds"):
        if not table_columns(conn, table):
            raise ProfileError(f"{path}: has PIPEFISHER_META but no {table} table, so it is a damaged "
                               f"profile.sqlite; rewrite it with write_profile (rerun profile.py)")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > FORMAT_VERSION:
        raise ProfileError(f"{path}: profile format version {version} is newer than this reader's "
                           f"{FORMAT_VERSION}; update pipefisher")
    metadata = {k: json.loads(v) for k, v in conn.execute("SELECT key, value FROM PIPEFISHER_META")}
    workers = {w: WorkerInfo(w, rank, gtid, host) for w, rank, gtid, host in conn.execute(
        "SELECT worker, rank, globalTid, host FROM PIPEFISHER_WORKERS ORDER BY worker")}
    worker_of_tid = {info.global_tid: w for w, info in workers.items()}
    rows = conn.execute(
        "SELECT n.rowid, COALESCE(n.text, s.value), p.kind, n.start, n.end, n.globalTid, p.step "
        "FROM NVTX_EVENTS AS n JOIN PIPEFISHER_EVENTS AS p ON p.nvtxRowId = n.rowid "
        "LEFT JOIN StringIds AS s ON s.id = n.textId ORDER BY n.rowid").fetchall()
    unknown = {r[5] for r in rows} - set(worker_of_tid)
    if unknown:
        raise ProfileError(f"{path}: NVTX_EVENTS has globalTid(s) {sorted(unknown)[:3]} missing from "
                           f"PIPEFISHER_WORKERS; rewrite the file with write_profile")
    spans = {r[0]: (r[3], r[4]) for r in rows}
    if gpu:
        spans = gpu_spans(conn, [(r[0], r[5], r[3], r[4]) for r in rows], path)
    events = [Event(worker_of_tid[gtid], name, kind, *spans[row], step)
              for row, name, kind, _, _, gtid, step in rows if row in spans]
    return Profile(events=events, metadata=metadata, workers=workers, source="pipefisher")


def read_profile(path: str | Path, *, gpu: bool = False) -> Profile:
    """Read a ``profile.sqlite`` written by :func:`write_profile`, or a real nsys export.

    Args:
        path: the database.
        gpu: GPU spans instead of CPU ranges (needs CUPTI kernel tables, i.e. an nsys export); see
            :func:`pipefisher.profiling.nsys.read_nsys`.

    Returns:
        For our files, exactly the events written (same order), the metadata and the worker map;
        for an nsys export (no ``PIPEFISHER_*`` tables), what ``read_nsys`` finds.

    Raises:
        ProfileError: not an SQLite file, a missing table, or no recognizable action ranges; the
            message names the file, the table and the fix.
    """
    path = Path(path)
    conn = open_database(path)
    try:
        ours = _is_ours(conn)
        if ours:
            return _read_ours(conn, path, gpu)
    finally:
        conn.close()
    return read_nsys(path, gpu=gpu)
