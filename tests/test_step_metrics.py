"""The per-step simulated utilization in metrics.jsonl is simulated from the step's own measured
costs, K-FAC units included (pipefisher.runtime.step_metrics.measured_costs)."""

from __future__ import annotations

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
