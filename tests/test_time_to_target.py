"""Time to target = steps (the calibration) x predicted step (issue 37, items 1-2): the calibration file's checks,
its interpolation, AdamW's and Muon's step and memory terms against hand sums and planning.memory, and a
ranking that follows the calibration."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pipefisher.config import ConfigError
from pipefisher.model.config import BertConfig
from pipefisher.planning.calibration import CalibrationError, read_calibration, write_calibration
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import Hardware, RunShape, kfac_linear_dims
from pipefisher.planning.memory import estimate_memory_per_worker
from pipefisher.planning.optimizer_costs import newton_schulz_flops
from pipefisher.planning.strategy_search import format_strategies, hybrid_costs, hybrid_memory_per_worker, search_strategies
from pipefisher.planning.time_to_target import rank_by_time_to_target
from tests.conftest import REPO, calibration_doc

STUDY = REPO / "bench" / "calibration" / "study_b32_fixed_schedule.json"


_doc = calibration_doc


def _write(tmp_path: Path, doc: dict, name: str = "cal.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_calibration_interpolates_steps_in_loss_and_inverts_the_seed_interval(tmp_path: Path):
    cal = read_calibration(_write(tmp_path, _doc()))
    assert cal.reference_steps(5.5) == pytest.approx(1250.0)
    value, low, high = cal.steps_multiplier("muon", None, 5.5)  # speed-up 2 [1.65, 2.375]
    assert (value, low, high) == pytest.approx((1 / 2.0, 1 / 2.375, 1 / 1.65))
    assert cal.steps_multiplier("nvlamb", None, 5.5) == (1.0, 1.0, 1.0)
    assert cal.steps_multiplier("muon", None, 4.9) is None  # no extrapolation
    assert cal.steps_multiplier("adamw", None, 5.5) is None
    assert cal.default_target == 5.0 and cal.loss_range == (5.0, 6.0)


def test_pipefisher_takes_its_k_else_the_nearest_larger_and_its_promotion_rule(tmp_path: Path):
    entries = [{"optimizer": "pipefisher", "k": k, "promote_inverses": p,
                "speedup": [{"loss": 6.0, "value": v}, {"loss": 5.0, "value": v}]}
               for k, p, v in ((4, "at_cycle_end", 1.1), (4, "when_ready", 1.2), (8, "when_ready", 1.05))]
    cal = read_calibration(_write(tmp_path, _doc(optimizers=entries)))
    assert cal.steps_multiplier("pipefisher", 4, 5.5, "when_ready")[0] == pytest.approx(1 / 1.2)
    assert cal.steps_multiplier("pipefisher", 4, 5.5, "at_cycle_end")[0] == pytest.approx(1 / 1.1)
    assert cal.steps_multiplier("pipefisher", 3, 5.5, "when_ready")[0] == pytest.approx(1 / 1.2)
    assert cal.steps_multiplier("pipefisher", 6, 5.5, "when_ready")[0] == pytest.approx(1 / 1.05)
    assert cal.steps_multiplier("pipefisher", 9, 5.5, "when_ready") is None


@pytest.mark.parametrize("change,message", [
    ({"format": "x"}, "field format is 'x'"),
    ({"method": "guess"}, "field method is 'guess'"),
    ({"budgets": [1000]}, "field budgets is \\[1000\\]: the budget method needs runs at two budgets"),
    ({"seeds": []}, "field seeds is \\[\\]"),
    ({"reference": "sgd"}, "field reference is 'sgd'"),
    ({"hardware": ""}, "field hardware is ''"),
    ({"model": {"num_layers": 4}}, "field model.hidden_size is None"),
    ({"reference_steps": [{"loss": 5.0, "steps": 100}, {"loss": 6.0, "steps": 50}]},
     "field reference_steps has losses \\[5.0, 6.0\\], not strictly decreasing"),
    ({"optimizers": [{"optimizer": "muon", "speedup": [{"loss": 6.0, "value": -1}]}]},
     "field optimizers\\[0\\].speedup\\[0\\].value is -1, not a positive number"),
    ({"optimizers": [{"optimizer": "muon", "speedup": [{"loss": 6.0, "value": 1.0, "low": 1.2}]}]},
     "field optimizers\\[0\\].speedup\\[0\\] has low=1.2, value=1, high=1"),
    ({"optimizers": [{"optimizer": "pipefisher", "speedup": [{"loss": 6.0, "value": 1.0}]}]},
     "field optimizers\\[0\\].k is None"),
    ({"optimizers": [{"optimizer": "muon", "k": 2, "speedup": [{"loss": 6.0, "value": 1.0}]}]},
     "field optimizers\\[0\\].k is 2, but muon has no refresh interval"),
    ({"optimizers": [{"optimizer": "muon", "speedup": [{"loss": 6.0, "value": 1.0}]}] * 2},
     "field optimizers\\[1\\] repeats optimizers\\[0\\]"),
])
def test_bad_calibration_files_are_refused_in_one_line_naming_the_field(tmp_path: Path, change, message):
    path = _write(tmp_path, _doc(**change))
    with pytest.raises(CalibrationError, match=f"calibration={path}: {message}") as err:
        read_calibration(path)
    assert "\n" not in str(err.value) and "--calibration-out" in str(err.value)
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    with pytest.raises(CalibrationError, match="not JSON"):
        read_calibration(not_json)
    with pytest.raises(CalibrationError, match="field method"):
        write_calibration(tmp_path / "w.json", _doc(method="guess"))
    assert not (tmp_path / "w.json").exists()


def test_the_shipped_study_calibration_reads_and_says_its_limits():
    cal = read_calibration(STUDY)
    assert cal.method == "fixed-schedule" and "single target placement" in cal.limits
    # bench/README.md section 7: Muon 0.78 [0.73-0.82] of NVLAMB's steps to H-0.3 (6.240)
    assert cal.steps_multiplier("muon", None, 6.24) == pytest.approx((1245 / 1606, 1186 / 1631, 1301 / 1586), rel=1e-3)
    assert cal.reference_steps(6.24) == 1606


# -- AdamW and Muon as candidates ------------------------------------------------------------------


def test_muon_and_adamw_memory_equal_planning_memory_and_adam_keeps_two_states():
    bert = BertConfig.from_size("mini")
    run = RunShape(bert, "1f1b", 2, 4, 8, 1, 1, 64, 10)
    schedule = run.build_schedule(dp_width=1)
    for opt in ("adamw", "muon"):
        ours = hybrid_memory_per_worker(run, 1, 1, schedule, opt)
        theirs = estimate_memory_per_worker(run, opt, schedule)
        for w in ours:
            assert ours[w].optimizer == pytest.approx(theirs[w].optimizer), (opt, w)
    nv = hybrid_memory_per_worker(run, 1, 1, schedule, "nvlamb")
    mu = hybrid_memory_per_worker(run, 1, 1, schedule, "muon")
    matrices = sum(i * o for i, o in kfac_linear_dims(bert, run.encoder_layers[0]))
    assert nv[0].optimizer - mu[0].optimizer == pytest.approx(4.0 * matrices)  # one moment fewer on its matrices


def test_muon_step_adds_newton_schulz_flops_and_reads_less_state_by_hand():
    bert = BertConfig.from_size("mini")
    run = RunShape(bert, "gpipe", 1, 2, 4, 1, 1, 64, 10)
    hw = Hardware(flops_per_s=1e12, memory_bytes_per_s=1e11)
    comm = CommCosts({}, hw)
    nv = hybrid_costs(run, 1, 1, hw, comm, optimizer="nvlamb")
    mu = hybrid_costs(run, 1, 1, hw, comm, optimizer="muon")
    h = bert.hidden_size
    assert newton_schulz_flops(h, 4 * h) == 5 * (4 * h * h * 4 * h + 2 * h ** 3)
    ns = bert.num_layers * (4 * newton_schulz_flops(h, h) + 2 * newton_schulz_flops(h, 4 * h))
    q = bert.num_layers * (4 * h * h + 2 * h * 4 * h)
    assert (mu.step_ns - nv.step_ns) * 1e-9 == pytest.approx(ns / 1e12 - 8 * q / 1e11, abs=2e-9)
    assert hybrid_costs(run, 1, 1, hw, comm, optimizer="adamw").step_ns == nv.step_ns


# -- the ranking -----------------------------------------------------------------------------------


def _search(calibration=None, **kwargs):
    return search_strategies(BertConfig.from_size("mini"), devices=2, memory_gb=100, global_batch=16,
                             methods=["1f1b"], micro_batch_sizes=[8], recompute=[False], sdp_degrees=[1],
                             tp_degrees=[1], optimizers=["nvlamb", "adamw", "muon"], seq_len=64, max_predictions=10,
                             hardware=Hardware(flops_per_s=1e12, memory_bytes_per_s=1e11), calibration=calibration,
                             **kwargs)


def test_the_ranking_follows_the_calibration(tmp_path: Path):
    """Same step predictions, two calibrations: Muon's speed-up 3 puts it first by time to target (its
    Newton-Schulz step is twice NVLAMB's here, last by throughput), 0.5 last; the throughput ranks do not move."""
    fast = read_calibration(_write(tmp_path, _doc(), "fast.json"))
    slow_doc = copy.deepcopy(_doc())
    for p in slow_doc["optimizers"][0]["speedup"]:
        p.update(value=0.5, low=0.4, high=0.6)
    slow = read_calibration(_write(tmp_path, slow_doc, "slow.json"))
    a = [c for c in _search(fast, target_loss=6.0) if c.excluded is None]
    b = [c for c in _search(slow, target_loss=6.0) if c.excluded is None]
    assert a[0].optimizer == "muon" and b[-1].optimizer == "muon"
    assert a[0].optimizer != b[0].optimizer
    assert {(c.label, c.throughput_rank) for c in a} == {(c.label, c.throughput_rank) for c in b}
    muon = next(c for c in a if c.optimizer == "muon" and c.stages == 2)
    assert muon.time_to_target_s == pytest.approx(500 / 3.0 * muon.step_time_s)  # steps x step, by hand
    assert max(c.throughput_rank for c in a) == max(c.throughput_rank for c in a if c.optimizer == "muon")
    assert [c.time_rank for c in a] == list(range(1, len(a) + 1))
    assert sorted(c.throughput_rank for c in a) == list(range(1, len(a) + 1))
    nvlamb = [c for c in a if c.optimizer == "nvlamb"]
    assert min(c.samples_per_s for c in nvlamb) >= 0 and all(c.steps_multiplier == 1.0 for c in nvlamb)


def test_optimizers_the_calibration_lacks_keep_the_references_steps_said_in_one_line(tmp_path: Path):
    cal = read_calibration(_write(tmp_path, _doc()))
    found = [c for c in _search(cal) if c.excluded is None]
    ranked, notes = rank_by_time_to_target(found, cal, model=BertConfig.from_size("mini"), global_batch=16)
    adamw = [c for c in ranked if c.optimizer == "adamw"]
    assert adamw and all(c.steps_multiplier is None for c in adamw)
    assert all(c.time_to_target_s == pytest.approx(2000 * c.step_time_s) for c in adamw)  # the default target 5.0
    lacking = [n for n in notes if "not in the calibration" in n]
    assert lacking == ["adamw: not in the calibration at loss 5: ranked by throughput alone (nvlamb's steps), "
                       "marked *"]
    text = format_strategies(ranked, 5, notes)
    assert "time#  tput#" in text and "1.00*" in text
    _, bare = rank_by_time_to_target(found, None)
    assert bare == ["no calibration: ranked by throughput alone (give calibration=<file> to rank by time to target)"]
    with pytest.raises(ValueError, match="target_loss=4: the calibration's reference covers held-out losses 5 .. 6"):
        rank_by_time_to_target(found, cal, 4.0)


def test_schedule_config_refuses_a_target_without_calibration_or_outside_it(tmp_path: Path):
    from pipefisher.planning.config import ScheduleConfig

    with pytest.raises(ConfigError, match="target_loss=6.0 has no steps to price without calibration"):
        ScheduleConfig(whatif=True, target_loss=6.0)
    path = _write(tmp_path, _doc())
    with pytest.raises(ConfigError, match="covers held-out losses 5 .. 6"):
        ScheduleConfig(whatif=True, calibration=str(path), target_loss=7.0)
    with pytest.raises(ConfigError, match="field method"):
        ScheduleConfig(whatif=True, calibration=str(_write(tmp_path, _doc(method="x"), "bad.json")))
