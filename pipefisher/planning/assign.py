"""PipeFisher: K-FAC work placed into the bubbles of the simulated pipeline by a list scheduler.

Entry point: :func:`plan_pipefisher` (``schedule.py`` calls it; the result is an
:class:`~pipefisher.schedules.kfac.Assignment` with ``deferred=True``).

[Note: the list scheduler]
The pipeline with one PRECOND per stage replica before STEP is simulated once; its bubbles become
insertion windows ([Note: bubbles as insertion windows] in ``planning.bubbles``), the same in
every phase of a k-step cycle. For phase p = 0, 1, …, k−1:

1. curvature, layer by layer, round robin over the stages: all CURV_A/CURV_B units of a layer,
   on every replica of its stage, go into the earliest window after their F (A) or B (B) on the
   same worker (Chimera's up-pipe replica after the up-pipe's computes) that has room; if one
   does not fit, the layer waits for a later phase (a layer's curvature stays in one step).
   A unit that no window after its F/B but the worker's last one (before STEP) could ever hold
   (the curvature of the last backwards of the worker that finishes last) goes to that tail
   window: such *tail* work lengthens the step once it overflows the tail, whatever k is, and is
   not counted as spill;
2. one SYNC_FACTOR per refreshed layer, at the same instant T on every replica (T = when the
   last replica finished the layer's curvature): each member at the place in its list where it
   is at time T (after the action it is busy with). Syncs go in order of T, so members issue
   shared all-reduces in one order. A sync that still deadlocks under blocking semantics
   (``checks.stuck_positions``) moves to the tail of the phase, where every worker has done all
   its messages;
3. INVERT of a layer in the earliest window after its SYNC_FACTOR ended, in this phase or a
   later one (inverses from earlier phases first).

What does not fit by the last phase is spilled to just before STEP of the last phase (units that
fit a bubble still go there). k is the smallest interval with no spill; when every interval up to
``max_interval`` spills (some layer's curvature never fits one step's bubbles), the smallest one
with the least spilled work per refresh. The work does not slow the
pipeline: every inserted unit ends before the action after its window needs the worker, so the
simulated times of the pipeline's own actions do not change (except for tail and spilled work).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipefisher.planning.bubbles import Window, WindowItem, find_windows
from pipefisher.schedules import Action, ActionKind, Schedule
from pipefisher.schedules.checks import stuck_positions
from pipefisher.schedules.kfac import Assignment, check_assignment, require_plain_schedule, with_preconditioning
from pipefisher.simulate import CostModel

__all__ = ["PlanStats", "plan_pipefisher", "plan_interval"]

log = logging.getLogger(__name__)
K = ActionKind


@dataclass(frozen=True)
class PlanStats:
    """What a plan could not hide.

    Attributes:
        interval: k.
        spilled_ns: work (summed over workers) placed before STEP of the last phase for want of
            room in the bubbles; 0 means the bubbles hold the refresh.
        tail_ns: work that follows the last backward of a worker with no bubble after it; it runs
            before STEP whatever k is.
        mid_step_syncs: SYNC_FACTORs placed inside a step (the others are at a phase's tail).
    """

    interval: int
    spilled_ns: int
    tail_ns: int
    mid_step_syncs: int


@dataclass
class _Sync:
    phase: int
    time: int  # T, the cut instant
    end: int  # planned end of the all-reduce
    items: dict[int, tuple[Window, WindowItem]] = field(default_factory=dict)


class _Planner:
    def __init__(self, schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], interval: int) -> None:
        self.base = with_preconditioning(schedule)
        self.cost = cost
        self.layers = list(kfac_layers)
        self.k = interval
        geometry, self.spans, self.step_end = find_windows(self.base, cost)
        self.windows = [{w: [Window(x.point, x.start, x.end, x.tail) for x in wins]
                         for w, wins in geometry.items()} for _ in range(interval)]
        self.tail_point = {w: next(x.point for x in wins if x.tail) for w, wins in geometry.items()}
        # For "could a window after action j other than the tail ever hold c ns?": the non-tail
        # windows by point, and suffix maxima of their lengths.
        self.points = {w: [x.point for x in wins if not x.tail] for w, wins in geometry.items()}
        self.suffix_max = {}
        for w, wins in geometry.items():
            best, out = 0, []
            for x in reversed([x for x in wins if not x.tail]):
                best = max(best, x.end - x.start)
                out.append(best)
            self.suffix_max[w] = out[::-1]
        self.index = {w: {a: i for i, a in enumerate(acts) if a.kind.is_compute}
                      for w, acts in self.base.actions.items()}
        self.replicas: dict[int, list[tuple[int, int]]] = defaultdict(list)  # stage -> (worker, pipe)
        for (_, pipe, stage), w in sorted(self.base.placement.workers.items(), key=lambda kv: kv[1]):
            self.replicas[stage].append((w, pipe))
        self.mbs = {p: [j for j, q in enumerate(schedule.pipe_of_micro_batch) if q == p]
                    for p in set(schedule.pipe_of_micro_batch)}
        self.seq = itertools.count()
        self.spilled_ns = 0
        self.tail_ns = 0
        self.syncs: dict[tuple[int, int], _Sync] = {}
        self.pending: list[tuple[int, int]] = []  # (stage, layer) whose inverts are not placed
        self.inverts_left: dict[tuple[int, int], set[int]] = {}  # workers still to invert

    # -- windows --------------------------------------------------------------------------------

    def _tail(self, p: int, w: int) -> Window:
        return next(x for x in self.windows[p][w] if x.tail)

    def _window_at(self, p: int, w: int, point: int) -> Window:
        wins = self.windows[p][w]
        for x in wins:
            if x.point == point:
                return x
        free = self.spans[w][point][0]
        new = Window(point, free, free)
        bisect.insort(wins, new, key=lambda x: x.point)
        return new

    def _inherent(self, w: int, dep: int, cost: int) -> bool:
        i = bisect.bisect_right(self.points[w], dep)
        return i >= len(self.points[w]) or self.suffix_max[w][i] < cost

    def _add(self, win: Window, start: int, cost: int, action: Action) -> WindowItem:
        return win.add(start, cost, next(self.seq), action)

    # -- curvature ------------------------------------------------------------------------------

    def _try_curvature(self, p: int, stage: int, layer: int, force: bool = False) -> dict[int, int] | None:
        """Place every curvature unit of (stage, layer) in phase p; per worker the last end, or None."""
        placed: list[tuple[Window, WindowItem]] = []
        ends: dict[int, int] = {}
        tail_ns = spilled = 0
        for w, pipe in self.replicas[stage]:
            units = []
            for j in self.mbs[pipe]:
                for kind, dep in ((K.CURV_A, K.FORWARD), (K.CURV_B, K.BACKWARD)):
                    units.append((self.index[w][Action(dep, stage, j, pipe)], Action(kind, stage, j, pipe, layer=layer)))
            units.sort(key=lambda u: u[0])
            for dep, act in units:
                c = self.cost.kfac_ns(act.kind, stage, layer)
                win = t = None
                if self._inherent(w, dep, c):
                    win = self._tail(p, w)
                    t = win.force(0, c)
                    tail_ns += c
                else:
                    for x in self.windows[p][w]:
                        if x.point > dep and (t := x.fit(0, c)) is not None:
                            win = x
                            break
                if win is None and force:
                    win = self._tail(p, w)
                    t = win.force(0, c)
                    spilled += c
                if win is None:
                    for x, item in placed:
                        x.remove(item)
                    return None
                item = self._add(win, t, c, act)
                placed.append((win, item))
                ends[w] = max(ends.get(w, 0), item.end)
        self.tail_ns += tail_ns
        self.spilled_ns += spilled
        return ends

    # -- syncs ----------------------------------------------------------------------------------

    def _place_sync(self, p: int, stage: int, layer: int, time: int, after: dict[int, int],
                    at_tail: bool = False) -> None:
        sync = _Sync(p, time, 0)
        arrivals = []
        for w, pipe in self.replicas[stage]:
            act = Action(K.SYNC_FACTOR, stage, None, pipe, layer=layer)
            if at_tail:
                win = self._tail(p, w)
                t = win.force(time, 0)
            else:
                spans = self.spans[w]
                point = next((i for i, (_, ready, _) in enumerate(spans) if ready >= time), self.tail_point[w])
                point = min(max(point, after.get(w, 0)), self.tail_point[w])
                win = self._window_at(p, w, point)
                t = win.busy_until(max(time, win.start))
            sync.items[w] = (win, self._add(win, t, 0, act))
            arrivals.append(t)
        sync.end = max(arrivals) + self.cost.kfac_ns(K.SYNC_FACTOR, stage, layer)
        self.syncs[(stage, layer)] = sync

    def _curvature_points(self, p: int, stage: int, layer: int) -> dict[int, int]:
        """Per worker, the window point of its last curvature unit of (stage, layer) in phase p."""
        out = {}
        for w, _ in self.replicas[stage]:
            for x in self.windows[p][w]:
                if any(i.action.layer == layer and i.action.stage == stage and i.action.kind in (K.CURV_A, K.CURV_B)
                       for i in x.items):
                    out[w] = x.point
        return out

    def _build(self, p: int) -> Schedule:
        actions = {}
        for w, acts in self.base.actions.items():
            by_point = {x.point: x.actions for x in self.windows[p][w]}
            out: list[Action] = []
            for i, a in enumerate(acts):
                out.extend(by_point.get(i, ()))
                out.append(a)
            actions[w] = tuple(out)
        return replace(self.base, actions=actions)

    def _repair(self, p: int) -> None:
        """Move SYNC_FACTORs that deadlock under blocking semantics to the phase's tail."""
        for _ in range(sum(1 for s in self.syncs.values() if s.phase == p) + 1):
            phase = self._build(p)
            stuck = stuck_positions(phase)
            if not stuck:
                return
            blocked = [phase.actions[w][i] for w, i in stuck.items()]
            keys = [(a.stage, a.layer) for a in blocked if a.kind == K.SYNC_FACTOR
                    and not all(item[0].tail for item in self.syncs[(a.stage, a.layer)].items.values())]
            if not keys:
                raise AssertionError(f"planned phase {p} deadlocks at {stuck} without a movable SYNC_FACTOR")
            key = min(keys, key=lambda k: self.syncs[k].time)
            old = self.syncs.pop(key)
            for win, item in old.items.values():
                win.remove(item)
            self._place_sync(p, *key, time=old.time, after={}, at_tail=True)
            log.debug("phase %d: SYNC_FACTOR of stage %d layer %d moved to the tail (deadlock)", p, *key)
        raise AssertionError(f"could not repair phase {p}")

    # -- inverts --------------------------------------------------------------------------------

    def _place_inverts(self, p: int, key: tuple[int, int], force: bool = False) -> None:
        stage, layer = key
        sync = self.syncs[key]
        left = self.inverts_left[key]
        for w, pipe in self.replicas[stage]:
            if w not in left:
                continue
            act = Action(K.INVERT, stage, None, pipe, layer=layer)
            c = self.cost.kfac_ns(K.INVERT, stage, layer)
            ready = sync.end if sync.phase == p else 0
            after = sync.items[w][0].point if sync.phase == p else -1
            win = t = None
            for x in self.windows[p][w]:
                if x.point >= after and (t := x.fit(ready, c)) is not None:
                    win = x
                    break
            if win is None and force:
                win = self._tail(p, w)
                t = win.force(ready, c)
                self.spilled_ns += c
            if win is not None:
                self._add(win, t, c, act)
                left.discard(w)

    # -- the phases -----------------------------------------------------------------------------

    def run(self) -> tuple[tuple[Schedule, ...], PlanStats]:
        todo = {s: list(range(n)) for s, n in enumerate(self.layers) if n}
        for p in range(self.k):
            committed: list[tuple[int, int, int, dict[int, int]]] = []  # (T, stage, layer, points)
            progress = True
            while progress:  # round robin: one layer per stage per round
                progress = False
                for stage in sorted(todo):
                    for layer in list(todo[stage]):
                        ends = self._try_curvature(p, stage, layer)
                        if ends is not None:
                            todo[stage].remove(layer)
                            committed.append((max(ends.values()), stage, layer,
                                              self._curvature_points(p, stage, layer)))
                            progress = True
                            break
            last = p == self.k - 1
            if last:  # spill: whole layers before STEP of the last phase
                for stage in sorted(todo):
                    for layer in todo[stage]:
                        ends = self._try_curvature(p, stage, layer, force=True)
                        committed.append((max(ends.values()), stage, layer, self._curvature_points(p, stage, layer)))
                todo = {}
            for time, stage, layer, points in sorted(committed):
                self._place_sync(p, stage, layer, time, points)
                self.inverts_left[(stage, layer)] = {w for w, _ in self.replicas[stage]}
            self._repair(p)
            for key in self.pending:
                self._place_inverts(p, key, force=last)
            new = sorted(((self.syncs[(s, l)].time, s, l) for _, s, l, _ in committed))
            for _, s, l in new:
                self._place_inverts(p, (s, l), force=last)
            self.pending = [key for key in self.pending + [(s, l) for _, s, l in new] if self.inverts_left[key]]
            todo = {s: ls for s, ls in todo.items() if ls}
        assert not self.pending and not todo
        phases = tuple(self._build(p) for p in range(self.k))
        mid = sum(1 for s in self.syncs.values() if not all(x[0].tail for x in s.items.values()))
        return phases, PlanStats(self.k, self.spilled_ns, self.tail_ns, mid)


def plan_interval(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], interval: int) -> tuple[Assignment, PlanStats]:
    """The PipeFisher plan for a given refresh interval ([Note: the list scheduler]).

    Returns:
        ``(assignment, stats)``; the assignment is checked.
    """
    require_plain_schedule(schedule, kfac_layers)
    if cost.num_stages != schedule.num_stages:
        raise ValueError(f"CostModel has {cost.num_stages} stages, the schedule {schedule.num_stages}")
    if cost.kfac_layers is not None and list(cost.kfac_layers) != list(kfac_layers):
        raise ValueError(f"kfac_layers={list(kfac_layers)} but the cost model has K-FAC costs for "
                         f"{list(cost.kfac_layers)} layers per stage; build both for the same model")
    phases, stats = _Planner(schedule, cost, kfac_layers, interval).run()
    a = Assignment(interval, phases, True, tuple(kfac_layers), metadata={
        "planner": "pipefisher", "spilled_ns": stats.spilled_ns, "tail_ns": stats.tail_ns,
        "mid_step_syncs": stats.mid_step_syncs})
    check_assignment(a)
    return a, stats


def plan_pipefisher(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], *,
                    max_interval: int = 8) -> Assignment:
    """Place K-FAC work into the bubbles; the smallest refresh interval whose bubbles hold it.

    See [Note: the list scheduler]. Curvature of micro-batch i runs after its F (A factor) or B
    (B factor) on the worker and pipe that ran it; factor all-reduces after all of a layer's
    curvature; inversion after the all-reduce; PRECOND before STEP in every phase. Inverses are
    deferred (used from the next cycle on).

    Args:
        schedule: a complete schedule without K-FAC units (``build_schedule``).
        cost: costs including the K-FAC units (``estimate_costs`` / ``costs_from_profile``).
        kfac_layers: K-FAC layers per stage (``kfac_layer_counts``).
        max_interval: the largest k to try. If no k up to it holds all the work, the k with the
            least spilled work (run before STEP of its last phase) per step is chosen.

    Returns:
        A checked assignment with ``deferred=True``; ``metadata`` holds ``spilled_ns``,
        ``tail_ns`` and ``mid_step_syncs``.
    """
    if not isinstance(max_interval, int) or max_interval < 1:
        raise ValueError(f"max_interval={max_interval!r}: try at least interval 1")
    best: tuple[float, Assignment] | None = None
    for k in range(1, max_interval + 1):
        a, stats = plan_interval(schedule, cost, kfac_layers, k)
        log.debug("interval %d: spilled %d ns, tail %d ns", k, stats.spilled_ns, stats.tail_ns)
        # Spilled work lengthens one step per refresh: compare it per step, so a pipeline without
        # bubbles to fill (e.g. Chimera with 2 stages) refreshes rarely instead of every step.
        per_step = stats.spilled_ns / k
        if best is None or per_step < best[0]:
            best = (per_step, a)
        if stats.spilled_ns == 0:
            break
    return best[1]
