"""Split backward for zero-bubble schedules: input gradient now (``I``), weight gradients later (``W``).

[Note: deferred weight gradients]
Every ``nn.Linear`` of a stage that runs split backwards computes through :class:`_DeferrableLinear`,
an autograd function whose backward returns the input and bias gradients at once and, while
:func:`deferring` is active, files the weight gradient's two operands (the layer's output
gradient g and input x, both as [tokens, features]) instead of multiplying them. ``W`` later
runs those products, gᵀx, and adds them to ``weight.grad``: exactly the matrix products that a
full backward would have run, so I + W does the work of one B plus Python bookkeeping (what
Megatron-based Zero Bubble code calls a weight-gradient store). W adds each product into
``.grad`` inside the GEMM where ``.grad`` exists ([Note: W accumulates inside the product] in
:func:`_accumulate_weight_grad`), and the embedding lookups' gradients are deferred too ([Note:
deferred embedding gradients]); everything else of the backward (attention, softmax, LayerNorm,
GELU, biases, the input-gradient products) runs in I, which is why I costs more than half of B.
Outside :func:`deferring` the functions compute the weight gradient at once, so one stage can run B
for some micro-batches and I + W for others.

[Note: a full backward accumulates in place]
The executor runs every schedule's stages through these functions, and a full ``B`` under
:func:`accumulating`: each weight gradient is added into ``.grad`` where it is computed, by W's own
code (``addmm_`` into the gradient, ``index_add_`` of the looked-up rows), and autograd receives
None for it. Autograd's own way makes a [out, in] product and AccumulateGrad adds it to ``.grad`` in
a second pass; for the word embeddings it makes a dense [V, H] gradient of zeros per micro-batch
(fresh pages on a CPU). Measured with ``bench/v_gap.py`` on bert-medium, a full B of zb-v's
embedding-only stage took 88 ms where its I + W took 4. The numerics are W's: equal up to rounding.
Outside :func:`accumulating` and :func:`deferring` (``bench/split_backward.py``'s ``Bd``) the
gradient goes back to autograd as ``nn.Linear``'s backward returns it.

[Note: deferred embedding gradients]
``nn.Embedding``'s backward makes a dense [V, H] gradient (zeros, then the looked-up rows added)
and AccumulateGrad adds that to ``.grad``: for BERT's 30522-word table two passes over a [V, H]
tensor (31 MB at H = 256) of which the micro-batch touches at most B·S rows. Measured with
``bench/split_backward.py`` on bert-mini's first stage, the zero fill alone was 10–20 % of the
stage's backward. Plain lookups (no padding index, max norm, frequency scaling or sparse
gradient) of a split stage therefore go through :class:`_DeferrableEmbedding`: I files
(weight, g [T, H], ids [T]) and W adds the rows into ``.grad`` with ``index_add_``, touching only
those rows (where ``.grad`` is None, W builds the dense gradient as the plain backward does).
The rows are added in token order as the plain backward adds them, to the running gradient
instead of to zeros: equal up to rounding. Nothing waits for an embedding's weight gradient, so
off the critical path is where it belongs; the store grows by g [T, H] per lookup (the word and
token-type lookups of stage 0; the position lookup's g is [S, H]).

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

__all__ = ["WeightGradStore", "accumulating", "apply_weight_grads", "deferring", "disable_split_backward",
           "enable_split_backward"]

WeightGradStore = list[tuple[nn.Parameter, Tensor, Tensor]]
"""Deferred weight gradients of one (stage, micro-batch): (weight, g [T, out], x [T, in]) of a
Linear, x in the dtype the forward saved it in (fp32 under bf16 autocast), g in the compute dtype;
or (weight, g [T, H], ids [T]) of an embedding lookup (integer ids tell the two apart)."""

# The store filed into while an I runs. A module global, not a thread-local: on CUDA the autograd
# engine runs backward functions on its own device threads.
_ACTIVE: WeightGradStore | None = None
# Set while a full B accumulates its weight gradients in place (:func:`accumulating`).
_IN_PLACE = False


class _DeferrableLinear(torch.autograd.Function):
    """y = x Wᵀ + b whose weight gradient can be deferred ([Note: deferred weight gradients])."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: nn.Parameter, bias: Tensor | None) -> Tensor:
        y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # the parameter itself (forward receives the caller's tensors)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad  # need_b is False without a bias
        grad_x = grad_w = grad_b = None
        # [T, out]: one copy where grad is not contiguous (nn.Linear's backward copies it once in its
        # view's backward; grad.matmul would copy it again beside this reshape).
        g2 = grad.reshape(-1, grad.shape[-1])
        if need_x:
            grad_x = g2.mm(weight if weight.dtype == grad.dtype else weight.to(grad.dtype))
            grad_x = grad_x.view(*grad.shape[:-1], grad_x.shape[-1])
            if grad_x.dtype != x.dtype:
                grad_x = grad_x.to(x.dtype)
        if need_b:
            grad_b = g2.sum(0)
        if need_w:
            x2 = x.reshape(-1, x.shape[-1])  # a view: filed as the forward saved it, cast in W
            if _ACTIVE is not None:
                _ACTIVE.append((ctx.param, g2, x2))
            elif _IN_PLACE:
                _accumulate_weight_grad(ctx.param, g2, x2)
            else:
                grad_w = g2.t().mm(x2.to(grad.dtype)).to(weight.dtype)
        return grad_x, grad_w, grad_b


class _DeferrableEmbedding(torch.autograd.Function):
    """A plain lookup ``weight[ids]`` whose weight gradient can be deferred ([Note: deferred
    embedding gradients])."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: nn.Parameter) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.param = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor | None]:
        (ids,) = ctx.saved_tensors
        if _ACTIVE is not None:
            _ACTIVE.append((ctx.param, grad.reshape(-1, grad.shape[-1]), ids.reshape(-1)))
        elif _IN_PLACE:
            _accumulate_embedding_grad(ctx.param, grad.reshape(-1, grad.shape[-1]), ids.reshape(-1))
        else:  # what nn.Embedding's backward computes (padding_idx -1: none)
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.param.shape[0], -1, False)
        return None, None


def _deferrable_forward(self: nn.Linear, x: Tensor) -> Tensor:
    if not torch.is_grad_enabled() or not self.weight.requires_grad:
        return F.linear(x, self.weight, self.bias)
    return _DeferrableLinear.apply(x, self.weight, self.bias)


def _deferrable_lookup(self: nn.Embedding, ids: Tensor) -> Tensor:
    if not torch.is_grad_enabled() or not self.weight.requires_grad:
        return F.embedding(ids, self.weight)
    return _DeferrableEmbedding.apply(ids, self.weight)


def _plain_embedding(m: nn.Module) -> bool:
    """Whether ``m`` is an ``nn.Embedding`` without the options the deferrable lookup leaves out."""
    return (isinstance(m, nn.Embedding) and m.padding_idx is None and m.max_norm is None
            and not m.scale_grad_by_freq and not m.sparse)


def enable_split_backward(modules: Iterable[nn.Module]) -> int:
    """Route every ``nn.Linear`` and plain ``nn.Embedding`` inside ``modules`` through the deferrable
    functions (idempotent).

    The layers stay ``nn.Linear`` / ``nn.Embedding`` modules: their parameters, state-dict keys and
    forward hooks (K-FAC's capture) are unchanged, and without :func:`deferring` the numerics are
    a plain layer's.

    Returns:
        How many layers were switched (0 when already done).
    """
    switched = 0
    for module in modules:
        for m in module.modules():
            if getattr(m, "_pf_deferrable", False):
                continue
            if isinstance(m, nn.Linear):
                m.forward = types.MethodType(_deferrable_forward, m)
            elif _plain_embedding(m):
                m.forward = types.MethodType(_deferrable_lookup, m)
            else:
                continue
            m._pf_deferrable = True
            switched += 1
    return switched


def disable_split_backward(modules: Iterable[nn.Module]) -> int:
    """Undo :func:`enable_split_backward`: the layers run ``nn.Linear`` / ``nn.Embedding``'s own
    forward and backward again (for another runtime on the same stages, e.g. torch's schedules in
    ``bench/``, whose split backward asks autograd for input gradients only).

    Returns:
        How many layers were switched back.
    """
    switched = 0
    for module in modules:
        for m in module.modules():
            if getattr(m, "_pf_deferrable", False):
                del m.forward  # the instance attribute: the class's forward shows through again
                m._pf_deferrable = False
                switched += 1
    return switched


@contextlib.contextmanager
def deferring(store: WeightGradStore) -> Iterator[WeightGradStore]:
    """While active, a backward through a switched ``nn.Linear`` or ``nn.Embedding`` files its weight
    gradient in ``store`` instead of computing it (the ``I`` of a split backward)."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, store
    try:
        yield store
    finally:
        _ACTIVE = previous


@contextlib.contextmanager
def accumulating() -> Iterator[None]:
    """While active, a backward through a switched ``nn.Linear`` or ``nn.Embedding`` adds its weight
    gradient into ``.grad`` itself, as W does, instead of returning it to autograd (a full ``B``:
    [Note: a full backward accumulates in place])."""
    global _IN_PLACE
    previous, _IN_PLACE = _IN_PLACE, True
    try:
        yield
    finally:
        _IN_PLACE = previous


def apply_weight_grads(store: WeightGradStore) -> None:
    """Run the deferred products of one ``I`` and accumulate them into ``.grad`` (the ``W``).

    The store is emptied as it goes, in filing order: each entry's operands are freed before the
    next product, so a new ``.grad`` (a step's first micro-batch) can take memory the operands
    held instead of fresh pages (bench/split_backward.py counts the page faults).
    """
    store.reverse()
    while store:
        param, g2, x2 = store.pop()
        if x2.is_floating_point():
            _accumulate_weight_grad(param, g2, x2)
        else:
            _accumulate_embedding_grad(param, g2, x2)
        del g2, x2


def _accumulate_weight_grad(param: nn.Parameter, g2: Tensor, x2: Tensor) -> None:
    """``param.grad += g2ᵀ x2`` in the forward's compute dtype (g2 [T, out], x2 [T, in]).

    [Note: W accumulates inside the product] Where ``param.grad`` exists in the compute dtype (every
    micro-batch of a step but the first, in fp32), ``addmm_`` adds the product to it as the GEMM
    writes it: no [out, in] temporary is allocated (fresh pages on CPU) and no separate pass reads
    and writes the gradient again, which a full B's AccumulateGrad pays. The sum is the same up to
    rounding (the product's partial sums meet the old gradient in another order).
    """
    if x2.dtype != g2.dtype:
        x2 = x2.to(g2.dtype)  # the forward's compute dtype, as a full B
    grad = param.grad
    if grad is not None and grad.dtype == g2.dtype and type(grad) is Tensor:
        grad.addmm_(g2.t(), x2)
        return
    product = g2.t().mm(x2)
    if product.dtype != param.dtype:
        product = product.to(param.dtype)
    if grad is None:
        param.grad = product
    else:
        grad.add_(product)


def _accumulate_embedding_grad(param: nn.Parameter, g2: Tensor, ids: Tensor) -> None:
    """``param.grad[ids[t]] += g2[t]`` for every token t (g2 [T, H], ids [T]): [Note: deferred
    embedding gradients]."""
    grad = param.grad
    if grad is None or type(grad) is not Tensor or grad.dtype != g2.dtype:
        # the dense gradient nn.Embedding's backward makes (zeros, then the rows added in token order)
        dense = torch.ops.aten.embedding_dense_backward(g2, ids, param.shape[0], -1, False)
        if grad is None:
            param.grad = dense.to(param.dtype)
        else:
            grad.add_(dense.to(grad.dtype))
        return
    grad.index_add_(0, ids, g2)
