"""bench/reprice.py's arithmetic: time to target = the study's steps × a step, intervals and separation."""

from __future__ import annotations


import pytest

from tests.conftest import load_bench



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
