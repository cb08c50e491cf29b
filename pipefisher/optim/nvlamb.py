"""NVLAMB: LAMB with one global gradient-norm clip, as in NVIDIA's BERT (apex ``FusedLAMB``).

Why one module: everything here serves the one global gradient-norm clip and the steps that take it ([Note:
the global norm]): the norm over devices and shards, the parameter groups, :class:`NVLAMB`, the clipped SGD,
and :func:`build_optimizer`'s choice of apex ``FusedLAMB`` with the same clip.

Per step, for every parameter tensor ``w`` with gradient ``g`` (``t`` = the tensor's step count,
starting at 1)::

    c     = max_grad_norm / max(‖G‖, max_grad_norm)      # ‖G‖: ONE norm over all gradients
    g     = c · g                                         # clip only when ‖G‖ > max_grad_norm
    m     = β1·m + (1 − β1)·g
    v     = β2·v + (1 − β2)·g²
    m̂, v̂  = m / (1 − β1ᵗ), v / (1 − β2ᵗ)                  # when bias_correction
    u     = m̂ / (sqrt(v̂) + eps) + wd·w                    # decoupled decay; wd = 0 for bias/LayerNorm
    r     = ‖w‖ / ‖u‖   (1 when either norm is 0)          # per-tensor trust ratio
    w     = w − lr · r · u

[Note: the global norm] In a pipeline every stage holds its own optimizer, but the clip must use the
norm of the *whole* model's gradient (DESIGN.md, "NVLAMB"). The runtime computes it across stages
(an all-reduce of squared local norms, counting tied or replicated weights once) and passes it as
``step(grad_norm=...)``; without it the norm is taken over this optimizer's own parameters, which is
right for a single-process run.

[Note: use_nvlamb] apex's ``FusedLAMB`` skips the trust ratio (r = 1) for parameter groups whose
weight decay is 0 unless ``use_nvlamb=True``. NVLAMB, as the name is used here and in DESIGN.md,
applies the ratio to every tensor, so ``use_nvlamb`` defaults to True, and :func:`build_optimizer`
passes the same value to apex so that both back ends compute the same update. NVIDIA's BERT recipe
itself runs apex's default (False); pass ``use_nvlamb=False`` to reproduce it exactly.

[Note: the momentum rule] A parameter group with ``rule="momentum"`` (K-FAC layers under
``optimizer.kfac_update=momentum``) is updated as the PipeFisher reference code updates its K-FAC
layers (BertAdam with b2 = −1): each gradient tensor is clipped by its own norm to the group's
``max_grad_norm`` (≤ 0: no clip), then ``m = β1·m + (1 − β1)·g``, ``w = w − lr·(m + wd·w)``: no
second moment (it would undo the preconditioning), no bias correction, no trust ratio. Such a
group takes no part in the global-norm clip; the runtime leaves it out of the global norm.

The arithmetic runs in the parameter's dtype with ``torch._foreach_*`` kernels over buckets of
tensors sharing a device and dtype; keep fp32 master weights for mixed precision.

[Note: sharded parameters] Parameters sharded by FSDP2 or split by tensor parallel (DTensors with
``Shard`` placements, issue 27; tensor parallel's ``Replicate`` biases count as whole tensors) are
bucketed apart by mesh and placement (one ``_foreach_norm`` cannot mix Tensors and DTensors); their
update runs on the local shards (Adam's moments are elementwise) and each trust ratio's two norms are
summed over the sharded mesh dimensions (one all-reduce per bucket and dimension), so the update
equals the unsharded one. The caller passes the global gradient norm.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = [
    "GlobalNormClipStep",
    "NVLAMB",
    "OPTIMIZERS",
    "build_optimizer",
    "global_grad_norm",
    "is_no_decay",
    "param_groups",
    "steps_per_group",
    "steps_per_parameter",
]

logger = logging.getLogger(__name__)

#: Names accepted by :func:`build_optimizer`.
OPTIMIZERS: tuple[str, ...] = ("nvlamb", "sgd")


# --------------------------------------------------------------------------------------------
# Helpers shared by all back ends
# --------------------------------------------------------------------------------------------


def global_grad_norm(params: Iterable[Tensor]) -> Tensor:
    """The L2 norm of all gradients taken together, as one vector.

    Parameters without a gradient are skipped; a parameter listed twice (a tied weight) counts once.

    Args:
        params: parameters (tensors with ``.grad``), e.g. ``model.parameters()``.

    Returns:
        A 0-d tensor on the device of the first gradient (CPU when there is none), float64 if any
        gradient is float64, else float32. 0 when no parameter has a gradient.
    """
    grads = [p.grad for p in _unique(params) if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if any(g.is_sparse for g in grads):
        raise ValueError("global_grad_norm: sparse gradients are not supported")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = grads[0].device
    norms = [n.to(device=device, dtype=dtype) for n in torch._foreach_norm(grads)]
    return torch.linalg.vector_norm(torch.stack(norms))


def _clip_coefficient(
    norm: Tensor | float, max_grad_norm: float, device: torch.device, dtype: torch.dtype
) -> Tensor:
    """``max_grad_norm / max(norm, max_grad_norm)`` as a 0-d tensor of ``dtype`` on ``device``,
    computed there (a GPU norm costs no host sync) in float64 unless the norm is lower precision."""
    if isinstance(norm, Tensor):
        norm_t = norm.to(device=device)
        if not norm_t.is_floating_point():
            norm_t = norm_t.double()
    else:
        norm_t = torch.tensor(float(norm), dtype=torch.float64, device=device)
    return (max_grad_norm / torch.clamp(norm_t, min=max_grad_norm)).to(dtype)


def _clip_grads_in_place(params: list[Tensor], grad_norm: Tensor | float, max_grad_norm: float) -> None:
    """Scale the ``.grad`` of ``params`` by the global clip coefficient (for back ends that clip
    nothing themselves or only by their local norm)."""
    grads = [p.grad for p in params if p.grad is not None]
    for (device, dtype, _), bucket in _buckets(grads).items():
        torch._foreach_mul_([_local(g) for g in bucket], _clip_coefficient(grad_norm, max_grad_norm, device, dtype))


def _unique(params: Iterable[Tensor]) -> list[Tensor]:
    """``params`` in order, each tensor once (by identity)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _buckets(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """Group tensors by (device, dtype) so each ``_foreach`` call can use one fused kernel, and
    DTensors apart by mesh and placement ([Note: sharded parameters])."""
    out: dict[tuple[Any, ...], list[Tensor]] = {}
    for t in tensors:
        layout = (id(t.device_mesh), t.placements) if isinstance(t, DTensor) else None
        out.setdefault((t.device, t.dtype, layout), []).append(t)
    return out


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (writes change it), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_groups(t: Tensor) -> list[Any]:
    """The process groups over which a sharded tensor's norms are summed, one per mesh dimension it
    is sharded on (FSDP's sdp, tensor parallel's tp, or both); none for a plain tensor and for a
    DTensor replicated on every dimension (its local tensor is the whole tensor: tensor parallel's
    row-parallel biases).

    Raises:
        NotImplementedError: a ``Partial`` placement (the local tensors are not parts of the tensor).
    """
    if not isinstance(t, DTensor):
        return []
    if any(p.is_partial() for p in t.placements):
        raise NotImplementedError(f"NVLAMB: DTensor placements {t.placements}: a Partial parameter has no "
                                  "local part to update; only sharded and replicated dimensions are supported")
    return [t.device_mesh.get_group(d) for d, p in enumerate(t.placements) if not p.is_replicate()]


def _norm_pairs(a: list[Tensor], b: list[Tensor], groups: list[Any]) -> tuple[Tensor, Tensor]:
    """Per-tensor L2 norms of ``a`` and of ``b``, stacked; of the whole tensors when they are shards
    over ``groups`` (one all-reduce of the squares per sharded mesh dimension)."""
    norms = torch.stack(torch._foreach_norm([*a, *b]))
    if groups:
        sq = norms.pow(2)
        for group in groups:
            dist.all_reduce(sq, group=group)
        norms = sq.sqrt()
    return norms[:len(a)], norms[len(a):]


def is_no_decay(name: str) -> bool:
    """Whether the parameter called ``name`` is exempt from weight decay (bias or LayerNorm).

    The rule is by name, as in NVIDIA's BERT: names ending in ``.bias`` (or equal to ``bias``) or
    containing ``LayerNorm`` / ``layer_norm``. Modules must name their LayerNorms accordingly.
    """
    return name == "bias" or name.endswith(".bias") or "LayerNorm" in name or "layer_norm" in name


def param_groups(
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    weight_decay: float,
    momentum: Callable[[str], bool] | None = None,
    momentum_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Split parameters into a decayed group and a group without weight decay.

    Bias and LayerNorm parameters (see :func:`is_no_decay`) get ``weight_decay=0``. A tensor reached
    under several names (a tied weight, e.g. word embeddings shared with the MLM decoder) appears
    once, classified by its first name. Parameters with ``requires_grad=False`` are left out.

    Args:
        named_parameters: ``(name, parameter)`` pairs, e.g. ``model.named_parameters(remove_duplicate=False)``.
        weight_decay: decoupled weight decay of the decayed group.
        momentum: names for which this is true go into two more groups with ``rule="momentum"``
            (decayed and not), with ``momentum_options`` (e.g. ``lr``, ``max_grad_norm``); see
            [Note: the momentum rule].

    Returns:
        Up to two groups ``{"params": [...], "weight_decay": float}`` (decayed first), then the
        momentum groups; empty groups are dropped, so the list is empty when there are no
        trainable parameters.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    m_decay: list[nn.Parameter] = []
    m_no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in named_parameters:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if momentum is not None and momentum(name):
            (m_no_decay if is_no_decay(name) else m_decay).append(p)
        else:
            (no_decay if is_no_decay(name) else decay).append(p)
    extra = {"rule": "momentum", **(momentum_options or {})}
    groups = [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
        {"params": m_decay, "weight_decay": float(weight_decay), **extra},
        {"params": m_no_decay, "weight_decay": 0.0, **extra},
    ]
    return [g for g in groups if g["params"]]


# --------------------------------------------------------------------------------------------
# NVLAMB
# --------------------------------------------------------------------------------------------


# [Note: step counts of apex and NVLAMB] apex's FusedLAMB counts steps per parameter group
# (``group["step"]``; a parameter's state holds only ``exp_avg``/``exp_avg_sq``), NVLAMB and torch's
# optimizers per parameter (``state[p]["step"]``). A checkpoint written by one back end is resumed by
# the other when apex is installed on one machine and not the other, or moves between CUDA and CPU
# (apex is CUDA only): each back end's ``load_state_dict`` converts the other's layout, so the bias
# correction goes on from the saved count instead of failing (KeyError 'step') or restarting at 1.


def steps_per_parameter(optimizer: torch.optim.Optimizer) -> None:
    """apex's layout → NVLAMB's: each parameter with moments gets its group's ``step``; the group's goes."""
    for group in optimizer.param_groups:
        step = group.pop("step", None)
        if step is None:
            continue
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and "step" not in state:
                state["step"] = int(step)


def steps_per_group(optimizer: torch.optim.Optimizer) -> None:
    """NVLAMB's layout → apex's: a group's ``step`` is the largest count of its parameters (a
    parameter that had no gradient at some step counts fewer); the parameters' counts go."""
    for group in optimizer.param_groups:
        counts = [int(optimizer.state[p].pop("step")) for p in group["params"]
                  if "step" in optimizer.state.get(p, {})]
        if counts and "step" not in group:
            group["step"] = max(counts)


class NVLAMB(torch.optim.Optimizer):
    """LAMB with global-norm clipping and decoupled weight decay (apex ``FusedLAMB`` semantics).

    See the module docstring for the update. State per parameter: ``step`` (int), ``exp_avg`` and
    ``exp_avg_sq`` (tensors like the parameter); ``state_dict()`` / ``load_state_dict()`` round-trip
    it, also through ``torch.load(weights_only=True)``.

    Args:
        params: parameters or parameter groups (see :func:`param_groups`); groups may override
            ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``bias_correction``.
        lr: learning rate.
        betas: Adam coefficients (β1, β2), each in [0, 1).
        eps: added to sqrt(v̂) in the denominator.
        weight_decay: decoupled weight decay (part of the update, so scaled by the trust ratio).
        max_grad_norm: clip threshold for the global gradient norm; ``<= 0`` (or ``inf``) disables
            clipping, and then no norm is computed. One
            value for the whole optimizer (``defaults["max_grad_norm"]``, read at each step), as in
            apex.
        bias_correction: divide the moments by (1 − βᵗ).
        use_nvlamb: apply the trust ratio also to groups with ``weight_decay == 0`` (see
            [Note: use_nvlamb]); False gives apex's default.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_grad_norm: float = 1.0,
        bias_correction: bool = True,
        *,
        use_nvlamb: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"NVLAMB: lr={lr} must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"NVLAMB: betas={betas} must each lie in [0, 1)")
        if not eps >= 0.0:
            raise ValueError(f"NVLAMB: eps={eps} must be >= 0")
        if not weight_decay >= 0.0:
            raise ValueError(f"NVLAMB: weight_decay={weight_decay} must be >= 0")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_grad_norm=max_grad_norm,
            use_nvlamb=use_nvlamb,
            rule="lamb",
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group.get("rule", "lamb") not in ("lamb", "momentum"):
                raise ValueError(f"NVLAMB: parameter group rule={group['rule']!r}; use lamb or momentum")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``; also takes apex FusedLAMB's layout ([Note: step counts of apex and NVLAMB])."""
        super().load_state_dict(state_dict)
        steps_per_parameter(self)

    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Tensor] | None = None,
        *,
        grad_norm: Tensor | float | None = None,
    ) -> Tensor | None:
        """Take one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss.
            grad_norm: the global gradient norm over the whole model (all pipeline stages), see
                [Note: the global norm]. ``None``: computed over this optimizer's parameters.
                Unused when clipping is disabled.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        with torch.no_grad():
            max_grad_norm = float(self.defaults["max_grad_norm"])
            clip_enabled = 0.0 < max_grad_norm < math.inf
            if clip_enabled and grad_norm is None:
                grad_norm = global_grad_norm(p for g in self.param_groups if g.get("rule", "lamb") == "lamb" for p in g["params"])
            for group in self.param_groups:
                self._step_group(group, grad_norm if clip_enabled else None, max_grad_norm)
        return loss

    def _step_group(
        self, group: dict[str, Any], grad_norm: Tensor | float | None, max_grad_norm: float
    ) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for (device, _dtype, _), bucket in _buckets(params).items():
            if group.get("rule", "lamb") == "momentum":
                self._momentum_bucket(group, bucket)
            else:
                self._step_bucket(group, bucket, device, grad_norm, max_grad_norm)

    def _momentum_bucket(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """[Note: the momentum rule]: per-tensor clip, m = β1 m + (1−β1) g, w -= lr (m + wd w)."""
        beta1 = group["betas"][0]
        lr, wd, clip = group["lr"], group["weight_decay"], float(group["max_grad_norm"])
        grads, exp_avgs = [], []
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
        if 0.0 < clip < math.inf:
            norms = torch.stack(torch._foreach_norm(grads))
            scale = torch.clamp(clip / torch.clamp(norms, min=1e-12), max=1.0)
            grads = torch._foreach_mul(grads, list(scale.to(grads[0].dtype).unbind(0)))
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        if wd != 0.0:
            torch._foreach_add_(params, params, alpha=-lr * wd)
        torch._foreach_add_(params, exp_avgs, alpha=-lr)

    def _step_bucket(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        device: torch.device,
        grad_norm: Tensor | float | None,
        max_grad_norm: float,
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]

        grads, exp_avgs, exp_avg_sqs, steps = [], [], [], []
        for p in params:
            if p.grad.is_sparse:
                raise ValueError("NVLAMB does not support sparse gradients")
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            grads.append(_local(p.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        shards = _shard_groups(params[0])  # sharded parameters: [Note: sharded parameters]
        params = [_local(p) for p in params]

        if grad_norm is not None:
            # A scaled copy: the caller's .grad stays as it was (K-FAC or logging may read it).
            grads = torch._foreach_mul(
                grads, _clip_coefficient(grad_norm, max_grad_norm, device, params[0].dtype)
            )

        # Adam moments: m = β1 m + (1-β1) g ; v = β2 v + (1-β2) g².
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        del grads

        # update = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps), built in place in `updates`.
        updates = torch._foreach_sqrt(exp_avg_sqs)
        if group["bias_correction"]:
            torch._foreach_div_(updates, [math.sqrt(1.0 - beta2**t) for t in steps])
        torch._foreach_add_(updates, eps)
        torch._foreach_reciprocal_(updates)
        torch._foreach_mul_(updates, exp_avgs)
        if group["bias_correction"]:
            torch._foreach_div_(updates, [1.0 - beta1**t for t in steps])
        if wd != 0.0:
            torch._foreach_add_(updates, params, alpha=wd)

        # Per-tensor trust ratio ‖w‖ / ‖u‖, 1 where either norm is 0; computed on the device.
        if wd != 0.0 or group["use_nvlamb"]:
            w_norm, u_norm = _norm_pairs(params, updates, shards)
            ratio = torch.where(
                (w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm)
            )
            torch._foreach_mul_(updates, list(ratio.unbind(0)))
        torch._foreach_add_(params, updates, alpha=-lr)


# --------------------------------------------------------------------------------------------
# Back-end choice
# --------------------------------------------------------------------------------------------


def clip_by_global_norm(groups: Iterable[dict[str, Any]], grad_norm: Tensor | float | None,
                        max_grad_norm: float) -> None:
    """Scale the ``.grad`` of every parameter in ``groups`` by the global clip coefficient.

    ``grad_norm`` None takes the norm over these parameters (each
    tensor once); ``max_grad_norm <= 0`` or ``inf`` disables the clip (then no norm is computed).
    """
    if not 0.0 < max_grad_norm < math.inf:
        return
    with torch.no_grad():
        params = _unique(p for g in groups for p in g["params"])
        if grad_norm is None:
            grad_norm = global_grad_norm(params)
        _clip_grads_in_place(params, grad_norm, max_grad_norm)


def _closure_loss(closure: Callable[[], Tensor] | None) -> Tensor | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class GlobalNormClipStep:
    """Mixin before a torch optimizer class: ``step(grad_norm=...)`` like NVLAMB's, which clips every
    ``.grad`` in place by the global norm (``self.max_grad_norm``; the norm is computed here when
    ``grad_norm`` is None; ``<= 0`` disables the clip), then takes the optimizer's own step."""

    max_grad_norm: float
    param_groups: list[dict[str, Any]]

    def step(  # type: ignore[override]
        self, closure: Callable[[], Tensor] | None = None, *, grad_norm: Tensor | float | None = None
    ) -> Tensor | None:
        loss = _closure_loss(closure)
        clip_by_global_norm(self.param_groups, grad_norm, self.max_grad_norm)
        super().step()  # type: ignore[misc]
        return loss


class _GlobalNormSGD(GlobalNormClipStep, torch.optim.SGD):
    """torch SGD that takes ``step(grad_norm=...)`` like NVLAMB and clips by the global norm.

    Clipping scales ``.grad`` in place. ``max_grad_norm <= 0`` disables it.
    """

    def __init__(self, params: Any, lr: float, max_grad_norm: float) -> None:
        super().__init__(params, lr=lr)
        self.max_grad_norm = float(max_grad_norm)


def _apex_fused_lamb_class() -> type[torch.optim.Optimizer] | None:
    """apex's FusedLAMB extended with ``step(grad_norm=...)``, or None when apex is missing.

    apex clips by the norm of its own parameters only. With an external (global) norm we clip the
    gradients in place first and raise apex's threshold to infinity for that step, so apex's own
    clip (``norm > max ? norm / max : 1``) becomes 1. ``max_grad_norm <= 0`` is mapped to infinity:
    apex would otherwise divide by zero and zero every gradient.
    """
    try:
        from apex.optimizers import FusedLAMB  # optional: not on the package index
    except ImportError:
        return None

    class _FusedLAMBGlobalNorm(FusedLAMB):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, *, max_grad_norm: float, **kwargs: Any) -> None:
            self.clip_threshold = float(max_grad_norm) if max_grad_norm > 0 else math.inf
            super().__init__(params, max_grad_norm=self.clip_threshold, **kwargs)

        def step(  # type: ignore[override]
            self, closure: Callable[[], Tensor] | None = None, *, grad_norm: Tensor | float | None = None
        ) -> Tensor | None:
            if grad_norm is None or math.isinf(self.clip_threshold):
                return super().step(closure)
            loss = _closure_loss(closure)
            with torch.no_grad():
                params = _unique(p for g in self.param_groups for p in g["params"])
                _clip_grads_in_place(params, grad_norm, self.clip_threshold)
            self.defaults["max_grad_norm"] = math.inf
            try:
                super().step()
            finally:
                self.defaults["max_grad_norm"] = self.clip_threshold
            return loss

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """apex's ``load_state_dict``; also takes NVLAMB's layout ([Note: step counts of apex and NVLAMB])."""
            super().load_state_dict(state_dict)
            steps_per_group(self)

        def zero_grad(self, set_to_none: bool = True) -> None:
            """torch's ``zero_grad(set_to_none)``: apex's ``FusedLAMB.zero_grad()`` takes no argument
            (it follows its constructor's ``set_grad_none``), and the runtime passes one."""
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    return _FusedLAMBGlobalNorm


def build_optimizer(
    name: str,
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    device: str | torch.device,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    momentum: Callable[[str], bool] | None = None,
    momentum_options: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer called ``name`` over :func:`param_groups` of ``named_parameters``.

    Every optimizer returned takes ``step(closure=None, *, grad_norm=None)``, so the runtime can
    pass the global gradient norm whichever back end is used.

    Args:
        name: ``"nvlamb"``: apex ``FusedLAMB`` (with ``use_nvlamb=True``) when apex is importable
            and ``device`` is CUDA, else :class:`NVLAMB`; ``"sgd"``: ``torch.optim.SGD`` with the
            same global-norm clipping (weight decay as SGD's L2 term, none on bias/LayerNorm).
        named_parameters: ``(name, parameter)`` pairs of this stage.
        lr: learning rate (the schedule multiplies it).
        weight_decay: weight decay of the decayed group.
        max_grad_norm: global-norm clip threshold; ``<= 0`` disables clipping.
        device: the device the parameters live on.
        betas: Adam coefficients of NVLAMB (unused by SGD).
        eps: NVLAMB's denominator term (unused by SGD).
        momentum, momentum_options: parameters updated by the momentum rule instead (NVLAMB only;
            see [Note: the momentum rule]); apex is then not used.

    Returns:
        The optimizer.

    Raises:
        ValueError: unknown ``name``, or no trainable parameters.
    """
    key = name.lower()
    if key not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    groups = param_groups(named_parameters, weight_decay, momentum, momentum_options)
    if not groups:
        raise ValueError("build_optimizer: no trainable parameters were given")
    has_momentum = any(g.get("rule") == "momentum" for g in groups)
    if key == "sgd" and has_momentum:
        raise ValueError("build_optimizer: the momentum rule for K-FAC layers needs nvlamb, not sgd")
    if key == "sgd":
        logger.info("optimizer: torch SGD (global-norm clip %s)", max_grad_norm)
        return _GlobalNormSGD(groups, lr=lr, max_grad_norm=max_grad_norm)

    is_cuda = torch.device(device).type == "cuda"
    fused = _apex_fused_lamb_class() if is_cuda and not has_momentum else None
    if fused is not None:
        logger.info("optimizer: apex FusedLAMB (use_nvlamb=True) on %s", device)
        return fused(
            groups,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            use_nvlamb=True,
        )
    reason = ("K-FAC layers use the momentum rule" if has_momentum else
              "apex is not importable" if is_cuda else f"device {device} is not CUDA")
    logger.info("optimizer: pure-PyTorch NVLAMB (%s)", reason)
    return NVLAMB(
        groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm
    )
