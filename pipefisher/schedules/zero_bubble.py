"""Zero-bubble schedules: the backward split into I (input gradient) and W (weight gradients).

Zero Bubble Pipeline Parallelism (Qi, Wan, Huang, Lin; ICLR 2024) observes that only the input
gradient of a backward is on the pipeline's critical path: the previous stage waits for it. The
weight gradients can run any time after it, so they can fill the bubbles that a full backward
leaves. DESIGN.md, "Split backward"; the IR's ``I`` and ``W`` actions (``pipefisher.schedules.ir``).

Two generators, with the signature of every generator (``pipefisher.schedules.generators``):

- :func:`zb_h1`: one stage per worker, 1F1B's order with each W deferred so that every stage holds
  up to D micro-batches between F and W (the paper's ZB-H1, Sec. 2.1). Bubble, with equal costs
  F = I = W: (D−1)(F+I−W), a third of 1F1B's (D−1)(F+I+W) (the paper's Table: rate (p−1)/3m).
- :func:`zb_v`: two stages (chunks) per worker in a V: worker r holds stage r and stage 2D−1−r of
  a 2D-stage model, so the first and the last stage share worker 0 (the paper's ZB-V, Sec. 6).
  N ≥ 2D. Its order comes from :func:`greedy_split_orders`, a list scheduler under unit costs.

:func:`merge_adjacent_backwards` then turns an I that its own W immediately follows on its worker
into one B where no other worker waits for that I's gradient: a split pays two actions' overhead
and holds W's operands from I until W, so a schedule should split only where W fills a bubble. On
CPU BERT stages I + W measured 1.01–1.04× one B of the same stage (bench/README.md §8), where it
had measured 1.07–1.12× before a full B accumulated its weight gradients as W does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.shapes import check_common, check_v_shape, linear_placement, replicate

__all__ = ["zb_h1", "zb_v", "capped_v_schedule", "greedy_split_orders", "merge_adjacent_backwards", "v_position"]

F = ActionKind.FORWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the IR's name
W = ActionKind.BACKWARD_WEIGHT


# -- ZB-H1 -------------------------------------------------------------------------------------


def _zb_h1_order(stage: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    """Stage s: 1F1B's D−1−s warm-up forwards, then F/I pairs; W(k) runs s pairs late (after the
    I of micro-batch k+s), so every stage holds up to D micro-batches between F and W; the
    cool-down runs one W after each I, then the rest."""
    d, n = num_stages, num_micro_batches
    warmup = min(d - 1 - stage, n)
    order = [Action(F, stage, j) for j in range(warmup)]
    next_w = 0
    for k in range(n - warmup):
        order += [Action(F, stage, warmup + k), Action(I, stage, k)]
        if k >= stage:
            order.append(Action(W, stage, next_w))
            next_w += 1
    for k in range(n - warmup, n):
        order.append(Action(I, stage, k))
        if next_w <= k:
            order.append(Action(W, stage, next_w))
            next_w += 1
    order += [Action(W, stage, j) for j in range(next_w, n)]
    return order


def zb_h1(num_stages: int, num_micro_batches: int, dp_width: int = 1, merge: bool = True) -> Schedule:
    """ZB-H1: 1F1B with the backward split and each stage's W deferred into the bubbles.

    D=3, N=4, F = I = W = 1 unit (``.`` = bubble)::

        W0  F0 F1 .  F2 .  I0 W0 F3 I1 W1 I2 W2 I3 W3
        W1  .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        W2  .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3

    Args:
        num_stages: D, one stage per worker.
        num_micro_batches: N >= 1.
        dp_width: W, data-parallel copies.
        merge: merge adjacent I and W where nobody waits (:func:`merge_adjacent_backwards`).

    Returns:
        A compute-only schedule with D·W workers (``method="zb-h1"``).
    """
    check_common(num_stages, num_micro_batches, dp_width)
    d, n = num_stages, num_micro_batches
    orders = [_zb_h1_order(s, d, n) for s in range(d)]
    schedule = Schedule(
        method="zb-h1",
        num_stages=d,
        num_micro_batches=n,
        placement=linear_placement(d, d, dp_width, lambda s: s),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=(0,) * n,
    )
    return merge_adjacent_backwards(schedule) if merge else schedule


# -- ZB-V --------------------------------------------------------------------------------------


def v_position(stage: int, num_workers: int) -> int:
    """The worker position of ``stage`` in a V placement of 2·D stages on D workers."""
    return stage if stage < num_workers else 2 * num_workers - 1 - stage


def greedy_split_orders(num_stages: int, num_micro_batches: int, position_of_stage: Sequence[int],
                        caps: Sequence[int], forward: Sequence[int] | None = None,
                        input_grad: Sequence[int] | None = None,
                        weight_grad: Sequence[int] | None = None) -> list[list[Action]]:
    """Per-position orders of F, I and W from a list-scheduling run (pure; no I/O).

    Time advances in cost units (default 1 per action). A free worker runs, among what is ready:
    the I of its oldest micro-batch (the critical path; between stages of one micro-batch, the
    later stage), else a forward (the later stage first, so micro-batches reach the loss and
    free memory early) if it holds fewer than ``caps[position]`` micro-batch activations of its
    stages between F and W (a forward of a stage that is not the worker's last takes the last slot
    only while an activation of the last is live, so that the micro-batches in flight can always
    come back through it), else its oldest pending W; it idles only when none is ready.
    Forwards run in micro-batch order per stage, as do the I's. Every stage of one micro-batch
    sees the same data, so the result runs with the executor unchanged.

    Args:
        num_stages: stages of the model (2D for a V placement).
        num_micro_batches: N.
        position_of_stage: worker position of each stage.
        caps: per position, the most activations (stage × micro-batch, counted from F to W) held.
        forward, input_grad, weight_grad: per-stage costs (integers), default 1.

    Returns:
        One order per position.

    Raises:
        ValueError: a cap below 1, or the run cannot finish (caps too small for the placement).
    """
    s_count, n = num_stages, num_micro_batches
    positions = sorted(set(position_of_stage))
    cost = {F: list(forward or [1] * s_count), I: list(input_grad or [1] * s_count),
            W: list(weight_grad or [1] * s_count)}
    if any(c < 1 for c in caps):
        raise ValueError(f"caps={list(caps)}: every worker must hold at least one activation")
    held = {p: sorted((s for s in range(s_count) if position_of_stage[s] == p), reverse=True) for p in positions}
    f_end: dict[tuple[int, int], int] = {}
    i_end: dict[tuple[int, int], int] = {}
    next_f = [0] * s_count
    next_i = [0] * s_count
    pending_w: dict[int, list[tuple[int, int]]] = {p: [] for p in positions}  # heap of (j, s)
    live = dict.fromkeys(positions, 0)
    live_last = dict.fromkeys(positions, 0)  # of those, activations of the worker's last stage
    clock = dict.fromkeys(positions, 0)
    orders: dict[int, list[Action]] = {p: [] for p in positions}
    last = s_count - 1

    def f_ready(s: int, j: int) -> int | None:
        return 0 if s == 0 else f_end.get((s - 1, j))

    def i_ready(s: int, j: int) -> int | None:
        own = f_end.get((s, j))
        if own is None:
            return None
        if s == last:
            return own
        down = i_end.get((s + 1, j))
        return None if down is None else max(own, down)

    def _pick(p: int, t: int) -> tuple[ActionKind, int, int] | None:
        i_candidates = []
        for s in held[p]:
            j = next_i[s]
            if j < next_f[s] and (ready := i_ready(s, j)) is not None and ready <= t:
                i_candidates.append((j, -s))
        if i_candidates:
            j, neg_s = min(i_candidates)
            return I, -neg_s, j
        for s in held[p]:  # later stages first
            # An earlier stage takes the last slot only if a later-stage activation is live (its
            # I and W will free memory); else the micro-batches in flight could never come back
            # through the later stage's F: a memory deadlock.
            room = caps[p] - (1 if s != held[p][0] and not live_last[p] else 0)
            j = next_f[s]
            if live[p] < room and j < n and (ready := f_ready(s, j)) is not None and ready <= t:
                return F, s, j
        if pending_w[p]:
            j, s = heapq.heappop(pending_w[p])
            return W, s, j
        return None

    todo = {p: 3 * len(held[p]) * n for p in positions}
    now = 0
    while any(todo.values()):
        for p in positions:  # every free worker picks at `now`; what it picks only ends later
            if clock[p] > now or not todo[p]:
                continue
            choice = _pick(p, now)
            if choice is None:
                clock[p] = now
                continue
            kind, s, j = choice
            end = now + cost[kind][s]
            orders[p].append(Action(kind, s, j))
            if kind == F:
                f_end[(s, j)] = end
                next_f[s] += 1
                live[p] += 1
                live_last[p] += s == held[p][0]
            elif kind == I:
                i_end[(s, j)] = end
                next_i[s] += 1
                heapq.heappush(pending_w[p], (j, s))
            else:
                live[p] -= 1
                live_last[p] -= s == held[p][0]
            clock[p] = end
            todo[p] -= 1
        later = [c for c in clock.values() if c > now]
        if not later:
            if any(todo.values()):
                raise ValueError(f"greedy_split_orders: no worker can go on at time {now} "
                                 f"(caps={list(caps)} too small for this placement)")
            break
        now = min(later)
    return [orders[p] for p in positions]


def zb_v(num_stages: int, num_micro_batches: int, dp_width: int = 1, num_virtual: int = 2,
         merge: bool = True, order_costs: Sequence[float] | None = None, activation_memory: float = 1.0,
         stage_costs: Sequence[float] | None = None) -> Schedule:
    """ZB-V: two model chunks per worker in a V, F/I/W ordered by :func:`greedy_split_orders`.

    The model is cut into 2D stages; worker r holds stage r and stage 2D−1−r, so a micro-batch
    goes down the workers and back up, and worker 0 computes both the embeddings and the loss.
    Each worker holds at most 2D chunk activations between F and W (times ``activation_memory``):
    D micro-batches of its share of the model, 1F1B's peak on its first stage. With equal costs
    and N ≥ 2D the step is the lower bound N(F+I+W) + (D−1)·F/2 (F, I, W per worker-share;
    tests/test_zero_bubble.py); with the measured, unequal costs the greedy order is 0–8 % over it
    (bench/README.md, section 8, which also measures ``order_costs`` and ``activation_memory`` > 1).

    Note: ``num_stages`` is the number of *workers* per pipeline (the config's ``stages``); the
    returned ``Schedule.num_stages`` is 2D.

    Args:
        num_stages: D, workers per pipeline.
        num_micro_batches: N >= 2D.
        dp_width: W, data-parallel copies.
        num_virtual: model chunks per worker; must be 2 (the config's ``pipeline.num_virtual``).
        merge: merge adjacent I and W where nobody waits (:func:`merge_adjacent_backwards`).
        order_costs: relative (F, I, W) costs of a stage the list scheduler orders by (default
            equal; the config's ``pipeline.order_costs``).
        activation_memory: the activation bound as a multiple of 1F1B's peak (>= 1; the config's
            ``pipeline.activation_memory``).
        stage_costs: relative forward cost of each of the 2D stages (train.py passes the
            partition's estimate: the V's end stages hold the embeddings and the heads, whose costs
            differ widely); default equal. A stage's I and W scale with it by ``order_costs``.

    Raises:
        ValueError: N < 2D, num_virtual != 2, or a bad order_costs / activation_memory, with the fix.
    """
    check_v_shape("zb-v", num_stages, num_micro_batches, dp_width, num_virtual, alternative=" (or pipeline=zb-h1)")
    d, n = num_stages, num_micro_batches
    if not activation_memory >= 1.0:
        raise ValueError(f"pipeline.activation_memory={activation_memory!r}: the bound is a multiple of 1F1B's "
                         f"peak, at least 1.0 (1.5 gives zb-v's order more room)")
    cap = max(2 * d, int(2 * d * activation_memory))
    return capped_v_schedule("zb-v", d, n, dp_width, cap, merge, order_costs, stage_costs)


def capped_v_schedule(method: str, num_stages: int, num_micro_batches: int, dp_width: int, cap: int,
                      merge: bool = True, order_costs: Sequence[float] | None = None,
                      stage_costs: Sequence[float] | None = None) -> Schedule:
    """A V placement (worker r: stages r and 2D−1−r) ordered by :func:`greedy_split_orders` with every
    worker holding at most ``cap`` chunk activations between F and W: zb-v (cap 2D) and the
    memory-controlled V schedules of ``pipefisher.schedules.v_schedules`` (smaller caps).

    Args:
        method: ``Schedule.method`` of the result.
        num_stages, num_micro_batches, dp_width: D workers per pipeline, N, W (checked by the caller).
        cap: chunk activations a worker may hold (2D: 1F1B's peak).
        merge, order_costs, stage_costs: as for :func:`zb_v`.

    Raises:
        ValueError: a bad order_costs / stage_costs, or a cap the list scheduler cannot finish with.
    """
    d, n = num_stages, num_micro_batches
    f_cost, i_cost, w_cost = _integer_costs(order_costs)
    scale = [1.0] * (2 * d)
    if stage_costs is not None:
        if len(stage_costs) != 2 * d or min(stage_costs) <= 0:
            raise ValueError(f"stage_costs={list(stage_costs)}: give {2 * d} positive relative costs, one per stage")
        scale = [c / max(stage_costs) for c in stage_costs]
    positions = [v_position(s, d) for s in range(2 * d)]
    orders = greedy_split_orders(2 * d, n, positions, caps=[cap] * d,
                                 forward=[max(1, round(f_cost * x)) for x in scale],
                                 input_grad=[max(1, round(i_cost * x)) for x in scale],
                                 weight_grad=[max(1, round(w_cost * x)) for x in scale])
    schedule = Schedule(
        method=method,
        num_stages=2 * d,
        num_micro_batches=n,
        placement=linear_placement(2 * d, d, dp_width, positions.__getitem__),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=(0,) * n,
    )
    return merge_adjacent_backwards(schedule) if merge else schedule


def _integer_costs(order_costs: Sequence[float] | None) -> tuple[int, int, int]:
    """(F, I, W) relative costs as integers for the list scheduler (two significant digits)."""
    if order_costs is None:
        return 100, 100, 100
    values = [float(x) for x in order_costs]
    if len(values) != 3 or min(values) <= 0:
        raise ValueError(f"pipeline.order_costs={list(order_costs)!r}: give three positive relative costs "
                         f"[F, I, W] of a stage, e.g. [1.0, 1.2, 1.0] (bench/zero_bubble.py measures them)")
    unit = min(values) / 100
    return tuple(max(1, round(v / unit)) for v in values)  # type: ignore[return-value]


# -- merging -----------------------------------------------------------------------------------


def merge_adjacent_backwards(schedule: Schedule, everywhere: bool = False) -> Schedule:
    """Replace an I that its own W immediately follows on the worker by one full B.

    By default only where the I sends its activation gradient to no other worker (stage 0, or the
    upstream stage is on the same worker, like the turn of a V): there a full B delays nobody. A
    merged pair elsewhere would hold the activation gradient back by W's time while the upstream
    worker waits for it (simulated for zb-v, D=2, N=4, with I+W = 1.1 B: merging every adjacent
    pair made the step 9 % longer; see bench/README.md, "Zero-bubble schedules").
    Only adjacent pairs merge, so the order of everything else is unchanged. A pure pass on a
    compute-only schedule.

    Args:
        schedule: a compute-only schedule with I and W actions.
        everywhere: merge every adjacent pair, whoever waits for its gradient.
    """
    dp_of = {w: dp for (dp, _, _), w in schedule.placement.workers.items()}
    where = schedule.placement.workers
    actions = {}
    for w, acts in schedule.actions.items():
        out: list[Action] = []
        for a in acts:
            prev = out[-1] if out else None
            if (a.kind == W and prev is not None and prev.kind == I
                    and (prev.stage, prev.micro_batch, prev.pipe) == (a.stage, a.micro_batch, a.pipe)
                    and (everywhere or a.stage == 0 or where[(dp_of[w], a.pipe, a.stage - 1)] == w)):
                out[-1] = Action(ActionKind.BACKWARD, a.stage, a.micro_batch, a.pipe)
            else:
                out.append(a)
        actions[w] = tuple(out)
    return replace(schedule, actions=actions)
