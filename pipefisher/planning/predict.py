"""Predicted step time and bubble utilization of nvlamb, kfac (critical path) and PipeFisher.

Every figure here is a simulation (``pipefisher.simulate``) of the schedules under a cost model:
nvlamb runs the pipeline alone; kfac runs :func:`~pipefisher.schedules.kfac.critical_path_assignment`
(refresh every ``kfac_interval`` steps, all of it after the flush); pipefisher runs the planned
assignment. Step time is the mean over the k steps of a cycle.

:func:`split_steps` puts a measured timeline (a profile) under the same definition, so a
prediction and a measurement of the same run compare; and says where each worker's step went.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from pipefisher.planning.assign import plan_pipefisher
from pipefisher.planning.staleness import StalenessCurve
from pipefisher.planning.bubbles import summarize_timeline
from pipefisher.schedules import Schedule
from pipefisher.schedules.kfac import Assignment, critical_path_assignment
from pipefisher.simulate import CostModel, simulate, simulate_phases
from pipefisher.timeline import COMPUTE_KINDS, SYNC_KINDS, Event, union_length

__all__ = ["Comparison", "Prediction", "StepSplit", "compare_optimizers", "predict_assignment", "predict_schedule",
           "split_steps"]


@dataclass(frozen=True)
class Prediction:
    """Simulated figures of one optimizer's schedule.

    Attributes:
        optimizer: ``nvlamb``, ``kfac`` or ``pipefisher``.
        interval: refresh interval k (1 for nvlamb).
        step_time_s: mean predicted step time.
        utilization: bubble utilization over the k steps (K-FAC work counts as busy).
    """

    optimizer: str
    interval: int
    step_time_s: float
    utilization: float


def predict_schedule(schedule: Schedule, cost: CostModel) -> tuple[Prediction, list[Event]]:
    """nvlamb: one step of the plain pipeline."""
    events = simulate(schedule, cost)
    s = summarize_timeline(events, schedule.num_workers, 1)
    return Prediction("nvlamb", 1, s.step_time_ns / 1e9, s.utilization), events


def predict_assignment(a: Assignment, cost: CostModel, optimizer: str = "pipefisher") -> tuple[Prediction, list[Event]]:
    """One refresh cycle (k steps) of an assignment."""
    events = simulate_phases(a.phases, cost)
    s = summarize_timeline(events, a.phases[0].num_workers, a.interval)
    return Prediction(optimizer, a.interval, s.step_time_ns / 1e9, s.utilization), events


@dataclass(frozen=True)
class Comparison:
    """The three optimizers on one pipeline and cost model.

    Attributes:
        nvlamb: the plain pipeline ("before").
        kfac: K-FAC on the critical path, refreshing every ``kfac_interval`` steps.
        kfac_same_interval: K-FAC on the critical path refreshing every k steps (PipeFisher's k).
        pipefisher: the planned assignment ("after").
        assignment: PipeFisher's assignment, its metadata extended with these figures.
        events: PipeFisher's simulated cycle (for the timeline picture).
    """

    nvlamb: Prediction
    kfac: Prediction
    kfac_same_interval: Prediction
    pipefisher: Prediction
    assignment: Assignment
    events: list[Event]

    def as_dict(self) -> dict[str, dict[str, float | int | str]]:
        return {p.optimizer if p is not self.kfac_same_interval else "kfac_same_interval": asdict(p)
                for p in (self.nvlamb, self.kfac, self.kfac_same_interval, self.pipefisher)}


def compare_optimizers(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], *,
                       max_interval: int = 8, kfac_interval: int = 1, max_staleness: int | None = None,
                       curvature_micro_batches: int = 0, curvature_placement: str = "after_capture",
                       promote: str = "at_cycle_end", staleness: StalenessCurve | None = None) -> Comparison:
    """Plan PipeFisher and predict nvlamb, kfac and pipefisher on ``schedule``.

    Args:
        schedule: a complete schedule without K-FAC units.
        cost: costs with K-FAC units.
        kfac_layers: K-FAC layers per stage.
        max_interval: largest refresh interval PipeFisher may choose.
        kfac_interval: refresh interval of the kfac baseline (1: every step).
        max_staleness, curvature_micro_batches, curvature_placement, promote, staleness: as
            :func:`~pipefisher.planning.assign.plan_pipefisher`
            (the kfac baselines use the same curvature micro-batches).

    Returns:
        The comparison; ``comparison.assignment.metadata["predicted"]`` holds the figures.
    """
    nvlamb, _ = predict_schedule(schedule, cost)
    planned = plan_pipefisher(schedule, cost, kfac_layers, max_interval=max_interval, max_staleness=max_staleness,
                              curvature_micro_batches=curvature_micro_batches,
                              curvature_placement=curvature_placement, promote=promote, staleness=staleness)
    pipefisher, events = predict_assignment(planned, cost)
    n = curvature_micro_batches
    kfac, _ = predict_assignment(critical_path_assignment(schedule, kfac_layers, kfac_interval,
                                                          curvature_micro_batches=n), cost, "kfac")
    same, _ = predict_assignment(critical_path_assignment(schedule, kfac_layers, planned.interval,
                                                          curvature_micro_batches=n), cost, "kfac")
    out = Comparison(nvlamb, kfac, same, pipefisher, planned, events)
    meta = dict(planned.metadata)
    meta["predicted"] = out.as_dict()
    return replace(out, assignment=replace(planned, metadata=meta))


@dataclass(frozen=True)
class StepSplit:
    """Where the workers' steps went, in ns per worker and step, under the definition of
    :func:`~pipefisher.planning.bubbles.summarize_timeline`: a step spans its first start to its
    last STEP end, and busy is the union of compute intervals (``timeline.COMPUTE_KINDS``).

    Attributes:
        num_steps: steps measured.
        step_ns: mean span of a step.
        busy_ns: computing.
        allreduce_ns: in an all-reduce's event (SYNC_GRAD / SYNC_FACTOR: starting one, waiting
            for one, or, simulated, one running), not computing.
        message_ns: in a send or receive, and in neither of the above.
        untracked_ns: in no event: idle, or (measured) the executor's own time between actions.
        between_ns: mean time from a step's end to the next one's start (between steps, rank 0's
            bookkeeping); in no step's span, so in neither figure.
    """

    num_steps: int
    step_ns: float
    busy_ns: float
    allreduce_ns: float
    message_ns: float
    untracked_ns: float
    between_ns: float = 0.0

    @property
    def utilization(self) -> float:
        return self.busy_ns / self.step_ns if self.step_ns > 0 else 0.0


def split_steps(events: Sequence[Event], num_workers: int) -> StepSplit:
    """Split each step of a timeline (measured or simulated) by what its workers did.

    Args:
        events: the events of one or more steps (``Event.step`` tells them apart).
        num_workers: workers of the run (a worker without events counts as idle).

    Returns:
        The mean split; ``split.utilization`` is Σ busy / (workers × Σ step spans), which for one
        simulated step is ``summarize_timeline``'s utilization.
    """
    by_step: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_step[e.step].append(e)
    totals = [0, 0, 0, 0, 0]  # span, busy, all-reduce, message, untracked (summed over workers)
    spans = []
    for _, evs in sorted(by_step.items()):
        start = min(e.start_ns for e in evs)
        ends = [e.end_ns for e in evs if e.kind == "STEP" and not e.name[:1].isdigit()]  # not a stage STEP ("1STEP@1")
        end = max(ends) if ends else max(e.end_ns for e in evs)
        spans.append((start, end))
        per_worker: dict[int, list[Event]] = defaultdict(list)
        for e in evs:
            if e.start_ns < end and e.end_ns > start:
                per_worker[e.worker].append(e)
        for w in range(num_workers):
            mine = per_worker.get(w, [])

            def covered(kinds: frozenset[str] | None, mine: list[Event] = mine) -> int:
                return union_length((max(e.start_ns, start), min(e.end_ns, end)) for e in mine
                                    if kinds is None or e.kind in kinds)

            busy, synced, anything = (covered(COMPUTE_KINDS), covered(COMPUTE_KINDS | SYNC_KINDS), covered(None))
            totals[0] += end - start
            totals[1] += busy
            totals[2] += synced - busy
            totals[3] += anything - synced
            totals[4] += end - start - anything
    n = max(len(spans), 1) * max(num_workers, 1)
    gaps = [max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
    return StepSplit(len(spans), *(t / n for t in totals), between_ns=sum(gaps) / len(gaps) if gaps else 0.0)
