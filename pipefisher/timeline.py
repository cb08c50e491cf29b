"""Timeline events: what a worker did and when, recorded by the executor or predicted by the simulator.

The executor (``pipefisher.runtime``) and the simulator (``pipefisher.simulate``) both produce a
``list[Event]``; profiling, plotting and bubble-utilization code consume it without knowing which.
Times are integer nanoseconds from an arbitrary per-run origin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Event", "COMPUTE_KINDS", "SYNC_KINDS", "is_wait", "union_length", "busy_ns", "bubble_utilization",
           "worker_utilization"]

# Action kinds whose time counts as useful work when measuring bubble utilization (DESIGN.md,
# "Bubble utilization"); communication waits and idle time do not.
COMPUTE_KINDS: frozenset[str] = frozenset(
    {"F", "B", "I", "W", "STEP", "CURV_A", "CURV_B", "INVERT", "PRECOND"}
)
# The all-reduces: a wait for one is recorded with its kind (see Event), never busy.
SYNC_KINDS: frozenset[str] = frozenset({"SYNC_GRAD", "SYNC_FACTOR"})


@dataclass(frozen=True)
class Event:
    """One span of work on one worker.

    A *wait* inside an action, for a collective it consumes (PRECOND for its stage's gradient
    all-reduce, INVERT for its factor all-reduce, STEP for all of them), is an event of its own
    just before the action's: it carries the action's name and the kind of the collective
    (``name="1PRECOND@1", kind="SYNC_GRAD"``), so it is never busy and never costs the action;
    see :func:`is_wait`.

    Attributes:
        worker: global worker index (rank).
        name: the action's string form, e.g. ``"1F3"``.
        kind: the action kind, e.g. ``"F"``, ``"B"``, ``"SEND_F"``, ``"SYNC_GRAD"`` (for a wait:
            the collective's kind).
        start_ns: start time in ns.
        end_ns: end time in ns (``>= start_ns``).
        step: the training step this span belongs to.
    """

    worker: int
    name: str
    kind: str
    start_ns: int
    end_ns: int
    step: int = 0

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def is_wait(event: Event) -> bool:
    """Whether ``event`` is an action's wait for a collective: its kind is a collective's
    (:data:`SYNC_KINDS`) but its name is another action's (names start with the optional stage
    digits, then the kind)."""
    return event.kind in SYNC_KINDS and not event.name.lstrip("0123456789").startswith(event.kind)


def union_length(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length covered by ``intervals`` (overlapping or nested parts count once)."""
    total = 0
    cur_start: int | None = None
    cur_end = 0
    for start, end in sorted(intervals):
        if cur_start is None or start > cur_end:
            if cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_start is not None:
        total += cur_end - cur_start
    return total


def busy_ns(events: Iterable[Event], kinds: frozenset[str] = COMPUTE_KINDS) -> dict[int, int]:
    """Per-worker busy time: the length of the union of its compute intervals (overlaps count once)."""
    per_worker: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        per_worker.setdefault(e.worker, [])
        if e.kind in kinds:
            per_worker[e.worker].append((e.start_ns, e.end_ns))
    return {w: union_length(iv) for w, iv in per_worker.items()}


def worker_utilization(
    events: Sequence[Event], num_workers: int | None = None, kinds: frozenset[str] = COMPUTE_KINDS
) -> dict[int, float]:
    """Busy fraction of each worker over the wall time spanned by all events."""
    if not events:
        return {}
    wall = max(e.end_ns for e in events) - min(e.start_ns for e in events)
    busy = busy_ns(events, kinds)
    workers = range(num_workers) if num_workers is not None else sorted(busy)
    return {w: (busy.get(w, 0) / wall if wall > 0 else 0.0) for w in workers}


def bubble_utilization(
    events: Sequence[Event], num_workers: int | None = None, kinds: frozenset[str] = COMPUTE_KINDS
) -> float:
    """Σ_workers busy / (workers × wall) for the span of ``events`` (one step, or several).

    Args:
        events: the events of all workers for the span to measure.
        num_workers: number of workers (defaults to those seen in ``events``).
        kinds: the action kinds that count as busy.

    Returns:
        A fraction in [0, 1]; 1 means no bubbles at all.
    """
    util = worker_utilization(events, num_workers, kinds)
    return sum(util.values()) / len(util) if util else 0.0
