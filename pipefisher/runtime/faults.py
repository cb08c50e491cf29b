"""Fault injection (``fault.mode``): a worker that raises, dies, stalls or computes NaN at a
chosen step, to test that the job ends promptly with the failing worker's traceback."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pipefisher.config import TrainConfig

__all__ = ["fault_here", "poison_outputs", "poison_gradient", "inject_fault"]

log = logging.getLogger(__name__)


def fault_here(cfg: TrainConfig, mode: str, rank: int, step: int) -> bool:
    f = cfg.fault
    return f.mode == mode and (f.rank, f.step) == (rank, step)


@contextlib.contextmanager
def poison_outputs(modules: Iterable[nn.Module], enabled: bool) -> Iterator[None]:
    """While active, every floating-point output of ``modules`` is NaN (``fault.mode=nan``): the
    NaN flows into the loss, every gradient and the K-FAC curvature, as a numerical blow-up would."""
    if not enabled:
        yield
        return

    def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return output * float("nan")
        if isinstance(output, tuple):
            return tuple(o * float("nan") if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in output)
        return output

    log.error("injecting fault 'nan': this worker's stage outputs are NaN for this step")
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def poison_gradient(modules: Iterable[nn.Module], enabled: bool) -> Iterator[None]:
    """While active, the gradient of one LayerNorm parameter of the first of ``modules`` is NaN
    (``fault.mode=nan_grad``): the loss and every other gradient stay finite, so only the global
    norm sees it (what per-stage steps must catch afterwards: ``runtime.stage_steps``)."""
    target = next((p for m in list(modules)[:1] for n, p in m.named_parameters() if "LayerNorm" in n), None) \
        if enabled else None
    if target is None:
        yield
        return
    log.error("injecting fault 'nan_grad': a LayerNorm gradient of this worker is NaN for this step")
    handle = target.register_hook(lambda g: g * float("nan"))
    try:
        yield
    finally:
        handle.remove()


def inject_fault(cfg: TrainConfig, rank: int, step: int) -> None:
    """Fail as ``cfg.fault`` asks, at the start of ``step`` on worker ``rank`` (a testing aid;
    ``nan`` is done by :func:`poison_outputs` around the step)."""
    f = cfg.fault
    if f.mode in ("none", "nan", "nan_grad") or not fault_here(cfg, f.mode, rank, step):
        return
    log.error("injecting fault %r on worker %d at step %d", f.mode, rank, step)
    if f.mode == "raise":
        raise RuntimeError(f"injected fault on worker {rank} at step {step} (fault.mode=raise)")
    if f.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if f.mode == "stall":
        while True:
            time.sleep(3600)
