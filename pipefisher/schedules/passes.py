"""Pure passes that turn a compute-only schedule into an executable one.

Why one module: the passes run in one documented order and share the rendezvous legalizer
(:class:`_Legalizer`) that orders their floating actions, so the ordering note below and the code it explains
stay together.

Chained by :func:`pipefisher.schedules.build_schedule` in this order::

    generator (F, B)  ──►  add_communication (SEND_*/RECV_*)  ──►  add_grad_sync_and_step

and, with ``optimizer_placement=per_stage``, after any K-FAC work has been assigned::

    ──►  per_stage_steps (one STEP per stage replica, in the bubble after its gradients are final)

Each pass takes a :class:`Schedule` and returns a new one; none mutates its input.

[Note: ordering point-to-point messages]
A RECV goes just before the compute that consumes it and a SEND just after the compute that
produces it, so between two computes of a worker there is a *cluster* of sends (of the earlier
compute) and receives (for the later one). Their order inside a cluster is free, but not every
order is safe when a send blocks until its receiver is there (rendezvous). 1F1B, D=2, N=2::

    W0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 ...     W0 blocks in SEND_F1 ...
    W1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 ...     ... W1 blocks in SEND_B0: deadlock

Swapping W1's cluster to ``1RECV_F1<0 1SEND_B0>0`` resolves it. Both passes therefore order the
floating actions (SEND, RECV, SYNC_GRAD) by a rendezvous execution of the whole schedule in which
each compute takes one time unit and the earliest completable pair (a send and its receive, both
pending) or collective (every member at its SYNC_GRAD of the stage) completes first; ties go to
messages before collectives, then by worker. When nothing can complete, the receive of the
earliest blocked send is *posted early*: moved from the cluster before its consumer into the
receiver's current cluster. Interleaved 1F1B needs this (Megatron-LM posts such receives early
for the same reason: ``send_backward_recv_backward``)::

    D=2, v=2, N=4 (W0 holds stages 0 and 2, W1 stages 1 and 3)
    W0: .. 2B0 2SEND_B0>1 0F3 .. 2RECV_B1<1 2B1        W0 waits for W1 to take B0 ...
    W1: .. 3B1 3SEND_B1>0 1F2 .. 1RECV_B0<0 1B0        ... W1 waits for W0 to take B1
    fix: W1 posts 1RECV_B0<0 before 3SEND_B1>0

The order of completions *is* a blocking execution that finishes, so the result cannot deadlock
under rendezvous semantics and blocking collectives; :func:`pipefisher.schedules.checks.
check_schedule` verifies it independently. If the compute order itself cannot complete (a
dependency cycle), the rest keeps its natural order and the checker reports the deadlock.

[Note: hoisting the nearest receive]
A hoisted receive is a wait placed earlier in the receiver's list; the executor and the simulator
wait there, so with real costs (B ≈ 2F, not the unit times above) it can stall the receiver. Chimera
with forward doubling sends forwards of both pipes in pairs and stalls the rendezvous execution
often: taking the earliest blocked send (``hoist="earliest_send"``) leaves its built schedule at a
simulated bubble of 0.14 (D=4, N=8) and 0.20 (D=8, N=32) for B = 2F, its compute order's 0.111 and
0.086; hoisting the receive with the fewest computes before its consumer
(``hoist="nearest_consumer"``) keeps 0.111 and 0.086. ``build_schedule`` picks the policy per
method (``generators.HOIST_POLICY``); the others keep ``earliest_send``, so their lists stay
as measured (issue 26).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from pipefisher.schedules.ir import Action, ActionKind, Placement, Schedule

__all__ = [
    "HOIST_POLICIES",
    "add_communication",
    "add_grad_sync_and_step",
    "per_stage_steps",
    "stage_step_bounds",
    "worker_dp_groups",
    "matching_recv",
    "matching_send",
]

K = ActionKind
HOIST_POLICIES = ("earliest_send", "nearest_consumer")  # [Note: hoisting the nearest receive]


def worker_dp_groups(placement: Placement) -> dict[int, int]:
    """``{worker: dp group}``; a worker belongs to exactly one data-parallel group."""
    return {w: dp for (dp, _, _), w in placement.workers.items()}


def matching_recv(send: Action, sender: int) -> Action:
    """The receive that pairs with ``send`` issued on worker ``sender``.

    ``SEND_F`` of stage s pairs with ``RECV_F`` of stage s+1; ``SEND_B`` of stage s with
    ``RECV_B`` of stage s−1 (same micro-batch and pipe).
    """
    if send.kind == K.SEND_F:
        return Action(K.RECV_F, send.stage + 1, send.micro_batch, send.pipe, sender)
    if send.kind == K.SEND_B:
        return Action(K.RECV_B, send.stage - 1, send.micro_batch, send.pipe, sender)
    raise ValueError(f"{send} is not a send")


def matching_send(recv: Action, receiver: int) -> Action:
    """The send that pairs with ``recv`` posted on worker ``receiver`` (inverse of ``matching_recv``)."""
    if recv.kind == K.RECV_F:
        return Action(K.SEND_F, recv.stage - 1, recv.micro_batch, recv.pipe, receiver)
    if recv.kind == K.RECV_B:
        return Action(K.SEND_B, recv.stage + 1, recv.micro_batch, recv.pipe, receiver)
    raise ValueError(f"{recv} is not a receive")


def _comm_around(action: Action, worker: int, dp: int,
                 schedule: Schedule) -> tuple[list[Action], list[Action]]:
    """(receives before, sends after) a compute action; none between co-located stages."""
    if not action.kind.is_compute:
        return [], []
    s, j, p = action.stage, action.micro_batch, action.pipe
    last = schedule.num_stages - 1
    where = schedule.placement.workers
    before: list[Action] = []
    after: list[Action] = []
    if action.kind == K.FORWARD:
        if s > 0 and (up := where[(dp, p, s - 1)]) != worker:
            before.append(Action(K.RECV_F, s, j, p, up))
        if s < last and (down := where[(dp, p, s + 1)]) != worker:
            after.append(Action(K.SEND_F, s, j, p, down))
    elif action.kind.is_input_backward:  # B or I; a deferred W exchanges nothing
        if s < last and (down := where[(dp, p, s + 1)]) != worker:
            before.append(Action(K.RECV_B, s, j, p, down))
        if s > 0 and (up := where[(dp, p, s - 1)]) != worker:
            after.append(Action(K.SEND_B, s, j, p, up))
    return before, after


Segments = dict[int, tuple[list[Action], list[list[Action]]]]
"""Per worker: its *anchors* (computes and STEP) and the n+1 *clusters* of floating actions
(SEND/RECV/SYNC_GRAD) before, between and after them, each in its natural order."""


def _is_floating(a: Action) -> bool:
    return a.kind.is_comm or a.kind == K.SYNC_GRAD


def _split(actions: Iterable[Action]) -> tuple[list[Action], list[list[Action]]]:
    anchors: list[Action] = []
    clusters: list[list[Action]] = [[]]
    for a in actions:
        if _is_floating(a):
            clusters[-1].append(a)
        else:
            anchors.append(a)
            clusters.append([])
    return anchors, clusters


def _join(anchors: list[Action], clusters: list[list[Action]]) -> tuple[Action, ...]:
    out = list(clusters[0])
    for a, cluster in zip(anchors, clusters[1:]):
        out.append(a)
        out.extend(cluster)
    return tuple(out)


class _Legalizer:
    """Orders every cluster by a rendezvous execution; see [Note: ordering point-to-point messages]."""

    def __init__(self, schedule: Schedule, segments: Segments, hoist: str = "earliest_send") -> None:
        if hoist not in HOIST_POLICIES:
            raise ValueError(f"hoist={hoist!r}: choose one of {', '.join(HOIST_POLICIES)}")
        self.hoist = hoist
        self.anchors = {w: anchors for w, (anchors, _) in segments.items()}
        self.clusters = {w: [list(c) for c in clusters] for w, (_, clusters) in segments.items()}
        self.members = {s: schedule.placement.replicas_of_stage(s) for s in range(schedule.num_stages)}
        self.workers = sorted(segments)
        self.out: dict[int, list[Action]] = {w: [] for w in self.workers}
        self.pos = {w: 0 for w in self.workers}  # current cluster index (== index of next anchor)
        self.clock = {w: 0 for w in self.workers}
        self.pending = {w: self.clusters[w][0] for w in self.workers}
        # (time, 0 = message / 1 = collective, worker, index in its cluster, tie counter, action)
        self.heap: list[tuple[int, int, int, int, int, Action]] = []
        self._tie = itertools.count()
        for w in self.workers:
            self._queue_ready(w)

    # -- readiness --------------------------------------------------------------------------

    def _sync_ready(self, stage: int) -> bool:
        return all(any(x.kind == K.SYNC_GRAD and x.stage == stage for x in self.pending[m])
                   for m in self.members[stage])

    def _queue_ready(self, w: int) -> None:
        """Queue every pair or collective that w's pending actions can complete now."""
        for i, a in enumerate(self.pending[w]):
            if a.kind in (K.SEND_F, K.SEND_B):
                sender, send = w, a
            elif a.kind in (K.RECV_F, K.RECV_B):
                sender, send = a.peer, matching_send(a, w)
            else:
                if self._sync_ready(a.stage):
                    t = max(self.clock[m] for m in self.members[a.stage])
                    heapq.heappush(self.heap, (t, 1, w, i, next(self._tie), a))
                continue
            if send in self.pending[sender] and matching_recv(send, sender) in self.pending[send.peer]:
                t = max(self.clock[sender], self.clock[send.peer])
                i_send = self.pending[sender].index(send)
                heapq.heappush(self.heap, (t, 0, sender, i_send, next(self._tie), send))

    # -- execution --------------------------------------------------------------------------

    def _advance(self, w: int) -> None:
        """Run w's anchors while its current cluster is empty."""
        anchors = self.anchors[w]
        while not self.pending[w] and self.pos[w] < len(anchors):
            a = anchors[self.pos[w]]
            self.out[w].append(a)
            self.clock[w] += 1 if a.kind.is_compute else 0
            self.pos[w] += 1
            self.pending[w] = self.clusters[w][self.pos[w]]
            self._queue_ready(w)

    def _fire(self, t: int, a: Action, w: int) -> list[int]:
        """Complete the pair (a is the send, w its sender) or collective (a a SYNC_GRAD)."""
        if a.kind == K.SYNC_GRAD:
            if not self._sync_ready(a.stage):
                return []
            involved = self.members[a.stage]
            done = [next(x for x in self.pending[m] if x.kind == K.SYNC_GRAD and x.stage == a.stage)
                    for m in involved]
        else:
            recv = matching_recv(a, w)
            if a not in self.pending[w] or recv not in self.pending[a.peer]:
                return []
            involved, done = [w, a.peer], [a, recv]
        now = max([t] + [self.clock[m] for m in involved])
        if now > t:  # a member got busier since this entry was queued: requeue at the true time
            kind = 1 if a.kind == K.SYNC_GRAD else 0
            heapq.heappush(self.heap, (now, kind, w, 0, next(self._tie), a))
            return []
        for m, x in zip(involved, done):
            self.pending[m].remove(x)
            self.out[m].append(x)
            self.clock[m] = now
        return involved

    def _hoist_one_receive(self) -> bool:
        """Break a stall: post one blocked send's receive early (see the Note). ``earliest_send``
        takes the earliest blocked send; ``nearest_consumer`` the receive with the fewest computes
        before its consumer, which moves a wait the least (see [Note: hoisting the nearest receive])."""
        blocked = []
        for w in self.workers:
            for i, a in enumerate(self.pending[w]):
                if a.kind not in (K.SEND_F, K.SEND_B):
                    continue
                b, recv = a.peer, matching_recv(a, w)
                k = next((k for k in range(self.pos[b] + 1, len(self.clusters[b])) if recv in self.clusters[b][k]), None)
                if k is not None:
                    ahead = k - self.pos[b] if self.hoist == "nearest_consumer" else 0
                    blocked.append((ahead, self.clock[w], w, i, b, k, recv))
        if not blocked:
            return False
        *_, b, k, recv = min(blocked, key=lambda x: x[:4])
        self.clusters[b][k].remove(recv)
        self.pending[b].append(recv)
        self._queue_ready(b)
        return True

    def run(self) -> dict[int, tuple[Action, ...]]:
        todo = list(self.workers)
        while True:
            while todo:
                self._advance(todo.pop())
            if self.heap:
                t, _, w, _, _, a = heapq.heappop(self.heap)
                todo.extend(self._fire(t, a, w))
                continue
            if all(not self.pending[w] and self.pos[w] == len(self.anchors[w]) for w in self.workers):
                break
            if not self._hoist_one_receive():
                break  # the compute order itself cannot complete: keep the rest as it is
        for w in self.workers:
            p = self.pos[w]
            rest = _join(self.anchors[w][p:], [self.pending[w]] + self.clusters[w][p + 1:])
            self.out[w].extend(rest)
        return {w: tuple(self.out[w]) for w in self.workers}


def add_communication(schedule: Schedule, hoist: str = "earliest_send") -> Schedule:
    """Insert the point-to-point messages of every stage boundary that crosses workers.

    ``RECV_F`` (from the worker of stage s−1, same dp group and pipe) goes before each F of stage
    s > 0 and ``SEND_F`` (to stage s+1's worker) after each F of stage s < D−1; ``RECV_B`` goes
    before each B of stage s < D−1 and ``SEND_B`` after each B of stage s > 0. Stages on the same
    worker exchange nothing. The order is then made safe under blocking (rendezvous) semantics;
    see [Note: ordering point-to-point messages].

    Args:
        schedule: a schedule without SEND/RECV actions (generator output; SYNC_GRAD/STEP allowed).
        hoist: which receive to post early when the rendezvous execution stalls, one of
            ``HOIST_POLICIES`` ([Note: hoisting the nearest receive]).

    Returns:
        A new schedule with the same computes in the same order, plus communication.

    Raises:
        ValueError: the schedule already holds communication actions.
    """
    dp_of = worker_dp_groups(schedule.placement)
    segments: Segments = {}
    for w, actions in schedule.actions.items():
        anchors: list[Action] = []
        clusters: list[list[Action]] = [[]]
        for a in actions:
            if a.kind.is_comm:
                raise ValueError(f"worker {w} already has {a}: add_communication expects a "
                                 f"schedule without SEND/RECV actions (run it once, on generator output)")
            if a.kind == K.SYNC_GRAD:
                clusters[-1].append(a)
                continue
            before, after = _comm_around(a, w, dp_of[w], schedule)
            clusters[-1].extend(before)
            anchors.append(a)
            clusters.append(after)
        segments[w] = (anchors, clusters)
    return replace(schedule, actions=_Legalizer(schedule, segments, hoist).run())


def _insert_syncs(anchors: list[Action], clusters: list[list[Action]]) -> set[tuple[int, int]]:
    """Put a SYNC_GRAD after the last B or W of each (stage, pipe) (the replica's gradients are
    complete then), after that B's own SEND_B."""
    last_b: dict[tuple[int, int], int] = {}
    for i, a in enumerate(anchors):
        if a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
            last_b[(a.stage, a.pipe)] = i
    for (stage, pipe), i in last_b.items():
        b = anchors[i]
        cluster = clusters[i + 1]
        at = 0
        for k, x in enumerate(cluster):
            if (x.kind == K.SEND_B and x.stage == b.stage and x.micro_batch == b.micro_batch
                    and x.pipe == b.pipe):
                at = k + 1
        cluster.insert(at, Action(K.SYNC_GRAD, stage, None, pipe))
    return set(last_b)


def add_grad_sync_and_step(schedule: Schedule, hoist: str = "earliest_send") -> Schedule:
    """Insert one ``SYNC_GRAD(stage, pipe)`` per stage replica and one ``STEP`` per worker.

    The SYNC_GRAD of a replica goes right after its last B or W (after that B's ``SEND_B`` when
    there is one), so a replica that finishes early starts its all-reduce early (DESIGN.md, "Schedules");
    STEP ends every worker's list. SYNC_GRAD is a collective over all replicas of the stage
    (Chimera twin and data-parallel copies); it is placed among the messages around it by the same
    rendezvous execution as ``add_communication`` (a collective completes when every member is
    at it), so members issue shared collectives in one relative order and nothing deadlocks
    under blocking semantics. Chimera positions r and D−1−r both finish stage D−1−r at slot
    2D+r−2 and stage r at slot 3D−3−r, so their two all-reduces line up.

    Args:
        schedule: a schedule without SYNC_GRAD or STEP actions (with or without communication).
        hoist: as for :func:`add_communication`.

    Returns:
        A new schedule with the synchronizations and steps added.

    Raises:
        ValueError: the schedule already has SYNC_GRAD/STEP, or a worker holds a replica it never
            runs a backward for.
    """
    segments: Segments = {}
    for w in sorted(schedule.actions):
        for a in schedule.actions[w]:
            if a.kind in (K.SYNC_GRAD, K.STEP):
                raise ValueError(f"worker {w} already has {a}: add_grad_sync_and_step runs once")
        anchors, clusters = _split(schedule.actions[w])
        synced = _insert_syncs(anchors, clusters)
        held = {(s, p) for (_, p, s) in schedule.placement.stages_of(w)}
        if held - synced:
            missing = ", ".join(f"stage {s} pipe {p}" for s, p in sorted(held - synced))
            raise ValueError(f"worker {w} holds {missing} but runs no backward for it")
        anchors.append(Action(K.STEP))
        clusters.append([])
        segments[w] = (anchors, clusters)
    return replace(schedule, actions=_Legalizer(schedule, segments, hoist).run())


def per_stage_steps(schedule: Schedule, positions: StepPositions | None = None, *,
                    exchanges: bool = False) -> Schedule:
    """Give every stage replica its own optimizer step once its gradients are final.

    [Note: per-stage optimizer steps]
    ``add_grad_sync_and_step`` ends each worker's list with one ``STEP`` that updates every stage
    the worker holds after a global barrier (the gradient norm is all-reduced over all workers), so
    every worker waits for stage 0's last backward before it steps (issue 36). Here each replica
    (stage s, pipe p) gets ``STEP(s, p)`` (string form ``sSTEP@p``); a K-FAC run's ``PRECOND(s, p)``
    moves with it, to just before it. The stage-less ``STEP`` stays last: it finishes the step (the
    tied weight, which needs both ends of the pipeline; the global norm's check; the learning rate);
    ``runtime.stage_steps`` [Note: post-validation] says why the early steps equal the global one.

    Where: a stage STEP must follow every action of its replica (its last B or W, the SEND_B after
    it, its SYNC_GRAD, its K-FAC units). By default it goes after the worker's last compute, the
    messages and the SYNC_GRADs (a step must not hold back a SEND_B or an all-reduce), the replicas in the order of their SYNC_GRADs, so the replica whose all-reduce was
    issued first steps while the later all-reduces are in flight, and the worker steps without
    waiting for the other workers (the global norm is checked afterwards). Right after a replica's
    last action is not better without costs: the step waits there for the replica's all-reduce and
    delays the worker's later computes (interleaved D=2 in the simulator, F=1, B=2, step 0.7:
    29.1 units per step against 28.4). ``positions`` places them elsewhere: the planner's
    ``planning.step_placement.place_stage_steps`` searches them with a cost model. Moving PRECOND changes nothing it reads: it still follows every unit of its own
    replica (its INVERTs included), and other replicas' actions do not touch its gradients.

    1F1B, D=2, N=2 (computes and steps only; worker 1 holds the last stage)::

        W0: 0F0 0F1 0B0 0B1 0SYNC_GRAD 0STEP STEP
        W1: 1F0 1B0 1F1 1B1 1SYNC_GRAD 1STEP STEP      1STEP runs while W0 still runs 0B1

    Args:
        schedule: a complete schedule with one stage-less STEP last on every worker and no stage
            STEPs (``build_schedule`` output, or a phase of a K-FAC assignment).
        positions: per worker, replica (stage, pipe) → the index in the worker's list without its
            PRECONDs and final STEP after which the replica's STEP goes (at least its replica's last
            action, :func:`stage_step_bounds`); None: the rule above.
        exchanges: a PRECOND starts an exchange (all-gather) among its stage's replicas that their STEPs wait for
            (``optimizer.kfac_owners=replicas``, [Note: stage steps after the exchanges]): each worker's
            stage STEPs then follow all its PRECONDs.

    Returns:
        A new schedule with one STEP per stage replica; nothing else moves except PRECOND.

    Raises:
        ValueError: the schedule already has stage STEPs, a worker's list does not end in STEP, or
            a position comes before its replica's last action.
    """
    rests, firsts, slots = stage_step_bounds(schedule)
    for w, mine in (positions or {}).items():
        for r, i in mine.items():
            if not firsts[w][r] <= i < len(rests[w]):
                raise ValueError(f"STEP of stage {r[0]} pipe {r[1]} on worker {w} at {i}: it must follow its "
                                 f"replica's last action ({firsts[w][r]}) and precede the final STEP")
            slots[w][r] = i
    return _place_steps(schedule, rests, slots, exchanges)


StepPositions = dict[int, dict[tuple[int, int], int]]
"""Per worker: stage replica (stage, pipe) → index in the worker's list (without its PRECONDs and
final STEP) after which the replica's STEP goes."""


def stage_step_bounds(schedule: Schedule) -> tuple[dict[int, list[Action]], StepPositions, StepPositions]:
    """Per worker, for :func:`per_stage_steps`: its list without PRECONDs and the final STEP, the
    earliest position of each replica's STEP (after its last action) and the default one (also after
    the worker's last compute).

    Raises:
        ValueError: as :func:`per_stage_steps`.
    """
    rests: dict[int, list[Action]] = {}
    firsts: StepPositions = {}
    slots: StepPositions = {}
    for w, acts in schedule.actions.items():
        if not acts or acts[-1] != Action(K.STEP):
            raise ValueError(f"worker {w} does not end with STEP: per_stage_steps runs on a complete "
                             f"schedule (build_schedule output)")
        if any(a.kind == K.STEP and a.stage is not None for a in acts):
            raise ValueError(f"worker {w} already has per-stage STEPs: per_stage_steps runs once")
        rest = [a for a in acts[:-1] if a.kind != K.PRECOND]
        replicas = sorted({(s, p) for (_, p, s) in schedule.placement.stages_of(w)})
        last = {r: max((i for i, a in enumerate(rest) if (a.stage, a.pipe) == r), default=-1) for r in replicas}
        # after the last compute, the messages and the all-reduces it starts: a step must not hold
        # back a SEND_B, and the first replica's step then overlaps the later ones' all-reduces
        last_work = max((i for i, a in enumerate(rest) if a.kind.is_compute or a.kind.is_comm
                         or a.kind == K.SYNC_GRAD), default=-1)
        rests[w], firsts[w] = rest, last
        slots[w] = {r: max(i, last_work) for r, i in last.items()}
    return rests, firsts, slots


def _place_steps(schedule: Schedule, rests: dict[int, list[Action]],
                 slots: dict[int, dict[tuple[int, int], int]], exchanges: bool = False) -> Schedule:
    """``schedule`` with [PRECOND(s, p)], STEP(s, p) after index ``slots[w][(s, p)]`` of each worker's
    list without its PRECONDs and final STEP (``rests[w]``); replicas at one index in SYNC_GRAD order.

    [Note: stage steps after the exchanges]
    With ``exchanges`` (``optimizer.kfac_owners=replicas``) a replica's PRECOND starts the all-gather that
    brings it the gradients its owners preconditioned, and its STEP waits for that all-gather, i.e. for
    the PRECOND of every replica of the stage. A STEP placed before a later PRECOND of its own worker can
    then close a cycle: Chimera D=2, worker 0 ``1PRECOND@1 1STEP@1 0PRECOND`` and worker 1 ``0PRECOND@1
    0STEP@1 1PRECOND`` (K-FAC units of stage 1 later on worker 1 hold its step back) wait for each other
    for ever (seen: PipeFisher's plan of ``tests/test_kfac_owners.py``, a hang until gloo's timeout). So
    every stage STEP goes no earlier than the worker's last PRECOND (PRECONDs first at one index): a STEP
    then waits only for PRECONDs that need no STEP, and ``check_schedule(exchanges=True)`` proves the
    rest (every K-FAC unit's own rules, no deadlock)."""
    actions: dict[int, tuple[Action, ...]] = {}
    for w, acts in schedule.actions.items():
        preconds = {(a.stage, a.pipe) for a in acts if a.kind == K.PRECOND}
        rest = rests[w]
        order = {(a.stage, a.pipe): i for i, a in enumerate(rest) if a.kind == K.SYNC_GRAD}
        last_precond = max((slots[w][r] for r in preconds), default=-1) if exchanges else -1
        before: dict[int, list[Action]] = defaultdict(list)  # with exchanges: PRECONDs before the STEPs of an index
        after: dict[int, list[Action]] = defaultdict(list)
        for r in sorted(slots[w], key=lambda r: (slots[w][r], order.get(r, -1))):
            s, p = r
            if r in preconds:  # without exchanges, each PRECOND right before its own STEP
                (before if exchanges else after)[slots[w][r]].append(Action(K.PRECOND, s, None, p))
            after[max(slots[w][r], last_precond)].append(Action(K.STEP, s, None, p))
        out = before.get(-1, []) + after.get(-1, [])
        for i, a in enumerate(rest):
            out.append(a)
            out.extend(before.get(i, []) + after.get(i, []))
        out.append(acts[-1])
        actions[w] = tuple(out)
    return replace(schedule, actions=actions)
