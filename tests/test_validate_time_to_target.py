"""bench/validate_time_to_target.py's arithmetic: ranks, Spearman, the rows and the goal verdicts (issue 37)."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.conftest import load_bench


@pytest.fixture(scope="module")
def v():
    return load_bench("validate_time_to_target")


def test_ranks_share_ties(v):
    assert v.ranks([3.0, 1.0, 2.0, 2.0]) == [4.0, 1.0, 2.5, 2.5]
    assert v.ranks([5.0, 5.0, 5.0]) == [2.0, 2.0, 2.0]


def test_spearman_equals_the_closed_form_without_ties(v):
    """Independent reference: 1 - 6 sum d^2 / (n (n^2 - 1)) holds when no value repeats."""
    rng = random.Random(0)
    for n in (2, 5, 9):
        xs = [rng.random() for _ in range(n)]
        ys = [rng.random() for _ in range(n)]
        d2 = sum((a - b) ** 2 for a, b in zip(v.ranks(xs), v.ranks(ys)))
        assert v.spearman(xs, ys) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
    assert v.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert v.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_spearman_with_ties_by_hand(v):
    # ranks x: 1, 2.5, 2.5, 4; y: 1, 2, 3, 4 -> Pearson of the ranks = 4.5 / sqrt(4.5 * 5)
    assert v.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    with pytest.raises(ValueError, match="constant"):
        v.spearman([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="at least 2"):
        v.spearman([1], [1])


def _pred(step_s, steps, k=1):
    return {"step_s": step_s, "steps": steps, "k": k}


def test_rows_price_both_sides_with_the_same_steps_and_the_order_weighs_them(v):
    """A slower step can reach the target first when its optimizer needs fewer steps: the order compares
    times (steps x step), not steps alone."""
    predicted = {"chimera/nvlamb": _pred(0.200, 1606), "chimera/muon": _pred(0.230, 1245),
                 "1f1b/pipefisher": _pred(0.260, 1277, k=6)}
    measured = {"chimera/nvlamb": [0.21, 0.19, 0.25], "chimera/muon": [0.22], "1f1b/pipefisher": [0.30, 0.28]}
    rows = v.assemble_rows(predicted, measured, builtin={k: _pred(0.05, 0) for k in predicted},
                           measured_k={"1f1b/pipefisher": 6})
    by = {f"{r.schedule}/{r.optimizer}": r for r in rows}
    nv = by["chimera/nvlamb"]
    assert nv.measured_s == 0.21 and nv.rounds_s == (0.21, 0.19, 0.25)  # the median of the rounds
    assert nv.error == pytest.approx(0.200 / 0.21 - 1)
    assert nv.predicted_time_s == pytest.approx(1606 * 0.200) and nv.measured_time_s == pytest.approx(1606 * 0.21)
    assert by["1f1b/pipefisher"].k_predicted == 6 and by["1f1b/pipefisher"].k_measured == 6
    assert by["chimera/muon"].builtin_error == pytest.approx(0.05 / 0.22 - 1)
    s = v.summary(rows)
    # times: nvlamb 321/337, muon 286/274, pipefisher 332/345 -> the same order predicted and measured
    assert s["spearman"] == pytest.approx(1.0) and s["spearman_met"]
    assert s["worst_pair"] == "1f1b/pipefisher" and s["worst_error"] == pytest.approx(0.26 / 0.29 - 1)
    assert not s["step_error_met"] and s["within_goal"] == 2
    # by step alone the order would be nvlamb < muon < pipefisher measured too, but muon is first in time
    table = v.table_lines(rows)
    assert table[2].startswith("| chimera  | muon") and "1/-" in table[2]
    with pytest.raises(ValueError, match="1f1b/kfac: measured but not predicted"):
        v.assemble_rows(predicted, {"1f1b/kfac": [0.3]})


def test_a_swapped_pair_lowers_spearman_below_the_goal(v):
    names = [f"s{i}/nvlamb" for i in range(4)]
    predicted = {n: _pred(0.1 * (i + 1), 1000) for i, n in enumerate(names)}
    measured = {n: [0.1 * (4 - i)] for i, n in enumerate(names)}  # the reverse order
    s = v.summary(v.assemble_rows(predicted, measured))
    assert s["spearman"] == pytest.approx(-1.0) and not s["spearman_met"]


def test_median_prediction_over_rounds_keeps_round_zeros_plan(v):
    rounds = [{"a/pipefisher": _pred(0.3, 1277, k=7)}, {"a/pipefisher": _pred(0.5, 1277, k=6)},
              {"a/pipefisher": _pred(0.2, 1277, k=7)}]
    got = v.median_prediction(rounds)["a/pipefisher"]
    assert got["step_s"] == 0.3 and got["k"] == 7 and got["rounds_step_s"] == [0.3, 0.5, 0.2]


def test_pairs(v):
    every = v.pairs_of(False)
    assert ("v-half", "muon") not in every and ("zb-v", "muon") in every  # v-half is zb-v's list at D=2, N=4
    assert len(every) == (len(v.SCHEDULES) - len(v.same_schedules())) * len(v.OPTIMIZERS)
    assert set(itertools.product(["chimera"], v.OPTIMIZERS)) <= set(every)
    assert v.pairs_of(False, "gpipe/kfac,zb-h1/muon") == [("gpipe", "kfac"), ("zb-h1", "muon")]
    with pytest.raises(ValueError, match="--pairs chimera/sgd"):
        v.pairs_of(False, "chimera/sgd")


def test_training_time_to_an_interpolated_step_leaves_evaluations_out(v):
    rows = [{"step": 0, "step_time_s": 1.0}, {"step": 1, "step_time_s": 2.0, "eval_mlm_loss": 7.0},
            {"step": 2, "step_time_s": 4.0}]
    assert v.time_at_steps(rows, 2) == 3.0
    assert v.time_at_steps(rows, 2.5) == 5.0  # half of step 2's 4 s
    with pytest.raises(ValueError, match="do not cover 4"):
        v.time_at_steps(rows, 4)


def test_decompose_separates_a_common_rate_from_one_mispriced_optimizer(v):
    """Every prediction 2x (a rate measured at another load) and muon's another 1.5x: the common factor is 2,
    muon's median over it 1.5, the others 1."""
    predicted, measured = {}, {}
    for sched in ("gpipe", "1f1b", "chimera"):
        for opt, extra in (("nvlamb", 1.0), ("adamw", 1.0), ("muon", 1.5)):
            predicted[f"{sched}/{opt}"] = _pred(0.2 * 2 * extra, 1000)
            measured[f"{sched}/{opt}"] = [0.2]
    d = v.decompose(v.assemble_rows(predicted, measured))
    assert d["common"] == pytest.approx(2.0)
    assert d["optimizer"] == pytest.approx({"nvlamb": 1.0, "adamw": 1.0, "muon": 1.5})
    assert d["schedule"] == pytest.approx({"gpipe": 1.0, "1f1b": 1.0, "chimera": 1.0})
    assert d["worst_after_common"][0].endswith("/muon") and d["worst_after_common"][1] == pytest.approx(0.5)
    assert d["within_after_common"] == 6


def test_round_spread_is_the_measurements_own_noise(v):
    predicted = {"a/nvlamb": _pred(0.2, 1000), "b/nvlamb": _pred(0.2, 1000), "c/nvlamb": _pred(0.2, 1000)}
    measured = {"a/nvlamb": [0.2, 0.3], "b/nvlamb": [0.2, 0.22, 0.21], "c/nvlamb": [0.4]}
    median, largest, pairs = v.round_spread(v.assemble_rows(predicted, measured))
    assert pairs == 2 and largest == pytest.approx(0.5) and median == pytest.approx((0.5 + 0.1) / 2)
    assert v.round_spread(v.assemble_rows(predicted, {"c/nvlamb": [0.4]})) is None


def test_twin_spread_compares_nvlamb_and_adamw_on_the_same_schedule(v):
    predicted = {k: _pred(0.2, 1606) for k in ("a/nvlamb", "a/adamw", "b/nvlamb", "b/adamw", "c/nvlamb")}
    measured = {"a/nvlamb": [0.3], "a/adamw": [0.2], "b/nvlamb": [0.2], "b/adamw": [0.25], "c/nvlamb": [0.2]}
    assert v.twin_spread(v.assemble_rows(predicted, measured)) == pytest.approx({"a": 0.5, "b": -0.2})


def test_round_spearman_orders_the_measurement_against_itself(v):
    predicted = {f"s{i}/nvlamb": _pred(0.2, 1000) for i in range(4)}
    measured = {"s0/nvlamb": [0.1, 0.4], "s1/nvlamb": [0.2, 0.3], "s2/nvlamb": [0.3, 0.2], "s3/nvlamb": [0.4, 0.1]}
    assert v.round_spearman(v.assemble_rows(predicted, measured)) == (pytest.approx(-1.0), 4)
    assert v.round_spearman(v.assemble_rows(predicted, {"s0/nvlamb": [0.1, 0.2]})) is None


def test_round_rows_pair_each_rounds_prediction_with_its_own_runs(v):
    doc = {"predicted_rounds": [{"a/nvlamb": _pred(0.4, 1000), "b/muon": _pred(0.5, 800)},
                                {"a/nvlamb": _pred(0.2, 1000), "b/muon": _pred(0.25, 800)}],
           "measured": {"a/nvlamb": [0.4, 0.25], "b/muon": [0.5]}}
    r0, r1 = v.round_rows(doc, 0), v.round_rows(doc, 1)
    assert [(r.optimizer, r.error) for r in r0] == [("nvlamb", 0.0), ("muon", 0.0)]
    assert [(r.optimizer, r.predicted_s, r.measured_s) for r in r1] == [("nvlamb", 0.2, 0.25)]  # muon not yet run


def test_with_kfac_units_in_search_sets_the_flag_on_a_copy(v):
    from pipefisher.planning.comm_costs import CommCosts

    doc = {"format": "x", "compute": {"micro_batch": {"8": {"flops_per_s": 2e10, "seconds_fb": 0.1, "seconds_f": 0.05}},
                                      "kfac": {"8": {"curvature_flops_per_s": 3e10}}, "optimizer_step": {"seconds": 1}}}
    assert CommCosts().forward_share == {} and CommCosts().kfac_flops_per_s == {}
    flagged = v.with_kfac_units_in_search(doc)
    assert flagged["compute"]["kfac_in_search"] is True and "kfac_in_search" not in doc["compute"]
    del flagged["compute"]["kfac_in_search"]
    assert flagged == doc  # nothing else changes


def test_without_pieces_drops_only_the_per_piece_times_on_a_copy(v):
    from pipefisher.planning.comm_costs import CommCosts

    pieces = {"embeddings": {"seconds_f": 1e-3, "seconds_fb": 2e-3, "flops_f": 1.0}}
    doc = {"format": "x", "compute": {"micro_batch": {"8": {"flops_per_s": 2e10, "seconds_fb": 0.1, "seconds_f": 0.05,
                                                            "pieces": pieces}}}}
    stripped = v.without_pieces(doc)
    assert "pieces" not in stripped["compute"]["micro_batch"]["8"] and doc["compute"]["micro_batch"]["8"]["pieces"]
    stripped["compute"]["micro_batch"]["8"]["pieces"] = pieces
    assert stripped == doc  # nothing else changes
    assert CommCosts().piece_seconds == {}


def test_without_executor_overhead_drops_only_the_executor_row_on_a_copy(v):
    doc = {"format": "x", "compute": {"micro_batch": {"8": {"flops_per_s": 2e10, "seconds_fb": 0.1}},
                                      "executor": {"overhead_per_action_s": 1e-3}}}
    stripped = v.without_executor_overhead(doc)
    assert "executor" not in stripped["compute"] and doc["compute"]["executor"]
    stripped["compute"]["executor"] = doc["compute"]["executor"]
    assert stripped == doc


def test_without_executor_methods_keeps_the_overhead_and_drops_the_schedules_steps_on_a_copy(v):
    methods = {"chimera": {"stages": 2, "micro_batches": 8, "micro_batch_size": 8, "step_seconds": 0.4}}
    doc = {"format": "x", "compute": {"executor": {"overhead_per_action_s": 1e-3, "methods": methods}}}
    stripped = v.without_executor_methods(doc)
    assert stripped["compute"]["executor"] == {"overhead_per_action_s": 1e-3} and doc["compute"]["executor"]["methods"]
    assert v.without_executor_methods({"format": "x"}) == {"format": "x"}


def test_without_bookkeeping_drops_only_the_bookkeeping_on_a_copy(v):
    doc = {"format": "x", "compute": {"executor": {"overhead_per_action_s": 1e-3, "bookkeeping_seconds": 2e-3}}}
    stripped = v.without_bookkeeping(doc)
    assert stripped["compute"]["executor"] == {"overhead_per_action_s": 1e-3}
    assert doc["compute"]["executor"]["bookkeeping_seconds"] == 2e-3


def test_without_kfac_factor_drops_only_the_kfac_steps_on_a_copy(v):
    row = {"stages": 2, "micro_batches": 8, "micro_batch_size": 8, "step_seconds": 0.4}
    doc = {"format": "x", "compute": {"executor": {"overhead_per_action_s": 1e-3, "kfac": {"gpipe": row}}}}
    stripped = v.without_kfac_factor(doc)
    assert stripped["compute"]["executor"] == {"overhead_per_action_s": 1e-3} and doc["compute"]["executor"]["kfac"]


def test_without_muon_factor_drops_only_the_muon_steps_on_a_copy(v):
    row = {"stages": 2, "micro_batches": 8, "micro_batch_size": 8, "step_seconds": 0.4}
    doc = {"format": "x", "compute": {"executor": {"kfac": {"gpipe": row}, "muon": {"gpipe": row}}}}
    stripped = v.without_muon_factor(doc)
    assert stripped["compute"]["executor"] == {"kfac": {"gpipe": row}} and doc["compute"]["executor"]["muon"]


def test_a_repricing_less_each_rounds_bookkeeping(v):
    # round 0's search added 2 ms to every step, round 1's 3 ms: taken off the alternative's steps round by round
    doc = {"predicted_rounds": [{"a/x": {"step_s": 0.102}}, {"a/x": {"step_s": 0.203}}],
           "predicted_no_bookkeeping_rounds": [{"a/x": {"step_s": 0.100}}, {"a/x": {"step_s": 0.200}}],
           "predicted_no_kfac_factor_rounds": [{"a/x": {"step_s": 0.052, "k": 1}, "b/y": {"step_s": 0.032}},
                                               {"a/x": {"step_s": 0.063, "k": 1}, "b/y": {"step_s": 0.043}}]}
    alt = v.without_measured_bookkeeping(doc, "predicted_no_kfac_factor_rounds")
    assert [{k: round(x["step_s"], 6) for k, x in r.items()} for r in alt] == [{"a/x": 0.05, "b/y": 0.03},
                                                                               {"a/x": 0.06, "b/y": 0.04}]
    assert alt[0]["a/x"]["k"] == 1
    assert v.without_measured_bookkeeping(doc, "predicted_kfac_units_rounds") == []
    assert "predicted_no_overhead_rounds" not in v.WITH_BOOKKEEPING  # its search has no bookkeeping to take off


def test_pair_rounds_hold_whole_refresh_cycles_in_each_half_of_every_pair(v):
    ks = [1, 2, 4, 5, 6, 7]  # a 2-core Xeon's plans: the lcm of all of them was 420 rounds for --interleaved 84
    rounds = {k: v.pair_rounds(k, 84) for k in ks}
    assert rounds == {1: 84, 2: 84, 4: 88, 5: 90, 6: 84, 7: 84}
    assert all(r % (2 * k) == 0 and 84 <= r < 84 + 2 * k for k, r in rounds.items())  # whole cycles per half
    assert v.pair_rounds(0, 3) == 4 and v.pair_rounds(1, 1) == 2  # k=0 counts as 1; two halves at least
    assert v.rounds_text(84) == "84 rounds" and v.rounds_text({"a": 84, "b": 90}) == "84-90 rounds per pair"


def test_halves_are_the_measurement_twice(v):
    assert v.halves([1.0, 3.0, 5.0, 7.0]) == [2.0, 6.0]
    assert v.halves([1.0, 3.0, 5.0]) == [1.0, 3.0]  # an odd round is left out, not counted in one half only
    with pytest.raises(ValueError, match="two halves"):
        v.halves([1.0])


@pytest.mark.slow
def test_interleaved_measures_each_strategy_file_in_one_pair_of_processes(tmp_path):
    """--interleaved on a folder --measure filled: every pair's strategy file becomes a PipelineWorker of the same two
    processes (the file's pipeline and optimizer, as train.py strategy= runs it); each pair gets its two halves, and
    the report sets them beside the predictions and against themselves."""
    import json
    import subprocess
    import sys

    from pipefisher.config import DataConfig, ModelConfig
    from pipefisher.planning.strategy_file import strategy_document
    from pipefisher.planning.strategy_search import Strategy
    from tests.conftest import REPO

    folder = tmp_path / "search-round0" / "strategies"
    folder.mkdir(parents=True)
    model = ModelConfig(hidden_size=32, num_heads=2, vocab_size=512)
    keys = ["1f1b/nvlamb", "chimera/adamw", "gpipe/muon"]  # three: the halves' own Spearman needs three pairs
    for key in keys:
        method, optimizer = key.split("/")
        s = Strategy(method, 2, 1, 1, 1, 1, 2, 4, False, optimizer, samples_per_s=10.0, step_time_s=0.05,
                     utilization=0.9, interval=1, memory_gb=0.1, memory_per_worker_gb=(0.1, 0.1))
        doc = strategy_document(s, model, DataConfig(seq_len=16, max_predictions=2))
        (folder / f"{key.replace('/', '-')}.json").write_text(json.dumps(doc))
    predicted = {key: {"step_s": 0.05 + 0.01 * i, "steps": 100, "k": 1} for i, key in enumerate(keys)}
    (tmp_path / "collectives-round0.json").write_text(json.dumps({"compute": {  # the rates' GPipe step: the reference
        "model": "bert-tiny", "vocab_size": 512, "seq_len": 16, "max_predictions": 2,
        "executor": {"methods": {"gpipe": {"micro_batch_size": 2, "micro_batches": 4, "step_seconds": 0.05}}}}}))
    (tmp_path / "validation.json").write_text(json.dumps({
        "hardware": "test", "command": "test", "loads": [], "rates": [], "stages": 2, "predicted": predicted,
        "predicted_rounds": [predicted], "measured": {key: [0.05 + 0.02 * i] for i, key in enumerate(keys)},
        "measured_k": {}}))
    done = subprocess.run([sys.executable, "bench/validate_time_to_target.py", "--out", str(tmp_path),
                           "--interleaved", "4"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    il = json.loads((tmp_path / "validation.json").read_text())["interleaved"]
    assert il["rounds"] == {key: 4 for key in keys} and sorted(il["measured"]) == keys  # k=1: 4 is 2 cycles per half
    assert all(len(h) == 2 and all(x > 0 for x in h) for h in il["measured"].values())
    assert "interleaved: Spearman" in done.stdout and "interleaved against itself" in done.stdout
    ref = il["reference"]  # the rates' GPipe step ran in the same rotation, apart from the pairs
    assert len(ref["measured"]) == 2 and all(x > 0 for x in ref["measured"]) and ref["rates_step_s"] == 0.05
    assert "reference: the rates file's GPipe step (NVLAMB, N=4, micro-batch 2)" in done.stdout


def test_halves_drift_separates_a_common_slowdown_from_each_pairs_noise(v):
    measured = {"a/x": [0.9, 1.0], "b/x": [1.8, 2.0], "c/x": [0.95, 1.0]}  # every pair 10 % faster first but one
    common, median_dev, largest = v.halves_drift(measured)
    assert common == pytest.approx(0.9) and median_dev == pytest.approx(0.0)
    assert largest == pytest.approx(0.95 / 0.9 - 1)
    assert v.halves_drift({}) is None


def test_the_interleaved_report_divides_out_the_drift_since_the_rates_were_measured(v):
    """Rates measured at another moment than the interleaved run put every prediction 12 % under the measured step:
    the report's diagnostic says so (median 0.88), finds the one pair mispriced beyond it, and counts the rest
    within 10 % over that common factor, while the goal's own count (raw errors) stays what it is."""
    keys = [f"{s}/{o}" for s in ("gpipe", "1f1b", "chimera") for o in ("nvlamb", "adamw", "muon")]
    step = {k: 0.1 + 0.01 * i for i, k in enumerate(keys)}
    predicted = {k: _pred(0.88 * step[k] * (1.3 if k == "chimera/muon" else 1.0), 1000) for k in keys}
    doc = {"stages": 2, "predicted_rounds": [predicted], "builtin": None,
           "interleaved": {"rounds": 4, "warmup": 1, "seconds": 1, "load_before": "-", "load_after": "-",
                           "measured": {k: [step[k], step[k]] for k in keys}}}
    text = "\n".join(v.interleaved_lines(doc))
    assert "0 of 9 within 10%" in text  # every raw error is -12 % or +14 %: the goal's count
    assert ("diagnostic: predicted / interleaved step over every pair, median 0.88" in text
            and "worst pair then chimera/muon +30%, 8 of 9 within 10%" in text)


def test_the_reference_step_carries_every_prediction_by_the_machines_speed_in_the_run(v):
    """The rates file's GPipe step run again beside the pairs took 1.25x the file's: the machine ran slower than when
    the rates were measured. Predictions 20 % under every pair (0.8 of the step) carried by 1.25 land on the measured
    steps, so every pair is within 10 % there, while the goal's raw count stays 0; a file without GPipe's executor
    step has no reference."""
    rates = {"compute": {"model": "bert-tiny", "vocab_size": 8192, "seq_len": 64, "max_predictions": 10,
                         "executor": {"methods": {"gpipe": {"micro_batch_size": 8, "micro_batches": 8,
                                                            "step_seconds": 0.2, "bookkeeping_seconds": 0.05,
                                                            "stages": 2}}}}}
    ref = v.reference_shape(rates)
    assert ref == {"model": "bert-tiny", "vocab_size": 8192, "seq_len": 64, "max_predictions": 10,
                   "micro_batch_size": 8, "micro_batches": 8, "rates_step_s": 0.2, "rates_bookkeeping_s": 0.05}
    assert v.reference_shape({"compute": {"model": "bert-tiny", "executor": {}}}) is None
    assert v.reference_shape({}) is None
    keys = ["gpipe/nvlamb", "1f1b/muon", "chimera/kfac"]
    step = {k: 0.1 + 0.02 * i for i, k in enumerate(keys)}
    predicted = {k: {**_pred(0.8 * step[k], 1000), "time_s": 800 * step[k]} for k in keys}
    moved = v.carried(predicted, 1.25)
    assert all(moved[k]["step_s"] == pytest.approx(step[k]) and moved[k]["time_s"] == pytest.approx(1000 * step[k])
               and moved[k]["steps"] == 1000 for k in keys)
    assert predicted["gpipe/nvlamb"]["step_s"] == pytest.approx(0.08)  # a copy: the input is left as it was
    measured = {k: [step[k], step[k]] for k in keys}
    line = v.reference_line({**ref, "measured": [0.24, 0.26]}, predicted, measured)
    assert "took 250.0 ms against the file's 200.0 ms (1.250" in line
    assert "3 of 3 within 10%, median +0.0%" in line
    raw = v.summary(v.assemble_rows(predicted, measured))
    assert raw["within_goal"] == 0
    # a train.py run's step carries train.py's bookkeeping: the file's step is compared with it added
    line = v.reference_line({**ref, "measured": [0.3125]}, predicted, measured, "as a train.py run", bookkeeping=True)
    assert "run again as a train.py run took 312.5 ms against the file's 250.0 ms (1.250" in line


def test_the_reference_half_by_half_shows_when_it_drifts_otherwise_than_the_pairs(v):
    """The pairs run at one speed in both halves; the reference slows by a fifth in the second: the first half's
    factor carries every prediction onto its pair, the second's overshoots them all, and the line says the reference
    drifted where the pairs did not."""
    keys = ["gpipe/nvlamb", "1f1b/muon", "chimera/kfac"]
    step = {k: 0.1 + 0.02 * i for i, k in enumerate(keys)}
    predicted = {k: _pred(0.8 * step[k], 1000) for k in keys}
    measured = {k: [step[k], step[k]] for k in keys}
    line = v.reference_halves_line({"rates_step_s": 0.2, "measured": [0.25, 0.3]}, predicted, measured)
    assert "first half 1.250: 3 of 3 within 10%" in line
    assert "second half 1.500: 0 of 3 within 10%, worst +20.0%" in line
    assert "the reference 0.833, the pairs 1.000" in line


def test_the_reference_run_is_the_config_the_rates_timed(v):
    """train.py's keys for the reference compose to the config measure.collectives timed GPipe's step with
    (pipeline_config: same pipeline, stages, micro-batches, shape, optimizer and vocabulary)."""
    import torch
    from hydra import compose, initialize_config_dir

    from pipefisher.config import register_configs, to_train_config
    from pipefisher.measure.executor_overhead import pipeline_config
    from tests.conftest import REPO

    shape = {"model": "bert-tiny", "vocab_size": 512, "seq_len": 16, "max_predictions": 2, "micro_batch_size": 2,
             "micro_batches": 8, "rates_step_s": 0.1}
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "pipefisher" / "conf"), version_base="1.3"):
        ours = to_train_config(compose(config_name="config", overrides=v.reference_keys(shape)))
    timed = pipeline_config("gpipe", "bert-tiny", 2, 8, 16, 2, 2, torch.device("cpu"), 512)
    for read in (lambda c: c.pipeline.method, lambda c: c.stages, lambda c: c.num_micro_batches,
                 lambda c: c.micro_batch_size, lambda c: c.data.seq_len, lambda c: c.data.max_predictions,
                 lambda c: c.model.vocab_size, lambda c: c.optimizer.name, lambda c: c.data.kind):
        assert read(ours) == read(timed)


def test_every_repricing_measured_with_the_rates_is_reported_and_strips_a_copy(v):
    """Each rates file --measure writes beside the real one is reported under its key (the legacy key only reads
    old files), and each transform leaves the measured document as it was."""
    assert [k for k, _, _ in v.REPRICE_FILES] == [k for k, _ in v.REPRICINGS if k != "predicted_legacy_rounds"]
    doc = {"compute": {"micro_batch": {"8": {"flops_per_s": 1.0, "pieces": {}}},
                       "executor": {"overhead_per_action_s": 1e-3, "bookkeeping_seconds": 2e-3, "methods": {},
                                    "kfac": {}, "muon": {}},
                       "newton_schulz": {"flops_per_s": 1.0}}}
    before = repr(doc)
    for _, _, transform in v.REPRICE_FILES:
        assert transform(doc) != doc
    assert repr(doc) == before


def test_restep_takes_every_pairs_steps_from_another_calibration_and_leaves_out_what_it_lacks(v) -> None:
    """Study 20's runs re-read with study 18's budget calibration: steps = the reference's steps to the loss × the
    optimizer's multiplier (the same on both sides, so step errors stay); AdamW, which the file lacks, is left
    out of every table and listed; a loss outside the file's range is refused naming it."""
    from pipefisher.planning.calibration import parse_calibration
    from tests.conftest import calibration_doc

    cal = parse_calibration(calibration_doc(), "cal.json")
    pair = lambda step, steps, k=1: {"step_s": step, "steps": steps, "k": k, "time_s": step * steps}  # noqa: E731
    doc = {"predicted": {"chimera/nvlamb": pair(0.1, 1606), "chimera/adamw": pair(0.1, 1606),
                         "chimera/muon": pair(0.12, 1245)},
           "predicted_rounds": [{"chimera/nvlamb": pair(0.1, 1606), "chimera/adamw": pair(0.1, 1606),
                                 "chimera/muon": pair(0.12, 1245)}],
           "measured": {"chimera/nvlamb": [0.11, 0.09], "chimera/adamw": [0.1], "chimera/muon": [0.125]},
           "interleaved": {"measured": {"chimera/nvlamb": [0.1], "chimera/adamw": [0.1], "chimera/muon": [0.12]}}}
    out = v.restep(doc, cal, 6.0)
    assert out["unpriced"] == ["chimera/adamw"]
    assert set(out["predicted"]) == set(out["measured"]) == set(out["interleaved"]["measured"]) == \
        {"chimera/nvlamb", "chimera/muon"}
    assert out["predicted"]["chimera/nvlamb"]["steps"] == 500.0  # the reference's steps to loss 6.0
    assert out["predicted"]["chimera/muon"]["steps"] == pytest.approx(500.0 / 3.0)  # 3x fewer
    assert out["predicted_rounds"][0]["chimera/muon"]["steps"] == pytest.approx(500.0 / 3.0)
    assert "chimera/adamw" in doc["predicted"]  # the input is not changed
    before = {r.optimizer: r.error for r in v.assemble_rows(doc["predicted"], doc["measured"])}
    after = {r.optimizer: r for r in v.assemble_rows(out["predicted"], out["measured"])}
    assert all(after[o].error == before[o] for o in after)  # steps cancel in a step's error
    # the order can change: Muon's time is now 1/3 of NVLAMB's steps x its 1.2x step, ahead of NVLAMB
    assert after["muon"].predicted_time_s < after["nvlamb"].predicted_time_s
    text = v.report({**out, "hardware": "h", "command": "c", "interleaved": None})
    assert "not calibrated, left out: chimera/adamw" in text
    assert out["unpriced_measured"] == {"chimera/adamw": [0.1]}  # still the noise check's twin of NVLAMB
    assert "NVLAMB / AdamW measured step - 1 (the same pipeline, priced equal): chimera +0%" in text
    with pytest.raises(ValueError, match="--target-loss=7: the calibration's reference covers held-out losses 5 .. 6"):
        v.restep(doc, cal, 7.0)
