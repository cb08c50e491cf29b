"""The budget method's analysis (bench/convergence_analysis.py [Note: speed-up by budgets]) on synthetic curves
with a known answer, and bench/convergence.py's calibration writer on fake study folders (issue 37, item 1)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pipefisher.planning.calibration import read_calibration

BUDGETS = [250, 500, 1000, 2000, 4000]
OFFSETS = (-0.01, 0.0, 0.01)  # three seeds


def ref_loss(budget: float) -> float:
    """A power law of the budget (final held-out loss of a run whose schedule ends at ``budget``)."""
    return 5.0 + 40.0 / math.sqrt(budget)


def _finals(scale: float) -> dict[int, list[float]]:
    """An arm that ends at the reference's loss of ``scale`` x its budget: speed-up ``scale`` at every loss."""
    return {b: [ref_loss(scale * b) + d for d in OFFSETS] for b in BUDGETS}


def test_budget_to_reach_interpolates_in_log_budget_without_extrapolating(ca):
    points = [(500, 7.0), (1000, 6.5), (2000, 6.2)]
    assert ca.budget_to_reach(points, 6.5) == 1000
    assert ca.budget_to_reach(points, 6.35) == pytest.approx(1000 * math.sqrt(2))
    assert ca.budget_to_reach(points, 7.0) == 500
    assert ca.budget_to_reach(points, 7.1) is None  # the smallest budget already ends below it
    assert ca.budget_to_reach(points, 6.1) is None  # no budget reaches it
    assert ca.budget_to_reach([(500, 7.0), (1000, 6.4), (2000, 6.6), (4000, 6.0)], 6.5) == pytest.approx(
        500 * 2 ** (0.5 / 0.6))  # the first crossing


def test_speedups_recover_the_known_budget_ratio_at_every_loss(ca):
    """Arms ending where the reference ends at 2x (0.5x) their budget, sampled on the reference's budgets (a
    factor 2 apart): log-budget interpolation recovers 2 (0.5) exactly at every loss both reach."""
    finals = {"nvlamb": _finals(1.0), "muon": _finals(2.0), "adamw": _finals(0.5)}
    losses = ca.budget_losses(finals["nvlamb"], 5)
    assert losses[0] == pytest.approx(ref_loss(250)) and losses[-1] == pytest.approx(ref_loss(4000))
    got = ca.budget_speedups(finals, "nvlamb", losses)
    assert [p["value"] for p in got["nvlamb"]] == pytest.approx([1.0] * 5)
    muon = got["muon"]  # its budgets reach the reference's losses of 500..8000 steps: the three in both ranges
    assert len(muon) == 3 and all(p["value"] == pytest.approx(2.0) for p in muon)
    assert all(p["low"] < 2.0 < p["high"] and 1 <= p["pairs"] <= 9 for p in muon)  # seeds 0.01 apart
    assert muon[0]["pairs"] == 9  # every seed pair reaches the highest loss
    assert all(p["value"] == pytest.approx(0.5) for p in got["adamw"])
    assert [p["loss"] for p in muon] == sorted((p["loss"] for p in muon), reverse=True)
    ref = ca.reference_steps(finals["nvlamb"], losses)
    assert [b for _, b in ref][0] == 250 and ref[-1][1] == pytest.approx(4000)
    with pytest.raises(ValueError, match="reference 'sgd' has no runs"):
        ca.budget_speedups(finals, "sgd", losses)


def test_budget_finals_take_each_budgets_tuned_lr_and_all_its_seeds(ca):
    rows = [
        {"arm": "muon", "lr": 1e-3, "seed": 0, "steps": 500, "final": 6.4, "status": "ok"},
        {"arm": "muon", "lr": 2e-3, "seed": 0, "steps": 500, "final": 6.3, "status": "ok"},
        {"arm": "muon", "lr": 2e-3, "seed": 1, "steps": 500, "final": 6.35, "status": "ok"},
        {"arm": "muon", "lr": 2e-3, "seed": 2, "steps": 500, "final": math.inf, "status": "failed"},
        {"arm": "muon", "lr": 1e-3, "seed": 0, "steps": 1000, "final": 6.1, "status": "ok"},  # smaller lr wins here
        {"arm": "muon", "lr": 2e-3, "seed": 0, "steps": 1000, "final": 6.2, "status": "ok"},
        {"arm": "muon", "lr": 1e-3, "seed": 1, "steps": 1000, "final": 6.12, "status": "ok"},
    ]
    assert ca.budget_finals(rows) == {"muon": {500: [6.3, 6.35], 1000: [6.1, 6.12]}}


def test_arms_map_to_calibration_entries(ca):
    assert ca.calibration_optimizer("muon") == {"optimizer": "muon"}
    assert ca.calibration_optimizer("kfac-k1") == {"optimizer": "kfac", "k": 1}
    assert ca.calibration_optimizer("kfac-k5-deferred") == {"optimizer": "pipefisher", "k": 5,
                                                            "promote_inverses": "at_cycle_end"}
    assert ca.calibration_optimizer("kfac-k8-ready")["promote_inverses"] == "when_ready"
    assert ca.calibration_optimizer("ekfac-k1") is None and ca.calibration_optimizer("kfac-k2-i4") is None


def _study(root: Path, budget: int, arms: dict[str, dict[int, list[float]]]) -> Path:
    out = root / f"steps{budget}"
    for arm, finals in arms.items():
        for seed, final in enumerate(finals[budget]):
            key = f"b32/{arm}/lr0.001-s{seed}"
            (out / "runs" / key).mkdir(parents=True)
            (out / "runs" / key / "result.json").write_text(json.dumps({
                "key": key, "batch": 32, "arm": arm, "lr": 1e-3, "seed": seed, "damping": None, "status": "ok",
                "final": final, "steps": budget, "curve": [[budget, final]]}))
    return out


def test_convergence_writes_a_calibration_the_planner_reads(cv, tmp_path: Path):
    arms = {"nvlamb": _finals(1.0), "muon": _finals(2.0), "kfac-k4-ready": _finals(4.0)}
    dirs = [_study(tmp_path, b, arms) for b in BUDGETS]
    out = tmp_path / "cal.json"
    args = cv.parse_args(["--calibration-from", ",".join(map(str, dirs)), "--calibration-out", str(out),
                          "--text-dir", str(tmp_path / "none")])
    doc = cv.calibration_from_runs(args, dirs, None)
    from pipefisher.planning.calibration import write_calibration

    write_calibration(out, doc)
    cal = read_calibration(out)
    assert cal.method == "budget" and cal.budgets == tuple(BUDGETS) and cal.seeds == (0, 1, 2)
    assert cal.model["name"] == "bert-tiny" and cal.batch["global_batch"] == 32
    loss = cal.default_target
    assert cal.reference_steps(loss) == pytest.approx(4000)
    for opt, k, speedup in (("muon", None, 2.0), ("pipefisher", 4, 4.0)):
        entry = cal.entry(opt, k, "when_ready")
        assert entry is not None and (entry.k, entry.promote_inverses) == ((4, "when_ready") if k else (None, None))
        for p in entry.speedup:
            assert cal.steps_multiplier(opt, k, p.loss, "when_ready")[0] == pytest.approx(1 / speedup, rel=1e-4)
    with pytest.raises(SystemExit, match="needs two or more"):
        cv.calibration_from_runs(args, dirs[:1], None)
