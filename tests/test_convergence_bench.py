"""The convergence study's pieces that can fail (bench/convergence_analysis.py, bench/convergence.py's
arms and spec, bench/convergence_report.py's tables): targets from held-out rows, steps to target,
seed intervals and their separation, the step-cost composition, the grid picks and the plan of runs.
No training run here; each expected value is computed by hand."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import load_bench



_load = load_bench


# --- targets ----------------------------------------------------------------------------------

def test_unigram_entropy_and_cross_entropy_against_hand_values(ca) -> None:
    held = np.array([1, 1, 2, 3])  # p = 1/2, 1/4, 1/4
    assert ca.unigram_entropy(held) == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    train = np.array([1, 2, 2, 2])  # counts (+0.5): [0.5, 1.5, 3.5, 0.5] of 6 over a vocabulary of 4
    expected = -(2 * math.log(1.5 / 6) + math.log(3.5 / 6) + math.log(0.5 / 6)) / 4
    assert ca.unigram_cross_entropy(held, train, vocab_size=4) == pytest.approx(expected)


def test_masked_labels_read_positions_above_zero_only(ca, tmp_path: Path) -> None:
    import h5py

    with h5py.File(tmp_path / "a.hdf5", "w") as f:
        f["masked_lm_ids"] = np.array([[5, 6, 0], [7, 0, 0]])
        f["masked_lm_positions"] = np.array([[3, 4, 0], [1, 0, 0]])
    assert sorted(ca.masked_labels([tmp_path / "a.hdf5"]).tolist()) == [5, 6, 7]


def test_targets_are_the_unigram_entropy_minus_each_drop_and_refuse_non_positive_drops(ca) -> None:
    assert ca.targets_below(6.5, [0.2, 0.5]) == {"H-0.2": pytest.approx(6.3), "H-0.5": pytest.approx(6.0)}
    with pytest.raises(ValueError, match="positive"):
        ca.targets_below(6.5, [0.0])


def test_eval_curve_takes_held_out_rows_only_at_steps_done(ca) -> None:
    rows = [{"step": 0, "mlm_loss": 9.0}, {"step": 49, "eval_mlm_loss": 7.0}, {"step": 50, "mlm_loss": 6.0},
            {"step": 99, "eval_mlm_loss": None}]
    curve = ca.eval_curve(rows)
    assert curve[0] == (50, 7.0) and curve[1][0] == 100 and math.isnan(curve[1][1])


def test_steps_to_target_interpolate_between_evaluations_and_none_when_never_reached(ca) -> None:
    curve = [(50, 7.0), (100, 6.6), (150, 6.2), (200, 6.1)]
    assert ca.steps_to_target(curve, 6.4) == pytest.approx(125.0)  # halfway from 6.6 at 100 to 6.2 at 150
    assert ca.steps_to_target(curve, 7.5) == 50.0  # the first evaluation is already below
    assert ca.steps_to_target(curve, 6.1) == 200.0
    assert ca.steps_to_target(curve, 6.0) is None
    assert ca.steps_to_target([(50, 7.0), (100, math.nan), (150, 6.0)], 6.5) == 150.0  # no line through a NaN


def test_final_loss_is_inf_for_a_run_with_any_non_finite_evaluation(ca) -> None:
    assert ca.final_loss([(50, 7.0), (100, 6.0)]) == 6.0
    assert ca.final_loss([(50, 7.0), (100, 6.0)], last=2) == 6.5
    assert ca.final_loss([(50, math.nan), (100, 6.0)]) == math.inf
    assert ca.final_loss([]) == math.inf


# --- seeds ------------------------------------------------------------------------------------

def test_seed_interval_counts_seeds_that_missed_the_target(ca) -> None:
    i = ca.seed_interval([100.0, 120.0, 110.0])
    assert (i.mean, i.lo, i.hi, i.n, i.missing) == (110.0, 100.0, 120.0, 3, 0)
    assert i.sd == pytest.approx(10.0)
    j = ca.seed_interval([100.0, None, 140.0])
    assert (j.mean, j.n, j.missing, j.complete) == (120.0, 2, 1, False)
    assert ca.seed_interval([None, None]).n == 0


def test_separation_needs_disjoint_ranges_and_two_seeds_on_each_side(ca) -> None:
    a, b = ca.seed_interval([100, 110, 105]), ca.seed_interval([120, 130, 125])
    assert ca.separated(a, b) and ca.separated(b, a)
    assert not ca.separated(a, ca.seed_interval([108, 130, 125]))  # overlap at 108..110
    assert not ca.separated(ca.seed_interval([100]), ca.seed_interval([200]))  # one seed each: unknown spread
    # b's seeds partly missed (open above): separated only if a is complete and below all of b's hits
    assert ca.separated(a, ca.seed_interval([150, None, 160]))
    assert not ca.separated(ca.seed_interval([100, None, 105]), b)  # a missing seed may lie anywhere above
    assert ca.separated(a, ca.seed_interval([None, None, None]))  # none of b reached what all of a did


def test_ratio_of_intervals_takes_means_and_extremes(ca) -> None:
    r = ca.ratio(ca.seed_interval([50, 60, 70]), ca.seed_interval([100, 110, 120]))
    assert r.mean == pytest.approx(60 / 110) and r.lo == pytest.approx(50 / 120) and r.hi == pytest.approx(0.7)
    assert r.established
    assert math.isnan(ca.ratio(ca.seed_interval([None, None]), ca.seed_interval([1, 2])).mean)
    assert r.complete and r.missed == (0, 0) and r.text() == "0.55 [0.42–0.70] separated"


def test_ratio_says_how_many_seeds_missed_the_target(ca) -> None:
    # The mean of a side with a seed that missed is of the seeds that reached the target only: the ratio
    # must say so (issue 38: it averaged them without a word).
    r = ca.ratio(ca.seed_interval([50, None, 70]), ca.seed_interval([100, 110, 120]))
    assert (r.mean, r.missed, r.seeds, r.complete) == (pytest.approx(60 / 110), (1, 0), (3, 3), False)
    assert r.text() == ("0.55 [0.42–0.70] not separated (of the seeds that reached it: 1 of 3 seeds of the first "
                        "missed the target; the ratio is a lower bound)")
    r = ca.ratio(ca.seed_interval([50, 60, 70]), ca.seed_interval([100, None, None, 120]))
    assert r.missed == (0, 2) and r.text().endswith("2 of 4 seeds of the second missed the target; the ratio is "
                                                    "an upper bound)")
    both = ca.ratio(ca.seed_interval([50, None]), ca.seed_interval([None, 120]))
    assert both.missed == (1, 1) and "neither bound" in both.text()
    none = ca.ratio(ca.seed_interval([None, None]), ca.seed_interval([1, 2]))
    assert none.missed == (2, 0) and none.text() == "–"


def test_time_to_target_is_steps_times_the_settings_step_cost(ca) -> None:
    t = ca.time_to_target(ca.seed_interval([100, 200]), 0.5)
    assert (t.mean, t.lo, t.hi, t.sd) == (75.0, 50.0, 100.0, pytest.approx(math.sqrt(2 * 50 ** 2) / 2))
    with pytest.raises(ValueError, match="step cost"):
        ca.time_to_target(ca.seed_interval([100]), 0.0)


# --- picks and the plan -------------------------------------------------------------------------

def test_pick_never_takes_a_diverged_run_and_reports_an_edge(ca) -> None:
    assert ca.pick({1e-3: 6.5, 2e-3: 6.3, 4e-3: 6.4}) == (2e-3, False)
    assert ca.pick({1e-3: 6.5, 2e-3: 6.3, 4e-3: math.inf}) == (2e-3, False)
    assert ca.pick({1e-3: 6.2, 2e-3: 6.3}) == (1e-3, True)
    assert ca.pick({1e-3: math.inf, 2e-3: math.nan}) == (None, True)
    assert ca.beyond_edge([1e-3, 2e-3], 2e-3) == 4e-3 and ca.beyond_edge([1e-3, 2e-3], 1e-3) == 5e-4


def _spec(ca, **kw):
    base = dict(steps={32: 100}, lr_grid={"nvlamb": [1e-2, 2e-2, 4e-2], "kfac": [1e-2, 2e-2]},
                damping_grid=[1e-3, 1e-2], stale_arms=["kfac-k2-deferred"], final_arms=["nvlamb", "kfac-k1"],
                seeds=3, max_extend=1)
    base.update(kw)
    return ca.StudySpec(**base)


def test_plan_starts_with_the_grids_at_seed_zero(ca) -> None:
    todo, picks = ca.plan_runs(_spec(ca), {})
    assert [r.key for r in todo] == ["b32/nvlamb/lr0.01-s0", "b32/nvlamb/lr0.02-s0", "b32/nvlamb/lr0.04-s0",
                                     "b32/kfac-k1/lr0.01-d0.001-s0", "b32/kfac-k1/lr0.02-d0.001-s0"]
    assert picks.lr == {}


def test_plan_extends_a_grid_past_its_edge_then_tunes_damping_then_runs_seeds(ca) -> None:
    spec = _spec(ca)
    done = {"b32/nvlamb/lr0.01-s0": 6.5, "b32/nvlamb/lr0.02-s0": 6.3, "b32/nvlamb/lr0.04-s0": 6.4,
            "b32/kfac-k1/lr0.01-d0.001-s0": 6.4, "b32/kfac-k1/lr0.02-d0.001-s0": 6.2}  # kfac's best at the edge
    todo, picks = ca.plan_runs(spec, done)
    keys = [r.key for r in todo]
    assert picks.lr[(32, "nvlamb")] == 0.02 and not picks.lr_edge[(32, "nvlamb")]
    assert "b32/kfac-k1/lr0.04-d0.001-s0" in keys  # extended past 0.02
    assert "b32/nvlamb/lr0.02-s1" in keys and "b32/nvlamb/lr0.02-s2" in keys
    assert "b32/nvlamb/lr0.02-s0" not in keys  # seed 0 is the tuning run
    assert not any(k.startswith("b32/kfac-k2") for k in keys)  # kfac not picked yet
    done["b32/kfac-k1/lr0.04-d0.001-s0"] = 6.25
    todo, picks = ca.plan_runs(spec, done)
    assert picks.lr[(32, "kfac")] == 0.02
    assert [r.key for r in todo if r.arm == "kfac-k1"] == ["b32/kfac-k1/lr0.02-d0.01-s0"]  # damping next
    done["b32/kfac-k1/lr0.02-d0.01-s0"] = 6.3  # damping 1e-3 wins, at the edge: extended by ÷10 once
    todo, picks = ca.plan_runs(spec, done)
    assert [r.key for r in todo if r.arm == "kfac-k1"] == ["b32/kfac-k1/lr0.02-d0.0001-s0"]
    done["b32/kfac-k1/lr0.02-d0.0001-s0"] = 6.4
    todo, picks = ca.plan_runs(spec, done)
    assert picks.damping[32] == 1e-3 and not picks.damping_edge[32]
    keys = [r.key for r in todo]
    assert "b32/kfac-k2-deferred/lr0.02-d0.001-s0" in keys
    assert "b32/kfac-k1/lr0.02-d0.001-s1" in keys and "b32/kfac-k1/lr0.02-d0.001-s0" not in keys


def test_plan_stops_extending_after_max_extend_and_keeps_the_edge_pick(ca) -> None:
    spec = _spec(ca, lr_grid={"nvlamb": [1e-2, 2e-2]}, max_extend=1, final_arms=["nvlamb"], stale_arms=[])
    done = {"b32/nvlamb/lr0.01-s0": 6.5, "b32/nvlamb/lr0.02-s0": 6.3, "b32/nvlamb/lr0.04-s0": 6.2}
    todo, picks = ca.plan_runs(spec, done)
    assert picks.lr[(32, "nvlamb")] == 0.04 and picks.lr_edge[(32, "nvlamb")]
    assert [r.key for r in todo] == ["b32/nvlamb/lr0.04-s1", "b32/nvlamb/lr0.04-s2"]


def test_arm_overrides_scale_the_factor_decay_per_step_and_defer_inverses(cv) -> None:
    assert cv.arm_overrides("muon", 0.95) == ["optimizer=muon"]
    o = cv.arm_overrides("kfac-k4-deferred", 0.95)
    assert "optimizer.curvature_interval=4" in o and "optimizer.deferred_inverse=true" in o
    assert f"optimizer.factor_decay={0.95 ** 4:.6g}" in o
    assert "optimizer.deferred_inverse=false" in cv.arm_overrides("kfac-k2", 0.9)
    with pytest.raises(ValueError, match="unknown arm"):
        cv.arm_overrides("kfac-k2-later", 0.95)


def test_decoupled_and_when_ready_kfac_arms(cv, ca) -> None:
    o = cv.arm_overrides("kfac-k1-i4", 0.95)  # factors every step, inverses every 4, used at once
    assert "optimizer.curvature_interval=1" in o and "optimizer.inverse_interval=4" in o
    assert "optimizer.deferred_inverse=false" in o and f"optimizer.factor_decay={0.95:.6g}" in o
    o = cv.arm_overrides("kfac-k4-ready", 0.95)
    assert "optimizer.deferred_inverse=true" in o and "optimizer.promote_inverses=when_ready" in o
    assert "optimizer.promote_inverses=when_ready" not in cv.arm_overrides("kfac-k4-deferred", 0.95)
    assert ca.kfac_arm("kfac-k2-i8-deferred") == (2, 8, "deferred") and ca.kfac_interval("nvlamb") is None
    with pytest.raises(ValueError, match="multiple of the factor interval 4"):
        cv.arm_overrides("kfac-k4-i6", 0.95)


def test_spec_of_the_arguments_adds_pipefisher_arms_and_refuses_bad_batches(cv, ca) -> None:
    args = cv.parse_args(["--quick", "--pipefisher-k", "D=2:7,D=8:2"])
    spec = cv.study_spec(args)
    assert "kfac-k7-deferred" in spec.final_arms and "kfac-k2-deferred" in spec.final_arms
    assert "pipefisher-d2" in spec.final_arms  # PipeFisher's own D=2 run beside its stand-ins
    assert spec.steps == {32: 120}
    with pytest.raises(SystemExit, match="multiple"):
        cv.study_spec(cv.parse_args(["--quick", "--batches", "48"]))
    with pytest.raises(ValueError, match="setting:k"):
        ca.pipefisher_ks("D=2")
    with pytest.raises(SystemExit, match="setting:k"):
        cv.study_spec(cv.parse_args(["--quick", "--pipefisher-k", "D=2"]))


def test_run_command_sets_accumulation_lr_seed_and_damping(cv, ca, tmp_path: Path) -> None:
    args = cv.parse_args(["--quick", "--batches", "128"])
    spec = cv.study_spec(args)
    cmd = cv.run_command(args, None, spec, ca.Run(128, "kfac-k1", 0.02, 1, 1e-3), tmp_path)
    assert "num_micro_batches=4" in cmd and "micro_batch_size=32" in cmd and "lr=0.02" in cmd
    assert "seed=1" in cmd and "optimizer.damping=0.001" in cmd and cmd[-1] == f"hydra.run.dir={tmp_path}"
    own = cv.run_command(args, None, spec, ca.Run(128, "pipefisher-d2", 0.02, 2, 1e-3), tmp_path)
    assert {"stages=2", "num_micro_batches=4", "micro_batch_size=32", "pipeline=chimera", "optimizer=pipefisher",
            "optimizer.factor_decay=0.95", "optimizer.factor_decay_per=step", "seed=2", "optimizer.damping=0.001",
            "lr=0.02"} <= set(own) and any(o.startswith("eval.every_steps=") and o != "eval.every_steps=0" for o in own)
    assert f"eval.batches={args.eval_batches}" in cmd and f"eval.batches={args.eval_batches}" in own  # both of 32
    # at batch 32 the pipeline's micro-batches hold 8: the same held-out sequences are 4 × as many of them
    args32 = cv.parse_args(["--quick"])
    own32 = cv.run_command(args32, None, cv.study_spec(args32), ca.Run(32, "pipefisher-d2", 0.02, 0, 1e-3), tmp_path)
    assert "micro_batch_size=8" in own32 and f"eval.batches={args32.eval_batches * 4}" in own32
    assert ca.family("pipefisher-d2") == "kfac" and ca.family("pipefisher-d2-c2") == "kfac"  # kfac-k1's lr, damping
    assert not any("curvature_micro_batches" in o for o in own)
    half = cv.run_command(args, None, spec, ca.Run(128, "pipefisher-d2-c2", 0.02, 0, 1e-3), tmp_path)
    assert "optimizer.curvature_micro_batches=2" in half and "stages=2" in half
    assert cv.timed_overrides("pipefisher-c2", 0.95) == ["optimizer=pipefisher", "optimizer.curvature_micro_batches=2"]
    assert cv.timed_overrides("pipefisher", 0.95) == ["optimizer=pipefisher"]
    assert not cv.timed_pipefisher("pipefisher-c0") and not cv.timed_pipefisher("pipefisher-cx")
    with pytest.raises(ValueError, match="pipefisher-d2"):
        cv.arm_overrides("pipefisher-d3", 0.95)
    assert "pipefisher-d2" in cv.study_spec(cv.parse_args(["--quick", "--final", "nvlamb,pipefisher-d2"])).final_arms
    timed = cv.common_overrides(args, None, 32, 40, stages=2, num_micro_batches=4, evaluate=False)
    assert {"stages=2", "micro_batch_size=8", "num_micro_batches=4", "eval.every_steps=0"} <= set(timed)
    assert not any(o.startswith("eval.batches") for o in timed)


# --- the report -----------------------------------------------------------------------------------

def _result(ca, run, curve):
    return {"key": run.key, "batch": run.batch, "arm": run.arm, "status": "ok", "final": ca.final_loss(curve),
            "curve": curve, "wall_s": 1.0}


def test_report_prices_steps_per_setting_and_calls_separation(ca, cv, tmp_path: Path) -> None:
    report = _load("convergence_report")
    spec = ca.StudySpec(steps={32: 200}, lr_grid={"nvlamb": [1e-2], "kfac": [1e-2]}, damping_grid=[1e-3],
                        stale_arms=[], final_arms=["nvlamb", "kfac-k1", "kfac-k2-deferred"], seeds=2, max_extend=0)
    results = {}
    for seed, (nv, kf, pf) in enumerate([(150, 100, 110), (160, 104, 114)]):
        for arm, hit, damping in (("nvlamb", nv, None), ("kfac-k1", kf, 1e-3), ("kfac-k2-deferred", pf, 1e-3)):
            run = ca.Run(32, arm, 1e-2, seed, damping)
            curve = [(50, 7.0), (hit, 6.0), (200, 5.9)]
            results[run.key] = _result(ca, run, curve)
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"D=8 simulated": {"nvlamb": 1.0, "kfac-k1": 2.0, "pipefisher": 1.1}}))
    args = argparse.Namespace(model="bert-tiny", seq_len=64, micro_batch_size=32, drops="0.5", step_costs=costs,
                              pipefisher_k="D=8 simulated:2", decay_per_step=0.95)
    data = argparse.Namespace(unigram=6.5, cross=6.7)
    report.write(tmp_path, args, spec, data, results)
    out = json.loads((tmp_path / "results.json").read_text())
    steps = out["batches"]["32"]["steps_to_target"]
    assert steps["nvlamb"]["H-0.5"]["mean"] == 155 and steps["kfac-k1"]["H-0.5"]["mean"] == 102
    times = out["batches"]["32"]["time"]["D=8 simulated"]["H-0.5"]
    assert times["kfac-k1"]["mean"] == 204.0  # 102 steps × 2.0 s
    assert times["kfac-k2-deferred"]["mean"] == pytest.approx(112 * 1.1)  # PipeFisher's step cost in that setting
    table = (tmp_path / "table.md").read_text()
    # PipeFisher 123.2 s vs NVLAMB 155 s: ranges [121–125.4] and [150–160] separate
    assert "0.79 [0.76–0.84] separated" in table
    assert (tmp_path / "heldout_b32.png").is_file() and (tmp_path / "staleness_b32.png").is_file()


def test_timed_step_is_the_mean_over_whole_refresh_cycles_after_the_first_two(cv) -> None:
    rows = [{"kfac_phase": s % 2, "step_time_s": 3.0 if s % 2 == 0 else 1.0} for s in range(11)]
    rows[0]["step_time_s"] = rows[2]["step_time_s"] = 50.0  # warm-up cycles: left out
    assert cv.cycle_mean_step_s(rows) == (2.0, 2)  # steps 4..9: three whole cycles; step 10 starts a fourth
    plain = [{"step_time_s": t} for t in (9.0, 9.0, 1.0, 2.0, 3.0)]
    assert cv.cycle_mean_step_s(plain) == (2.0, 1)
    with pytest.raises(ValueError, match="no whole refresh cycle"):
        cv.cycle_mean_step_s(rows[:5])


def test_a_step_cost_setting_named_for_a_batch_prices_that_batch_only() -> None:
    report = _load("convergence_report")
    costs = {"D=2 measured, batch 32": {"nvlamb": 1.0}, "D=8 simulated": {"nvlamb": 2.0}}
    assert list(report._settings(costs, 32)) == ["D=2 measured, batch 32", "D=8 simulated"]
    assert list(report._settings(costs, 256)) == ["D=8 simulated"]
    pf = {"D=2": "kfac-k7-deferred"}
    assert report._cost_arm("kfac-k7-deferred", pf, "D=2 measured, batch 32") == "pipefisher"
    assert report._cost_arm("kfac-k2-deferred", pf, "D=2 measured, batch 32") == "kfac-k2"  # critical path at k
    # PipeFisher's own D=2 run costs its measured D=2 step, and is not priced at D=8 (another plan there)
    assert report._cost_arm("pipefisher-d2", pf, "D=2 measured, batch 32") == "pipefisher"
    assert report._cost_arm("pipefisher-d2", pf, "D=8 simulated, batch 32") not in {"pipefisher", "kfac-k1"}
    assert report._cost_arm("pipefisher-d2-c2", pf, "D=2 measured, batch 32") == "pipefisher-c2"


def test_timings_on_other_pipelines_and_placements_are_settings_of_their_own(cv) -> None:
    """--timing-pipelines / --timing-placements: chimera with the global step keeps the study's setting name;
    any other pipeline or placement is a setting named for it, priced for its batch only."""
    assert cv.timing_setting(32) == "D=2 measured, batch 32"
    other = cv.timing_setting(32, "1f1b", "per_stage")
    assert other == "D=2 measured, 1f1b, optimizer_placement=per_stage, batch 32"
    assert cv.timing_setting(32, "chimera", "per_stage") != cv.timing_setting(32)
    report = _load("convergence_report")
    costs = {cv.timing_setting(32): {"pipefisher": 1.0}, other: {"pipefisher": 2.0}}
    assert list(report._settings(costs, 32)) == [cv.timing_setting(32), other]
    assert list(report._settings(costs, 64)) == []
    assert report._cost_arm("pipefisher-d2", {}, other) == "pipefisher"  # a D=2 setting: PipeFisher's own run


def test_tuning_score_ranks_by_steps_to_the_hardest_target_then_by_final_loss(ca) -> None:
    fast = [(50, 7.0), (100, 6.0), (150, 5.9)]
    slow = [(50, 7.0), (100, 6.5), (150, 5.8)]
    missed_low, missed_high = [(50, 7.0), (150, 6.1)], [(50, 7.0), (150, 6.3)]
    target = 6.0
    scores = [ca.tuning_score(c, target) for c in (fast, slow, missed_low, missed_high)]
    assert scores[0] == 100.0 and scores[1] == pytest.approx(100 + 50 * 0.5 / 0.7)  # 6.5 -> 5.8 crosses 6.0
    assert scores[0] < scores[1] < scores[2] < scores[3]  # a lower final loss does not beat reaching sooner
    assert ca.tuning_score([(50, math.nan)], target) == math.inf
    assert ca.tuning_score(slow, None) == 5.8  # no target: the final loss
    assert ca.pick({1e-3: scores[1], 2e-3: scores[0], 4e-3: scores[2]}) == (2e-3, False)


def test_max_mean_gap_compares_seed_means_at_common_steps_only(ca) -> None:
    arm = [[(50, 7.0), (100, 6.50), (150, 6.30)], [(50, 7.2), (100, 6.54), (150, 6.34)]]  # means 7.1, 6.52, 6.32
    ref = [[(50, 7.1), (100, 6.45), (150, 6.31), (200, 6.0)], [(50, 7.1), (100, 6.49), (150, 6.33)]]  # 7.1, 6.47, 6.32
    gap, step = ca.max_mean_gap(arm, ref)
    assert step == 100 and gap == pytest.approx(0.05)  # step 200 is not in every run; 50 and 150 give 0
    ahead = [[(50, 7.0), (100, 6.4)]]
    assert ca.max_mean_gap(ahead, [[(50, 7.1), (100, 6.5)]])[0] == pytest.approx(-0.1)  # ahead at every step
    assert ca.max_mean_gap(arm, []) is None and ca.max_mean_gap([[(10, 1.0)]], [[(20, 1.0)]]) is None
    assert ca.max_mean_gap([[(50, math.nan)]], [[(50, 7.0)]]) == (math.inf, 50)


def test_staleness_multipliers_pair_seeds_and_leave_out_unknown_intervals(ca) -> None:
    steps = {"kfac-k1": {0: 1000, 1: 1200}, "kfac-k2-deferred": {0: 1100}, "kfac-k4-deferred": {0: 1000, 1: None},
             "kfac-k8-deferred": {0: 1500, 1: 1800}, "kfac-k4-ready": {0: 900}, "kfac-k1-i4-deferred": {0: 5000},
             "nvlamb": {0: 2000}}
    m = ca.staleness_multipliers(steps, "deferred")
    # k=2 against seed 0 only; k=4 missed the target at seed 1: unknown; k=8 over both seeds; k=1 not run: 1.0
    assert m == {1: (1.0, 0), 2: (pytest.approx(1.1), 1), 8: (pytest.approx(3300 / 2200), 2)}
    assert ca.staleness_multipliers(steps, "ready") == {1: (1.0, 0), 4: (pytest.approx(0.9), 1)}
    assert ca.staleness_multipliers(steps, "fresh") == {1: (pytest.approx(1.0), 2)}  # kfac-k1 is its own reference
    with pytest.raises(ValueError, match="deferred, ready or fresh"):
        ca.staleness_multipliers(steps, "stale")


def test_trade_off_prices_each_interval_by_its_step_and_its_steps(ca) -> None:
    costs = {"nvlamb": 0.2, "kfac-k1": 0.4, "kfac-k4": 0.25, "pipefisher-k1": 0.3, "pipefisher-k4": 0.21,
             "pipefisher-k4-ready": 0.22}  # the plan with every INVERT in its curvature's phase
    multipliers = {"deferred": {1: (1.0, 0), 4: (1.1, 3), 8: (1.3, 1)}, "ready": {1: (1.0, 0), 4: (1.05, 1)},
                   "fresh": {1: (1.0, 3), 4: (1.02, 1)}}
    rows = ca.trade_off(costs, multipliers, steps_kfac1_over_nvlamb=0.8)
    assert [r.k for r in rows] == [1, 4]  # k=8 has no step cost of either kind
    k1, k4 = rows
    assert (k1.pipefisher_step, k1.deferred_steps, k1.ready_steps) == (pytest.approx(1.5), None, None)
    assert k1.kfac_time == pytest.approx(2.0 * 1.0 * 0.8)  # K-FAC every step: 2x the step, 0.8x the steps
    assert k4.pipefisher_time == pytest.approx(1.05 * 1.1 * 0.8) and k4.deferred_seeds == 3
    assert k4.ready_time == pytest.approx(1.1 * 1.05 * 0.8) and k4.kfac_time == pytest.approx(1.25 * 1.02 * 0.8)
    assert k1.ready_step is None and k1.ready_time is None  # no when-ready plan priced at k=1


def test_simulated_setting_names_the_stage_count_and_global_batch(ca) -> None:
    doc = {"simulated_run": {"stages": 8, "micro_batch_size": 16, "num_micro_batches": 8, "dp_width": 1},
           "simulated": {"nvlamb": {"step_s": 0.1, "k": None}, "pipefisher-k2": {"step_s": 0.12, "k": 2}}}
    assert ca.simulated_setting(doc) == ("D=8 simulated, batch 128", {"nvlamb": 0.1, "pipefisher-k2": 0.12,
                                                                       "adamw": 0.1, "muon": 0.1})
