"""Bubbles of a simulated step, and step time / utilization of simulated steps.

[Note: bubbles as insertion windows]
A bubble is idle time of a worker in the simulated timeline, tied to a place in its action list:
before action i the worker is free from the end of action i−1 (``free``) until action i can do
its work (``ready``: the start of a compute, STEP or PRECOND, the arrival of a RECV's data).
Work of total length ≤ ``ready − free`` inserted at that place leaves every later action's time
unchanged (each action starts at max(worker free, inputs ready), and neither moves), so the
pipeline does not slow down. Sends and all-reduce arrivals take no worker time and never wait, so
they open no window; work is inserted after them, so messages and all-reduces are not delayed.

The last window of a worker, the *tail* (before STEP), also holds the worker's *slack*: the time
its step ends before the slowest worker's, by which its STEP can slip without lengthening the
step (a PRECOND waiting for its gradient all-reduce opens a window of its own before it)::

    W0  F0 F1 .. B0 .. B1 SYNC_GRAD [wait for all-reduce] PRECOND | STEP     slowest: no slack
    W1  .. F0 F1 B0 .. B1 SYNC_GRAD [wait for all-reduce] PRECOND |[slack ......] STEP
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipefisher.schedules import Action, ActionKind, Schedule
from pipefisher.simulate import CostModel, action_times
from pipefisher.timeline import COMPUTE_KINDS, Event, union_length

__all__ = ["Bubble", "TimelineSummary", "Window", "WindowItem", "find_bubbles", "find_windows", "summarize_timeline"]

K = ActionKind


@dataclass(frozen=True)
class Bubble:
    """Idle time of one worker in one simulated step.

    Attributes:
        worker: the worker.
        point: index of the action the bubble precedes (work goes before it).
        start_ns: the worker becomes free.
        end_ns: the next action needs the worker (for the last window: plus the worker's slack).
        tail: the worker's last window (before STEP).
    """

    worker: int
    point: int
    start_ns: int
    end_ns: int
    tail: bool = False

    @property
    def length_ns(self) -> int:
        return self.end_ns - self.start_ns


@dataclass(slots=True)
class WindowItem:
    """An action placed in a window over [start, end) ns; ``seq`` breaks ties in list order."""

    start: int
    end: int
    seq: int
    action: Action


def _order(item: WindowItem) -> tuple[int, int, int]:
    return item.start, item.end, item.seq


def _start(item: WindowItem) -> int:
    return item.start


@dataclass
class Window:
    """A bubble being filled by the planner: items are kept in time order.

    ``fit`` finds room at or after a ready time without passing ``end``; ``force`` puts work
    after everything already there, past ``end`` if need be (exposed work).
    """

    point: int
    start: int
    end: int
    tail: bool = False
    items: list[WindowItem] = field(default_factory=list)
    busy_ns: int = 0  # summed length of the items
    # The least cost known to find no room from the window's start: adding items only takes room away, so it
    # holds until an item is removed (then None). Work of that cost or more is refused without a scan, the
    # planner's commonest question (``planning.assign`` asks every window after a unit's F/B in turn).
    no_room_ns: int | None = field(default=None, repr=False, compare=False)
    # Per cost c > 0, the earliest start of room for c found from the window's start: no span of c or more fits
    # before it, also once items are added (until one is removed: then cleared). A search for c or more starts
    # there, so filling a window from its front does not walk its whole front each time (same answers).
    earliest_ns: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    # The longest item ever added (not lowered on removal: an upper bound): an item starting more than this before
    # an instant has ended by then, so a search from that instant skips it by bisection.
    longest_ns: int = field(default=0, repr=False, compare=False)
    # The latest end of the items (None: not known since a removal), for :meth:`force`.
    last_end_ns: int | None = field(default=None, repr=False, compare=False)

    def fit(self, ready: int, cost: int) -> int | None:
        """Earliest start >= ready (and >= start) of a free span of ``cost`` ns, or None.

        Work never overlaps an item, and a span of work never contains a zero-length item (an
        all-reduce's arrival) strictly inside it.
        """
        start, end = self.start, self.end
        t = ready if ready > start else start
        if t + cost > end or cost > end - start - self.busy_ns:
            return None
        no_room = self.no_room_ns
        if no_room is not None and cost >= no_room:  # no room from the start: none from any later instant
            return None
        earliest = start
        if cost > 0:
            for c, at in self.earliest_ns.items():
                if c <= cost and at > earliest:
                    earliest = at
        if ready > earliest:
            return self._scan(ready, cost)
        found = self._scan(earliest, cost)  # the earliest room of the whole window
        if found is None:
            if no_room is None or cost < no_room:
                self.no_room_ns = cost
        elif cost > 0:
            self.earliest_ns[cost] = found
        return found

    def _scan(self, t: int, cost: int) -> int | None:
        """:meth:`fit`'s search from instant ``t``."""
        end = self.end
        items = self.items
        n, longest = len(items), self.longest_ns
        moved = n > 0
        while moved:  # the hot loop of the planner: locals only (same rule as written out in the docstring)
            moved = False
            first = bisect.bisect_left(items, t - longest, key=_start)  # the items before it ended before t
            for k in range(first, n):  # by start: the first that starts past the span ends the pass
                item = items[k]
                stop = t + cost
                if stop > end:
                    return None
                s = item.start
                if s >= stop:
                    break
                e = item.end
                if e > s:
                    overlap = (s < stop and e > t) if cost else s < t < e
                else:
                    overlap = t < s < stop
                if overlap:
                    t, moved = e, True
        return t if t + cost <= end else None

    def force(self, ready: int, cost: int) -> int:
        """Start of ``cost`` ns of work after every item here (and after ``ready``)."""
        if self.last_end_ns is None:
            self.last_end_ns = max((item.end for item in self.items), default=self.start)
        return max(ready, self.start, self.last_end_ns)

    def add(self, start: int, cost: int, seq: int, action: Action) -> WindowItem:
        item = WindowItem(start, start + cost, seq, action)
        bisect.insort(self.items, item, key=_order)
        self.busy_ns += cost
        self.longest_ns = max(self.longest_ns, cost)
        if self.last_end_ns is not None:
            self.last_end_ns = max(self.last_end_ns, item.end)
        return item

    def remove(self, item: WindowItem) -> None:
        """Remove ``item`` itself (not an equal one)."""
        i = bisect.bisect_left(self.items, _order(item), key=_order)  # its equals (if any) stand from here
        while self.items[i] is not item:
            i += 1
        del self.items[i]
        self.busy_ns -= item.end - item.start
        self.no_room_ns = None
        self.earliest_ns.clear()
        self.last_end_ns = None

    def busy_until(self, t: int) -> int:
        """The first instant >= t at which no item of this window is running."""
        moved = True
        while moved:
            moved = False
            for item in self.items:
                if item.start < t < item.end:
                    t, moved = item.end, True
        return t

    @property
    def actions(self) -> list[Action]:
        return [item.action for item in self.items]

    @property
    def exposed_ns(self) -> int:
        """How far the items run past ``end``."""
        return max([0] + [item.end - self.end for item in self.items])


def find_windows(schedule: Schedule, cost: CostModel) -> tuple[dict[int, list[Window]], dict[int, list[tuple[int, int, int]]], int]:
    """The insertion windows of one simulated step ([Note: bubbles as insertion windows]).

    Args:
        schedule: a complete schedule (PRECONDs included when the run preconditions).
        cost: its cost model.

    Returns:
        ``(windows, times, step_end)``: per worker its windows in list order (every worker has a
        tail window, possibly empty); per worker ``(free, ready, end)`` of each action; the end of
        the slowest worker's STEP.
    """
    times = action_times(schedule, cost)
    step_end = max(t[-1].end_ns for t in times.values())
    windows: dict[int, list[Window]] = {}
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for w, acts in schedule.actions.items():
        ts = times[w]
        tail = next(i for i, a in enumerate(acts) if a.kind == K.STEP)
        slack = step_end - ts[-1].end_ns
        spans[w] = []
        out = []
        for i, a in enumerate(acts):
            free = ts[i - 1].end_ns if i else 0
            ready = ts[i].end_ns if a.kind in (K.RECV_F, K.RECV_B) else ts[i].start_ns
            spans[w].append((free, ready, ts[i].end_ns))
            if i == tail:
                out.append(Window(i, free, ready + slack, tail=True))
            elif ready > free:
                out.append(Window(i, free, ready))
        windows[w] = out
    return windows, spans, step_end


def find_bubbles(schedule: Schedule, cost: CostModel) -> list[Bubble]:
    """The bubbles of one simulated step of ``schedule``, by worker and time."""
    windows, _, _ = find_windows(schedule, cost)
    return [Bubble(w, win.point, win.start, win.end, win.tail)
            for w in sorted(windows) for win in windows[w] if win.end > win.start]


@dataclass(frozen=True)
class TimelineSummary:
    """Step time and utilization of simulated steps.

    Attributes:
        step_time_ns: mean time per step (last STEP end − first start, over the steps).
        utilization: Σ busy / (workers × that span), busy being the union of compute intervals
            (``timeline.COMPUTE_KINDS``: F, B, K-FAC work, STEP) clipped to the span.
        num_steps: steps summarized.
    """

    step_time_ns: float
    utilization: float
    num_steps: int


def summarize_timeline(events: Sequence[Event], num_workers: int, num_steps: int) -> TimelineSummary:
    """Step time and bubble utilization of ``num_steps`` consecutive simulated steps.

    The span ends with the last STEP: a factor all-reduce still running after it belongs to the
    next step's time (it overlaps that step's work).
    """
    start = min(e.start_ns for e in events)
    steps = [e.end_ns for e in events if e.kind == K.STEP.value]
    end = max(steps) if steps else max(e.end_ns for e in events)
    span = max(end - start, 1)
    per_worker: dict[int, list[tuple[int, int]]] = {}
    for e in events:
        if e.kind in COMPUTE_KINDS and e.start_ns < end:
            per_worker.setdefault(e.worker, []).append((max(e.start_ns, start), min(e.end_ns, end)))
    busy = sum(union_length(intervals) for intervals in per_worker.values())
    return TimelineSummary(step_time_ns=(end - start) / num_steps, utilization=busy / (num_workers * span),
                           num_steps=num_steps)
