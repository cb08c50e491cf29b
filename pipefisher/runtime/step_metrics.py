"""What rank 0 reports about each training step from the gathered timelines: measured bubble
utilization, the simulated figure on logged steps, and the K-FAC fields (see the README's
``metrics.jsonl`` list)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.kfac import Assignment
from pipefisher.simulate import CostModel, compute_cost_fields, mean_ns, simulate, worker_step_costs
from pipefisher.timeline import COMPUTE_KINDS, Event, bubble_utilization, busy_ns, is_wait

KFAC_KINDS = frozenset(k.value for k in ActionKind if k.is_kfac)


def step_utilization(events: list[Event], num_workers: int, kinds: frozenset[str] = COMPUTE_KINDS) -> float:
    """Σ busy / (workers × wall), wall = the longest worker's step (robust to clock offsets)."""
    busy = busy_ns(events, kinds)
    spans: dict[int, tuple[int, int]] = {}
    for e in events:
        lo, hi = spans.get(e.worker, (e.start_ns, e.end_ns))
        spans[e.worker] = (min(lo, e.start_ns), max(hi, e.end_ns))
    wall = max(hi - lo for lo, hi in spans.values())
    return sum(busy.values()) / (num_workers * wall) if wall > 0 else 0.0


def measured_costs(events: list[Event], schedule: Schedule, kfac_layers: Sequence[int] = ()) -> CostModel:
    """Mean F, B (and split I, W) time per stage, each worker's STEP and each stage's STEP (per-stage
    optimizer steps), in this step's timeline → a cost model for the simulator.

    With ``kfac_layers`` (K-FAC layers per stage) the K-FAC units the step ran are costed too, as
    measured (a unit run for all of a stage's layers at once is split evenly over them; what the
    step did not run costs 0, and the step's schedule does not hold it either).
    """
    sums: dict[tuple[str, int], list[int]] = {}
    kfac: dict[tuple[str, int, int | None], list[int]] = {}
    steps: dict[int, list[int]] = {}
    stage_steps: dict[int, list[int]] = {}
    for e in events:
        if e.kind == "STEP" and e.name != "STEP":  # a stage STEP (per-stage optimizer steps)
            stage_steps.setdefault(Action.from_str(e.name).stage, []).append(e.duration_ns)
        elif e.kind == "STEP":  # a wait of STEP has a collective's kind
            steps.setdefault(e.worker, []).append(e.duration_ns)
        elif e.kind in ("F", "B", "I", "W"):
            stage = int(e.name.split(e.kind, 1)[0])
            sums.setdefault((e.kind, stage), []).append(e.duration_ns)
        elif kfac_layers and e.kind in KFAC_KINDS and not is_wait(e):  # a wait costs no unit
            a = Action.from_str(e.name)
            kfac.setdefault((e.kind, a.stage, a.layer), []).append(e.duration_ns)
    mean = {k: mean_ns(v) for k, v in sums.items()}
    d = schedule.num_stages
    compute = compute_cost_fields(mean, d)
    # each worker's STEP ([Note: simulated semantics]); none under tp, where process ranks are not workers
    compute["worker_step_ns"] = worker_step_costs(steps, schedule.num_workers)
    compute["stage_step_ns"] = [mean_ns(stage_steps[s]) if s in stage_steps else 0 for s in range(d)]
    if not kfac_layers:
        return CostModel(**compute)

    def table(kind: ActionKind) -> list[list[int]]:
        rows = []
        for s in range(d):
            whole = kfac.get((kind.value, s, None))
            rows.append([mean_ns(v) if (v := kfac.get((kind.value, s, layer)))
                         else (round(sum(whole) / len(whole) / kfac_layers[s]) if whole else 0)
                         for layer in range(kfac_layers[s])])
        return rows

    precond = [kfac.get((ActionKind.PRECOND.value, s, None), []) for s in range(d)]
    return CostModel(
        **compute,
        curv_a_ns=table(ActionKind.CURV_A), curv_b_ns=table(ActionKind.CURV_B),
        sync_factor_ns=table(ActionKind.SYNC_FACTOR), invert_ns=table(ActionKind.INVERT),
        precond_ns=[mean_ns(v) if v else 0 for v in precond],
    )


def kfac_plan_label(assignment: Assignment) -> str:
    """What runs K-FAC's work, for ``metrics.jsonl``'s ``kfac_plan``: ``pipefisher``,
    ``critical-path fallback: <reason>``, or ``critical path`` (``optimizer=kfac``)."""
    meta = assignment.metadata
    if meta.get("fallback"):
        return f"critical-path fallback: {meta.get('fallback_reason', 'predicted faster than the plan')}"
    return "pipefisher" if meta.get("planner") == "pipefisher" else "critical path"


def timeline_fields(events: list[Event], schedule: Schedule, num_workers: int, step: int, *, simulated: bool,
                    assignment: Assignment | None = None, curvature_age: int | None = None) -> dict[str, Any]:
    """The step's row fields read from its gathered timeline (every worker's events).

    ``bubble_utilization`` always; ``simulated_bubble_utilization`` when ``simulated`` (the
    simulation costs 17–130 ms at D=8, so the loop asks for it on logged steps only); with K-FAC
    (``assignment``) the plan, the curvature age, the phase, the units run, their time and the
    utilization without them.
    """
    row: dict[str, Any] = {"bubble_utilization": step_utilization(events, num_workers)}
    if simulated:
        if assignment is None:
            timeline = simulate(schedule, measured_costs(events, schedule))
        else:  # this step's phase of the K-FAC plan, K-FAC units at their measured cost
            phase = assignment.phases[step % assignment.interval]
            timeline = simulate(phase, measured_costs(events, schedule, assignment.kfac_layers))
        # The schedule's workers (under tp each is tp processes that run alike): runtime.tensor_parallel.
        row["simulated_bubble_utilization"] = bubble_utilization(timeline, schedule.num_workers)
    if assignment is not None:
        kfac_events = [e for e in events if e.kind in KFAC_KINDS and not is_wait(e)]
        row.update(
            kfac_plan=kfac_plan_label(assignment),
            curvature_age=curvature_age,
            refresh_interval=assignment.interval,
            kfac_phase=step % assignment.interval,
            kfac_work={kind: sum(e.kind == kind for e in kfac_events) for kind in sorted(KFAC_KINDS)},
            kfac_time_s=sum(e.duration_ns for e in kfac_events) / 1e9,
            bubble_utilization_without_kfac=step_utilization(events, num_workers, COMPUTE_KINDS - KFAC_KINDS),
        )
    return row
