"""Static checks of a schedule: coverage, dependencies, message matching, collectives, deadlock.

Why one module: the checks are the parts of one function, :func:`check_schedule`, run in a fixed order and
failing through one :class:`ScheduleError` with the marked step × worker grid; each is short and pure, and
together they are the schedule's specification.

:func:`check_schedule` raises :class:`ScheduleError` with the step × worker grid
(``Schedule.format_grid``) and the failing cell bracketed, e.g.::

    B0 of stage 1 (pipe 0) on worker 1 runs before its own forward
    step W0     W1
       0 0F0    [1B0]
       1 0B0    1F0

[Note: deadlock semantics]
The deadlock check executes the lists abstractly under the strictest semantics the executor may
face: a SEND completes only together with its matching RECV on the peer (rendezvous), and a
SYNC_GRAD only when every replica of its stage is at its SYNC_GRAD of that stage (a blocking
collective). A schedule that completes this way also completes with buffered sends and
asynchronous all-reduces, which is what the executor and the simulator use. Computes never wait
in a schedule with communication: their inputs are carried by RECVs, which the checks require.
A compute-only schedule (generator output) is executed with its data dependencies instead: an F
waits for the upstream F, a B for the downstream B. ``SYNC_FACTOR`` (K-FAC) is a blocking
collective like ``SYNC_GRAD``, over the same members, matched by (stage, layer); the other K-FAC
units are local work and never wait.

[Note: K-FAC rules of one step]
For a schedule with K-FAC work (``pipefisher.schedules.kfac``; the rules over a whole refresh
cycle are in :func:`pipefisher.schedules.kfac.check_assignment`): a K-FAC unit sits on a worker
holding its stage replica; ``CURV_A`` of (stage, micro-batch, pipe) comes after that forward on
the same worker and ``CURV_B`` after that backward; no unit appears twice and a kind does not mix
the all-layers form (no ``#layer``) with per-layer units of the same replica; a ``SYNC_FACTOR``
comes after every curvature unit of its layer in the step and is issued by every replica of the
stage; an ``INVERT`` comes after the ``SYNC_FACTOR`` of its layer when the step has one;
``PRECOND`` (whole replica, no layer) exactly once per stage replica, after the replica's
``SYNC_GRAD``; every K-FAC unit before ``STEP`` (and a replica's own units before its stage
``STEP`` under per-stage steps, ``passes.per_stage_steps``). Workers sharing collectives issue them all
(gradient and factor all-reduces) in one relative order.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from typing import NoReturn

from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.passes import matching_recv, worker_dp_groups

__all__ = ["ScheduleError", "check_schedule", "stuck_positions"]

K = ActionKind
_SENDS = (K.SEND_F, K.SEND_B)
_RECVS = (K.RECV_F, K.RECV_B)
_COLLECTIVES = (K.SYNC_GRAD, K.SYNC_FACTOR)
_LOCAL_KFAC = (K.CURV_A, K.CURV_B, K.INVERT, K.PRECOND)
_NO_MICRO_BATCH = (K.SYNC_GRAD, K.SYNC_FACTOR, K.INVERT, K.PRECOND, K.STEP)


class ScheduleError(ValueError):
    """A schedule that is incomplete, inconsistent or would deadlock; the message shows the grid."""


def _fail(schedule: Schedule, message: str, mark: tuple[int, int] | None = None) -> NoReturn:
    raise ScheduleError(f"{schedule.method} schedule (D={schedule.num_stages}, "
                        f"N={schedule.num_micro_batches}): {message}\n{schedule.format_grid(mark=mark)}")


def check_schedule(schedule: Schedule, *, complete: bool = True, kfac: bool | None = None,
                   forward_only: bool = False, max_activations: Mapping[int, int] | None = None,
                   exchanges: bool = False) -> None:
    """Check that ``schedule`` is well formed and runs to completion.

    Checks, in order: every action sits on a worker holding its stage replica (right pipe, right
    peer); every micro-batch gets exactly one F and either one B or one I and one W (split
    backward) per stage replica; on a worker, B or I comes after its own F, W after its own I, and
    co-located stages keep data order; every cross-worker dependency is
    carried by a SEND after the producer and a RECV before the consumer, each SEND matching exactly
    one RECV on its peer (a split backward's I carries the B's messages; its W none); exactly one SYNC_GRAD per stage replica (after its last B), issued in the
    same relative order by workers that share collectives, and one STEP per worker after all its
    work (with per-stage steps also one stage STEP per replica after that replica's work); the K-FAC rules of [Note: K-FAC rules of one step]; no deadlock (see
    [Note: deadlock semantics]).

    Args:
        schedule: the schedule to check.
        complete: require communication, SYNC_GRAD and STEP (an executable schedule). With False,
            a compute-only schedule passes; whatever communication or synchronization it has is
            still checked.
        kfac: require one PRECOND per stage replica (a step of a K-FAC run). None: require it
            when the schedule has any K-FAC unit; False: never require it (K-FAC units present
            are still checked).
        forward_only: check an evaluation schedule (``pipefisher.schedules.evaluation``)
            instead: exactly one F per micro-batch per stage replica and nothing but F, SEND_F
            and RECV_F (no backward, weight gradient, SYNC_GRAD, STEP or K-FAC unit);
            placement, local order, forward messages (required when ``complete``) and no
            deadlock as above.
        max_activations: per worker, the most micro-batch activations it may hold at once
            (counted from F to B or W, every replica it holds, as ``simulate.peak_activations``);
            e.g. ``chimera_doubling_peaks(D)``, a memory model's bound. None: no bound.
        exchanges: a PRECOND starts an exchange (all-gather) over its stage's replicas (``optimizer.kfac_owners=
            replicas``) and a STEP waits until every replica of its stages has issued its PRECOND (a
            stage STEP its own stage's, the final STEP all the worker holds): the deadlock check runs
            with these waits ([Note: stage steps after the exchanges] in ``schedules.passes``).

    Raises:
        ScheduleError: the first violation found; the message includes the grid with the failing
            cell marked.
        ValueError: ``forward_only`` together with ``kfac=True``.
    """
    if forward_only:
        if kfac:
            raise ValueError("check_schedule: kfac=True contradicts forward_only=True "
                             "(a forward-only schedule has no K-FAC units)")
        _check_forward_only_kinds(schedule)
        _check_placement(schedule)
        _check_coverage(schedule, forward_only=True)
        _check_local_order(schedule)
        has_comm = any(a.kind.is_comm for acts in schedule.actions.values() for a in acts)
        if has_comm or complete:
            _check_communication(schedule)
        _check_no_deadlock(schedule, data_dependencies=not has_comm)
        return
    _check_placement(schedule)
    _check_coverage(schedule)
    _check_local_order(schedule)
    if max_activations is not None:
        _check_activations(schedule, max_activations)
    has_comm = any(a.kind.is_comm for acts in schedule.actions.values() for a in acts)
    if has_comm or complete:
        _check_communication(schedule)
    has_sync = any(a.kind in (K.SYNC_GRAD, K.STEP) for acts in schedule.actions.values() for a in acts)
    if has_sync or complete:
        _check_sync_and_step(schedule)
    has_kfac = any(a.kind.is_kfac for acts in schedule.actions.values() for a in acts)
    if has_kfac or kfac:
        _check_kfac(schedule, require_precond=has_kfac if kfac is None else kfac)
    if has_sync or has_kfac or complete:
        _check_collective_order(schedule)
    _check_no_deadlock(schedule, data_dependencies=not has_comm, exchanges=exchanges)


# -- placement ---------------------------------------------------------------------------------


def _neighbor(schedule: Schedule, dp: int, a: Action) -> int | None:
    """The worker a communication action must name as its peer, or None if there is none."""
    other = a.stage + (1 if a.kind in (K.SEND_F, K.RECV_B) else -1)
    return schedule.placement.workers.get((dp, a.pipe, other))


def _check_placement(schedule: Schedule) -> None:
    placed = set(schedule.placement.workers.values())
    if set(schedule.actions) != placed:
        _fail(schedule, f"workers with actions {sorted(schedule.actions)} differ from the workers "
                        f"of the placement {sorted(placed)}")
    if len(schedule.pipe_of_micro_batch) != schedule.num_micro_batches:
        _fail(schedule, f"pipe_of_micro_batch has {len(schedule.pipe_of_micro_batch)} entries for "
                        f"N={schedule.num_micro_batches} micro-batches")
    dp_of = worker_dp_groups(schedule.placement)
    where = schedule.placement.workers
    for w, actions in schedule.actions.items():
        dp = dp_of[w]
        for i, a in enumerate(actions):
            if a.kind == K.STEP and a.stage is None:  # the worker's final step
                if a.micro_batch is not None or a.pipe:
                    _fail(schedule, f"STEP on worker {w} takes no micro-batch or pipe", (w, i))
                continue
            if a.stage is None or not 0 <= a.stage < schedule.num_stages:
                _fail(schedule, f"{a} on worker {w}: stage out of range [0, {schedule.num_stages})", (w, i))
            if where.get((dp, a.pipe, a.stage)) != w:
                _fail(schedule, f"{a} on worker {w}: the worker does not hold stage {a.stage} of "
                                f"pipe {a.pipe} (data-parallel group {dp})", (w, i))
            if a.kind in _NO_MICRO_BATCH:
                if a.micro_batch is not None:
                    _fail(schedule, f"{a} on worker {w}: {a.kind} takes no micro-batch", (w, i))
                continue
            if not 0 <= a.micro_batch < schedule.num_micro_batches:
                _fail(schedule, f"{a} on worker {w}: micro-batch out of range "
                                f"[0, {schedule.num_micro_batches})", (w, i))
            if a.pipe != schedule.pipe_of_micro_batch[a.micro_batch]:
                _fail(schedule, f"{a} on worker {w}: micro-batch {a.micro_batch} travels on pipe "
                                f"{schedule.pipe_of_micro_batch[a.micro_batch]}", (w, i))
            if a.kind.is_comm:
                expected = _neighbor(schedule, dp, a)
                if expected is None:
                    _fail(schedule, f"{a} on worker {w}: stage {a.stage} has no neighbor in that "
                                    f"direction", (w, i))
                if a.peer != expected:
                    _fail(schedule, f"{a} on worker {w}: the peer must be worker {expected}", (w, i))


# -- coverage and local order ------------------------------------------------------------------


def _compute_positions(schedule: Schedule) -> dict[tuple[int, Action], list[int]]:
    pos: dict[tuple[int, Action], list[int]] = defaultdict(list)
    for w, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if a.kind.is_compute:
                pos[(w, a)].append(i)
    return pos


def _check_coverage(schedule: Schedule, forward_only: bool = False) -> None:
    """One F per micro-batch per stage replica, and (unless ``forward_only``) one B or one I + W."""
    rule = ("a forward-only schedule runs exactly one F per micro-batch per stage replica" if forward_only
            else "each micro-batch gets exactly one F and one B (or one I and one W) per stage replica")
    pos = _compute_positions(schedule)
    for (w, a), where in pos.items():
        if len(where) > 1:
            _fail(schedule, f"{a} appears {len(where)} times on worker {w}; {rule}", (w, where[1]))
    for dp in range(schedule.dp_width):
        for j, pipe in enumerate(schedule.pipe_of_micro_batch):
            for s in range(schedule.num_stages):
                w = schedule.placement.worker_of(dp, pipe, s)
                f, b = Action(K.FORWARD, s, j, pipe), Action(K.BACKWARD, s, j, pipe)
                i, wg = Action(K.BACKWARD_INPUT, s, j, pipe), Action(K.BACKWARD_WEIGHT, s, j, pipe)
                if (w, f) not in pos:
                    _fail(schedule, f"{f} is missing on worker {w} (data-parallel group {dp}); {rule}")
                if forward_only:
                    continue
                split = [x for x in (i, wg) if (w, x) in pos]
                if (w, b) in pos and split:
                    _fail(schedule, f"{b} and {split[0]} both on worker {w}: a micro-batch's backward "
                                    f"is either one B or a split I + W", (w, pos[(w, split[0])][0]))
                if (w, b) not in pos and len(split) < 2:
                    what = b if not split else (wg if split[0] == i else i)
                    _fail(schedule, f"{what} is missing on worker {w} (data-parallel group {dp}); {rule}",
                          (w, pos[(w, split[0])][0]) if split else None)


_FORWARD_ONLY_KINDS = (K.FORWARD, K.SEND_F, K.RECV_F)


def _check_activations(schedule: Schedule, limits: Mapping[int, int]) -> None:
    """No worker holds more micro-batch activations than ``limits[worker]`` (F adds one, B or W frees one)."""
    for w, acts in schedule.actions.items():
        held = 0
        for i, a in enumerate(acts):
            held += 1 if a.kind == K.FORWARD else -1 if a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT) else 0
            if w in limits and held > limits[w]:
                _fail(schedule, f"worker {w} holds {held} micro-batch activations at {a}, more than its bound "
                      f"{limits[w]}", (w, i))


def _check_forward_only_kinds(schedule: Schedule) -> None:
    for w, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if a.kind not in _FORWARD_ONLY_KINDS:
                what = ("a backward" if a.kind.is_compute else "a K-FAC unit" if a.kind.is_kfac
                        else "a backward message" if a.kind.is_comm else f"a {a.kind}")
                _fail(schedule, f"{a} on worker {w} is {what}; a forward-only schedule holds only "
                                f"F, SEND_F and RECV_F", (w, i))


def _input_backward_at(pos: dict[tuple[int, Action], int], w: int, s: int, j: int, p: int) -> int:
    """Position of the B or I of (stage s, micro-batch j, pipe p) on worker w (coverage holds)."""
    b = pos.get((w, Action(K.BACKWARD, s, j, p)))
    return b if b is not None else pos[(w, Action(K.BACKWARD_INPUT, s, j, p))]


def _check_local_order(schedule: Schedule) -> None:
    pos = {key: where[0] for key, where in _compute_positions(schedule).items()}
    where = schedule.placement.workers
    dp_of = worker_dp_groups(schedule.placement)
    last = schedule.num_stages - 1
    for (w, a), i in pos.items():
        s, j, p, dp = a.stage, a.micro_batch, a.pipe, dp_of[w]
        if a.kind == K.FORWARD:
            if s > 0 and where[(dp, p, s - 1)] == w and pos[(w, Action(K.FORWARD, s - 1, j, p))] > i:
                _fail(schedule, f"{a} on worker {w} runs before the forward of stage {s - 1} that "
                                f"feeds it (same worker)", (w, i))
        elif a.kind == K.BACKWARD_WEIGHT:
            if pos[(w, Action(K.BACKWARD_INPUT, s, j, p))] > i:
                _fail(schedule, f"{a} on worker {w} runs before its own I: the weight gradients need "
                                f"the output gradient that I computes", (w, i))
        else:
            if pos[(w, Action(K.FORWARD, s, j, p))] > i:
                _fail(schedule, f"{a} on worker {w} runs before its own forward", (w, i))
            if s < last and where[(dp, p, s + 1)] == w and _input_backward_at(pos, w, s + 1, j, p) > i:
                _fail(schedule, f"{a} on worker {w} runs before the backward of stage {s + 1} that "
                                f"feeds it (same worker)", (w, i))


# -- communication -----------------------------------------------------------------------------


def _required_comm(schedule: Schedule, w: int, dp: int, a: Action) -> list[tuple[Action, bool]]:
    """The messages a compute needs: (action, True if it must come before the compute)."""
    s, j, p = a.stage, a.micro_batch, a.pipe
    where = schedule.placement.workers
    last = schedule.num_stages - 1
    need = []
    if a.kind == K.FORWARD:
        if s > 0 and (u := where[(dp, p, s - 1)]) != w:
            need.append((Action(K.RECV_F, s, j, p, u), True))
        if s < last and (v := where[(dp, p, s + 1)]) != w:
            need.append((Action(K.SEND_F, s, j, p, v), False))
    elif a.kind.is_input_backward:  # B or I; W exchanges nothing
        if s < last and (v := where[(dp, p, s + 1)]) != w:
            need.append((Action(K.RECV_B, s, j, p, v), True))
        if s > 0 and (u := where[(dp, p, s - 1)]) != w:
            need.append((Action(K.SEND_B, s, j, p, u), False))
    return need


def _check_communication(schedule: Schedule) -> None:
    dp_of = worker_dp_groups(schedule.placement)
    comm_pos: dict[tuple[int, Action], int] = {}
    for w, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if not a.kind.is_comm:
                continue
            if (w, a) in comm_pos:
                _fail(schedule, f"{a} appears twice on worker {w}", (w, i))
            if a.peer == w:
                _fail(schedule, f"{a} on worker {w} sends to itself; co-located stages exchange "
                                f"nothing", (w, i))
            comm_pos[(w, a)] = i
    used: set[tuple[int, Action]] = set()
    for w, actions in schedule.actions.items():
        for i, a in enumerate(actions):
            if not a.kind.is_compute:
                continue
            for msg, before in _required_comm(schedule, w, dp_of[w], a):
                j = comm_pos.get((w, msg))
                if j is None:
                    _fail(schedule, f"{a} on worker {w} needs {msg} "
                                    f"{'before' if before else 'after'} it", (w, i))
                if (j < i) != before:
                    _fail(schedule, f"{msg} on worker {w} must come {'before' if before else 'after'} "
                                    f"{a}", (w, j))
                used.add((w, msg))
    for (w, a), i in sorted(comm_pos.items(), key=lambda kv: (kv[0][0], kv[1])):
        if (w, a) not in used:
            _fail(schedule, f"{a} on worker {w} belongs to no compute of this worker", (w, i))
        if a.kind in _SENDS and (a.peer, matching_recv(a, w)) not in comm_pos:
            _fail(schedule, f"{a} on worker {w} has no matching {matching_recv(a, w)} on worker "
                            f"{a.peer}", (w, i))
    # Every RECV is required by a compute whose producer is on the peer, and that producer's SEND
    # is required there too, so RECVs without a SEND were reported above as missing SENDs.


# -- gradient synchronization and step ---------------------------------------------------------


def _check_sync_and_step(schedule: Schedule) -> None:
    placement = schedule.placement
    per_stage = any(a.kind == K.STEP and a.stage is not None for acts in schedule.actions.values() for a in acts)
    for w, actions in schedule.actions.items():
        held = [(s, p) for (_, p, s) in placement.stages_of(w)]
        stages = Counter(s for s, _ in held)
        if any(c > 1 for c in stages.values()):
            _fail(schedule, f"worker {w} holds two replicas of one stage ({held}); one SYNC_GRAD "
                            f"collective per stage cannot tell them apart")
        syncs: dict[tuple[int, int], list[int]] = defaultdict(list)
        last_b: dict[tuple[int, int], int] = {}
        steps: list[int] = []
        stage_steps: dict[tuple[int, int], list[int]] = defaultdict(list)
        last_of: dict[tuple[int, int], int] = {}  # last non-STEP action of each replica
        last_work = -1
        for i, a in enumerate(actions):
            if a.stage is not None and a.kind != K.STEP:
                last_of[(a.stage, a.pipe)] = i
            if a.kind == K.STEP and a.stage is not None:
                stage_steps[(a.stage, a.pipe)].append(i)
                last_work = i
            elif a.kind == K.SYNC_GRAD:
                syncs[(a.stage, a.pipe)].append(i)
                last_work = i
            elif a.kind in (K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT):
                last_b[(a.stage, a.pipe)] = max(i, last_b.get((a.stage, a.pipe), -1))
                last_work = i
            elif a.kind == K.FORWARD or a.kind.is_kfac:
                last_work = i
            elif a.kind == K.STEP:
                steps.append(i)
        for s, p in held:
            where = syncs.get((s, p), [])
            if not where:
                _fail(schedule, f"worker {w} never runs SYNC_GRAD for stage {s} (pipe {p})")
            if len(where) > 1:
                _fail(schedule, f"SYNC_GRAD of stage {s} (pipe {p}) appears {len(where)} times on "
                                f"worker {w}; one per stage replica per step", (w, where[1]))
            if where[0] < last_b.get((s, p), -1):
                _fail(schedule, f"{actions[where[0]]} on worker {w} comes before the replica's last "
                                f"backward", (w, where[0]))
        if len(steps) != 1:
            _fail(schedule, f"worker {w} has {len(steps)} STEP actions; exactly one per worker",
                  (w, steps[1]) if steps else None)
        if steps[0] < last_work:
            _fail(schedule, f"STEP on worker {w} comes before the worker's last F/B/SYNC_GRAD/K-FAC unit",
                  (w, steps[0]))
        _check_stage_steps(schedule, w, held, stage_steps, last_of, per_stage)


def _check_stage_steps(schedule: Schedule, w: int, held: list[tuple[int, int]],
                       stage_steps: dict[tuple[int, int], list[int]], last_of: dict[tuple[int, int], int],
                       per_stage: bool) -> None:
    """[Note: per-stage optimizer steps] (``passes.per_stage_steps``): either every worker steps all its
    replicas at its final STEP (no stage STEP anywhere), or every replica steps once, after every
    other action of that replica (its last B/W, its SYNC_GRAD, its PRECOND and other K-FAC units)."""
    if not per_stage:
        return
    for s, p in held:
        where = stage_steps.get((s, p), [])
        name = f"{s}STEP" + (f"@{p}" if p else "")
        if len(where) != 1:
            _fail(schedule, f"worker {w} runs {name} {len(where)} times; with per-stage steps each stage "
                            f"replica it holds steps exactly once", (w, where[1]) if where else None)
        if where[0] < last_of.get((s, p), -1):
            late = schedule.actions[w][last_of[(s, p)]]
            _fail(schedule, f"{name} on worker {w} comes before {late}: a stage steps once its gradients "
                            f"are final (after its last B/W, SYNC_GRAD and K-FAC units)", (w, where[0]))


def _collective_key(a: Action) -> tuple[str, int, int | None]:
    return (a.kind.value, a.stage, a.layer if a.kind == K.SYNC_FACTOR else None)


def _describe(key: tuple[str, int, int | None]) -> str:
    kind, stage, layer = key
    return f"{stage}{kind}" + ("" if layer is None else f"#{layer}")


def _check_collective_order(schedule: Schedule) -> None:
    """Workers sharing collectives must issue them in the same relative order."""
    members = {s: set(schedule.placement.replicas_of_stage(s)) for s in range(schedule.num_stages)}
    sync_seq = {
        w: [(i, _collective_key(a)) for i, a in enumerate(actions) if a.kind in _COLLECTIVES]
        for w, actions in schedule.actions.items()
    }
    workers = sorted(schedule.actions)
    for x in workers:
        for y in workers:
            if y <= x:
                continue
            shared = {s for s, m in members.items() if x in m and y in m}
            if not shared:
                continue
            seq_x = [(i, key) for i, key in sync_seq[x] if key[1] in shared]
            seq_y = [(i, key) for i, key in sync_seq[y] if key[1] in shared]
            if len({key for _, key in seq_x}) < 2:
                continue
            for (i, kx), (_, ky) in zip(seq_x, seq_y):
                if kx != ky:
                    what = ("gradient all-reduces" if all(k[0] == K.SYNC_GRAD.value for _, k in seq_x + seq_y)
                            else "all-reduces")
                    _fail(schedule, f"workers {x} and {y} share the {what} of stages "
                                    f"{sorted(shared)} but issue them in different orders "
                                    f"({[_describe(k) for _, k in seq_x]} vs "
                                    f"{[_describe(k) for _, k in seq_y]})", (x, i))


# -- K-FAC -------------------------------------------------------------------------------------


def _layers_match(a: int | None, b: int | None) -> bool:
    """Does a unit of layer ``a`` touch layer ``b`` (None: every layer of the stage)?"""
    return a is None or b is None or a == b


def _check_kfac(schedule: Schedule, require_precond: bool) -> None:
    """[Note: K-FAC rules of one step]."""
    placement = schedule.placement
    factor_syncs: dict[tuple[int, int | None], dict[int, int]] = defaultdict(dict)
    for w, actions in schedule.actions.items():
        computes = {(a.kind, a.stage, a.micro_batch, a.pipe): i
                    for i, a in enumerate(actions) if a.kind.is_compute}
        grad_syncs = {(a.stage, a.pipe): i for i, a in enumerate(actions) if a.kind == K.SYNC_GRAD}
        seen: dict[Action, int] = {}
        layers: dict[tuple[ActionKind, int, int | None, int], set[int | None]] = defaultdict(set)
        curvature: list[tuple[int, Action]] = []
        syncs: list[tuple[int, Action]] = []
        inverts: list[tuple[int, Action]] = []
        preconds: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, a in enumerate(actions):
            if not a.kind.is_kfac:
                continue
            if a in seen:
                _fail(schedule, f"{a} appears twice on worker {w}; each K-FAC unit runs once per step",
                      (w, i))
            seen[a] = i
            group = layers[(a.kind, a.stage, a.micro_batch, a.pipe)]
            if group and (a.layer is None or None in group):
                _fail(schedule, f"{a} on worker {w}: {a.kind} of stage {a.stage} mixes the all-layers "
                                f"form (no #layer) with per-layer units in one step; use one form", (w, i))
            group.add(a.layer)
            if a.kind in (K.CURV_A, K.CURV_B):
                dep = K.FORWARD if a.kind == K.CURV_A else K.BACKWARD
                j = computes.get((dep, a.stage, a.micro_batch, a.pipe))
                if j is None and dep == K.BACKWARD:  # a split backward: its I computes the output gradient
                    j = computes.get((K.BACKWARD_INPUT, a.stage, a.micro_batch, a.pipe))
                need = Action(dep, a.stage, a.micro_batch, a.pipe)
                if j is None:
                    _fail(schedule, f"{a} on worker {w} has no {need} on this worker in this step; "
                                    f"curvature uses what that {'forward' if dep == K.FORWARD else 'backward'} "
                                    f"captured", (w, i))
                if j > i:
                    _fail(schedule, f"{a} on worker {w} runs before {need}, whose "
                                    f"{'input' if dep == K.FORWARD else 'output gradient'} it needs", (w, i))
                curvature.append((i, a))
            elif a.kind == K.SYNC_FACTOR:
                syncs.append((i, a))
                factor_syncs[(a.stage, a.layer)][w] = i
            elif a.kind == K.INVERT:
                inverts.append((i, a))
            else:  # PRECOND
                if a.layer is not None:
                    _fail(schedule, f"{a} on worker {w}: PRECOND preconditions a whole stage replica; "
                                    f"drop the #layer", (w, i))
                j = grad_syncs.get((a.stage, a.pipe))
                if j is None or j > i:
                    _fail(schedule, f"{a} on worker {w} must come after {a.stage}SYNC_GRAD"
                                    f"{'@' + str(a.pipe) if a.pipe else ''}: it preconditions the "
                                    f"all-reduced gradients", (w, i))
                preconds[(a.stage, a.pipe)].append(i)
        for i, sync in syncs:
            for j, c in curvature:
                if j > i and (c.stage, c.pipe) == (sync.stage, sync.pipe) and _layers_match(c.layer, sync.layer):
                    _fail(schedule, f"{sync} on worker {w} comes before {c}; the factor all-reduce "
                                    f"needs every curvature unit of its layer first", (w, i))
        for i, inv in inverts:
            for j, sync in syncs:
                if j > i and (sync.stage, sync.pipe) == (inv.stage, inv.pipe) and _layers_match(sync.layer, inv.layer):
                    _fail(schedule, f"{inv} on worker {w} comes before {sync}; the inversion needs the "
                                    f"all-reduced factors", (w, i))
        if require_precond:
            for (_, p, st) in placement.stages_of(w):
                where = preconds.get((st, p), [])
                if len(where) != 1:
                    _fail(schedule, f"worker {w} runs PRECOND of stage {st} (pipe {p}) {len(where)} times; "
                                    f"a K-FAC step preconditions each stage replica exactly once, "
                                    f"after its SYNC_GRAD and before STEP", (w, where[1]) if where else None)
    for (stage, layer), have in factor_syncs.items():
        members = placement.replicas_of_stage(stage)
        missing = [m for m in members if m not in have]
        if missing:
            w = min(have)
            name = f"SYNC_FACTOR of stage {stage}" + ("" if layer is None else f" layer {layer}")
            _fail(schedule, f"{name} is issued by workers {sorted(have)} but not by {missing}: it is a "
                            f"collective over every replica of the stage", (w, have[w]))


# -- deadlock ----------------------------------------------------------------------------------


def stuck_positions(schedule: Schedule) -> dict[int, int]:
    """Where each worker stops in the abstract execution of [Note: deadlock semantics].

    Returns:
        ``{worker: index of the action it cannot complete}`` for the workers that do not finish;
        empty when the schedule runs to completion. Planners use it to repair an order.
    """
    has_comm = any(a.kind.is_comm for acts in schedule.actions.values() for a in acts)
    return _abstract_run(schedule, data_dependencies=not has_comm)


def _check_no_deadlock(schedule: Schedule, data_dependencies: bool, exchanges: bool = False) -> None:
    """Abstract execution; see [Note: deadlock semantics]."""
    stuck = _abstract_run(schedule, data_dependencies, exchanges)
    if stuck:
        waits = ", ".join(f"worker {w} at {schedule.actions[w][i]}" for w, i in stuck.items())
        first = min(stuck)
        what = " and the owners' exchanges" if exchanges else ""
        _fail(schedule, f"deadlock under blocking send/receive and collectives{what}: {waits}",
              (first, stuck[first]))


def _abstract_run(schedule: Schedule, data_dependencies: bool, exchanges: bool = False) -> dict[int, int]:
    actions = schedule.actions
    dp_of = worker_dp_groups(schedule.placement)
    members = {s: schedule.placement.replicas_of_stage(s) for s in range(schedule.num_stages)}
    last = schedule.num_stages - 1
    ptr = {w: 0 for w in actions}
    done: set[tuple[int, Action]] = set()  # (dp, compute action) executed
    # exchanges: per stage with PRECONDs, the workers that must issue one and those that have
    exchanging = {a.stage for acts in actions.values() for a in acts if a.kind == K.PRECOND} if exchanges else set()
    preconditioned: dict[int, set[int]] = defaultdict(set)

    def exchanged(w: int, a: Action) -> bool:
        stages = [a.stage] if a.stage is not None else sorted({s for (_, _, s) in schedule.placement.stages_of(w)})
        return all(preconditioned[s] >= set(members[s]) for s in stages if s in exchanging)

    def current(w: int) -> Action | None:
        return actions[w][ptr[w]] if ptr[w] < len(actions[w]) else None

    def ready_compute(w: int, a: Action) -> bool:
        if not data_dependencies:
            return True
        dp, s, j, p = dp_of[w], a.stage, a.micro_batch, a.pipe
        if a.kind == K.FORWARD:
            return s == 0 or (dp, Action(K.FORWARD, s - 1, j, p)) in done
        if a.kind == K.BACKWARD_WEIGHT:
            return (dp, Action(K.BACKWARD_INPUT, s, j, p)) in done
        return (dp, Action(K.FORWARD, s, j, p)) in done and (
            s == last or (dp, Action(K.BACKWARD, s + 1, j, p)) in done
            or (dp, Action(K.BACKWARD_INPUT, s + 1, j, p)) in done)

    def step(w: int) -> bool:
        a = current(w)
        if a is None:
            return False
        if a.kind.is_compute:
            if not ready_compute(w, a):
                return False
            done.add((dp_of[w], a))
            ptr[w] += 1
            return True
        if a.kind == K.STEP:
            if exchanging and not exchanged(w, a):
                return False
            ptr[w] += 1
            return True
        if a.kind in _SENDS:
            if current(a.peer) != matching_recv(a, w):
                return False
            ptr[w] += 1
            ptr[a.peer] += 1
            return True
        if a.kind in _RECVS:
            return False  # completes from the sender's side
        if a.kind in _LOCAL_KFAC:
            if a.kind == K.PRECOND:
                preconditioned[a.stage].add(w)
            ptr[w] += 1
            return True
        group = members[a.stage]  # SYNC_GRAD or SYNC_FACTOR: blocking collectives
        key = _collective_key(a)
        if not all((c := current(m)) is not None and c.kind in _COLLECTIVES and _collective_key(c) == key
                   for m in group):
            return False
        for m in group:
            ptr[m] += 1
        return True

    progress = True
    while progress:
        progress = False
        for w in actions:
            while step(w):
                progress = True
    return {w: ptr[w] for w in sorted(actions) if current(w) is not None}
