"""What K-FAC does is visible and bounded (issue 13): curvature age within 2k−1 (or
``optimizer.max_staleness``), a critical-path fallback reported in metrics.jsonl, K-FAC acting
from its first refresh on, curvature from part of the batch, the planner's lower bound k_min, the
global-norm clip taken before preconditioning and the momentum rule for K-FAC layers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipefisher.optim import NVLAMB, param_groups
from pipefisher.planning.assign import (
    _no_slower_than_critical_path,
    _step_ns,
    plan_interval,
    plan_pipefisher,
    work_and_bubbles,
)
from pipefisher.planning.costs import estimate_run_costs
from pipefisher.runtime.build import kfac_assignment
from pipefisher.runtime.worker import CPU_HARDWARE, encoder_layers_per_stage, run_shape, schedule_for
from pipefisher.schedules import ActionKind as K
from pipefisher.schedules import build_schedule
from pipefisher.schedules.checks import ScheduleError
from pipefisher.schedules.kfac import (
    assignment_from_dict,
    assignment_to_dict,
    assignment_to_json,
    check_assignment,
    critical_path_assignment,
    curvature_age_bound,
    kfac_layer_counts,
)
from pipefisher.optim.factory import is_kfac_parameter
from tests.conftest import compose_train
from tests.dist_harness import start_workers
from tests.dist_harness import train_jobs

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
         "data.max_predictions=3", "lr=0.01", "optimizer.damping=0.01"]


def _metrics(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _run_all(tmp: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, list[dict]]:
    """Each run's metrics.jsonl, by name: the runs go through ``train_worker`` (what each launched
    worker runs) in one start of two processes that walks them all, as ``test_checkpoint``'s."""
    jobs = []
    for name, overrides in runs.items():
        cfg = compose_train(SMALL + ["pipeline=1f1b", "stages=2", "num_micro_batches=2", *overrides])
        jobs.append(([cfg, cfg], str(tmp / name), False, None))
    (tmp / "pg").mkdir()
    start_workers(train_jobs, (jobs, str(tmp / "pg")), 2)
    return {name: _metrics(tmp / name) for name in runs}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("kfac_pays")
    cfg = compose_train(SMALL + ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "optimizer=pipefisher"])
    schedule = schedule_for(cfg)
    layers = kfac_layer_counts(schedule, encoder_layers_per_stage(cfg, schedule.num_stages))
    # A plan that refreshes stage s in phase s is slower than all of it after the flush of phase 0
    # (the exposures overlap there): the planner's fallback replaces it.
    cost = estimate_run_costs(run_shape(cfg), CPU_HARDWARE)
    cp = critical_path_assignment(schedule, layers, 2, deferred=True)
    phases = [replace(cp.phases[0], actions={w: tuple(x for x in acts if not x.kind.is_kfac or x.kind == K.PRECOND
                                                      or x.stage == p)
                                             for w, acts in cp.phases[0].actions.items()}) for p in range(2)]
    fallback = _no_slower_than_critical_path(replace(cp, phases=tuple(phases), metadata={"planner": "pipefisher"}),
                                             schedule, cost)
    assert fallback.metadata.get("fallback") == "critical_path"
    plan = assignment_to_json(fallback, tmp / "fallback.json")
    steps = "steps=6"
    return _run_all(tmp, {
        "nvlamb": (steps,),
        # at_cycle_end (optimizer=pipefisher's default is when_ready, the "ready" runs): inverses from the next cycle
        "pipefisher": (steps, "optimizer=pipefisher", "optimizer.max_interval=3",
                       "optimizer.promote_inverses=at_cycle_end"),
        "bounded": (steps, "optimizer=pipefisher", "optimizer.max_staleness=1",
                    "optimizer.promote_inverses=at_cycle_end"),
        "kfac3": (steps, "optimizer=kfac", "optimizer.curvature_interval=3", "optimizer.inverse_interval=3"),
        "fallback": (steps, "optimizer=pipefisher", f"optimizer.schedule={plan}",
                     "optimizer.promote_inverses=at_cycle_end"),
        # issue 28: deferred inverses in use from the step after their INVERT; factors every step, inverses every 3
        "ready": (steps, "optimizer=pipefisher", "optimizer.max_interval=3", "optimizer.promote_inverses=when_ready"),
        "ready_bounded": (steps, "optimizer=pipefisher", "optimizer.max_staleness=2",
                          "optimizer.promote_inverses=when_ready"),
        "kfac_f1_i3": (steps, "optimizer=kfac", "optimizer.curvature_interval=1", "optimizer.inverse_interval=3"),
    })


def _plan(*overrides: str):
    """The assignment the runs of ``runs`` with ``overrides`` execute (the planner is deterministic)."""
    cfg = compose_train(SMALL + ["pipeline=1f1b", "stages=2", "num_micro_batches=2", *overrides])
    return kfac_assignment(cfg, schedule_for(cfg))


@pytest.mark.slow
def test_curvature_age_stays_within_2k_minus_1_and_within_max_staleness(runs) -> None:
    for name in ("pipefisher", "bounded", "fallback"):
        k = runs[name][0]["refresh_interval"]
        ages = [m["curvature_age"] for m in runs[name]]
        assert all(a is None or 0 <= a <= 2 * k - 1 for a in ages), (name, k, ages)
        assert any(a is not None for a in ages), name
    assert runs["bounded"][0]["refresh_interval"] == 1
    assert all(m["curvature_age"] is None or m["curvature_age"] <= 1 for m in runs["bounded"])
    # Critical-path K-FAC uses a refresh at once: at most k − 1 = 2 steps old, 0 at refresh steps.
    ages = [m["curvature_age"] for m in runs["kfac3"]]
    assert ages == [0, 1, 2, 0, 1, 2]


@pytest.mark.slow
def test_curvature_age_reaches_the_plans_bound_under_each_promotion_rule(runs) -> None:
    """metrics.jsonl's curvature_age against curvature_age_bound: at most 2k − 1 − p_c with
    inverses from the next cycle, k + p_i − p_c from the step after their INVERT, reached within
    six steps (k <= 3); max_staleness bounds the latter's plan by that formula, not by 2k − 1."""
    for name, promote in (("pipefisher", "at_cycle_end"), ("ready", "when_ready")):
        plan = _plan("optimizer=pipefisher", "optimizer.max_interval=3", f"optimizer.promote_inverses={promote}")
        bound = curvature_age_bound(plan, promote)
        ages = [m["curvature_age"] for m in runs[name] if m["curvature_age"] is not None]
        assert runs[name][0]["refresh_interval"] == plan.interval <= 3
        assert max(ages) == bound, (name, ages, bound)
        assert plan.interval <= bound <= 2 * plan.interval - 1
        assert curvature_age_bound(plan, "when_ready") <= curvature_age_bound(plan, "at_cycle_end")
    assert all(m["curvature_age"] is None or m["curvature_age"] <= 2 for m in runs["ready_bounded"])
    # Factors every step, inverses every 3 steps, used at once: the age counts from the inversion's capture.
    assert [m["curvature_age"] for m in runs["kfac_f1_i3"]] == [0, 1, 2, 0, 1, 2]
    assert runs["kfac_f1_i3"][0]["refresh_interval"] == 3
    assert [m["kfac_work"]["CURV_A"] > 0 for m in runs["kfac_f1_i3"]] == [True] * 6
    assert [m["kfac_work"]["INVERT"] > 0 for m in runs["kfac_f1_i3"]] == [True, False, False] * 2


@pytest.mark.slow
def test_kfac_plan_names_pipefisher_or_the_fallback_and_its_reason(runs) -> None:
    assert {m["kfac_plan"] for m in runs["pipefisher"]} == {"pipefisher"}
    plans = {m["kfac_plan"] for m in runs["fallback"]}
    assert len(plans) == 1
    (plan,) = plans
    assert plan.startswith("critical-path fallback: ") and "predicted slower" in plan
    assert "kfac_plan" not in runs["nvlamb"][0]


@pytest.mark.slow
def test_kfac_changes_the_parameters_from_its_first_refresh_on(runs) -> None:
    """NVLAMB and PipeFisher share weights and data: they agree until the first inverses exist,
    and differ from the step after the first refresh (the first inverses are used at once)."""
    nv, pf = [m["loss"] for m in runs["nvlamb"]], [m["loss"] for m in runs["pipefisher"]]
    first_used = next(i for i, m in enumerate(runs["pipefisher"]) if m["curvature_age"] is not None)
    k = runs["pipefisher"][0]["refresh_interval"]
    assert first_used <= k, "the first refresh's inverses are used within its cycle"
    assert pf[:first_used + 1] == pytest.approx(nv[:first_used + 1], rel=1e-6)
    assert pf[first_used + 1] != pytest.approx(nv[first_used + 1], rel=1e-6)


def test_curvature_from_the_first_micro_batches_of_each_pipe() -> None:
    s = build_schedule("chimera", 2, 4)
    a = critical_path_assignment(s, [6, 6], 1, curvature_micro_batches=1)
    curv = {(x.pipe, x.micro_batch) for acts in a.phases[0].actions.values() for x in acts
            if x.kind in (K.CURV_A, K.CURV_B)}
    first = {p: s.pipe_of_micro_batch.index(p) for p in (0, 1)}  # the first micro-batch each pipe carries
    assert curv == {(0, first[0]), (1, first[1])}
    assert assignment_from_dict(assignment_to_dict(a)).curvature_micro_batches == 1
    with pytest.raises(ScheduleError, match="outside the refresh's micro-batches"):
        check_assignment(replace(critical_path_assignment(s, [6, 6], 1), curvature_micro_batches=1))
    with pytest.raises(ScheduleError, match="never gets"):
        check_assignment(replace(a, curvature_micro_batches=0))


def test_planner_reports_k_min_and_respects_max_staleness() -> None:
    cfg = compose_train(["model=bert-mini", "pipeline=1f1b", "stages=2", "num_micro_batches=4",
                         "micro_batch_size=8", "data.seq_len=128", "data.max_predictions=20",
                         "optimizer=pipefisher"])
    s = schedule_for(cfg)
    layers = kfac_layer_counts(s, encoder_layers_per_stage(cfg, s.num_stages))
    cost = estimate_run_costs(run_shape(cfg), CPU_HARDWARE)
    full = work_and_bubbles(s, cost, layers)
    part = work_and_bubbles(s, cost, layers, curvature_micro_batches=1)
    assert part["bubble_ns"] == full["bubble_ns"] > 0
    assert part["kfac_work_ns"] < full["kfac_work_ns"] and part["k_min"] <= full["k_min"]
    assert full["k_min"] == -(-full["kfac_work_ns"] // full["bubble_ns"])
    a = plan_pipefisher(s, cost, layers, curvature_micro_batches=1)
    assert a.interval >= a.metadata["k_min"] and a.metadata["choice"].startswith(f"k={a.interval}")
    bounded = plan_pipefisher(s, cost, layers, max_staleness=3)
    assert 2 * bounded.interval - 1 <= 3 and bounded.metadata["max_staleness"] == 3
    # optimizer=pipefisher's defaults (inverses when ready, age <= 8) keep this plan's curvature within 8 steps,
    # where the old ones (from the next cycle, no bound) let it reach 2k - 1
    o = cfg.optimizer
    assert (o.promote_inverses, o.max_staleness) == ("when_ready", 8)
    assert curvature_age_bound(kfac_assignment(cfg, s), "when_ready") <= 8
    assert curvature_age_bound(plan_pipefisher(s, cost, layers), "at_cycle_end") > 8


def test_when_ready_plans_invert_in_the_curvatures_phase_to_meet_the_bound() -> None:
    """[Note: inverting in the curvature's phase], bert-mini D=2 1F1B N=8 (no k <= 8 hides its refresh):
    the plain plan at k=7 inverts some layers phases after their curvature (age 9 > 8 under when_ready,
    13 under at_cycle_end); keeping room for each INVERT in its curvature's phase gives age k = 7
    at a predicted step within 2 % of the plain plan's; a lag of at most 1 gives age <= 8, which
    optimizer=pipefisher's defaults take."""
    from pipefisher.schedules.kfac import _curvature_and_inverse_phases

    cfg = compose_train(["model=bert-mini", "pipeline=1f1b", "stages=2", "num_micro_batches=8", "micro_batch_size=4",
                         "data.seq_len=128", "optimizer=pipefisher"])
    s = schedule_for(cfg)
    layers = kfac_layer_counts(s, encoder_layers_per_stage(cfg, s.num_stages))
    cost = estimate_run_costs(run_shape(cfg), CPU_HARDWARE)
    plain, _ = plan_interval(s, cost, layers, 7)
    kept, _ = plan_interval(s, cost, layers, 7, max_invert_lag=0)
    lag1, _ = plan_interval(s, cost, layers, 7, max_invert_lag=1)
    assert curvature_age_bound(plain, "when_ready") > 8
    assert any(p_c < p_i for p_c, p_i in _curvature_and_inverse_phases(plain))
    assert all(p_c == p_i for p_c, p_i in _curvature_and_inverse_phases(kept))
    assert curvature_age_bound(kept, "when_ready") == 7
    assert all(p_i - p_c <= 1 for p_c, p_i in _curvature_and_inverse_phases(lag1))
    assert curvature_age_bound(lag1, "when_ready") <= 8
    assert _step_ns(kept, cost) <= 1.02 * _step_ns(plain, cost)
    default = kfac_assignment(cfg, s)  # max_staleness 8 at k=7: a lag of 1 allowed
    assert default.metadata.get("max_invert_lag") == 1 and default.interval == 7
    assert curvature_age_bound(default, "when_ready") <= 8
    assert _step_ns(default, cost) <= 1.02 * _step_ns(plain, cost)
    # at_cycle_end gains nothing from it (its age is 2k - 1 - p_c): the planner does not try it there
    assert "max_invert_lag" not in plan_pipefisher(s, cost, layers, max_staleness=13).metadata
    with pytest.raises(ValueError, match="max_invert_lag"):
        plan_interval(s, cost, layers, 7, max_invert_lag=-1)
    with pytest.raises(ValueError, match="max_staleness"):
        plan_pipefisher(s, cost, layers, max_staleness=0)


def test_config_checks_the_new_kfac_options() -> None:
    from pipefisher.config import ConfigError

    base = SMALL + ["optimizer=pipefisher", "pipeline=chimera", "stages=2", "num_micro_batches=4"]
    with pytest.raises(ConfigError, match="optimizer.curvature_micro_batches"):
        compose_train(base + ["optimizer.curvature_micro_batches=3"])  # each chimera pipe has 2
    with pytest.raises(ConfigError, match="optimizer.max_staleness"):
        compose_train(base + ["optimizer.max_staleness=0"])
    with pytest.raises(ConfigError, match="optimizer.kfac_update"):
        compose_train(base + ["optimizer.kfac_update=adam"])


def test_momentum_rule_matches_a_hand_computed_update() -> None:
    """[Note: the momentum rule]: per-tensor clip, m = β1 m + (1−β1) g, w -= lr (m + wd w); the
    NVLAMB groups beside it are clipped by the global norm of their own gradients only."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64))
    other = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    named = [("encoder.layer.0.intermediate.dense.weight", w), ("embeddings.LayerNorm.weight", other)]
    assert is_kfac_parameter(named[0][0]) and not is_kfac_parameter(named[1][0])
    groups = param_groups(named, 0.01, is_kfac_parameter, {"lr": 0.5, "max_grad_norm": 1.0})
    opt = NVLAMB(groups, lr=0.1, weight_decay=0.01, max_grad_norm=1.0, betas=(0.9, 0.999))
    w0, other0 = w.detach().clone(), other.detach().clone()
    g = torch.randn(3, 4, dtype=torch.float64) * 10
    w.grad, other.grad = g.clone(), torch.randn(5, dtype=torch.float64)
    ref = NVLAMB([{"params": [other_ref := torch.nn.Parameter(other0.clone())], "weight_decay": 0.0}], lr=0.1,
                 max_grad_norm=1.0)
    other_ref.grad = other.grad.clone()
    opt.step()
    ref.step()
    clipped = g * min(1.0, 1.0 / g.norm().item())
    m = 0.1 * clipped
    torch.testing.assert_close(w.detach(), w0 - 0.5 * (m + 0.01 * w0))
    torch.testing.assert_close(other.detach(), other_ref.detach())  # the K-FAC gradient's norm is not in its clip
    assert set(opt.state[w]) == {"step", "exp_avg"}  # no second moment


def test_clip_before_preconditioning_uses_the_raw_gradient_norm() -> None:
    """Single-process K-FAC hands the base optimizer the norm of the gradient as it was before
    preconditioning (``clip_before_precondition``, the default), or leaves it to the base
    optimizer, which then takes the preconditioned gradient's norm."""
    from pipefisher.optim import KFAC

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.randn(8, 6)
    for before in (True, False):
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        net.load_state_dict(model.state_dict())
        kfac = KFAC(net, lr=0.1, include=None, damping=0.1, clip_before_precondition=before)
        seen = []
        base_step = kfac.optimizer.step
        kfac.optimizer.step = lambda grad_norm=None: (seen.append(grad_norm), base_step(grad_norm=grad_norm))
        kfac.on_step_start(0)
        with kfac.micro_batch(0):
            net(x).pow(2).mean().backward()
        raw = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])).item()
        kfac.refresh_and_precondition(0)  # the first refresh: inverses in use at once
        kfac.on_step_start(1)
        with kfac.micro_batch(0):
            net.zero_grad()
            net(x).pow(2).mean().backward()
        raw = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()])).item()
        kfac.step(1)
        if before:
            assert float(seen[0]) == pytest.approx(raw, rel=1e-6)
        else:
            assert seen == [None]
