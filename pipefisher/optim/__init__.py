"""Optimizers: NVLAMB (global-norm clipped LAMB), its learning-rate schedule, the back-end choice,
K-FAC for Linear layers as schedulable work units, and the AdamW and Muon baselines.

Entry points: :func:`build_optimizer` (name → optimizer taking ``step(grad_norm=...)``),
:func:`build_baseline_optimizer` (``adamw``, ``muon``: torch's, with the same ``step``; Muon's
Newton–Schulz precision from :func:`resolve_ns_dtype`, one owner per matrix under sdp/tp: :class:`ShardedMuon`),
:func:`make_lr_scheduler`, :class:`KFACPreconditioner` (work units), :class:`EKFACPreconditioner`
(Adam in the factors' eigenbasis; :func:`build_preconditioner` picks one) and :class:`KFAC` (one process).
"""

from pipefisher.optim.baselines import BASELINE_OPTIMIZERS, build_baseline_optimizer, is_muon_parameter
from pipefisher.optim.ekfac import PRECONDITIONERS, EKFACPreconditioner, build_preconditioner
from pipefisher.optim.kfac import ENCODER_LINEAR_PATTERN, KFACPreconditioner, select_linears
from pipefisher.optim.kfac_driver import KFAC
from pipefisher.optim.lr_schedule import make_lr_scheduler, warmup_poly_lr
from pipefisher.optim.muon import NS_DTYPES, Muon, ShardedMuon, resolve_ns_dtype
from pipefisher.optim.nvlamb import (
    NVLAMB,
    OPTIMIZERS,
    build_optimizer,
    global_grad_norm,
    is_no_decay,
    param_groups,
)

__all__ = [
    "BASELINE_OPTIMIZERS",
    "EKFACPreconditioner",
    "ENCODER_LINEAR_PATTERN",
    "KFAC",
    "KFACPreconditioner",
    "Muon",
    "NS_DTYPES",
    "NVLAMB",
    "OPTIMIZERS",
    "PRECONDITIONERS",
    "ShardedMuon",
    "build_baseline_optimizer",
    "build_optimizer",
    "build_preconditioner",
    "global_grad_norm",
    "is_muon_parameter",
    "is_no_decay",
    "make_lr_scheduler",
    "param_groups",
    "resolve_ns_dtype",
    "select_linears",
    "warmup_poly_lr",
]
