"""One asynchronous all-reduce of several tensors packed into one flat buffer, and its copy-back.

The executor's gradient all-reduce (SYNC_GRAD) and K-FAC's factor all-reduce (SYNC_FACTOR) both start a flat
all-reduce when an action runs and wait for it when a later action needs its result ([Note: waits are not compute]
in ``runtime.executor``): this is the one place that packs, waits and unpacks. The owners' exchange of
preconditioned gradients (``optimizer.kfac_owners=replicas``) is one too where an all-gather
(``runtime.flat_all_gather``) would move more bytes (``optim.owners.exchange_gathers``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["FlatAllReduce"]


@dataclass
class FlatAllReduce:
    """An all-reduce (sum) in flight over ``flat``, whose result :meth:`finish` copies back into ``tensors``.

    Attributes:
        work: The collective's handle.
        flat: The buffer being reduced.
        tensors: Where the result goes, in packing order (empty: nothing is copied back, e.g. the
            communication ablation's one-byte message).
    """

    work: dist.Work
    flat: torch.Tensor
    tensors: list[torch.Tensor]

    @classmethod
    def start(cls, tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> FlatAllReduce:
        """Pack ``tensors`` (one dtype and device) into one buffer and start summing it over ``group``."""
        flat = torch._utils._flatten_dense_tensors(tensors)
        return cls(dist.all_reduce(flat, group=group, async_op=True), flat, list(tensors))

    @classmethod
    def start_message(cls, message: torch.Tensor, group: dist.ProcessGroup | None) -> FlatAllReduce:
        """Start an all-reduce of ``message`` whose result is copied nowhere (an ablation's stand-in)."""
        return cls(dist.all_reduce(message, group=group, async_op=True), message, [])

    def wait(self) -> None:
        """Wait for the collective without unpacking (a caller that times the wait apart from the work)."""
        self.work.wait()

    def finish(self) -> list[torch.Tensor]:
        """Wait for the collective and copy the summed values back into ``tensors``.

        Returns:
            ``tensors``, now holding the sums.
        """
        self.work.wait()
        if self.tensors:
            for t, summed in zip(self.tensors, torch._utils._unflatten_dense_tensors(self.flat, self.tensors)):
                t.copy_(summed)
        return self.tensors
