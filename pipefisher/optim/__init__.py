"""Optimizers: NVLAMB (global-norm clipped LAMB), its learning-rate schedule, the back-end choice,
and K-FAC for Linear layers as schedulable work units.

Entry points: :func:`build_optimizer` (name → optimizer taking ``step(grad_norm=...)``),
:func:`make_lr_scheduler`, :class:`KFACPreconditioner` (work units) and :class:`KFAC` (one process).
"""

from pipefisher.optim.kfac import ENCODER_LINEAR_PATTERN, KFACPreconditioner, select_linears
from pipefisher.optim.kfac_driver import KFAC
from pipefisher.optim.lr_schedule import make_lr_scheduler, warmup_poly_lr
from pipefisher.optim.nvlamb import (
    NVLAMB,
    OPTIMIZERS,
    build_optimizer,
    global_grad_norm,
    is_no_decay,
    param_groups,
)

__all__ = [
    "ENCODER_LINEAR_PATTERN",
    "KFAC",
    "KFACPreconditioner",
    "NVLAMB",
    "OPTIMIZERS",
    "build_optimizer",
    "global_grad_norm",
    "is_no_decay",
    "make_lr_scheduler",
    "param_groups",
    "select_linears",
    "warmup_poly_lr",
]
