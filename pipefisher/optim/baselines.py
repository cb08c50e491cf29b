"""Baseline optimizers: torch's AdamW, and torch's Muon on the encoder's matrices with AdamW beside it.

Both take ``step(closure=None, *, grad_norm=None)`` like :class:`~pipefisher.optim.nvlamb.NVLAMB`
and first scale every ``.grad`` in place by ``max_grad_norm / max(‖G‖, max_grad_norm)``, ‖G‖ being
the global norm the runtime computes over all pipeline stages (``nvlamb`` [Note: the global norm];
``None``: the norm of this optimizer's own gradients, right for one process). The update itself is
torch's, unchanged.

[Note: Muon with AdamW]
Muon (Jordan et al., 2024) orthogonalizes the momentum of a 2-D weight by a Newton–Schulz
iteration; it is meant for hidden layers' matrices only, so, as its authors use it, the encoder's
Linear weights (query, key, value, attention output, FFN in and out: the K-FAC layers' weights,
:data:`~pipefisher.optim.ENCODER_LINEAR_PATTERN`) go to torch's Muon (Nesterov momentum)
and everything else (embeddings, LayerNorms, biases, pooler, heads) to ``torch.optim.AdamW``.
Muon runs with ``adjust_lr_fn="match_rms_adamw"``, Moonshot's rule (Liu et al., 2025, "Muon is
Scalable for LLM Training"): a matrix of shape A×B steps with lr·0.2·sqrt(max(A, B)), which gives
its update the RMS of an AdamW update, so one ``lr`` (and one weight decay) serves both halves.

:class:`MuonAdamW` is one ``torch.optim.Optimizer`` whose ``param_groups`` list *is* the two inner
optimizers' group dicts (Muon's first), so a scheduler built over it (``make_lr_scheduler``) sets
the lr that both inner optimizers read. Its ``state_dict()`` has torch's layout, the Muon
parameters numbered first; ``load_state_dict()`` splits it back and relinks the groups.

[Note: Muon's precision and sharded weights]
The Muon half is :class:`~pipefisher.optim.muon.Muon`: torch's Muon with its Newton–Schulz in a
precision that follows the hardware (``optimizer.ns_dtype``; ``pipefisher.optim.muon`` [Note:
Newton–Schulz precision]), and for DTensor weights (``sdp``, ``tp``)
:class:`~pipefisher.optim.muon.ShardedMuon`, which orthogonalizes each whole matrix once, on one
owner per matrix ([Note: one owner per matrix]). AdamW needs nothing of the kind: its update is
elementwise, so torch's AdamW runs on the local parts.

[Note: AdamW's kernel]
torch's AdamW has three implementations of the same update: a loop over the tensors (torch's choice on
CPU), ``foreach`` (lists of tensors per op; torch's choice on CUDA; bit for bit the loop's on CPU) and
``fused`` (one kernel per device and dtype, on CPU and CUDA from torch 2.4, on DTensors too: DTensor
propagates ``_fused_adamw_`` pointwise). ``optimizer.adamw_kernel`` picks one (``auto`` leaves torch's
choice, today's runs). On CPU the fused kernel runs AdamW's update on a bert-tiny stage's non-matrix
tensors in 4.6 ms against the loop's 36 ms (bench/studies/19, section 3), and it rounds differently:
it computes the step in another order (its bias corrections and ``lr/bias1`` folded), so parameters
differ from the loop's in the last bits (about 1e-7 relative per step, measured in
tests/test_adamw_kernel.py), not bit for bit. A checkpoint keeps the group's kernel flags; loading it
restores this run's choice (:func:`_use_kernel`), so a resumed run may change kernels.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipefisher.optim.kfac import ENCODER_LINEAR_PATTERN
from pipefisher.optim.muon import Muon, ShardedMuon
from pipefisher.optim.nvlamb import GlobalNormClipStep, _closure_loss, clip_by_global_norm, param_groups

__all__ = [
    "ADAMW_KERNELS",
    "BASELINE_OPTIMIZERS",
    "GlobalNormAdamW",
    "MuonAdamW",
    "ShardedMuon",
    "build_baseline_optimizer",
    "clip_by_global_norm",
    "is_muon_parameter",
]

#: Names accepted by :func:`build_baseline_optimizer`.
BASELINE_OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")

#: ``optimizer.adamw_kernel``'s choices and the AdamW options each sets ([Note: AdamW's kernel]).
ADAMW_KERNEL_OPTIONS: dict[str, dict[str, bool | None]] = {
    "auto": {"foreach": None, "fused": None},  # torch's choice: the per-tensor loop on CPU, foreach on CUDA
    "foreach": {"foreach": True, "fused": None},
    "fused": {"foreach": None, "fused": True},
}
ADAMW_KERNELS: tuple[str, ...] = tuple(ADAMW_KERNEL_OPTIONS)


def _kernel_options(kernel: str) -> dict[str, bool | None]:
    if kernel not in ADAMW_KERNEL_OPTIONS:
        raise ValueError(f"adamw_kernel={kernel!r}: choose one of {', '.join(ADAMW_KERNELS)}")
    return ADAMW_KERNEL_OPTIONS[kernel]


def _use_kernel(opt: torch.optim.AdamW, kernel: str) -> None:
    """Set ``kernel``'s flags on every group of ``opt`` and move each ``step`` count where that kernel
    keeps it (fused: float32 on the parameter's device; the others: a CPU scalar), as torch's own
    ``load_state_dict`` does for the kernel a checkpoint was saved with."""
    options = _kernel_options(kernel)
    for group in opt.param_groups:
        group.update(options)
        for p in group["params"]:
            step = opt.state.get(p, {}).get("step")
            if isinstance(step, Tensor) and not group.get("capturable"):
                device = p.device if options["fused"] else torch.device("cpu")
                opt.state[p]["step"] = step.to(device=device, dtype=torch.float32)


class GlobalNormAdamW(GlobalNormClipStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` that takes ``step(grad_norm=...)`` and clips by the global norm first.

    Args:
        params: parameters or groups (:func:`~pipefisher.optim.param_groups`: no decay on bias and
            LayerNorm).
        lr, betas, eps, weight_decay: AdamW's (decoupled decay; a group's own value wins).
        max_grad_norm: global-norm clip threshold; ``<= 0`` disables it.
        kernel: torch's implementation, one of :data:`ADAMW_KERNELS` ([Note: AdamW's kernel]).
    """

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 max_grad_norm: float, kernel: str = "auto") -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **_kernel_options(kernel))
        self.max_grad_norm = float(max_grad_norm)
        self.kernel = kernel

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then this optimizer's kernel again (the saved groups carry the saving run's)."""
        super().load_state_dict(state_dict)
        _use_kernel(self, self.kernel)


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` for 2-D hidden weights and ``torch.optim.AdamW`` for the rest, as one
    optimizer (see [Note: Muon with AdamW]).

    ``param_groups`` is the inner optimizers' groups (Muon's first), shared, so an lr scheduler over
    this object drives both; ``state`` stays empty (the moments live in ``.muon.state`` and
    ``.adamw.state``; ``state_dict()`` holds both).

    Args:
        muon_params: 2-D weights for Muon (may be empty: a stage without encoder layers).
        adamw_groups: groups for AdamW (may hold no parameters).
        lr: the one peak rate (Muon scales it per matrix by ``match_rms_adamw``).
        betas, eps: AdamW's.
        weight_decay: decoupled decay of the Muon weights and AdamW's default (groups may override).
        muon_momentum: Muon's Nesterov momentum.
        max_grad_norm: global-norm clip threshold over both halves; ``<= 0`` disables it.
        ns_dtype: Newton–Schulz precision (default bf16, torch's; ``optimizer.ns_dtype`` resolved by
            :func:`~pipefisher.optim.muon.resolve_ns_dtype`).
        adamw_kernel: the AdamW half's implementation, one of :data:`ADAMW_KERNELS` ([Note: AdamW's kernel]).

    Raises:
        ValueError: no parameters at all, a Muon parameter that is not 2-D, or a torch without Muon.
    """

    def __init__(self, muon_params: Iterable[nn.Parameter], adamw_groups: Iterable[dict[str, Any]], *,
                 lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, muon_momentum: float = 0.95, max_grad_norm: float = 1.0,
                 ns_dtype: torch.dtype = torch.bfloat16, adamw_kernel: str = "auto") -> None:
        muon_params = list(muon_params)
        adamw_groups = [g for g in adamw_groups if g["params"]]
        if not muon_params and not adamw_groups:
            raise ValueError("MuonAdamW: no trainable parameters were given")
        if muon_params and not hasattr(torch.optim, "Muon"):
            raise ValueError(f"optimizer=muon needs torch.optim.Muon (torch >= 2.9), this is torch "
                             f"{torch.__version__}; upgrade torch or use optimizer=adamw")
        for p in muon_params:
            if p.ndim != 2:
                raise ValueError(f"MuonAdamW: Muon takes 2-D weights only, got a tensor of shape {tuple(p.shape)}")
        # DTensor weights (sdp, tp) need the whole matrix orthogonalized: [Note: Muon's precision and sharded weights]
        muon_class = ShardedMuon if any(isinstance(p, DTensor) for p in muon_params) else Muon
        self.muon = muon_class(muon_params, lr=lr, weight_decay=weight_decay, momentum=muon_momentum,
                               nesterov=True, adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype) if muon_params else None
        self.adamw = (torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                        **_kernel_options(adamw_kernel)) if adamw_groups else None)
        self.adamw_kernel = adamw_kernel
        super().__init__([p for opt in self._inner() for g in opt.param_groups for p in g["params"]], {"lr": lr})
        self.max_grad_norm = float(max_grad_norm)
        self._link()

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    def _link(self) -> None:
        """Make ``param_groups`` the inner optimizers' group dicts (after construction and loading)."""
        self.param_groups = [g for opt in self._inner() for g in opt.param_groups]

    def step(  # type: ignore[override]
        self, closure: Callable[[], Tensor] | None = None, *, grad_norm: Tensor | float | None = None
    ) -> Tensor | None:
        """Clip every ``.grad`` by ``grad_norm`` (computed over both halves when None), then step
        Muon and AdamW."""
        loss = _closure_loss(closure)
        clip_by_global_norm(self.param_groups, grad_norm, self.max_grad_norm)
        for opt in self._inner():
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Both inner optimizers' state in torch's layout: parameters numbered Muon's first."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        offset = 0
        for opt in self._inner():
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load :meth:`state_dict` output of a MuonAdamW over the same parameters.

        Raises:
            ValueError: the saved groups do not match this optimizer's.
        """
        saved = list(state_dict["param_groups"])
        inner = self._inner()
        if len(saved) != sum(len(opt.param_groups) for opt in inner):
            raise ValueError(f"MuonAdamW.load_state_dict: {len(saved)} saved parameter groups, this optimizer has "
                             f"{[len(opt.param_groups) for opt in inner]} (Muon, AdamW)")
        for opt in inner:
            mine, saved = saved[:len(opt.param_groups)], saved[len(opt.param_groups):]
            ids = {i for g in mine for i in g["params"]}
            offset = min(ids, default=0)
            opt.load_state_dict({
                "state": {i - offset: s for i, s in state_dict["state"].items() if i in ids},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
            })
        if self.adamw is not None:
            _use_kernel(self.adamw, self.adamw_kernel)
        self._link()


def is_muon_parameter(name: str) -> bool:
    """Whether the parameter called ``name`` is an encoder Linear layer's weight (the K-FAC layers'
    weights, :data:`~pipefisher.optim.ENCODER_LINEAR_PATTERN`); prefixes such as ``"0.1."`` are allowed."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and re.search(ENCODER_LINEAR_PATTERN, module) is not None


def _split_by_kind(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split in two with the same options: its plain tensors, then its DTensors.

    torch's AdamW defaults to its ``_foreach`` kernels on CUDA, and one ``_foreach`` call cannot mix
    Tensors and DTensors ("got mixed torch.Tensor and DTensor"), which a tensor-parallel stage holds
    side by side (split weights beside whole embeddings and LayerNorms). A group without DTensors
    comes back as it was (the same dict), so unsharded runs keep their groups.
    """
    out: list[dict[str, Any]] = []
    for group in groups:
        dtensors = [p for p in group["params"] if isinstance(p, DTensor)]
        if not dtensors:
            out.append(group)
            continue
        plain = [p for p in group["params"] if not isinstance(p, DTensor)]
        out += [{**group, "params": params} for params in (plain, dtensors) if params]
    return out


def build_baseline_optimizer(
    name: str,
    named_parameters: Iterable[tuple[str, nn.Parameter]],
    *,
    lr: float,
    weight_decay: float,
    max_grad_norm: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    muon_momentum: float = 0.95,
    ns_dtype: torch.dtype = torch.bfloat16,
    adamw_kernel: str = "auto",
) -> torch.optim.Optimizer:
    """Build ``adamw`` (:class:`GlobalNormAdamW`) or ``muon`` (:class:`MuonAdamW`) over one stage's
    parameters, with NVLAMB's groups (:func:`~pipefisher.optim.param_groups`: no decay on bias and
    LayerNorm) for AdamW.

    Args:
        name: ``"adamw"`` or ``"muon"``.
        named_parameters: ``(name, parameter)`` pairs of this stage; a tensor reached under several
            names counts once, by its first name; ``requires_grad=False`` ones are left out.
        lr: peak learning rate (the schedule multiplies it).
        weight_decay: decoupled weight decay of the decayed parameters (and of Muon's).
        max_grad_norm: global-norm clip threshold; ``<= 0`` disables clipping.
        betas, eps: AdamW's.
        muon_momentum: Muon's momentum (``muon`` only).
        ns_dtype: Muon's Newton–Schulz precision (``muon`` only; default bf16, torch's).
        adamw_kernel: AdamW's implementation (``adamw``, and ``muon``'s AdamW half), one of
            :data:`ADAMW_KERNELS`; ``auto`` is torch's choice.

    Raises:
        ValueError: unknown ``name`` or ``adamw_kernel``, or no trainable parameters.
    """
    key = name.lower()
    if key not in BASELINE_OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(BASELINE_OPTIMIZERS)}")
    _kernel_options(adamw_kernel)
    named: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for n, p in named_parameters:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            named.append((n, p))
    if not named:
        raise ValueError("build_baseline_optimizer: no trainable parameters were given")
    if key == "adamw":
        return GlobalNormAdamW(_split_by_kind(param_groups(named, weight_decay)), lr=lr, betas=betas, eps=eps,
                               weight_decay=weight_decay, max_grad_norm=max_grad_norm, kernel=adamw_kernel)
    muon = [p for n, p in named if is_muon_parameter(n)]
    rest = _split_by_kind(param_groups([(n, p) for n, p in named if not is_muon_parameter(n)], weight_decay))
    return MuonAdamW(muon, rest, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                     muon_momentum=muon_momentum, max_grad_norm=max_grad_norm, ns_dtype=ns_dtype,
                     adamw_kernel=adamw_kernel)
