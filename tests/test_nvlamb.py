"""NVLAMB against a loop-by-loop reference; parameter groups; back-end choice; LR schedule."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from pipefisher.optim import (
    NVLAMB,
    build_optimizer,
    global_grad_norm,
    make_lr_scheduler,
    param_groups,
    warmup_poly_lr,
)
from pipefisher.optim.nvlamb import steps_per_group, steps_per_parameter
from pipefisher.runtime.state import load_optimizer_state
from tests import apex_standin

# --------------------------------------------------------------------------------------------
# A small model with biases and LayerNorm, and the independent reference
# --------------------------------------------------------------------------------------------


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 6)
        self.LayerNorm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)
        # Gets an all-zero gradient: update norm 0 -> trust ratio 1 (and ‖w‖ = 0 at the start).
        self.idle = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.LayerNorm(self.dense(x)))) + 0.0 * self.idle


def _model(seed: int = 0) -> _Tiny:
    torch.manual_seed(seed)
    return _Tiny().double()


def _backward(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    (scale * ((model(x) - y) ** 2).mean()).backward()


class _ReferenceLAMB:
    """NVLAMB written out per parameter with plain formulas (no foreach, no shared code)."""

    def __init__(self, named, lr, betas, eps, wd, max_grad_norm, use_nvlamb=True):
        self.named = list(named)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, wd
        self.max_grad_norm, self.use_nvlamb = max_grad_norm, use_nvlamb
        self.m = {n: torch.zeros_like(p) for n, p in self.named}
        self.v = {n: torch.zeros_like(p) for n, p in self.named}
        self.t = 0

    @torch.no_grad()
    def step(self, grads: dict[str, torch.Tensor], grad_norm: float | None = None) -> None:
        self.t += 1
        b1, b2 = self.betas
        if grad_norm is None:
            total = 0.0
            for g in grads.values():
                total += float((g * g).sum())
            grad_norm = math.sqrt(total)
        clip = 1.0
        if self.max_grad_norm > 0 and grad_norm > self.max_grad_norm:
            clip = self.max_grad_norm / grad_norm
        for name, p in self.named:
            g = grads[name] * clip
            self.m[name] = b1 * self.m[name] + (1 - b1) * g
            self.v[name] = b2 * self.v[name] + (1 - b2) * g * g
            m_hat = self.m[name] / (1 - b1**self.t)
            v_hat = self.v[name] / (1 - b2**self.t)
            no_decay = name.endswith("bias") or "LayerNorm" in name or name == "idle"
            wd = 0.0 if no_decay else self.wd
            update = m_hat / (v_hat.sqrt() + self.eps) + wd * p
            w_norm, u_norm = float(p.norm()), float(update.norm())
            ratio = w_norm / u_norm if (w_norm > 0 and u_norm > 0) else 1.0
            if wd == 0.0 and not self.use_nvlamb:
                ratio = 1.0
            p -= self.lr * ratio * update


def _groups(model: nn.Module, wd: float) -> list[dict]:
    # "idle" is treated as a no-decay parameter in both optimizer and reference.
    named = [(("idle.bias" if n == "idle" else n), p) for n, p in model.named_parameters()]
    return param_groups(named, wd)


def _run_both(max_grad_norm: float, *, steps: int = 4, use_nvlamb: bool = True, scale: float = 1.0):
    model, ref_model = _model(), _model()
    kw = dict(lr=0.05, betas=(0.9, 0.999), eps=1e-6)
    opt = NVLAMB(_groups(model, 0.01), weight_decay=0.01, max_grad_norm=max_grad_norm,
                 use_nvlamb=use_nvlamb, **kw)
    ref = _ReferenceLAMB(ref_model.named_parameters(), wd=0.01, max_grad_norm=max_grad_norm,
                         use_nvlamb=use_nvlamb, **kw)
    norms = []
    for s in range(steps):
        _backward(model, seed=s, scale=scale)
        _backward(ref_model, seed=s, scale=scale)
        norms.append(float(global_grad_norm(model.parameters())))
        opt.step()
        ref.step({n: p.grad for n, p in ref_model.named_parameters()})
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            assert_close(p, q, msg=lambda m, name=name, s=s: f"{name} after step {s}: {m}")
            assert_close(opt.state[p]["exp_avg"], ref.m[name])
    return norms


# --------------------------------------------------------------------------------------------
# NVLAMB numerics
# --------------------------------------------------------------------------------------------


def test_nvlamb_matches_reference_with_clipping_active():
    norms = _run_both(max_grad_norm=0.05, scale=10.0)
    assert all(n > 0.05 for n in norms), norms  # the clip really fired on every step


def test_nvlamb_matches_reference_with_clipping_inactive():
    norms = _run_both(max_grad_norm=1e3)
    assert all(n < 1e3 for n in norms)


def test_nvlamb_matches_reference_with_clipping_disabled():
    _run_both(max_grad_norm=0.0, scale=10.0)


def test_nvlamb_without_use_nvlamb_skips_trust_ratio_for_zero_decay_groups():
    _run_both(max_grad_norm=0.05, scale=10.0, use_nvlamb=False)


def test_zero_weight_decay_parameters_get_no_decay():
    # With all-zero gradients the Adam part of the update is 0: the decayed group moves by its
    # decay alone and the no-decay group (bias, LayerNorm) must stay put.
    model = _model()
    opt = NVLAMB(_groups(model, 0.1), lr=0.1, weight_decay=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        if n.endswith("bias") or "LayerNorm" in n or n == "idle":
            assert torch.equal(p, before[n]), n
        else:
            # update = wd·w, ratio = ‖w‖/‖wd·w‖ = 1/wd  ->  w -= lr·w
            assert_close(p, before[n] * (1 - 0.1), msg=n)


def test_external_grad_norm_equal_to_computed_gives_identical_step():
    a, b = _model(), _model()
    opt_a = NVLAMB(_groups(a, 0.01), lr=0.05, max_grad_norm=0.05)
    opt_b = NVLAMB(_groups(b, 0.01), lr=0.05, max_grad_norm=0.05)
    for s in range(3):
        _backward(a, s, scale=10.0)
        _backward(b, s, scale=10.0)
        opt_a.step()
        # Same summation order as the optimizer's own norm, so the value is bit-identical.
        norm = global_grad_norm(p for g in opt_b.param_groups for p in g["params"])
        opt_b.step(grad_norm=norm if s % 2 else float(norm))  # tensor and float both accepted
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_external_grad_norm_from_other_stages_clips_harder():
    # The norm over the whole pipeline is larger than this stage's own: the clip must use it.
    model, ref_model = _model(), _model()
    opt = NVLAMB(_groups(model, 0.01), lr=0.05, max_grad_norm=0.5)
    ref = _ReferenceLAMB(ref_model.named_parameters(), lr=0.05, betas=(0.9, 0.999), eps=1e-6,
                         wd=0.01, max_grad_norm=0.5)
    for s in range(2):
        _backward(model, s)
        _backward(ref_model, s)
        opt.step(grad_norm=torch.tensor(7.0))
        ref.step({n: p.grad for n, p in ref_model.named_parameters()}, grad_norm=7.0)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert_close(p, q)


def test_step_leaves_gradients_untouched_and_skips_params_without_grad():
    model = _model()
    opt = NVLAMB(_groups(model, 0.01), lr=0.05, max_grad_norm=0.01)
    _backward(model, 0, scale=10.0)
    model.out.weight.grad = None
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    w_out = model.out.weight.detach().clone()
    opt.step()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n]), n
    assert torch.equal(model.out.weight, w_out)
    assert model.out.weight not in opt.state


def test_state_dict_round_trip_continues_identically():
    a = _model()
    opt_a = NVLAMB(_groups(a, 0.01), lr=0.05, max_grad_norm=0.05)
    for s in range(2):
        _backward(a, s, scale=10.0)
        opt_a.step()

    # Checkpoint as the trainer will: torch.save, then torch.load(weights_only=True).
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = _model(seed=123)
    b.load_state_dict(ckpt["model"])
    opt_b = NVLAMB(_groups(b, 0.01), lr=0.05, max_grad_norm=0.05)
    opt_b.load_state_dict(ckpt["optim"])

    for s in range(2, 5):
        _backward(a, s, scale=10.0)
        _backward(b, s, scale=10.0)
        opt_a.step()
        opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert opt_b.state[next(b.parameters())]["step"] == 5


def test_float32_model_close_to_float64_reference():
    model32 = _model().float()
    ref_model = _model()
    opt = NVLAMB(_groups(model32, 0.01), lr=0.05, max_grad_norm=0.05)
    ref = _ReferenceLAMB(ref_model.named_parameters(), lr=0.05, betas=(0.9, 0.999), eps=1e-6,
                         wd=0.01, max_grad_norm=0.05)
    for s in range(3):
        _backward(ref_model, s, scale=10.0)
        for p, q in zip(model32.parameters(), ref_model.parameters()):
            p.grad = q.grad.float()
        opt.step()
        ref.step({n: p.grad for n, p in ref_model.named_parameters()})
    for p, q in zip(model32.parameters(), ref_model.parameters()):
        assert_close(p.double(), q, rtol=1e-5, atol=1e-6)


def test_invalid_hyperparameters_raise():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="betas"):
        NVLAMB(p, lr=0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr"):
        NVLAMB(p, lr=-1.0)


# --------------------------------------------------------------------------------------------
# global_grad_norm, param_groups
# --------------------------------------------------------------------------------------------


def test_global_grad_norm_is_norm_of_concatenated_grads_and_counts_tied_once():
    model = _model()
    _backward(model, 0)
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    params = list(model.parameters())
    assert_close(global_grad_norm(params), flat.norm())
    assert_close(global_grad_norm(params + params[:1]), flat.norm())  # duplicate counted once
    assert float(global_grad_norm([nn.Parameter(torch.ones(2))])) == 0.0


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(10, 4)
        self.encoder = nn.Linear(4, 4)
        self.layer_norm = nn.LayerNorm(4)
        self.decoder = nn.Linear(4, 10)
        self.decoder.weight = self.word_embeddings.weight  # tied, as the MLM head
        self.frozen = nn.Parameter(torch.zeros(1), requires_grad=False)


def test_param_groups_exclude_bias_and_layernorm_and_dedup_tied_weights():
    model = _Tied()
    groups = param_groups(model.named_parameters(remove_duplicate=False), weight_decay=0.01)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decay["params"]) == ids([model.word_embeddings.weight, model.encoder.weight])
    assert len(decay["params"]) == 2  # the tied weight appears once
    assert ids(no_decay["params"]) == ids(
        [model.encoder.bias, model.layer_norm.weight, model.layer_norm.bias, model.decoder.bias]
    )
    NVLAMB(groups, lr=0.1)  # torch rejects a parameter in two groups: this must not raise


def test_param_groups_drop_empty_groups():
    lin = nn.Linear(2, 2, bias=False)
    assert [len(g["params"]) for g in param_groups(lin.named_parameters(), 0.01)] == [1]
    assert param_groups([], 0.01) == []


# --------------------------------------------------------------------------------------------
# build_optimizer
# --------------------------------------------------------------------------------------------


def test_build_optimizer_picks_pure_pytorch_nvlamb_on_cpu():
    opt = build_optimizer("nvlamb", _model().named_parameters(), 0.1, 0.01, 1.0, "cpu")
    assert type(opt) is NVLAMB
    assert opt.defaults["max_grad_norm"] == 1.0


def test_build_optimizer_passes_betas_and_eps():
    opt = build_optimizer("nvlamb", _model().named_parameters(), 0.1, 0.01, 1.0, "cpu",
                          betas=(0.8, 0.99), eps=1e-8)
    assert opt.defaults["betas"] == (0.8, 0.99) and opt.defaults["eps"] == 1e-8


def test_build_optimizer_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="nvlamb, sgd"):
        build_optimizer("adamw", _model().named_parameters(), 0.1, 0.01, 1.0, "cpu")


def test_build_optimizer_sgd_accepts_grad_norm_and_clips():
    model = _model()
    opt = build_optimizer("sgd", model.named_parameters(), 0.1, 0.0, 0.5, "cpu")
    assert isinstance(opt, torch.optim.SGD)
    _backward(model, 0)
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step(grad_norm=5.0)
    for p, b, g in zip(model.parameters(), before, grads):
        assert_close(p, b - 0.1 * g * (0.5 / 5.0))


@pytest.fixture
def fake_apex(monkeypatch):
    """apex's FusedLAMB stood in (tests/apex_standin.py: its signatures, state layout and update rule)."""
    return apex_standin.install(monkeypatch)


def test_build_optimizer_uses_apex_on_cuda_and_honours_external_grad_norm(fake_apex):
    a, b = _model(), _model()
    fused = build_optimizer("nvlamb", a.named_parameters(), 0.05, 0.01, 0.5, "cuda")
    ours = build_optimizer("nvlamb", b.named_parameters(), 0.05, 0.01, 0.5, "cpu")
    assert isinstance(fused, fake_apex) and type(ours) is NVLAMB
    for s in range(3):
        _backward(a, s)
        _backward(b, s)
        fused.step(grad_norm=7.0)  # the norm of the whole pipeline, larger than this stage's
        ours.step(grad_norm=7.0)
        assert fused.defaults["max_grad_norm"] == 0.5  # threshold restored after the step
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p, q)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_apex_optimizer_takes_the_runtimes_zero_grad_call(fake_apex, set_to_none):
    model = _model()
    fused = build_optimizer("nvlamb", model.named_parameters(), 0.05, 0.01, 0.5, "cuda")
    _backward(model, 0)
    fused.zero_grad(set_to_none=set_to_none)  # the worker's call; apex's own zero_grad() takes no argument
    for p in model.parameters():
        assert (p.grad is None) if set_to_none else bool((p.grad == 0).all())


def test_build_optimizer_ignores_apex_on_cpu(fake_apex):
    opt = build_optimizer("nvlamb", _model().named_parameters(), 0.1, 0.01, 1.0, "cpu")
    assert type(opt) is NVLAMB


def test_apex_standin_matches_nvlamb_and_keeps_apexs_state_layout(fake_apex):
    """The stand-in's own clip (no external norm) and update equal NVLAMB's; its step counts are per group."""
    a, b = _model(), _model()
    fused = build_optimizer("nvlamb", a.named_parameters(), 0.05, 0.01, 0.5, "cuda")
    ours = build_optimizer("nvlamb", b.named_parameters(), 0.05, 0.01, 0.5, "cpu")
    for s in range(3):
        _backward(a, s, scale=10.0)
        _backward(b, s, scale=10.0)
        fused.step()
        ours.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert_close(p, q)
    saved = fused.state_dict()
    assert [g["step"] for g in saved["param_groups"]] == [3, 3]
    assert all(set(st) == {"exp_avg", "exp_avg_sq"} for st in saved["state"].values())


def _saved_and_continued(first: str, then: str, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two steps on back end ``first``, its checkpoint (torch.save, weights_only load) resumed on back
    end ``then`` as the runtime resumes (``load_optimizer_state``) for two more steps; and the same four steps on ``first`` alone. Returns both
    parameter lists. Back ends: ``apex`` (the stand-in, device cuda) or ``nvlamb``."""
    def build(model: nn.Module, backend: str) -> torch.optim.Optimizer:
        with monkeypatch.context() as m:
            if backend == "apex":
                apex_standin.install(m)
            return build_optimizer("nvlamb", model.named_parameters(), 0.05, 0.01, 0.5,
                                   "cuda" if backend == "apex" else "cpu")

    straight, moved = _model(), _model()
    opt_straight, opt_first = build(straight, first), build(moved, first)
    for s in range(2):
        for model, opt in ((straight, opt_straight), (moved, opt_first)):
            _backward(model, s, scale=10.0)
            opt.step()
    buf = io.BytesIO()
    torch.save(opt_first.state_dict(), buf)  # the runtime's checkpoint holds optimizer.state_dict()
    buf.seek(0)
    opt_then = build(moved, then)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt_then, lambda step: 1.0)
    saved = torch.load(buf, weights_only=True)
    load_optimizer_state(opt_then, scheduler, {"optimizer": saved, "scheduler": scheduler.state_dict()})
    for s in range(2, 4):
        for model, opt in ((straight, opt_straight), (moved, opt_then)):
            _backward(model, s, scale=10.0)
            opt.step()
    return list(straight.parameters()), list(moved.parameters())


@pytest.mark.parametrize(("first", "then"), [("apex", "nvlamb"), ("nvlamb", "apex")])
def test_checkpoint_of_one_back_end_continues_on_the_other(first, then, monkeypatch):
    """[Note: step counts of apex and NVLAMB]: apex's checkpoint resumed without apex failed with
    KeyError 'step'; NVLAMB's resumed with apex restarted the bias correction at step 1."""
    straight, moved = _saved_and_continued(first, then, monkeypatch)
    for p, q in zip(straight, moved):
        assert_close(q, p)


def test_nvlamb_checkpoint_gives_apex_the_largest_step_count_of_a_group():
    w, v = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = NVLAMB([{"params": [w, v]}], lr=0.1)
    opt.state[w].update(step=5, exp_avg=torch.zeros(2))
    opt.state[v].update(step=3, exp_avg=torch.zeros(2))  # had no gradient at two steps
    steps_per_group(opt)
    assert opt.param_groups[0]["step"] == 5 and "step" not in opt.state[w] and "step" not in opt.state[v]
    steps_per_parameter(opt)
    assert "step" not in opt.param_groups[0] and opt.state[w]["step"] == opt.state[v]["step"] == 5


# --------------------------------------------------------------------------------------------
# LR schedule
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.25),  # t = 1: warm-up already above 0 at step 0
        (2, 0.75),  # t = 3
        (3, math.sqrt(1 - 4 / 10)),  # t = 4 = warmup: decay branch, (1 - 0.4)^0.5
        (5, math.sqrt(1 - 6 / 10)),
        (8, math.sqrt(1 - 9 / 10)),
        (9, 0.0),  # t = total: last step has lr 0
        (25, 0.0),  # past the end: stays 0
    ],
)
def test_warmup_poly_lr_hand_computed(step, expected):
    lr = warmup_poly_lr(step, base_lr=2.0, warmup_steps=4, total_steps=10)
    assert lr == pytest.approx(2.0 * expected, abs=1e-12)


def test_warmup_poly_lr_power_and_no_warmup():
    assert warmup_poly_lr(5, base_lr=1.0, warmup_steps=2, total_steps=10, power=1.0) == pytest.approx(0.4)
    assert warmup_poly_lr(0, base_lr=1.0, warmup_steps=0, total_steps=4) == pytest.approx(math.sqrt(0.75))


def test_warmup_poly_lr_rejects_bad_arguments():
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_poly_lr(0, base_lr=1.0, warmup_steps=11, total_steps=10)
    with pytest.raises(ValueError, match="total_steps"):
        warmup_poly_lr(0, base_lr=1.0, warmup_steps=0, total_steps=0)


def test_make_lr_scheduler_follows_warmup_poly_lr_per_group_and_round_trips():
    model = _model()
    opt = NVLAMB(_groups(model, 0.01), lr=0.2)
    opt.param_groups[1]["lr"] = 0.1  # per-group peak rates are kept
    sched = make_lr_scheduler(opt, warmup_steps=3, total_steps=8)
    seen = []
    for step in range(5):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()  # no grads: a no-op, keeps torch's "step before scheduler" order
        sched.step()
    for step, lrs in enumerate(seen):
        for lr, base in zip(lrs, (0.2, 0.1)):
            assert lr == pytest.approx(warmup_poly_lr(step, base_lr=base, warmup_steps=3, total_steps=8))

    state = copy.deepcopy(sched.state_dict())
    opt2 = NVLAMB(_groups(_model(), 0.01), lr=0.2)
    opt2.param_groups[1]["lr"] = 0.1
    sched2 = make_lr_scheduler(opt2, warmup_steps=3, total_steps=8)
    sched2.load_state_dict(state)
    opt.step(), sched.step()
    opt2.step(), sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]


def test_make_lr_scheduler_base_lr_sets_every_group_peak():
    opt = NVLAMB(_groups(_model(), 0.01), lr=0.5)
    make_lr_scheduler(opt, warmup_steps=2, total_steps=4, base_lr=0.2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.1])  # step 0: 0.2 · 1/2
