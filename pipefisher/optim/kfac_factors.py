"""K-FAC arithmetic for one Linear layer: factor sums, factored damping, damped inverses, the product.

Pure tensor functions without module state, so each is testable against a dense computation and
reusable by any scheduler. :mod:`pipefisher.optim.kfac` wires them to hooks and work units.

Shape legend:
    T   rows (tokens) of one micro-batch: B·S flattened
    I   input features of the layer (``in_features``); Ĩ = I + 1 with the bias column
    O   output features of the layer (``out_features``)

[Note: the homogeneous coordinate]
A layer with bias, y = W x + b, is the bias-free layer y = [W | b] x̃ with x̃ = [x; 1]. Its input
factor is A = E[x̃ x̃ᵀ] ((I+1)×(I+1)) and the gradient matrix is G = [∇W | ∇b] (O×(I+1)), so
the bias is preconditioned jointly with W by the same Kronecker product: P = B⁻¹ G A⁻¹ and
∇W ← P[:, :I], ∇b ← P[:, I]. Rather than concatenating a column of ones to x ([T, I+1], a copy),
:func:`input_factor_sum` assembles x̃ᵀx̃ from xᵀx, the column sums of x and the row count:

    x̃ᵀx̃ = [[ xᵀx    Σ_t x_t ]
            [ Σ_t x_tᵀ    T  ]]

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
    "damped_inverse",
    "factored_damping",
    "grad_factor_sum",
    "input_factor_sum",
    "kron_precondition",
]

#: Factors up to this dimension are inverted in float64 (cheap, and the damped matrix of a
#: low-rank factor can be badly conditioned); larger ones in the factor's own dtype (fp32 at least).
FP64_MAX_DIM = 1024


def input_factor_sum(x: Tensor, bias: bool, dtype: torch.dtype = torch.float32) -> Tensor:
    """Σ_t x̃_t x̃_tᵀ over the rows of one micro-batch's layer input (not yet averaged).

    Args:
        x: [..., I] layer input; all leading dimensions are rows (tokens), T = x.numel() / I.
        bias: append the homogeneous coordinate (see [Note: the homogeneous coordinate]).
        dtype: accumulation dtype.

    Returns:
        [Ĩ, Ĩ] symmetric sum (Ĩ = I + 1 with ``bias``, else I), in ``dtype``.
    """
    x = x.reshape(-1, x.shape[-1]).to(dtype)  # [T, I]
    xx = x.T @ x  # [I, I]
    if not bias:
        return xx
    rows = x.shape[0]
    col_sum = x.sum(dim=0)  # [I]
    dim = x.shape[1] + 1
    out = xx.new_empty(dim, dim)  # [I+1, I+1]
    out[:-1, :-1] = xx
    out[:-1, -1] = col_sum
    out[-1, :-1] = col_sum
    out[-1, -1] = rows
    return out


def grad_factor_sum(g: Tensor, scale: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """Σ_t (s·g_t)(s·g_t)ᵀ over the rows of one micro-batch's output gradient (not yet averaged).

    Args:
        g: [..., O] gradient of the backward loss w.r.t. the layer output; leading dimensions are
            rows (tokens).
        scale: s, the factor that turns the captured gradient into the per-row gradient the
            factor is defined with (see ``KFACPreconditioner``, [Note: gradient scale]).
        dtype: accumulation dtype.

    Returns:
        [O, O] symmetric sum in ``dtype``.
    """
    g = g.reshape(-1, g.shape[-1]).to(dtype)  # [T, O]
    return (g.T @ g) * (scale * scale)  # [O, O]


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
    mean_eig_a = float(torch.trace(a)) / a.shape[0]
    mean_eig_b = float(torch.trace(b)) / b.shape[0]
    pi = 1.0
    if mean_eig_a > 0 and mean_eig_b > 0 and math.isfinite(mean_eig_a) and math.isfinite(mean_eig_b):
        pi = math.sqrt(mean_eig_a / mean_eig_b)
    root = math.sqrt(damping)
    return pi * root, root / pi


def damped_inverse(factor: Tensor, damping: float, max_tries: int = 4, precision: str = "auto") -> Tensor:
    """(F + damping·I)⁻¹ of a symmetric PSD factor by Cholesky.

    With ``precision="auto"`` factors up to :data:`FP64_MAX_DIM` are inverted in float64, larger
    ones in the factor's dtype (float32 at least); ``"float32"`` / ``"float64"`` force the working
    precision (``optimizer.inverse_dtype``). If Cholesky fails (rounding made the damped matrix indefinite) the
    diagonal shift is multiplied by 10 and the inversion repeated, up to ``max_tries`` times.

    Args:
        factor: [n, n] symmetric positive semi-definite matrix.
        damping: shift added to the diagonal, > 0.
        max_tries: Cholesky attempts before giving up.
        precision: working precision: auto, float32 or float64.

    Returns:
        [n, n] inverse, in the factor's dtype.

    Raises:
        torch.linalg.LinAlgError: the matrix is still not positive definite after the retries
            (non-finite entries, typically).
    """
    n = factor.shape[0]
    if precision == "float64":
        work_dtype = torch.float64
    elif precision == "float32":
        work_dtype = torch.float32
    elif precision == "auto":
        work_dtype = torch.float64 if n <= FP64_MAX_DIM else torch.promote_types(factor.dtype, torch.float32)
    else:
        raise ValueError(f"damped_inverse: precision={precision!r}; use auto, float32 or float64")
    f = factor.to(work_dtype)
    f = 0.5 * (f + f.T)  # exact symmetry: sums of products are symmetric only up to rounding
    shift = float(damping)
    for _ in range(max_tries):
        chol, info = torch.linalg.cholesky_ex(f + shift * torch.eye(n, dtype=work_dtype, device=f.device))
        if int(info) == 0:
            return torch.cholesky_inverse(chol).to(factor.dtype)
        shift *= 10.0
    raise torch.linalg.LinAlgError(
        f"damped_inverse: {n}x{n} factor not positive definite even with damping {shift / 10:g} "
        f"(non-finite entries: {bool((~torch.isfinite(factor)).any())})"
    )


def kron_precondition(grad: Tensor, a_inv: Tensor, b_inv: Tensor) -> Tensor:
    """B⁻¹ G A⁻¹, i.e. (A⁻¹ ⊗ B⁻¹) vec(G) for symmetric A⁻¹ (column-major vec).

    Args:
        grad: [O, Ĩ] gradient matrix G ([∇W | ∇b] with the bias column).
        a_inv: [Ĩ, Ĩ] damped inverse of A.
        b_inv: [O, O] damped inverse of B.

    Returns:
        [O, Ĩ] preconditioned gradient, in the inverses' dtype.
    """
    return b_inv @ grad.to(b_inv.dtype) @ a_inv  # [O, Ĩ]
