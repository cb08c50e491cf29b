"""``bench/v_gap.py``'s readers of a timeline, checked on simulated timelines whose answers are known:
the replay of a simulated step at its own durations is that step, the message latency is the
simulator's, and the per-worker split adds up to the worker's span."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.schedules import build_schedule
from pipefisher.simulate import CostModel, simulate
from tests.test_convergence_bench import _load


@pytest.fixture(scope="module")
def vg():
    return _load("v_gap")


@pytest.mark.parametrize("method", ["1f1b", "zb-h1", "zb-v", "dualpipev", "v-min"])
def test_replay_of_a_simulated_step_is_that_step(vg, method: str) -> None:
    schedule = build_schedule(method, 2, 4)
    cost = replace(CostModel.uniform(4 if method in ("zb-v", "dualpipev", "v-min") else 2, 1_000, 2_100,
                                     p2p_ns=150, input_grad_ns=1_200, weight_grad_ns=900),
                   worker_step_ns=(700, 300))
    events = simulate(schedule, cost)
    span = max(e.end_ns for e in events) - min(e.start_ns for e in events)
    assert vg.message_latency(events) == 150
    assert vg.replay(schedule, events, 150) == span
    for w, parts in vg.breakdown(events).items():
        mine = sorted((e for e in events if e.worker == w), key=lambda e: (e.start_ns, e.end_ns))
        step = next(e for e in mine if e.kind == "STEP")
        before = max(e.end_ns for e in mine if e is not step and e.start_ns <= step.start_ns)
        # The simulator records no event for STEP's wait at the barrier: that is the untracked time.
        assert parts["untracked"] == step.start_ns - before
        assert parts["compute"] + parts["recv wait"] + parts["step"] + parts["untracked"] == parts["span"]
