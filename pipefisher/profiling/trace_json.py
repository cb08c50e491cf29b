"""``timeline.json``: a run's timeline in the Trace Event Format, for ui.perfetto.dev and
chrome://tracing.

[Note: timeline.json]
The JSON object format: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
Each worker is one process (``pid`` = worker index, named by a ``process_name`` metadata event
with its rank, host and OS pid; ``process_sort_index`` keeps rank order); its actions are complete
events (``"ph": "X"``, ``ts`` and ``dur`` in µs) on one thread, ``cat`` = the action kind,
``args`` = step and kind. Times are put on one axis through each host's UTC offset where the
workers' origins are known ([Note: clocks per host]), then shifted so the first event is at 0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipefisher.atomic import write_text_atomic
from pipefisher.profiling.origin import WorkerOrigin
from pipefisher.timeline import Event

__all__ = ["ACTION_TID", "trace_events", "write_trace_json"]

ACTION_TID = 1  # the one thread of a worker process in the trace


def _label(w: int, rank: int, origin: WorkerOrigin | None) -> str:
    where = f" on {origin.host}, pid {origin.pid}" if origin is not None else ""
    return f"worker {w} (rank {rank}){where}"


def trace_events(events: Sequence[Event], *, ranks: Mapping[int, int] | None = None,
                 origins: Mapping[int, WorkerOrigin] | None = None) -> list[dict[str, Any]]:
    """The ``traceEvents`` list of [Note: timeline.json]."""
    origins = origins or {}
    offset = {w: o.utc_offset_ns for w, o in origins.items()}
    aligned = [(e, e.start_ns + offset.get(e.worker, 0)) for e in events]
    t0 = min((t for _, t in aligned), default=0)
    workers = sorted({e.worker for e in events} | set(origins) | set(ranks or {}))
    out: list[dict[str, Any]] = []
    for w in workers:
        rank = (ranks or {}).get(w, w)
        out.append({"name": "process_name", "ph": "M", "pid": w, "tid": ACTION_TID,
                    "args": {"name": _label(w, rank, origins.get(w))}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": w, "tid": ACTION_TID,
                    "args": {"sort_index": w}})
        out.append({"name": "thread_name", "ph": "M", "pid": w, "tid": ACTION_TID,
                    "args": {"name": "actions"}})
    for e, t in sorted(aligned, key=lambda x: (x[0].worker, x[1], -x[0].duration_ns)):
        out.append({"name": e.name, "cat": e.kind, "ph": "X", "pid": e.worker, "tid": ACTION_TID,
                    "ts": (t - t0) / 1e3, "dur": e.duration_ns / 1e3,
                    "args": {"step": e.step, "kind": e.kind}})
    return out


def write_trace_json(path: str | Path, events: Sequence[Event], *, ranks: Mapping[int, int] | None = None,
                     origins: Mapping[int, WorkerOrigin] | None = None,
                     metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``timeline.json`` ([Note: timeline.json]) atomically; returns the path.

    Args:
        path: destination, conventionally beside ``profile.sqlite``.
        events: the run's timeline events.
        ranks: ``{worker: rank}`` (default rank = worker).
        origins: ``{worker: WorkerOrigin}``: hosts, pids and clock offsets.
        metadata: JSON-serializable run facts for ``otherData`` (method, stages, …).
    """
    path = Path(path)
    doc = {"traceEvents": trace_events(events, ranks=ranks, origins=origins), "displayTimeUnit": "ms",
           "otherData": {"producer": "pipefisher", **{k: v for k, v in (metadata or {}).items()}}}
    return write_text_atomic(path, json.dumps(doc, separators=(",", ":")))
