"""Learning-rate schedule of NVIDIA's BERT phase 1: linear warm-up, then polynomial decay.

[Note: counting steps] ``step`` is the 0-based index of the optimizer step about to be taken. As in
NVIDIA's ``PolyWarmUpScheduler`` (DeepLearningExamples, BERT ``schedulers.py``), which sets
``last_epoch = optimizer_step_count + 1`` before each step, the schedule is evaluated at
``t = step + 1``, so step 0 already has a learning rate above 0::

    t = step + 1
    lr = base_lr · t / warmup_steps                 if t < warmup_steps
    lr = base_lr · (1 − t / total_steps) ** power   otherwise (0 once t >= total_steps)

Both branches use the same progress ``t / total_steps``, so the decay does not restart from
``base_lr``: at ``t = warmup_steps`` the rate drops from ``base_lr·(W−1)/W`` to
``base_lr·(1 − W/T)^power`` (NVIDIA's behaviour, kept on purpose), and the last step
(``step = total_steps − 1``) has lr 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["make_lr_scheduler", "warmup_poly_lr"]


def _check(warmup_steps: int, total_steps: int, power: float) -> None:
    if total_steps <= 0:
        raise ValueError(f"lr schedule: total_steps={total_steps} must be > 0")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"lr schedule: warmup_steps={warmup_steps} must lie in [0, total_steps={total_steps}]"
        )
    if power < 0:
        raise ValueError(f"lr schedule: power={power} must be >= 0")


def warmup_poly_lr(
    step: int, *, base_lr: float, warmup_steps: int, total_steps: int, power: float = 0.5
) -> float:
    """Learning rate for the 0-based optimizer step ``step`` (see [Note: counting steps]).

    Args:
        step: 0-based index of the optimizer step about to be taken; must be >= 0.
        base_lr: peak learning rate.
        warmup_steps: number of warm-up steps (0: no warm-up).
        total_steps: steps after which the rate is 0.
        power: exponent of the decay (0.5 in NVIDIA's phase 1).

    Returns:
        The learning rate, in [0, base_lr].
    """
    _check(warmup_steps, total_steps, power)
    if step < 0:
        raise ValueError(f"lr schedule: step={step} must be >= 0")
    t = step + 1
    if t < warmup_steps:
        return base_lr * t / warmup_steps
    progress = min(t / total_steps, 1.0)
    return base_lr * (1.0 - progress) ** power


@dataclass(frozen=True)
class _WarmupPolyFactor:
    """Picklable multiplier for ``LambdaLR`` (its state_dict stores callable objects' fields)."""

    warmup_steps: int
    total_steps: int
    power: float

    def __call__(self, step: int) -> float:
        return warmup_poly_lr(
            step,
            base_lr=1.0,
            warmup_steps=self.warmup_steps,
            total_steps=self.total_steps,
            power=self.power,
        )


def make_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    power: float = 0.5,
    base_lr: float | None = None,
) -> LambdaLR:
    """A ``LambdaLR`` that scales each group's initial lr by :func:`warmup_poly_lr`.

    Call ``scheduler.step()`` after each ``optimizer.step()``: the k-th optimizer step (0-based)
    then runs with ``warmup_poly_lr(k, base_lr=<group's initial lr>, ...)``. Construction already
    sets the rate of step 0.

    Args:
        optimizer: the optimizer whose groups' ``lr`` is the peak rate.
        warmup_steps: number of warm-up steps.
        total_steps: steps after which the rate is 0.
        power: decay exponent.
        base_lr: peak rate for every group, written into the groups' ``lr`` first; ``None`` keeps
            each group's own ``lr`` as its peak.

    Returns:
        The scheduler; its ``state_dict()`` round-trips ``last_epoch``.
    """
    _check(warmup_steps, total_steps, power)
    if base_lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = base_lr
    return LambdaLR(optimizer, _WarmupPolyFactor(warmup_steps, total_steps, power))
