"""A worker's micro-batches on its device, copied before the step's actions run where that matters.

On CUDA a micro-batch read inside an F (the executor asks for it there) puts the host-to-device copy
inside F's timing, and without pinned memory ``non_blocking=True`` copies are synchronous. A worker's
schedule reads the same micro-batches every step, so :class:`BatchFeed` remembers which ones this
worker read in the previous step and, at the start of the next, copies them from pinned memory
before any action is timed (issue 25, item 4). The first step, and CPU runs, read lazily as before
(on CPU there is no copy to move, and reading ahead would only move the data reading out of F).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["BatchFeed"]

Batch = dict[str, torch.Tensor]


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


class BatchFeed:
    """Micro-batches of a step on ``device``.

    Args:
        read: (step, micro-batch) -> the host batch.
        device: where the batches go.
        prefetch: copy last step's micro-batches at :meth:`start_step`; None = on CUDA only.
        pin: how a host tensor is pinned before its copy (``Tensor.pin_memory`` by default).
    """

    def __init__(self, read: Callable[[int, int], Batch], device: torch.device, *, prefetch: bool | None = None,
                 pin: Callable[[torch.Tensor], torch.Tensor] = _pinned) -> None:
        self.read, self.device, self.pin = read, device, pin
        self.prefetch = device.type == "cuda" if prefetch is None else prefetch
        self._read_last: list[int] = []
        self._ready: dict[int, Batch] = {}

    def _to_device(self, batch: Batch, pin: bool) -> Batch:
        return {k: (self.pin(v) if pin else v).to(self.device, non_blocking=True) for k, v in batch.items()}

    def start_step(self, step: int) -> None:
        """Forget what was not used, and copy the micro-batches read in the previous step."""
        wanted, self._read_last = self._read_last, []
        self._ready = {mb: self._to_device(self.read(step, mb), pin=True) for mb in wanted} if self.prefetch else {}

    def get(self, step: int, micro_batch: int) -> Batch:
        """The micro-batch on the device: copied at the step's start if it was, else read now."""
        self._read_last.append(micro_batch)
        ready = self._ready.pop(micro_batch, None)
        return ready if ready is not None else self._to_device(self.read(step, micro_batch), pin=False)

    @property
    def prefetched(self) -> list[int]:
        """Micro-batches copied at this step's start and not yet asked for."""
        return sorted(self._ready)
