"""Single-process K-FAC: a :class:`~pipefisher.optim.kfac.KFACPreconditioner` in front of NVLAMB or SGD.

The pipeline runtime does not use this: it calls the preconditioner's work units itself, placed
by the schedule. See :mod:`pipefisher.optim.kfac` for the notes on the K-FAC work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipefisher.optim.kfac import ENCODER_LINEAR_PATTERN, KFACPreconditioner
from pipefisher.optim.nvlamb import build_optimizer

__all__ = ["KFAC"]


class KFAC:
    """Single-process K-FAC: a :class:`KFACPreconditioner` in front of a base optimizer.

    Per step, with N micro-batches::

        kfac.on_step_start(step)
        for j in range(N):
            with kfac.micro_batch(j):
                (loss_j / N).backward()          # so loss_scale = 1/N
        kfac.step(step)                          # refresh_and_precondition(step), then base step
        kfac.zero_grad()

    Args:
        model: its Linear layers matching ``include`` are preconditioned; all its trainable
            parameters are updated by the base optimizer.
        lr: base learning rate.
        base: ``"nvlamb"`` (default, as in the reference work) or ``"sgd"``, built by
            :func:`~pipefisher.optim.nvlamb.build_optimizer`; ignored when ``optimizer`` is given.
        optimizer: a prebuilt base optimizer taking ``step(grad_norm=...)``.
        weight_decay: base optimizer weight decay (none on bias and LayerNorm).
        max_grad_norm: global-norm clip of the base optimizer; ``<= 0`` disables it.
        clip_before_precondition: the clip's norm is that of the gradient before preconditioning
            (True, the default, as ``optimizer.clip_before_precondition``), else that of the
            preconditioned gradient.
        include: Linear selection (see :func:`select_linears`).
        **kfac_kwargs: ``damping``, ``factor_decay``, ``curvature_interval``, ``inverse_interval``,
            ``loss_scale``, ``factor_dtype`` of :class:`KFACPreconditioner`.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        base: str = "nvlamb",
        *,
        optimizer: torch.optim.Optimizer | None = None,
        weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        include: str | Sequence[str] | None = ENCODER_LINEAR_PATTERN,
        clip_before_precondition: bool = True,
        **kfac_kwargs: Any,
    ) -> None:
        self.clip_before_precondition = clip_before_precondition
        self.preconditioner = KFACPreconditioner(model, include=include, **kfac_kwargs)
        if optimizer is None:
            device = next(model.parameters()).device
            optimizer = build_optimizer(base, model.named_parameters(), lr, weight_decay, max_grad_norm, device)
        self.optimizer = optimizer

    def on_step_start(self, step: int) -> None:
        """See :meth:`KFACPreconditioner.on_step_start`."""
        self.preconditioner.on_step_start(step)

    def micro_batch(self, index: int) -> contextlib.AbstractContextManager[None]:
        """See :meth:`KFACPreconditioner.micro_batch`."""
        return self.preconditioner.micro_batch(index)

    def refresh_and_precondition(self, step: int) -> None:
        """See :meth:`KFACPreconditioner.refresh_and_precondition`."""
        self.preconditioner.refresh_and_precondition(step)

    def step(self, step: int, grad_norm: Tensor | float | None = None) -> None:
        """K-FAC's work for ``step``, then the base optimizer's step on the preconditioned gradient.

        Args:
            step: the step index (decides capture and inversion with the intervals).
            grad_norm: global gradient norm for the base optimizer's clip (None: computed here
                over the base optimizer's parameters, before or after preconditioning as
                ``clip_before_precondition`` says).
        """
        self.refresh_and_precondition(step)
        if grad_norm is None and self.clip_before_precondition:
            raw = self.preconditioner.raw_grad_sq()
            params = {id(p): p for g in self.optimizer.param_groups if g.get("rule", "lamb") == "lamb"
                      for p in g["params"] if p.grad is not None}
            grad_norm = torch.stack([raw[i] if i in raw else p.grad.detach().float().pow(2).sum()
                                     for i, p in params.items()]).sum().sqrt() if params else 0.0
        self.optimizer.step(grad_norm=grad_norm)  # type: ignore[call-arg]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the base optimizer's parameters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """``{"kfac": preconditioner state, "optimizer": base optimizer state}``."""
        return {"kfac": self.preconditioner.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.preconditioner.load_state_dict(state["kfac"])
        self.optimizer.load_state_dict(state["optimizer"])
