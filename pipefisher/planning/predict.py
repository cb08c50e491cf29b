"""Predicted step time and bubble utilization of nvlamb, kfac (critical path) and PipeFisher.

Every figure here is a simulation (``pipefisher.simulate``) of the schedules under a cost model:
nvlamb runs the pipeline alone; kfac runs :func:`~pipefisher.schedules.kfac.critical_path_assignment`
(refresh every ``kfac_interval`` steps, all of it after the flush); pipefisher runs the planned
assignment. Step time is the mean over the k steps of a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from pipefisher.planning.assign import plan_pipefisher
from pipefisher.planning.bubbles import summarize_timeline
from pipefisher.schedules import Schedule
from pipefisher.schedules.kfac import Assignment, critical_path_assignment
from pipefisher.simulate import CostModel, simulate, simulate_phases
from pipefisher.timeline import Event

__all__ = ["Comparison", "Prediction", "compare_optimizers", "predict_assignment", "predict_schedule"]


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
                       max_interval: int = 8, kfac_interval: int = 1) -> Comparison:
    """Plan PipeFisher and predict nvlamb, kfac and pipefisher on ``schedule``.

    Args:
        schedule: a complete schedule without K-FAC units.
        cost: costs with K-FAC units.
        kfac_layers: K-FAC layers per stage.
        max_interval: largest refresh interval PipeFisher may choose.
        kfac_interval: refresh interval of the kfac baseline (1: every step).

    Returns:
        The comparison; ``comparison.assignment.metadata["predicted"]`` holds the figures.
    """
    nvlamb, _ = predict_schedule(schedule, cost)
    planned = plan_pipefisher(schedule, cost, kfac_layers, max_interval=max_interval)
    pipefisher, events = predict_assignment(planned, cost)
    kfac, _ = predict_assignment(critical_path_assignment(schedule, kfac_layers, kfac_interval), cost, "kfac")
    same, _ = predict_assignment(critical_path_assignment(schedule, kfac_layers, planned.interval), cost, "kfac")
    out = Comparison(nvlamb, kfac, same, pipefisher, planned, events)
    meta = dict(planned.metadata)
    meta["predicted"] = out.as_dict()
    return replace(out, assignment=replace(planned, metadata=meta))
