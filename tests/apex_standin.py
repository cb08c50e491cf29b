"""A stand-in for ``apex.optimizers.FusedLAMB`` (issue 25): apex's signatures, state layout and
update rule, written out in plain torch from apex's ``fused_lamb.py`` and ``multi_tensor_lamb.cu``.

What matters to the runtime and differs from torch's optimizers and our NVLAMB:

- ``zero_grad(self)`` takes no argument (``set_grad_none`` comes from the constructor);
- ``step(self, closure=None)`` takes no norm: it clips by the norm of *its own* gradients, with the
  threshold read from ``self.defaults["max_grad_norm"]`` at each step;
- the step count lives in each parameter group (``group["step"]``), not in each parameter's state,
  which holds only ``exp_avg`` and ``exp_avg_sq``;
- the kernel writes the update into ``p.grad`` (the gradients are gone after a step).

Use :func:`install` (with pytest's ``monkeypatch``) to make ``from apex.optimizers import FusedLAMB``
import this class.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

__all__ = ["FusedLAMB", "install"]


class FusedLAMB(torch.optim.Optimizer):
    """apex's FusedLAMB with the same constructor, ``step``, ``zero_grad`` and state layout."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self):
        if self.set_grad_none:
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None
        else:
            super().zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        global_grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        max_grad_norm = self.defaults["max_grad_norm"]
        clip = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1.0
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # one count per group, as apex
            self._update_group(group, clip)
        return loss

    def _update_group(self, group: dict[str, Any], clip: torch.Tensor | float) -> None:
        """multi_tensor_lamb's two stages for one group (adam_w_mode: decay added to the update)."""
        beta1, beta2 = group["betas"]
        beta3 = 1 - beta1 if group["grad_averaging"] else 1.0
        bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
        bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
        decay = group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            g = p.grad / clip
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.mul_(beta1).add_(g, alpha=beta3)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
            if self.adam_w_mode:
                update = update + decay * p
            else:  # pragma: no cover - the runtime uses adam_w_mode
                raise NotImplementedError("L2 mode is not stood in for")
            ratio = group["lr"]
            if self.use_nvlamb or decay != 0.0:
                p_norm, u_norm = p.norm(), update.norm()
                if p_norm != 0 and u_norm != 0:
                    ratio = group["lr"] * (p_norm / u_norm)
            p.grad.copy_(update)  # apex's kernel writes the update over the gradient
            p.sub_(ratio * update)


def install(monkeypatch: Any) -> type[FusedLAMB]:
    """Make ``apex.optimizers.FusedLAMB`` importable as :class:`FusedLAMB` (undone by ``monkeypatch``)."""
    apex = types.ModuleType("apex")
    optimizers = types.ModuleType("apex.optimizers")
    optimizers.FusedLAMB = FusedLAMB
    apex.optimizers = optimizers
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)
    return FusedLAMB
