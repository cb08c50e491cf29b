"""One asynchronous all-gather of each member's tensors, packed into one flat piece per member, and its copy-back.

The exchange of preconditioned gradients among a stage's replicas (``optimizer.kfac_owners=replicas``, [Note:
K-FAC owners among replicas] in ``runtime.kfac_owners``) sends each layer from its one owner to the others: each
member contributes only the layers it owns, so an all-gather moves (g − 1)/g of the stage's K-FAC gradients per
member where a ring all-reduce of the whole (the others' layers zeroed) moves 2(g − 1)/g of them, and the result
is a copy of the owner's values (bit for bit, as the sum with zeros was).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["FlatAllGather"]


def _all_gather(out: torch.Tensor, piece: torch.Tensor, group: dist.ProcessGroup | None) -> dist.Work:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the former from torch 2.13
    return gather(out, piece, group=group, async_op=True)


@dataclass
class FlatAllGather:
    """An all-gather in flight: member r's ``pieces[r]`` (packed, padded to the longest piece) lands in ``out``;
    :meth:`finish` copies every other member's piece into its tensors.

    Attributes:
        work: The collective's handle.
        out: The gathered buffer, ``width`` elements per member, in the group's rank order.
        width: The longest piece's elements (the others are padded with zeros to it).
        pieces: Per member of the group, the tensors it sends (on this rank: where the others' values go).
        me: This rank's index in the group (its own tensors already hold its piece).
    """

    work: dist.Work
    out: torch.Tensor
    width: int
    pieces: list[list[torch.Tensor]]
    me: int

    @classmethod
    def start(cls, pieces: Sequence[Sequence[torch.Tensor]], group: dist.ProcessGroup | None) -> FlatAllGather:
        """Start gathering ``pieces[r]`` from member r of ``group`` (every member passes tensors of the same shapes in
        the same order; one dtype and device), this rank's own piece packed from its tensors.

        Raises:
            ValueError: ``pieces`` does not have one entry per member of ``group``, or holds no tensor.
        """
        world, me = dist.get_world_size(group), dist.get_rank(group)
        if len(pieces) != world:
            raise ValueError(f"FlatAllGather: {len(pieces)} pieces for a group of {world}; one per member")
        ref = next((t for piece in pieces for t in piece), None)
        if ref is None:
            raise ValueError("FlatAllGather: no tensor to gather")
        width = max(sum(t.numel() for t in piece) for piece in pieces)
        flat = torch.zeros(width, dtype=ref.dtype, device=ref.device)
        if pieces[me]:
            own = torch.cat([t.reshape(-1) for t in pieces[me]])
            flat[:own.numel()].copy_(own)
        out = torch.empty(width * world, dtype=ref.dtype, device=ref.device)
        return cls(_all_gather(out, flat, group), out, width, [list(p) for p in pieces], me)

    def finish(self) -> list[list[torch.Tensor]]:
        """Wait for the collective and copy each other member's piece into its tensors.

        Returns:
            ``pieces``, every member's now holding what that member sent.
        """
        self.work.wait()
        for r, piece in enumerate(self.pieces):
            if r == self.me:
                continue
            offset = r * self.width
            for t in piece:
                n = t.numel()
                t.copy_(self.out[offset:offset + n].view_as(t))
                offset += n
        return self.pieces
