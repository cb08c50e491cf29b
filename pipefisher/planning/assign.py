"""PipeFisher: K-FAC work placed into the bubbles of the simulated pipeline by a list scheduler.

Why one module: most of it is one list scheduler, :class:`_Planner`, whose passes (curvature, factor syncs,
inverses, preconditioning) place units into the same shared bubble windows; the rest is its entry point and
statistics.

Entry point: :func:`plan_pipefisher` (``schedule.py`` calls it; the result is an
:class:`~pipefisher.schedules.kfac.Assignment` with ``deferred=True``).

[Note: the list scheduler]
The pipeline with one PRECOND per stage replica before STEP is simulated once; its bubbles become
insertion windows ([Note: bubbles as insertion windows] in ``planning.bubbles``), the same in
every phase of a k-step cycle.

1. Curvature that fits, phase by phase (p = 0, 1, …, k−1), layer by layer, round robin over the
   stages: all CURV_A/CURV_B units of a layer, on every replica of its stage, go into the earliest
   window after their F (A) or B (B) on the same worker (Chimera's up-pipe replica after the
   up-pipe's computes) that has room; if one does not fit, the layer waits for a later phase (a
   layer's curvature stays in one step). A unit that no window after its F/B, the tail (the last
   one, before STEP) included, could hold even in an empty step (the curvature of the last
   backwards of the worker that finishes last) goes after everything in the tail: such *tail*
   work lengthens the step whatever k is and is not counted as spill. A layer whose curvature
   does not fit the windows of an otherwise empty step (*oversized*: with N ≫ D, N units after
   N forwards in 1F1B's steady state, whose bubbles are short) is left to 2.; its exposed units
   count as tail work too, as no k hides them.
2. What did not fit (spill) and the oversized layers, whole layers, largest first: units that fit
   a window go there, the others after everything in the tail; each layer into the phase whose
   step it lengthens least ([Note: exposed work goes where exposed work already is]).
3. Per phase, one SYNC_FACTOR per refreshed layer, at the same instant T on every replica (T =
   when the last replica finished the layer's curvature): each member at the place in its list
   where it is at time T (after the action it is busy with). Syncs go in order of T, so members
   issue shared all-reduces in one order. A sync that still deadlocks under blocking semantics
   (``checks.stuck_positions``) moves to the tail of the phase, where every worker has done all
   its messages. Then INVERT of a layer in the earliest window after its SYNC_FACTOR ended, in
   this phase or a later one (inverses from earlier phases first); what does not fit by the last
   phase runs before STEP of the last phase (spilled).

[Note: curvature beside W]
With ``curvature_placement="beside_w"`` on a zero-bubble schedule (split backwards, ``I``/``W``), a
micro-batch's CURV_A and CURV_B go into the earliest window after the W of the same micro-batch
(after its B where the pair was merged), not after its F or I: W holds exactly the layer inputs
and output gradients the curvature reads, so a capture then lives no longer than W's operands do
and costs no activation memory of its own. ``after_capture`` (the default) lets them run as early
as their data exists, which hides more in short bubbles but keeps captures alive longer.

[Note: inverting in the curvature's phase]
Step 1 fills each phase's bubbles with curvature before any INVERT is placed, so a layer's INVERT
often lands phases after its curvature: with inverses promoted when ready the curvature age is
k + p_i − p_c, and on bert-mini at D=2 (k=7) that lag reaches 2, at D=8 (chimera, bert-tiny, k=5–8) 3.
``max_invert_lag`` L bounds it: an INVERT not placed by phase p_c + L runs there anyway, before
STEP (spilled), so the age is at most k + L. With L = 0 step 1 also keeps, per worker and phase,
room for the INVERTs of the layers whose curvature it put there: a layer's curvature goes into
phase p only if the free time of p's windows at or after its last curvature unit, less the INVERT
time already reserved in p on that worker, still holds its own INVERT (free time, not where it
lies: a window can be too short); layers it pushes past the last phase spill as in 2.
:func:`plan_pipefisher` re-plans a k with L = max_staleness − k under ``promote="when_ready"`` only
when its plain plan exceeds ``max_staleness``.

k is the smallest interval with no spill; when every interval up to ``max_interval`` spills, the
smallest one predicted within 2 % of the fastest ([Note: choosing k]). The work does not slow the pipeline: every inserted
unit ends before the action after its window needs the worker, so the simulated times of the
pipeline's own actions do not change (except for tail and spilled work). Finally the simulator
compares the plan with the same refresh on the critical path and keeps the faster ([Note: never
slower than critical-path K-FAC]).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipefisher.planning.bubbles import Window, WindowItem, find_windows, summarize_timeline
from pipefisher.planning.staleness import StalenessCurve, choose_interval
from pipefisher.schedules import Action, ActionKind, Schedule
from pipefisher.schedules.checks import stuck_positions
from pipefisher.schedules.kfac import (
    Assignment,
    check_assignment,
    critical_path_assignment,
    curvature_age_bound,
    refresh_micro_batches,
    require_plain_schedule,
    with_preconditioning,
)
from pipefisher.simulate import CostModel, owner_members, simulate, simulate_phases

__all__ = ["CURVATURE_PLACEMENTS", "PlanStats", "plan_pipefisher", "plan_interval", "work_and_bubbles"]

# Where a micro-batch's curvature may go ([Note: curvature beside W]).
CURVATURE_PLACEMENTS = ("after_capture", "beside_w")

log = logging.getLogger(__name__)
K = ActionKind


@dataclass(frozen=True)
class PlanStats:
    """What a plan could not hide.

    Attributes:
        interval: k.
        spilled_ns: work (summed over workers) placed before STEP for want of room in the
            bubbles, though an otherwise empty step's bubbles would hold it; 0 means the bubbles
            hold the refresh.
        tail_ns: work placed before STEP that no k would hide: curvature following the last
            backward of a worker with no bubble after it, and the units of layers whose curvature
            does not fit one empty step's bubbles that found no room.
        mid_step_syncs: SYNC_FACTORs placed inside a step (the others are at a phase's tail).
    """

    interval: int
    spilled_ns: int
    tail_ns: int
    mid_step_syncs: int


def _point(window: Window) -> int:
    return window.point


@dataclass(frozen=True)
class _Placed:
    worker: int
    window: Window
    item: WindowItem
    how: str  # "fit" (in a window's room), "inherent" or "forced" (after everything in the tail)


@dataclass
class _Sync:
    phase: int
    time: int  # T, the cut instant
    end: int  # planned end of the all-reduce
    items: dict[int, tuple[Window, WindowItem]] = field(default_factory=dict)


class _Planner:
    def __init__(self, schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], interval: int,
                 curvature_micro_batches: int = 0, curvature_placement: str = "after_capture",
                 max_invert_lag: int | None = None) -> None:
        if curvature_placement not in CURVATURE_PLACEMENTS:
            raise ValueError(f"optimizer.curvature_placement={curvature_placement!r}: use one of "
                             f"{', '.join(CURVATURE_PLACEMENTS)}")
        self.beside_w = curvature_placement == "beside_w"
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
        self.tail_room = {w: next(x.end - x.start for x in wins if x.tail) for w, wins in geometry.items()}
        self.suffix_max = {}
        for w, wins in geometry.items():
            best, out = 0, []
            for x in reversed([x for x in wins if not x.tail]):
                best = max(best, x.end - x.start)
                out.append(best)
            self.suffix_max[w] = out[::-1]
        self.index = {w: {a: i for i, a in enumerate(acts) if a.kind.is_compute}
                      for w, acts in self.base.actions.items()}
        self._after_index: dict[tuple[int, ActionKind, int, int, int], int] = {}  # :meth:`_after`'s answers
        self.replicas: dict[int, list[tuple[int, int]]] = defaultdict(list)  # stage -> (worker, pipe)
        for (_, pipe, stage), w in sorted(self.base.placement.workers.items(), key=lambda kv: kv[1]):
            self.replicas[stage].append((w, pipe))
        # kfac_owners=replicas ([Note: pricing owners]): a replica's index among its stage's workers
        self.member = owner_members(self.base.placement, cost)
        self.mbs = {p: refresh_micro_batches(schedule, p, curvature_micro_batches)
                    for p in set(schedule.pipe_of_micro_batch)}
        self.seq = itertools.count()
        self.spilled_ns = 0
        self.tail_ns = 0
        self.syncs: dict[tuple[int, int], _Sync] = {}
        self.pending: list[tuple[int, int]] = []  # (stage, layer) whose inverts are not placed
        self.inverts_left: dict[tuple[int, int], set[int]] = {}  # workers still to invert
        # [Note: inverting in the curvature's phase]: INVERT ns reserved per (phase, worker), or None
        if max_invert_lag is not None and max_invert_lag < 0:
            raise ValueError(f"max_invert_lag={max_invert_lag}: an INVERT cannot run before its curvature")
        self.max_invert_lag = max_invert_lag
        self.reserved: dict[tuple[int, int], int] | None = defaultdict(int) if max_invert_lag == 0 else None

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
        """Whether no window after action ``dep`` (the tail included), even empty, holds ``cost``."""
        if cost <= self.tail_room[w]:
            return False
        i = bisect.bisect_right(self.points[w], dep)
        return i >= len(self.points[w]) or self.suffix_max[w][i] < cost

    def _after(self, w: int, kind: ActionKind, stage: int, j: int, pipe: int) -> int:
        """Index of the compute a curvature unit must follow on worker w: its F (A factor) or its
        B / I (B factor); with beside_w, the micro-batch's W (or merged B) for both."""
        key = (w, kind, stage, j, pipe)
        found = self._after_index.get(key)
        if found is not None:  # asked for every unit of every layer at every k: built once
            return found
        index = self.index[w]
        full = index.get(Action(K.BACKWARD, stage, j, pipe))
        if self.beside_w:
            found = full if full is not None else index[Action(K.BACKWARD_WEIGHT, stage, j, pipe)]
        elif kind == K.CURV_A:
            found = index[Action(K.FORWARD, stage, j, pipe)]
        else:
            found = full if full is not None else index[Action(K.BACKWARD_INPUT, stage, j, pipe)]
        self._after_index[key] = found
        return found

    def _add(self, win: Window, start: int, cost: int, action: Action) -> WindowItem:
        return win.add(start, cost, next(self.seq), action)

    # -- curvature ------------------------------------------------------------------------------

    def _place_curvature(self, p: int, stage: int, layer: int, force: bool = False) -> list[_Placed] | None:
        """Place every curvature unit of (stage, layer) in phase p; the units placed, or None.

        A unit no window after its F/B could hold even in an empty step goes after everything
        in the tail window (*inherent*). With ``force``, so does a unit no window has room for
        (*forced*). Nothing is counted here (see :meth:`_commit`): a placement can be undone.
        """
        placed: list[_Placed] = []
        for w, pipe in self.replicas[stage]:
            units = []
            for j in self.mbs[pipe]:
                for kind in (K.CURV_A, K.CURV_B):
                    units.append((self._after(w, kind, stage, j, pipe), Action(kind, stage, j, pipe, layer=layer)))
            units.sort(key=lambda u: u[0])
            for dep, act in units:
                c = self.cost.kfac_ns(act.kind, stage, layer)
                win = t = None
                how = "fit"
                if self._inherent(w, dep, c):
                    win, how = self._tail(p, w), "inherent"
                    t = win.force(0, c)
                else:
                    wins = self.windows[p][w]
                    for x in itertools.islice(wins, bisect.bisect_right(wins, dep, key=_point), None):
                        if (t := x.fit(0, c)) is not None:
                            win = x
                            break
                if win is None and force:
                    win, how = self._tail(p, w), "forced"
                    t = win.force(0, c)
                if win is None:
                    self._undo(placed)
                    return None
                placed.append(_Placed(w, win, self._add(win, t, c, act), how))
        return placed

    def _reserve_inverts(self, p: int, stage: int, layer: int, placed: list[_Placed]) -> bool:
        """Reserve (stage, layer)'s INVERTs in phase p if every replica's worker has the free time
        for them after its last curvature unit there ([Note: inverting in the curvature's phase])."""
        assert self.reserved is not None
        costs = {w: self.cost.kfac_ns(K.INVERT, stage, layer, self.member.get((w, stage)))
                 for w, _ in self.replicas[stage]}
        for w, c in costs.items():
            last = max(u.window.point for u in placed if u.worker == w)
            free = sum(max(0, x.end - x.start - x.busy_ns) for x in self.windows[p][w] if x.point >= last)
            if free < self.reserved[(p, w)] + c:
                return False
        for w, c in costs.items():
            self.reserved[(p, w)] += c
        return True

    @staticmethod
    def _undo(placed: list[_Placed]) -> None:
        for u in placed:
            u.window.remove(u.item)

    def _commit(self, placed: list[_Placed], oversized: bool) -> dict[int, int]:
        """Count the exposed units of a placement; per worker the end of its last unit.

        Forced units of an oversized layer (one an empty step cannot hold) count as tail work,
        not spill: no k hides them.
        """
        ends: dict[int, int] = {}
        for u in placed:
            ends[u.worker] = max(ends.get(u.worker, 0), u.item.end)
            c = u.item.end - u.item.start
            if u.how == "inherent" or (u.how == "forced" and oversized):
                self.tail_ns += c
            elif u.how == "forced":
                self.spilled_ns += c
        return ends

    def _exposure(self, p: int) -> int:
        """How far phase p's tail work runs past the tail windows (the slowest worker's)."""
        return max(self._tail(p, w).exposed_ns for w in self.windows[p])

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
            c = self.cost.kfac_ns(K.INVERT, stage, layer, self.member.get((w, stage)))
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

    def _due(self, p: int, key: tuple[int, int]) -> bool:
        """Whether (stage, layer)'s INVERT must run in phase p ([Note: inverting in the curvature's phase])."""
        return self.max_invert_lag is not None and p - self.syncs[key].phase >= self.max_invert_lag

    # -- the phases -----------------------------------------------------------------------------

    def _oversized(self) -> set[tuple[int, int]]:
        """(stage, layer)s whose curvature does not fit the bubbles of an otherwise empty step.

        Tried in a scratch phase built from phase 0's windows, so it runs before any placement.
        """
        scratch = {w: [Window(x.point, x.start, x.end, x.tail) for x in wins]
                   for w, wins in self.windows[0].items()}
        self.windows.append(scratch)
        out = set()
        try:
            for stage, n in enumerate(self.layers):
                for layer in range(n):
                    placed = self._place_curvature(self.k, stage, layer)
                    if placed is None:
                        out.add((stage, layer))
                    else:
                        self._undo(placed)
        finally:
            self.windows.pop()
        return out

    def _curvature_ns(self, stage: int, layer: int) -> int:
        per_mb = self.cost.kfac_ns(K.CURV_A, stage, layer) + self.cost.kfac_ns(K.CURV_B, stage, layer)
        return sum(per_mb * len(self.mbs[pipe]) for _, pipe in self.replicas[stage])

    def _place_exposed(self, stage: int, layer: int, oversized: bool) -> tuple[int, dict[int, int]]:
        """Force (stage, layer)'s curvature into the phase whose step it lengthens least.

        [Note: exposed work goes where exposed work already is]
        A phase's step is about as long as its most exposed worker's tail, so exposed work on
        different workers overlaps when it is in one phase and adds up when it is in different
        phases (the 1F1B, N = 4D weakness of issue 8: the last stage's curvature exposed in phase
        0 and the first stages' spill in phase k−1 made the plan slower than critical-path K-FAC
        at the same k). Each layer goes where max-over-workers exposure grows least; ties go to
        the earlier phase, which leaves later phases' bubbles for the layer's INVERT.
        """
        best = None
        for p in range(self.k):
            before = self._exposure(p)
            placed = self._place_curvature(p, stage, layer, force=True)
            grow = self._exposure(p) - before
            self._undo(placed)
            if best is None or grow < best[0]:
                best = (grow, p)
        p = best[1]
        return p, self._commit(self._place_curvature(p, stage, layer, force=True), oversized)

    def run(self) -> tuple[tuple[Schedule, ...], PlanStats]:
        oversized = self._oversized()
        todo = {s: [l for l in range(n) if (s, l) not in oversized] for s, n in enumerate(self.layers)}
        todo = {s: ls for s, ls in todo.items() if ls}
        # per phase: (stage, layer, per worker the end of its last curvature unit)
        committed: list[list[tuple[int, int, dict[int, int]]]] = [[] for _ in range(self.k)]
        for p in range(self.k):  # 1. curvature that fits the bubbles
            progress = True
            while progress:  # round robin: one layer per stage per round
                progress = False
                for stage in sorted(todo):
                    for layer in list(todo[stage]):
                        placed = self._place_curvature(p, stage, layer)
                        if placed is not None and self.reserved is not None \
                                and not self._reserve_inverts(p, stage, layer, placed):
                            self._undo(placed)  # no room left for its INVERT in this phase: try the next
                            placed = None
                        if placed is not None:
                            todo[stage].remove(layer)
                            committed[p].append((stage, layer, self._commit(placed, False)))
                            progress = True
                            break
            todo = {s: ls for s, ls in todo.items() if ls}
        # 2. spill and oversized layers: whole layers, exposed, largest first
        rest = [(s, l) for s in sorted(todo) for l in todo[s]] + sorted(oversized)
        for stage, layer in sorted(rest, key=lambda key: -self._curvature_ns(*key)):
            p, ends = self._place_exposed(stage, layer, (stage, layer) in oversized)
            committed[p].append((stage, layer, ends))
        for p in range(self.k):  # 3. syncs and inverts
            last = p == self.k - 1
            entries = sorted((max(ends.values()), stage, layer, self._curvature_points(p, stage, layer))
                             for stage, layer, ends in committed[p])
            for time, stage, layer, points in entries:
                self._place_sync(p, stage, layer, time, points)
                self.inverts_left[(stage, layer)] = {w for w, _ in self.replicas[stage]}
            self._repair(p)
            for key in self.pending:
                self._place_inverts(p, key, force=last or self._due(p, key))
            new = sorted((self.syncs[(s, l)].time, s, l) for _, s, l, _ in entries)
            for _, s, l in new:
                self._place_inverts(p, (s, l), force=last or self._due(p, (s, l)))
            self.pending = [key for key in self.pending + [(s, l) for _, s, l in new] if self.inverts_left[key]]
        assert not self.pending
        phases = tuple(self._build(p) for p in range(self.k))
        mid = sum(1 for s in self.syncs.values() if not all(x[0].tail for x in s.items.values()))
        return phases, PlanStats(self.k, self.spilled_ns, self.tail_ns, mid)


def plan_interval(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], interval: int, *,
                  curvature_micro_batches: int = 0, curvature_placement: str = "after_capture",
                  max_invert_lag: int | None = None, check: bool = True) -> tuple[Assignment, PlanStats]:
    """The PipeFisher plan for a given refresh interval ([Note: the list scheduler]).

    ``curvature_micro_batches``: curvature from the first n micro-batches of each pipe (0: all;
    ``pipefisher.schedules.kfac`` [Note: curvature from part of the batch]).
    ``curvature_placement``: ``after_capture`` or ``beside_w`` ([Note: curvature beside W]).
    ``max_invert_lag``: every INVERT at most this many phases after its curvature (0: in its phase,
    with room kept for it; None: no bound) ([Note: inverting in the curvature's phase]).
    ``check``: check the assignment (``schedules.kfac.check_assignment``); :func:`plan_pipefisher` checks
    only the one it returns (the candidates it compares are simulated, not run).

    Returns:
        ``(assignment, stats)``; the assignment is checked unless ``check`` is False.
    """
    require_plain_schedule(schedule, kfac_layers)
    if cost.num_stages != schedule.num_stages:
        raise ValueError(f"CostModel has {cost.num_stages} stages, the schedule {schedule.num_stages}")
    if cost.kfac_layers is not None and list(cost.kfac_layers) != list(kfac_layers):
        raise ValueError(f"kfac_layers={list(kfac_layers)} but the cost model has K-FAC costs for "
                         f"{list(cost.kfac_layers)} layers per stage; build both for the same model")
    phases, stats = _Planner(schedule, cost, kfac_layers, interval, curvature_micro_batches,
                             curvature_placement, max_invert_lag).run()
    a = Assignment(interval, phases, True, tuple(kfac_layers), metadata={
        "planner": "pipefisher", "spilled_ns": stats.spilled_ns, "tail_ns": stats.tail_ns,
        "mid_step_syncs": stats.mid_step_syncs, "curvature_placement": curvature_placement,
        **({"max_invert_lag": max_invert_lag} if max_invert_lag is not None else {})},
        curvature_micro_batches=curvature_micro_batches)
    if check:
        check_assignment(a)
    return a, stats


def plan_pipefisher(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], *,
                    max_interval: int = 8, max_staleness: int | None = None,
                    curvature_micro_batches: int = 0, curvature_placement: str = "after_capture",
                    promote: str = "at_cycle_end", staleness: StalenessCurve | None = None) -> Assignment:
    """Place K-FAC work into the bubbles; the smallest refresh interval whose bubbles hold it, or with
    a measured ``staleness`` curve the interval of least predicted time to target.

    See [Note: the list scheduler]. Curvature of micro-batch i runs after its F (A factor) or B
    (B factor) on the worker and pipe that ran it; factor all-reduces after all of a layer's
    curvature; inversion after the all-reduce; PRECOND before STEP in every phase. Inverses are
    deferred (used from the next cycle on), so the curvature in use is up to 2k − 1 steps old.

    [Note: choosing k]
    k_min = ⌈K-FAC work of one refresh / bubble time of one step⌉ (both summed over workers) is a
    lower bound: no plan hides a refresh in fewer steps. The planner tries k = 1, 2, … up to
    ``max_interval`` (and up to (max_staleness + 1) / 2, so that 2k − 1 stays within the bound;
    with ``promote="when_ready"`` up to max_staleness, re-planning a k whose plan's bound
    k + p_i − p_c exceeds it with its INVERTs at most max_staleness − k phases late and skipping it
    if that still exceeds it: ``schedules.kfac.curvature_age_bound``, [Note: inverting in the
    curvature's phase])
    and takes the first k with no spilled work. When every k spills, spilled work lengthens one
    step per cycle; the planner takes the smallest k whose predicted mean step time is within 2 %
    of the best k's (a larger k buys at most that much speed, and costs freshness), and says so.
    With a staleness curve (:mod:`pipefisher.planning.staleness`) every k up to the curve's largest
    is planned and the k of least step time × steps multiplier is taken: a k whose bubbles hold the
    refresh can lose to a smaller k that spills, where stale curvature costs more steps than the
    spill costs time.

    Args:
        schedule: a complete schedule without K-FAC units (``build_schedule``).
        cost: costs including the K-FAC units (``estimate_costs`` / ``costs_from_profile``).
        kfac_layers: K-FAC layers per stage (``kfac_layer_counts``).
        max_interval: the largest k to try.
        max_staleness: bound on the curvature age in steps (the plan's :func:`curvature_age_bound`
            under ``promote`` <= it); None: no bound.
        curvature_micro_batches: curvature from the first n micro-batches of each pipe (0: all).
        curvature_placement: ``after_capture`` (after the F / the B or I) or ``beside_w`` (after the
            micro-batch's W on a zero-bubble schedule; [Note: curvature beside W]).
        promote: when the runtime puts deferred inverses in use (``optimizer.promote_inverses``):
            ``at_cycle_end`` or ``when_ready``; decides the age bound.
        staleness: steps multiplier per k, measured under ``promote`` (None: bubbles alone decide).

    Returns:
        A checked assignment with ``deferred=True``, never predicted slower than the same
        refresh on the critical path at its k; ``metadata`` holds ``spilled_ns``, ``tail_ns``,
        ``mid_step_syncs``, ``k_min``, ``kfac_work_ns``, ``bubble_ns``, ``max_staleness``,
        ``choice`` (why this k) and ``fallback`` (with its reason) where the critical path was faster.

    Raises:
        ValueError: ``max_interval`` < 1 or ``max_staleness`` < 1.
    """
    if not isinstance(max_interval, int) or max_interval < 1:
        raise ValueError(f"max_interval={max_interval!r}: try at least interval 1")
    limit = max_interval
    if max_staleness is not None:
        if max_staleness < 1:
            raise ValueError(f"max_staleness={max_staleness!r}: deferred inverses are at least 1 step old")
        limit = min(limit, (max_staleness + 1) // 2 if promote == "at_cycle_end" else max_staleness)
    if staleness is not None:
        if staleness.promote_inverses != promote:
            raise ValueError(f"the staleness curve was measured with promote_inverses={staleness.promote_inverses}, "
                             f"this plan promotes {promote}: the curvature ages differ; measure a curve for {promote}")
        limit = min(limit, staleness.max_k)
    tried: list[tuple[Assignment, PlanStats, float]] = []
    for k in range(1, limit + 1):  # plan_interval checks the inputs
        a, stats = plan_interval(schedule, cost, kfac_layers, k, curvature_micro_batches=curvature_micro_batches,
                                 curvature_placement=curvature_placement, check=False)
        age = curvature_age_bound(a, promote)
        log.debug("interval %d: spilled %d ns, tail %d ns, curvature age <= %d", k, stats.spilled_ns, stats.tail_ns, age)
        if max_staleness is not None and age > max_staleness >= k and promote == "when_ready":
            # [Note: inverting in the curvature's phase]: the INVERTs' lag may be what breaks the bound
            b, b_stats = plan_interval(schedule, cost, kfac_layers, k, curvature_micro_batches=curvature_micro_batches,
                                       curvature_placement=curvature_placement, max_invert_lag=max_staleness - k,
                                       check=False)
            if (b_age := curvature_age_bound(b, promote)) <= max_staleness:
                a, stats, age = b, b_stats, b_age
                log.debug("interval %d: INVERTs kept near their curvature: spilled %d ns, curvature age <= %d",
                          k, stats.spilled_ns, age)
        if max_staleness is not None and age > max_staleness:
            continue  # k = 1 always passes: its bound is 1 under either rule
        tried.append((a, stats, _step_ns(a, cost)))
        if stats.spilled_ns == 0 and staleness is None:
            break
    a, stats, step_ns = tried[-1]
    bounds = work_and_bubbles(schedule, cost, kfac_layers, curvature_micro_batches)
    if staleness is not None:
        k, choice = choose_interval({x.interval: t for x, _, t in tried}, staleness)
        a, stats, step_ns = next(x for x in tried if x[0].interval == k)
    elif stats.spilled_ns == 0:
        choice = f"k={a.interval}: the smallest interval whose bubbles hold the refresh (k_min={bounds['k_min']})"
    else:
        best = min(t for _, _, t in tried)
        a, stats, step_ns = next(x for x in tried if x[2] <= 1.02 * best)
        choice = (f"k={a.interval}: no k <= {limit} hides the refresh; the smallest k predicted within 2% of the "
                  f"fastest ({step_ns / 1e6:.1f} ms vs {best / 1e6:.1f} ms per step; k_min={bounds['k_min']})")
    check_assignment(a)  # the candidate taken; the others were only simulated
    a = replace(a, metadata={**a.metadata, **bounds, "max_staleness": max_staleness, "choice": choice,
                             "promote_inverses": promote})
    return _no_slower_than_critical_path(a, schedule, cost, step_ns)


def work_and_bubbles(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int],
                     curvature_micro_batches: int = 0) -> dict[str, int]:
    """K-FAC work of one refresh, bubble time of one step (both summed over workers, in ns), and
    the lower bound k_min = ⌈work / bubbles⌉ on the refresh interval of any plan ([Note: choosing k]).

    The work is curvature (of the refresh's micro-batches) and inversion of every layer of every
    stage replica; the bubbles are the idle time of the simulated step with one PRECOND per replica.
    """
    base = with_preconditioning(schedule)
    events = simulate(base, cost)
    summary = summarize_timeline(events, base.num_workers, 1)
    bubble = round(summary.step_time_ns * base.num_workers * (1.0 - summary.utilization))
    work = 0
    member = owner_members(base.placement, cost)  # [Note: pricing owners]
    for (_, pipe, stage), w in base.placement.workers.items():
        n = len(refresh_micro_batches(schedule, pipe, curvature_micro_batches))
        for layer in range(kfac_layers[stage]):
            work += n * (cost.kfac_ns(K.CURV_A, stage, layer) + cost.kfac_ns(K.CURV_B, stage, layer))
            work += cost.kfac_ns(K.INVERT, stage, layer, member.get((w, stage)))
    k_min = max(1, -(-work // bubble)) if bubble > 0 else 0  # 0: no bubble, no k hides anything
    return {"kfac_work_ns": int(work), "bubble_ns": int(bubble), "k_min": int(k_min)}


def _step_ns(a: Assignment, cost: CostModel) -> float:
    """Simulated mean step time of one refresh cycle (as ``predict.predict_assignment``)."""
    return summarize_timeline(simulate_phases(a.phases, cost), a.phases[0].num_workers, a.interval).step_time_ns


def _no_slower_than_critical_path(planned: Assignment, schedule: Schedule, cost: CostModel,
                                  planned_ns: float | None = None) -> Assignment:
    """``planned``, or the same refresh on the critical path where the simulator says that is faster
    (``planned_ns``: ``planned``'s simulated step where the caller has it).

    [Note: never slower than critical-path K-FAC]
    The list scheduler is greedy and its exposure model (a phase's step is as long as its most
    exposed tail) ignores how a late worker delays the next step's pipeline, so a plan can come
    out slower than running the same refresh after the flush of phase 0
    (``critical_path_assignment`` at the same k). The simulator decides: the faster of the two is
    returned, so a PipeFisher plan is never predicted slower than critical-path K-FAC at its k.
    The fallback keeps ``deferred=True`` (the runtime then uses the same staleness as a plan) and
    says so in ``metadata["fallback"]``; all its work counts as spilled.
    """
    k = planned.interval
    cp = critical_path_assignment(schedule, planned.kfac_layers, k, deferred=True,
                                  curvature_micro_batches=planned.curvature_micro_batches)
    t_plan = _step_ns(planned, cost) if planned_ns is None else planned_ns
    t_cp = _step_ns(cp, cost)
    if t_plan <= t_cp:
        return planned
    work = sum(cost.kfac_ns(x.kind, x.stage, x.layer) for x in _kfac_units(cp)
               if x.kind in (K.CURV_A, K.CURV_B, K.INVERT))
    reason = (f"the plan at k={k} is predicted slower than its work on the critical path "
              f"({t_plan / 1e6:.1f} ms vs {t_cp / 1e6:.1f} ms per step)")
    log.info("PipeFisher falls back to critical-path K-FAC: %s", reason)
    keep = {key: planned.metadata[key] for key in ("k_min", "kfac_work_ns", "bubble_ns", "max_staleness", "choice",
                                                   "promote_inverses")
            if key in planned.metadata}
    return replace(cp, metadata={**keep, "planner": "pipefisher", "fallback": "critical_path",
                                 "fallback_reason": reason, "spilled_ns": work, "tail_ns": 0, "mid_step_syncs": 0})


def _kfac_units(a: Assignment) -> list[Action]:
    return [x for phase in a.phases for acts in phase.actions.values() for x in acts if x.kind.is_kfac]
