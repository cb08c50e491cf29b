"""bench/reprice.py's arithmetic: time to target = the study's steps × a step, intervals and separation."""

from __future__ import annotations


import pytest

from tests.conftest import calibration_doc, load_bench



@pytest.fixture(scope="module")
def rp():
    return load_bench("reprice")


def test_time_to_target_is_steps_times_step(rp):
    # muon to H-0.3 in the study: 1245 steps, seeds 1186-1301; muon-bf16 has the same steps
    assert rp.time_to_target("muon", 0.1, "H-0.3") == pytest.approx((124.5, 118.6, 130.1))
    assert rp.time_to_target("muon-bf16", 0.2, "H-0.3") == pytest.approx((249.0, 237.2, 260.2))
    assert rp.time_to_target("nvlamb", 1.0, "H-0.2") == (672, 594, 742)


def test_overlap(rp):
    assert rp.overlap((0, 1, 2), (0, 2, 3))       # touching counts as overlapping
    assert not rp.overlap((0, 1, 2), (0, 2.5, 3))
    assert rp.overlap((0, 2.5, 3), (0, 1, 2.6))


def test_setting_table_names_the_fastest_and_separation(rp):
    # equal steps: muon (1186-1301 steps) is separated from nvlamb (1586-1631) at H-0.3 and fastest there
    text = rp.setting_table({"nvlamb": 0.1, "muon": 0.1}, "t")
    muon = next(line for line in text.splitlines() if line.startswith("| muon"))
    cells = [c.strip() for c in muon.strip("|").split("|")]
    assert cells[6] == "124 [119–130]"
    assert cells[7] == "0.78 [0.73–0.82] sep."   # 07-convergence.md's D=8 figure at equal steps
    assert cells[8] == "fastest"
    # a Muon step 1.3x NVLAMB's: no longer separated from NVLAMB at H-0.3, and NVLAMB is ahead
    slow = rp.setting_table({"nvlamb": 0.1, "muon": 0.13}, "t")
    muon = next(line for line in slow.splitlines() if line.startswith("| muon"))
    cells = [c.strip() for c in muon.strip("|").split("|")]
    assert cells[7].endswith("not sep.")
    assert cells[8] == "overlaps nvlamb"


def test_fused_arms_take_their_optimizers_steps_and_set_the_kernel(rp):
    # optimizer.adamw_kernel=fused changes the step's cost, not the steps to target (tests/test_adamw_kernel.py)
    assert rp.time_to_target("muon-fused", 0.1, "H-0.3") == rp.time_to_target("muon", 0.1, "H-0.3")
    assert rp.time_to_target("adamw-fused", 0.1, "H-0.2") == rp.time_to_target("adamw", 0.1, "H-0.2")
    assert rp.arm_keys("muon-fused") == ["optimizer=muon", "optimizer.adamw_kernel=fused"]
    assert rp.PAIRED_ARMS["adamw-fused"] == ["optimizer=adamw", "optimizer.adamw_kernel=fused"]


def _calibration():
    from pipefisher.planning.calibration import parse_calibration

    flat = [{"loss": 6.5, "value": 1.25, "low": 1.2, "high": 1.3}, {"loss": 6.2, "value": 1.25, "low": 1.2, "high": 1.3}]
    doc = calibration_doc(
        reference_steps=[{"loss": 6.5, "steps": 500.0}, {"loss": 6.2, "steps": 2000.0}],
        optimizers=[{"optimizer": "muon", "speedup": flat},
                    {"optimizer": "kfac", "k": 1, "speedup": [{**p, "value": 2.0, "low": 1.9, "high": 2.1} for p in flat]},
                    {"optimizer": "pipefisher", "k": 8, "promote_inverses": "when_ready",
                     "speedup": [{**p, "value": 1.6, "low": 1.5, "high": 1.7} for p in flat]}])
    return parse_calibration(doc, "cal.json")


def test_steps_from_a_calibration_are_nvlambs_times_the_multiplier(rp):
    source = rp.StepsSource(_calibration(), (6.3,))
    assert source.targets == ("L=6.300",)
    ref = 500 + (6.5 - 6.3) / (6.5 - 6.2) * 1500  # NVLAMB's steps to 6.3, interpolated in loss: 1500
    assert source.steps("nvlamb", "L=6.300") == pytest.approx((ref, ref, ref))
    # Muon 1.25x fewer steps [1.2-1.3]: steps ref/1.25, interval [ref/1.3, ref/1.2]; its precision/kernel arms alike
    assert source.steps("muon-fused", "L=6.300") == pytest.approx((ref / 1.25, ref / 1.3, ref / 1.2))
    assert source.steps("kfac-k1", "L=6.300") == pytest.approx((ref / 2, ref / 2.1, ref / 1.9))
    # PipeFisher at its plan's k takes the nearest larger k measured; above it, and AdamW, are not calibrated
    assert source.steps("pipefisher", "L=6.300", pipefisher_k=5) == pytest.approx((ref / 1.6, ref / 1.7, ref / 1.5))
    assert source.steps("pipefisher", "L=6.300", pipefisher_k=9) is None
    assert source.steps("adamw", "L=6.300") is None
    assert rp.time_to_target("muon", 0.1, "L=6.300", source=source) == pytest.approx((120.0, ref / 1.3 * 0.1, 125.0))


def test_a_calibrated_table_leaves_uncalibrated_arms_out_and_separates_by_the_multiplier(rp):
    source = rp.StepsSource(_calibration(), (6.3,))
    steps = {"nvlamb": 0.1, "adamw": 0.05, "muon": 0.1, "pipefisher": 0.13}

    def row(text, arm):
        line = next(x for x in text.splitlines() if x.startswith(f"| {arm} "))
        return [c.strip() for c in line.strip("|").split("|")]

    text = rp.setting_table(steps, "t", source=source, pipefisher_k=6)
    assert row(text, "adamw")[3] == "not calibrated"  # the fastest step, but no steps to price it with
    assert row(text, "muon")[4] == "0.80 [0.77–0.83] sep."  # 1/1.25 [1/1.3, 1/1.2] at NVLAMB's step
    assert row(text, "muon")[5] == "fastest"
    assert row(text, "pipefisher")[4].endswith("sep.") and row(text, "pipefisher")[5] == "overlaps muon"
    # a Muon step 1.3x NVLAMB's: [1.0, 1.08] x NVLAMB's time, touching 1: not separated
    slow = rp.setting_table({**steps, "muon": 0.13}, "t", source=source, pipefisher_k=6)
    assert row(slow, "muon")[4].endswith("not sep.")
    ranked = rp.ranking({f"s/{a}": v for a, v in steps.items()}, "t", source=source, pipefisher_ks={"s": 6})
    assert "s/adamw" not in ranked and "fastest to L=6.300" in ranked
    first = [c.strip() for c in ranked.splitlines()[4].strip("|").split("|")]
    assert first[:3] == ["1", "s/muon", "120 [115–125]"]


@pytest.mark.slow
def test_simulate_d8_prices_two_chunk_schedules_on_the_same_model_and_skips_what_a_generator_refuses(
        rp, tmp_path, monkeypatch):
    """D=8 simulation from a (synthetic) profile: a 16-layer model for every schedule; zb-v at N=8 (< 2D) is
    skipped with the generator's reason, not priced; Muon's STEP is NVLAMB's × its paired ratio."""
    import json

    from pipefisher.model import BertConfig
    from pipefisher.planning.costs import RunShape
    from pipefisher.simulate import CostModel

    sc = rp.sc
    measured = RunShape(bert=BertConfig(hidden_size=64, num_layers=2, num_heads=2), method="chimera", stages=2,
                        num_micro_batches=4, micro_batch_size=4, seq_len=32, max_predictions=5)
    row = (1, 2, 3, 4, 5, 6)
    cost = CostModel(forward_ns=(100_000, 300_000), backward_ns=(200_000, 600_000), step_ns=1_000_000,
                     curv_a_ns=(row, row), curv_b_ns=(row, row), invert_ns=(row, row), sync_factor_ns=(row, row),
                     precond_ns=(50, 50))
    monkeypatch.setattr(sc, "profile_run", lambda keys, out: out)
    monkeypatch.setattr(sc, "load_costs", lambda path: (cost, measured))
    (tmp_path / "paired.json").write_text(json.dumps({
        "command": "test", "hardware": "test", "threads": 1, "reps": 1, "load": "test",
        "step_s": {"nvlamb": 1.0, "muon": 2.0}, "pair_ratio_to_nvlamb": {"nvlamb": 1.0, "muon": 2.0}}))
    doc = rp.simulate_d8(tmp_path, ("1f1b", "zb-v"), (8, 16), reps=1, layers=16)
    assert set(doc["simulated"]) == {"1f1b/N=8", "1f1b/N=16", "zb-v/N=16"}
    assert "zb-v/N=8" in doc["skipped"] and "micro" in doc["skipped"]["zb-v/N=8"].lower()
    assert doc["layers"] == 16 and json.loads((tmp_path / "d8.json").read_text())["skipped"] == doc["skipped"]
    for key, r in doc["simulated"].items():
        method, n = key.split("/N=")
        target = sc.simulated_run(measured, 8, method, int(n), 16)
        assert target.bert.num_layers == 16
        scaled = sc.scale_costs(cost, measured, target)
        want = sc.steady_step_ns((sc.simulated_schedule(target, scaled),), scaled) / 1e9
        assert r["step_s"]["nvlamb"] == pytest.approx(want)
        assert r["step_s"]["muon"] > r["step_s"]["nvlamb"]  # its STEP doubled
    # a zero-bubble V schedule at N=16 is faster than 1F1B's flush on the same model and costs: within 10 % of
    # zb-v's lower bound N(F+I+W) + (D-1)F/2 per worker share (2 chunks of F 200 us, I 200, W 200) + STEP 1 ms
    zbv = doc["simulated"]["zb-v/N=16"]["step_s"]["nvlamb"]
    bound = (16 * 3 * 400e-6 + 7 * 200e-6) + 1e-3
    assert bound <= zbv <= 1.1 * bound
    assert zbv < doc["simulated"]["1f1b/N=16"]["step_s"]["nvlamb"]
    # ordered by RunShape's estimate (the heads in the V's last stage) it is far slower on these equal stages
    target = sc.simulated_run(measured, 8, "zb-v", 16, 16)
    estimate_order = sc.steady_step_ns((target.build_schedule(dp_width=1),), sc.scale_costs(cost, measured, target))
    assert estimate_order / 1e9 > 2 * zbv
    assert "16 encoder layers" in rp.report(tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--target-loss", "4"], "--target-loss=4: the calibration's reference covers held-out losses 5 .. 6"),
    (["--simulate", "--methods", "zb-v", "--layers", "8"], "--layers 8: zb-v at D=8 has 16 model stages"),
    (["--simulate", "--methods", "zb-x"], "--methods zb-x: use gpipe"),
])
def test_bad_arguments_are_refused_before_any_measurement(rp, tmp_path, monkeypatch, argv, message):
    import json
    import re
    import sys

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(calibration_doc()))
    out = tmp_path / "out"
    extra = ["--calibration", str(cal)] if "--target-loss" in argv else []
    monkeypatch.setattr(sys, "argv", ["reprice.py", "--out", str(out), *extra, *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        rp.main()
    assert not out.exists()  # refused before the output folder, a profile or a run
