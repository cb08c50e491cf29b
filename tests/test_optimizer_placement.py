"""``optimizer_placement=per_stage`` (issue 36, items 1, 2 and 5) equals the global step bit for bit,
and so single-process training: every schedule × optimizer, clipping off, clipping that each stage
sees coming (its own norm above the threshold: it defers its step), clipping that only the global
norm shows (the stages stepped with c = 1 roll back and redo), and a NaN gradient on one worker
(the others roll back; on_nonfinite=skip drops the update as the global step does).

``runtime.stage_steps`` [Note: post-validation]. On this model (4 layers, H=32, seq 16) the
first steps' global gradient norm is about 2–4 and each of two stages' about 1–2: max_grad_norm 0.5
makes every stage defer (not all four of zb-v's), 2.0 makes every stage step and roll back, 1e9
confirms every step.
"""

from __future__ import annotations

import pytest
import torch

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.runtime.stage_steps import StageSteps
from pipefisher.optim.baselines import build_baseline_optimizer
from pipefisher.optim.nvlamb import build_optimizer
from tests.conftest import compose_train
from tests.dist_harness import run_cases
from tests.test_pipeline_equivalence import MODEL, assert_params_equal_single_process

STEPS = 3
OFF, DEFER, ROLL_BACK = 1e9, 0.5, 2.0
SCHEDULES = [("gpipe", 2, 2), ("1f1b", 2, 4), ("chimera", 2, 4), ("zb-h1", 2, 4), ("zb-v", 2, 4)]
OPTIMIZERS = ["nvlamb", "adamw", "muon", "kfac", "pipefisher"]


def _cfg(method: str, d: int, n: int, optimizer: str, placement: str, clip: float, *extra: str) -> TrainConfig:
    model = [x for x in MODEL if not x.startswith("steps=")]
    return compose_train(model + [f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}", f"optimizer={optimizer}",
                                  f"optimizer.max_grad_norm={clip}", f"optimizer_placement={placement}",
                                  f"steps={STEPS}", *extra])


def _case_id(c: tuple) -> str:
    method, d, n, opt, clip, *extra = c
    return "-".join([method, f"D{d}", opt, f"clip{clip:g}", *[e.split("=")[-1] for e in extra]])


NAN = ("fault.mode=nan_grad", "fault.rank=1", "fault.step=1", "on_nonfinite=skip")
# DEFER on 1f1b (one stage per worker), chimera (two replicas per worker) and zb-v (four stages, some
# stepping and rolling back): gpipe's and zb-h1's (one stage per worker, every stage defers and the
# final STEP steps everything) take 1f1b's path.
DEFERRED = ("1f1b", "chimera", "zb-v")
CASES = ([(m, d, n, "nvlamb", clip) for m, d, n in SCHEDULES for clip in (OFF, DEFER, ROLL_BACK)
          if clip != DEFER or m in DEFERRED]
         + [(m, d, n, opt, ROLL_BACK) for m, d, n in SCHEDULES for opt in OPTIMIZERS[1:]]
         + [(m, d, n, opt, OFF) for m, d, n in SCHEDULES[1:3] for opt in OPTIMIZERS[1:]]
         + [("1f1b", 2, 4, "ekfac", ROLL_BACK)]
         + [(m, d, n, opt, OFF, *NAN) for m, d, n in SCHEDULES[1:3] for opt in ("nvlamb", "muon")]
         + [("1f1b", 2, 4, opt, ROLL_BACK, "sdp=2") for opt in ("nvlamb", "muon")])


@pytest.fixture(scope="module")
def placement_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, tuple[dict, dict]]:
    results = {}
    # one spawn per world size: a rank beyond a case's world waits at the next case it joins
    for cases in ([c for c in CASES if "sdp=2" not in c], [c for c in CASES if "sdp=2" in c]):
        runs = [(_cfg(*c[:4], placement, *c[4:]), STEPS) for c in cases for placement in ("global", "per_stage")]
        out = run_cases(runs, tmp_path_factory.mktemp("placement"))
        results.update({c: (out[2 * i], out[2 * i + 1]) for i, c in enumerate(cases)})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_per_stage_steps_equal_the_global_step_bit_for_bit(case, placement_results) -> None:
    glob, per = placement_results[case]
    for r in glob:
        assert per[r]["losses"] == glob[r]["losses"]
        for name, value in glob[r]["params"].items():
            torch.testing.assert_close(per[r]["params"][name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert all(x == 0 for x in glob[0]["rollbacks"])  # the global step has none to roll back
    rollbacks = per[0]["rollbacks"]
    clip = case[4]
    if case[5:] == NAN:  # the workers without the NaN stepped their stages, and undid them
        assert rollbacks[1] > 0
    elif case[3] == "nvlamb" and clip == ROLL_BACK and case[0] in ("1f1b", "chimera"):
        assert sum(rollbacks) > 0  # the rollback path runs (gpipe's N=2 norms differ: it may defer instead)
    elif case[3] == "nvlamb" and clip == OFF or (clip == DEFER and case[0] != "zb-v" and "sdp=2" not in case):
        assert rollbacks == [0] * STEPS  # confirmed, or deferred before stepping (zb-v's 4 stages: some
        # have their own norm below 0.5, step and roll back)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c[3] == "nvlamb" and len(c) == 5 and c[0] in ("1f1b", "chimera")],
                         ids=_case_id)
def test_per_stage_steps_equal_single_process_training(case, placement_results) -> None:
    assert_params_equal_single_process(_cfg(*case[:4], "per_stage", *case[4:]), placement_results[case][1])


def test_optimizer_placement_is_validated_with_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="optimizer_placement.*choose one of global, per_stage") as err:
        _cfg("1f1b", 2, 4, "nvlamb", "per-stage", OFF)
    assert "\n" not in str(err.value)


def _tiny_stage() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)


@pytest.mark.parametrize("optimizer", ["nvlamb", "adamw", "muon"])
@pytest.mark.parametrize("max_norm, rolled", [(1e9, 0), (1e-3, 0), (None, 2)])
def test_stage_steps_redo_or_confirm_equal_one_step_of_everything(optimizer, max_norm, rolled) -> None:
    """Two stages stepped apart and validated equal one global-norm step of both (CPU, one process)."""
    def build():
        a, b = _tiny_stage()
        named = [("0.encoder.layer.0.attention.self.query." + n, p) for n, p in a.named_parameters()]
        named += [("1.heads." + n, p) for n, p in b.named_parameters()]
        return a, b, named

    results = []
    for per_stage in (False, True):
        a, b, named = build()
        params = [*a.parameters(), *b.parameters()]

        def gradients(step: int) -> torch.Tensor:  # fresh each step (the optimizers clip in place)
            for p in params:
                p.grad = torch.linspace(-1, 1, p.numel()).reshape(p.shape) * (3.0 if p is a.weight else 0.7) / (step + 1)
            return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))

        norm = gradients(0)
        # between each stage's own norm and the global one: each stage steps, then rolls back
        own = max(torch.stack([p.grad.norm() for p in m.parameters()]).norm() for m in (a, b))
        threshold = float(own + norm) / 2 if max_norm is None else max_norm
        opt = (build_optimizer("nvlamb", named, 0.1, 0.01, threshold, "cpu") if optimizer == "nvlamb" else
               build_baseline_optimizer(optimizer, named, lr=0.1, weight_decay=0.01, max_grad_norm=threshold))
        for step in range(2):
            norm = gradients(step) if step else norm
            if per_stage:
                steps = StageSteps(opt, {(0, 0): a, (0, 1): b}, [], threshold)
                steps.step_stage((0, 0))
                steps.step_stage((0, 1))
                steps.finish(norm, lambda n: pytest.fail("finite norm"))
                if step == 0:
                    assert steps.rollbacks == rolled
            else:
                opt.step(grad_norm=norm)
        results.append([p.detach().clone() for p in [*a.parameters(), *b.parameters()]])
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("stop", [False, True])
def test_a_nan_norm_rolls_back_or_stops_without_copies(stop) -> None:
    """on_nonfinite=skip: the stage steps are undone (the parameters and the state as before the
    step); stop without clipping keeps no copies and the run ends at the final STEP."""
    a, b = _tiny_stage()
    named = [("a." + n, p) for n, p in a.named_parameters()] + [("b." + n, p) for n, p in b.named_parameters()]
    params = [*a.parameters(), *b.parameters()]
    before = [p.detach().clone() for p in params]
    opt = build_baseline_optimizer("adamw", named, lr=0.1, weight_decay=0.01, max_grad_norm=0.0)
    for p in params:
        p.grad = torch.ones_like(p)
    steps = StageSteps(opt, {(0, 0): a, (0, 1): b}, [], 0.0, stop_on_nonfinite=stop)
    assert steps.copies is not stop
    steps.step_stage((0, 0))
    steps.step_stage((0, 1))
    assert not torch.equal(params[0], before[0])

    class Stop(Exception):
        pass

    def nonfinite(norm: float) -> None:
        if stop:
            raise Stop(norm)

    if stop:
        with pytest.raises(Stop):
            steps.finish(torch.tensor(float("nan")), nonfinite)
        return
    steps.finish(torch.tensor(float("nan")), nonfinite)
    assert steps.rollbacks == 2
    for p, q in zip(params, before):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0)
    assert not opt.state  # AdamW's moments as before its first step: none


def test_after_a_clipped_step_every_stage_defers_instead_of_rolling_back() -> None:
    a, b = _tiny_stage()
    named = [("a." + n, p) for n, p in a.named_parameters()] + [("b." + n, p) for n, p in b.named_parameters()]
    params = [*a.parameters(), *b.parameters()]
    opt = build_baseline_optimizer("adamw", named, lr=0.1, weight_decay=0.01, max_grad_norm=1.0)
    steps = StageSteps(opt, {(0, 0): a, (0, 1): b}, [], 1.0)
    for step, expected in enumerate([2, 0]):
        for p in params:
            p.grad = torch.full_like(p, 0.05)  # each stage's own norm below 1, the global norm 2 above it
        steps.step_stage((0, 0))
        steps.step_stage((0, 1))
        assert steps.deferred == (set() if step == 0 else {(0, 0), (0, 1)})
        steps.finish(torch.tensor(2.0), lambda n: pytest.fail("finite"))
        assert steps.rollbacks == expected
