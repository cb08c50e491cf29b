"""Communication costs for the strategy search: the latency + bytes/bandwidth fit, the ring
extrapolation to unmeasured group sizes, the JSON the measurement writes, and the measurement itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipefisher.planning.comm_costs import COLLECTIVES_FORMAT, CommCosts, LinkFit, collectives_json, fit_latency_bandwidth
from pipefisher.planning.costs import Hardware


def test_fit_recovers_hand_latency_and_bandwidth_from_exact_points():
    # 50 us + bytes / 2 GB/s, at 4 KiB .. 16 MiB
    points = [(n, 50e-6 + n / 2e9) for n in (4096, 65536, 1 << 20, 16 << 20)]
    fit = fit_latency_bandwidth(points)
    assert fit.latency_s == pytest.approx(50e-6, rel=1e-9)
    assert fit.bytes_per_s == pytest.approx(2e9, rel=1e-9)


def test_fit_weighs_relative_error_so_small_messages_set_the_latency():
    # Hand values: two points, exact line through them: t(1e3)=1e-4, t(1e7)=1e-4+1e7/1e9=1.01e-2.
    fit = fit_latency_bandwidth([(1e3, 1e-4 + 1e3 / 1e9), (1e7, 1e-4 + 1e7 / 1e9)])
    assert (fit.latency_s, fit.bytes_per_s) == pytest.approx((1e-4, 1e9), rel=1e-9)
    # A third, noisy large point (+10 %) moves the bandwidth, and the latency stays near 100 us.
    noisy = fit_latency_bandwidth([(1e3, 1.01e-4), (1e4, 1.1e-4), (1e7, 1.01e-2 * 1.1)])
    assert noisy.latency_s == pytest.approx(1e-4, rel=0.05)
    assert 0.85e9 < noisy.bytes_per_s < 1e9


def test_fit_clamps_a_negative_latency_and_refits_the_slope():
    # Pure bandwidth with a super-linear bump at the large end pulls the intercept below 0.
    points = [(1e3, 1e-6), (1e6, 1e-3), (1e7, 1.2e-2)]
    fit = fit_latency_bandwidth(points)
    assert fit.latency_s == 0.0
    # Slope alone minimizing sum(((b x - t)/t)^2): b = sum(x/t) / sum(x^2/t^2).
    b = sum(x / t for x, t in points) / sum(x * x / t / t for x, t in points)
    assert fit.bytes_per_s == pytest.approx(1 / b)


def test_fit_refuses_a_single_size():
    with pytest.raises(ValueError, match="two distinct message sizes"):
        fit_latency_bandwidth([(4096, 1e-4), (4096, 2e-4)])


def test_comm_costs_use_the_measured_fit_and_extrapolate_other_group_sizes_as_a_ring():
    costs = CommCosts({"all_reduce": {2: LinkFit(1e-4, 1e9)}, "all_gather": {2: LinkFit(2e-4, 2e9)}})
    assert costs.seconds("all_reduce", 2, 1e6) == pytest.approx(1e-4 + 1e-3)
    assert costs.seconds("all_reduce", 1, 1e6) == 0.0
    # g=4 from g=2: latency x (4-1)/(2-1); bytes x (2*3/4)/(2*1/2) = 1.5
    assert costs.seconds("all_reduce", 4, 1e6) == pytest.approx(3e-4 + 1.5e-3)
    # all_gather g=4: bytes x (3/4)/(1/2) = 1.5
    assert costs.seconds("all_gather", 4, 4e6) == pytest.approx(6e-4 + 1.5 * 2e-3)
    # Nothing measured for reduce_scatter or p2p: the ring model at the hardware's bandwidths, no latency.
    hw = Hardware(p2p_bytes_per_s=1e10, allreduce_bytes_per_s=5e9)
    analytic = CommCosts({}, hw)
    assert analytic.seconds("reduce_scatter", 4, 4e6) == pytest.approx(0.75 * 4e6 / 5e9)
    assert analytic.seconds("p2p", 2, 1e6) == pytest.approx(1e6 / 1e10)
    assert analytic.seconds("all_reduce", 8, 1e6) == pytest.approx(2 * 7 / 8 * 1e6 / 5e9)


def test_comm_costs_read_the_measurement_json_and_refuse_bad_files(tmp_path: Path):
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096, 50e-6 + 4096 / 2e9), (1 << 20, 50e-6 + (1 << 20) / 2e9)]}})
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    costs = CommCosts.from_json(path)
    assert costs.fits["all_reduce"][2].bytes_per_s == pytest.approx(2e9)
    assert "all_reduce@2 50 us" in costs.describe()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "format": "x"}))
    with pytest.raises(ValueError, match=f"comm_costs={bad}: field format"):
        CommCosts.from_json(bad)
    bad.write_text(json.dumps({"format": COLLECTIVES_FORMAT, "ops": {"all_reduce": {"2": {"latency_s": 1e-4}}}}))
    with pytest.raises(ValueError, match="field ops.all_reduce.2 needs latency_s and bytes_per_s"):
        CommCosts.from_json(bad)
    with pytest.raises(ValueError, match="cannot be read"):
        CommCosts.from_json(tmp_path / "missing.json")


@pytest.mark.slow
def test_measurement_at_world_2_writes_fits_the_search_reads(tmp_path: Path):
    from pipefisher.measure.collectives import measure_collectives

    out = tmp_path / "coll.json"
    doc = measure_collectives(out, world=2, min_bytes=4096, max_bytes=256 << 10, repeats=3, budget_s=0.05,
                              model="bert-tiny", micro_batch_sizes=[2], seq_len=32, max_predictions=5,
                              executor_micro_batches=2, executor_methods=["gpipe", "chimera", "zb-v"],
                              executor_kfac_methods=["gpipe"])
    assert doc["backend"] == "gloo" and doc["world_size"] == 2
    assert set(doc["ops"]) == {"all_reduce", "all_gather", "reduce_scatter", "p2p"}
    for op, groups in doc["ops"].items():
        row = groups["2"]
        assert [int(x) for x, _ in row["points"]] == [4096, 16384, 65536, 262144]
        assert row["latency_s"] >= 0 and row["bytes_per_s"] > 0
    costs = CommCosts.from_json(out)
    assert costs.seconds("all_reduce", 2, 1 << 20) > 0
    rate = doc["compute"]["micro_batch"]["2"]
    assert rate["flops_per_s"] == pytest.approx(rate["flops_fb"] / rate["seconds_fb"])
    assert doc["compute"]["tensor_parallel"]["2"]["2"]["seconds_fb"] > 0  # bert-tiny's 2 heads split over 2
    assert CommCosts.from_json(out).tp_seconds_fb[(2, 2)] > 0
    assert 0 < rate["seconds_f"] < rate["seconds_fb"]  # the forward alone, part of the forward + backward
    from pipefisher.model.config import BertConfig
    from pipefisher.model.partition import layer_costs
    from pipefisher.planning.comm_costs import PIECES

    flops = layer_costs(BertConfig.from_size("tiny"), 32, 5)  # the pieces: pipeline layers 0, 1 and L + 1
    assert {k: p["flops_f"] for k, p in rate["pieces"].items()} == dict(zip(PIECES, (2 * flops[0], 2 * flops[1],
                                                                                      2 * flops[-1])))
    assert all(0 < p["seconds_f"] < p["seconds_fb"] for p in rate["pieces"].values())
    executor = doc["compute"]["executor"]  # GPipe over the 2 processes, N=2: 2 (N + D - 1) = 6 compute actions
    assert (executor["method"], executor["stages"], executor["micro_batches"]) == ("gpipe", 2, 2)
    assert executor["step_seconds"] > 0 and executor["simulated_seconds"] > 0
    assert executor["overhead_per_action_s"] == pytest.approx(
        max(0.0, executor["step_seconds"] - executor["simulated_seconds"]) / 6)
    assert CommCosts.from_json(out).action_overhead_s == executor["overhead_per_action_s"]
    methods = executor["methods"]  # GPipe again, taking turns with the others; zb-v needs N >= 2D = 4
    assert list(methods)[0] == "gpipe" and methods["gpipe"]["step_seconds"] > 0
    assert methods["gpipe"]["simulated_seconds"] > 0 and methods["chimera"]["simulated_seconds"] > 0
    assert methods["chimera"]["step_seconds"] > 0 and methods["chimera"]["micro_batches"] == 2
    assert "num_micro_batches" in methods["zb-v"]["refused"]
    assert set(CommCosts.from_json(out).executor_steps) == {"gpipe", "chimera"}
    kfac_step = executor["kfac"]["gpipe"]  # GPipe with K-FAC every step and with NVLAMB, taking turns
    assert kfac_step["step_seconds"] > 0 and kfac_step["nvlamb_step_seconds"] > 0 and kfac_step["micro_batches"] == 2
    assert kfac_step["rounds"] == 12 and math.isfinite(kfac_step["extra_seconds"])
    read_kfac = CommCosts.from_json(out).kfac_executor_steps["gpipe"]
    assert (read_kfac.step_seconds, read_kfac.extra_seconds) == (kfac_step["step_seconds"], kfac_step["extra_seconds"])
    assert executor["bookkeeping_seconds"] > 0  # the timeline gathered to rank 0 and read, after every step
    assert CommCosts.from_json(out).step_bookkeeping_s == executor["bookkeeping_seconds"]
    assert CommCosts.from_json(out).piece_seconds[2]["heads"] == tuple(rate["pieces"]["heads"][k] for k in
                                                                       ("seconds_f", "seconds_fb", "flops_f"))
    units = doc["compute"]["kfac"]["2"]
    # bert-tiny (H=128, FFN 512), T = 2 x 32 rows: CURV_A + CURV_B = 2 T (in^2 + out^2) over the layer's 6 Linears
    curvature_flops = sum(2.0 * 64 * (i * i + o * o) for i, o in [(128, 128)] * 4 + [(128, 512), (512, 128)])
    assert units["curvature_flops_per_s"] == pytest.approx(curvature_flops / units["curvature_seconds"])
    assert units["precondition_flops_per_s"] > 0 and units["invert_flops_per_s"] > 0
    read = CommCosts.from_json(out)
    assert read.forward_share[2] == pytest.approx(rate["seconds_f"] / rate["seconds_fb"])
    assert read.kfac_flops_per_s[2] == (units["curvature_flops_per_s"], units["precondition_flops_per_s"],
                                        units["invert_flops_per_s"])
    assert not read.kfac_in_search  # recorded, priced in the search only where the file asks
    ns = doc["compute"]["newton_schulz"]  # Muon's orthogonalization of one encoder layer's six weights
    ns_flops = sum(5 * (4 * 128 * 128 * n + 2 * 128 ** 3) for n in [128] * 4 + [512, 512])
    assert ns["flops"] == ns_flops and ns["flops_per_s"] == pytest.approx(ns_flops / ns["seconds"])
    assert ns["dtype"] in ("bfloat16", "float32") and read.ns_flops_per_s == ns["flops_per_s"]
    doc["compute"]["kfac_in_search"] = True
    out.write_text(json.dumps(doc))
    assert CommCosts.from_json(out).kfac_in_search


def test_a_measured_tp_step_scales_the_modelled_tp_stage_costs(tmp_path: Path):
    """A tensor-parallel forward + backward measured at 1.5x what FLOPs and all-reduces predict makes
    every tp stage cost 1.5x; one process (tp=1), or a tp without a measurement, is left as modelled."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import Hardware, RunShape
    from pipefisher.planning.strategy_search import hybrid_costs, tp_measured_over_modelled

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {4: 5e10}, 4e9, {}, ("bert-mini", 64, 10))
    assert tp_measured_over_modelled(plain, 2, 4) == 1.0
    unit = replace(plain, tp_seconds_fb={(2, 4): 1.0})
    modelled = 1.0 / tp_measured_over_modelled(unit, 2, 4)
    slow = replace(plain, tp_seconds_fb={(2, 4): 1.5 * modelled})
    assert tp_measured_over_modelled(slow, 2, 4) == pytest.approx(1.5)
    assert tp_measured_over_modelled(slow, 4, 4) == 1.0  # not measured at tp=4
    run = RunShape(BertConfig.from_size("mini"), "gpipe", 1, 2, 4, seq_len=64, max_predictions=10)
    hw = plain.hardware_for(4)
    base, scaled = hybrid_costs(run, 1, 2, hw, plain), hybrid_costs(run, 1, 2, hw, slow)
    assert [s / b for s, b in zip(scaled.forward_ns + scaled.backward_ns, base.forward_ns + base.backward_ns)] == \
        pytest.approx([1.5, 1.5], rel=1e-6)
    assert hybrid_costs(run, 1, 1, hw, slow).forward_ns == hybrid_costs(run, 1, 1, hw, plain).forward_ns
    # The file's field, read back.
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096, 1e-4), (1 << 20, 1e-3)]}},
                           compute={"model": "bert-mini", "seq_len": 64, "max_predictions": 10,
                                    "micro_batch": {"4": {"flops_per_s": 5e10}},
                                    "optimizer_step": {"memory_bytes_per_s": 4e9},
                                    "tensor_parallel": {"2": {"4": {"seconds_fb": 0.25}}}})
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    read = CommCosts.from_json(path)
    assert read.tp_seconds_fb == {(2, 4): 0.25} and read.compute_model == ("bert-mini", 64, 10)
    assert "tp=2 micro-batch 4: 250 ms" in read.describe()


def test_the_compute_measurement_takes_the_runs_vocabulary(tmp_path: Path):
    """``--vocab-size``: the model measured is the run's (its heads' FLOPs follow the vocabulary); the file
    names it, and the tp ratio models the same model (bert-tiny's heads at vocabulary 30,522 are most of its
    FLOPs, at 8,192 about a quarter)."""
    from dataclasses import replace

    import torch

    from pipefisher.measure.compute_rates import model_and_batch as _model_and_batch
    from pipefisher.planning.strategy_search import tp_measured_over_modelled

    bert, net, batch = _model_and_batch("bert-tiny", 2, 16, 2, torch.device("cpu"), vocab_size=512)
    assert bert.vocab_size == 512 and int(batch["input_ids"].max()) < 512
    rows = {p.shape[0] for p in net.parameters()}
    assert 512 in rows and 30522 not in rows  # the word embedding (tied to the MLM decoder) has the run's rows
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096, 1e-4), (1 << 20, 1e-3)]}},
                           compute={"model": "bert-tiny", "vocab_size": 8192, "seq_len": 64, "max_predictions": 10,
                                    "micro_batch": {"8": {"flops_per_s": 2e10}},
                                    "optimizer_step": {"memory_bytes_per_s": 4e9},
                                    "tensor_parallel": {"2": {"8": {"seconds_fb": 0.25}}}})
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    read = CommCosts.from_json(path)
    assert read.compute_vocab_size == 8192
    preset = replace(read, compute_vocab_size=None)  # the same seconds against the preset's (larger) heads
    assert tp_measured_over_modelled(read, 2, 8) > 1.5 * tp_measured_over_modelled(preset, 2, 8)
    del doc["compute"]["vocab_size"]  # files written before the field: the preset's
    path.write_text(json.dumps(doc))
    assert CommCosts.from_json(path).compute_vocab_size is None


def test_kfac_factor_all_reduces_are_priced_by_the_measured_collectives():
    """Study 20: the search priced K-FAC's factor all-reduce from the FLOP estimate's ring model (no latency:
    0.01 ms per layer at D=2 chimera) while the profile measured 0.3-1.1 ms; it now takes the same collective
    model as the gradient all-reduce. Without a file the two agree (train.py's plans do not move)."""
    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import RunShape, estimate_run_costs, kfac_linear_dims
    from pipefisher.planning.strategy_search import hybrid_costs

    bert = BertConfig(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512, vocab_size=8192)
    run = RunShape(bert, "chimera", 2, 4, 8, seq_len=64, max_predictions=10)  # two pipes: factors over 2 replicas
    hw = Hardware(flops_per_s=1e10, p2p_bytes_per_s=2e9, memory_bytes_per_s=1e10)
    assert hybrid_costs(run, 1, 1, hw, CommCosts({}, hw)).sync_factor_ns == estimate_run_costs(run, hw).sync_factor_ns
    measured = CommCosts({"all_reduce": {2: LinkFit(500e-6, 1e9)}}, hw)
    got = hybrid_costs(run, 1, 1, hw, measured).sync_factor_ns
    want = tuple(tuple(round((500e-6 + 4.0 * (i * i + o * o) / 1e9) * 1e9) for i, o in kfac_linear_dims(bert, n))
                 for n in run.encoder_layers)
    assert got == want and min(min(row) for row in got) >= 500_000


def test_step_prices_the_tied_weight_once_where_a_worker_holds_both_of_its_copies():
    """Study 20: a chimera D=2 worker holds stage 0 and the last stage, whose word embedding and MLM decoder are
    one Parameter on that worker (runtime.build.tie_local_copies), so its NVLAMB step updates the whole model
    once: bert-tiny's parameter count, not the two stages' sum (the search charged 2.60 M for 1.55 M)."""
    from pipefisher.model.bert import build_full_model
    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import STEP_BYTES_PER_PARAM, RunShape
    from pipefisher.planning.strategy_search import hybrid_costs

    bert = BertConfig(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512, vocab_size=8192)
    whole = sum(p.numel() for p in build_full_model(bert).parameters() if p.requires_grad)
    hw = Hardware(flops_per_s=1e10, p2p_bytes_per_s=1e30, memory_bytes_per_s=1e9)  # collectives free
    chimera = hybrid_costs(RunShape(bert, "chimera", 2, 4, 8, seq_len=64, max_predictions=10), 1, 1, hw,
                           CommCosts({}, hw))
    assert chimera.step_ns == pytest.approx(whole * STEP_BYTES_PER_PARAM / 1e9 * 1e9, abs=2)


def test_measured_forward_share_and_kfac_rates_reprice_the_search_s_stages_and_units(tmp_path: Path):
    """A forward measured at a third of the forward + backward leaves the stage costs as the FLOP count's 1:2 split;
    at half, F = B with F + B unchanged (a recomputing stage keeps its extra forward). K-FAC's curvature and
    preconditioning measured at 2x and 4x the model's rate cost (where the file asks the search to use them)
    1/2 and 1/4 of the FLOP estimate, and the inversion
    at half the rate twice the estimate (absent: at the model's rate); under EKFAC only the curvature moves (its
    inversion and preconditioning are other kernels). Without the measurements nothing changes."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.strategy_search import hybrid_costs

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9)
    run = RunShape(BertConfig.from_size("mini"), "1f1b", 2, 4, 8, seq_len=64, max_predictions=10,
                   recompute_stages=(1,))
    hw = plain.hardware_for(8)
    base = hybrid_costs(run, 1, 1, hw, plain)
    third = hybrid_costs(run, 1, 1, hw, replace(plain, forward_share={8: 1 / 3}))
    assert third.forward_ns == pytest.approx(base.forward_ns, abs=1) and third.backward_ns == pytest.approx(base.backward_ns, abs=1)
    half = hybrid_costs(run, 1, 1, hw, replace(plain, forward_share={2: 0.9, 8: 0.5}))  # the nearest size: 8
    f0, f1 = base.forward_ns
    assert half.forward_ns == pytest.approx((1.5 * f0, 1.5 * f1), abs=1)
    assert half.backward_ns == pytest.approx((1.5 * f0, 1.5 * f1 + 1.5 * f1), abs=2)  # stage 1 recomputes: B + F
    rates = {8: (2 * hw.flops_per_s, 4 * hw.flops_per_s, None)}
    unused = hybrid_costs(run, 1, 1, hw, replace(plain, kfac_flops_per_s=rates))  # measured, not asked for
    assert (unused.curv_a_ns, unused.precond_ns, unused.invert_ns) == (base.curv_a_ns, base.precond_ns, base.invert_ns)
    plain = replace(plain, kfac_in_search=True)
    fast = hybrid_costs(run, 1, 1, hw, replace(plain, kfac_flops_per_s=rates))
    for got, want in ((fast.curv_a_ns, base.curv_a_ns), (fast.curv_b_ns, base.curv_b_ns)):
        assert [[x for x in row] for row in got] == [[round(x / 2) for x in row] for row in want]
    assert list(fast.precond_ns) == [round(x / 4) for x in base.precond_ns]
    assert fast.invert_ns == base.invert_ns and fast.forward_ns == base.forward_ns
    slow_inverse = hybrid_costs(run, 1, 1, hw, replace(plain, kfac_flops_per_s={8: (*rates[8][:2], hw.flops_per_s / 2)}))
    assert [list(row) for row in slow_inverse.invert_ns] == [[2 * x for x in row] for row in base.invert_ns]
    ekfac = replace(run, preconditioner="ekfac")
    e_base = hybrid_costs(ekfac, 1, 1, hw, plain)
    e_fast = hybrid_costs(ekfac, 1, 1, hw, replace(plain, kfac_flops_per_s={8: (*rates[8][:2], hw.flops_per_s / 2)}))
    assert e_fast.precond_ns == e_base.precond_ns and e_fast.invert_ns == e_base.invert_ns
    assert [list(r) for r in e_fast.curv_a_ns] == [[round(x / 2) for x in r] for r in e_base.curv_a_ns]
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}},
                           compute={"model": "bert-mini", "seq_len": 64, "max_predictions": 10,
                                    "micro_batch": {"8": {"flops_per_s": 5e10, "seconds_fb": 0.3, "seconds_f": 0.4}}})
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="seconds_f must be positive and below seconds_fb"):
        CommCosts.from_json(tmp_path / "bad.json")


def test_measured_pieces_price_each_stage_as_the_sum_of_its_pieces(tmp_path: Path):
    """With the pieces measured (the embeddings, an encoder layer, the heads, each alone), a stage's F is the sum of
    its pieces' forwards and B of their forward + backward less the forward, whatever the whole model's FLOP rate;
    a recomputing stage's B adds its F; another micro-batch size scales each piece by its FLOPs; at tp > 1, or with
    a piece missing, the FLOP rate prices the stages as before. A file with an unknown piece or a forward not below
    its forward + backward is refused, naming the field."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.model.partition import layer_costs
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.strategy_search import hybrid_costs

    bert = BertConfig.from_size("tiny")  # 2 encoder layers: at pp=4 one piece per stage
    flops = layer_costs(bert, 64, 10)
    pieces = {"embeddings": (1e-3, 4e-3, 8 * flops[0]), "encoder_layer": (10e-3, 30e-3, 8 * flops[1]),
              "heads": (7e-3, 20e-3, 8 * flops[-1])}
    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9, forward_share={8: 0.4})
    measured = replace(plain, piece_seconds={8: pieces})
    hw = plain.hardware_for(8)
    run = RunShape(bert, "1f1b", 4, 4, 8, seq_len=64, max_predictions=10, recompute_stages=(2,))
    cost = hybrid_costs(run, 1, 1, hw, measured)
    assert cost.forward_ns == pytest.approx((1e6, 10e6, 10e6, 7e6), abs=1)
    assert cost.backward_ns == pytest.approx((3e6, 20e6, 20e6 + 10e6, 13e6), abs=1)  # stage 2 recomputes
    two = hybrid_costs(RunShape(bert, "1f1b", 2, 4, 8, seq_len=64, max_predictions=10), 1, 1, hw, measured)
    assert two.forward_ns == pytest.approx((11e6, 17e6), abs=1) and two.backward_ns == pytest.approx((23e6, 33e6), abs=1)
    half = hybrid_costs(RunShape(bert, "1f1b", 4, 4, 4, seq_len=64, max_predictions=10), 1, 1,
                        plain.hardware_for(4), measured)  # micro-batch 4 from the pieces at 8: half the FLOPs
    assert half.forward_ns == pytest.approx((0.5e6, 5e6, 5e6, 3.5e6), abs=1)
    flop_rate = hybrid_costs(run, 1, 1, hw, plain)
    assert flop_rate.forward_ns != cost.forward_ns
    partial = replace(plain, piece_seconds={8: {k: v for k, v in pieces.items() if k != "heads"}})
    assert hybrid_costs(run, 1, 1, hw, partial).forward_ns == flop_rate.forward_ns
    tp_run = RunShape(bert, "1f1b", 2, 4, 8, seq_len=64, max_predictions=10)
    assert hybrid_costs(tp_run, 1, 2, hw, measured).forward_ns == hybrid_costs(tp_run, 1, 2, hw, plain).forward_ns
    row = {"flops_per_s": 5e10, "seconds_fb": 0.3, "seconds_f": 0.1,
           "pieces": {k: {"seconds_f": f, "seconds_fb": fb, "flops_f": fl} for k, (f, fb, fl) in pieces.items()}}
    compute = {"model": "bert-tiny", "seq_len": 64, "max_predictions": 10, "micro_batch": {"8": row}}
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}, compute=compute)
    (tmp_path / "ok.json").write_text(json.dumps(doc))
    assert CommCosts.from_json(tmp_path / "ok.json").piece_seconds == {8: pieces}
    for bad in ({"pooler": {"seconds_f": 1e-3, "seconds_fb": 2e-3, "flops_f": 1.0}},
                {"heads": {"seconds_f": 3e-3, "seconds_fb": 2e-3, "flops_f": 1.0}}):
        row["pieces"] = bad
        (tmp_path / "bad.json").write_text(json.dumps(collectives_json(
            "gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}, compute=compute)))
        with pytest.raises(ValueError, match=r"compute.micro_batch.8.pieces"):
            CommCosts.from_json(tmp_path / "bad.json")


def test_the_executor_overhead_is_added_to_every_compute_action_the_search_prices(tmp_path: Path):
    """The measured overhead per compute action (compute.executor) is added to each F and B, and on a split-backward
    schedule to each I and W; nothing else moves, and without it the costs are unchanged. A negative overhead is
    refused, naming the field."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.strategy_search import pipeline_costs

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9)
    hw = plain.hardware_for(8)
    for method in ("1f1b", "zb-h1"):
        run = RunShape(BertConfig.from_size("mini"), method, 2, 4, 8, seq_len=64, max_predictions=10)
        base, more = pipeline_costs(run, hw, plain), pipeline_costs(run, hw, replace(plain, action_overhead_s=2e-3))
        for name in ("forward_ns", "backward_ns", "input_grad_ns", "weight_grad_ns"):
            assert getattr(more, name) == tuple(x + 2_000_000 for x in getattr(base, name)), (method, name)
        assert (more.step_ns, more.sync_ns, more.p2p_ns) == (base.step_ns, base.sync_ns, base.p2p_ns)
    compute = {"model": "bert-tiny", "seq_len": 64, "max_predictions": 10,
               "micro_batch": {"8": {"flops_per_s": 5e10, "seconds_fb": 0.3}},
               "executor": {"overhead_per_action_s": 1.5e-3}}
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}, compute=compute)
    (tmp_path / "ok.json").write_text(json.dumps(doc))
    assert CommCosts.from_json(tmp_path / "ok.json").action_overhead_s == 1.5e-3
    compute["executor"]["overhead_per_action_s"] = -1e-3
    (tmp_path / "bad.json").write_text(json.dumps(collectives_json(
        "gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}, compute=compute)))
    with pytest.raises(ValueError, match="compute.executor.overhead_per_action_s"):
        CommCosts.from_json(tmp_path / "bad.json")


def test_solve_factor_finds_the_scale_that_matches_a_measured_step_and_clamps_outside_its_range():
    from pipefisher.planning.executor_calibration import FACTOR_RANGE, scale_compute, solve_factor
    from pipefisher.simulate import CostModel

    def step(r: float) -> float:
        return 0.1 + 0.5 * r  # a fixed part (STEP, messages) and a scaled one

    assert solve_factor(step, 0.85) == pytest.approx(1.5, abs=1e-3)
    assert solve_factor(step, 0.01) == FACTOR_RANGE[0] and solve_factor(step, 10.0) == FACTOR_RANGE[1]
    with pytest.raises(ValueError, match="positive"):
        solve_factor(step, 0.0)
    cost = CostModel(forward_ns=(10, 20), backward_ns=(30, 40), step_ns=7, p2p_ns=3, input_grad_ns=(5, 6),
                     weight_grad_ns=(1, 2))
    scaled = scale_compute(cost, 2.0)
    assert (scaled.forward_ns, scaled.backward_ns, scaled.input_grad_ns, scaled.weight_grad_ns) == (
        (20, 40), (60, 80), (10, 12), (2, 4))
    assert (scaled.step_ns, scaled.p2p_ns) == (7, 3)


def test_a_measured_schedule_step_is_matched_at_its_shape_and_scales_that_schedule_alone(tmp_path: Path):
    """With a schedule's executor step measured (compute.executor.methods), the search's simulated step of that
    schedule at the measured shape equals it, the factor carries to its other shapes at the same D (more
    micro-batches, another optimizer), and other schedules and other D are priced as before. The file round-trips
    the measured steps, skips refused ones and names a bad field."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.comm_costs import ExecutorStep
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.predict import predict_schedule
    from pipefisher.planning.strategy_search import executor_factor, pipeline_costs

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9, compute_model=("bert-tiny", 64, 10),
                      action_overhead_s=1e-3)
    hw = plain.hardware_for(8)
    bert = BertConfig.from_size("tiny")

    def step(comm: CommCosts, method: str, stages: int = 2, n: int = 4, optimizer: str = "nvlamb") -> float:
        run = RunShape(bert, method, stages, n, 8, seq_len=64, max_predictions=10)
        return predict_schedule(run.build_schedule(dp_width=1), pipeline_costs(run, hw, comm,
                                                                               optimizer=optimizer))[0].step_time_s

    before = step(plain, "chimera")
    measured = replace(plain, executor_steps={"chimera": ExecutorStep(2, 4, 8, 1, 1.4 * before)})
    assert step(measured, "chimera") == pytest.approx(1.4 * before, rel=1e-3)
    factor = executor_factor(RunShape(bert, "chimera", 2, 8, 8, seq_len=64, max_predictions=10), measured)
    assert factor > 1.4  # the fixed STEP and messages are not scaled: the compute must grow more
    assert step(measured, "chimera", n=8) > step(plain, "chimera", n=8) * 1.3
    assert step(measured, "chimera", optimizer="adamw") > step(plain, "chimera", optimizer="adamw") * 1.3
    assert step(measured, "1f1b") == step(plain, "1f1b")  # not measured: as before
    assert step(measured, "chimera", stages=4) == step(plain, "chimera", stages=4)  # measured at D=2 only
    again = replace(measured, action_overhead_s=5e-3)  # a copy with another term solves its own factor
    assert step(again, "chimera") == pytest.approx(1.4 * before, rel=1e-3)
    compute = {"model": "bert-tiny", "seq_len": 64, "max_predictions": 10,
               "micro_batch": {"8": {"flops_per_s": 5e10, "seconds_fb": 0.3}},
               "executor": {"overhead_per_action_s": 1e-3, "methods": {
                   "chimera": {"stages": 2, "micro_batches": 4, "micro_batch_size": 8, "num_virtual": 1,
                               "step_seconds": 0.25, "simulated_seconds": 0.2},
                   "zb-v": {"refused": "num_micro_batches=4: zb-v needs at least 2 x stages"}}}}
    doc = collectives_json("gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}, compute=compute)
    (tmp_path / "ok.json").write_text(json.dumps(doc))
    assert CommCosts.from_json(tmp_path / "ok.json").executor_steps == {"chimera": ExecutorStep(2, 4, 8, 1, 0.25)}
    compute["executor"]["methods"]["chimera"]["step_seconds"] = 0.0
    (tmp_path / "bad.json").write_text(json.dumps(collectives_json(
        "gloo", "cpu", 2, {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}, compute=compute)))
    with pytest.raises(ValueError, match="compute.executor.methods"):
        CommCosts.from_json(tmp_path / "bad.json")


def test_a_measured_muon_step_scales_the_part_of_muons_step_beyond_nvlambs(tmp_path: Path):
    """With GPipe's Muon step measured beside NVLAMB's (compute.executor.muon), the search's simulated Muon step
    exceeds its NVLAMB step by the measured extra; NVLAMB, AdamW and K-FAC are priced as before; a schedule measured
    on its own takes its own factor at its D, others GPipe's; the file round-trips it."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.comm_costs import ExecutorStep
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.predict import predict_schedule
    from pipefisher.planning.strategy_search import muon_step_factor, pipeline_costs

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9, compute_model=("bert-tiny", 64, 10),
                      action_overhead_s=1e-3)
    hw = plain.hardware_for(8)
    bert = BertConfig.from_size("tiny")

    def step(comm: CommCosts, method: str, optimizer: str, stages: int = 2) -> float:
        run = RunShape(bert, method, stages, 4, 8, seq_len=64, max_predictions=10)
        schedule = run.build_schedule(dp_width=1)
        return predict_schedule(schedule, pipeline_costs(run, hw, comm, schedule=schedule,
                                                         optimizer=optimizer))[0].step_time_s

    extra = step(plain, "gpipe", "muon") - step(plain, "gpipe", "nvlamb")
    assert extra > 0  # Newton-Schulz: the model prices Muon's step dearer than NVLAMB's
    measured = replace(plain, muon_executor_steps={"gpipe": ExecutorStep(2, 4, 8, 1, 9.0, 0.5 * extra)})
    assert step(measured, "gpipe", "muon") - step(measured, "gpipe", "nvlamb") == pytest.approx(0.5 * extra, rel=1e-2)
    assert 0.25 <= muon_step_factor(measured) < 1 and muon_step_factor(plain) == 1.0
    for method in ("gpipe", "1f1b", "chimera"):
        for optimizer in ("nvlamb", "adamw"):
            assert step(measured, method, optimizer) == step(plain, method, optimizer)
    assert step(measured, "1f1b", "muon") < step(plain, "1f1b", "muon")  # GPipe's factor on an unmeasured schedule
    chimera = step(plain, "chimera", "muon") - step(plain, "chimera", "nvlamb")
    own = replace(measured, muon_executor_steps={**measured.muon_executor_steps,
                                                 "chimera": ExecutorStep(2, 4, 8, 1, 9.0, 2.0 * chimera)})
    assert step(own, "chimera", "muon") - step(own, "chimera", "nvlamb") == pytest.approx(2.0 * chimera, rel=1e-2)
    assert step(own, "gpipe", "muon") == step(measured, "gpipe", "muon")
    row = {"stages": 2, "micro_batches": 4, "micro_batch_size": 8, "num_virtual": 1, "step_seconds": 0.25}
    compute = {"model": "bert-tiny", "seq_len": 64, "max_predictions": 10,
               "micro_batch": {"8": {"flops_per_s": 5e10, "seconds_fb": 0.3}},
               "executor": {"overhead_per_action_s": 1e-3,
                            "muon": {"gpipe": {**row, "extra_seconds": -0.004}, "zb-v": {"refused": "N"}}}}
    ops = {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}
    (tmp_path / "ok.json").write_text(json.dumps(collectives_json("gloo", "cpu", 2, ops, compute=compute)))
    read = CommCosts.from_json(tmp_path / "ok.json")
    assert read.muon_executor_steps == {"gpipe": ExecutorStep(2, 4, 8, 1, 0.25, -0.004)}
    assert "Muon in the executor: gpipe D=2 N=4 250 ms (NVLAMB's -4 ms)" in read.describe()
    assert muon_step_factor(read) == 0.25  # a measured extra below what the range reaches: clamped to its end


def test_a_measured_newton_schulz_rate_prices_muons_orthogonalization(tmp_path: Path):
    """With ``compute.newton_schulz`` measured, Muon's step prices its Newton–Schulz FLOPs at that rate instead of
    the model's forward + backward rate (the rest of its step unchanged); NVLAMB's step is the same either way; the
    file round-trips the rate and refuses a non-positive one."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.optimizer_costs import muon_matrices, newton_schulz_flops, optimizer_step_seconds

    plain = CommCosts({}, Hardware(), "test", {8: 5e10}, 4e9, compute_model=("bert-tiny", 64, 10))
    fast = replace(plain, ns_flops_per_s=2e11)  # four times the forward + backward rate
    hw = plain.hardware_for(8)
    mats = muon_matrices(BertConfig.from_size("tiny"), 1)
    ns = sum(newton_schulz_flops(i, o) for i, o in mats)
    before, after = (optimizer_step_seconds("muon", 1e6, mats, hw, c) for c in (plain, fast))
    assert before - after == pytest.approx(ns / 5e10 - ns / 2e11, rel=1e-9)
    assert optimizer_step_seconds("nvlamb", 1e6, mats, hw, fast) == optimizer_step_seconds("nvlamb", 1e6, mats, hw, plain)
    compute = {"model": "bert-tiny", "seq_len": 64, "max_predictions": 10,
               "micro_batch": {"8": {"flops_per_s": 5e10, "seconds_fb": 0.3}},
               "newton_schulz": {"dtype": "bfloat16", "seconds": 0.01, "flops": 2e9, "flops_per_s": 2e11}}
    ops = {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}
    (tmp_path / "ok.json").write_text(json.dumps(collectives_json("gloo", "cpu", 2, ops, compute=compute)))
    read = CommCosts.from_json(tmp_path / "ok.json")
    assert read.ns_flops_per_s == 2e11 and "Muon's Newton-Schulz 200.00 GFLOP/s" in read.describe()
    compute["newton_schulz"]["flops_per_s"] = 0.0
    (tmp_path / "bad.json").write_text(json.dumps(collectives_json("gloo", "cpu", 2, ops, compute=compute)))
    with pytest.raises(ValueError, match="rates and times must be positive"):
        CommCosts.from_json(tmp_path / "bad.json")


def test_a_measured_kfac_step_scales_kfac_units_alone_at_every_d(tmp_path: Path):
    """With GPipe's step measured with K-FAC every step (compute.executor.kfac), the search's K-FAC step of GPipe at
    that shape equals it; the factor scales only K-FAC's units, so NVLAMB is priced as before, K-FAC on another
    schedule and D grows, EKFAC (another kernel) does not; the file round-trips it and names a bad field."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.comm_costs import ExecutorStep
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.predict import predict_assignment, predict_schedule
    from pipefisher.planning.strategy_search import kfac_unit_factor, pipeline_costs
    from pipefisher.schedules.kfac import critical_path_assignment

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9, compute_model=("bert-tiny", 64, 10),
                      action_overhead_s=1e-3)
    hw = plain.hardware_for(8)
    bert = BertConfig.from_size("tiny")

    def step(comm: CommCosts, method: str, optimizer: str, stages: int = 2, preconditioner: str = "kfac") -> float:
        run = RunShape(bert, method, stages, 4, 8, seq_len=64, max_predictions=10, preconditioner=preconditioner)
        schedule = run.build_schedule(dp_width=1)
        cost = pipeline_costs(run, hw, comm)
        if optimizer == "nvlamb":
            return predict_schedule(schedule, cost)[0].step_time_s
        return predict_assignment(critical_path_assignment(schedule, run.kfac_layers, 1), cost, "kfac")[0].step_time_s

    before = step(plain, "gpipe", "kfac")
    measured = replace(plain, kfac_executor_steps={"gpipe": ExecutorStep(2, 4, 8, 1, 1.3 * before)})
    assert step(measured, "gpipe", "kfac") == pytest.approx(1.3 * before, rel=1e-3)
    assert kfac_unit_factor(measured) > 1.3  # F, B, messages and STEP are not scaled: the units must grow more
    assert kfac_unit_factor(plain) == 1.0
    for method in ("gpipe", "1f1b", "zb-h1", "chimera"):
        assert step(measured, method, "nvlamb") == step(plain, method, "nvlamb")
    assert step(measured, "1f1b", "kfac", stages=4) > step(plain, "1f1b", "kfac", stages=4)  # every D
    assert step(measured, "1f1b", "kfac", preconditioner="ekfac") == step(plain, "1f1b", "kfac",
                                                                           preconditioner="ekfac")
    faster = replace(plain, kfac_executor_steps={"gpipe": ExecutorStep(2, 4, 8, 1, 0.9 * before)})
    assert kfac_unit_factor(faster) < 1  # units faster in the executor than priced: scaled down alike
    # measured as K-FAC's extra over NVLAMB's step (taking turns): the simulated extra matches it, whatever the
    # absolute step was on the machine at the time
    nvlamb = step(plain, "gpipe", "nvlamb")
    paired = replace(plain, kfac_executor_steps={"gpipe": ExecutorStep(2, 4, 8, 1, 9.0, 1.5 * (before - nvlamb))})
    assert step(paired, "gpipe", "kfac") - nvlamb == pytest.approx(1.5 * (before - nvlamb), rel=1e-3)
    # a schedule measured on its own gets its own factor at its D; others, and other D, keep GPipe's
    chimera_nvlamb, chimera_kfac = step(plain, "chimera", "nvlamb"), step(plain, "chimera", "kfac")
    own = replace(paired, kfac_executor_steps={
        **paired.kfac_executor_steps, "chimera": ExecutorStep(2, 4, 8, 1, 9.0, 2.0 * (chimera_kfac - chimera_nvlamb))})
    assert step(own, "chimera", "kfac") - chimera_nvlamb == pytest.approx(2.0 * (chimera_kfac - chimera_nvlamb),
                                                                          rel=1e-3)
    assert step(own, "gpipe", "kfac") == step(paired, "gpipe", "kfac")
    assert step(own, "1f1b", "kfac") == step(paired, "1f1b", "kfac")
    assert step(own, "chimera", "kfac", stages=4) == step(paired, "chimera", "kfac", stages=4)
    assert step(paired, "chimera", "kfac") != pytest.approx(step(own, "chimera", "kfac"), rel=1e-2)
    row = {"stages": 2, "micro_batches": 4, "micro_batch_size": 8, "num_virtual": 1, "step_seconds": 0.25,
           "simulated_seconds": 0.2}
    compute = {"model": "bert-tiny", "seq_len": 64, "max_predictions": 10,
               "micro_batch": {"8": {"flops_per_s": 5e10, "seconds_fb": 0.3}},
               "executor": {"overhead_per_action_s": 1e-3, "methods": {"gpipe": dict(row)},
                            "kfac": {"gpipe": {**row, "step_seconds": 0.4, "extra_seconds": 0.15}}}}
    ops = {"all_reduce": {2: [(4096.0, 1e-4), (65536.0, 2e-4)]}}
    (tmp_path / "ok.json").write_text(json.dumps(collectives_json("gloo", "cpu", 2, ops, compute=compute)))
    read = CommCosts.from_json(tmp_path / "ok.json")
    assert read.kfac_executor_steps == {"gpipe": ExecutorStep(2, 4, 8, 1, 0.4, 0.15)}
    assert "K-FAC every step in the executor: gpipe D=2 N=4 400 ms (NVLAMB's + 150 ms)" in read.describe()
    compute["executor"]["kfac"]["gpipe"]["step_seconds"] = -1.0
    (tmp_path / "bad.json").write_text(json.dumps(collectives_json("gloo", "cpu", 2, ops, compute=compute)))
    with pytest.raises(ValueError, match=r"compute.executor.methods \(or .kfac, .muon\)"):
        CommCosts.from_json(tmp_path / "bad.json")


def test_train_pys_measured_bookkeeping_is_added_to_every_predicted_step_once():
    """train.py's step_time_s holds rank 0's bookkeeping after the step (compute.executor.bookkeeping_seconds):
    the search adds it to each candidate's step, once, and nothing else changes."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig
    from pipefisher.planning.strategy_search import search_strategies

    fits = {"all_reduce": {2: LinkFit(50e-6, 2e9)}, "p2p": {2: LinkFit(20e-6, 4e9)}}
    plain = CommCosts(fits, Hardware(), "test", {8: 5e10}, 4e9)
    space = dict(devices=2, memory_gb=100.0, global_batch=32, methods=["gpipe", "chimera"], micro_batch_sizes=[8],
                 optimizers=["nvlamb", "pipefisher"], recompute=[False], sdp_degrees=[1], tp_degrees=[1],
                 seq_len=64, max_predictions=10)
    bert = BertConfig.from_size("tiny")
    before = {s.label: s for s in search_strategies(bert, comm=plain, **space) if s.excluded is None}
    after = {s.label: s for s in search_strategies(bert, comm=replace(plain, step_bookkeeping_s=3e-3), **space)
             if s.excluded is None}
    assert before.keys() == after.keys() and len(before) >= 4
    for label, s in before.items():
        assert after[label].step_time_s == pytest.approx(s.step_time_s + 3e-3, abs=1e-12), label
        assert after[label].interval == s.interval, label  # PipeFisher's plan does not see it
