"""Discrete-event simulation of a schedule under a cost model, giving a predicted timeline.

Why one module: :class:`CostModel` and the event-driven simulation are the two halves of one contract ([Note:
simulated semantics]: what each action costs and when it may start), and the helpers below them (phases,
action times, peak activations, bubble ratio) are views of that one simulation.

``simulate(schedule, cost)`` walks every worker's action list in order and starts each action as
soon as the worker is free and its inputs exist; it returns the same ``list[Event]`` the executor
records, so profiling, plots and bubble utilization work on either. Pure Python; no torch.

[Note: simulated semantics]
Chosen to match ``pipefisher.runtime.executor``:

- ``F``/``B`` of stage s occupy the worker for ``cost.forward_ns[s]`` / ``cost.backward_ns[s]``;
  the split backward's ``I``/``W`` for ``cost.input_grad_ns[s]`` / ``cost.weight_grad_ns[s]``.
- ``SEND_*`` is issued and returns at once (zero-length event; the executor uses ``isend``).
- ``RECV_*`` ends at max(worker free, send issued + ``cost.p2p_ns``); its event spans the wait.
- ``SYNC_GRAD`` of stage s is an asynchronous all-reduce: it starts when every replica of the
  stage has reached its SYNC_GRAD and lasts ``cost.sync_ns[s]``; the worker does not wait for it.
- ``STEP`` waits for the worker's all-reduces of the step and for every worker to reach its STEP
  (the global gradient norm is an all-reduce over all workers), then lasts ``cost.step_of(worker)``.
- A stage ``STEP`` (``sSTEP@p``, ``passes.per_stage_steps``) waits for its replica's ``SYNC_GRAD``
  all-reduce only, as ``PRECOND`` does, and lasts ``cost.stage_step_ns[s]``; the worker's final
  ``STEP`` then costs what is left (``step_of``: the tied weight, the norm's check).
- A compute-only schedule (no SEND/RECV) is simulated with its data dependencies instead: an F
  starts after the upstream F ended (+ ``p2p_ns`` across workers), a B or I after its own F and
  the downstream B or I, a W after its own I.
- K-FAC work (DESIGN.md, "K-FAC"; ``pipefisher.schedules.kfac``): ``CURV_A``/``CURV_B``/``INVERT``
  of a stage's layer occupy the worker for ``cost.kfac_ns(kind, stage, layer)`` (``layer=None``:
  the sum over the stage's layers); ``PRECOND`` waits for the stage's ``SYNC_GRAD`` all-reduce and
  lasts ``cost.precond_ns[stage]``. ``SYNC_FACTOR`` is an asynchronous all-reduce like
  ``SYNC_GRAD`` (it starts when every replica of the stage has reached its ``SYNC_FACTOR`` of that
  layer, lasts ``cost.sync_factor_ns[stage][layer]``); the ``INVERT`` of that layer waits for it
  (under ``kfac_owner`` only its owner's), ``STEP`` does not (a factor all-reduce may still run
  across a step boundary; its inversion is what needs it).

With ``steps > 1`` the lists are repeated; a worker starts step k+1 right after its own STEP.
:func:`simulate_phases` runs a different schedule per step (the phases of a K-FAC assignment).
Example, 1F1B, D=3, N=4, F = B = 1 unit, no communication cost (``.`` = bubble)::

    W0  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    W1  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    W2  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .      bubble 2/(4+2) = (D−1)/(N+D−1)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from pipefisher.schedules.checks import ScheduleError
from pipefisher.schedules.ir import Action, ActionKind, Placement, Schedule
from pipefisher.schedules.passes import matching_send, worker_dp_groups
from pipefisher.timeline import Event, bubble_utilization

__all__ = ["ActionTime", "CostModel", "action_times", "compute_cost_fields", "mean_ns", "owner_members", "peak_activations",
           "simulate", "simulate_phases", "simulated_bubble_ratio", "worker_step_costs"]

K = ActionKind


def _split_halves(backward_ns: int) -> tuple[int, int]:
    """(I, W) of a backward that was not measured split: its halves, I rounded up."""
    return backward_ns - backward_ns // 2, backward_ns // 2


def _as_tuple(values: Sequence[int] | int, n: int, name: str) -> tuple[int, ...]:
    out = (values,) * n if isinstance(values, int) else tuple(values)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in out):
        raise ValueError(f"CostModel.{name}={values!r}: costs are non-negative integer ns")
    return out


KfacTable = tuple[tuple[int, ...], ...]
"""Per-stage, per-layer costs in ns: ``table[stage][layer]``; ``()`` means 0 everywhere."""

_KFAC_TABLES = {K.CURV_A: "curv_a_ns", K.CURV_B: "curv_b_ns", K.SYNC_FACTOR: "sync_factor_ns",
                K.INVERT: "invert_ns"}


def _as_table(values: Sequence[Sequence[int]], n: int, name: str) -> KfacTable:
    if isinstance(values, int) or values is None:
        raise ValueError(f"CostModel.{name}={values!r}: give one tuple of per-layer ns per stage, "
                         f"e.g. CostModel.uniform(..., kfac_layers=6, {name}=100)")
    rows = tuple(_as_tuple(row, 0, name) for row in values)
    if rows and len(rows) != n:
        raise ValueError(f"CostModel.{name} has {len(rows)} rows; forward_ns has {n} (one per stage)")
    return rows


@dataclass(frozen=True)
class CostModel:
    """Per-action costs in nanoseconds.

    Attributes:
        forward_ns: forward cost of each stage, ``len == num_stages``.
        backward_ns: backward cost of each stage.
        p2p_ns: latency of one point-to-point message (send issued → data received).
        sync_ns: gradient all-reduce cost of each stage (empty means 0 for every stage).
        step_ns: optimizer step cost per worker.
        kfac_owner: ``optimizer.kfac_owners=replicas``: ``[stage][layer]`` the owner of the layer among the
            stage's replicas (an index into its workers, sorted: ``Placement.replicas_of_stage``, the order of
            the stage's process group), which alone inverts and preconditions it; the others' INVERT of it costs
            0, their PRECOND only their own layers (``precond_layer_ns``), and the preconditioned gradients
            travel in one all-gather (``exchange_ns``) that the STEP waits for ([Note: pricing owners] in
            ``planning.owner_costs``). ``()``: every replica does every layer's work (``holder``).
        precond_layer_ns: ``[stage][layer]`` PRECOND of one layer (read with ``kfac_owner`` only).
        exchange_ns: per stage, the all-gather of the preconditioned gradients among the owners (with
            ``kfac_owner``; empty: 0).
        stage_step_ns: per-stage cost of a stage STEP (the optimizer step of that stage's parameters,
            the tied weight excepted; ``passes.per_stage_steps``); empty: 0.
        worker_step_ns: optimizer step cost of each worker, where they differ (empty: ``step_ns``
            for every worker). A V schedule puts the embeddings and the heads on one worker, whose
            step then updates far more parameters than the others' (``bench/v_gap.py``).
        curv_a_ns: K-FAC: ``[stage][layer]`` cost of one CURV_A unit (one layer, one micro-batch);
            ``()`` means K-FAC work costs nothing (a schedule without K-FAC actions).
        curv_b_ns: the same for CURV_B.
        sync_factor_ns: ``[stage][layer]`` cost of the factor all-reduce of one layer.
        invert_ns: ``[stage][layer]`` cost of inverting both factors of one layer.
        precond_ns: per-stage cost of preconditioning all the stage's gradients (empty: 0).
        input_grad_ns: per-stage cost of a split backward's I (input gradient); empty: the first
            half of ``backward_ns`` (rounded up). Measured I + W is 1.01–1.04× one B on CPU BERT
            stages (bench/README.md §8), so give measured values where you have them.
        weight_grad_ns: per-stage cost of a split backward's W (weight gradients); empty: the rest
            of ``backward_ns``.
    """

    forward_ns: tuple[int, ...]
    backward_ns: tuple[int, ...]
    p2p_ns: int = 0
    sync_ns: tuple[int, ...] = ()
    step_ns: int = 0
    curv_a_ns: KfacTable = ()
    curv_b_ns: KfacTable = ()
    sync_factor_ns: KfacTable = ()
    invert_ns: KfacTable = ()
    precond_ns: tuple[int, ...] = ()
    input_grad_ns: tuple[int, ...] = ()
    weight_grad_ns: tuple[int, ...] = ()
    worker_step_ns: tuple[int, ...] = ()
    stage_step_ns: tuple[int, ...] = ()
    kfac_owner: KfacTable = ()
    precond_layer_ns: KfacTable = ()
    exchange_ns: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward_ns)
        object.__setattr__(self, "forward_ns", _as_tuple(self.forward_ns, n, "forward_ns"))
        object.__setattr__(self, "backward_ns", _as_tuple(self.backward_ns, n, "backward_ns"))
        given_i, given_w = len(self.input_grad_ns) > 0, len(self.weight_grad_ns) > 0
        if given_i != given_w:
            raise ValueError("CostModel: give both input_grad_ns and weight_grad_ns (split backward) "
                             "or neither (then each is half of backward_ns)")
        if not given_i:
            halves = [_split_halves(b) for b in self.backward_ns]
            object.__setattr__(self, "input_grad_ns", tuple(i for i, _ in halves))
            object.__setattr__(self, "weight_grad_ns", tuple(w for _, w in halves))
        for name in ("input_grad_ns", "weight_grad_ns"):
            object.__setattr__(self, name, _as_tuple(getattr(self, name), n, name))
        sync = self.sync_ns if (isinstance(self.sync_ns, int) or len(self.sync_ns)) else 0
        object.__setattr__(self, "sync_ns", _as_tuple(sync, n, "sync_ns"))
        precond = self.precond_ns if (isinstance(self.precond_ns, int) or len(self.precond_ns)) else 0
        object.__setattr__(self, "precond_ns", _as_tuple(precond, n, "precond_ns"))
        stage_step = self.stage_step_ns if (isinstance(self.stage_step_ns, int) or len(self.stage_step_ns)) else 0
        object.__setattr__(self, "stage_step_ns", _as_tuple(stage_step, n, "stage_step_ns"))
        exchange = self.exchange_ns if (isinstance(self.exchange_ns, int) or len(self.exchange_ns)) else 0
        object.__setattr__(self, "exchange_ns", _as_tuple(exchange, n, "exchange_ns"))
        _as_tuple(self.p2p_ns, 1, "p2p_ns")
        _as_tuple(self.step_ns, 1, "step_ns")
        object.__setattr__(self, "worker_step_ns", tuple(int(x) for x in self.worker_step_ns))
        for name in ("backward_ns", "sync_ns", "precond_ns", "input_grad_ns", "weight_grad_ns", "stage_step_ns",
                     "exchange_ns"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"CostModel.{name} has {len(getattr(self, name))} entries; "
                                 f"forward_ns has {n} (one per stage)")
        counts: tuple[int, ...] | None = None
        for name in _KFAC_TABLES.values():
            table = _as_table(getattr(self, name), n, name)
            object.__setattr__(self, name, table)
            if not table:
                continue
            mine = tuple(len(row) for row in table)
            if counts is not None and mine != counts:
                raise ValueError(f"CostModel.{name} has {list(mine)} layers per stage, the other K-FAC "
                                 f"tables {list(counts)}; give every K-FAC kind the same layers")
            counts = mine
        for name in ("kfac_owner", "precond_layer_ns"):
            table = _as_table(getattr(self, name), n, name)
            object.__setattr__(self, name, table)
            if table and counts is not None and tuple(len(row) for row in table) != counts:
                raise ValueError(f"CostModel.{name} has {[len(row) for row in table]} layers per stage, the K-FAC "
                                 f"tables {list(counts)}")
        if self.kfac_owner and not self.precond_layer_ns:
            raise ValueError("CostModel.kfac_owner needs precond_layer_ns (what each owner's PRECOND costs)")

    @classmethod
    def uniform(cls, num_stages: int, forward_ns: int, backward_ns: int | None = None, *,
                p2p_ns: int = 0, sync_ns: int = 0, step_ns: int = 0, kfac_layers: int = 0,
                curv_a_ns: int = 0, curv_b_ns: int = 0, sync_factor_ns: int = 0, invert_ns: int = 0,
                precond_ns: int = 0, input_grad_ns: int | None = None,
                weight_grad_ns: int | None = None, stage_step_ns: int = 0) -> CostModel:
        """Every stage costs the same.

        Args:
            num_stages: number of stages (``Schedule.num_stages``; D·v for interleaved).
            forward_ns: forward cost of a stage.
            backward_ns: backward cost of a stage; defaults to ``forward_ns`` (the closed-form
                bubble ratios of DESIGN.md assume equal costs; real backwards cost about 2×).
            p2p_ns: point-to-point latency.
            sync_ns: all-reduce cost of a stage.
            step_ns: optimizer step cost.
            kfac_layers: K-FAC layers per stage (0: no K-FAC cost tables).
            curv_a_ns: cost of one CURV_A unit (one layer, one micro-batch).
            curv_b_ns: cost of one CURV_B unit.
            sync_factor_ns: factor all-reduce of one layer.
            invert_ns: inversion of one layer's factors.
            precond_ns: preconditioning of one stage.
            input_grad_ns: a split backward's I; with ``weight_grad_ns``, or both None (halves of
                the backward).
            weight_grad_ns: a split backward's W.
            stage_step_ns: a stage STEP (per-stage optimizer steps).
        """
        def table(value: int) -> KfacTable:
            return ((value,) * kfac_layers,) * num_stages if kfac_layers else ()

        return cls(
            forward_ns=(forward_ns,) * num_stages,
            backward_ns=((forward_ns if backward_ns is None else backward_ns),) * num_stages,
            p2p_ns=p2p_ns,
            sync_ns=(sync_ns,) * num_stages,
            step_ns=step_ns,
            curv_a_ns=table(curv_a_ns),
            curv_b_ns=table(curv_b_ns),
            sync_factor_ns=table(sync_factor_ns),
            invert_ns=table(invert_ns),
            precond_ns=(precond_ns,) * num_stages,
            input_grad_ns=() if input_grad_ns is None else (input_grad_ns,) * num_stages,
            weight_grad_ns=() if weight_grad_ns is None else (weight_grad_ns,) * num_stages,
            stage_step_ns=(stage_step_ns,) * num_stages,
        )

    def compute_ns(self, kind: ActionKind, stage: int) -> int:
        """Cost of one F, B, I or W of ``stage``."""
        table = {K.FORWARD: self.forward_ns, K.BACKWARD: self.backward_ns,
                 K.BACKWARD_INPUT: self.input_grad_ns, K.BACKWARD_WEIGHT: self.weight_grad_ns}[kind]
        return table[stage]

    @property
    def num_stages(self) -> int:
        return len(self.forward_ns)

    @property
    def kfac_layers(self) -> tuple[int, ...] | None:
        """K-FAC layers per stage according to the cost tables, or None when they are empty."""
        for name in _KFAC_TABLES.values():
            table = getattr(self, name)
            if table:
                return tuple(len(row) for row in table)
        return None

    def kfac_ns(self, kind: ActionKind, stage: int, layer: int | None = None, member: int | None = None) -> int:
        """Cost of one K-FAC unit: CURV_A/CURV_B (per micro-batch), SYNC_FACTOR, INVERT, PRECOND.

        Args:
            kind: a K-FAC kind.
            stage: the stage.
            layer: the stage's K-FAC layer; None sums over all of them (``PRECOND`` ignores it).
            member: the replica's index among the stage's workers (``kfac_owner``): its INVERT of a layer it
                does not own and its PRECOND of such layers cost 0. None: every layer's cost.

        Raises:
            ValueError: ``layer`` beyond the layers the cost tables give the stage.
        """
        if kind == K.PRECOND:
            return self.precond_of(stage, member)
        table = getattr(self, _KFAC_TABLES[kind])
        if not table:
            return 0
        row = table[stage]
        mine = self.owned(stage, member) if kind == K.INVERT else None
        if layer is None:
            return sum(c for i, c in enumerate(row) if mine is None or i in mine)
        if not 0 <= layer < len(row):
            raise ValueError(f"{kind} of stage {stage} layer {layer}: the cost model has {len(row)} "
                             f"K-FAC layers for that stage; build it with the run's layer counts")
        return row[layer] if mine is None or layer in mine else 0

    def owned(self, stage: int, member: int | None) -> frozenset[int] | None:
        """The layers of ``stage`` replica ``member`` inverts and preconditions; None: all (no owners, or no
        member given)."""
        if member is None or not self.kfac_owner:
            return None
        return frozenset(i for i, o in enumerate(self.kfac_owner[stage]) if o == member)

    def precond_of(self, stage: int, member: int | None = None) -> int:
        """PRECOND of ``stage`` on replica ``member``: its own layers' under ``kfac_owner``, else the stage's."""
        mine = self.owned(stage, member)
        if mine is None:
            return self.precond_ns[stage]
        return sum(c for i, c in enumerate(self.precond_layer_ns[stage]) if i in mine)

    # Short aliases: cost.forward[stage], cost.backward[stage], cost.sync[stage], cost.step.
    @property
    def forward(self) -> tuple[int, ...]:
        return self.forward_ns

    @property
    def backward(self) -> tuple[int, ...]:
        return self.backward_ns

    @property
    def sync(self) -> tuple[int, ...]:
        return self.sync_ns

    @property
    def step(self) -> int:
        return self.step_ns

    def step_of(self, worker: int) -> int:
        """The optimizer step's cost on ``worker``: its ``worker_step_ns`` entry, else ``step_ns`` (a
        model measured on fewer workers, e.g. a profile's costs priced on more data-parallel copies)."""
        return self.worker_step_ns[worker] if 0 <= worker < len(self.worker_step_ns) else self.step_ns


def compute_cost_fields(mean: dict[tuple[str, int], int], num_stages: int) -> dict[str, list[int]]:
    """CostModel's F/B/I/W fields from per-(kind, stage) mean durations in ns.

    A stage that ran only split backwards gets B = I + W; one that ran only full backwards gets
    I and W as halves of B (``CostModel``'s default); one that ran both keeps each as measured.
    """
    forward, backward, input_grad, weight_grad = [], [], [], []
    for s in range(num_stages):
        b, i, w = mean.get(("B", s)), mean.get(("I", s)), mean.get(("W", s))
        split = i is not None and w is not None
        full = b if b is not None else ((i + w) if split else 0)
        if not split:
            i, w = _split_halves(full)
        forward.append(mean.get(("F", s), 0))
        backward.append(full)
        input_grad.append(i)
        weight_grad.append(w)
    return {"forward_ns": forward, "backward_ns": backward, "input_grad_ns": input_grad,
            "weight_grad_ns": weight_grad}


def mean_ns(durations: Sequence[int]) -> int:
    """The mean of ``durations`` in whole ns (the cost model's unit)."""
    return round(sum(durations) / len(durations))


def worker_step_costs(durations: dict[int, list[int]], num_workers: int | None = None) -> tuple[int, ...]:
    """CostModel's ``worker_step_ns`` from each worker's STEP durations in ns: the mean of each of workers
    0 .. n−1 (n = ``num_workers``, or one past the highest worker seen), or () unless every one of them,
    and none other, has a STEP."""
    n = num_workers if num_workers is not None else max(durations, default=-1) + 1
    if set(durations) != set(range(n)):
        return ()
    return tuple(mean_ns(durations[w]) for w in range(n))


def owner_members(placement: Placement, cost: CostModel) -> dict[tuple[int, int], int]:
    """(worker, stage) -> the replica's index among the stage's workers (``CostModel.kfac_owner``'s member), for
    the stages several workers hold, when ``cost`` prices owners; empty otherwise ([Note: pricing owners])."""
    if not cost.kfac_owner:
        return {}
    out: dict[tuple[int, int], int] = {}
    for stage in {s for (_, _, s) in placement.workers}:
        workers = placement.replicas_of_stage(stage)
        if len(workers) > 1:
            out.update({(w, stage): i for i, w in enumerate(workers)})
    return out


class ActionTime(NamedTuple):
    """When one action ran on its worker (ns).

    Attributes:
        free_ns: the worker became free for it (end of the worker's previous action).
        start_ns: it started (after waiting for inputs or all-reduces; a RECV starts at once and
            spans its wait; a SYNC_GRAD/SYNC_FACTOR arrival takes no worker time).
        end_ns: it ended (for a RECV: the data arrived).
    """

    free_ns: int
    start_ns: int
    end_ns: int


class _Sim:
    """State of one simulation; ``run`` fills ``events`` (and ``times``)."""

    def __init__(self, steps: Sequence[Schedule], cost: CostModel) -> None:
        self.s = steps[0]
        self.steps = list(steps)
        self.cost = cost
        self.dp_of = worker_dp_groups(self.s.placement)
        self.where = self.s.placement.workers
        self.members = {st: self.s.placement.replicas_of_stage(st) for st in range(self.s.num_stages)}
        # [Note: pricing owners]: a replica's index among its stage's workers, where several hold the stage
        self.member = owner_members(self.s.placement, cost)
        self.exchange_arrivals: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
        self.data_deps = [not any(a.kind.is_comm for acts in sch.actions.values() for a in acts)
                          for sch in self.steps]
        self.work = {w: [(k, i, a) for k, sch in enumerate(self.steps) for i, a in enumerate(sch.actions[w])]
                     for w in self.s.actions}
        self.ptr = {w: 0 for w in self.work}
        self.clock = {w: 0 for w in self.work}
        self.compute_end: dict[tuple[int, int, Action], int] = {}  # (step, dp, F/B) -> end
        self.sent: dict[tuple[int, int, Action], int] = {}  # (step, sender, SEND) -> issue time
        # Collectives: (step, kind, stage, layer) -> {worker: arrival}.
        self.arrivals: dict[tuple[int, ActionKind, int, int | None], dict[int, int]] = defaultdict(dict)
        self.open_syncs: dict[tuple[int, int], set[int]] = defaultdict(set)  # (step, w) -> stages
        self.sync_end: dict[tuple[int, int], int] = defaultdict(int)  # (step, w) -> latest end
        self.stage_sync_end: dict[tuple[int, int, int], int] = {}  # (step, w, stage) -> end
        # Factor all-reduces per (w, stage): layers in flight, and layer -> end of the latest.
        self.open_factors: dict[tuple[int, int], set[int | None]] = defaultdict(set)
        self.factor_end: dict[tuple[int, int], dict[int | None, int]] = defaultdict(dict)
        self.step_ready: dict[int, dict[int, int]] = defaultdict(dict)  # step -> {worker: ready for STEP}
        self.events: list[Event] = []
        self.times: dict[tuple[int, int, int], ActionTime] = {}  # (step, w, index) -> times

    def _emit(self, w: int, k: int, a: Action, start: int, end: int) -> None:
        self.events.append(Event(worker=w, name=str(a), kind=a.kind.value, start_ns=start,
                                 end_ns=end, step=k))

    def _input_ready(self, w: int, k: int, a: Action) -> int | None:
        """Earliest start allowed by data dependencies (compute-only schedules), None if unknown."""
        t = 0
        if not self.data_deps[k]:
            return t
        dp, s, j, p = self.dp_of[w], a.stage, a.micro_batch, a.pipe
        deps = []
        if a.kind == K.FORWARD:
            if s > 0:
                deps.append(Action(K.FORWARD, s - 1, j, p))
        elif a.kind == K.BACKWARD_WEIGHT:
            deps.append(Action(K.BACKWARD_INPUT, s, j, p))
        else:
            deps.append(Action(K.FORWARD, s, j, p))
            if s < self.s.num_stages - 1:
                down = Action(K.BACKWARD, s + 1, j, p)
                if (k, dp, down) not in self.compute_end:
                    down = Action(K.BACKWARD_INPUT, s + 1, j, p)
                deps.append(down)
        for d in deps:
            end = self.compute_end.get((k, dp, d))
            if end is None:
                return None
            t = max(t, end + (self.cost.p2p_ns if self.where[(dp, p, d.stage)] != w else 0))
        return t

    def _factor_ready(self, w: int, a: Action) -> int | None:
        """When the factor all-reduce(s) an INVERT needs have ended; None while one is in flight. Under
        ``kfac_owner`` a replica's INVERT needs only its own layers' ([Note: a non-owner does not wait] in
        ``runtime.kfac_work``)."""
        mine = self.cost.owned(a.stage, self.member.get((w, a.stage)))
        inverted = None if mine is None else (mine if a.layer is None else mine & {a.layer})  # None: every layer

        def relevant(layer: int | None) -> bool:  # a sync of ``layer`` (None: the stage's) that this INVERT needs
            if inverted is None:
                return a.layer is None or layer is None or layer == a.layer
            return bool(inverted) if layer is None else layer in inverted

        if any(relevant(layer) for layer in self.open_factors[(w, a.stage)]):
            return None
        return max((end for layer, end in self.factor_end[(w, a.stage)].items() if relevant(layer)),
                   default=0)

    def _advance(self, w: int) -> bool:
        k, i, a = self.work[w][self.ptr[w]]
        now = self.clock[w]
        if a.kind.is_compute:
            ready = self._input_ready(w, k, a)
            if ready is None:
                return False
            start = max(now, ready)
            end = start + self.cost.compute_ns(a.kind, a.stage)
            self.compute_end[(k, self.dp_of[w], a)] = end
        elif a.kind in (K.SEND_F, K.SEND_B):
            start = end = now
            self.sent[(k, w, a)] = now
        elif a.kind in (K.RECV_F, K.RECV_B):
            issued = self.sent.get((k, a.peer, matching_send(a, w)))
            if issued is None:
                return False
            start, end = now, max(now, issued + self.cost.p2p_ns)
        elif a.kind in (K.SYNC_GRAD, K.SYNC_FACTOR):
            self._arrive(w, k, a, now)
            self.times[(k, w, i)] = ActionTime(now, now, now)
            self.ptr[w] += 1
            return True
        elif a.kind == K.STEP and a.stage is not None:  # a per-stage step: its replica's all-reduce only
            if a.stage in self.open_syncs[(k, w)]:
                return False
            start = max(now, self.stage_sync_end.get((k, w, a.stage), 0))
            end = start + self.cost.stage_step_ns[a.stage]
        elif a.kind == K.STEP:
            if self.open_syncs[(k, w)]:
                return False
            ready = self.step_ready[k]
            ready[w] = max(now, self.sync_end[(k, w)])
            if len(ready) < len(self.work):  # the global norm's all-reduce joins every worker
                return False
            start = max(ready.values())
            end = start + self.cost.step_of(w)
        elif a.kind in (K.CURV_A, K.CURV_B):
            start = now
            end = start + self.cost.kfac_ns(a.kind, a.stage, a.layer)
        elif a.kind == K.INVERT:
            ready = self._factor_ready(w, a)
            if ready is None:
                return False
            start = max(now, ready)
            end = start + self.cost.kfac_ns(a.kind, a.stage, a.layer, self.member.get((w, a.stage)))
        elif a.kind == K.PRECOND:
            if a.stage in self.open_syncs[(k, w)]:
                return False
            start = max(now, self.stage_sync_end.get((k, w, a.stage), 0))
            end = start + self.cost.precond_of(a.stage, self.member.get((w, a.stage)))
            if (w, a.stage) in self.member and self.cost.kfac_owner[a.stage]:
                self._exchange(w, k, a.stage, end)
        else:  # pragma: no cover - kinds added to the IR must be simulated here
            raise NotImplementedError(f"simulator has no rule for {a}")
        self._emit(w, k, a, start, end)
        self.times[(k, w, i)] = ActionTime(now, start, end)
        self.clock[w] = end
        self.ptr[w] += 1
        return True

    def _exchange(self, w: int, k: int, stage: int, ready: int) -> None:
        """The owners' all-gather of ``stage``'s preconditioned gradients ([Note: pricing owners]): it starts
        when every replica has preconditioned its layers and ends ``exchange_ns`` later; the STEP waits for it
        as for a gradient all-reduce."""
        arrived = self.exchange_arrivals[(k, stage)]
        arrived[w] = ready
        self.open_syncs[(k, w)].add(stage)
        if set(arrived) != set(self.members[stage]):
            return
        end = max(arrived.values()) + self.cost.exchange_ns[stage]
        for m in self.members[stage]:
            self.open_syncs[(k, m)].discard(stage)
            self.sync_end[(k, m)] = max(self.sync_end[(k, m)], end)
            self.stage_sync_end[(k, m, stage)] = max(self.stage_sync_end.get((k, m, stage), 0), end)

    def _arrive(self, w: int, k: int, a: Action, now: int) -> None:
        layer = a.layer if a.kind == K.SYNC_FACTOR else None
        arrived = self.arrivals[(k, a.kind, a.stage, layer)]
        arrived[w] = now
        if a.kind == K.SYNC_GRAD:
            self.open_syncs[(k, w)].add(a.stage)
        else:
            self.open_factors[(w, a.stage)].add(layer)
        if set(arrived) != set(self.members[a.stage]):
            return
        start = max(arrived.values())
        if a.kind == K.SYNC_GRAD:
            end = start + self.cost.sync_ns[a.stage]
        else:
            end = start + self.cost.kfac_ns(K.SYNC_FACTOR, a.stage, layer)
        for m in self.members[a.stage]:
            if a.kind == K.SYNC_GRAD:
                self.open_syncs[(k, m)].discard(a.stage)
                self.sync_end[(k, m)] = max(self.sync_end[(k, m)], end)
                self.stage_sync_end[(k, m, a.stage)] = end
            else:
                self.open_factors[(m, a.stage)].discard(layer)
                self.factor_end[(m, a.stage)][layer] = end
            mine = next(x for x in self.steps[k].actions[m]
                        if x.kind == a.kind and x.stage == a.stage and x.layer == layer)
            self._emit(m, k, mine, start, end)

    def run(self) -> list[Event]:
        progress = True
        while progress:
            progress = False
            for w, work in self.work.items():
                while self.ptr[w] < len(work) and self._advance(w):
                    progress = True
        stuck = [w for w, work in self.work.items() if self.ptr[w] < len(work)]
        if stuck:
            waits = ", ".join(f"worker {w} at {self.work[w][self.ptr[w]][2]} (step {self.work[w][self.ptr[w]][0]})"
                              for w in stuck)
            raise ScheduleError(f"simulation of {self.s.method} cannot proceed: {waits}; "
                                f"run check_schedule for the grid")
        self.events.sort(key=lambda e: (e.start_ns, e.worker, e.end_ns))
        return self.events


def _check_fits(schedule: Schedule, cost: CostModel) -> None:
    if cost.num_stages != schedule.num_stages:
        raise ValueError(f"CostModel has {cost.num_stages} stages, the {schedule.method} schedule "
                         f"{schedule.num_stages}; build it with CostModel.uniform("
                         f"{schedule.num_stages}, ...)")


def simulate(schedule: Schedule, cost: CostModel, steps: int = 1) -> list[Event]:
    """Predict the timeline of ``steps`` training steps of ``schedule``.

    Args:
        schedule: a schedule (compute-only, or complete from ``build_schedule``, with or without
            K-FAC work).
        cost: per-action costs; ``cost.num_stages`` must equal ``schedule.num_stages``.
        steps: how many consecutive steps to simulate.

    Returns:
        One event per action and step (``name=str(action)``, ``kind=action.kind.value``), sorted by
        start time. See [Note: simulated semantics].

    Raises:
        ValueError: the cost model does not fit the schedule, or ``steps < 1``.
        ScheduleError: the schedule cannot run to completion.
    """
    _check_fits(schedule, cost)
    if steps < 1:
        raise ValueError(f"steps={steps}: simulate at least one step")
    return _Sim([schedule] * steps, cost).run()


def simulate_phases(phases: Sequence[Schedule], cost: CostModel, cycles: int = 1) -> list[Event]:
    """Predict consecutive steps that run different schedules (e.g. a K-FAC assignment's phases).

    Step t runs ``phases[t % len(phases)]``; ``cycles`` repetitions of all phases are simulated.
    Events carry the step index t.

    Args:
        phases: one schedule per step of a cycle; same method, stages and placement.
        cost: per-action costs, including the K-FAC unit costs the phases need.
        cycles: how many times to run the whole cycle.

    Returns:
        The events of ``len(phases) * cycles`` steps, sorted by start time.

    Raises:
        ValueError: no phases, ``cycles < 1``, phases of different pipelines, or a cost model
            that does not fit.
        ScheduleError: a phase cannot run to completion.
    """
    if not phases or cycles < 1:
        raise ValueError(f"simulate_phases needs at least one phase and cycles >= 1 "
                         f"(got {len(phases)} phases, cycles={cycles})")
    first = phases[0]
    for p in phases:
        _check_fits(p, cost)
        if p.placement != first.placement or set(p.actions) != set(first.actions):
            raise ValueError("simulate_phases: every phase must have the placement and workers of "
                             "phase 0 (one pipeline, different action lists)")
    return _Sim(list(phases) * cycles, cost).run()


def action_times(schedule: Schedule, cost: CostModel) -> dict[int, list[ActionTime]]:
    """When each action of one step of ``schedule`` ran, per worker, in list order.

    The planner (``pipefisher.planning``) reads the bubbles off these: before action i a worker
    idles from ``times[i-1].end_ns`` to ``times[i].start_ns`` (``end_ns`` for a RECV, which spans
    its own wait).

    Returns:
        ``{worker: [ActionTime, ...]}``, one entry per action of ``schedule.actions[worker]``.
    """
    _check_fits(schedule, cost)
    sim = _Sim([schedule], cost)
    sim.run()
    return {w: [sim.times[(0, w, i)] for i in range(len(acts))] for w, acts in schedule.actions.items()}


def peak_activations(schedule: Schedule) -> dict[int, int]:
    """Most micro-batch activations a worker holds at once: max over its order of #F − #B − #W.

    A split backward's activations count until its W (W keeps each layer's input and output
    gradient alive; counting the whole activation until then is the conservative choice).

    Args:
        schedule: any schedule.

    Returns:
        ``{worker: peak}``, counting every stage replica the worker holds.
    """
    peaks = {}
    for w, actions in schedule.actions.items():
        held = peak = 0
        for a in actions:
            if a.kind == K.FORWARD:
                held += 1
                peak = max(peak, held)
            elif a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
                held -= 1
        peaks[w] = peak
    return peaks


def simulated_bubble_ratio(schedule: Schedule, cost: CostModel | None = None) -> float:
    """Idle fraction of the F/B span: 1 − bubble utilization counting only F and B.

    Communication, all-reduce and step costs are set to zero, so the result is comparable with the
    closed forms of DESIGN.md ("Schedules").

    Args:
        schedule: the schedule to simulate (one step).
        cost: F/B costs; defaults to 1000 ns for every forward and backward.

    Returns:
        A fraction in [0, 1).
    """
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, 1000)
    cost = replace(cost, p2p_ns=0, sync_ns=(0,) * cost.num_stages, step_ns=0, worker_step_ns=(),
                   stage_step_ns=(0,) * cost.num_stages)
    fb = frozenset(k.value for k in (K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT))
    events = [e for e in simulate(schedule, cost) if e.kind in fb]
    return 1.0 - bubble_utilization(events, schedule.num_workers, kinds=fb)
