"""Where each stage's optimizer step goes, by simulation (``schedules.passes.per_stage_steps``), and the costs of a
per-stage run read back as the global step's (:func:`global_step_costs`).

The pass alone puts a replica's STEP after the worker's last compute ([Note: per-stage optimizer
steps]); with measured or estimated costs a step can go earlier, into a bubble that follows its
replica's last backward. :func:`place_stage_steps` tries, replica by replica, every position from
right after the replica's last action to the default one and keeps the one the simulator finishes
soonest over two steps (ties keep the later position, so it is never worse than the default
under the model).
"""

from __future__ import annotations

from dataclasses import replace

from pipefisher.schedules.ir import ActionKind, Schedule
from pipefisher.schedules.passes import per_stage_steps, stage_step_bounds
from pipefisher.simulate import CostModel, simulate

__all__ = ["global_step_costs", "place_stage_steps"]


def place_stage_steps(schedule: Schedule, cost: CostModel) -> Schedule:
    """``per_stage_steps(schedule)`` with each stage STEP moved to where ``cost`` says the step ends soonest.

    Args:
        schedule: a complete schedule (``build_schedule`` output, or a phase of a K-FAC assignment).
        cost: per-action costs with ``stage_step_ns`` (and the final STEP's ``step_ns`` /
            ``worker_step_ns``: what the worker does after its stage steps).

    Returns:
        The placed schedule; its simulated step time is at most the default placement's.
    """
    rests, firsts, slots = stage_step_bounds(schedule)
    best = {w: dict(mine) for w, mine in slots.items()}

    def finish(positions: dict[int, dict[tuple[int, int], int]]) -> int:
        return max(e.end_ns for e in simulate(per_stage_steps(schedule, positions), cost, steps=2))

    best_time = finish(best)
    for w in sorted(rests):
        for r in sorted(best[w], key=lambda r: firsts[w][r]):
            for i in range(firsts[w][r], slots[w][r]):
                trial = {**best, w: {**best[w], r: i}}
                t = finish(trial)
                if t < best_time:
                    best_time, best = t, trial
    return per_stage_steps(schedule, best)


def global_step_costs(cost: CostModel, schedule: Schedule) -> CostModel:
    """``cost`` with each worker's stage STEPs priced in its final STEP: what a run profiled with
    ``optimizer_placement=per_stage`` costs as the global step ``schedule`` (without stage STEPs) takes it.

    The simulator charges ``stage_step_ns`` only to stage STEP actions, so a schedule without them, priced from a
    per-stage profile, would drop that optimizer work: each worker's ``worker_step_ns`` (or ``step_ns`` for all)
    gains the stage STEPs ``per_stage_steps(schedule)`` gives it, one per stage replica it holds.

    Args:
        cost: costs with ``stage_step_ns`` (``planning.costs.costs_from_profile`` of a per-stage run).
        schedule: the global-step schedule to price (``RunShape.build_schedule`` output, or a K-FAC phase).
    """
    if not any(cost.stage_step_ns):
        return cost
    per_stage = per_stage_steps(schedule)
    final = cost.worker_step_ns or (cost.step_ns,) * schedule.num_workers
    extra = [sum(cost.stage_step_ns[a.stage] for a in per_stage.actions[w]
                 if a.kind == ActionKind.STEP and a.stage is not None) for w in range(schedule.num_workers)]
    return replace(cost, worker_step_ns=tuple(f + x for f, x in zip(final, extra)), stage_step_ns=())
