"""The owners' exchange of preconditioned gradients (``optimizer.kfac_owners=replicas``, ``runtime.kfac_work``): on
two gloo ranks whose gradients differ, every layer's gradient afterwards is its owner's bit for bit on both ranks,
with the owner's curvature age and the non-owner's own raw norm (the clip reads it), by an all-gather where each
member owns a piece and by an all-reduce where one member owns everything (``optim.owners.exchange_gathers``)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from pipefisher.optim import KFACPreconditioner
from pipefisher.optim.owners import exchange_gathers, plan_owners
from pipefisher.runtime.kfac_owners import layer_owners
from pipefisher.runtime.kfac_work import KfacWork
from pipefisher.runtime.teardown import release_process_group


def _linears(shapes: list[tuple[int, int]]) -> dict[str, nn.Linear]:
    torch.manual_seed(0)  # the same layers on every rank
    return {f"l{i}": nn.Linear(i_, o) for i, (i_, o) in enumerate(shapes)}  # (in, out)


def _grads(rank: int, linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank's own gradients
    return {f"{n}.{p}": torch.randn(getattr(m, p).shape, generator=g) for n, m in linears.items()
            for p in ("weight", "bias")}


def _rank(rank: int, out_dir: str, shapes: list[tuple[int, int]]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        linears = _linears(shapes)
        before = _grads(rank, linears)
        for n, m in linears.items():
            m.weight.grad, m.bias.grad = before[f"{n}.weight"].clone(), before[f"{n}.bias"].clone()
        pre = KFACPreconditioner(linears)
        owned = frozenset(n for n, o in layer_owners(pre, 2).items() if o == rank)
        work = KfacWork({(0, 0): pre}, {0: dist.group.WORLD}, deferred=False, owned={(0, 0): owned})
        work._start_exchange((0, 0), pre, list(linears), owned, {n: 3 + rank for n in owned})  # PRECOND's exchange
        kind = type(work._exchanges[(0, 0)][0][0]).__name__
        assert work.finish_exchanges() and not work.finish_exchanges()
        torch.save({"kind": kind, "age": work._used_age, "owned": sorted(owned),
                    "grads": {f"{n}.{p}": getattr(m, p).grad.clone() for n, m in linears.items() for p in ("weight", "bias")},
                    "raw": {n: pre.layer(n).raw_grad_sq for n in linears}}, Path(out_dir, f"rank{rank}.pt"))
    finally:
        release_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("shapes, kind", [([(6, 8), (8, 6), (6, 6)], "FlatAllGather"), ([(6, 8)], "FlatAllReduce")],
                         ids=["pieces-all-gather", "one-owner-all-reduce"])
def test_every_layer_gets_its_owners_gradient_bit_for_bit(tmp_path: Path, shapes, kind) -> None:
    mp.spawn(_rank, args=(str(tmp_path), shapes), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    linears = _linears(shapes)
    owner = {f"l{i}": o for i, o in enumerate(plan_owners([(o, i_) for i_, o in shapes], 2))}
    assert [g["owned"] for g in got] == [[n for n in owner if owner[n] == r] for r in (0, 1)]
    sent = [_grads(r, linears) for r in (0, 1)]
    for r in (0, 1):
        assert got[r]["kind"] == kind
        for key, value in got[r]["grads"].items():
            assert torch.equal(value, sent[owner[key.split(".")[0]]][key]), (r, key)  # the owner's, exactly
        others = [3 + owner[n] for n in owner if owner[n] != r]  # its own ages PRECOND notes, not the exchange
        assert got[r]["age"] == (max(others) if others else None)  # the oldest curvature the other owners used
        for n, raw in got[r]["raw"].items():  # a non-owner keeps its own gradient's norm; an owner records none here
            if owner[n] == r:
                assert raw is None
            else:
                own = sent[r][f"{n}.weight"].double().pow(2).sum() + sent[r][f"{n}.bias"].double().pow(2).sum()
                torch.testing.assert_close(raw.double(), own, rtol=1e-6, atol=0)


def test_the_exchange_gathers_where_that_moves_fewer_bytes() -> None:
    """Per member an all-gather moves (g − 1)·max piece, a ring all-reduce 2(g − 1)/g·sum: bert's six Linears of
    hidden h (four [h, h], [4h, h], [h, 4h]) gather at two and four members, not at eight (pieces padded to a
    4h² layer, a third of the 12h² whole) nor with everything on one member."""
    h = 64
    shapes = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]  # [O, I]
    for g, gathers in ((2, True), (3, True), (4, True), (8, False)):
        owner = plan_owners(shapes, g)
        piece = [sum(o * i for (o, i), m in zip(shapes, owner) if m == r) for r in range(g)]
        assert exchange_gathers(piece) is gathers, (g, piece)
    assert not exchange_gathers([10, 0]) and exchange_gathers([6, 4]) and not exchange_gathers([7])
