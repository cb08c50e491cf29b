"""DualPipeV (issue 26, item 2): our generator against torch's own ``ScheduleDualPipeV`` order, our
checker, the simulator against the synchronous lower bound and DeepSeek's figures, the config's
refusals, K-FAC planning on it, and one run against single-process training. The equivalence grid
(D=2 and D=4, data parallel, five NVLAMB steps) is in ``test_pipeline_equivalence.py``, K-FAC in
``test_pipeline_kfac.py``."""

from __future__ import annotations

import pytest

from pipefisher.config import ConfigError
from pipefisher.planning.assign import plan_pipefisher
from pipefisher.planning.costs import Hardware, RunShape, estimate_run_costs
from pipefisher.model import BertConfig
from pipefisher.schedules import build_schedule, check_schedule
from pipefisher.schedules.dualpipe import dualpipev
from pipefisher.schedules.ir import ActionKind
from pipefisher.schedules.kfac import check_assignment
from pipefisher.schedules.passes import add_communication, add_grad_sync_and_step
from pipefisher.schedules.torch_csv import from_torch_csv
from pipefisher.schedules.zero_bubble import merge_adjacent_backwards
from pipefisher.simulate import CostModel, peak_activations, simulate
from pipefisher.torch_schedule import torch_schedule_csv
from tests.conftest import compose_train
from tests.dist_harness import run_cases
from tests.test_pipeline_equivalence import _cfg, assert_first_step_equals_single_process

K = ActionKind
U = 100  # one cost unit in ns
SHAPES = [(2, 4), (2, 5), (2, 8), (3, 6), (3, 7), (4, 8), (4, 9), (4, 16), (8, 16), (8, 40)]


def _orders(schedule) -> dict[int, list[str]]:
    return {w: [str(a) for a in acts if a.kind.is_compute] for w, acts in schedule.actions.items()}


def _span(schedule, cost: CostModel) -> int:
    events = simulate(schedule, cost)
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def _chunk_costs(d: int, f: int, i: int, w: int) -> CostModel:
    """Per-chunk costs (a chunk is half a worker's share of the model); B = I + W."""
    return CostModel.uniform(2 * d, f * U, (i + w) * U, input_grad_ns=i * U, weight_grad_ns=w * U)


# -- the order against torch's ------------------------------------------------------------------


@pytest.mark.parametrize("d,n", SHAPES, ids=[f"D{d}-N{n}" for d, n in SHAPES])
def test_order_equals_torch_schedule_dual_pipe_v(d: int, n: int) -> None:
    # torch 2.13's own pipeline_order (its _dump_csv, OVERLAP_F_B as its forward then its backward,
    # as torch's runtime runs them), read by our CSV reader.
    theirs = from_torch_csv(torch_schedule_csv("DualPipeV", d, n))
    ours = dualpipev(d, n, merge=False)
    assert _orders(ours) == _orders(theirs)
    assert ours.placement.workers == theirs.placement.workers  # the V: stages r and 2D-1-r on worker r
    # merge=True (what pipeline=dualpipev runs) differs only where an I and its own W run back to
    # back and nobody else waits for the gradient: there one full B replaces them.
    assert _orders(dualpipev(d, n)) == _orders(merge_adjacent_backwards(theirs))


@pytest.mark.parametrize("d,n,w", [(2, 4, 1), (2, 5, 2), (4, 8, 1), (4, 12, 2), (8, 16, 1)])
def test_built_schedule_passes_the_checker(d: int, n: int, w: int) -> None:
    s = build_schedule("dualpipev", d, n, w, num_virtual=2)
    assert s.num_stages == 2 * d and s.num_workers == d * w
    split = dualpipev(d, n, w, merge=False)
    check_schedule(add_grad_sync_and_step(add_communication(split)))  # the unmerged order runs too
    kinds = {a.kind for acts in s.actions.values() for a in acts}
    assert {K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT} <= kinds


def test_refuses_too_few_micro_batches_and_one_chunk() -> None:
    with pytest.raises(ValueError, match="num_micro_batches=7: dualpipev needs at least 2 x stages = 8 .*num_micro_batches=8"):
        dualpipev(4, 7)
    with pytest.raises(ValueError, match="pipeline.num_virtual=1: dualpipev places exactly 2 model chunks"):
        build_schedule("dualpipev", 2, 4, num_virtual=1)


@pytest.mark.parametrize("overrides,message", [
    (["pipeline=dualpipev", "stages=2", "num_micro_batches=3"], "num_micro_batches=3: dualpipev needs at least 2 x stages = 4"),
    (["pipeline=dualpipev", "stages=2", "pipeline.num_virtual=1"], "pipeline.num_virtual=1: dualpipev places exactly 2"),
    (["pipeline=dualpipev", "stages=2", "pipeline.activation_memory=1.5"], "pipeline.activation_memory=1.5: only pipeline=zb-v"),
])
def test_config_refuses_bad_shapes_before_workers_start(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_train(overrides)


def test_config_auto_gives_two_micro_batches_per_stage_and_the_v_partition() -> None:
    from pipefisher.runtime.build import schedule_for

    cfg = compose_train(["pipeline=dualpipev", "stages=2"])
    assert cfg.num_micro_batches == 4 and cfg.pipeline.num_virtual == 2
    assert schedule_for(cfg).method == "dualpipev"


# -- the simulator -------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("n_per_d", [2, 3])
@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (2, 1, 2), (3, 2, 2), (2, 1, 3)])
def test_step_is_the_synchronous_lower_bound_when_input_gradients_are_cheapest(d, n_per_d, f, i, w) -> None:
    # Without overlap (F&B = F + B: one core per worker, as torch's implementation) and without
    # communication cost, DualPipeV's order takes N·2(F+I+W) + (D-1)·F per chunk whenever F >= I and
    # W >= I: the lower bound of a synchronous step (DESIGN.md: (D-1)F/v per worker share, v = 2),
    # the same as zb-v with equal costs, for every N >= 2D.
    n = n_per_d * d
    assert _span(dualpipev(d, n, merge=False), _chunk_costs(d, f, i, w)) == (n * 2 * (f + i + w) + (d - 1) * f) * U


@pytest.mark.parametrize("d", [2, 4, 8])
def test_deepseek_count_charges_every_f_and_b_block_the_executed_order_does_not(d: int) -> None:
    # DeepSeek's bubble (PP/2-1)(F&B + B - 3W) with PP = DualPipe's ranks = 2D chunks' stages and
    # F&B = F + B is (D-1)(F + 2B - 3W): at equal costs 2(D-1)F, twice the simulated (D-1)F; with a
    # fully hidden forward (F&B = B) it is (D-1)(2B - 3W) = (D-1)F, the simulated bubble.
    n = 3 * d
    f = i = w = 1
    bubble = _span(dualpipev(d, n, merge=False), _chunk_costs(d, f, i, w)) / U - n * 2 * (f + i + w)
    b = i + w
    assert bubble == (d - 1) * (b + b - 3 * w) == (d - 1) * (f + b + b - 3 * w) / 2


@pytest.mark.parametrize("d", [2, 3, 4, 8])
def test_activation_peak_is_deepseeks_pp_plus_one(d: int) -> None:
    # DeepSeek's table: DualPipe holds PP+1 chunk activations (PP = its ranks = 2D stages here); the
    # memory model counts F..W per chunk (simulate.peak_activations): 2D+1 on worker 0, one more
    # than zb-v's and 1F1B's 2D.
    peaks = peak_activations(dualpipev(d, 4 * d, merge=False))
    assert peaks[0] == 2 * d + 1 == max(peaks.values())


# -- K-FAC on it -----------------------------------------------------------------------------------


def test_pipefisher_plans_and_checks_on_dualpipev() -> None:
    run = RunShape(BertConfig(num_layers=6, hidden_size=32, num_heads=2, vocab_size=128), "dualpipev", 2, 4, 2,
                   num_virtual=2, seq_len=16, max_predictions=3)
    schedule = run.build_schedule()
    assignment = plan_pipefisher(schedule, estimate_run_costs(run, Hardware()), run.kfac_layers)
    check_assignment(assignment)
    assert assignment.interval >= 1


# -- one run against single-process training (the grid: test_pipeline_equivalence) -------------


@pytest.mark.slow
def test_dualpipev_gives_single_process_loss_and_gradients(tmp_path) -> None:
    cfg = _cfg("dualpipev", 2, 4, 1)  # 2 processes, dropout on; data parallel: the slow grid
    (results,) = run_cases([(cfg, 1)], tmp_path)
    assert_first_step_equals_single_process(cfg, results)


@pytest.mark.slow
def test_pipefisher_on_dualpipev_equals_kfac_with_the_same_plan(tmp_path) -> None:
    # As test_pipeline_kfac's Chimera case: PipeFisher's units in DualPipeV's bubbles give the
    # parameters of K-FAC running the same plan's units after the flush (same interval, staleness).
    import dataclasses

    import torch

    from tests.test_pipeline_kfac import _cfg as kfac_cfg, _planned

    path = tmp_path / "assignment.json"
    plan = _planned(kfac_cfg("dualpipev", 2, 4, 1, "optimizer=pipefisher"), path)
    steps = 2 * plan.interval + 1
    cases = [dataclasses.replace(kfac_cfg("dualpipev", 2, 4, 1, *extra, f"optimizer.schedule={path}"), steps=steps)
             for extra in (("optimizer=pipefisher",), ("optimizer.promote_inverses=when_ready",))]  # as pipefisher's
    pipefisher, kfac = run_cases([(c, steps) for c in cases], tmp_path)
    for rank in pipefisher:
        for key, value in pipefisher[rank]["params"].items():
            torch.testing.assert_close(value, kfac[rank]["params"][key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, kk=key: f"{kk}: {m}")
    assert [sum(v) for v in pipefisher[0]["losses"]] == pytest.approx([sum(v) for v in kfac[0]["losses"]], rel=1e-5)


def test_a_dualpipev_profile_is_inferred_as_dualpipev_not_zb_v() -> None:
    # zb-v's order depends on stage costs, so inference accepts any V order with zb-v's actions; an
    # exact order match (DualPipeV's is fixed) wins over that.
    from pipefisher.planning.infer import infer_shape

    s = build_schedule("dualpipev", 2, 4, num_virtual=2)
    shape = infer_shape(simulate(s, _chunk_costs(2, 1, 1, 1)))
    assert (shape.methods, shape.stages, shape.num_micro_batches, shape.num_virtual) == (("dualpipev",), 2, 4, 2)
