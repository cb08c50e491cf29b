"""The run a profile records: pipeline method, stages, micro-batches and width, read from the
order of its actions (issue 15, item 6).

An nsys export carries no run config, and keys given on the command line may describe another
run. The profile does hold the answer: action names carry stage, micro-batch and pipe (``3B5@1``),
and each worker's order of forwards and backwards is its schedule's. :func:`infer_shape` builds
every registered schedule that fits the counts and keeps those whose per-worker order of compute
actions equals the profile's first step.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipefisher.schedules import GENERATORS, Action, ActionKind, build_schedule
from pipefisher.schedules.v_schedules import v_half_cap, v_min_cap
from pipefisher.timeline import Event

__all__ = ["ProfiledShape", "infer_shape"]

log = logging.getLogger(__name__)

_COMPUTE = frozenset({"F", "B", "I", "W"})
_MAX_VIRTUAL = 8  # interleaved chunks per worker to try
# V schedules list-scheduled by the run's stage costs ([Note: V schedules in a profile]): zb-v, and the
# memory-capped ones with their activation caps (chunk activations per worker) at D stages
_CAPPED_V = {"v-min": v_min_cap, "v-half": v_half_cap}
_COST_ORDERED = ("zb-v", *_CAPPED_V)


@dataclass(frozen=True)
class ProfiledShape:
    """What a profile's actions say about its run.

    Attributes:
        methods: pipeline methods whose schedule has the profile's order (several when the orders
            coincide, e.g. gpipe and 1f1b with one micro-batch); empty when none has it.
        stages: D, workers per pipeline.
        num_micro_batches: N, one more than the largest micro-batch index of a forward.
        data_parallel: W, workers / D.
        num_virtual: model chunks per worker (interleaved), else 1.
        model_stages: distinct stage indices of the forwards (D · num_virtual).
        num_workers: workers with compute events.
    """

    methods: tuple[str, ...]
    stages: int
    num_micro_batches: int
    data_parallel: int
    num_virtual: int
    model_stages: int
    num_workers: int


def _orders(events: Sequence[Event]) -> dict[int, list[str]]:
    """Per worker, the names of its compute actions in the profile's first step, by start time."""
    first = min(e.step for e in events)
    out: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    for i, e in enumerate(events):
        if e.step == first and e.kind in _COMPUTE:
            out[e.worker].append((e.start_ns, i, e.name))
    return {w: [n for _, _, n in sorted(v)] for w, v in out.items()}


def _candidates(model_stages: int, workers: int) -> list[tuple[str, int, int, int]]:
    """``(method, D, W, num_virtual)`` shapes that fit the counts."""
    out = []
    for method in GENERATORS:
        chunks = (2,) if method in ("zb-v", "dualpipev", *_CAPPED_V) else (1,)
        for v in (range(2, _MAX_VIRTUAL + 1) if method == "interleaved" else chunks):
            if model_stages % v:
                continue
            d = model_stages // v
            if d and workers % d == 0:
                out.append((method, d, workers // d, v))
    return out


def _as_split(names: Sequence[str]) -> list[str]:
    """Compute-action names, sorted, with every full backward B written as its I and W."""
    out = []
    for name in names:
        a = Action.from_str(name)
        if a.kind == ActionKind.BACKWARD:
            out += [str(replace(a, kind=k)) for k in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)]
        else:
            out.append(name)
    return sorted(out)


def _peak_activations(orders: dict[int, list[str]]) -> int:
    """Most chunk activations any worker holds at once in ``orders``: #F − #B − #W over its order."""
    peak = 0
    for names in orders.values():
        held = 0
        for name in names:
            kind = Action.from_str(name).kind
            held += 1 if kind == ActionKind.FORWARD else -1 if kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT) else 0
            peak = max(peak, held)
    return peak


def _by_memory(matches: list[tuple[str, int, int, int, bool]], peak: int) -> list[tuple[str, int, int, int, bool]]:
    """[Note: V schedules in a profile]: drop a capped V schedule whose cap is below the profile's peak
    and put the V schedules with the tightest cap the profile keeps first (zb-v first on a tie)."""
    def cap(m: tuple[str, int, int, int, bool]) -> int:
        return _CAPPED_V[m[0]](m[1]) if m[0] in _CAPPED_V else 2 * m[1]

    kept = [m for m in matches if m[0] not in _CAPPED_V or peak <= cap(m)]
    v = sorted((m for m in kept if m[0] in _COST_ORDERED), key=lambda m: (cap(m), _COST_ORDERED.index(m[0])))
    return v + [m for m in kept if m[0] not in _COST_ORDERED]


def infer_shape(events: Sequence[Event]) -> ProfiledShape | None:
    """The run shape of a profile's events, or None if it holds no forward.

    [Note: V schedules in a profile]
    zb-v, v-half and v-min order their actions by the run's stage costs (the model, pipeline.order_costs),
    so a profile's order is compared with theirs loosely: the V placement, the same actions on the same
    workers. What tells them apart is memory: v-min and v-half hold at most their caps of chunk
    activations (``v_min_cap``, ``v_half_cap``), zb-v 2D at 1F1B's memory (more with
    ``pipeline.activation_memory``). The profile's peak rules out the caps below it; the tightest cap
    left comes first. At D <= 2 the caps are zb-v's and the three are one schedule: zb-v comes first.

    Args:
        events: a profile's events (any number of steps; the first one's order is compared).
    """
    stages, mbs = set(), set()
    for e in events:
        if e.kind != "F":
            continue
        try:
            a = Action.from_str(e.name)
        except ValueError:
            continue
        if a.stage is not None:
            stages.add(a.stage)
        if a.micro_batch is not None:
            mbs.add(a.micro_batch)
    if not stages or not mbs:
        return None
    orders = _orders(events)
    model_stages, n, workers = max(stages) + 1, max(mbs) + 1, max(orders) + 1
    matches = []
    for method, d, w, v in _candidates(model_stages, workers):
        try:
            schedule = build_schedule(method, d, n, w, num_virtual=v)
        except Exception as exc:  # noqa: BLE001 - a shape a generator refuses is simply no candidate
            log.debug("not %s D=%d N=%d W=%d v=%d: %s", method, d, n, w, v, exc)
            continue
        # zb-v's order depends on the run's stage costs (pipeline.order_costs, the model): its V
        # placement, the same actions on the same workers, identifies it.
        # Which I+W pairs merged into a B depends on that order too, so compare with B as I and W.
        same = (lambda x, y: _as_split(x) == _as_split(y)) if method in _COST_ORDERED else (lambda x, y: x == y)
        ours = {worker: [str(a) for a in schedule.actions.get(worker, ()) if a.kind.value in _COMPUTE]
                for worker in orders}
        if all(same(ours[worker], names) for worker, names in orders.items()):
            matches.append((method, d, w, v, ours == orders))
    if any(m[-1] for m in matches):  # an exact order (e.g. dualpipev's) beats zb-v's loose match
        matches = [m for m in matches if m[-1]]
    matches = [m[:-1] for m in _by_memory(matches, _peak_activations(orders))]
    if not matches:
        guess = (model_stages, workers // model_stages if workers % model_stages == 0 else 1, 1)
        return ProfiledShape((), guess[0], n, guess[1], 1, model_stages, workers)
    method, d, w, v = matches[0]
    same = tuple(m for m, d2, w2, v2 in matches if (d2, w2, v2) == (d, w, v))
    return ProfiledShape(same, d, n, w, v, model_stages, workers)

