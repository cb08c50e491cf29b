"""bench/step_costs.py: step cost per optimizer arm from a cost model, checked against closed forms."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest

from pipefisher.model import BertConfig
from pipefisher.planning.costs import RunShape
from pipefisher.schedules import build_schedule
from pipefisher.simulate import CostModel
from tests.conftest import load_bench



@pytest.fixture(scope="module")
def sc():
    """bench/step_costs.py as a module (it imports bench/_harness.py by name, as when run as a script)."""
    return load_bench("step_costs", "bench_step_costs")


# A D=2 stage with 6 K-FAC layers (one encoder layer); distinct per-layer costs, so a sum that
# drops or repeats a layer fails.
F, B, STEP, PRECOND = 100, 200, 10, 7
CURV_A = (1, 2, 3, 4, 5, 6)
CURV_B = (10, 20, 30, 40, 50, 60)
INVERT = (100, 200, 300, 400, 500, 600)


def _cost(d: int, *, sync_factor: int = 0, kfac: bool = True) -> CostModel:
    rows = (lambda r: (tuple(r),) * d) if kfac else (lambda r: ((0,) * 6,) * d)
    return CostModel(forward_ns=(F,) * d, backward_ns=(B,) * d, step_ns=STEP,
                     curv_a_ns=rows(CURV_A), curv_b_ns=rows(CURV_B), invert_ns=rows(INVERT),
                     sync_factor_ns=((sync_factor,) * 6,) * d, precond_ns=(PRECOND if kfac else 0,) * d)


def _refresh(n: int) -> int:
    """One worker's refresh of one 6-layer stage: curvature of n micro-batches, then the inversions."""
    return n * (sum(CURV_A) + sum(CURV_B)) + sum(INVERT)


# --- the estimator and nvlamb ---------------------------------------------------------------------

@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
@pytest.mark.parametrize("d,n", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_nvlamb_step_is_the_flush_pipelines_closed_form(sc, method, d, n) -> None:
    # GPipe/1F1B with equal stages and free messages: stage 0's last backward ends at
    # (N + D - 1)(F + B); its STEP follows, and stage 0 starts the next step's F right after it.
    schedule = build_schedule(method, d, n)
    assert sc.steady_step_ns((schedule,), _cost(d)) == (n + d - 1) * (F + B) + STEP
    with pytest.raises(ValueError, match="cycles"):
        sc.steady_step_ns((schedule,), _cost(d), cycles=0)


# --- critical-path K-FAC: closed forms --------------------------------------------------------------

@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
@pytest.mark.parametrize("sync_factor", [0, 50])
def test_critical_path_kfac_adds_worker0s_refresh_once_per_cycle(sc, method, sync_factor) -> None:
    """D=2, N=2, one replica per stage. Worker 0 ends each step last (its B1 at 3(F+B)), and the
    critical-path refresh goes after that flush: CURV_A/B of both micro-batches of its 6 layers,
    the 6 factor all-reduces issued together (each lasts sigma, concurrently; INVERT l waits for
    its own, so only the first, sigma <= sigma + INVERT_0, is exposed), the 6 inversions, PRECOND,
    STEP. Worker 1 runs the same refresh one B earlier and is free before worker 0's next F
    reaches it. So the refresh step is T0 + PRECOND + c + sigma (c = _refresh(2)), the other K-1
    steps of a cycle T0 + PRECOND, and the mean over a K-step cycle T0 + PRECOND + (c + sigma)/K."""
    d, n = 2, 2
    schedule = build_schedule(method, d, n)
    t0 = (n + d - 1) * (F + B) + STEP
    c = _refresh(n) + sync_factor
    arms = sc.arm_step_costs(schedule, _cost(d, sync_factor=sync_factor), [6, 6], intervals=(1, 2, 3, 4, 8))
    assert arms["nvlamb"]["step_s"] * 1e9 == pytest.approx(t0)
    assert arms["nvlamb"]["k"] is None and arms["nvlamb"]["ratio_to_nvlamb"] == 1.0
    for k in (1, 2, 3, 4, 8):
        row = arms[f"kfac-k{k}"]
        assert row["k"] == k
        assert row["step_s"] * 1e9 == pytest.approx(t0 + PRECOND + c / k)
        assert row["ratio_to_nvlamb"] == pytest.approx((t0 + PRECOND + c / k) / t0)


def test_curvature_micro_batches_shrink_the_refresh_on_the_critical_path(sc) -> None:
    d, n = 2, 4
    schedule = build_schedule("gpipe", d, n)
    t0 = (n + d - 1) * (F + B) + STEP
    arms = sc.arm_step_costs(schedule, _cost(d), [6, 6], intervals=(1,), curvature_micro_batches=1)
    assert arms["kfac-k1"]["step_s"] * 1e9 == pytest.approx(t0 + PRECOND + _refresh(1))


# --- every arm without K-FAC work; PipeFisher's bounds ---------------------------------------------

@pytest.mark.parametrize("method,d,n", [("gpipe", 2, 2), ("1f1b", 4, 8), ("chimera", 2, 4), ("chimera", 4, 4)])
def test_without_kfac_work_every_arm_is_nvlamb(sc, method, d, n) -> None:
    schedule = build_schedule(method, d, n)
    cost = _cost(d, kfac=False)
    arms = sc.arm_step_costs(schedule, cost, [6] * d)
    assert set(arms) == {"nvlamb", "kfac-k1", "kfac-k2", "kfac-k4", "kfac-k8", "pipefisher",
                         *(f"pipefisher-k{k}{ready}" for k in (1, 2, 4, 8) for ready in ("", "-ready"))}
    for arm, row in arms.items():
        assert row["step_s"] == arms["nvlamb"]["step_s"], arm
        assert row["ratio_to_nvlamb"] == 1.0


@pytest.mark.parametrize("method,d,n", [("gpipe", 4, 4), ("1f1b", 4, 8), ("chimera", 4, 4), ("chimera", 4, 8)])
@pytest.mark.slow
def test_pipefisher_lies_between_nvlamb_and_critical_path_kfac_at_its_k(sc, method, d, n) -> None:
    schedule = build_schedule(method, d, n)
    cost = _cost(d, sync_factor=20)
    arms = sc.arm_step_costs(schedule, cost, [6] * d, intervals=range(1, 9), max_interval=8)
    pf = arms["pipefisher"]
    assert 1 <= pf["k"] <= 8
    assert arms["nvlamb"]["step_s"] <= pf["step_s"] <= arms[f"kfac-k{pf['k']}"]["step_s"] * (1 + 1e-9)
    assert "k_min=" in pf["note"]
    # the forced-k plan at the planner's k, or one re-planned with its INVERTs nearer their curvature
    # because the plain plan's curvature is older than optimizer=pipefisher's max_staleness (8, when ready)
    plain = arms[f"pipefisher-k{pf['k']}"]
    assert pf["curvature_age"] <= 8
    if plain["curvature_age"] <= 8:
        assert pf["step_s"] == plain["step_s"]
    for k in range(1, 9):  # every forced k: no slower than the critical path at k, no faster than no K-FAC
        assert arms["nvlamb"]["step_s"] <= arms[f"pipefisher-k{k}"]["step_s"] <= arms[f"kfac-k{k}"]["step_s"] * (1 + 1e-9)
        ready = arms[f"pipefisher-k{k}-ready"]
        assert ready["curvature_age"] == k <= arms[f"pipefisher-k{k}"]["curvature_age"]  # the kfac-kK-ready numerics
        assert arms["nvlamb"]["step_s"] <= ready["step_s"]


# --- scaling to D stages --------------------------------------------------------------------------

def _measured(num_layers: int, method: str = "chimera") -> RunShape:
    bert = BertConfig(hidden_size=64, num_layers=num_layers, num_heads=2)
    return RunShape(bert=bert, method=method, stages=2, num_micro_batches=4, micro_batch_size=8, seq_len=32,
                    max_predictions=5)


def _measured_cost(layers_per_stage: int) -> CostModel:
    """Two measured stages with different costs (stage 1 holds the heads)."""
    m = 6 * layers_per_stage

    def table(base: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(base * (s + 1) + layer for layer in range(m)) for s in range(2))

    return CostModel(forward_ns=(100, 300), backward_ns=(200, 600), input_grad_ns=(90, 250),
                     weight_grad_ns=(110, 350), p2p_ns=5, sync_ns=(20, 40), step_ns=1000,
                     curv_a_ns=table(10), curv_b_ns=table(20), sync_factor_ns=table(3), invert_ns=table(50),
                     precond_ns=(8, 12))


@pytest.mark.parametrize("layers_per_stage", [1, 2])
def test_scaling_gives_every_stage_the_measured_mean_per_encoder_layer(sc, layers_per_stage) -> None:
    measured = _measured(2 * layers_per_stage)
    cost = _measured_cost(layers_per_stage)
    target = sc.simulated_run(measured, 8, "chimera", 8)
    assert target.encoder_layers == [1] * 8 and target.num_micro_batches == 8
    scaled = sc.scale_costs(cost, measured, target)
    e = layers_per_stage  # encoder layers per measured stage
    assert scaled.num_stages == 8 and scaled.kfac_layers == (6,) * 8
    assert scaled.forward_ns == (round(200 / e),) * 8  # mean of 100 and 300, per encoder layer
    assert scaled.backward_ns == (round(400 / e),) * 8
    assert scaled.input_grad_ns == (round(170 / e),) * 8 and scaled.weight_grad_ns == (round(230 / e),) * 8
    assert scaled.precond_ns == (round(10 / e),) * 8 and scaled.sync_ns == (round(30 / e),) * 8
    assert scaled.p2p_ns == 5
    assert scaled.step_ns == round(1000 / e)  # chimera -> chimera: a worker holds 2 stages on both sides
    for name, base in (("curv_a_ns", 10), ("curv_b_ns", 20), ("sync_factor_ns", 3), ("invert_ns", 50)):
        table = getattr(cost, name)
        for pos in range(6):  # the same Linear (query, ..., output) in every measured encoder layer
            values = [row[j] for row in table for j in range(pos, len(row), 6)]
            assert all(row[pos] == round(statistics.fmean(values)) for row in getattr(scaled, name)), (name, pos)
        # per-layer mean over both stages: base * 1.5 + the mean layer index at that position
        assert getattr(scaled, name)[0][0] == round(base * 1.5 + 6 * (e - 1) / 2)


def test_scaling_to_a_method_with_one_replica_drops_the_all_reduces_and_halves_the_step(sc) -> None:
    measured = _measured(2)
    scaled = sc.scale_costs(_measured_cost(1), measured, sc.simulated_run(measured, 4, "1f1b"))
    assert scaled.sync_ns == (0,) * 4 and scaled.sync_factor_ns == ((0,) * 6,) * 4
    assert scaled.step_ns == 500  # a 1F1B worker holds one stage, a measured chimera worker two
    assert scaled.forward_ns == (200,) * 4


def test_scaling_refuses_what_it_cannot_scale(sc) -> None:
    measured = _measured(2)
    with pytest.raises(ValueError, match="encoder layers"):
        uneven = dataclasses.replace(measured, bert=dataclasses.replace(measured.bert, num_layers=3),
                                     layers_per_stage=(1, 2))
        sc.scale_costs(_measured_cost(1), measured, uneven)
    no_kfac = CostModel(forward_ns=(1, 1), backward_ns=(1, 1))
    with pytest.raises(ValueError, match="K-FAC"):
        sc.scale_costs(no_kfac, measured, sc.simulated_run(measured, 4))
    with pytest.raises(ValueError, match="--method"):
        sc.simulated_run(measured, 4, "zb-x")
    with pytest.raises(ValueError, match="--layers 12.*multiple of 8"):
        sc.simulated_run(measured, 4, "zb-v", layers=12)  # 8 model stages (two chunks per worker)
    with pytest.raises(ValueError, match="--layers 2.*multiple of 4"):
        sc.simulated_run(measured, 4, "1f1b", layers=2)  # fewer layers than stages


@pytest.mark.parametrize("method", ["interleaved", "zb-v", "dualpipev", "v-half", "v-min"])
def test_two_chunk_methods_hold_the_same_model_in_twice_the_stages(sc, method) -> None:
    """The same 8-layer model at D=4: a one-chunk method puts 2 layers in each of 4 stages, a two-chunk one 1 in
    each of 8; per worker both hold the same work (F, B, PRECOND, K-FAC layers, STEP's parameters)."""
    measured = _measured(2)
    cost = _measured_cost(1)
    one = sc.simulated_run(measured, 4, "1f1b", 8, layers=8)
    two = sc.simulated_run(measured, 4, method, 8, layers=8)
    assert (one.num_model_stages, one.encoder_layers) == (4, [2] * 4)
    assert (two.num_model_stages, two.encoder_layers, two.num_virtual) == (8, [1] * 8, 2)
    assert sc.simulated_run(measured, 4, method, 8).encoder_layers == [1] * 8  # default: one layer per stage
    a, b = sc.scale_costs(cost, measured, one), sc.scale_costs(cost, measured, two)
    assert a.forward_ns == (400,) * 4 and b.forward_ns == (200,) * 8  # the measured 200 per encoder layer, x m
    assert a.kfac_layers == (12,) * 4 and b.kfac_layers == (6,) * 8
    assert a.invert_ns[0] == b.invert_ns[0] * 2  # the same six Linear positions, repeated per encoder layer
    assert a.step_ns == b.step_ns == 1000  # a worker holds 2 of the 2 measured layers' parameters either way
    for name in ("forward_ns", "backward_ns", "input_grad_ns", "weight_grad_ns", "precond_ns"):
        assert sum(getattr(a, name)) == sum(getattr(b, name)), name
    schedule = sc.simulated_schedule(two, b)
    assert schedule.num_stages == 8 and schedule.method == method
    # no faster than the work of one worker without any bubble: N x (its two stages' F + B) + STEP
    assert sc.steady_step_ns((schedule,), b) >= 8 * 2 * (200 + 400) + 1000


@pytest.mark.slow
def test_simulated_step_costs_of_a_two_chunk_method_simulate_its_scaled_schedule(sc) -> None:
    measured, cost = _measured(2), _measured_cost(1)
    got = sc.simulated_step_costs(cost, measured, 4, "zb-v", 8, layers=8, intervals=(1,))
    target = sc.simulated_run(measured, 4, "zb-v", 8, layers=8)
    scaled = sc.scale_costs(cost, measured, target)
    assert got == sc.arm_step_costs(sc.simulated_schedule(target, scaled), scaled, [6] * 8, intervals=(1,))
    assert got["nvlamb"]["step_s"] <= got["pipefisher"]["step_s"] <= got["kfac-k1"]["step_s"]


def test_simulated_step_costs_simulate_the_scaled_uniform_pipeline(sc) -> None:
    measured = _measured(2)
    cost = _measured_cost(1)
    got = sc.simulated_step_costs(cost, measured, 4, "gpipe", 4, intervals=(1, 2))
    target = sc.simulated_run(measured, 4, "gpipe", 4)
    want = sc.arm_step_costs(build_schedule("gpipe", 4, 4), sc.scale_costs(cost, measured, target), [6] * 4,
                             intervals=(1, 2))
    assert got == want
    # and nvlamb's closed form: equal stages of F=200, B=400, STEP 500 (one stage per worker), and the
    # 5 ns message crossed 2(D-1) times on the path from stage 0's first F to its last B
    assert got["nvlamb"]["step_s"] * 1e9 == pytest.approx((4 + 4 - 1) * 600 + 2 * 3 * 5 + 500)
    assert sc.simulated_run(measured, 4).num_micro_batches == 8  # default N = 2D


def test_measured_step_costs_use_the_measured_run_unscaled(sc) -> None:
    measured = _measured(2, "1f1b")
    cost = dataclasses.replace(_measured_cost(1), sync_ns=(0, 0), sync_factor_ns=((0,) * 6,) * 2)
    got = sc.measured_step_costs(cost, measured, intervals=(1,))
    # 1F1B D=2 N=4 with unequal stages, messages 5 ns: stage 1 is the bottleneck; the measured
    # simulation must keep that (the scaled one would average it away)
    want = sc.arm_step_costs(build_schedule("1f1b", 2, 4), cost, [6, 6], intervals=(1,))
    assert got == want
    assert sc.measured_step_costs(cost, measured, micro_batches=2, intervals=(1,)) == \
        sc.arm_step_costs(build_schedule("1f1b", 2, 2), cost, [6, 6], intervals=(1,))


def test_profile_keys_and_default_masked_positions(sc) -> None:
    assert sc.default_max_predictions(128) == 20 and sc.default_max_predictions(64) == 10
    assert sc.default_max_predictions(512) == 80
    keys = sc.profile_overrides("bert-tiny", 64, 32, overrides=["model.vocab_size=512"])
    assert "optimizer=kfac" in keys and "stages=2" in keys and "data.max_predictions=10" in keys
    assert keys[-1] == "model.vocab_size=512"  # the caller's keys last, so they win


# --- a real profile ------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_profiles_a_tiny_run_and_prints_both_tables(sc, tmp_path, capsys) -> None:
    out = tmp_path / "costs.json"
    sc.main(["--model", "bert-tiny", "--seq-len", "16", "--micro-batch-size", "2", "--profile-steps", "3",
             "--override", "model.vocab_size=512", "--profile-dir", str(tmp_path / "prof"), "--stages", "4",
             "--micro-batches", "4", "--intervals", "1,2", "--max-interval", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert "Simulated: chimera, D=4, N=4" in text and "Simulated at the measured shape: chimera, D=2, N=4" in text
    data = json.loads(out.read_text())
    for table in ("simulated", "measured_shape"):
        assert set(data[table]) == {"nvlamb", "kfac-k1", "kfac-k2", "pipefisher", "pipefisher-k1", "pipefisher-k2",
                                    "pipefisher-k1-ready", "pipefisher-k2-ready"}
        assert data[table]["nvlamb"]["step_s"] > 0
        assert data[table]["kfac-k1"]["step_s"] > data[table]["nvlamb"]["step_s"]
    assert data["measured_run"]["bert"]["vocab_size"] == 512
    # the profile is reusable
    sc.main(["--profile", data["profile"], "--stages", "4", "--intervals", "1", "--max-interval", "1"])
    assert "Simulated: chimera, D=4, N=8" in capsys.readouterr().out


def test_median_costs_take_each_actions_median_over_the_profiles(sc) -> None:
    a = _measured_cost(1)
    b = dataclasses.replace(a, forward_ns=(300, 100), step_ns=4000, p2p_ns=1)
    c = dataclasses.replace(a, forward_ns=(200, 200), step_ns=2000, p2p_ns=9,
                            invert_ns=tuple(tuple(x + 1000 for x in row) for row in a.invert_ns))
    got = sc.median_costs([a, b, c])
    assert got.forward_ns == (200, 200)  # per stage: median(100, 300, 200) and median(300, 100, 200)
    assert got.step_ns == 2000 and got.p2p_ns == 5
    assert got.invert_ns == a.invert_ns  # median of (x, x, x + 1000) per layer
    assert sc.median_costs([a]) == a
    with pytest.raises(ValueError, match="different shapes|differs in shape"):
        sc.median_costs([a, _measured_cost(2)])
    with pytest.raises(ValueError, match="at least one"):
        sc.median_costs([])
