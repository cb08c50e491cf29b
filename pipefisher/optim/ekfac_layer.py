"""Eigenbasis-Adam (SOAP-style EKFAC) state and work units of one ``nn.Linear`` layer.

:class:`~pipefisher.optim.ekfac.EKFACPreconditioner` holds one :class:`LinearEKFAC` per layer. The
capture, curvature, factor sync and running average are K-FAC's (inherited from
:class:`~pipefisher.optim.kfac_layer.LinearKFAC`); the refresh's last unit (INVERT in the schedule)
computes eigenbases instead of inverses, and the per-step unit (PRECOND) rescales the gradient in
that basis. The notes of :mod:`pipefisher.optim.ekfac` give the math and the choices.

Shape legend:
    I   input features of the layer; Ĩ = I + 1 with the bias column (else Ĩ = I)
    O   output features of the layer
    n   side of a square factor (Ĩ or O)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipefisher.optim.kfac_factors import FP64_MAX_DIM, INVERSE_PRECISIONS
from pipefisher.optim.kfac_layer import STATE_ENTRIES, LinearKFAC

__all__ = ["EKFAC_STATE_ENTRIES", "LinearEKFAC", "eigenbasis", "eigen_adam_precondition_"]

#: Per-layer entries of an EKFAC state dict: K-FAC's (the inverse entries stay absent) and the
#: bases in use, the second moment in the eigenbasis and its update count.
EKFAC_STATE_ENTRIES: tuple[str, ...] = STATE_ENTRIES + ("Q_A", "Q_B", "V", "moment_steps")


def eigenbasis(factor: Tensor, precision: str = "float32") -> Tensor:
    """Eigenvectors of a symmetric PSD factor, as columns, eigenvalues ascending (``torch.linalg.eigh``).

    Damping shifts every eigenvalue alike and leaves the eigenvectors as they are, so the basis is
    that of the undamped factor. Only the lower triangle is read (eigh's).

    Args:
        factor: [n, n] symmetric factor (A or B).
        precision: working dtype as ``optimizer.inverse_dtype``: float32 (the factor's own, float32 at
            least), float64, or auto (float64 up to ``FP64_MAX_DIM`` wide).

    Returns:
        [n, n] orthogonal Q (F = Q diag(λ) Qᵀ, λ ascending), in the factor's dtype.

    Raises:
        ValueError: unknown ``precision``, or non-finite entries in the factor.
    """
    if precision not in INVERSE_PRECISIONS:
        raise ValueError(f"eigenbasis: precision={precision!r}; use one of {', '.join(INVERSE_PRECISIONS)}")
    if not bool(torch.isfinite(factor).all()):
        raise ValueError(f"eigenbasis: the {tuple(factor.shape)} factor has non-finite entries")
    own = torch.promote_types(factor.dtype, torch.float32)
    wide = precision == "float64" or (precision == "auto" and factor.shape[0] <= FP64_MAX_DIM)
    work = factor.to(torch.float64 if wide else own)
    _, q = torch.linalg.eigh(work)  # [n], [n, n]
    return q.to(factor.dtype).contiguous()


def eigen_adam_precondition_(weight_grad: Tensor, bias_grad: Tensor | None, q_a: Tensor, q_b: Tensor,
                             v: Tensor, steps: int, beta2: float, eps: float) -> int:
    """One step of Adam's second moment in the Kronecker eigenbasis, in place on ∇W (and ∇b).

    With G = [∇W | ∇b] [O, Ĩ]::

        G' = Q_Bᵀ G Q_A                       projected gradient              [O, Ĩ]
        v  ← β₂ v + (1 − β₂) G'²              second moment, elementwise      [O, Ĩ]
        v̂  = v / (1 − β₂ᵗ)                    bias correction, t = steps + 1
        G  ← Q_B (G' / (√v̂ + ε)) Q_Aᵀ         back to the weights' coordinates

    Args:
        weight_grad: [O, I] ∇W, overwritten.
        bias_grad: [O] ∇b, overwritten; None for a layer without bias (Ĩ = I).
        q_a: [Ĩ, Ĩ] eigenvectors of A (columns).
        q_b: [O, O] eigenvectors of B (columns).
        v: [O, Ĩ] second moment, updated in place.
        steps: updates of ``v`` so far (t − 1).
        beta2: second-moment decay in [0, 1).
        eps: added to √v̂, > 0.

    Returns:
        The new update count t.
    """
    dtype = q_b.dtype
    in_dim = weight_grad.shape[1]
    g = weight_grad.to(dtype)  # [O, I]
    if bias_grad is not None:
        g = torch.cat([g, bias_grad.to(dtype).unsqueeze(1)], dim=1)  # [O, Ĩ]
    projected = q_b.T @ g @ q_a  # [O, Ĩ]
    v.mul_(beta2).addcmul_(projected, projected, value=1.0 - beta2)
    t = steps + 1
    denom = (v / (1.0 - beta2 ** t)).sqrt_().add_(eps)  # [O, Ĩ]
    update = q_b @ projected.div_(denom) @ q_a.T  # [O, Ĩ]
    weight_grad.copy_(update[:, :in_dim])
    if bias_grad is not None:
        bias_grad.copy_(update[:, in_dim])
    return t


class LinearEKFAC(LinearKFAC):
    """K-FAC's factors of one Linear layer, their eigenbases, and Adam's second moment in that basis.

    The inverse slots of :class:`LinearKFAC` stay None; ``pending`` holds deferred bases
    ``(Q_A, Q_B, (0.0, 0.0))`` in the same place deferred inverses go, so promotion, checkpoints
    and curvature ages work as for K-FAC.

    Args:
        name, module, loss_scale, factor_dtype, inverse_dtype: as :class:`LinearKFAC`
            (``inverse_dtype`` is the eigendecomposition's working precision).
        beta2: second-moment decay in [0, 1).
        eps: added to √v̂, > 0.
    """

    STATE_ENTRIES = EKFAC_STATE_ENTRIES

    def __init__(self, name: str, module: nn.Linear, loss_scale: float, factor_dtype: torch.dtype,
                 inverse_dtype: str = "float32", *, beta2: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(name, module, loss_scale, factor_dtype, inverse_dtype)
        self.beta2 = float(beta2)
        self.eps = float(eps)
        self.q_a: Tensor | None = None  # [Ĩ, Ĩ] eigenbasis of A in use
        self.q_b: Tensor | None = None  # [O, O] eigenbasis of B in use
        self.v: Tensor | None = None  # [O, Ĩ] second moment of the projected gradient
        self.moment_steps = 0  # updates of v (bias correction)

    @property
    def ready(self) -> bool:
        """Whether the layer has an eigenbasis in use."""
        return self.q_a is not None and self.q_b is not None

    def invert(self, damping: float, deferred: bool = False) -> None:
        """The refresh's last unit: eigenbases of both factors (``damping`` leaves them unchanged).

        With ``deferred`` they wait in ``pending`` until :meth:`promote`. The second moment is kept
        (ekfac [Note: keeping v across a basis refresh]).

        Raises:
            ValueError: no factors yet (no :meth:`update_factors` so far).
        """
        if self.a is None or self.b is None:
            raise ValueError(f"EKFAC eigendecomposition({self.name!r}): no factors yet; run curvature and "
                             "update_factors first")
        bases = (eigenbasis(self.a, self.inverse_dtype), eigenbasis(self.b, self.inverse_dtype), (0.0, 0.0))
        if deferred:
            self.pending = bases
            self.pending_step = self.factor_step
        else:
            self._use(bases)
            self.inverse_step = self.factor_step

    def _use(self, bases: tuple[Tensor, Tensor, tuple[float, float]]) -> None:
        self.q_a, self.q_b, _ = bases
        if self.v is None:
            dim_a, dim_b = self.dims
            self.v = torch.zeros(dim_b, dim_a, dtype=self.factor_dtype, device=self.module.weight.device)

    def promote(self) -> bool:
        """Put the pending (deferred) bases in use; returns whether there were any."""
        if self.pending is None:
            return False
        self._use(self.pending)
        self.inverse_step = self.pending_step
        self.pending = None
        return True

    def precondition(self) -> bool:
        """Replace ``W.grad`` (and ``b.grad``) by the eigenbasis-Adam direction
        (:func:`eigen_adam_precondition_`), updating the second moment.

        Returns:
            False (gradients and moment untouched) when there is no basis yet or ``W.grad`` is None.
        """
        w, b = self.module.weight, self.module.bias
        self.raw_grad_sq = None
        if not self.ready or w.grad is None:
            return False
        assert self.q_a is not None and self.q_b is not None and self.v is not None
        with torch.no_grad():
            self.raw_grad_sq = self.grad_sq()
            self.moment_steps = eigen_adam_precondition_(w.grad, None if b is None else b.grad, self.q_a, self.q_b,
                                                         self.v, self.moment_steps, self.beta2, self.eps)
        return True

    def state_dict(self) -> dict[str, Tensor]:
        """K-FAC's entries (factors, curvature steps) plus ``Q_A``, ``Q_B``, ``V`` and
        ``moment_steps`` (0-d int64)."""
        out = super().state_dict()
        for key, t in (("Q_A", self.q_a), ("Q_B", self.q_b), ("V", self.v)):
            if t is not None:
                out[key] = t.detach().clone()
        out["moment_steps"] = torch.tensor(self.moment_steps, dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: a matrix has the wrong shape.
        """
        dim_a, dim_b = self.dims
        for entry, shape in (("Q_A", (dim_a, dim_a)), ("Q_B", (dim_b, dim_b)), ("V", (dim_b, dim_a))):
            t = state.get(entry)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"EKFAC load_state_dict: {self.name}/{entry} has shape {tuple(t.shape)}, "
                                 f"expected {shape}")
        super().load_state_dict(state)
        device = self.module.weight.device
        self.q_a, self.q_b, self.v = (None if state.get(e) is None else state[e].to(device, self.factor_dtype).clone()
                                      for e in ("Q_A", "Q_B", "V"))
        steps = state.get("moment_steps")
        self.moment_steps = 0 if steps is None else int(steps)
