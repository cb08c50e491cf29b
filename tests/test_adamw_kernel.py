"""``optimizer.adamw_kernel`` (``pipefisher.optim.baselines`` [Note: AdamW's kernel]): torch's AdamW as a loop
(``auto`` on CPU), ``foreach`` or ``fused``, for ``optimizer=adamw`` and Muon's AdamW half. foreach equals the
loop bit for bit on CPU; fused stays within a measured tolerance of it on a tiny BERT and is not bit-equal (so
the option really switches the kernel); a pipeline (and sdp, tp: DTensor parameters) with the option equals
one process with the same option; a checkpoint resumes under this run's kernel; bad values are refused.
"""

from __future__ import annotations

import dataclasses
import io
import logging
from pathlib import Path

import pytest
import torch

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.config.choices import ADAMW_KERNELS as CONFIG_ADAMW_KERNELS
from pipefisher.model import build_full_model
from pipefisher.optim.baselines import ADAMW_KERNELS, GlobalNormAdamW, MuonAdamW, build_baseline_optimizer
from pipefisher.run_spec import bert_config
from tests import test_pipeline_equivalence as equiv
from tests.conftest import compose_train
from tests.dist_harness import run_cases
from tests.reference import one_thread, train_single_process

# [Note: fused AdamW's tolerance] torch's fused AdamW computes the same update as its per-tensor loop in
# another order (bias corrections folded into the step size), so parameters differ in the last bits of
# a step, and training feeds that back through the next gradients. Measured here (equiv.MODEL: a 4-layer
# BERT of width 32, 5 steps at lr 0.01, one thread, torch 2.13.0 CPU) the largest parameter difference
# fused vs loop is 3.6e-7 (adamw) and 1.8e-7 (muon with fp32 Newton–Schulz); after 20 steps 2.8e-7 and
# 7.9e-7. The tolerance below is torch's own for fused vs foreach (rtol 1e-5, its
# test_fused_optimizers) with atol 1e-6, about 3x the 5-step difference: a lost hyperparameter (the
# decay, eps, a bias correction) moves parameters by ~lr·1e-2 = 1e-4 in one step, far outside it. With
# Muon's Newton–Schulz in bf16 a last-bit difference grows to ~1e-3 in 5 steps (tests/
# test_baseline_optimizers.py [Note: Muon and summation order]), so the tolerance holds for fp32 NS only.
FUSED_CLOSE = {"rtol": 1e-5, "atol": 1e-6}


def _train(name: str, kernel: str, *extra: str) -> tuple[dict[str, torch.Tensor], float]:
    """Parameters and last loss of equiv.MODEL trained 5 steps in one process with ``kernel``."""
    cfg = compose_train(equiv.MODEL + [f"optimizer={name}", f"optimizer.adamw_kernel={kernel}", *extra])
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    with one_thread():
        last = train_single_process(cfg, model=model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, last["loss"]


def test_config_and_optimizer_list_the_same_kernels() -> None:
    assert CONFIG_ADAMW_KERNELS == ADAMW_KERNELS == ("auto", "foreach", "fused")


@pytest.mark.parametrize("name,extra", [("adamw", ()), ("muon", ("optimizer.ns_dtype=fp32",))])
def test_foreach_equals_the_loop_and_fused_is_close_but_not_equal_on_a_tiny_bert(name: str, extra: tuple) -> None:
    loop, loop_loss = _train(name, "auto", *extra)
    foreach, foreach_loss = _train(name, "foreach", *extra)
    fused, fused_loss = _train(name, "fused", *extra)
    assert foreach_loss == loop_loss and fused_loss == pytest.approx(loop_loss, rel=1e-6)
    for n in loop:
        assert torch.equal(foreach[n], loop[n]), f"foreach {n}"
        torch.testing.assert_close(fused[n], loop[n], **FUSED_CLOSE, msg=lambda m, n=n: f"fused {n}: {m}")
    assert any(not torch.equal(fused[n], loop[n]) for n in loop), "fused equals the loop bit for bit: not fused?"


def test_the_kernel_reaches_torch_adamw_in_both_optimizers() -> None:
    lin = torch.nn.Linear(4, 4)
    named = [("bert.encoder.layer.0.attention.self.query.weight", lin.weight), ("bert.pooler.dense.bias", lin.bias)]
    for kernel, (foreach, fused) in {"auto": (None, None), "foreach": (True, None), "fused": (None, True)}.items():
        adamw = build_baseline_optimizer("adamw", named, lr=0.1, weight_decay=0.01, max_grad_norm=1.0, adamw_kernel=kernel)
        muon = build_baseline_optimizer("muon", named, lr=0.1, weight_decay=0.01, max_grad_norm=1.0, adamw_kernel=kernel)
        assert isinstance(adamw, GlobalNormAdamW) and isinstance(muon, MuonAdamW) and muon.muon is not None
        for group in adamw.param_groups + muon.adamw.param_groups:
            assert (group["foreach"], group["fused"]) == (foreach, fused), kernel
    with pytest.raises(ValueError, match="adamw_kernel='loop': choose one of auto, foreach, fused"):
        build_baseline_optimizer("adamw", named, lr=0.1, weight_decay=0.0, max_grad_norm=1.0, adamw_kernel="loop")


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_checkpoint_resumes_under_this_runs_kernel(name: str) -> None:
    """The saved groups carry the saving run's kernel flags; loading keeps this run's, and the step
    counts move where its kernel keeps them (fused: float32 on the parameter's device)."""
    def build(kernel: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        named = [(f"bert.encoder.layer.0.output.dense.{n}", p) for n, p in model[0].named_parameters()]
        named += [(f"bert.encoder.layer.0.output.LayerNorm.{n}", p) for n, p in model[1].named_parameters()]
        return model, build_baseline_optimizer(name, named, lr=0.1, weight_decay=0.01, max_grad_norm=1.0,
                                               adamw_kernel=kernel)

    def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
        for i in range(n):
            model(torch.full((2, 4), float(i + 1))).square().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    for saved, loaded in (("fused", "auto"), ("auto", "fused"), ("foreach", "auto")):
        model, opt = build(saved)
        steps(model, opt, 2)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        model2, opt2 = build(loaded)
        model2.load_state_dict(model.state_dict())
        opt2.load_state_dict(torch.load(buffer, weights_only=True))
        adamw = opt2 if name == "adamw" else opt2.adamw
        flags = {"auto": (None, None), "foreach": (True, None), "fused": (None, True)}[loaded]
        assert all((g["foreach"], g["fused"]) == flags for g in adamw.param_groups), (saved, loaded)
        assert all(s["step"].dtype == torch.float32 and float(s["step"]) == 2.0 for s in adamw.state.values())
        steps(model2, opt2, 1)  # the loaded state steps under this run's kernel
        assert all(float(s["step"]) == 3.0 for s in adamw.state.values())


@pytest.mark.parametrize("overrides,message", [
    (["optimizer=adamw", "optimizer.adamw_kernel=loop"], "optimizer.adamw_kernel='loop': choose one of auto, foreach, fused"),
    (["optimizer=muon", "optimizer.adamw_kernel=FUSED"], "optimizer.adamw_kernel='FUSED': choose one of"),
])
def test_bad_kernels_are_refused_naming_the_field_and_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        compose_train(overrides)


def test_fused_is_refused_before_workers_start_where_torch_has_no_fused_adamw_for_the_device(monkeypatch) -> None:
    import torch.utils._foreach_utils as foreach_utils

    monkeypatch.setattr(foreach_utils, "_get_fused_kernels_supported_devices", lambda: ["cuda"])  # torch < 2.4
    with pytest.raises(ConfigError, match=r"^optimizer.adamw_kernel='fused': torch .* has no fused AdamW for device "
                                          r"cpu; use optimizer.adamw_kernel=foreach \(or auto\)$"):
        compose_train(["optimizer=adamw", "optimizer.adamw_kernel=fused", "device=cpu"])
    assert compose_train(["optimizer=adamw", "optimizer.adamw_kernel=foreach", "device=cpu"]).optimizer.adamw_kernel == "foreach"


def test_a_kernel_set_without_adamw_warns_that_it_has_no_effect(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pipefisher.config"):
        cfg = compose_train(["optimizer=nvlamb", "optimizer.adamw_kernel=fused"])
    assert cfg.optimizer.adamw_kernel == "fused"
    assert "optimizer.adamw_kernel has no effect unless optimizer=adamw or muon" in caplog.text


# Pipeline cases, each against one process with the same option. Exact ones (N=1, no clip: the sums agree
# bit for bit, tests/test_baseline_optimizers.py [Note: Muon and summation order]) would fail if a worker
# ran another kernel (fused vs loop differ by ~3e-7 after 5 steps, ~1e-3 with bf16 Newton–Schulz); the
# sharded ones (sdp, tp: DTensor parameters, whose fused step DTensor propagates) sum in another order
# and compare at the pipeline tests' tolerance.
PIPELINE_CASES = {
    "adamw-1f1b-D2-exact": (["optimizer=adamw", "pipeline=1f1b", "stages=2", "num_micro_batches=1",
                             "optimizer.max_grad_norm=1e9"], True),
    "muon-1f1b-D2-bf16-exact": (["optimizer=muon", "pipeline=1f1b", "stages=2", "num_micro_batches=1",
                                 "optimizer.max_grad_norm=1e9", "optimizer.ns_dtype=bf16"], True),
    "muon-chimera-D2-per_stage": (["optimizer=muon", "pipeline=chimera", "stages=2", "num_micro_batches=2",
                                   "optimizer.ns_dtype=fp32", "optimizer_placement=per_stage"], False),
    "adamw-sdp2": (["optimizer=adamw", "pipeline=gpipe", "stages=1", "num_micro_batches=2", "sdp=2"], False),
    "muon-tp2": (["optimizer=muon", "pipeline=gpipe", "stages=1", "num_micro_batches=2", "tp=2",
                  "optimizer.ns_dtype=fp32"], False),
}


def _pipeline_cfg(overrides: list[str]) -> TrainConfig:
    return compose_train(equiv.MODEL + overrides + ["optimizer.adamw_kernel=fused"])


@pytest.mark.slow
def test_pipelines_with_fused_adamw_equal_one_process_with_fused_adamw(tmp_path: Path) -> None:
    cfgs = {case: _pipeline_cfg(overrides) for case, (overrides, _) in PIPELINE_CASES.items()}
    results = run_cases([(cfg, cfg.steps) for cfg in cfgs.values()], tmp_path)
    for (case, cfg), result in zip(cfgs.items(), results):
        exact = PIPELINE_CASES[case][1]
        with one_thread():  # as dist_harness's workers
            ref_params, ref_last_loss = equiv._reference_params(cfg)
        assert sum(result[0]["losses"][-1]) == pytest.approx(ref_last_loss, rel=1e-5), case
        tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": equiv.PARAM_ATOL}
        params = {(equiv.WORD if n == equiv.DECODER else n): v for n, v in equiv._by_name(result, "params")}
        for pname, value in params.items():
            torch.testing.assert_close(value, ref_params[pname], **tol, msg=lambda m, n=pname, c=case: f"{c} {n}: {m}")
        if exact:  # and the comparison can tell the kernels apart: the loop's run is not these parameters
            loop = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, adamw_kernel="auto"))
            with one_thread():
                loop_params, _ = equiv._reference_params(loop)
            assert any(not torch.equal(v, loop_params[n]) for n, v in params.items()), case
