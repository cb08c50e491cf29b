"""A staleness-tolerant preconditioner: Adam in the eigenbasis of K-FAC's factors (``optimizer=ekfac``).

Issue 28, item 3. K-FAC's expensive part, recomputed every k steps (in PipeFisher's bubbles), becomes
the eigenbases of the Kronecker factors; its cheap part, a per-coordinate scaling in that basis, is
updated every step from the current gradient, so it is never stale.

Shape legend:
    I   input features of a layer; Ĩ = I + 1 with the bias column (else Ĩ = I)
    O   output features of a layer

[Note: the rule] (Vyas et al. 2024, "SOAP: Improving and Stabilizing Shampoo using Adam", Alg. 3)
Per Linear layer, with K-FAC's factors A = E[x̃ x̃ᵀ] [Ĩ, Ĩ] and B = E[g gᵀ] [O, O] (captured,
synced and averaged exactly as K-FAC's, :mod:`pipefisher.optim.kfac`):

    refresh (the INVERT unit, every inverse_interval steps, placed like K-FAC's inversion):
        A = Q_A Λ_A Q_Aᵀ,  B = Q_B Λ_B Q_Bᵀ                     (torch.linalg.eigh)
    every step (the PRECOND unit), G = [∇W | ∇b]:
        G' = Q_Bᵀ G Q_A
        v  ← β₂ v + (1 − β₂) G'²,   v̂ = v / (1 − β₂ᵗ)
        G  ← Q_B (G' / (√v̂ + ε)) Q_Aᵀ

then the update rule of K-FAC (``optimizer.kfac_update``: NVLAMB on the preconditioned gradient, or
the momentum rule), with the same lr schedule, weight decay and global-norm clip (of the gradient
before preconditioning by default), so lr grids of kfac and ekfac are comparable. Layers K-FAC does
not precondition get what they get under K-FAC (NVLAMB).

This is SOAP's rule with K-FAC's factors (E[x xᵀ], E[g gᵀ] per token) in place of Shampoo's
(G Gᵀ, Gᵀ G of the whole gradient). George et al.'s EKFAC (NeurIPS 2018) rescales the same
eigenbasis with per-example second moments E[(Q_Bᵀ g_t x̃_tᵀ Q_A)²], re-estimated from the rows of
a batch; that needs every row's projected gradient outer product (T·O·Ĩ extra work per micro-batch),
which one step's bubbles cannot pay. The running second moment of the mini-batch gradient costs
four matrix products per layer per step (projection and back), twice K-FAC's B⁻¹ G A⁻¹; the
refresh's eigh costs several times a Cholesky inversion (``bench/ekfac_costs.py``).

[Note: first moment]
The preconditioner keeps no first moment: the update rule behind it has one (NVLAMB's m, or the
momentum rule's), acting on the rescaled gradient. For a fixed basis and a slowly moving v
(β₂ = 0.999: ~1000 steps) the momentum of G'/√v̂ equals SOAP's m̂'/√v̂ up to v's drift; a second
momentum here would average twice. (Under ``kfac_update=lamb`` NVLAMB's own second moment then
normalizes the result once more per coordinate of W, as it does for K-FAC's B⁻¹GA⁻¹; the trust
ratio sets the step length either way.)

[Note: keeping v across a basis refresh]
At a refresh the new bases replace the old ones and v is kept as it is, as SOAP does. eigh orders
eigenvectors by ascending eigenvalue, so coordinate (i, j) of v keeps meaning "the i-th smallest
direction of B × the j-th smallest of A" (SOAP sorts its QR estimates for the same reason); signs do
not matter to a squared moment. Why keep rather than restart or rotate: the factors are running
averages (decay 0.95 per step), so consecutive bases are close and v, a ~1000-step average, is still
a good estimate in the new basis; restarting would throw it away every k steps and put the bias
correction's noisy first steps into every cycle; rotating the diagonal, v ← (R_B∘R_B) v (R_A∘R_A)ᵀ
with R = Q_newᵀ Q_old, is exact only if v's off-diagonal covariances are zero, which is exactly what a
moving basis breaks, and costs more matrix products per refresh. SOAP reports that a refresh every 10
steps costs little with v kept.

[Note: eps and degenerate eigenspaces]
Adam's normalization gives every eigen-coordinate with |G'| ≫ ε a step of unit size, however small
|G'| is. Where a factor is rank-deficient or has near-equal eigenvalues (few tokens carry gradient:
BERT's loss sits on ~15 % of positions; a LayerNorm makes Σᵢ xᵢ = 0, an exact null direction of A),
the eigenvectors inside that eigenspace are fixed by rounding alone, and so are the coordinates of G'
there (|G'| down to ~1e-7 of the largest, in float32). With ε below that floor those coordinates get
unit steps in arbitrary directions: measured on a 2-layer, 32-wide model with 8 masked positions per
micro-batch, float32 vs float64 eigh of the same factors flips bias signs after 4 steps at ε = 1e-8
(and 1e-5), and moves weights by < 1 % at ε = 1e-4. SOAP's ε = 1e-8 is the default; raise
``optimizer.ekfac_eps`` toward ~1e-7 × the largest |G'| (bias-sensitive or tiny runs) to damp them.
George et al.'s EKFAC adds the damping λ to its scaling for the same reason.

[Note: staleness]
Intervals, deferral and promotion are K-FAC's (``optimizer.curvature_interval``, ``inverse_interval``,
``deferred_inverse``, ``promote_inverses``; PipeFisher's plan): the bases in use are k..2k−1 steps old
under deferral, while v (the scaling) is updated by every step's gradient. The schedule's INVERT
actions run the eigendecompositions (same unit, same place; an eigh costs several Cholesky
inversions, so a plan made from a profile of an ekfac run places the measured cost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipefisher.optim.ekfac_layer import LinearEKFAC
from pipefisher.optim.kfac import ENCODER_LINEAR_PATTERN, KFACPreconditioner

__all__ = ["PRECONDITIONERS", "EKFACPreconditioner", "build_preconditioner"]

#: Values of ``optimizer.preconditioner``.
PRECONDITIONERS = ("kfac", "ekfac")


class EKFACPreconditioner(KFACPreconditioner):
    """K-FAC's factors, their eigenbases, and Adam's second moment in that basis (see the module notes).

    The work units and their order are :class:`KFACPreconditioner`'s; :meth:`invert` computes the
    eigenbases and :meth:`precondition` rescales in them.

    Args:
        named_linears, damping, factor_decay, curvature_interval, inverse_interval, include,
            loss_scale, factor_dtype, inverse_dtype, warn_if_empty: as :class:`KFACPreconditioner` (``damping`` does
            not change an eigenbasis: it is checked but unused; ``inverse_dtype`` is eigh's precision).
        beta2: second-moment decay in [0, 1) (``optimizer.ekfac_beta2``).
        eps: added to √v̂, > 0 (``optimizer.ekfac_eps``).

    Raises:
        ValueError: a hyper-parameter out of range (also those of :class:`KFACPreconditioner`).
    """

    def __init__(self, named_linears: Mapping[str, nn.Linear] | nn.Module, damping: float = 1e-3,
                 factor_decay: float = 0.95, curvature_interval: int = 1, inverse_interval: int = 1, *,
                 include: str | Sequence[str] | None = ENCODER_LINEAR_PATTERN, loss_scale: float = 1.0,
                 factor_dtype: torch.dtype = torch.float32, inverse_dtype: str = "float32",
                 warn_if_empty: bool = True, beta2: float = 0.999, eps: float = 1e-8) -> None:
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"EKFACPreconditioner: beta2={beta2} must lie in [0, 1)")
        if not (eps > 0.0 and math.isfinite(eps)):
            raise ValueError(f"EKFACPreconditioner: eps={eps} must be > 0")
        self.beta2, self.eps = float(beta2), float(eps)  # read by _new_layer during super().__init__
        super().__init__(named_linears, damping, factor_decay, curvature_interval, inverse_interval, include=include,
                         loss_scale=loss_scale, factor_dtype=factor_dtype, inverse_dtype=inverse_dtype,
                         warn_if_empty=warn_if_empty)

    def _new_layer(self, name: str, module: nn.Linear, loss_scale: float, factor_dtype: torch.dtype,
                   inverse_dtype: str) -> LinearEKFAC:
        return LinearEKFAC(name, module, loss_scale, factor_dtype, inverse_dtype, beta2=self.beta2, eps=self.eps)

    def layer(self, name: str) -> LinearEKFAC:  # type: ignore[override]
        """The state of layer ``name`` (factors ``a``, ``b``, bases ``q_a``, ``q_b``, moment ``v``)."""
        return super().layer(name)  # type: ignore[return-value]

    def invert(self, name: str, deferred: bool = False) -> None:
        """The eigenbases Q_A, Q_B of layer ``name``'s factors in one unit (the schedule's INVERT).

        With ``deferred`` they are put in use only by :meth:`promote_inverses`.

        Raises:
            ValueError: the layer has no factors yet, or they are not finite.
        """
        self.layer(name).invert(self.damping, deferred)

    def precondition(self, name: str) -> bool:
        """Replace layer ``name``'s ``W.grad`` (and ``b.grad``) by Q_B (G'/(√v̂ + ε)) Q_Aᵀ, updating v.

        Returns:
            False (gradients untouched) when the layer has no basis yet or no gradient.
        """
        return self.layer(name).precondition()


def build_preconditioner(kind: str, named_linears: Mapping[str, nn.Linear] | nn.Module, *,
                         beta2: float = 0.999, eps: float = 1e-8, **kwargs: Any) -> KFACPreconditioner:
    """The preconditioner ``optimizer.preconditioner`` names: ``kfac`` (inverses) or ``ekfac``
    (eigenbasis Adam); ``beta2`` / ``eps`` are ekfac's, ``kwargs`` go to both constructors.

    Raises:
        ValueError: unknown ``kind`` (the message lists the choices).
    """
    if kind == "kfac":
        return KFACPreconditioner(named_linears, **kwargs)
    if kind == "ekfac":
        return EKFACPreconditioner(named_linears, beta2=beta2, eps=eps, **kwargs)
    raise ValueError(f"preconditioner={kind!r}: choose one of {', '.join(PRECONDITIONERS)}")
