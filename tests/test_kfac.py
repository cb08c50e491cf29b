"""K-FAC: dense and Kronecker references, replicas, damping, intervals, convergence, asdl, checkpoints.

Shape legend: B sequences, S tokens per sequence, T = B·S rows, I input and O output features.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.testing import assert_close

from pipefisher.model.bert import build_full_model
from pipefisher.model.config import BertConfig
from pipefisher.optim.kfac import ENCODER_LINEAR_PATTERN, KFACPreconditioner, select_linears
from pipefisher.optim.kfac_driver import KFAC
from pipefisher.optim.kfac_factors import (
    damped_inverse,
    factored_damping,
    grad_factor_sum,
    input_factor_sum,
    kron_precondition,
    kron_precondition_,
    row_aligned,
)
from pipefisher.optim.nvlamb import build_optimizer

torch.set_num_threads(1)

F64 = torch.float64
I_DIM, O_DIM, B, S = 5, 3, 2, 4  # the tiny layer: nn.Linear(5, 3) on [B, S, 5] micro-batches


# --------------------------------------------------------------------------------------------
# The tiny layer, its micro-batches, and the dense reference written with plain matrix products
# --------------------------------------------------------------------------------------------


def _layer(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(I_DIM, O_DIM).double()


def _micro_batches(n: int, seed: int = 1, x_scale: float = 1.0) -> list[tuple[Tensor, Tensor]]:
    """``n`` micro-batches (x [B, S, I], target [B, S, O])."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            x_scale * torch.randn(B, S, I_DIM, generator=gen, dtype=F64),
            torch.randn(B, S, O_DIM, generator=gen, dtype=F64),
        )
        for _ in range(n)
    ]


def _loss(y: Tensor, target: Tensor) -> Tensor:
    """Mean over the T rows of 0.5·‖y − target‖²."""
    return 0.5 * ((y - target) ** 2).sum(-1).mean()


def _capture(pre: KFACPreconditioner, lin: nn.Linear, mbs: list[tuple[Tensor, Tensor]], loss_scale: float) -> None:
    """Forward and backward of every micro-batch, loss scaled by ``loss_scale``, with capture on."""
    pre.set_capture(True)
    for j, (x, t) in enumerate(mbs):
        with pre.micro_batch(j):
            (loss_scale * _loss(lin(x), t)).backward()


def _refresh(pre: KFACPreconditioner, name: str, micro_batches: range) -> None:
    """The work units of one refresh of one layer, called one by one."""
    for j in micro_batches:
        pre.curvature_a(name, j)
        pre.curvature_b(name, j)
    pre.update_factors(name)
    pre.step_curvature_done()


def _dense_factors(lin: nn.Linear, mbs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """A, B and the per-row residuals R, from stacked rows (weights as they are now).

    x̃ = [x, 1] (bias column); g̃ = y − target, the gradient of the per-row loss, which is the
    captured gradient rescaled by T / loss_scale.
    """
    x = torch.cat([x.reshape(-1, I_DIM) for x, _ in mbs])  # [N·T, I]
    x1 = torch.cat([x, torch.ones(len(x), 1, dtype=F64)], dim=1)  # [N·T, I+1]
    wb = torch.cat([lin.weight.detach(), lin.bias.detach()[:, None]], dim=1)  # [O, I+1]
    r = x1 @ wb.T - torch.cat([t.reshape(-1, O_DIM) for _, t in mbs])  # [N·T, O]
    return x1.T @ x1 / len(x1), r.T @ r / len(r), r


def _split_damping(a: Tensor, b: Tensor, lam: float) -> tuple[float, float]:
    pi = math.sqrt((float(a.trace()) / a.shape[0]) / (float(b.trace()) / b.shape[0]))
    return pi * math.sqrt(lam), math.sqrt(lam) / pi


def _grad_matrix(lin: nn.Linear) -> Tensor:
    return torch.cat([lin.weight.grad, lin.bias.grad[:, None]], dim=1)  # [O, I+1]


# --------------------------------------------------------------------------------------------
# 1. Against the dense computation and the Kronecker form
# --------------------------------------------------------------------------------------------


def test_preconditioned_gradient_matches_dense_and_kronecker_reference() -> None:
    lam, n = 1e-2, 3
    lin = _layer()
    mbs = _micro_batches(n)
    pre = KFACPreconditioner({"lin": lin}, damping=lam, loss_scale=1.0 / n, factor_dtype=F64)
    _capture(pre, lin, mbs, loss_scale=1.0 / n)
    _refresh(pre, "lin", range(n))
    pre.invert("lin")

    a, b, r = _dense_factors(lin, mbs)
    x1 = torch.cat([torch.cat([x.reshape(-1, I_DIM), torch.ones(B * S, 1, dtype=F64)], 1) for x, _ in mbs])
    g = r.T @ x1 / (B * S * n)  # [O, I+1]: the accumulated gradient of the mean loss
    assert_close(_grad_matrix(lin), g)  # the reference sees the gradient autograd produced
    assert_close(pre.layer("lin").a, a)
    assert_close(pre.layer("lin").b, b)

    lam_a, lam_b = _split_damping(a, b, lam)
    a_inv = torch.linalg.inv(a + lam_a * torch.eye(I_DIM + 1, dtype=F64))
    b_inv = torch.linalg.inv(b + lam_b * torch.eye(O_DIM, dtype=F64))
    expected = b_inv @ g @ a_inv  # [O, I+1]
    assert pre.precondition("lin")
    assert_close(lin.weight.grad, expected[:, :I_DIM])
    assert_close(lin.bias.grad, expected[:, I_DIM])

    # vec(B⁻¹ G A⁻¹) = (A⁻¹ ⊗ B⁻¹) vec(G), vec stacking columns (A⁻¹ is symmetric).
    vec = lambda m: m.T.reshape(-1)  # noqa: E731
    assert_close(vec(_grad_matrix(lin)), torch.kron(a_inv, b_inv) @ vec(g))


def test_running_average_folds_refreshes_with_factor_decay() -> None:
    lin = _layer()
    first, second = _micro_batches(2, seed=1), _micro_batches(2, seed=2)
    for decay in (0.95, 0.0):
        pre = KFACPreconditioner({"lin": lin}, factor_decay=decay, loss_scale=0.5, factor_dtype=F64)
        _capture(pre, lin, first, loss_scale=0.5)
        _refresh(pre, "lin", range(2))
        a1, b1, _ = _dense_factors(lin, first)
        assert_close(pre.layer("lin").a, a1)  # the first update takes the estimate as it is
        _capture(pre, lin, second, loss_scale=0.5)
        _refresh(pre, "lin", range(2))
        a2, b2, _ = _dense_factors(lin, second)
        assert_close(pre.layer("lin").a, decay * a1 + (1 - decay) * a2)
        assert_close(pre.layer("lin").b, decay * b1 + (1 - decay) * b2)
        assert pre.layer("lin").num_updates == 2
        pre.remove_hooks()


# --------------------------------------------------------------------------------------------
# 2. Replicas: factor sums over half the micro-batches each, all-reduced, equal one process
# --------------------------------------------------------------------------------------------


def test_replica_factors_summed_via_factor_tensors_equal_single_process() -> None:
    n, world = 4, 2
    lin = _layer()
    mbs = _micro_batches(n)
    single = KFACPreconditioner({"lin": lin}, loss_scale=1.0 / n, factor_dtype=F64)
    _capture(single, lin, mbs, loss_scale=1.0 / n)
    _refresh(single, "lin", range(n))
    single.invert("lin")
    single.remove_hooks()

    half = n // world
    replicas = []
    for r in range(world):  # replica r runs micro-batches r·half .. (r+1)·half − 1 on its copy
        rep_lin = copy.deepcopy(lin)
        pre = KFACPreconditioner({"lin": rep_lin}, loss_scale=1.0 / (half * world), factor_dtype=F64)
        _capture(pre, rep_lin, mbs[r * half : (r + 1) * half], loss_scale=1.0 / (half * world))
        for j in range(half):
            pre.curvature_a("lin", j)
            pre.curvature_b("lin", j)
        replicas.append(pre)
    tensors = [pre.factor_tensors("lin") for pre in replicas]
    # Collectives need contiguous tensors: the row-aligned sums become contiguous means here.
    assert all(t.is_contiguous() for ts in tensors for t in ts)
    for k in range(2):  # the all-reduce (sum), in place on every replica
        total = sum(t[k].clone() for t in tensors)
        for t in tensors:
            t[k].copy_(total)
    for pre in replicas:
        pre.finish_sync("lin", world)
        pre.update_factors("lin")
        pre.invert("lin")
        pre.step_curvature_done()
        for key in ("a", "b", "a_inv", "b_inv"):
            assert_close(getattr(pre.layer("lin"), key), getattr(single.layer("lin"), key))


# --------------------------------------------------------------------------------------------
# 3. Damping from both traces in one inversion unit (the reference defect)
# --------------------------------------------------------------------------------------------


def test_inversion_uses_both_traces_and_keeps_the_factors() -> None:
    lam = 1e-3
    lin = _layer()
    with torch.no_grad():
        lin.weight.zero_()  # residuals independent of x, so scaling x scales A only
    mbs = _micro_batches(2, x_scale=30.0)  # tr A / dim A >> tr B / dim B: π far from 1
    pre = KFACPreconditioner({"lin": lin}, damping=lam, loss_scale=0.5, factor_dtype=F64)
    _capture(pre, lin, mbs, loss_scale=0.5)
    _refresh(pre, "lin", range(2))
    state = pre.layer("lin")
    a_before, b_before = state.a.clone(), state.b.clone()

    pre.invert("lin")
    lam_a, lam_b = _split_damping(a_before, b_before, lam)
    assert state.damping == pytest.approx((lam_a, lam_b), rel=1e-12)
    assert lam_a / math.sqrt(lam) > 10 and lam_b / math.sqrt(lam) < 0.1  # π ≠ 1: both traces mattered
    # The partner factor is intact after the inversion (the defect zeroed it, so the second
    # inversion of the reference code saw tr = 0), and a second inversion gives the same inverses.
    assert torch.equal(state.a, a_before) and torch.equal(state.b, b_before)
    a_inv, b_inv = state.a_inv.clone(), state.b_inv.clone()
    assert_close(a_inv, torch.linalg.inv(a_before + lam_a * torch.eye(I_DIM + 1, dtype=F64)))
    assert_close(b_inv, torch.linalg.inv(b_before + lam_b * torch.eye(O_DIM, dtype=F64)))
    pre.invert("lin")
    assert torch.equal(state.a_inv, a_inv) and torch.equal(state.b_inv, b_inv)


def test_factored_damping_falls_back_to_even_split_on_a_zero_trace() -> None:
    a = torch.diag(torch.tensor([4.0, 4.0], dtype=F64))
    b = torch.diag(torch.tensor([1.0, 1.0, 1.0], dtype=F64))
    assert factored_damping(a, b, 1e-2) == pytest.approx((0.2, 0.05))  # π = 2
    assert factored_damping(a, torch.zeros(3, 3, dtype=F64), 1e-2) == pytest.approx((0.1, 0.1))


def test_pure_helpers_match_dense_forms() -> None:
    x = torch.randn(2, 3, 4, dtype=F64)
    x1 = torch.cat([x.reshape(-1, 4), torch.ones(6, 1, dtype=F64)], 1)
    assert_close(input_factor_sum(x, bias=True, dtype=F64), x1.T @ x1)
    assert_close(input_factor_sum(x, bias=False, dtype=F64), x1[:, :4].T @ x1[:, :4])
    f = x1.T @ x1
    # Sums over several micro-batches accumulate in place into the first one's tensor.
    acc = input_factor_sum(x[0], bias=True, dtype=F64)
    assert input_factor_sum(x[1], bias=True, dtype=F64, out=acc) is acc
    assert_close(acc, x1.T @ x1)
    g = torch.randn(6, 3, dtype=F64)
    acc = grad_factor_sum(g[:2], 2.0, dtype=F64)
    assert grad_factor_sum(g[2:], 2.0, dtype=F64, out=acc) is acc
    assert_close(acc, 4.0 * g.T @ g)
    assert_close(damped_inverse(f, 0.3), torch.linalg.inv(f + 0.3 * torch.eye(5, dtype=F64)))  # float64 stays
    big = torch.eye(1100) * 2.0  # above FP64_MAX_DIM: float32 under "auto" too
    assert_close(damped_inverse(big, 2.0, precision="auto"), torch.eye(1100) / 4.0)
    with pytest.raises(ValueError, match="precision='float16'"):
        damped_inverse(f, 0.3, precision="float16")


def test_float32_inversion_of_a_rank_deficient_factor_matches_float64_dense_reference() -> None:
    """The default float32 inversion is accurate enough ([Note: inversion precision] in kfac_factors).

    A layer of 128 inputs and 64 outputs sees 24 rows, with an offset and uneven feature scales
    like real activations: A (129×129) has rank ≤ 24 and B (64×64) rank ≤ 24, damping 1e-3 split
    by π (cond(A + λ_A I) ≈ 7e2). The preconditioned gradient from float32 factors and float32
    inverses is within 1e-4 (relative Frobenius norm; measured 4e-6 here, 1e-4 on bert-mini's
    factors of a 64-token batch) of the float64 dense reference, torch.linalg.inv of the damped
    float64 factors.
    """
    gen = torch.Generator().manual_seed(3)
    rows, d_in, d_out, lam = 24, 128, 64, 1e-3
    x = 0.5 + torch.randn(rows, d_in, generator=gen, dtype=F64) * torch.logspace(-2, 1, d_in, dtype=F64)
    g = torch.randn(rows, d_out, generator=gen, dtype=F64) * torch.logspace(-3, 0, d_out, dtype=F64)
    a64, b64 = input_factor_sum(x, bias=True, dtype=F64) / rows, grad_factor_sum(g, 1.0, dtype=F64) / rows
    grad = torch.randn(d_out, d_in + 1, generator=gen, dtype=F64)  # [O, Ĩ]
    lam_a, lam_b = factored_damping(a64, b64, lam)
    eye_a, eye_b = torch.eye(d_in + 1, dtype=F64), torch.eye(d_out, dtype=F64)
    a_inv64, b_inv64 = torch.linalg.inv(a64 + lam_a * eye_a), torch.linalg.inv(b64 + lam_b * eye_b)
    reference = b_inv64 @ grad @ a_inv64
    assert torch.linalg.matrix_rank(a64).item() <= rows + 1 and torch.linalg.cond(a64 + lam_a * eye_a) > 300

    a32, b32 = a64.float(), b64.float()

    def relative_error(precision: str) -> tuple[float, float]:
        a_inv, b_inv = damped_inverse(a32, lam_a, precision=precision), damped_inverse(b32, lam_b, precision=precision)
        assert a_inv.dtype == b_inv.dtype == torch.float32  # returned in the factor's dtype whatever the precision
        got = kron_precondition(grad.float(), a_inv, b_inv).double()
        inverse_error = (a_inv.double() - a_inv64).norm() / a_inv64.norm()
        return float((got - reference).norm() / reference.norm()), float(inverse_error)

    err32, inv_err32 = relative_error("float32")  # the default
    assert relative_error("float32") == (err32, inv_err32)
    err64, inv_err64 = relative_error("float64")
    assert err32 < 1e-4 and err64 < 1e-4
    # float64 really works in float64: its inverse is the reference rounded to float32 (the
    # factors' own rounding aside), closer than float32's.
    assert inv_err64 < 1e-5 and inv_err64 <= inv_err32
    assert damped_inverse(a32, lam_a).equal(damped_inverse(a32, lam_a, precision="float32"))


@pytest.mark.parametrize("aligned", [True, False], ids=["row-aligned", "contiguous"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("inverse_dtype", [torch.float32, F64], ids=["fp32-inverses", "fp64-inverses"])
def test_in_place_preconditioning_matches_the_concatenated_product(
    bias: bool, inverse_dtype: torch.dtype, aligned: bool
) -> None:
    gen = torch.Generator().manual_seed(4)
    d_in, d_out = 7, 5
    d_a = d_in + int(bias)
    a = torch.randn(d_a, d_a, generator=gen, dtype=F64)
    b = torch.randn(d_out, d_out, generator=gen, dtype=F64)
    a_inv, b_inv = (a @ a.T).to(inverse_dtype), (b @ b.T).to(inverse_dtype)  # symmetric, as inverses are
    w_grad = torch.randn(d_out, d_in, generator=gen)  # float32 gradients
    b_grad = torch.randn(d_out, generator=gen) if bias else None
    g = w_grad if b_grad is None else torch.cat([w_grad, b_grad[:, None]], dim=1)  # [O, Ĩ]
    expected = kron_precondition(g, a_inv, b_inv).float()
    if aligned:  # as LinearKFAC.invert stores them: rows padded to 16 elements, same values
        a_inv, b_inv = row_aligned(a_inv), row_aligned(b_inv)
        assert a_inv.stride(0) == b_inv.stride(0) == 16 and a_inv.clone().is_contiguous()
        assert_close(kron_precondition(g, a_inv, b_inv).float(), expected)
    w_ptr = w_grad.data_ptr()
    kron_precondition_(w_grad, b_grad, a_inv, b_inv)
    assert w_grad.data_ptr() == w_ptr and w_grad.dtype == torch.float32
    assert_close(w_grad, expected[:, :d_in])
    if bias:
        assert_close(b_grad, expected[:, d_in])


# --------------------------------------------------------------------------------------------
# 4. Intervals and staleness
# --------------------------------------------------------------------------------------------


def _mlp(seed: int = 1, d_in: int = 6, hidden: int = 8, d_out: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, d_out))


@pytest.mark.parametrize(("curvature_interval", "inverse_interval"), [(3, 3), (1, 2)])
def test_factors_and_inverses_change_only_on_their_interval_steps(
    curvature_interval: int, inverse_interval: int
) -> None:
    model = _mlp()
    kfac = KFAC(
        model,
        lr=0.05,
        base="sgd",
        include=None,
        max_grad_norm=0.0,
        damping=1e-2,
        curvature_interval=curvature_interval,
        inverse_interval=inverse_interval,
        loss_scale=0.5,
    )
    pre = kfac.preconditioner
    name = pre.layer_names[0]
    gen = torch.Generator().manual_seed(3)
    prev_a = prev_inv = None
    for step in range(8):
        kfac.on_step_start(step)
        for j in range(2):
            with kfac.micro_batch(j):
                x = torch.randn(4, 6, generator=gen)
                (0.5 * F.mse_loss(model(x), torch.randn(4, 3, generator=gen))).backward()
        captured = pre.captured_micro_batches(name)
        assert captured == (([0, 1], [0, 1]) if step % curvature_interval == 0 else ([], []))
        kfac.step(step)
        kfac.zero_grad()
        a, a_inv = pre.layer(name).a.clone(), pre.layer(name).a_inv.clone()
        if prev_a is not None:
            assert (not torch.equal(a, prev_a)) == (step % curvature_interval == 0), step
            assert (not torch.equal(a_inv, prev_inv)) == (step % inverse_interval == 0), step
        # Staleness: the inverses in use at step t were made at inverse_interval·⌊t/inverse_interval⌋.
        assert pre.last_inverse_step == inverse_interval * (step // inverse_interval)
        assert pre.last_refresh_step == curvature_interval * (step // curvature_interval)
        prev_a, prev_inv = a, a_inv


# --------------------------------------------------------------------------------------------
# 5. Convergence on a small learnable problem
# --------------------------------------------------------------------------------------------

_CLS_IN, _CLS_HIDDEN, _CLS_CLASSES, _CLS_SAMPLES = 16, 32, 8, 1024


def _classification_problem(seed: int = 0) -> tuple[Tensor, Tensor]:
    """Inputs with a rotated, ill-conditioned covariance (scales 1 … 0.01); labels from a
    linear teacher on the whitened inputs, so every direction matters."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(_CLS_IN, _CLS_IN, generator=gen))
    mix = q * torch.logspace(0, -2, _CLS_IN)  # [I, I]
    z = torch.randn(_CLS_SAMPLES, _CLS_IN, generator=gen)
    teacher = torch.randn(_CLS_CLASSES, _CLS_IN, generator=gen)
    return z @ mix.T, (z @ teacher.T).argmax(-1)


def _steps_to_target(optimizer: str, lr: float, target: float, max_steps: int, n: int = 2, mb: int = 64) -> int | None:
    """Steps until the full-data cross-entropy is below ``target`` (None: not within max_steps)."""
    x, y = _classification_problem()
    model = _mlp(1, _CLS_IN, _CLS_HIDDEN, _CLS_CLASSES)
    kfac = None
    if optimizer.startswith("kfac+"):
        kfac = KFAC(
            model,
            lr=lr,
            base=optimizer.removeprefix("kfac+"),
            include=None,
            weight_decay=0.0,
            max_grad_norm=0.0,
            damping=1e-3,
            factor_decay=0.95,
            loss_scale=1.0 / n,
        )
    else:
        opt = build_optimizer(optimizer, model.named_parameters(), lr, 0.0, 0.0, "cpu")
    gen = torch.Generator().manual_seed(5)
    for step in range(max_steps):
        idx = torch.randint(0, _CLS_SAMPLES, (n, mb), generator=gen)
        if kfac is not None:
            kfac.on_step_start(step)
        for j in range(n):
            with kfac.micro_batch(j) if kfac is not None else contextlib.nullcontext():
                (F.cross_entropy(model(x[idx[j]]), y[idx[j]]) / n).backward()
        if kfac is not None:
            kfac.step(step)
            kfac.zero_grad()
        else:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            if F.cross_entropy(model(x), y).item() < target:
                return step + 1
    return None


@pytest.mark.slow
def test_kfac_reaches_target_loss_in_fewer_steps_than_nvlamb() -> None:
    target, max_steps = 1.0, 250  # nats; ln 8 = 2.08 at chance
    nvlamb = {lr: _steps_to_target("nvlamb", lr, target, max_steps) for lr in (0.01, 0.03, 0.1)}
    kfac_sgd = _steps_to_target("kfac+sgd", 0.1, target, max_steps)
    kfac_nvlamb = _steps_to_target("kfac+nvlamb", 0.03, target, max_steps)
    print(
        f"\nsteps to cross-entropy < {target} (max {max_steps}): NVLAMB by lr {nvlamb}; "
        f"K-FAC+SGD (lr 0.1) {kfac_sgd}; K-FAC+NVLAMB (lr 0.03) {kfac_nvlamb}"
    )
    reached = [s for s in nvlamb.values() if s is not None]
    best_nvlamb = min(reached) if reached else max_steps + 1
    assert kfac_sgd is not None and kfac_sgd < best_nvlamb
    assert kfac_nvlamb is not None and kfac_nvlamb < best_nvlamb


# --------------------------------------------------------------------------------------------
# BERT stages: selection, and capture under activation recomputation
# --------------------------------------------------------------------------------------------


def _bert_and_batch(recompute: bool) -> tuple[nn.Module, dict[str, Tensor]]:
    cfg = BertConfig(
        vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, hidden_dropout=0.0, attention_dropout=0.0
    )
    model = build_full_model(cfg, seed=0, recompute=recompute).double().train()
    gen = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(5, 64, (2, 8), generator=gen),
        "segment_ids": torch.zeros(2, 8, dtype=torch.long),
        "input_mask": torch.ones(2, 8, dtype=torch.long),
        "masked_lm_positions": torch.randint(0, 8, (2, 3), generator=gen),
        "masked_lm_ids": torch.randint(5, 64, (2, 3), generator=gen),
        "next_sentence_labels": torch.randint(0, 2, (2,), generator=gen),
    }
    return model, batch


def test_bert_encoder_linears_selected_and_recomputation_captured_once() -> None:
    factors = {}
    for recompute in (False, True):
        model, batch = _bert_and_batch(recompute)
        pre = KFACPreconditioner(model, factor_dtype=F64)
        assert len(pre.layer_names) == 6 * 2
        assert all(n.startswith("bert.encoder.layer.") for n in pre.layer_names)
        pre.set_capture(True)
        with pre.micro_batch(0):
            loss = model(None, batch).sum()
        for name in pre.layer_names:  # PipeFisher's order: curvature for A right after F
            pre.curvature_a(name, 0)
        with pre.micro_batch(0):  # the recomputation in backward must not capture x again
            loss.backward()
        for name in pre.layer_names:
            pre.curvature_b(name, 0)
            pre.update_factors(name)
        pre.step_curvature_done()  # raises if anything was captured twice
        factors[recompute] = {n: (pre.layer(n).a, pre.layer(n).b) for n in pre.layer_names}
    for name, (a, b) in factors[False].items():
        assert_close(factors[True][name][0], a)
        assert_close(factors[True][name][1], b)


def test_select_linears_by_pattern_list_or_all() -> None:
    model = _mlp()
    assert list(select_linears(model, None)) == ["0", "2"]
    assert list(select_linears(model, ["2"])) == ["2"]
    assert select_linears(model) == {}  # default: the encoder pattern
    assert list(select_linears(model, r"^0$")) == ["0"]
    with pytest.raises(ValueError, match="not nn.Linear"):
        select_linears(model, ["1"])
    assert ENCODER_LINEAR_PATTERN  # documented default


# --------------------------------------------------------------------------------------------
# Misuse is reported, not silently absorbed
# --------------------------------------------------------------------------------------------


def test_misuse_raises_with_a_message() -> None:
    lin = _layer()
    pre = KFACPreconditioner({"lin": lin}, factor_dtype=F64)
    with pytest.raises(ValueError, match="no input captured"):
        pre.curvature_a("lin", 0)  # scheduled before its forward
    with pytest.raises(ValueError, match="unknown layer"):
        pre.invert("nope")
    with pytest.raises(ValueError, match="no factors yet"):
        pre.invert("lin")
    assert not pre.precondition("lin")  # no inverses yet: gradient untouched

    pre.on_step_start(0)
    x, t = _micro_batches(1)[0]
    _loss(lin(x), t).backward()  # outside micro_batch(i): nothing captured
    with pytest.raises(RuntimeError, match="micro_batch"):
        pre.refresh_and_precondition(0)

    _capture(pre, lin, [(x, t)], loss_scale=1.0)
    pre.curvature_a("lin", 0)  # curvature_b never runs
    with pytest.raises(RuntimeError, match="never consumed"):
        pre.step_curvature_done()
    assert pre.captured_micro_batches("lin") == ([], [])  # freed anyway

    for kwargs in ({"damping": 0.0}, {"factor_decay": 1.0}, {"curvature_interval": 0}, {"loss_scale": -1.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            KFACPreconditioner({"lin": lin}, **kwargs)


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def test_state_dict_round_trips_through_weights_only_load() -> None:
    lin = _layer()
    pre = KFACPreconditioner({"lin": lin}, factor_dtype=F64)
    _capture(pre, lin, _micro_batches(2), loss_scale=0.5)
    _refresh(pre, "lin", range(2))
    pre.invert("lin")
    buf = io.BytesIO()
    torch.save(pre.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert set(state) == {f"lin/{k}" for k in ("A", "B", "A_inv", "B_inv", "damping", "num_updates",
                                               "curvature_steps")}

    fresh = KFACPreconditioner({"lin": copy.deepcopy(lin)}, factor_dtype=F64)
    fresh.load_state_dict(state)
    for key in ("a", "b", "a_inv", "b_inv", "damping", "num_updates", "factor_step", "inverse_step"):
        got, want = getattr(fresh.layer("lin"), key), getattr(pre.layer("lin"), key)
        assert torch.equal(got, want) if isinstance(want, Tensor) else got == want
    with pytest.raises(ValueError, match="unexpected key"):
        fresh.load_state_dict({"other/A": state["lin/A"]})
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({"lin/A": torch.eye(2, dtype=F64)})


# --------------------------------------------------------------------------------------------
# 6. Against asdl (asdfghjkl), when it is installed
# --------------------------------------------------------------------------------------------


def _import_asdl(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    try:
        import asdl  # noqa: F401
        import asdl.fisher
        import asdl.operations.operation as operation
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        pytest.skip(f"asdl (pip install asdfghjkl) is not importable: {exc!r}")
    # asdl wraps its curvature code in torch.cuda.nvtx ranges; make them no-ops for CPU-only torch.
    noop_nvtx = types.SimpleNamespace(
        range=lambda *a, **k: contextlib.nullcontext(), range_push=lambda *a, **k: None, range_pop=lambda: None
    )
    monkeypatch.setattr(operation, "nvtx", noop_nvtx)
    return asdl.fisher


# asdl 0.1a5 calls torch.jit.script at import and registers non-full backward hooks.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")
def test_factors_match_asdl_empirical_fisher_kron(monkeypatch: pytest.MonkeyPatch) -> None:
    asdl_fisher = _import_asdl(monkeypatch)
    lin = _layer()
    x, t = _micro_batches(1)[0]

    # asdl: empirical Fisher, Kronecker-factored, from a sum-reduced loss over the T rows;
    # A = (1/T) Σ x xᵀ (no bias column: asdl keeps the bias apart) and B = (1/T) Σ g gᵀ with the
    # per-row gradients g, i.e. the same definitions as ours on the weight block of A.
    ref = copy.deepcopy(lin)
    config = asdl_fisher.FisherConfig(fisher_type="fisher_emp", fisher_shapes=["kron"], data_size=B * S)
    maker = asdl_fisher.get_fisher_maker(ref, config)
    dummy_y = maker.setup_model_call(ref, x)
    maker.setup_loss_call(lambda y, target, reduction="sum": 0.5 * ((y - target) ** 2).sum(), dummy_y, t)
    maker.forward_and_backward()
    kron = ref.fisher.kron

    pre = KFACPreconditioner({"lin": lin}, loss_scale=1.0, factor_dtype=F64)
    _capture(pre, lin, [(x, t)], loss_scale=1.0)
    _refresh(pre, "lin", range(1))
    assert_close(pre.layer("lin").a[:I_DIM, :I_DIM], kron.A)
    assert_close(pre.layer("lin").b, kron.B)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts reads of a tensor's value into Python (each one a device-to-host sync on a GPU)."""

    READS = {torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.item,
             torch.Tensor.tolist}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def test_an_inversion_reads_the_device_once_for_the_damping_and_once_per_cholesky() -> None:
    """Issue 25: the two traces of the factored damping are read together (was two reads); each
    Cholesky's ``info`` is one read (the retry needs it); nothing else is read."""
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(64, 9, generator=gen), torch.randn(64, 5, generator=gen)
    a, b = x.t() @ x / 64, g.t() @ g / 64
    with _HostReads() as reads:
        lam_a, lam_b = factored_damping(a, b, 0.01)
    assert reads.count == 1 and lam_a * lam_b == pytest.approx(0.01)
    with _HostReads() as reads:
        damped_inverse(a, lam_a)
        damped_inverse(b, lam_b)
    assert reads.count == 2


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_an_empty_selection_warns_unless_a_pipeline_stage_expects_it(kind, caplog):
    """A selection that matches no Linear layer is logged (a pattern that selects nothing is a mistake), except where
    the caller says it is expected: a pipeline stage holding only the embeddings or the heads has no encoder Linear
    (pipeline_worker builds one per stage, and the V schedules' end stages have none)."""
    import logging

    from pipefisher.optim.ekfac import build_preconditioner

    heads_only = nn.Sequential(nn.LayerNorm(8))
    with caplog.at_level(logging.WARNING, logger="pipefisher"):
        build_preconditioner(kind, heads_only)
    assert "no Linear layer selected" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipefisher"):
        p = build_preconditioner(kind, heads_only, warn_if_empty=False)
    assert caplog.text == "" and not p._layers
