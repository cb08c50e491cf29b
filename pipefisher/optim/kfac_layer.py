"""K-FAC state and work units of one ``nn.Linear`` layer.

:class:`~pipefisher.optim.kfac.KFACPreconditioner` holds one :class:`LinearKFAC` per layer and
dispatches its work units by layer name; the module notes of :mod:`pipefisher.optim.kfac` explain
the order of the units, the gradient scale, replicas, the running average and staleness.

Shape legend:
    T   rows (tokens) of one micro-batch: B·S flattened
    I   input features of the layer; Ĩ = I + 1 with the bias column (else Ĩ = I)
    O   output features of the layer
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipefisher.optim.kfac_factors import (
    damped_inverse,
    factored_damping,
    grad_factor_sum,
    input_factor_sum,
    kron_precondition_,
    row_aligned,
)

__all__ = ["LinearKFAC", "STATE_ENTRIES"]

#: Per-layer entries of a state dict (see :meth:`LinearKFAC.state_dict`).
STATE_ENTRIES: tuple[str, ...] = ("A", "B", "A_inv", "B_inv", "damping", "num_updates", "curvature_steps")


def _contiguous_div(t: Tensor, divisor: int) -> Tensor:
    """t / divisor in place when ``t`` is contiguous, else into a new contiguous tensor (one pass)."""
    if t.is_contiguous():
        return t.div_(divisor)
    return torch.div(t, divisor, out=torch.empty(t.shape, dtype=t.dtype, device=t.device))


class LinearKFAC:
    """Captured tensors, factor sums, factors and inverses of one Linear layer.

    Factors and inverses are kept in ``factor_dtype`` on the weight's device.

    Args:
        name: the layer's qualified name (used in messages).
        module: the layer.
        loss_scale: factor each micro-batch loss was multiplied by before backward.
        factor_dtype: dtype of factors and inverses.
        inverse_dtype: working precision of the inversion: float32, float64 or auto (see
            :func:`~pipefisher.optim.kfac_factors.damped_inverse`).
    """

    #: Entries of :meth:`state_dict` (a subclass adds its own).
    STATE_ENTRIES: tuple[str, ...] = STATE_ENTRIES

    def __init__(self, name: str, module: nn.Linear, loss_scale: float, factor_dtype: torch.dtype,
                 inverse_dtype: str = "float32") -> None:
        self.name = name
        self.module = module
        self.bias = module.bias is not None
        self.loss_scale = loss_scale
        self.factor_dtype = factor_dtype
        self.inverse_dtype = inverse_dtype
        self.xs: dict[int, Tensor] = {}  # micro-batch → captured input [..., I]
        self.gs: dict[int, Tensor] = {}  # micro-batch → captured output gradient [..., O]
        self.seen: set[int] = set()  # micro-batches captured in the current capture window
        self.acc_a: Tensor | None = None  # [Ĩ, Ĩ] this refresh's sum (a mean once normalized)
        self.acc_b: Tensor | None = None  # [O, O]
        self.rows_a = 0
        self.rows_b = 0
        self.normalized = False  # acc_* hold means (handed out by factor_tensors)
        self.a: Tensor | None = None  # [Ĩ, Ĩ] running-average factor A
        self.b: Tensor | None = None  # [O, O] running-average factor B
        self.a_inv: Tensor | None = None  # [Ĩ, Ĩ] (A + λ_A I)⁻¹
        self.b_inv: Tensor | None = None  # [O, O] (B + λ_B I)⁻¹
        self.damping: tuple[float, float] = (0.0, 0.0)  # (λ_A, λ_B) of the current inverses
        # Inverses made with ``deferred=True``, waiting for :meth:`promote` (PipeFisher's staleness).
        self.pending: tuple[Tensor, Tensor, tuple[float, float]] | None = None
        self.num_updates = 0
        # Curvature age (issue 13): the step whose capture was folded into the factors last, and
        # the steps whose captures the pending inverses and the inverses in use were made from.
        self.factor_step: int | None = None
        self.pending_step: int | None = None
        self.inverse_step: int | None = None
        # ‖∇W‖² + ‖∇b‖² before the last precondition (clip before preconditioning); None after
        # :meth:`forget_raw_norm` or when the last precondition did nothing.
        self.raw_grad_sq: Tensor | None = None

    @property
    def ready(self) -> bool:
        """Whether the layer has a preconditioner in use (inverses here)."""
        return self.a_inv is not None and self.b_inv is not None

    @property
    def dims(self) -> tuple[int, int]:
        """(Ĩ, O): the sizes of A and B."""
        out_features, in_features = self.module.weight.shape
        return in_features + int(self.bias), out_features

    # -- capture ---------------------------------------------------------------------------------

    def capture(self, micro_batch: int, x: Tensor, output: Tensor) -> None:
        """Keep the input of ``micro_batch`` and hook its output's gradient, once per window."""
        if micro_batch in self.seen:  # a recomputation inside backward: already captured
            return
        self.seen.add(micro_batch)
        self.xs[micro_batch] = x.detach()

        def grad_hook(grad: Tensor) -> None:
            self.gs.setdefault(micro_batch, grad.detach())

        output.register_hook(grad_hook)

    def open_window(self) -> None:
        """Start a new capture window: every micro-batch may be captured once more."""
        self.seen.clear()

    def clear_captures(self) -> None:
        """Drop captured tensors and close the capture window."""
        self.xs.clear()
        self.gs.clear()
        self.seen.clear()

    # -- work units ------------------------------------------------------------------------------

    def curvature_a(self, micro_batch: int) -> None:
        """Add Σ_t x̃_t x̃_tᵀ of ``micro_batch``'s captured input to this refresh's A sum; free it.

        Raises:
            ValueError: nothing captured for that micro-batch (scheduled before its F).
            RuntimeError: this refresh's estimates were already handed out by factor_tensors.
        """
        x = self._take(self.xs, micro_batch, "curvature_a", "input")
        self.acc_a = input_factor_sum(x, self.bias, self.factor_dtype, out=self.acc_a)  # [Ĩ, Ĩ], in place
        self.rows_a += x.numel() // x.shape[-1]

    def curvature_b(self, micro_batch: int) -> None:
        """Add Σ_t g̃_t g̃_tᵀ, g̃ = g·T/loss_scale, of ``micro_batch``'s captured gradient; free it.

        Raises:
            ValueError: nothing captured for that micro-batch (scheduled before its B).
            RuntimeError: this refresh's estimates were already handed out by factor_tensors.
        """
        g = self._take(self.gs, micro_batch, "curvature_b", "gradient")
        rows = g.numel() // g.shape[-1]
        self.acc_b = grad_factor_sum(g, rows / self.loss_scale, self.factor_dtype, out=self.acc_b)  # [O, O]
        self.rows_b += rows

    def _take(self, captured: dict[int, Tensor], micro_batch: int, unit: str, what: str) -> Tensor:
        """Pop ``micro_batch``'s captured tensor for ``unit``, checking the refresh is still open."""
        t = captured.pop(micro_batch, None)
        if t is None:
            raise ValueError(f"K-FAC {unit}({self.name!r}, {micro_batch}): no {what} captured for this micro-batch")
        self._check_open(unit)
        return t

    def _check_open(self, unit: str) -> None:
        if self.normalized:
            raise RuntimeError(
                f"K-FAC {unit}({self.name!r}): this refresh's factors were handed out by factor_tensors; "
                "call update_factors before adding curvature of the next refresh"
            )

    def has_curvature(self) -> bool:
        """Whether both factor sums of a refresh are waiting for :meth:`update_factors`."""
        return self.acc_a is not None and self.acc_b is not None

    def _normalize(self) -> tuple[Tensor, Tensor]:
        if self.acc_a is None or self.acc_b is None:
            missing = "A" if self.acc_a is None else "B"
            raise ValueError(f"K-FAC layer {self.name!r}: no curvature for {missing} since the last update")
        if not self.normalized:
            # Into new contiguous tensors (all-reduced in place later): the sums may be row-aligned
            # views (kfac_factors, [Note: the homogeneous coordinate]); the division is a pass anyway.
            self.acc_a = _contiguous_div(self.acc_a, self.rows_a)
            self.acc_b = _contiguous_div(self.acc_b, self.rows_b)
            self.normalized = True
        return self.acc_a, self.acc_b

    def factor_tensors(self) -> list[Tensor]:
        """[A_batch [Ĩ, Ĩ], B_batch [O, O]]: this refresh's means over this process's rows.

        All-reduce them (sum, in place), then call :meth:`finish_sync`.
        """
        return list(self._normalize())

    def finish_sync(self, world: int) -> None:
        """Divide the summed estimates by the number of replicas ``world``."""
        if not self.normalized:
            raise RuntimeError(f"K-FAC finish_sync({self.name!r}): call factor_tensors (and all-reduce) first")
        if world < 1:
            raise ValueError(f"K-FAC finish_sync({self.name!r}): world={world} must be >= 1")
        if world > 1:
            acc_a, acc_b = self._normalize()
            acc_a.div_(world)
            acc_b.div_(world)

    def update_factors(self, factor_decay: float, step: int | None = None) -> None:
        """A ← decay·A + (1 − decay)·A_batch, B likewise; the first update takes the estimates as is.

        ``step``: the step whose capture these estimates came from (recorded as ``factor_step``).
        """
        acc_a, acc_b = self._normalize()
        if step is not None:
            self.factor_step = int(step)
        if self.a is None or self.b is None or factor_decay == 0.0:
            self.a, self.b = acc_a, acc_b
        else:
            self.a.lerp_(acc_a, 1.0 - factor_decay)
            self.b.lerp_(acc_b, 1.0 - factor_decay)
        self.acc_a = self.acc_b = None
        self.rows_a = self.rows_b = 0
        self.normalized = False
        self.num_updates += 1

    def invert(self, damping: float, deferred: bool = False) -> None:
        """Both damped inverses, with λ_A, λ_B from the traces of both factors read first.

        The factors stay as they are (the running average and the next inversion need them).
        With ``deferred`` the inverses wait in ``pending`` until :meth:`promote`; the ones in use
        stay until then.

        Raises:
            ValueError: no factors yet (no :meth:`update_factors` so far).
        """
        if self.a is None or self.b is None:
            raise ValueError(f"K-FAC invert({self.name!r}): no factors yet; run curvature and update_factors first")
        lam_a, lam_b = factored_damping(self.a, self.b, damping)
        # Row-aligned copies when Ĩ or O is not a multiple of 16: the GEMMs of every step's
        # precondition read them (kfac_factors, [Note: the homogeneous coordinate]).
        inverses = (row_aligned(damped_inverse(self.a, lam_a, precision=self.inverse_dtype)),
                    row_aligned(damped_inverse(self.b, lam_b, precision=self.inverse_dtype)), (lam_a, lam_b))
        if deferred:
            self.pending = inverses
            self.pending_step = self.factor_step
        else:
            self.a_inv, self.b_inv, self.damping = inverses
            self.inverse_step = self.factor_step

    def promote(self) -> bool:
        """Put the pending (deferred) inverses in use; returns whether there were any."""
        if self.pending is None:
            return False
        self.a_inv, self.b_inv, self.damping = self.pending
        self.inverse_step = self.pending_step
        self.pending = None
        return True

    def precondition(self) -> bool:
        """Replace ``W.grad`` [O, I] (and ``b.grad`` [O]) by (B + λ_B I)⁻¹ [∇W | ∇b] (A + λ_A I)⁻¹.

        Returns:
            False (gradients untouched) when there are no inverses yet or ``W.grad`` is None.
        """
        w, b = self.module.weight, self.module.bias
        self.raw_grad_sq = None
        if self.a_inv is None or self.b_inv is None or w.grad is None:
            return False
        with torch.no_grad():
            self.raw_grad_sq = self.grad_sq()
            kron_precondition_(w.grad, None if b is None else b.grad, self.a_inv, self.b_inv)  # [O, I], [O]
        return True

    def grad_sq(self) -> Tensor:
        """‖∇W‖² + ‖∇b‖² of the gradients as they are now (fp32; a missing bias gradient is created as zeros, as
        preconditioning does): what :meth:`precondition` records as ``raw_grad_sq``."""
        w, b = self.module.weight, self.module.bias
        with torch.no_grad():
            if b is not None and b.grad is None:
                b.grad = torch.zeros_like(b)
            raw = w.grad.float().pow(2).sum()
            return raw if b is None else raw + b.grad.float().pow(2).sum()

    # -- checkpoints -----------------------------------------------------------------------------

    def forget_raw_norm(self) -> None:
        """Drop the raw gradient norm of the last precondition (a new step starts)."""
        self.raw_grad_sq = None

    def state_dict(self) -> dict[str, Tensor]:
        """``{entry: tensor}`` for the :data:`STATE_ENTRIES` that exist (damping: [2] float64;
        ``curvature_steps``: [3] int64 factor/pending/inverse step, -1 for none)."""
        matrices = (("A", self.a), ("B", self.b), ("A_inv", self.a_inv), ("B_inv", self.b_inv))
        out = {k: t.detach().clone() for k, t in matrices if t is not None}
        out["damping"] = torch.tensor(self.damping, dtype=torch.float64)
        out["num_updates"] = torch.tensor(self.num_updates, dtype=torch.int64)
        out["curvature_steps"] = torch.tensor(
            [-1 if s is None else s for s in (self.factor_step, self.pending_step, self.inverse_step)], dtype=torch.int64)
        return out

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore :meth:`state_dict` output; pending captures and sums are dropped.

        Raises:
            ValueError: a matrix has the wrong shape.
        """
        dim_a, dim_b = self.dims
        device = self.module.weight.device
        for entry, n in (("A", dim_a), ("B", dim_b), ("A_inv", dim_a), ("B_inv", dim_b)):
            t = state.get(entry)
            if t is not None and tuple(t.shape) != (n, n):
                raise ValueError(
                    f"K-FAC load_state_dict: {self.name}/{entry} has shape {tuple(t.shape)}, expected ({n}, {n})"
                )
        self.a, self.b, self.a_inv, self.b_inv = (
            None if state.get(e) is None else state[e].to(device, self.factor_dtype).clone()
            for e in ("A", "B", "A_inv", "B_inv")
        )
        damping = state.get("damping")
        self.damping = (0.0, 0.0) if damping is None else (float(damping[0]), float(damping[1]))
        updates = state.get("num_updates")
        self.num_updates = 0 if updates is None else int(updates)
        steps = state.get("curvature_steps")
        self.factor_step, self.pending_step, self.inverse_step = (
            (None, None, None) if steps is None else (None if int(s) < 0 else int(s) for s in steps.tolist()))
        self.clear_captures()
        self.acc_a = self.acc_b = None
        self.rows_a = self.rows_b = 0
        self.normalized = False
