"""The PipeFisher planner weighing a measured staleness curve (issue 28, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipefisher.config import ConfigError
from pipefisher.planning import plan_interval, plan_pipefisher, predict_assignment
from pipefisher.planning.staleness import StalenessCurve, choose_interval, load_staleness_curve
from pipefisher.schedules import build_schedule
from pipefisher.simulate import CostModel


def _heavy_case():
    """chimera D=4 N=8 with a refresh too large for one step's bubbles (k=1 spills, a longer k does not)."""
    s = build_schedule("chimera", 4, 8)
    cost = CostModel.uniform(4, 100, 100, p2p_ns=5, sync_ns=30, kfac_layers=6, curv_a_ns=8, curv_b_ns=8,
                             sync_factor_ns=16, invert_ns=16, precond_ns=3)
    return s, cost


def _step_ns(s, cost, k: int) -> float:
    """Predicted mean step of the plan at interval k (the predictor, not the planner's own timing)."""
    a, _ = plan_interval(s, cost, [6] * 4, k)
    return predict_assignment(a, cost)[0].step_time_s * 1e9


def test_curve_interpolates_between_measured_intervals_and_says_nothing_beyond() -> None:
    c = StalenessCurve({1: 1.0, 2: 1.0, 4: 1.1, 8: 1.5})
    assert c.at(3) == pytest.approx(1.05) and c.at(6) == pytest.approx(1.3) and c.at(8) == 1.5
    assert c.at(9) is None and c.max_k == 8
    with pytest.raises(ValueError, match="needs k=1"):
        StalenessCurve({2: 1.0})
    with pytest.raises(ValueError, match=r"multiplier\[2\]=0"):
        StalenessCurve({1: 1.0, 2: 0})


def test_choose_interval_minimizes_step_times_multiplier_and_prefers_the_fresher_on_ties() -> None:
    curve = StalenessCurve({1: 1.0, 2: 1.02, 4: 1.3})
    k, why = choose_interval({1: 150e6, 2: 110e6, 3: 100e6, 4: 95e6}, curve)
    # 150, 112.2, 100 x 1.16 = 116, 95 x 1.3 = 123.5: k=2
    assert k == 2 and "110.0 ms × 1.020" in why
    assert choose_interval({1: 100e6, 2: 100e6}, StalenessCurve({1: 1.0, 2: 1.0}))[0] == 1
    with pytest.raises(ValueError, match="covers k <= 2"):
        choose_interval({3: 1.0}, StalenessCurve({1: 1.0, 2: 1.0}))


def test_load_refuses_missing_files_and_bad_values_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_staleness_curve(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"multiplier": {"one": 1.0}}))
    with pytest.raises(ValueError, match="keys must be intervals"):
        load_staleness_curve(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"multiplier": {"1": 1.0, "4": 1.2}, "promote_inverses": "when_ready", "seeds": {"4": 1}}))
    c = load_staleness_curve(good)
    assert c.multiplier == {1: 1.0, 4: 1.2} and c.promote_inverses == "when_ready" and c.details == {"seeds": {"4": 1}}


def test_planner_trades_staleness_against_step_time() -> None:
    s, cost = _heavy_case()
    default = plan_pipefisher(s, cost, [6] * 4)
    k0 = default.interval
    assert k0 > 1 and default.metadata["spilled_ns"] == 0  # bubbles alone: the smallest k that hides the refresh
    times = {k: _step_ns(s, cost, k) for k in range(1, k0 + 3)}
    # A flat curve up to k0 + 2: staleness is free, so the least predicted step wins (ties: the smaller k).
    flat = plan_pipefisher(s, cost, [6] * 4, staleness=StalenessCurve({1: 1.0, k0 + 2: 1.0}))
    assert flat.interval == min(times, key=lambda k: (round(times[k]), k))
    # Every k >= 2 costs twice the steps: the planner weighs k=1's spill against that.
    steep = StalenessCurve({1: 1.0, 2: 2.0, 8: 2.0})
    expected = min(times, key=lambda k: (round(times[k] * (1.0 if k == 1 else 2.0)), k))
    picked = plan_pipefisher(s, cost, [6] * 4, staleness=steep)
    assert picked.interval == expected == 1  # k=1 spills, but by less than the doubled steps cost
    assert "staleness curve" in picked.metadata["choice"]


def test_planner_refuses_a_curve_measured_under_another_promotion_rule() -> None:
    s, cost = _heavy_case()
    with pytest.raises(ValueError, match="measured with promote_inverses=when_ready"):
        plan_pipefisher(s, cost, [6] * 4, staleness=StalenessCurve({1: 1.0, 2: 1.0}, "when_ready"))


def test_schedule_config_checks_the_curve_before_planning(tmp_path: Path) -> None:
    from pipefisher.planning.config import ScheduleConfig

    with pytest.raises(ConfigError, match="staleness_curve=.*no such file"):
        ScheduleConfig(staleness_curve=str(tmp_path / "missing.json"))
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"multiplier": {"1": 1.0, "2": 1.0}, "promote_inverses": "at_cycle_end"}))
    with pytest.raises(ConfigError, match="set promote_inverses=at_cycle_end"):
        ScheduleConfig(staleness_curve=str(f))  # schedule.py's default is optimizer=pipefisher's: when_ready
    assert ScheduleConfig(staleness_curve=str(f), promote_inverses="at_cycle_end").staleness_curve == str(f)


def test_train_config_takes_a_curve_for_the_pipefisher_planner_only(tmp_path: Path, make_cfg) -> None:
    f = tmp_path / "curve.json"
    f.write_text(json.dumps({"multiplier": {"1": 1.0, "2": 1.01, "4": 1.05}}))
    cfg = make_cfg("optimizer=pipefisher", f"optimizer.staleness_curve={f}", "optimizer.promote_inverses=at_cycle_end")
    assert cfg.optimizer.staleness_curve == str(f)
    with pytest.raises(ConfigError, match="optimizer.staleness_curve=.*only the pipefisher planner"):
        make_cfg("optimizer=kfac", f"optimizer.staleness_curve={f}")
    with pytest.raises(ConfigError, match="optimizer.staleness_curve=.*no such file"):
        make_cfg("optimizer=pipefisher", f"optimizer.staleness_curve={tmp_path / 'none.json'}")
    with pytest.raises(ConfigError, match="set optimizer.promote_inverses=at_cycle_end"):
        make_cfg("optimizer=pipefisher", f"optimizer.staleness_curve={f}")  # pipefisher's default: when_ready
