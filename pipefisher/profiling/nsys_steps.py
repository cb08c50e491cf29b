"""Steps of the action ranges of Nsight Systems exports, and which of them the capture holds whole.

[Note: steps of an nsys export]
Workers come from [Note: ranks of an nsys export] (``nsys_ranks``). An action's step is the
number of ``STEP`` ranges its worker ended before the action started (0 when none was recorded;
ties at one instant are broken by record order). A range named like an action that encloses
another action range of its thread (a user's ``STEP`` around a whole iteration) is not an action:
it is dropped from the events, and its ends count steps only where the worker recorded no
optimizer ``STEP`` range (issue 15, item 8). A ``STEP`` that began before the capture counts
too: it closes a step the capture holds only in part, which is dropped as such, so steps are
numbered and dropped steps counted as the run ran them (issue 38: a capture read on the wrong clock
had 119 steps' ranges "begin before the capture", merged into one step, and said it dropped 2).

[Note: partial steps]
A capture that starts or stops inside a step holds part of it; averaging its actions in, or
counting it as a full step, gives wrong costs (issue 25). Dropped, with one log line:

- every step from the first one with an action range that never ended (``end`` NULL, or the
  capture's end: [Note: the capture window] in ``nsys_capture``);
- every step from the first one that some worker never closed with a ``STEP`` (the capture
  stopped between its actions), when the workers record ``STEP`` ranges;
- a step with an action range (or ``STEP`` bracket) that began before the capture;
- the first or last step kept when one of its workers holds fewer forwards and backwards
  (F, B, I, W) in it than in its fullest step (the capture began or ended between actions).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ActionRange", "PartialSteps", "delimiters", "enclosing", "partial_steps", "steps_of"]

Key = tuple[int, int]  # (file index, NVTX_EVENTS rowid)
_COMPUTE = frozenset({"F", "B", "I", "W"})


@dataclass(frozen=True)
class ActionRange:
    """One NVTX range that names an action (``end`` None: it never ended)."""

    key: Key
    name: str
    kind: str
    start: int
    end: int | None
    global_tid: int
    prefix_worker: int | None
    early: bool = False  # began before the capture started


def enclosing(ranges: Sequence[ActionRange]) -> set[Key]:
    """Keys of finished ranges that enclose another action range of their thread (not actions themselves)."""
    out = set()
    by_thread: dict[tuple[int, int], list[ActionRange]] = defaultdict(list)
    for r in ranges:
        if r.end is not None:
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


def delimiters(ranges: Sequence[ActionRange], enclosing_keys: set[Key], worker_of: Mapping[Key, int]) -> list[ActionRange]:
    """Per worker: its finished optimizer STEP ranges, or its enclosing STEP ranges if it has none
    (those that began before the capture too: [Note: steps of an nsys export])."""
    chosen: dict[int, list[ActionRange]] = defaultdict(list)
    brackets: dict[int, list[ActionRange]] = defaultdict(list)
    for r in ranges:
        if r.kind == "STEP" and not r.name[:1].isdigit() and r.end is not None:  # not a stage STEP ("1STEP@1")
            (brackets if r.key in enclosing_keys else chosen)[worker_of[r.key]].append(r)
    return [r for w in set(chosen) | set(brackets) for r in (chosen.get(w) or brackets[w])]


def steps_of(ranges: Sequence[ActionRange], worker_of: Mapping[Key, int],
             delimiter_ranges: Sequence[ActionRange]) -> dict[Key, int]:
    """``{key: step}``: the worker's step delimiters that ended before the range started.

    A delimiter counts for a range only if it also comes first in (start, end, key) order, so that
    a zero-length range recorded just before a zero-length STEP at the same instant stays in its step.
    """
    def order(r: ActionRange) -> tuple[int, int, Key]:
        return (r.start, r.end if r.end is not None else r.start, r.key)

    steps: dict[int, list[ActionRange]] = defaultdict(list)
    for r in delimiter_ranges:
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


@dataclass(frozen=True)
class PartialSteps:
    """Steps a capture holds only in part ([Note: partial steps])."""

    dropped: dict[int, str]  # step -> why
    unfinished: int  # action ranges that never ended
    num_steps: int  # steps the capture touches

    def describe(self) -> str:
        """One line: how many steps were dropped and why."""
        by_reason: dict[str, list[int]] = defaultdict(list)
        for step, why in sorted(self.dropped.items()):
            by_reason[why].append(step)
        parts = [f"step{'s' if len(s) > 1 else ''} {_span(s)} ({why})" for why, s in by_reason.items()]
        return (f"dropped {len(self.dropped)} partial step(s) of the {self.num_steps} the capture touches: "
                + "; ".join(parts))


def _span(steps: Sequence[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}" \
        if steps == list(range(steps[0], steps[-1] + 1)) else ", ".join(map(str, steps))


def partial_steps(ranges: Sequence[ActionRange], step_of: Mapping[Key, int], worker_of: Mapping[Key, int],
                  delimiter_ranges: Sequence[ActionRange], enclosing_keys: set[Key]) -> PartialSteps:
    """Steps to drop by [Note: partial steps].

    Args:
        ranges: every action range (unfinished ones with ``end`` None).
        step_of: each range's step (:func:`steps_of`).
        worker_of: each range's worker.
        delimiter_ranges: the STEP ranges that count steps (:func:`delimiters`).
        enclosing_keys: ranges that are step brackets, not actions.
    """
    actions = [r for r in ranges if r.key not in enclosing_keys]
    early = {step_of[r.key] for r in ranges if r.early}  # brackets too: the actions they hold are partial
    all_steps = sorted({step_of[r.key] for r in actions} | early)
    dropped: dict[int, str] = {}
    unfinished = [step_of[r.key] for r in ranges if r.end is None]
    stop = min(unfinished) if unfinished else None
    closed = Counter(worker_of[r.key] for r in delimiter_ranges)
    if closed:
        unclosed = min(closed.values())  # a worker's actions after its last STEP are a step it never closed
        stop = unclosed if stop is None else min(stop, unclosed)
    for step in all_steps:
        if stop is not None and step >= stop:
            dropped[step] = (f"the capture stopped inside it: {len(unfinished)} action range(s) never ended"
                             if unfinished and step >= min(unfinished) else "the capture stopped before its STEP")
    for step in sorted(early - set(dropped)):
        dropped[step] = "the capture started inside it: a range began before the capture"
    kept = [s for s in all_steps if s not in dropped]
    if len(kept) > 1:
        counts: dict[int, Counter[int]] = defaultdict(Counter)  # worker -> step -> compute actions
        for r in actions:
            if r.kind in _COMPUTE and r.end is not None:
                counts[worker_of[r.key]][step_of[r.key]] += 1
        for step, where in ((kept[0], "started"), (kept[-1], "stopped")):
            if any(c[step] < max(c[s] for s in kept) for c in counts.values()):
                dropped.setdefault(step, f"the capture {where} between its actions: fewer forwards and backwards "
                                         f"than a full step")
    return PartialSteps(dropped, len(unfinished), len(all_steps))
