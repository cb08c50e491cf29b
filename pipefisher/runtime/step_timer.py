"""The wall time of a training step (the loop's ``step_time_s``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["StepTimer"]


@dataclass
class StepTimer:
    """Wall time of a step, synchronizing CUDA so queued kernels are counted."""

    device: torch.device
    _start: float = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._start
