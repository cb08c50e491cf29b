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
2. The final STEP is where all workers meet anyway (the norm's all-reduce). There, once the clip
   factor is known and the optimistic stage steps are confirmed or redone, the Muon matrices that
   step at the final STEP step first (momentum; their NS left pending), and every rank knows which
   matrices are pending where without a message: every rank's all (the global placement; stage steps
   deferred after a clipped step; rolled back), or the late ranks' (stage steps confirmed).
   :func:`plan_owners` gives each pending matrix one owner: first its least loaded holder (a matrix
   held by several workers, Chimera's twins, is orthogonalized once), then matrices move from the
   most to the least loaded rank while that lowers the larger of the two loads (load = ``ns_flops``).
3. Two ``all_to_all_single`` over all workers: the momentum updates of moved matrices go to their
   owners, cast to the NS precision (NS's first operation is that cast, so this is exact), while the
   rest of the final STEP (AdamW's half) steps; the owners orthogonalize (their own pending matrices
   first); the results go back to every holder, which applies decay and update. Neither exchange
   runs when no matrix moves or has a second holder.

The NS inputs are the same tensors, in the same dtype, through the same function
(``Muon.orthogonalize`` = the ``newton_schulz`` call ``Muon.step`` makes), and Muon's updates are per
tensor, so the parameters equal ``ns_owners=holder``'s bit for bit; only the process that computes
each NS changes. A rolled-back stage step drops its pending matrices with the rest of the step.
Cost: per moved matrix two messages of its size in the NS precision, and a second synchronization of
all workers after the norm's (the result exchange). It pays where the NS it takes off the slowest worker
costs more than that and the owners are idle at the final STEP; measured and simulated figures:
``bench/studies/19-muon-off-critical-path.md`` (at D=2 on a CPU it pays for Chimera's twins, which
orthogonalize each matrix once instead of twice, and not for 1F1B, whose last stage is not idle then).
Under ``sdp``/``tp`` (``ShardedMuon``: one owner per matrix inside each mesh already) it is refused.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from pipefisher.optim.muon import Muon, ns_flops
from pipefisher.runtime.kfac_work import StageKey
from pipefisher.schedules.ir import ActionKind, Schedule
from pipefisher.simulate import CostModel, simulate

__all__ = ["NsSpread", "late_workers", "only_grads", "plan_owners"]

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
    Per step: stage STEPs run inside :meth:`deferring` (``stage_step=True``); the final STEP calls
    :meth:`step` for what steps there, then :meth:`resolve`.

    Args:
        muon: the worker's Muon (``MuonAdamW.muon``); None when the worker has no Muon matrix.
        modules: the worker's stage replicas, keyed by (pipe, stage).
        late: the ranks whose stage STEPs leave their NS pending (:func:`late_workers`).
        ns_dtype: the NS precision (``resolve_ns_dtype``; the same on every rank).
        device: where the exchanged tensors live (CPU with gloo, the GPU with NCCL).
        group: the process group of all workers (None: the default group).

    Attributes:
        ns_runs: orthogonalizations this process ran in the last :meth:`resolve`.
        received: matrices this process orthogonalized for another in the last :meth:`resolve`.
        resolve_s, ns_s: host wall time of the last :meth:`start` + :meth:`resolve` and of their
            orthogonalizations (benchmarks; on a GPU the time to launch them, not to run them).
    """

    def __init__(self, muon: Muon | None, modules: dict[StageKey, nn.Module], late: set[int], ns_dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.muon, self.dtype, self.device, self.group = muon, ns_dtype, device, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.late_ranks = set(late)
        self.late = self.rank in self.late_ranks
        if muon is not None and len({(g["ns_coefficients"], g["ns_steps"], g["eps"]) for g in muon.param_groups}) > 1:
            raise ValueError("NsSpread: an owner orthogonalizes others' matrices with its own Newton-Schulz "
                             "settings, so every Muon group must share ns_coefficients, ns_steps and eps")
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
        self.matrices: list[MatrixId] = sorted(every)  # the run's Muon matrices, one order on every rank
        self.shapes = [every[m] for m in self.matrices]
        self.index = {m: i for i, m in enumerate(self.matrices)}
        self.held = [{self.index[m] for m, _ in c} for c in catalogs]  # rank -> the matrices it steps
        self.takers = [r for r, c in enumerate(catalogs) if c]  # ranks with a Muon (and its NS settings)
        self.pending: dict[int, list[_Pending]] = {}  # matrix index -> this rank's pending updates (replicas)
        self._plan: _Plan | None = None
        self.ns_runs = 0
        self.received = 0
        self.resolve_s = self.ns_s = 0.0

    def holds(self, p: Tensor) -> bool:
        """Whether ``p`` is one of this worker's Muon matrices."""
        return id(p) in self.ids

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

    def step(self, optimizer: torch.optim.Optimizer, params: list[Tensor], grad_norm: Tensor,
             everything: bool) -> None:
        """The final STEP's update of ``params``: the Muon matrices first (momentum; NS left pending),
        then :meth:`start`, so the matrices travel while the rest (AdamW) steps. The updates are per
        tensor and the clip factor comes from ``grad_norm``, so the split changes no bit.

        Args:
            everything: every rank leaves all its matrices to this STEP (the global placement, a stage
                step deferred after a clipped step, or rolled back); False: the stage steps were
                confirmed and only the late ranks' matrices are pending ([Note: NS owners across the
                pipeline]). The same on every rank.
        """
        matrices = [p for p in params if self.holds(p)]
        with only_grads(optimizer, matrices), self.deferring():
            optimizer.step(grad_norm=grad_norm)
        self.start(everything)
        with only_grads(optimizer, [p for p in params if not self.holds(p)]):
            optimizer.step(grad_norm=grad_norm)

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
        self._plan = None
        self.ns_runs = self.received = 0
        self.resolve_s = self.ns_s = 0.0

    @torch.no_grad()
    def start(self, everything: bool) -> None:
        """Plan the owners of the pending matrices and send the moved ones' updates to their owners
        (asynchronously). A collective over all workers when a matrix moves; every worker calls it
        at its final STEP, after its Muon matrices' momentum.

        Which matrices are pending is known on every rank without a message: all of every rank's
        (``everything``) or the late ranks' ([Note: NS owners across the pipeline]). A matrix
        pending here outside that set (a stage that deferred on its own norm when rounding let the
        global norm pass) is orthogonalized here, as ``ns_owners=holder`` would.
        """
        self.ns_s, started = 0.0, time.perf_counter()
        expected = [r for r in range(self.world) if everything or r in self.late_ranks]
        todo = sorted({i for r in expected for i in self.held[r]})
        holders = [[r for r in expected if i in self.held[r]] for i in todo]
        missing = [i for i, h in zip(todo, holders) if self.rank in h and i not in self.pending]
        if missing:
            raise AssertionError(f"ns_spread: rank {self.rank} was expected to hold pending updates of "
                                 f"{[self.matrices[i] for i in missing]}")
        owners = plan_owners([ns_flops(self.shapes[i]) for i in todo], holders, self.world, self.takers)
        # the input of a matrix its owner does not hold comes from its lowest holder
        source = [o if o in h else h[0] for o, h in zip(owners, holders)]
        moved = [k for k in range(len(todo)) if source[k] != owners[k]]
        plan = _Plan(todo, holders, owners, source, moved, local=sorted(set(self.pending) - set(todo)))
        if moved:
            send = [(owners[k], self._update(todo[k]).to(self.dtype)) for k in moved if source[k] == self.rank]
            recv = [(source[k], self.shapes[todo[k]]) for k in moved if owners[k] == self.rank]
            plan.inputs, plan.work = self._exchange(send, recv, async_op=True)
        self._plan = plan
        self.resolve_s = time.perf_counter() - started

    @torch.no_grad()
    def resolve(self) -> None:
        """Orthogonalize the pending matrices this rank owns, send the results to their holders and
        apply what is held here (a collective over all workers when a result has to travel)."""
        plan, self._plan = self._plan, None
        if plan is None:  # the final STEP stepped nothing through step() (no Muon matrix anywhere)
            return
        started = time.perf_counter()
        todo, holders, owners, source, moved = plan.todo, plan.holders, plan.owners, plan.source, plan.moved
        me = self.rank
        results: dict[int, Tensor] = {}  # k -> orthogonalized update (owned here)
        for k in range(len(todo)):
            if owners[k] == me and source[k] == me:  # ours first, while the moved updates travel
                results[k] = self._orthogonalize(todo[k], self._update(todo[k]))
        if plan.work is not None:
            plan.work.wait()
            for k, x in zip([k for k in moved if owners[k] == me], plan.inputs()):
                results[k] = self._orthogonalize(todo[k], x)
        got: dict[int, Tensor] = {todo[k]: x for k, x in results.items() if me in holders[k]}
        back = [k for k in range(len(todo)) if any(r != owners[k] for r in holders[k])]
        if back:  # results to every holder that is not the owner
            send = [(r, results[k]) for k in back if owners[k] == me for r in holders[k] if r != me]
            mine = [k for k in back if owners[k] != me and me in holders[k]]
            outputs, _ = self._exchange(send, [(owners[k], self.shapes[todo[k]]) for k in mine])
            got.update(zip([todo[k] for k in mine], outputs()))
        for i in plan.local:  # pending here but not in the plan: orthogonalized by its holder
            got[i] = self._orthogonalize(i, self._update(i))
        self.ns_runs = sum(o == me for o in owners) + len(plan.local)
        self.received = sum(owners[k] == me for k in moved)
        for i, ortho in got.items():
            for p, _, group in self.pending[i]:
                Muon.apply(p, ortho, group)
        self.pending.clear()
        self.resolve_s += time.perf_counter() - started

    def _update(self, i: int) -> Tensor:
        """This rank's momentum update of matrix ``i`` (replicas on one worker hold equal ones)."""
        return self.pending[i][0][1]

    def _orthogonalize(self, i: int, update: Tensor) -> Tensor:
        group = self.pending[i][0][2] if i in self.pending else self.muon.param_groups[0]
        start = time.perf_counter()
        ortho = self.muon.orthogonalize(update, group)
        self.ns_s += time.perf_counter() - start
        return ortho

    def _exchange(self, send: list[tuple[int, Tensor]], recv: list[tuple[int, tuple[int, ...]]],
                  async_op: bool = False) -> tuple[Callable[[], list[Tensor]], dist.Work | None]:
        """One ``all_to_all_single``: ``send`` (destination, tensor) in order, ``recv`` (source, shape)
        in the order the sources send them (matrix order on both sides), in the NS precision.

        Returns:
            ``(tensors, work)``: ``tensors()`` gives the received tensors in ``recv``'s order once
            ``work`` (None unless ``async_op``) is done.
        """
        send_splits = [sum(t.numel() for d, t in send if d == r) for r in range(self.world)]
        recv_splits = [sum(math.prod(s) for src, s in recv if src == r) for r in range(self.world)]
        flat = [t.reshape(-1) for r in range(self.world) for d, t in send if d == r]
        buffer = torch.cat(flat) if flat else torch.empty(0, dtype=self.dtype, device=self.device)
        received = torch.empty(sum(recv_splits), dtype=self.dtype, device=self.device)
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


@dataclass
class _Plan:
    """One final STEP's owners (:meth:`NsSpread.start`), indexed k over the pending matrices ``todo``."""

    todo: list[int]  # matrix indices
    holders: list[list[int]]
    owners: list[int]
    source: list[int]  # who sends the update of a moved matrix (its lowest holder)
    moved: list[int]  # k of the matrices whose owner does not hold them
    local: list[int]  # matrices pending here outside the plan
    inputs: Callable[[], list[Tensor]] | None = None
    work: dist.Work | None = None


@contextlib.contextmanager
def only_grads(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> Iterator[None]:
    """While active, only ``params`` of ``optimizer`` have a ``.grad``: its step updates them alone
    (every optimizer here skips a parameter without a gradient)."""
    keep = {id(p) for p in params}
    hidden = [(p, p.grad) for g in optimizer.param_groups for p in g["params"]
              if p.grad is not None and id(p) not in keep]
    for p, _ in hidden:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in hidden:
            p.grad = grad
