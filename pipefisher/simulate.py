"""Discrete-event simulation of a schedule under a cost model, giving a predicted timeline.

``simulate(schedule, cost)`` walks every worker's action list in order and starts each action as
soon as the worker is free and its inputs exist; it returns the same ``list[Event]`` the executor
records, so profiling, plots and bubble utilization work on either. Pure Python; no torch.

[Note: simulated semantics]
Chosen to match ``pipefisher.runtime.executor``:

- ``F``/``B`` of stage s occupy the worker for ``cost.forward_ns[s]`` / ``cost.backward_ns[s]``.
- ``SEND_*`` is issued and returns at once (zero-length event; the executor uses ``isend``).
- ``RECV_*`` ends at max(worker free, send issued + ``cost.p2p_ns``); its event spans the wait.
- ``SYNC_GRAD`` of stage s is an asynchronous all-reduce: it starts when every replica of the
  stage has reached its SYNC_GRAD and lasts ``cost.sync_ns[s]``; the worker does not wait for it.
- ``STEP`` waits for the worker's all-reduces of the step, then lasts ``cost.step_ns``.
- A compute-only schedule (no SEND/RECV) is simulated with its data dependencies instead: an F
  starts after the upstream F ended (+ ``p2p_ns`` across workers), a B after its own F and the
  downstream B.

With ``steps > 1`` the lists are repeated; a worker starts step k+1 right after its own STEP.
Example, 1F1B, D=3, N=4, F = B = 1 unit, no communication cost (``.`` = bubble)::

    W0  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    W1  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    W2  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .      bubble 2/(4+2) = (D−1)/(N+D−1)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipefisher.schedules.checks import ScheduleError
from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.passes import matching_send, worker_dp_groups
from pipefisher.timeline import Event, bubble_utilization

__all__ = ["CostModel", "simulate", "peak_activations", "simulated_bubble_ratio"]

K = ActionKind


def _as_tuple(values: Sequence[int] | int, n: int, name: str) -> tuple[int, ...]:
    out = (values,) * n if isinstance(values, int) else tuple(values)
    if any(not isinstance(v, int) or v < 0 for v in out):
        raise ValueError(f"CostModel.{name}={values!r}: costs are non-negative integer ns")
    return out


@dataclass(frozen=True)
class CostModel:
    """Per-action costs in nanoseconds.

    Attributes:
        forward_ns: forward cost of each stage, ``len == num_stages``.
        backward_ns: backward cost of each stage.
        p2p_ns: latency of one point-to-point message (send issued → data received).
        sync_ns: gradient all-reduce cost of each stage (empty means 0 for every stage).
        step_ns: optimizer step cost per worker.
    """

    forward_ns: tuple[int, ...]
    backward_ns: tuple[int, ...]
    p2p_ns: int = 0
    sync_ns: tuple[int, ...] = ()
    step_ns: int = 0

    def __post_init__(self) -> None:
        n = len(self.forward_ns)
        object.__setattr__(self, "forward_ns", _as_tuple(self.forward_ns, n, "forward_ns"))
        object.__setattr__(self, "backward_ns", _as_tuple(self.backward_ns, n, "backward_ns"))
        sync = self.sync_ns if (isinstance(self.sync_ns, int) or len(self.sync_ns)) else 0
        object.__setattr__(self, "sync_ns", _as_tuple(sync, n, "sync_ns"))
        _as_tuple(self.p2p_ns, 1, "p2p_ns")
        _as_tuple(self.step_ns, 1, "step_ns")
        for name in ("backward_ns", "sync_ns"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"CostModel.{name} has {len(getattr(self, name))} entries; "
                                 f"forward_ns has {n} (one per stage)")

    @classmethod
    def uniform(cls, num_stages: int, forward_ns: int, backward_ns: int | None = None, *,
                p2p_ns: int = 0, sync_ns: int = 0, step_ns: int = 0) -> CostModel:
        """Every stage costs the same.

        Args:
            num_stages: number of stages (``Schedule.num_stages``; D·v for interleaved).
            forward_ns: forward cost of a stage.
            backward_ns: backward cost of a stage; defaults to ``forward_ns`` (the closed-form
                bubble ratios of DESIGN.md assume equal costs; real backwards cost about 2×).
            p2p_ns: point-to-point latency.
            sync_ns: all-reduce cost of a stage.
            step_ns: optimizer step cost.
        """
        return cls(
            forward_ns=(forward_ns,) * num_stages,
            backward_ns=((forward_ns if backward_ns is None else backward_ns),) * num_stages,
            p2p_ns=p2p_ns,
            sync_ns=(sync_ns,) * num_stages,
            step_ns=step_ns,
        )

    @property
    def num_stages(self) -> int:
        return len(self.forward_ns)

    # Short aliases: cost.forward[stage], cost.backward[stage], cost.sync[stage], cost.step.
    @property
    def forward(self) -> tuple[int, ...]:
        return self.forward_ns

    @property
    def backward(self) -> tuple[int, ...]:
        return self.backward_ns

    @property
    def sync(self) -> tuple[int, ...]:
        return self.sync_ns

    @property
    def step(self) -> int:
        return self.step_ns


class _Sim:
    """State of one simulation; ``run`` fills ``events``."""

    def __init__(self, schedule: Schedule, cost: CostModel, steps: int) -> None:
        self.s = schedule
        self.cost = cost
        self.dp_of = worker_dp_groups(schedule.placement)
        self.where = schedule.placement.workers
        self.members = {st: schedule.placement.replicas_of_stage(st) for st in range(schedule.num_stages)}
        self.data_deps = not any(a.kind.is_comm for acts in schedule.actions.values() for a in acts)
        self.work = {w: [(k, a) for k in range(steps) for a in acts]
                     for w, acts in schedule.actions.items()}
        self.ptr = {w: 0 for w in self.work}
        self.clock = {w: 0 for w in self.work}
        self.compute_end: dict[tuple[int, int, Action], int] = {}  # (step, dp, F/B) -> end
        self.sent: dict[tuple[int, int, Action], int] = {}  # (step, sender, SEND) -> issue time
        self.arrivals: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)  # (step, stage)
        self.open_syncs: dict[tuple[int, int], set[int]] = defaultdict(set)  # (step, w) -> stages
        self.sync_end: dict[tuple[int, int], int] = defaultdict(int)  # (step, w) -> latest end
        self.events: list[Event] = []

    def _emit(self, w: int, k: int, a: Action, start: int, end: int) -> None:
        self.events.append(Event(worker=w, name=str(a), kind=a.kind.value, start_ns=start,
                                 end_ns=end, step=k))

    def _input_ready(self, w: int, k: int, a: Action) -> int | None:
        """Earliest start allowed by data dependencies (compute-only schedules), None if unknown."""
        t = 0
        if not self.data_deps:
            return t
        dp, s, j, p = self.dp_of[w], a.stage, a.micro_batch, a.pipe
        deps = []
        if a.kind == K.FORWARD:
            if s > 0:
                deps.append(Action(K.FORWARD, s - 1, j, p))
        else:
            deps.append(Action(K.FORWARD, s, j, p))
            if s < self.s.num_stages - 1:
                deps.append(Action(K.BACKWARD, s + 1, j, p))
        for d in deps:
            end = self.compute_end.get((k, dp, d))
            if end is None:
                return None
            t = max(t, end + (self.cost.p2p_ns if self.where[(dp, p, d.stage)] != w else 0))
        return t

    def _advance(self, w: int) -> bool:
        k, a = self.work[w][self.ptr[w]]
        now = self.clock[w]
        if a.kind.is_compute:
            ready = self._input_ready(w, k, a)
            if ready is None:
                return False
            start = max(now, ready)
            end = start + (self.cost.forward_ns if a.kind == K.FORWARD else self.cost.backward_ns)[a.stage]
            self.compute_end[(k, self.dp_of[w], a)] = end
        elif a.kind in (K.SEND_F, K.SEND_B):
            start = end = now
            self.sent[(k, w, a)] = now
        elif a.kind in (K.RECV_F, K.RECV_B):
            issued = self.sent.get((k, a.peer, matching_send(a, w)))
            if issued is None:
                return False
            start, end = now, max(now, issued + self.cost.p2p_ns)
        elif a.kind == K.SYNC_GRAD:
            self._arrive(w, k, a, now)
            self.ptr[w] += 1
            return True
        elif a.kind == K.STEP:
            if self.open_syncs[(k, w)]:
                return False
            start = max(now, self.sync_end[(k, w)])
            end = start + self.cost.step_ns
        else:  # pragma: no cover - kinds added to the IR must be simulated here
            raise NotImplementedError(f"simulator has no rule for {a}")
        self._emit(w, k, a, start, end)
        self.clock[w] = end
        self.ptr[w] += 1
        return True

    def _arrive(self, w: int, k: int, a: Action, now: int) -> None:
        arrived = self.arrivals[(k, a.stage)]
        arrived[w] = now
        self.open_syncs[(k, w)].add(a.stage)
        if set(arrived) != set(self.members[a.stage]):
            return
        start = max(arrived.values())
        end = start + self.cost.sync_ns[a.stage]
        for m in self.members[a.stage]:
            self.open_syncs[(k, m)].discard(a.stage)
            self.sync_end[(k, m)] = max(self.sync_end[(k, m)], end)
            mine = next(x for x in self.s.actions[m] if x.kind == K.SYNC_GRAD and x.stage == a.stage)
            self._emit(m, k, mine, start, end)

    def run(self) -> list[Event]:
        progress = True
        while progress:
            progress = False
            for w, work in self.work.items():
                while self.ptr[w] < len(work) and self._advance(w):
                    progress = True
        stuck = [w for w, work in self.work.items() if self.ptr[w] < len(work)]
        if stuck:
            waits = ", ".join(f"worker {w} at {self.work[w][self.ptr[w]][1]}" for w in stuck)
            raise ScheduleError(f"simulation of {self.s.method} cannot proceed: {waits}; "
                                f"run check_schedule for the grid")
        self.events.sort(key=lambda e: (e.start_ns, e.worker, e.end_ns))
        return self.events


def simulate(schedule: Schedule, cost: CostModel, steps: int = 1) -> list[Event]:
    """Predict the timeline of ``steps`` training steps of ``schedule``.

    Args:
        schedule: a schedule (compute-only, or complete from ``build_schedule``).
        cost: per-action costs; ``cost.num_stages`` must equal ``schedule.num_stages``.
        steps: how many consecutive steps to simulate.

    Returns:
        One event per action and step (``name=str(action)``, ``kind=action.kind.value``), sorted by
        start time. See [Note: simulated semantics].

    Raises:
        ValueError: the cost model does not fit the schedule, or ``steps < 1``.
        ScheduleError: the schedule cannot run to completion.
    """
    if cost.num_stages != schedule.num_stages:
        raise ValueError(f"CostModel has {cost.num_stages} stages, the {schedule.method} schedule "
                         f"{schedule.num_stages}; build it with CostModel.uniform("
                         f"{schedule.num_stages}, ...)")
    if steps < 1:
        raise ValueError(f"steps={steps}: simulate at least one step")
    return _Sim(schedule, cost, steps).run()


def peak_activations(schedule: Schedule) -> dict[int, int]:
    """Most micro-batch activations a worker holds at once: max over its order of #F − #B.

    Args:
        schedule: any schedule.

    Returns:
        ``{worker: peak}``, counting every stage replica the worker holds.
    """
    peaks = {}
    for w, actions in schedule.actions.items():
        held = peak = 0
        for a in actions:
            if a.kind == K.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind == K.BACKWARD:
                held -= 1
        peaks[w] = peak
    return peaks


def simulated_bubble_ratio(schedule: Schedule, cost: CostModel | None = None) -> float:
    """Idle fraction of the F/B span: 1 − bubble utilization counting only F and B.

    Communication, all-reduce and step costs are set to zero, so the result is comparable with the
    closed forms of DESIGN.md ("Schedules").

    Args:
        schedule: the schedule to simulate (one step).
        cost: F/B costs; defaults to 1000 ns for every forward and backward.

    Returns:
        A fraction in [0, 1).
    """
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, 1000)
    cost = replace(cost, p2p_ns=0, sync_ns=(0,) * cost.num_stages, step_ns=0)
    fb = frozenset({K.FORWARD.value, K.BACKWARD.value})
    events = [e for e in simulate(schedule, cost) if e.kind in fb]
    return 1.0 - bubble_utilization(events, schedule.num_workers, kinds=fb)
