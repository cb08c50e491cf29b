"""``runtime.flat_all_gather.FlatAllGather``, the owners' exchange (``optimizer.kfac_owners=replicas``): each member's
piece, packed and padded to the longest, lands bit for bit in the other members' tensors of that piece; a member's
own tensors are left as they are; and the exchange priced as the bytes it moves (``owner_costs.exchange_share``)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.optim.owners import plan_owners
from pipefisher.planning.owner_costs import exchange_share
from pipefisher.runtime.flat_all_gather import FlatAllGather
from pipefisher.runtime.teardown import release_process_group


def _pieces(rank: int) -> list[list[torch.Tensor]]:
    """Member 0 sends a [3, 2] and a [2] tensor, member 1 one [5] tensor and an empty one; on each rank its own
    piece holds its values (a seeded draw per member), the other's tensors hold a marker to be overwritten."""
    values = [[torch.randn(3, 2, generator=torch.Generator().manual_seed(0)), torch.tensor([1e-30, -7.5])],
              [torch.randn(5, generator=torch.Generator().manual_seed(1)), torch.zeros(0)]]
    return [[v.clone() if r == rank else torch.full_like(v, 99.0) for v in piece] for r, piece in enumerate(values)]


def _two_ranks(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        pieces = _pieces(rank)
        own = [t.data_ptr() for t in pieces[rank]]
        gathered = FlatAllGather.start(pieces, None).finish()
        assert [t.data_ptr() for t in gathered[rank]] == own  # the same tensors, filled in place
        torch.save(gathered, Path(out_dir, f"rank{rank}.pt"))
    finally:
        release_process_group()


@pytest.mark.slow
def test_each_members_piece_reaches_the_others_bit_for_bit(tmp_path: Path) -> None:
    mp.spawn(_two_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    expected = [[t.clone() for t in piece] for piece in (_pieces(0)[0], _pieces(1)[1])]  # each member's own values
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert [[tuple(t.shape) for t in piece] for piece in got] == [[(3, 2), (2,)], [(5,), (0,)]]
        for piece, want in zip(got, expected):
            assert all(torch.equal(a, b) for a, b in zip(piece, want))  # 1e-30 too: a copy, not a sum


def test_a_start_without_one_piece_per_member_is_refused(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with pytest.raises(ValueError, match="2 pieces for a group of 1"):
            FlatAllGather.start([[torch.ones(1)], [torch.ones(1)]], None)
        with pytest.raises(ValueError, match="no tensor"):
            FlatAllGather.start([[]], None)
        alone = [torch.arange(3.0)]
        assert torch.equal(FlatAllGather.start([alone], None).finish()[0][0], torch.arange(3.0))
    finally:
        release_process_group()


def test_the_exchange_is_priced_as_the_bytes_the_all_gather_moves() -> None:
    """bert's six Linears of hidden 8, split over two members by ``plan_owners``: the all-gather moves (g − 1)·P of
    the largest piece P where a ring all-reduce of the stage's p parameters moves 2(g − 1)/g·p, so g·P / 2p of it;
    with every layer on one member it moves as much as the all-reduce of the K-FAC layers did."""
    h = 8
    dims = [(h, h)] * 4 + [(h, 4 * h), (4 * h, h)]  # (in, out)
    owner = plan_owners([(o, i) for i, o in dims], 2)
    piece = [sum(i * o + o for (i, o), m in zip(dims, owner) if m == r) for r in (0, 1)]
    p = sum(i * o + o for i, o in dims) + 100  # the stage's other parameters (layer norms, ...) travel in neither
    assert exchange_share(dims, owner, p, 2) == pytest.approx(2 * max(piece) / (2 * p))
    assert exchange_share(dims, owner, p, 2) < sum(piece) / p  # under the all-reduce of the K-FAC share it replaced
    assert exchange_share(dims, [0] * 6, p, 1) == 0.0 and exchange_share(dims, owner, 0, 2) == 0.0
    one_owner = exchange_share(dims, [0] * 6, p, 2)  # everything on one member: as many bytes as the all-reduce
    assert one_owner == pytest.approx(sum(piece) / p)
