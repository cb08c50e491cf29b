"""``planning.bubbles.Window.fit`` against a brute-force search, through random adds and removes.

The window remembers what earlier searches found (the least cost with no room, the earliest room per cost, the
longest item) so that the planner does not rescan a window it fills from the front; those answers must stay
exactly the brute force's, including after items are removed (the memory is dropped) and for zero-length items
(an all-reduce's arrival, which work may touch but not contain).
"""

from __future__ import annotations

import random

import pytest

from pipefisher.planning.bubbles import Window
from pipefisher.schedules import Action, ActionKind


def _brute_fit(win: Window, ready: int, cost: int) -> int | None:
    """The earliest t >= max(ready, start) with [t, t + cost) inside the window, overlapping no item and holding
    no zero-length item strictly inside; for cost 0, t not strictly inside an item."""
    lo = max(ready, win.start)
    candidates = sorted({lo, *(x.end for x in win.items if x.end >= lo)})
    for t in candidates:
        if t + cost > win.end:
            return None
        ok = True
        for x in win.items:
            if x.end > x.start:
                hit = (x.start < t + cost and x.end > t) if cost else x.start < t < x.end
            else:
                hit = t < x.start < t + cost
            if hit:
                ok = False
                break
        if ok:
            return t
    return None


@pytest.mark.parametrize("seed", range(6))
def test_fit_equals_a_brute_force_search_through_adds_and_removes(seed: int) -> None:
    rng = random.Random(seed)
    win = Window(point=0, start=100, end=100 + rng.choice([300, 1000, 5000]))
    action = Action(ActionKind.CURV_A, 0, 0, 0, layer=0)
    items, asked = [], 0
    for step in range(600):
        r = rng.random()
        if r < 0.1 and items:  # remove one: what the window learnt no longer holds
            win.remove(items.pop(rng.randrange(len(items))))
            continue
        if r < 0.2:  # an arrival (zero-length) where there is room for one
            t = rng.randrange(win.start, win.end)
            if win.fit(t, 0) == t == _brute_fit(win, t, 0):
                items.append(win.add(t, 0, step, action))
            continue
        cost = rng.choice([0, 1, 5, 10, 10, 10, 25, 40, 40, 120])
        ready = 0 if rng.random() < 0.7 else rng.randrange(0, win.end + 10)
        got, want = win.fit(ready, cost), _brute_fit(win, ready, cost)
        asked += 1
        assert got == want, (step, ready, cost, got, want, [(x.start, x.end) for x in win.items])
        if got is not None and cost > 0 and rng.random() < 0.8:
            items.append(win.add(got, cost, step, action))
    assert asked > 300 and items  # the run asked often and kept a crowded window


def test_force_goes_after_every_item_also_after_a_removal() -> None:
    win = Window(point=0, start=0, end=50)
    action = Action(ActionKind.CURV_A, 0, 0, 0, layer=0)
    a = win.add(0, 30, 0, action)
    win.add(30, 10, 1, action)
    assert win.force(0, 5) == 40 and win.force(45, 5) == 45
    last = win.add(win.force(0, 20), 20, 2, action)  # past the end: exposed work
    assert win.force(0, 1) == 60 and win.exposed_ns == 10
    win.remove(last)
    win.remove(a)
    assert win.force(0, 1) == 40 and win.fit(0, 30) == 0 and win.fit(0, 31) is None
