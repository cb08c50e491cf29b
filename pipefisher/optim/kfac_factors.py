"""K-FAC arithmetic for one Linear layer: factor sums, factored damping, damped inverses, the product.

Pure tensor functions without module state, so each is testable against a dense computation and
reusable by any scheduler. :mod:`pipefisher.optim.kfac` wires them to hooks and work units.

Shape legend:
    T   rows (tokens) of one micro-batch: B·S flattened
    I   input features of the layer (``in_features``); Ĩ = I + 1 with the bias column
    O   output features of the layer (``out_features``)
    n   side of a square factor (Ĩ or O)

[Note: the homogeneous coordinate]
A layer with bias, y = W x + b, is the bias-free layer y = [W | b] x̃ with x̃ = [x; 1]. Its input
factor is A = E[x̃ x̃ᵀ] ((I+1)×(I+1)) and the gradient matrix is G = [∇W | ∇b] (O×(I+1)), so
the bias is preconditioned jointly with W by the same Kronecker product: P = B⁻¹ G A⁻¹ and
∇W ← P[:, :I], ∇b ← P[:, I]. Neither x̃ nor G is ever materialized (each would be a copy of a
[T, I+1] or [O, I+1] tensor on every call):

- :func:`input_factor_sum` writes xᵀx straight into the top-left block of the [Ĩ, Ĩ] result
  (BLAS takes the block's row stride as its leading dimension) and fills the border with the
  column sums of x and the row count:

      x̃ᵀx̃ = [[ xᵀx    Σ_t x_t ]
              [ Σ_t x_tᵀ    T  ]]

- :func:`kron_precondition_` computes B⁻¹G as [B⁻¹∇W | B⁻¹∇b] into one [O, Ĩ] buffer, then
  ∇W ← (B⁻¹G)·A⁻¹[:, :I] and ∇b ← (B⁻¹G)·A⁻¹[:, I] straight into the gradient tensors.

A row of Ĩ = I + 1 floats leaves every other row of a contiguous [·, Ĩ] matrix off the 64-byte
lines GEMM kernels load best, which cost ~3 % of the preconditioning product on 2 CPU threads
and up to ~10 % of a 256-wide xᵀx (bench/README.md §3). So the sum a new :func:`input_factor_sum`
returns, the [O, Ĩ] buffer and the stored inverses (:func:`row_aligned`, called by
``LinearKFAC.invert``) are views of buffers whose rows are padded to a multiple of 16 elements.
The factors themselves are contiguous: ``LinearKFAC`` divides the sum by the row count into a
contiguous tensor (the pass it needs anyway), since factors are all-reduced in place.

[Note: factored damping] (Martens & Grosse 2015, §6.3; DESIGN.md "K-FAC for a Linear layer")
(A ⊗ B + λ I) is approximated by (A + λ_A I) ⊗ (B + λ_B I) with λ_A·λ_B = λ and the split chosen
by the factors' average eigenvalues: π = sqrt((tr A / dim A) / (tr B / dim B)),
λ_A = π·sqrt(λ), λ_B = sqrt(λ)/π. Both traces enter one call (:func:`factored_damping`), which
is why inversion is one work unit per layer: the reference code inverted A and B separately and
zeroed each factor after its inversion, so the second inversion saw a zero trace.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "FP64_MAX_DIM",
    "INVERSE_PRECISIONS",
    "damped_inverse",
    "factored_damping",
    "grad_factor_sum",
    "input_factor_sum",
    "kron_precondition",
    "kron_precondition_",
    "row_aligned",
]

#: Row padding, in elements, of :func:`row_aligned` tensors (64 bytes of float32).
_ROW_ALIGN = 16

#: With ``precision="auto"``, factors up to this dimension are inverted in float64, larger ones in
#: the factor's own dtype (float32 at least). Not the default: see [Note: inversion precision].
FP64_MAX_DIM = 1024

#: Values of ``precision`` (``optimizer.inverse_dtype``) accepted by :func:`damped_inverse`.
INVERSE_PRECISIONS = ("float32", "float64", "auto")

# [Note: inversion precision] (issue 8, item 3; bench/README.md §3)
# The default inverts in the factor's dtype, float32 in training, as ASDL and other K-FAC codes do.
# Measured on bert-mini's 24 encoder factors at damping 1e-3 (A up to 1025 wide, 64-token batch,
# so A has numerical rank ~25 of 257 and ~64 of 1025): the preconditioned gradient with float32
# inverses is within 1.0e-4 (relative Frobenius error) of a float64 computation from the same
# factors, and so is the one with float64 inverses stored in float32 (1.0e-4): the float32 storage
# of factors, inverses and gradient sets the error, not the inversion. With 1024 tokens both are
# 4e-6; at damping 1e-5, 5e-4 both. The damping bounds cond(F + λI) (~1e2 here), which is why a
# float32 Cholesky suffices; if it fails anyway the shift grows (see damped_inverse). On 2 CPU
# cores float64 inversion took ~1.5× the float32 time (auto ~1.3×); both stay selectable.


def input_factor_sum(x: Tensor, bias: bool, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """Σ_t x̃_t x̃_tᵀ over the rows of one micro-batch's layer input (not yet averaged).

    Args:
        x: [..., I] layer input; all leading dimensions are rows (tokens), T = x.numel() / I.
        bias: append the homogeneous coordinate (see [Note: the homogeneous coordinate]).
        dtype: accumulation dtype.
        out: [Ĩ, Ĩ] running sum in ``dtype`` to add to in place (earlier micro-batches), any
            strides; None for a new tensor.

    Returns:
        [Ĩ, Ĩ] symmetric sum (Ĩ = I + 1 with ``bias``, else I), in ``dtype``: ``out`` when given,
        else a new row-aligned view (see [Note: the homogeneous coordinate]).
    """
    x = x.reshape(-1, x.shape[-1]).to(dtype)  # [T, I]
    rows, dim = x.shape[0], x.shape[1] + int(bias)
    first = out is None
    if first:
        out = _aligned_empty(dim, dim, dtype, x.device)  # [Ĩ, Ĩ]
    elif out.shape != (dim, dim) or out.dtype != dtype:
        raise ValueError(f"input_factor_sum: out is {tuple(out.shape)} {out.dtype}, expected ({dim}, {dim}) {dtype}")
    block = out[:-1, :-1] if bias else out  # [I, I]
    # beta=0 ignores the (uninitialized) block; else xᵀx is added in place, no temporary.
    torch.addmm(block, x.T, x, beta=0 if first else 1, out=block)
    if bias:
        last_row = out[-1, :-1]  # [I]
        if first:
            torch.sum(x, dim=0, out=last_row)  # Σ_t x_t
            out[-1, -1].fill_(rows)
        else:
            last_row.add_(x.sum(dim=0))
            out[-1, -1].add_(rows)
        out[:-1, -1].copy_(last_row)  # the column: the same sums
    return out


def grad_factor_sum(g: Tensor, scale: float, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """Σ_t (s·g_t)(s·g_t)ᵀ over the rows of one micro-batch's output gradient (not yet averaged).

    Args:
        g: [..., O] gradient of the backward loss w.r.t. the layer output; leading dimensions are
            rows (tokens).
        scale: s, the factor that turns the captured gradient into the per-row gradient the
            factor is defined with (see ``KFACPreconditioner``, [Note: gradient scale]).
        dtype: accumulation dtype.
        out: [O, O] running sum in ``dtype`` to add to in place; None for a new tensor.

    Returns:
        [O, O] symmetric sum in ``dtype``: ``out`` when given.
    """
    g = g.reshape(-1, g.shape[-1]).to(dtype)  # [T, O]
    dim = g.shape[1]
    if out is None:
        out = g.new_empty(dim, dim)  # [O, O]
        beta = 0  # ignores the uninitialized ``out``
    elif out.shape != (dim, dim) or out.dtype != dtype:
        raise ValueError(f"grad_factor_sum: out is {tuple(out.shape)} {out.dtype}, expected ({dim}, {dim}) {dtype}")
    else:
        beta = 1
    # s² enters as GEMM's alpha: no separate pass over [O, O].
    return torch.addmm(out, g.T, g, beta=beta, alpha=scale * scale, out=out)


def factored_damping(a: Tensor, b: Tensor, damping: float) -> tuple[float, float]:
    """The split (λ_A, λ_B) of ``damping`` between the two factors (see [Note: factored damping]).

    Both traces are read here, before anything is inverted. When a trace is 0 or not finite (a
    layer whose inputs or gradients were all zero) π = 1, the unfactored split sqrt(λ) each.

    Args:
        a: [Ĩ, Ĩ] input factor A.
        b: [O, O] output-gradient factor B.
        damping: λ > 0.

    Returns:
        ``(λ_A, λ_B)`` as Python floats, λ_A·λ_B = λ.
    """
    # One device-to-host read for both traces (issue 25: each float() is a sync on a GPU).
    trace_a, trace_b = torch.stack([torch.trace(a).double(), torch.trace(b).double()]).tolist()
    mean_eig_a, mean_eig_b = trace_a / a.shape[0], trace_b / b.shape[0]
    pi = 1.0
    if mean_eig_a > 0 and mean_eig_b > 0 and math.isfinite(mean_eig_a) and math.isfinite(mean_eig_b):
        pi = math.sqrt(mean_eig_a / mean_eig_b)
    root = math.sqrt(damping)
    return pi * root, root / pi


def damped_inverse(factor: Tensor, damping: float, max_tries: int = 4, precision: str = "float32") -> Tensor:
    """(F + damping·I)⁻¹ of a symmetric PSD factor by Cholesky.

    ``precision`` (``optimizer.inverse_dtype``) sets the working dtype: ``"float32"`` (default) the
    factor's own dtype, float32 at least (a float64 factor stays float64); ``"float64"`` float64;
    ``"auto"`` float64 up to :data:`FP64_MAX_DIM` wide, else as ``"float32"``. See
    [Note: inversion precision]. Only the lower triangle of F is read (Cholesky's). If Cholesky
    fails (rounding made the damped matrix indefinite) the diagonal shift is multiplied by 10 and
    the inversion repeated, up to ``max_tries`` times.

    Args:
        factor: [n, n] symmetric positive semi-definite matrix.
        damping: shift added to the diagonal, > 0.
        max_tries: Cholesky attempts before giving up.
        precision: working precision: float32, float64 or auto.

    Returns:
        [n, n] symmetric inverse, in the factor's dtype.

    Raises:
        ValueError: unknown ``precision``.
        torch.linalg.LinAlgError: the matrix is still not positive definite after the retries
            (non-finite entries, typically).
    """
    n = factor.shape[0]
    own = torch.promote_types(factor.dtype, torch.float32)
    if precision == "float32":
        work_dtype = own
    elif precision == "float64":
        work_dtype = torch.float64
    elif precision == "auto":
        work_dtype = torch.float64 if n <= FP64_MAX_DIM else own
    else:
        raise ValueError(f"damped_inverse: precision={precision!r}; use one of {', '.join(INVERSE_PRECISIONS)}")
    shift = float(damping)
    for _ in range(max_tries):
        damped = factor.to(work_dtype, copy=True)  # [n, n]; the factor itself stays as it is
        damped.diagonal().add_(shift)
        chol, info = torch.linalg.cholesky_ex(damped)  # [n, n] lower triangle L, F + shift·I = L Lᵀ
        if int(info) == 0:
            return torch.cholesky_inverse(chol).to(factor.dtype)
        shift *= 10.0
    raise torch.linalg.LinAlgError(
        f"damped_inverse: {n}x{n} factor not positive definite even with damping {shift / 10:g} "
        f"(non-finite entries: {bool((~torch.isfinite(factor)).any())})"
    )


def kron_precondition(grad: Tensor, a_inv: Tensor, b_inv: Tensor) -> Tensor:
    """B⁻¹ G A⁻¹, i.e. (A⁻¹ ⊗ B⁻¹) vec(G) for symmetric A⁻¹ (column-major vec).

    The reference form; :func:`kron_precondition_` computes the same in place on ∇W and ∇b.

    Args:
        grad: [O, Ĩ] gradient matrix G ([∇W | ∇b] with the bias column).
        a_inv: [Ĩ, Ĩ] damped inverse of A.
        b_inv: [O, O] damped inverse of B.

    Returns:
        [O, Ĩ] preconditioned gradient, in the inverses' dtype.
    """
    return b_inv @ grad.to(b_inv.dtype) @ a_inv  # [O, Ĩ]


def kron_precondition_(weight_grad: Tensor, bias_grad: Tensor | None, a_inv: Tensor, b_inv: Tensor) -> None:
    """[∇W | ∇b] ← B⁻¹ [∇W | ∇b] A⁻¹ in place, without concatenating G.

    See [Note: the homogeneous coordinate]; equal to :func:`kron_precondition` up to rounding.

    Args:
        weight_grad: [O, I] ∇W, overwritten.
        bias_grad: [O] ∇b, overwritten; None for a layer without bias (then Ĩ = I).
        a_inv: [Ĩ, Ĩ] damped inverse of A.
        b_inv: [O, O] damped inverse of B.
    """
    dtype = b_inv.dtype
    out_dim, in_dim = weight_grad.shape
    bg = _aligned_empty(out_dim, in_dim + int(bias_grad is not None), dtype, weight_grad.device)  # [O, Ĩ] B⁻¹G
    torch.mm(b_inv, weight_grad.to(dtype), out=bg[:, :in_dim])
    if bias_grad is not None:
        torch.mv(b_inv, bias_grad.to(dtype), out=bg[:, in_dim])
    a_w = a_inv[:, :in_dim]  # [Ĩ, I], a strided view
    if weight_grad.dtype == dtype:
        torch.mm(bg, a_w, out=weight_grad)  # bg does not alias weight_grad
    else:
        weight_grad.copy_(bg @ a_w)
    if bias_grad is not None:
        bias_grad.copy_(bg @ a_inv[:, in_dim])


def _aligned_empty(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized [rows, cols] view whose row stride is ``cols`` rounded up to ``_ROW_ALIGN``."""
    stride = -(-cols // _ROW_ALIGN) * _ROW_ALIGN
    return torch.empty(rows, stride, dtype=dtype, device=device)[:, :cols]


def row_aligned(t: Tensor) -> Tensor:
    """``t`` (2-D) itself when its rows are already a multiple of 16 elements apart, else a copy in
    a view of a buffer with padded rows (see [Note: the homogeneous coordinate]). The values are
    equal; only the layout differs (``clone`` of the view is contiguous again)."""
    if t.stride(0) % _ROW_ALIGN == 0 and t.stride(1) == 1:
        return t
    out = _aligned_empty(t.shape[0], t.shape[1], t.dtype, t.device)
    out.copy_(t)
    return out
