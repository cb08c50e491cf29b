"""``profile.sqlite``: a run's timeline in the Nsight Systems export layout, plus run metadata.

Writing our profiles the way ``nsys export --type sqlite`` writes its databases (DESIGN.md,
"profile.sqlite") lets one reader serve both, and lets NVIDIA's own queries and recipes read ours:
:func:`read_profile` reads our files exactly and hands real exports to
:func:`pipefisher.profiling.nsys.read_nsys`.

[Note: profile.sqlite layout]
Tables shared with Nsight Systems, with nsys's columns (times in ns)::

    NVTX_EVENTS(start, end, eventType, rangeId, category,   one row per event: eventType 59
                color, text, globalTid, endGlobalTid,       (NvtxPushPopRange), the name in text
                textId, domainId, …)                        (an unregistered string), textId NULL,
                                                            endGlobalTid NULL (same thread),
                                                            domainId 0; and per worker one mark
                                                            (34) "rank=N" at its first event
    StringIds(id, value)                                    thread names
    ThreadNames(nameId, priority, globalTid)                "worker W (rank R)"
    PROCESSES(globalPid, pid, name)                         one per worker
    META_DATA_EXPORT(name, value)                           who wrote the file, format version
    TARGET_INFO_SESSION_START_TIME(utcEpochNs, utcTime,     UTC of timestamp 0 on the first
                                   localTime)               worker's host
    ENUM_NSYS_EVENT_TYPE(id, name, label)                   34, 59, 60, 75

A worker's ``globalTid`` is nsys's encoding of its real process and thread,
``(host index << 48) | (pid << 24) | tid`` (the host index, 0 for the first worker's host, keeps
equal pids on two hosts apart); a worker without a recorded origin gets the made-up pid = tid =
``FAKE_PID_BASE + w``. Event times are each host's ``perf_counter_ns`` ([Note: clocks per host] in
``pipefisher.profiling.origin``). Our own tables::

    PIPEFISHER_META(key TEXT PRIMARY KEY, value TEXT)       run metadata, each value JSON
    PIPEFISHER_WORKERS(worker, rank, globalTid, host)       worker → rank (and host) map
    PIPEFISHER_HOSTS(host, hwId, utcOffsetNs)               clock alignment per host:
                                                            UTC ns = event ns + utcOffsetNs
    PIPEFISHER_EVENTS(nvtxRowId INTEGER PRIMARY KEY, step,  the rest of each Event; nvtxRowId is
                      kind, name)                           the rowid of its NVTX_EVENTS row; name
                                                            only for a wait, whose NVTX text is its
                                                            collective (SYNC_GRAD), as on a GPU

``PRAGMA user_version`` holds :data:`FORMAT_VERSION` (1: names through textId, made-up pids;
still read). Metadata values go through JSON, so tuples come back as lists and dict keys as strings.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipefisher.atomic import temp_beside
from pipefisher.profiling.nsys import (
    NVTX_MARK,
    NVTX_PUSH_POP_RANGE,
    NVTX_START_END_RANGE,
    GpuArg,
    damaged,
    expand_paths,
    gpu_spans,
    open_database,
    read_nsys,
    resolve_gpu,
    table_columns,
)
from pipefisher.profiling.nsys_gpu import TID_MASK
from pipefisher.profiling.nvtx import rank_mark_text
from pipefisher.profiling.origin import WorkerOrigin
from pipefisher.profiling.range_names import RangeNames
from pipefisher.profiling.types import Profile, ProfileError, WorkerInfo
from pipefisher.timeline import Event, is_wait

__all__ = ["FAKE_PID_BASE", "FORMAT_VERSION", "META_KEYS", "global_tid_of_worker", "read_profile",
           "worker_global_tids", "write_profile"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
FAKE_PID_BASE = 100_000  # worker w without an origin is process FAKE_PID_BASE + w (fits nsys's 24 bits)
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
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT, binaryData TEXT
);
CREATE TABLE ThreadNames (nameId INTEGER NOT NULL, priority INTEGER, globalTid INTEGER);
CREATE TABLE PROCESSES (globalPid INTEGER, pid INTEGER, name TEXT);
CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT);
CREATE TABLE TARGET_INFO_SESSION_START_TIME (utcEpochNs INTEGER, utcTime TEXT, localTime TEXT);
CREATE TABLE ENUM_NSYS_EVENT_TYPE (id INTEGER NOT NULL PRIMARY KEY, name TEXT, label TEXT);
CREATE TABLE PIPEFISHER_META (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE PIPEFISHER_WORKERS (
    worker INTEGER PRIMARY KEY, rank INTEGER NOT NULL, globalTid INTEGER NOT NULL UNIQUE, host TEXT
);
CREATE TABLE PIPEFISHER_HOSTS (host TEXT PRIMARY KEY, hwId INTEGER NOT NULL, utcOffsetNs INTEGER NOT NULL);
CREATE TABLE PIPEFISHER_EVENTS (
    nvtxRowId INTEGER PRIMARY KEY REFERENCES NVTX_EVENTS(rowid), step INTEGER NOT NULL,
    kind TEXT NOT NULL, name TEXT
);
"""
_EVENT_TYPES = ((NVTX_MARK, "NvtxMark"), (NVTX_PUSH_POP_RANGE, "NvtxPushPopRange"),
                (NVTX_START_END_RANGE, "NvtxStartEndRange"), (75, "NvtxDomainCreate"))


def global_tid_of_worker(worker: int) -> int:
    """The made-up ``globalTid`` of a worker without a recorded origin ([Note: profile.sqlite layout])."""
    pid = FAKE_PID_BASE + worker
    if not 0 <= worker or pid >= 1 << 24:
        raise ValueError(f"worker {worker} out of range for profile.sqlite: 0 <= worker < "
                         f"{(1 << 24) - FAKE_PID_BASE}")
    return pid << 24 | pid


def worker_global_tids(workers: Sequence[int], origins: Mapping[int, WorkerOrigin]) -> dict[int, int]:
    """``{worker: globalTid}``: nsys's encoding of each worker's host, pid and tid.

    Raises:
        ValueError: a pid or tid beyond nsys's 24 bits, or two workers on one host, pid and tid.
    """
    hosts: dict[str, int] = {}
    out: dict[int, int] = {}
    for w in workers:
        o = origins.get(w)
        if o is None:
            out[w] = global_tid_of_worker(w)
            continue
        if not (0 < o.pid <= TID_MASK and 0 < o.tid <= TID_MASK):
            raise ValueError(f"worker {w}: pid {o.pid} / tid {o.tid} do not fit nsys's 24-bit globalTid fields")
        hw = hosts.setdefault(o.host, len(hosts))
        out[w] = hw << 48 | o.pid << 24 | o.tid
    clash = len(set(out.values())) < len(out)
    if clash:
        raise ValueError(f"two workers have one host, pid and tid ({origins}); each worker is its own process")
    return out


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


def _utc_text(utc_ns: int, local: bool) -> str:
    t = dt.datetime.fromtimestamp(utc_ns / 1e9, tz=dt.timezone.utc)
    return (t.astimezone() if local else t).isoformat(timespec="microseconds")


def _nsys_rows(events: Sequence[Event], workers: Sequence[int], ranks: Mapping[int, int],
               tids: Mapping[int, int], origins: Mapping[int, WorkerOrigin]) -> dict[str, list[tuple]]:
    """Rows of the tables shared with Nsight Systems ([Note: profile.sqlite layout])."""
    first = {}
    for e in events:
        first[e.worker] = min(first.get(e.worker, e.start_ns), e.start_ns)
    # A wait is named by its collective, as the executor's NVTX range for it is (SYNC_GRAD, …).
    nvtx = [(e.start_ns, e.end_ns, NVTX_PUSH_POP_RANGE, e.kind if is_wait(e) else e.name, tids[e.worker], None,
             None, 0) for e in events]
    nvtx += [(first[w], None, NVTX_MARK, rank_mark_text(ranks[w]), tids[w], None, None, 0)
             for w in workers if w in first]
    strings = [(i, f"worker {w} (rank {ranks[w]})") for i, w in enumerate(workers, start=1)]
    threads = [(i, 0, tids[w]) for i, w in enumerate(workers, start=1)]
    processes = [(tids[w] & ~TID_MASK, (tids[w] >> 24) & TID_MASK,
                  origins[w].process_name if w in origins else "python") for w in workers]
    meta = [("EXPORT_PRODUCT", "pipefisher profile.sqlite"), ("PIPEFISHER_FORMAT_VERSION", str(FORMAT_VERSION)),
            ("TIMESTAMPS", "perf_counter_ns of each worker's host; UTC = ns + PIPEFISHER_HOSTS.utcOffsetNs")]
    session = []
    if workers and workers[0] in origins:
        utc0 = origins[workers[0]].utc_offset_ns  # UTC of timestamp 0 on the first worker's host
        session = [(utc0, _utc_text(utc0, False), _utc_text(utc0, True))]
    return {"nvtx": nvtx, "strings": strings, "threads": threads, "processes": processes, "meta": meta,
            "session": session, "types": [(i, n, n) for i, n in _EVENT_TYPES]}


def write_profile(path: str | Path, events: Sequence[Event], *, metadata: Mapping[str, Any],
                  worker_ranks: Mapping[int, int] | None = None,
                  worker_hosts: Mapping[int, str] | None = None,
                  origins: Mapping[int, WorkerOrigin] | None = None) -> None:
    """Write ``events`` and run metadata to ``path`` atomically ([Note: profile.sqlite layout]).

    The file is built beside ``path`` under a temporary name and moved into place with
    ``os.replace``, so a reader never sees half a profile and an existing file is replaced whole.

    Args:
        path: destination, conventionally ``profile.sqlite`` in the run's output directory.
        events: timeline events (any order; read back in this order).
        metadata: JSON-serializable run metadata, see :data:`META_KEYS`.
        worker_ranks: ``{worker: rank}``; a worker not listed has rank = worker.
        worker_hosts: ``{worker: host name}`` for workers without an origin; unknown hosts are NULL.
        origins: ``{worker: WorkerOrigin}`` as each worker recorded it (host, pid, tid, clock);
            a worker without one gets a made-up pid and tid.

    Raises:
        ValueError: a metadata value is not JSON-serializable, or an event is malformed
            (negative worker, end before start).
    """
    path = Path(path)
    origins = dict(origins or {})
    worker_hosts = {**dict(worker_hosts or {}), **{w: o.host for w, o in origins.items()}}
    meta_rows = _json_metadata(metadata)
    for e in events:
        if e.end_ns < e.start_ns:
            raise ValueError(f"event {e} ends before it starts; cannot write it to {path}")
    workers = sorted({e.worker for e in events} | set(worker_ranks or {}) | set(worker_hosts))
    ranks = {w: (worker_ranks or {}).get(w, w) for w in workers}
    tids = worker_global_tids(workers, origins)
    hosts: dict[str, tuple[int, int]] = {}
    for w in workers:
        if w in origins:
            hosts.setdefault(origins[w].host, (tids[w] >> 48, origins[w].utc_offset_ns))
    rows = _nsys_rows(events, workers, ranks, tids, origins)

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            with conn:
                conn.executescript(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
                conn.executemany("INSERT INTO NVTX_EVENTS(start, end, eventType, text, globalTid, endGlobalTid, "
                                 "textId, domainId) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows["nvtx"])
                conn.executemany("INSERT INTO StringIds(id, value) VALUES (?, ?)", rows["strings"])
                conn.executemany("INSERT INTO ThreadNames VALUES (?, ?, ?)", rows["threads"])
                conn.executemany("INSERT INTO PROCESSES VALUES (?, ?, ?)", rows["processes"])
                conn.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)", rows["meta"])
                conn.executemany("INSERT INTO TARGET_INFO_SESSION_START_TIME VALUES (?, ?, ?)", rows["session"])
                conn.executemany("INSERT INTO ENUM_NSYS_EVENT_TYPE VALUES (?, ?, ?)", rows["types"])
                conn.executemany("INSERT INTO PIPEFISHER_EVENTS(nvtxRowId, step, kind, name) VALUES (?, ?, ?, ?)",
                                 [(i, e.step, e.kind, e.name if is_wait(e) else None)
                                  for i, e in enumerate(events, start=1)])
                conn.executemany("INSERT INTO PIPEFISHER_WORKERS VALUES (?, ?, ?, ?)",
                                 [(w, ranks[w], tids[w], worker_hosts.get(w)) for w in workers])
                conn.executemany("INSERT INTO PIPEFISHER_HOSTS VALUES (?, ?, ?)",
                                 [(h, hw, off) for h, (hw, off) in hosts.items()])
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


def _read_ours(conn: sqlite3.Connection, path: Path, gpu: GpuArg) -> Profile:
    for table in ("PIPEFISHER_EVENTS", "PIPEFISHER_WORKERS", "NVTX_EVENTS"):
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
    hosts = ({h: off for h, off in conn.execute("SELECT host, utcOffsetNs FROM PIPEFISHER_HOSTS")}
             if table_columns(conn, "PIPEFISHER_HOSTS") else {})
    worker_of_tid = {info.global_tid: w for w, info in workers.items()}
    pname = "p.name" if "name" in table_columns(conn, "PIPEFISHER_EVENTS") else "NULL"
    names = ("COALESCE(n.text, s.value)", "LEFT JOIN StringIds AS s ON s.id = n.textId") \
        if version < 2 else (f"COALESCE({pname}, n.text)", "")
    rows = conn.execute(
        f"SELECT n.rowid, {names[0]}, p.kind, n.start, n.end, n.globalTid, p.step "
        f"FROM NVTX_EVENTS AS n JOIN PIPEFISHER_EVENTS AS p ON p.nvtxRowId = n.rowid {names[1]} "
        f"ORDER BY n.rowid").fetchall()
    unknown = {r[5] for r in rows} - set(worker_of_tid)
    if unknown:
        raise ProfileError(f"{path}: NVTX_EVENTS has globalTid(s) {sorted(unknown)[:3]} missing from "
                           f"PIPEFISHER_WORKERS; rewrite the file with write_profile")
    spans = {r[0]: (r[3], r[4]) for r in rows}
    use_gpu = resolve_gpu(conn, gpu)
    if use_gpu:
        spans.update(gpu_spans(conn, [(r[0], r[5], r[3], r[4]) for r in rows], path))
    events = [Event(worker_of_tid[gtid], name, kind, *spans[row], step)
              for row, name, kind, _, _, gtid, step in rows]
    return Profile(events=events, metadata=metadata, workers=workers, source="pipefisher", gpu=use_gpu,
                   hosts_utc_offset_ns=hosts)


def read_profile(path: str | Path | Sequence[str | Path], *, gpu: GpuArg = "auto",
                 warmup_steps: int = 0, names: RangeNames | None = None) -> Profile:
    """Read a ``profile.sqlite`` written by :func:`write_profile`, or real nsys exports.

    Args:
        path: the database; for nsys exports also a comma-separated list or glob of per-rank files.
        gpu: kernel spans instead of CPU ranges: True, False, or ``"auto"`` (when the database
            has CUDA kernels); see :func:`pipefisher.profiling.nsys.read_nsys`.
        warmup_steps: steps to drop from the start of an nsys export (our files hold only the
            steps after ``profile.warmup_steps`` already, so it does not apply to them).
        names: how an nsys export's range names map to actions (``range_names``); None: ours.

    Returns:
        For our files, exactly the events written (same order), the metadata, the worker map and
        the hosts' clock offsets; for nsys exports (no ``PIPEFISHER_*`` tables), what ``read_nsys``
        finds.

    Raises:
        ProfileError: a missing, empty, damaged or non-SQLite file, a missing table, or no
            recognizable action ranges; the message names the file, the table and the fix.
    """
    paths = expand_paths(path)
    if len(paths) == 1:
        conn = open_database(paths[0])
        try:
            if _is_ours(conn):
                return _read_ours(conn, paths[0], gpu)
        except sqlite3.DatabaseError as exc:
            raise damaged(paths[0], exc) from None
        finally:
            conn.close()
    return read_nsys(paths, gpu=gpu, warmup_steps=warmup_steps, names=names)
