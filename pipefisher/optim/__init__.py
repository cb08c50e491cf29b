"""Optimizers: NVLAMB (global-norm clipped LAMB), its learning-rate schedule, and the back-end choice.

Entry points: :func:`build_optimizer` (name → optimizer taking ``step(grad_norm=...)``) and
:func:`make_lr_scheduler`.
"""

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
    "NVLAMB",
    "OPTIMIZERS",
    "build_optimizer",
    "global_grad_norm",
    "is_no_decay",
    "make_lr_scheduler",
    "param_groups",
    "warmup_poly_lr",
]
