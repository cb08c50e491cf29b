"""Planning: PipeFisher's list scheduler, costs, memory, what-if, and schedule.py end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipefisher.model.config import BertConfig
from pipefisher.planning import (
    RunShape,
    compare_optimizers,
    costs_from_profile,
    estimate_costs,
    estimate_memory,
    find_bubbles,
    format_candidates,
    plan_interval,
    plan_pipefisher,
    predict_assignment,
    predict_schedule,
    what_if,
)
from pipefisher.planning.cli import plan_run, run_whatif
from pipefisher.planning.memory import _activation_bytes, estimate_memory_per_worker, heads_logits_bytes
from pipefisher.planning.whatif import METHODS
from pipefisher.planning.config import register_schedule_configs, to_schedule_config
from pipefisher.profiling import read_profile, write_profile
from pipefisher.schedules import (
    Action,
    ActionKind,
    assignment_from_json,
    build_schedule,
    check_assignment,
    critical_path_assignment,
)
from pipefisher.schedules.checks import stuck_positions
from pipefisher.schedules.kfac import with_preconditioning
from pipefisher.simulate import CostModel, peak_activations, simulate, simulate_phases
from tests.conftest import CONF_DIR, PIPELINE_GRID, PIPELINE_GRID_IDS, REPO

K = ActionKind


def _cost(s, layers: int = 2, *, sync_ns: int = 30, unit: int = 5, precond_ns: int = 3) -> CostModel:
    return CostModel.uniform(s.num_stages, 100, 100, p2p_ns=5, sync_ns=sync_ns, kfac_layers=layers,
                             curv_a_ns=unit, curv_b_ns=unit, sync_factor_ns=2 * unit, invert_ns=2 * unit,
                             precond_ns=precond_ns)


# -- the list scheduler ------------------------------------------------------------------------


@pytest.mark.parametrize("method, d, n, w", PIPELINE_GRID, ids=PIPELINE_GRID_IDS)
def test_pipefisher_plan_passes_the_checks_and_beats_the_critical_path(method, d, n, w):
    s = build_schedule(method, d, n, w)
    cost = _cost(s)
    a = plan_pipefisher(s, cost, [2] * s.num_stages)
    check_assignment(a)
    assert a.deferred and 1 <= a.interval <= 8 and a.schedule.actions == s.actions
    pf, _ = predict_assignment(a, cost)
    nvlamb, _ = predict_schedule(s, cost)
    for k in sorted({1, a.interval}):
        kfac, _ = predict_assignment(critical_path_assignment(s, [2] * s.num_stages, k), cost, "kfac")
        assert pf.step_time_s <= kfac.step_time_s
    assert pf.utilization > nvlamb.utilization


@pytest.mark.parametrize("method, d, n, w", [("chimera", 4, 4, 1), ("chimera", 4, 8, 2), ("1f1b", 4, 8, 2),
                                             ("gpipe", 2, 4, 2), ("interleaved", 2, 4, 1)])
def test_small_kfac_work_is_fully_hidden_with_k_1(method, d, n, w):
    # Equal F and B, small K-FAC units, a gradient all-reduce to wait for: every unit fits a bubble
    # (the curvature of the last backward fits the all-reduce wait), so a refresh every step costs
    # nothing but PRECOND, which every K-FAC step does after the all-reduce.
    s = build_schedule(method, d, n, w)
    for precond_ns in (0, 2):
        cost = CostModel.uniform(s.num_stages, 100, 100, sync_ns=60, kfac_layers=2, curv_a_ns=1, curv_b_ns=1,
                                 sync_factor_ns=2, invert_ns=2, precond_ns=precond_ns)
        a = plan_pipefisher(s, cost, [2] * s.num_stages)
        assert a.interval == 1 and a.metadata["spilled_ns"] == a.metadata["tail_ns"] == 0
        pf, events = predict_assignment(a, cost)
        plain, _ = predict_schedule(with_preconditioning(s), cost)
        assert pf.step_time_s == plain.step_time_s
        if precond_ns == 0:
            assert pf.step_time_s == predict_schedule(s, cost)[0].step_time_s
        # The pipeline's own actions run exactly when they did without K-FAC work.
        own = {(e.worker, e.name): (e.start_ns, e.end_ns) for e in simulate(with_preconditioning(s), cost)
               if e.kind in ("F", "B")}
        assert {(e.worker, e.name): (e.start_ns, e.end_ns) for e in events if e.kind in ("F", "B")} == own


def test_larger_work_takes_a_longer_interval_and_stays_off_the_pipeline():
    s = build_schedule("chimera", 4, 8)
    cost = _cost(s, layers=6, unit=8)
    a, stats = plan_interval(s, cost, [6] * 4, 1)
    assert stats.spilled_ns > 0  # one step's bubbles do not hold a refresh ...
    b = plan_pipefisher(s, cost, [6] * 4)
    assert b.interval > 1 and b.metadata["spilled_ns"] == 0  # ... a few steps' bubbles do
    # Curvature of a layer is refreshed in one phase; the whole cycle refreshes every layer once.
    phases_of = {}
    for p, phase in enumerate(b.phases):
        for acts in phase.actions.values():
            for x in acts:
                if x.kind in (K.CURV_A, K.CURV_B):
                    phases_of.setdefault((x.stage, x.pipe, x.layer), set()).add(p)
    assert len(phases_of) == 2 * 4 * 6 and all(len(v) == 1 for v in phases_of.values())


def test_curvature_after_the_last_backward_without_a_bubble_is_reported_as_tail():
    s = build_schedule("1f1b", 2, 2)  # W=1, no all-reduce: nothing follows worker 0's last B
    cost = _cost(s, sync_ns=0, unit=1, precond_ns=0)
    a = plan_pipefisher(s, cost, [2, 2])
    assert a.metadata["tail_ns"] > 0
    check_assignment(a)


def test_up_pipe_curvature_runs_after_the_up_pipe_computes():
    s = build_schedule("chimera", 4, 4)
    a = plan_pipefisher(s, _cost(s), [2] * 4)
    for phase in a.phases:
        for w, acts in phase.actions.items():
            for i, x in enumerate(acts):
                if x.kind in (K.CURV_A, K.CURV_B):
                    dep = Action(K.FORWARD if x.kind == K.CURV_A else K.BACKWARD, x.stage, x.micro_batch, x.pipe)
                    assert acts.index(dep) < i and s.pipe_of_micro_batch[x.micro_batch] == x.pipe


@pytest.mark.parametrize("n", [2, 4])
def test_factor_syncs_of_twins_that_are_also_neighbours_do_not_deadlock(n):
    # Chimera D=2: workers 0 and 1 hold both replicas of both stages and exchange every message.
    # Some mid-step all-reduces would deadlock under blocking semantics; the planner moves those
    # to the step's tail and keeps the others in the bubbles.
    s = build_schedule("chimera", 2, n)
    cost = CostModel.uniform(2, 100, 200, p2p_ns=7, sync_ns=40, kfac_layers=3, curv_a_ns=1, curv_b_ns=3,
                             sync_factor_ns=3, invert_ns=2, precond_ns=2)
    a, stats = plan_interval(s, cost, [3, 3], 1)
    check_assignment(a)
    assert all(not stuck_positions(phase) for phase in a.phases)
    assert 0 < stats.mid_step_syncs < 6  # some syncs inside the step, some moved to the tail


# Issue 8, item 5: with N >> D the curvature outgrows the bubbles. The plan must never be predicted
# slower than the same refresh on the critical path at its k (the bert-large 1F1B D=8 N=32 plan
# was: 480.3 ms against 462.4 ms, because the last stage's curvature was exposed in phase 0 and the
# first stages' spill in phase k-1, so the two exposures added up instead of overlapping).
_BERT_SHAPES = [("base", "1f1b", 4, 16), ("base", "gpipe", 4, 16),
                ("base", "chimera", 4, 16), ("base", "gpipe", 4, 4), ("base", "1f1b", 6, 6)]


def _bert_plan(size: str, method: str, d: int, n: int):
    from pipefisher.planning import Hardware, estimate_run_costs
    from pipefisher.schedules.kfac import kfac_layer_counts

    run = RunShape(BertConfig.from_size(size), method, d, n, 32)
    s = build_schedule(method, d, n)
    cost = estimate_run_costs(run, Hardware())
    return s, cost, kfac_layer_counts(s, run.encoder_layers)


@pytest.mark.parametrize("size, method, d, n", _BERT_SHAPES,
                         ids=[f"bert-{z}-{m}-D{d}-N{n}" for z, m, d, n in _BERT_SHAPES])
def test_pipefisher_is_never_predicted_slower_than_critical_path_kfac_at_its_interval(size, method, d, n):
    s, cost, layers = _bert_plan(size, method, d, n)
    cmp = compare_optimizers(s, cost, layers)
    check_assignment(cmp.assignment)
    assert cmp.assignment.deferred and cmp.assignment.schedule.actions == s.actions
    assert cmp.pipefisher.step_time_s <= cmp.kfac_same_interval.step_time_s
    assert cmp.pipefisher.step_time_s <= cmp.kfac.step_time_s


@pytest.mark.slow
def test_exposed_work_of_one_f_one_b_with_n_4d_overlaps_in_one_phase():
    # bert-large, 1F1B, D=8, N=32 (the shape of the issue): the plan itself, not the critical-path
    # fallback, beats critical-path K-FAC at its k by more than 3 %. No k <= 8 hides all the work:
    # the planner takes the smallest k within 2 % of the fastest ([Note: choosing k]).
    s, cost, layers = _bert_plan("large", "1f1b", 8, 32)
    cmp = compare_optimizers(s, cost, layers)
    check_assignment(cmp.assignment)
    a = cmp.assignment
    assert "fallback" not in a.metadata and a.metadata["choice"].startswith(f"k={a.interval}: no k <= 8 hides")
    assert a.metadata["k_min"] <= a.interval <= 8
    assert cmp.pipefisher.step_time_s < 0.97 * cmp.kfac_same_interval.step_time_s
    assert cmp.nvlamb.step_time_s < cmp.pipefisher.step_time_s


def test_a_plan_slower_than_the_critical_path_falls_back_to_it():
    from pipefisher.planning.assign import _no_slower_than_critical_path

    # Stage s refreshes in phase s: every stage's work is exposed in a step of its own, which is
    # slower than all of it in phase 0 where the exposures overlap.
    s = build_schedule("gpipe", 4, 4)
    cost = _cost(s, layers=2, unit=40)
    cp = critical_path_assignment(s, [2] * 4, 4, deferred=True)
    phases = []
    for p in range(4):
        actions = {w: tuple(x for x in acts if not x.kind.is_kfac or x.kind == K.PRECOND or x.stage == p)
                   for w, acts in cp.phases[0].actions.items()}
        phases.append(replace(cp.phases[0], actions=actions))
    bad = replace(cp, phases=tuple(phases), metadata={"planner": "pipefisher"})
    check_assignment(bad)
    assert predict_assignment(bad, cost)[0].step_time_s > predict_assignment(cp, cost)[0].step_time_s
    out = _no_slower_than_critical_path(bad, s, cost)
    assert out.metadata["fallback"] == "critical_path" and out.deferred and out.interval == 4
    check_assignment(out)
    assert predict_assignment(out, cost)[0].step_time_s == predict_assignment(cp, cost)[0].step_time_s
    # A plan that is faster is kept as it is.
    good = plan_pipefisher(s, cost, [2] * 4)
    assert _no_slower_than_critical_path(good, s, cost) is good


def test_find_bubbles_of_one_f_one_b_add_up_to_the_closed_form():
    s = build_schedule("1f1b", 4, 8)
    bubbles = find_bubbles(s, CostModel.uniform(4, 100))
    idle = sum(b.length_ns for b in bubbles)
    total = 4 * (8 + 4 - 1) * 200  # workers × step length (N + D − 1 slots of F + B)
    assert idle / total == pytest.approx(3 / 11)
    assert all(b.start_ns <= b.end_ns for b in bubbles) and any(b.tail for b in bubbles)


def test_planner_rejects_mismatched_inputs():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="K-FAC costs for \\[2, 2\\] layers"):
        plan_pipefisher(s, _cost(s), [3, 3])
    with pytest.raises(ValueError, match="max_interval=0"):
        plan_pipefisher(s, _cost(s), [2, 2], max_interval=0)


# -- costs -------------------------------------------------------------------------------------

TINY = BertConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=2)


def test_estimate_costs_follows_the_flop_formulas():
    cost = estimate_costs(TINY, 2, 2, 32, 5, 1e12, 1e10, num_replicas=2)
    t = 2 * 32  # tokens per micro-batch
    assert cost.backward_ns == tuple(2 * f for f in cost.forward_ns) or all(
        abs(b - 2 * f) <= 1 for f, b in zip(cost.forward_ns, cost.backward_ns))
    assert cost.kfac_layers == (6, 6)
    assert cost.curv_a_ns[0][0] == round(2 * t * 128 ** 2 / 1e3)  # 2·T·in² FLOPs at 1e12 FLOP/s, in ns
    assert cost.curv_b_ns[0][4] == round(2 * t * 512 ** 2 / 1e3)  # intermediate.dense: out = 4H
    assert cost.invert_ns[0][0] == round(2 * 128 ** 3 * (2 / 3 + 1) / 1e3)
    assert cost.precond_ns[0] == round((4 * 2 * 128 * 128 * 256 + 2 * 2 * 128 * 512 * 640) / 1e3)
    assert cost.sync_factor_ns[0][0] == round(4 * 2 * 128 ** 2 / 1e10 * 1e9)  # 2(r-1)/r = 1 for r = 2
    assert cost.p2p_ns == round(2 * 32 * 128 * 4 / 1e10 * 1e9)
    single = estimate_costs(TINY, 2, 2, 32, 5, 1e12, 1e10)
    assert single.sync_ns == (0, 0) and single.sync_factor_ns[0][0] == 0  # one replica: no all-reduce


def test_ekfac_estimates_price_eigendecompositions_and_two_projections():
    kfac = estimate_costs(TINY, 2, 2, 32, 5, 1e12, 1e10)
    ekfac = estimate_costs(TINY, 2, 2, 32, 5, 1e12, 1e10, preconditioner="ekfac")
    assert ekfac.invert_ns[0][0] == round(2 * 128 ** 3 * 4.0 / 1e3)  # eigh: ~4 n³ per factor
    assert ekfac.invert_ns[0][0] / kfac.invert_ns[0][0] == pytest.approx(4.0 / (2 / 3 + 1), rel=1e-3)
    dims = [(128, 128)] * 4 + [(128, 512), (512, 128)]
    assert ekfac.precond_ns[0] == round(sum(4 * i * o * (i + o) + 10 * i * o for i, o in dims) / 1e3)
    assert (ekfac.curv_a_ns, ekfac.curv_b_ns, ekfac.forward_ns) == (kfac.curv_a_ns, kfac.curv_b_ns, kfac.forward_ns)
    with pytest.raises(ValueError, match="preconditioner='shampoo'"):
        RunShape(TINY, "1f1b", 2, 4, 2, preconditioner="shampoo")


def test_train_and_schedule_configs_carry_the_preconditioner_into_the_run_shape(make_cfg):
    from pipefisher.runtime.build import run_shape
    assert run_shape(make_cfg("optimizer=ekfac", "stages=2")).preconditioner == "ekfac"
    assert RunShape.from_train_config(asdict(make_cfg("optimizer=ekfac", "stages=2"))).preconditioner == "ekfac"
    assert run_shape(make_cfg("optimizer=kfac", "stages=2")).preconditioner == "kfac"
    with pytest.raises(Exception, match="preconditioner='shampoo'"):
        _compose(["preconditioner=shampoo"])
    assert _compose(["preconditioner=ekfac"]).preconditioner == "ekfac"


def test_a_kfac_profile_refuses_to_be_planned_as_ekfac(tmp_path: Path, make_cfg):
    from pipefisher.planning.cli import _run_from_profile
    metadata = {"config": asdict(make_cfg("optimizer=kfac", "stages=2"))}
    with pytest.raises(ValueError, match="preconditioner='ekfac' \\(the profiled run has optimizer.preconditioner='kfac'"):
        _run_from_profile(_compose(["preconditioner=ekfac"]), tmp_path / "p.sqlite", metadata, {"preconditioner"})
    ekfac_run = {"config": asdict(make_cfg("optimizer=ekfac", "stages=2"))}
    assert _run_from_profile(_compose([]), tmp_path / "p.sqlite", ekfac_run, set()).preconditioner == "ekfac"


def _profile(tmp_path: Path, make_cfg, method: str = "1f1b", *, kfac: bool = False, extra=()) -> tuple[Path, CostModel]:
    cfg = make_cfg(f"pipeline={method}", "stages=2", "num_micro_batches=4", *extra)
    s = build_schedule(method, 2, 4)
    cost = CostModel.uniform(2, 1000, 2000, p2p_ns=70, sync_ns=0, step_ns=50, kfac_layers=6,
                             curv_a_ns=11, curv_b_ns=13, sync_factor_ns=0, invert_ns=17, precond_ns=19)
    if kfac:
        events = simulate_phases(critical_path_assignment(s, [6, 6], 1).phases, cost, cycles=2)
    else:
        events = simulate(s, cost, steps=2)
    path = tmp_path / "profile.sqlite"
    write_profile(path, events, metadata={"config": asdict(cfg), "method": method, "num_stages": 2,
                                          "num_micro_batches": 4, "device": "cpu", "oversubscribed": False})
    return path, cost


def test_costs_from_a_profile_recover_the_simulated_costs(tmp_path: Path, make_cfg):
    path, truth = _profile(tmp_path, make_cfg, kfac=True)
    cost = costs_from_profile(read_profile(path), path=path)
    assert (cost.forward_ns, cost.backward_ns, cost.p2p_ns, cost.step_ns) == (
        truth.forward_ns, truth.backward_ns, truth.p2p_ns, truth.step_ns)
    assert (cost.curv_a_ns, cost.curv_b_ns, cost.invert_ns, cost.precond_ns) == (
        truth.curv_a_ns, truth.curv_b_ns, truth.invert_ns, truth.precond_ns)


def test_costs_from_a_zero_bubble_profile_recover_the_split_backward_costs(tmp_path: Path, make_cfg):
    # zb-h1 at D=2, N=4 merges stage 0's I+W pairs into B and splits stage 1's: B is measured on
    # stage 0, I and W on stage 1, and each stays as measured (B = I + W where only the split ran).
    cfg = make_cfg("pipeline=zb-h1", "stages=2", "num_micro_batches=4")
    truth = CostModel.uniform(2, 1000, 2000, p2p_ns=70, input_grad_ns=1200, weight_grad_ns=900)
    events = simulate(build_schedule("zb-h1", 2, 4), truth, steps=2)
    path = tmp_path / "profile.sqlite"
    write_profile(path, events, metadata={"config": asdict(cfg), "method": "zb-h1", "num_stages": 2,
                                          "num_micro_batches": 4, "device": "cpu", "oversubscribed": False})
    kinds = {(e.kind, e.name[0]) for e in events if e.kind in ("B", "I", "W")}
    cost = costs_from_profile(read_profile(path), path=path)
    assert cost.forward_ns == truth.forward_ns
    for s in range(2):
        if ("I", str(s)) in kinds:
            assert (cost.input_grad_ns[s], cost.weight_grad_ns[s]) == (1200, 900)
        if ("B", str(s)) in kinds:
            assert cost.backward_ns[s] == 2000
    assert ("I", "1") in kinds


def test_costs_from_a_profile_without_kfac_estimate_it_at_the_measured_rate(tmp_path: Path, make_cfg):
    path, _ = _profile(tmp_path, make_cfg)
    cost = costs_from_profile(read_profile(path), path=path)
    assert cost.kfac_layers == (6, 6)
    # Same FLOPs per ns as the forwards: the ratio to F is the ratio of the FLOP counts.
    run = RunShape.from_train_config(read_profile(path).metadata["config"])
    flops = estimate_costs(run.bert, 2, run.micro_batch_size, run.seq_len, run.max_predictions, 1e12, 1e10)
    for s in range(2):
        ratio = cost.curv_a_ns[s][0] / cost.forward_ns[s]
        assert ratio == pytest.approx(flops.curv_a_ns[s][0] / flops.forward_ns[s], rel=0.02)


def test_profile_that_does_not_fit_the_run_is_refused_with_file_and_field(tmp_path: Path, make_cfg):
    path, _ = _profile(tmp_path, make_cfg)
    profile = read_profile(path)
    run = RunShape.from_train_config(profile.metadata["config"])
    with pytest.raises(ValueError, match=f"{path}: event .* names stage 1, but the run has 1 stages"):
        costs_from_profile(profile, replace(run, stages=1), path=path)
    only_stage_0 = replace(profile, events=[e for e in profile.events if not e.name.startswith("1")])
    with pytest.raises(ValueError, match=f"{path}: no F events for stage\\(s\\) \\[1\\] of 2"):
        costs_from_profile(only_stage_0, run, path=path)
    bad = replace(profile, events=profile.events + [replace(profile.events[0], name="0CURV_A0#9", kind="CURV_A")])
    with pytest.raises(ValueError, match="names K-FAC layer 9 of stage 0, which has 6"):
        costs_from_profile(bad, path=path)
    with pytest.raises(ValueError, match="metadata.config is missing"):
        costs_from_profile(replace(profile, metadata={}), path=path)


# -- memory and what-if ------------------------------------------------------------------------


def test_memory_counts_optimizer_state_activations_and_captures():
    run = RunShape(BertConfig.from_size("mini"), "1f1b", 2, 4, 8, seq_len=64, max_predictions=10)
    s = run.build_schedule()
    nvlamb = estimate_memory(run, "nvlamb", s)
    kfac = estimate_memory(run, "kfac", s, critical_path_assignment(s, run.kfac_layers, 1))
    assert nvlamb.optimizer == 3 * nvlamb.weights and nvlamb.captures == 0  # 2 moments + the step's temporary
    assert kfac.optimizer > nvlamb.optimizer and kfac.captures > 0
    assert estimate_memory(replace(run, recompute=True), "nvlamb", s).activations < nvlamb.activations
    assert "GB on worker" in kfac.describe()


def test_ekfac_memory_adds_each_layers_second_moment_in_the_eigenbasis():
    run = RunShape(BertConfig.from_size("mini"), "1f1b", 2, 4, 8, seq_len=64, max_predictions=10)
    kfac = estimate_memory_per_worker(run, "kfac")
    ekfac = estimate_memory_per_worker(replace(run, preconditioner="ekfac"), "kfac")
    h, f = 256, 1024  # bert-mini: 6 Linear layers per encoder layer
    per_layer = 4 * ((h + 1) * h * 4 + (h + 1) * f + (f + 1) * h)
    assert [ekfac[w].optimizer - kfac[w].optimizer for w in (0, 1)] == [n * per_layer for n in run.encoder_layers]
    assert estimate_memory_per_worker(replace(run, preconditioner="ekfac"), "nvlamb") == \
        estimate_memory_per_worker(run, "nvlamb")


def test_memory_model_knows_forward_doubling_holds_7_8_8_7_activations_at_d4():
    bert = BertConfig.from_size("mini")
    direct = RunShape(bert, "chimera", 4, 8, 8, seq_len=64, max_predictions=10)
    doubling = replace(direct, method="chimera-doubling")
    assert doubling.partition == direct.partition and doubling.num_replicas == 2 and doubling.stages_per_worker == 2
    a = {w: m.activations for w, m in estimate_memory_per_worker(direct, "nvlamb").items()}
    b = {w: m.activations for w, m in estimate_memory_per_worker(doubling, "nvlamb").items()}
    # In flight: 3 4 4 3 micro-batches against 7 8 8 7, each counted in its own stage (activation_peak).
    assert list(peak_activations(direct.build_schedule()).values()) == [3, 4, 4, 3]
    assert list(peak_activations(doubling.build_schedule()).values()) == [7, 8, 8, 7]
    # Workers 0 and 3 hold the heads (of one pipe each): their backward's two b·P·V buffers are once per worker.
    t = {w: 2 * heads_logits_bytes(direct) * (w in (0, 3)) for w in range(4)}
    # Workers 1 and 2 hold the two middle stages, of equal bytes: exactly 8/4 of direct's.
    assert [(b[w] - t[w]) / ((a[w] - t[w]) / 4) for w in (1, 2)] == pytest.approx([8, 8])
    # Workers 0 and 3 hold the first stage (embeddings) and the last (heads): their 7 lie between 7 of the
    # smaller and 7 of the larger (the model counted 7 of the larger before activation_peak).
    stage = [_activation_bytes(direct, s) for s in range(4)]
    for w in (0, 3):
        assert 7 * min(stage[0], stage[3]) < b[w] - t[w] < 7 * max(stage[0], stage[3])
    assert estimate_memory(doubling, "nvlamb").total > estimate_memory(direct, "nvlamb").total


def test_backward_halving_is_forward_doubling_on_half_micro_batches_at_direct_memory_and_a_smaller_bubble():
    """Chimera's backward halving (Sec. 3.5): the doubling schedule on micro-batches of half the size, twice
    as many (what the what-if search's micro-batch sizes reach). Its activations are direct concatenation's,
    not doubling's (D=8: the same bytes), and with B = 2F, F proportional to the micro-batch, its bubble is
    below both.

    Closed forms (Chimera, Li & Hoefler SC'21, Sec. 3.2 and 3.5; DESIGN.md): a basic unit of D
    micro-batches leaves each worker (D−2)/2 slots of F+B idle, so with N micro-batches the bubble is
    (D−2)/2 / (N + (D−2)/2) = (D−2)/(2N+D−2). Forward doubling removes the bubbles between units: one
    unit's idle for any N, (D−2)/(2N+D−2) = 6/38 = 3/19 at D=8, N=16. Direct concatenation keeps every
    unit's: k = N/D units idle k(D−2)/2 slots, k(D−2)/(2N+k(D−2)) = 12/44 = 3/11. Halving is doubling
    on N' = 2N micro-batches of half the cost: (D−2)/(2N'+D−2) = 6/70 = 3/35. All three hold for any
    B/F ratio: the idle is counted in slots of F+B."""
    bert = BertConfig.from_size("base")
    direct = RunShape(bert, "chimera", 8, 16, 8, seq_len=128, max_predictions=20)
    doubling = replace(direct, method="chimera-doubling")
    halving = replace(doubling, num_micro_batches=32, micro_batch_size=4)
    act = {name: estimate_memory(r, "nvlamb").activations for name, r in
           (("direct", direct), ("doubling", doubling), ("halving", halving))}
    assert act["halving"] == pytest.approx(act["direct"]) and act["doubling"] == pytest.approx(2 * act["direct"])

    def bubble(run: RunShape) -> float:
        f = 100 * run.micro_batch_size
        span = max(e.end_ns for e in simulate(run.build_schedule(), CostModel(
            forward_ns=(f,) * 8, backward_ns=(2 * f,) * 8, step_ns=0)))
        return 1 - run.num_micro_batches * 3 * f / span

    d, n, k = 8, 16, 16 // 8

    def basic(micro_batches: int) -> float:
        return (d - 2) / (2 * micro_batches + d - 2)

    closed = {"direct": k * (d - 2) / (2 * n + k * (d - 2)), "doubling": basic(n), "halving": basic(2 * n)}
    assert closed == pytest.approx({"direct": 3 / 11, "doubling": 3 / 19, "halving": 3 / 35})
    got = {"direct": bubble(direct), "doubling": bubble(doubling), "halving": bubble(halving)}
    assert got == pytest.approx(closed, rel=1e-9)


def test_whatif_ranks_by_throughput_and_excludes_over_budget_configs_with_the_reason():
    bert = BertConfig.from_size("mini")
    run = RunShape(bert, "1f1b", 2, 2, 8, 2, seq_len=64, max_predictions=10)
    need = {o: estimate_memory(run, o, run.build_schedule(1)).total_gb for o in ("nvlamb", "kfac")}
    budget = (need["nvlamb"] + need["kfac"]) / 2  # nvlamb fits, K-FAC's factors do not
    found = what_if(bert, devices=4, memory_gb=budget, global_batch=32, methods=["1f1b"],
                    micro_batch_sizes=[8, 16], optimizers=["nvlamb", "kfac"], recompute=[False], seq_len=64,
                    max_predictions=10, max_interval=2)
    ranked = [c for c in found if c.excluded is None]
    assert ranked and all(a.samples_per_s >= b.samples_per_s for a, b in zip(ranked, ranked[1:]))
    over = [c for c in found if c.excluded and "exceeds memory_gb" in c.excluded]
    assert any(c.optimizer == "kfac" and c.stages == 2 for c in over)
    assert any("not a multiple of micro_batch_size" in (c.excluded or "") for c in found)  # D=1, W=4, mbs=16
    assert "excluded" in format_candidates(found)


# -- schedule.py -------------------------------------------------------------------------------


def _compose(overrides: list[str]):
    register_schedule_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_schedule_config(compose(config_name="schedule", overrides=overrides))


def test_schedule_config_has_a_from_key_and_rejects_typos():
    cfg = _compose(["from=x.sqlite", "model=bert-mini", "stages=2"])
    assert cfg.from_ == "x.sqlite" and cfg.model.name == "bert-mini" and cfg.pipeline.method == "chimera"
    with pytest.raises(Exception, match="frm"):
        _compose(["frm=x.sqlite"])
    with pytest.raises(Exception, match="stages"):
        _compose(["stages=four"])


def test_plan_from_a_profile_checks_the_requested_run(tmp_path: Path, make_cfg):
    path, _ = _profile(tmp_path, make_cfg)
    cfg = _compose([f"from={path}", "stages=4"])
    with pytest.raises(ValueError, match=f"{path}: the profile is of another run than requested: stages=4"):
        plan_run(cfg, tmp_path / "out", requested={"from", "stages"})
    result = plan_run(_compose([f"from={path}", "plot=false"]), tmp_path / "out", requested={"from", "plot"})
    assert result.run.method == "1f1b" and result.run.stages == 2
    assert assignment_from_json(result.assignment_path) == result.comparison.assignment  # metadata aside
    assert "costs measured on CPU" in result.summary


def _whatif_every_method(**kwargs):
    return what_if(BertConfig.from_size("mini"), devices=4, global_batch=32, micro_batch_sizes=[4],
                   optimizers=["nvlamb"], recompute=[False], seq_len=64, max_predictions=10, **kwargs)


def test_whatif_searches_every_schedule_train_py_runs_with_its_memory():
    found = _whatif_every_method(memory_gb=100.0)
    ranked = {(c.method, c.stages): c for c in found if c.excluded is None}
    assert set(METHODS) == {"gpipe", "1f1b", "chimera", "chimera-doubling", "interleaved", "zb-h1", "zb-v",
                            "dualpipev", "v-half", "v-min"}
    for method in METHODS:  # D=2, W=2, N=4 fits every one
        c = ranked[(method, 2)]
        run = RunShape(BertConfig.from_size("mini"), method, 2, 4, 4, 2, c.num_virtual, 64, 10)
        assert c.memory_gb == pytest.approx(estimate_memory(run, "nvlamb", run.build_schedule(1)).total_gb)
    assert ranked[("zb-v", 2)].num_virtual == 2 and "zb-v D=2 v=2" in ranked[("zb-v", 2)].label
    assert ranked[("chimera-doubling", 2)].memory_gb > ranked[("chimera", 2)].memory_gb
    assert ("chimera-doubling", 4) in ranked  # D=4, W=1: N=8 = 2D
    reasons = {(c.method, c.stages): c.excluded for c in found if c.excluded}
    assert reasons[("chimera-doubling", 1)] == "chimera-doubling needs an even number of stages (stages=1)"
    assert reasons[("zb-v", 4)] == ("8 model stages exceed model.num_layers=4 + 2 (one encoder layer per stage, "
                                    "plus a stage for the heads and one for the embeddings)")


def test_search_ranks_the_shapes_train_py_runs_with_stages_of_heads_or_embeddings_alone():
    """bert-tiny (2 encoder layers) at D=2 with two chunks per worker: 4 model stages, which train.py runs (the
    heads and the embeddings get stages of their own, config.validation's L + 2); the search refused them."""
    from pipefisher.config import ConfigError
    from pipefisher.planning.strategy_search import search_strategies
    from tests.conftest import compose_train

    tiny = BertConfig.from_size("tiny")
    two_chunks = ["interleaved", "zb-v", "dualpipev", "v-half", "v-min"]
    found = search_strategies(tiny, devices=2, memory_gb=100.0, global_batch=32, methods=two_chunks,
                              micro_batch_sizes=[8], optimizers=["nvlamb", "pipefisher"], recompute=[False],
                              sdp_degrees=[1], tp_degrees=[1], seq_len=64, max_predictions=10)
    ranked = {(c.method, c.optimizer) for c in found if c.excluded is None and c.stages == 2}
    assert ranked == {(m, o) for m in two_chunks for o in ("nvlamb", "pipefisher")}
    for method in two_chunks:  # and train.py accepts each of them
        compose_train(["model=bert-tiny", "stages=2", f"pipeline={method}", "num_micro_batches=4"], tiny=False)
    at_d4 = [c for c in what_if(tiny, devices=4, memory_gb=100.0, global_batch=32, methods=["zb-v"],
                                micro_batch_sizes=[4], optimizers=["nvlamb"], recompute=[False], seq_len=64,
                                max_predictions=10) if c.stages == 4]
    assert [c.excluded for c in at_d4] == ["8 model stages exceed model.num_layers=2 + 2 (one encoder layer per "
                                           "stage, plus a stage for the heads and one for the embeddings)"]
    with pytest.raises(ConfigError, match=r"exceeds model.num_layers=2 \+ 2"):
        compose_train(["model=bert-tiny", "stages=4", "pipeline=zb-v", "num_micro_batches=8"], tiny=False)


def test_whatif_memory_budget_excludes_forward_doubling_where_direct_chimera_fits():
    bert = BertConfig.from_size("mini")
    direct = RunShape(bert, "chimera", 2, 4, 4, 2, seq_len=64, max_predictions=10)
    doubling = replace(direct, method="chimera-doubling")
    need = [estimate_memory(r, "nvlamb", r.build_schedule(1)).total_gb for r in (direct, doubling)]
    found = _whatif_every_method(memory_gb=sum(need) / 2, methods=["chimera", "chimera-doubling"])
    at_d2 = {c.method: c for c in found if c.stages == 2}
    assert at_d2["chimera"].excluded is None
    assert "exceeds memory_gb" in at_d2["chimera-doubling"].excluded
    assert at_d2["chimera-doubling"].memory_gb == pytest.approx(need[1])


def test_whatif_charges_split_backwards_their_measured_ratio():
    def step(method: str, ratio: float) -> float:
        found = _whatif_every_method(memory_gb=100.0, methods=[method], split_backward_ratio=ratio)
        return next(c.step_time_s for c in found if c.excluded is None and c.stages == 2)

    assert step("zb-h1", 1.3) > step("zb-h1", 1.07) > step("zb-h1", 1.0)
    assert step("zb-v", 1.3) > step("zb-v", 1.0)
    assert step("1f1b", 1.3) == step("1f1b", 1.0)  # a full backward is not split
    with pytest.raises(ValueError, match="split_backward_ratio=0"):
        _whatif_every_method(memory_gb=100.0, split_backward_ratio=0)


def test_run_whatif_writes_every_row(tmp_path: Path):
    cfg = _compose(["whatif=true", "model=bert-mini", "devices=2", "global_batch=16", "memory_gb=1",
                    "search.methods=[1f1b,chimera]", "search.micro_batch_sizes=[8]", "search.recompute=[false]",
                    "search.optimizers=[nvlamb,pipefisher]", "data.seq_len=64", "max_interval=2"])
    text = run_whatif(cfg, tmp_path)
    rows = json.loads((tmp_path / "whatif.json").read_text())
    assert "samples/s" in text and {r["method"] for r in rows} == {"1f1b", "chimera"}


def _run(args: list[str], ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 0) == ok, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_schedule_py_plans_from_a_profile(tmp_path: Path, make_cfg):
    path, _ = _profile(tmp_path, make_cfg, "chimera")
    out = tmp_path / "plan"
    proc = _run(["schedule.py", f"from={path}", f"hydra.run.dir={out}"])
    assert "bubble utilization" in proc.stdout and "pipefisher, refresh every k=" in proc.stdout
    a = assignment_from_json(out / "assignment.json")
    assert a.deferred and a.phases[0].method == "chimera" and a.metadata["predicted"]["pipefisher"]["interval"] == a.interval
    for suffix in (".pdf", ".png"):
        assert (out / f"timeline{suffix}").stat().st_size > 1000
    bad = _run(["schedule.py", f"from={path}", "num_micro_batches=8", f"hydra.run.dir={tmp_path / 'bad'}"], ok=False)
    assert f"{path}: the profile is of another run" in bad.stderr and "num_micro_batches=8" in bad.stderr


@pytest.mark.slow
def test_schedule_py_plans_from_estimates_without_a_profile(tmp_path: Path):
    out = tmp_path / "plan"
    proc = _run(["schedule.py", "model=bert-mini", "pipeline=1f1b", "stages=2", "num_micro_batches=4",
                 "micro_batch_size=8", f"hydra.run.dir={out}"])
    assert "estimated from FLOPs" in proc.stdout and "nvlamb" in proc.stdout
    check_assignment(assignment_from_json(out / "assignment.json"))
    assert proc.stdout.strip().endswith((out / "summary.txt").read_text().strip())
