"""Split backward for zero-bubble schedules: input gradient now (``I``), weight gradients later (``W``).

[Note: deferred weight gradients]
Every ``nn.Linear`` of a stage that runs split backwards computes through :class:`_DeferrableLinear`,
an autograd function whose backward returns the input and bias gradients at once and, while
:func:`deferring` is active, files the weight gradient's two operands (the layer's output
gradient g and input x, both as [tokens, features]) instead of multiplying them. ``W`` later
runs those products, gᵀx, and adds them to ``weight.grad``: exactly the matrix products that a
full backward would have run, so I + W does the work of one B plus Python bookkeeping (what
Megatron-based Zero Bubble code calls a weight-gradient store). Everything else of the backward
(attention, softmax, LayerNorm, GELU, embeddings, biases, the input-gradient products) runs in I,
which is why I costs more than half of B. Outside :func:`deferring` (a full ``B``, or a forward
under ``torch.no_grad``) the function computes the weight gradient at once, so one stage can run
B for some micro-batches and I + W for others.

The operands W keeps are the ones K-FAC's curvature needs too (the A factor from x, the B factor
from g), so curvature next to W costs no activation memory beyond what W holds anyway. What W holds
is the layer's input *as saved by the forward* (its storage, not a copy): Q, K and V read one hidden
state, so a layer's three entries share one storage. Under recompute (activation checkpointing) the
inputs are those of B's recomputed forward, which W keeps alive from I until W, where a full B would
free them at its end: there W's store is activation memory that recompute would otherwise save.

Autocast: the product runs in the dtype of the output gradient (the forward's compute dtype) and
the result is cast to the parameter's dtype, as autocast's cast-then-linear backward does. The cast
of x to that dtype happens in W, one product at a time (issue 25: casting when filing stored a bf16
copy of the shared Q/K/V input once per layer, three copies beside the fp32 input K-FAC keeps).

Shared weights: the MLM decoder's weight is tied to the word embeddings; its deferred product is
added to the same ``.grad`` the embedding lookup's gradient went to (or to the stage's own copy,
which the executor sums with the other holders' at STEP), so it counts exactly once.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["WeightGradStore", "enable_split_backward", "deferring", "apply_weight_grads"]

WeightGradStore = list[tuple[nn.Parameter, Tensor, Tensor]]
"""Deferred weight gradients of one (stage, micro-batch): (weight, g [T, out], x [T, in]); x in the
dtype the forward saved it in (fp32 under bf16 autocast), g in the compute dtype."""

# The store filed into while an I runs. A module global, not a thread-local: on CUDA the autograd
# engine runs backward functions on its own device threads.
_ACTIVE: WeightGradStore | None = None


class _DeferrableLinear(torch.autograd.Function):
    """y = x Wᵀ + b whose weight gradient can be deferred ([Note: deferred weight gradients])."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: nn.Parameter, bias: Tensor | None) -> Tensor:
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.param = weight  # the parameter itself (forward receives the caller's tensors)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dtype = grad.dtype
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight.to(dtype)).to(x.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])  # a view: filed as the forward saved it, cast in W
            if _ACTIVE is None:
                grad_w = g2.t().mm(x2.to(dtype)).to(weight.dtype)
            else:
                _ACTIVE.append((ctx.param, g2, x2))
        return grad_x, grad_w, grad_b


def _deferrable_forward(self: nn.Linear, x: Tensor) -> Tensor:
    if not torch.is_grad_enabled() or not self.weight.requires_grad:
        return F.linear(x, self.weight, self.bias)
    return _DeferrableLinear.apply(x, self.weight, self.bias)


def enable_split_backward(modules: Iterable[nn.Module]) -> int:
    """Route every ``nn.Linear`` inside ``modules`` through the deferrable function (idempotent).

    The layers stay ``nn.Linear`` modules: their parameters, state-dict keys and forward hooks
    (K-FAC's capture) are unchanged, and without :func:`deferring` the numerics are a plain
    linear's.

    Returns:
        How many layers were switched (0 when already done).
    """
    switched = 0
    for module in modules:
        for m in module.modules():
            if isinstance(m, nn.Linear) and not getattr(m, "_pf_deferrable", False):
                m.forward = types.MethodType(_deferrable_forward, m)
                m._pf_deferrable = True
                switched += 1
    return switched


@contextlib.contextmanager
def deferring(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """While active, a backward through a switched ``nn.Linear`` files its weight gradient in
    ``store`` instead of computing it (the ``I`` of a split backward)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, store
    try:
        yield store
    finally:
        _ACTIVE = previous


def apply_weight_grads(store: WeightGradStore) -> None:
    """Run the deferred products of one ``I`` and accumulate them into ``.grad`` (the ``W``)."""
    for param, g2, x2 in store:
        grad = g2.t().mm(x2.to(g2.dtype)).to(param.dtype)  # the forward's compute dtype, as a full B
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
    store.clear()
