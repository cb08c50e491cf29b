"""``bench/optimizer_placement.py --simulate-only``: the simulated global and per-stage steps of every optimizer.

The K-FAC arms (kfac, ekfac, pipefisher) simulate the plan train.py runs (``runtime.build.kfac_assignment``, its
phases made per-stage as ``PipelineWorker`` makes them); the element-wise arms one schedule. The steady step is
the mean over the third of three refresh cycles; for one schedule that is the third step less the second, the
figure the table printed before the K-FAC arms (its NVLAMB rows must not change).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.runtime.build import kfac_assignment
from pipefisher.schedules.kfac import check_assignment
from pipefisher.schedules.passes import per_stage_steps
from pipefisher.simulate import simulate
from tests.conftest import load_bench

op = load_bench("optimizer_placement")


def test_one_schedule_steady_step_is_the_third_step_less_the_second() -> None:
    phases, glob, per, exchanges = op._costs("bert-tiny", "1f1b", 2, 4, "nvlamb")
    assert len(phases) == 1 and not exchanges
    events = simulate(phases[0], glob, steps=3)
    ends = [max(e.end_ns for e in events if e.step == k) for k in range(3)]
    assert op._steady(phases, glob) == ends[2] - ends[1]
    assert glob.stage_step_ns == (0, 0) and sum(per.stage_step_ns) > 0  # global: all at the worker's STEP


@pytest.mark.parametrize("arm", ["kfac", "ekfac", "pipefisher", "pipefisher:kfac_owners=replicas"])
def test_kfac_arms_simulate_the_plan_train_py_runs(arm: str) -> None:
    phases, glob, per, exchanges = op._costs("bert-tiny", "chimera", 2, 4, arm)
    cfg = op.h.compose(["model=bert-tiny", "pipeline=chimera", "stages=2", "num_micro_batches=4",
                        "micro_batch_size=2", "data.seq_len=128", *op._arm_overrides(arm)])
    run = op.run_shape(cfg)
    assert phases == kfac_assignment(cfg, run.build_schedule()).phases
    assert exchanges == arm.endswith("replicas")
    assert any(a.kind.value == "PRECOND" for p in phases for acts in p.actions.values() for a in acts)
    # per_stage's phases are the ones the worker checks before it runs them
    per_phases = tuple(per_stage_steps(p, exchanges=exchanges) for p in phases)
    check_assignment(replace(kfac_assignment(cfg, run.build_schedule()), phases=per_phases), exchanges=exchanges)
    # K-FAC's work makes the step dearer than NVLAMB's on the same pipeline; ekfac's PRECOND dearer than kfac's
    nvlamb_phases, nvlamb_glob, _, _ = op._costs("bert-tiny", "chimera", 2, 4, "nvlamb")
    assert op._steady(phases, glob) > op._steady(nvlamb_phases, nvlamb_glob)
    if arm.endswith("replicas"):  # priced as the search prices owners: each layer's INVERT and PRECOND once
        assert glob.kfac_owner and any(glob.exchange_ns)
    if arm == "ekfac":
        kfac_glob = op._costs("bert-tiny", "chimera", 2, 4, "kfac")[1]
        assert sum(glob.precond_ns) > sum(kfac_glob.precond_ns)


def test_kfac_per_stage_moves_precond_with_the_stage_step() -> None:
    phases, glob, per, exchanges = op._costs("bert-tiny", "1f1b", 2, 4, "kfac")
    (phase,) = phases  # K-FAC on the critical path, every step: one phase
    moved = per_stage_steps(phase, exchanges=exchanges)
    for acts in moved.actions.values():
        kinds = [(a.kind.value, a.stage) for a in acts]
        assert kinds[-1] == ("STEP", None)  # the worker's final STEP stays last
        for s in {a.stage for a in acts if a.kind.value == "PRECOND"}:
            # a stage's PRECOND comes before its own stage STEP, which comes before the worker's final STEP
            pre = max(i for i, k in enumerate(kinds) if k == ("PRECOND", s))
            assert pre < kinds.index(("STEP", s)) < len(acts) - 1, kinds
