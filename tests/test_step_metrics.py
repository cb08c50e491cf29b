"""The per-step simulated utilization in metrics.jsonl is simulated from the step's own measured
costs, K-FAC units included (pipefisher.runtime.step_metrics.measured_costs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.runtime.step_metrics import measured_costs as _measured_costs
from pipefisher.schedules import build_schedule
from pipefisher.schedules.kfac import critical_path_assignment
from pipefisher.simulate import CostModel, simulate
from pipefisher.timeline import bubble_utilization


@pytest.mark.parametrize("method", ["gpipe", "1f1b", "chimera"])
def test_costs_read_back_from_a_step_timeline_include_its_kfac_units(method: str) -> None:
    base = build_schedule(method, 2, 4)
    phase = critical_path_assignment(base, [2, 2], 1).phases[0]
    cost = CostModel(forward_ns=[1000, 1200], backward_ns=[2000, 2500], curv_a_ns=[[300, 310], [320, 330]],
                     curv_b_ns=[[400, 410], [420, 430]], sync_factor_ns=[[50, 60], [70, 80]],
                     invert_ns=[[900, 910], [920, 930]], precond_ns=[150, 160])
    events = simulate(phase, cost)  # a stand-in for the executor's measured timeline
    measured = _measured_costs(events, base, [2, 2])
    for name in ("forward_ns", "backward_ns", "curv_a_ns", "curv_b_ns", "invert_ns", "precond_ns"):
        assert getattr(measured, name) == getattr(cost, name), name
    with_kfac = bubble_utilization(simulate(phase, measured), 2)
    assert with_kfac == pytest.approx(bubble_utilization(events, 2))
    # Without the K-FAC units (the metric before) the step simulates as a different one.
    assert bubble_utilization(simulate(base, _measured_costs(events, base)), 2) != pytest.approx(with_kfac)


def test_each_workers_step_is_simulated_at_its_own_measured_cost() -> None:
    """A V schedule's worker 0 holds the embeddings and the heads: its STEP costs more than worker
    1's. The cost model read from a timeline keeps each worker's STEP, and the simulated step ends
    at the slower worker's STEP, as the run does."""
    schedule = build_schedule("zb-v", 2, 4)
    truth = CostModel.uniform(4, 1_000, 2_000, step_ns=0)
    truth = replace(truth, worker_step_ns=(9_000, 1_000))
    timeline = simulate(schedule, truth)
    cost = _measured_costs(timeline, schedule)
    assert cost.worker_step_ns == (9_000, 1_000)
    span = max(e.end_ns for e in simulate(schedule, cost)) - min(e.start_ns for e in simulate(schedule, cost))
    flat = replace(cost, worker_step_ns=(), step_ns=5_000)  # the mean over workers: shorter
    flat_span = max(e.end_ns for e in simulate(schedule, flat))
    assert span == max(e.end_ns for e in timeline) - min(e.start_ns for e in timeline)
    assert span > flat_span
