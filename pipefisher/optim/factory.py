"""The optimizer and LR schedule of a run's worker, from the run's config (:func:`make_optimizer`).

``optim`` sits below ``config`` (CONTRIBUTING.md, "The map and its layers"), so the config is read
here by its fields, not imported: ``cfg`` is a :class:`pipefisher.config.TrainConfig`, already
validated. The names below repeat the config's (``tests/test_config.py`` checks they agree).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from pipefisher.optim import (
    BASELINE_OPTIMIZERS,
    ENCODER_LINEAR_PATTERN,
    build_baseline_optimizer,
    build_optimizer,
    make_lr_scheduler,
    resolve_ns_dtype,
)

log = logging.getLogger(__name__)

__all__ = ["make_optimizer", "is_kfac_parameter", "refresh_decay", "KFAC_OPTIMIZERS", "FACTOR_DECAY_UNITS"]

KFAC_OPTIMIZERS = ("kfac", "pipefisher")  # as pipefisher.config.KFAC_OPTIMIZERS
FACTOR_DECAY_UNITS = ("step", "refresh")  # as pipefisher.config.FACTOR_DECAY_UNITS


def refresh_decay(factor_decay: float, per: str, interval: int) -> float:
    """The running-average decay applied at each K-FAC refresh: ``factor_decay ** interval`` when
    ``factor_decay_per`` is ``"step"`` (a refresh every k steps then forgets as fast per step as a
    refresh every step; bench/README.md §10 measured that 0.95 per refresh at k=2 loses K-FAC's gain
    and 0.95² keeps it), ``factor_decay`` when it is ``"refresh"`` (ASDL's and kfac-pytorch's rule)."""
    if per not in FACTOR_DECAY_UNITS:
        raise ValueError(f"optimizer.factor_decay_per={per!r}: choose one of {', '.join(FACTOR_DECAY_UNITS)}")
    return factor_decay ** interval if per == "step" else factor_decay


def is_kfac_parameter(name: str) -> bool:
    """Whether the parameter called ``name`` belongs to a K-FAC layer (an encoder Linear layer,
    :data:`~pipefisher.optim.ENCODER_LINEAR_PATTERN`); prefixes such as ``"0.1."`` are allowed."""
    module, _, leaf = name.rpartition(".")
    return leaf in ("weight", "bias") and re.search(ENCODER_LINEAR_PATTERN, module) is not None


def make_optimizer(cfg: Any, named_params: list[tuple[str, torch.nn.Parameter]], device: torch.device,
                   log_here: bool = True) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Optimizer and LR scheduler for the parameters one worker updates.

    ``cfg``: the run's :class:`~pipefisher.config.TrainConfig`.
    ``optimizer=adamw`` / ``muon``: torch's AdamW, or torch's Muon on the encoder's Linear weights
    with AdamW for the rest (``pipefisher.optim.baselines``), clipped by the global norm like NVLAMB.
    With K-FAC and ``optimizer.kfac_update=momentum`` the K-FAC layers' parameters are updated by
    the momentum rule (``pipefisher.optim.nvlamb`` [Note: the momentum rule]) at ``optimizer.kfac_lr``
    under the same warm-up and decay; the rest by NVLAMB. Every group follows the same schedule.
    Muon's Newton–Schulz precision follows ``optimizer.ns_dtype`` and the device
    (:func:`~pipefisher.optim.muon.resolve_ns_dtype`), logged in one line when ``log_here``. AdamW's
    implementation (``optimizer=adamw`` and Muon's AdamW half) is ``optimizer.adamw_kernel``
    (``pipefisher.optim.baselines`` [Note: AdamW's kernel]).
    """
    o = cfg.optimizer
    if o.name in BASELINE_OPTIMIZERS:
        ns_dtype, line = resolve_ns_dtype(o.ns_dtype, device)
        if o.name == "muon" and log_here:
            log.info("%s", line)
        opt = build_baseline_optimizer(o.name, named_params, lr=cfg.lr, weight_decay=o.weight_decay,
                                       max_grad_norm=o.max_grad_norm, betas=(o.beta1, o.beta2), eps=o.eps,
                                       muon_momentum=o.muon_momentum, ns_dtype=ns_dtype,
                                       adamw_kernel=o.adamw_kernel)
    else:
        opt = _nvlamb(cfg, named_params, device)
    sched = make_lr_scheduler(
        opt,
        warmup_steps=int(o.warmup_proportion * cfg.steps),
        total_steps=cfg.steps,
        power=o.poly_power,
    )
    return opt, sched


def _nvlamb(cfg: Any, named_params: list[tuple[str, torch.nn.Parameter]],
            device: torch.device) -> torch.optim.Optimizer:
    """NVLAMB (optimizer=nvlamb, and the base of kfac / pipefisher), with the momentum rule's groups."""
    o = cfg.optimizer
    momentum = o.name in KFAC_OPTIMIZERS and o.kfac_update == "momentum"
    return build_optimizer(
        "nvlamb",
        named_params,
        lr=cfg.lr,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        device=device,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        momentum=is_kfac_parameter if momentum else None,
        momentum_options={"lr": o.kfac_lr if o.kfac_lr is not None else cfg.lr,
                          "max_grad_norm": o.kfac_max_grad_norm} if momentum else None,
    )
