"""Newton–Schulz owners across the pipeline (``optimizer.ns_owners=pipeline``, issue 36 item 3).

Entry points: :class:`NsSpread` (one worker's part), :func:`plan_owners` (who orthogonalizes what,
a pure function), :func:`late_workers` (whose stage steps leave their NS to the final STEP).

[Note: NS owners across the pipeline]
Muon's update of a matrix is momentum (elementwise, where the matrix lives), then Newton–Schulz of
the whole matrix (5 × two or three matrix products), then decay and update (elementwise). Only the
middle is expensive and only it needs the whole matrix, not the parameter: it can run on any process.
In 1F1B the worker holding stage 0 finishes its last backward last, so with
``optimizer_placement=per_stage`` its NS sits on the critical path while the last stage's worker,
whose own stage step ran in its cooldown bubble, waits at the final STEP's norm all-reduce; with
``global`` every worker orthogonalizes its own stages after the barrier, and Chimera's twins (and
data-parallel copies) orthogonalize the same matrix on every worker that holds it. So:

1. The stage STEPs of the worker(s) that finish last (:func:`late_workers`, a unit-cost simulation of
   the schedule: the same answer on every rank) move the momentum and step everything else as
   before, and leave each Muon matrix's momentum update *pending* (``Muon.collecting``). Every other
   stage STEP orthogonalizes at once, in its worker's bubble. At the final STEP, the stages that
   step there (the global step, deferred or rolled-back stage steps) leave theirs pending too.
2. The final STEP is where all workers meet anyway (the norm's all-reduce). There, after the clip
   factor is known and the optimistic stage steps are confirmed or redone, each rank's pending
   matrices are made known to all (one all-reduce of a flag per matrix of the run's catalog), and
   :func:`plan_owners` gives each pending matrix one owner: first its least loaded holder (a matrix
   held by several workers, Chimera's twins, is orthogonalized once), then matrices move from the
   most to the least loaded rank while that lowers the larger of the two loads (load = ``ns_flops``).
3. Two ``all_to_all_single`` over all workers: the momentum updates of moved matrices go to their
   owners, cast to the NS precision (NS's first operation is that cast, so this is exact); the owner
   orthogonalizes (its own pending matrices while the first exchange is in flight); the results go
   back to every holder, which applies decay and update. Nothing is exchanged when no matrix moves.

The NS inputs are the same tensors, in the same dtype, through the same function
(``Muon.orthogonalize`` = the ``newton_schulz`` call ``Muon.step`` makes), and Muon's updates are per
tensor, so the parameters equal ``ns_owners=holder``'s bit for bit; only the process that computes
each NS changes. A rolled-back stage step drops its pending matrices with the rest of the step.
Cost: per moved matrix two messages of its size in the NS precision, plus one small all-reduce per
step; the spread pays where the NS it takes off the slowest worker costs more than that.
Under ``sdp``/``tp`` (``ShardedMuon``: one owner per matrix inside each mesh already) it is refused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.optim.muon import Muon, ns_flops
from pipefisher.runtime.kfac_work import StageKey
from pipefisher.schedules.ir import ActionKind, Schedule
from pipefisher.simulate import CostModel, simulate

__all__ = ["NsSpread", "late_workers", "plan_owners"]

MatrixId = tuple[int, str]  # (stage, the parameter's name in its stage module): the same on every replica
_Pending = tuple[Tensor, Tensor, dict[str, Any]]  # (parameter, momentum update, group)


def late_workers(schedule: Schedule) -> set[int]:
    """The workers whose last compute ends last in a unit-cost simulation of one step (F = 1,
    B = 2 per stage, no communication or step cost): their stage STEPs leave their NS pending.

    1F1B/GPipe: worker 0 (stage 0's last backward); Chimera at D=2: both workers (symmetric)."""
    s = schedule.num_stages
    events = simulate(schedule, CostModel(forward_ns=(1000,) * s, backward_ns=(2000,) * s))
    ends: dict[int, int] = {}
    for e in events:
        if ActionKind(e.kind).is_compute:
            ends[e.worker] = max(ends.get(e.worker, 0), e.end_ns)
    last = max(ends.values())
    return {w for w, end in ends.items() if end == last}


def plan_owners(flops: Sequence[int], holders: Sequence[Sequence[int]], ranks: int,
                eligible: Sequence[int] | None = None) -> list[int]:
    """One owner (0..ranks-1) per matrix, balancing NS work ([Note: NS owners across the pipeline]).

    Two plans, the one with the smaller largest load kept (ties: fewer matrices away from a holder,
    then the first):

    - *from the holders*: each matrix, largest first (ties: lower index), to its least loaded holder
      (ties: lower rank); then, while the most loaded rank (ties: lower rank) holds a matrix whose
      move to the least loaded eligible rank lowers the larger of their two loads, the one that
      lowers it most moves (ties: lower index);
    - *largest first*: each matrix, largest first, to the least loaded rank, a holder on ties
      (largest-processing-time scheduling: within 4/3 of the best largest load).

    A pure function of its arguments: every rank computes the same owners.

    Args:
        flops: NS cost of each matrix (``ns_flops``).
        holders: the ranks holding each matrix's update (at least one each).
        ranks: number of processes.
        eligible: the ranks that may orthogonalize a matrix they do not hold (default: all).
    """
    if len(flops) != len(holders) or any(not h for h in holders):
        raise ValueError("plan_owners: one non-empty holder list per matrix")
    takers = list(range(ranks)) if eligible is None else sorted(eligible)
    order = sorted(range(len(flops)), key=lambda i: (-flops[i], i))
    load = [0] * ranks
    kept = [0] * len(flops)
    for i in order:
        kept[i] = min(holders[i], key=lambda r: (load[r], r))
        load[kept[i]] += flops[i]
    while takers:
        hi = min(range(ranks), key=lambda r: (-load[r], r))
        lo = min(takers, key=lambda r: (load[r], r))
        moves = [(max(load[hi] - flops[i], load[lo] + flops[i]), i) for i in range(len(flops)) if kept[i] == hi]
        best = min((m for m in moves if m[0] < load[hi]), default=None)
        if best is None:
            break
        i = best[1]  # load[lo] + f < load[hi]: the sum of squared loads falls, so this ends
        kept[i] = lo
        load[hi] -= flops[i]
        load[lo] += flops[i]
    load = [0] * ranks
    lpt = [0] * len(flops)
    for i in order:
        lpt[i] = min(set(takers) | set(holders[i]), key=lambda r: (load[r], r not in holders[i], r))
        load[lpt[i]] += flops[i]

    def rank_of(owners: list[int]) -> tuple[int, int]:
        loads = [sum(f for f, o in zip(flops, owners) if o == r) for r in range(ranks)]
        return max(loads, default=0), sum(o not in h for o, h in zip(owners, holders))

    return min((kept, lpt), key=rank_of)


class NsSpread:
    """One worker's part of ``optimizer.ns_owners=pipeline`` ([Note: NS owners across the pipeline]).

    Built on every worker (a collective: the catalog of every worker's Muon matrices is gathered).

    Args:
        muon: the worker's Muon (``MuonAdamW.muon``); None when the worker has no Muon matrix.
        modules: the worker's stage replicas, keyed by (pipe, stage).
        late: whether this worker's stage STEPs leave their NS pending (:func:`late_workers`).
        ns_dtype: the NS precision (``resolve_ns_dtype``; the same on every rank).
        device: where the exchanged tensors live (CPU with gloo, the GPU with NCCL).
        group: the process group of all workers (None: the default group).

    Attributes:
        ns_runs: orthogonalizations this process ran in the last :meth:`resolve`.
        received: matrices this process orthogonalized for another in the last :meth:`resolve`.
    """

    def __init__(self, muon: Muon | None, modules: dict[StageKey, nn.Module], late: bool, ns_dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.muon, self.late, self.dtype, self.device, self.group = muon, late, ns_dtype, device, group
        if muon is not None and len({(g["ns_coefficients"], g["ns_steps"], g["eps"]) for g in muon.param_groups}) > 1:
            raise ValueError("NsSpread: an owner orthogonalizes others' matrices with its own Newton-Schulz "
                             "settings, so every Muon group must share ns_coefficients, ns_steps and eps")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        mine = {id(p) for g in muon.param_groups for p in g["params"]} if muon is not None else set()
        self.ids: dict[int, MatrixId] = {}  # id(parameter) -> its matrix
        shapes: dict[MatrixId, tuple[int, ...]] = {}
        for (_, stage), m in sorted(modules.items()):
            for name, p in m.named_parameters():
                if id(p) in mine:
                    self.ids[id(p)] = (stage, name)
                    shapes[(stage, name)] = tuple(p.shape)
        catalogs: list[Any] = [None] * self.world
        dist.all_gather_object(catalogs, sorted(shapes.items()), group=group)
        every = dict(kv for c in catalogs for kv in c)
        self.takers = [r for r, c in enumerate(catalogs) if c]  # ranks with a Muon (and its NS settings)
        self.matrices: list[MatrixId] = sorted(every)  # the run's Muon matrices, one order on every rank
        self.shapes = [every[m] for m in self.matrices]
        self.index = {m: i for i, m in enumerate(self.matrices)}
        self.pending: dict[int, list[_Pending]] = {}  # matrix index -> this rank's pending updates (replicas)
        self.ns_runs = 0
        self.received = 0

    @contextlib.contextmanager
    def deferring(self, stage_step: bool = False) -> Iterator[None]:
        """While active, Muon's updates are left pending (``Muon.collecting``): at the final STEP
        (``stage_step=False``) always, at a stage STEP when this worker is late."""
        if self.muon is None or (stage_step and not self.late):
            yield
            return
        with self.muon.collecting() as pending:
            yield
        for item in pending:
            self.pending.setdefault(self.index[self.ids[id(item[0])]], []).append(item)

    def discard(self, params: Iterable[Tensor]) -> None:
        """Drop the pending updates of ``params`` (their stage step is rolled back and redone)."""
        gone = {id(p) for p in params}
        for i in list(self.pending):
            self.pending[i] = [x for x in self.pending[i] if id(x[0]) not in gone]
            if not self.pending[i]:
                del self.pending[i]

    def clear(self) -> None:
        """Drop every pending update (a skipped step: nothing resolved, nothing counted)."""
        self.pending.clear()
        self.ns_runs = self.received = 0

    @torch.no_grad()
    def resolve(self) -> None:
        """Orthogonalize every pending matrix of every rank once, on its owner, and apply the results
        where they are held. A collective over all workers: every worker calls it at its final STEP."""
        m = len(self.matrices)
        if m == 0:
            return
        flags = torch.zeros(self.world, m, dtype=torch.int32, device=self.device)
        flags[self.rank, list(self.pending)] = 1
        dist.all_reduce(flags, group=self.group)  # each rank wrote its own row: the sum is every row
        held = flags.cpu().bool()
        todo = [i for i in range(m) if held[:, i].any()]
        holders = [[r for r in range(self.world) if held[r, i]] for i in todo]
        owners = plan_owners([ns_flops(self.shapes[i]) for i in todo], holders, self.world, self.takers)
        # the input of a matrix its owner does not hold comes from its lowest holder
        source = [o if o in h else h[0] for o, h in zip(owners, holders)]
        moved = [k for k in range(len(todo)) if source[k] != owners[k]]
        back = [k for k in range(len(todo)) if any(r != owners[k] for r in holders[k])]
        self.ns_runs = sum(o == self.rank for o in owners)
        self.received = sum(owners[k] == self.rank for k in moved)
        dtype = self.dtype
        results: dict[int, Tensor] = {}  # k -> orthogonalized update (owned here)
        inputs, work = None, None
        if moved:  # updates to their owners; our own matrices are orthogonalized meanwhile
            send = [(owners[k], self._update(todo[k]).to(dtype)) for k in moved if source[k] == self.rank]
            recv = [(source[k], self.shapes[todo[k]]) for k in moved if owners[k] == self.rank]
            inputs, work = self._exchange(send, recv, dtype, async_op=True)
        for k in range(len(todo)):
            if owners[k] == self.rank and source[k] == self.rank:
                results[k] = self._orthogonalize(todo[k], self._update(todo[k]))
        if work is not None:
            work.wait()
            for k, x in zip([k for k in moved if owners[k] == self.rank], inputs()):
                results[k] = self._orthogonalize(todo[k], x)
        got: dict[int, Tensor] = {k: results[k] for k in results if self.rank in holders[k]}
        if back:  # results to every holder that is not the owner
            send = [(r, results[k]) for k in back if owners[k] == self.rank for r in holders[k] if r != self.rank]
            mine = [k for k in back if owners[k] != self.rank and self.rank in holders[k]]
            outputs, _ = self._exchange(send, [(owners[k], self.shapes[todo[k]]) for k in mine], dtype)
            got.update(zip(mine, outputs()))
        for k, ortho in got.items():
            for p, _, group in self.pending[todo[k]]:
                Muon.apply(p, ortho, group)
        self.pending.clear()

    def _update(self, i: int) -> Tensor:
        """This rank's momentum update of matrix ``i`` (replicas on one worker hold equal ones)."""
        return self.pending[i][0][1]

    def _orthogonalize(self, i: int, update: Tensor) -> Tensor:
        group = self.pending[i][0][2] if i in self.pending else self.muon.param_groups[0]
        return self.muon.orthogonalize(update, group)

    def _exchange(self, send: list[tuple[int, Tensor]], recv: list[tuple[int, tuple[int, ...]]], dtype: torch.dtype,
                  async_op: bool = False) -> tuple[Any, dist.Work | None]:
        """One ``all_to_all_single``: ``send`` (destination, tensor) in order, ``recv`` (source, shape)
        in the order the sources send them (matrix order on both sides).

        Returns:
            ``(tensors, work)``: ``tensors()`` gives the received tensors in ``recv``'s order once
            ``work`` (None unless ``async_op``) is done.
        """
        send_splits = [sum(t.numel() for d, t in send if d == r) for r in range(self.world)]
        recv_splits = [sum(math.prod(s) for src, s in recv if src == r) for r in range(self.world)]
        flat = [t.reshape(-1) for r in range(self.world) for d, t in send if d == r]
        buffer = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=self.device)
        received = torch.empty(sum(recv_splits), dtype=dtype, device=self.device)
        work = dist.all_to_all_single(received, buffer, recv_splits, send_splits, group=self.group, async_op=async_op)

        def tensors() -> list[Tensor]:
            offsets = [sum(recv_splits[:r]) for r in range(self.world)]
            out = []
            for src, shape in recv:
                n = math.prod(shape)
                out.append(received[offsets[src]:offsets[src] + n].view(shape))
                offsets[src] += n
            return out

        return tensors, work
