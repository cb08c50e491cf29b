"""Busy fractions measured on each host's own clock.

``timeline.worker_utilization`` divides every worker's busy time by one wall span over all
events. Event times are per-host clocks ([Note: clocks per host] in
``pipefisher.profiling.origin``), so across nodes that span mixes unrelated clocks. Here each
worker's busy time is divided by the span of its own host's events: first start to last end of
that host's workers, measured on that host's clock (issue 15).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipefisher.timeline import COMPUTE_KINDS, Event, busy_ns

__all__ = ["host_spans_ns", "utilization_per_host"]


def host_spans_ns(events: Sequence[Event], hosts: Mapping[int, str] | None = None) -> dict[str, int]:
    """``{host: wall ns}`` of each host's events (one host ``""`` when ``hosts`` is None or a
    worker is not in it)."""
    bounds: dict[str, tuple[int, int]] = {}
    for e in events:
        h = (hosts or {}).get(e.worker, "")
        lo, hi = bounds.get(h, (e.start_ns, e.end_ns))
        bounds[h] = (min(lo, e.start_ns), max(hi, e.end_ns))
    return {h: hi - lo for h, (lo, hi) in bounds.items()}


def utilization_per_host(events: Sequence[Event], num_workers: int | None = None,
                         hosts: Mapping[int, str] | None = None,
                         kinds: frozenset[str] = COMPUTE_KINDS) -> dict[int, float]:
    """Busy fraction of each worker over the wall span of its host's events.

    Args:
        events: the events of all workers.
        num_workers: workers to report (default: those seen); a worker without events is 0.
        hosts: ``{worker: host}``; None (or one host) gives ``timeline.worker_utilization``.
        kinds: the action kinds that count as busy.
    """
    if not events:
        return {}
    walls = host_spans_ns(events, hosts)
    busy = busy_ns(events, kinds)
    workers = range(num_workers) if num_workers is not None else sorted(busy)
    out = {}
    for w in workers:
        wall = walls.get((hosts or {}).get(w, ""), 0)
        out[w] = busy.get(w, 0) / wall if wall > 0 else 0.0
    return out
