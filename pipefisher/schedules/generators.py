"""Schedule generators: pure functions from a pipeline shape to per-worker orders of F and B.

Every generator has the signature ``(num_stages, num_micro_batches, dp_width=1, **options) ->
Schedule`` and returns compute actions only (``F``/``B``); the passes in
:mod:`pipefisher.schedules.passes` add communication, gradient synchronization and the optimizer
step. Adding a pipeline method means adding one function here and one entry in ``GENERATORS``.

Worker numbering (all methods): ``worker = dp * D + position`` for data-parallel group ``dp`` in
[0, W) and pipeline position in [0, D); every data-parallel group runs the same order on its own
micro-batches (micro-batch indices are per group).

Error messages name the config field (``stages``, ``num_micro_batches``, ``data_parallel``,
``pipeline.num_virtual``), its value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable

from pipefisher.schedules.chimera_doubling import chimera_doubling
from pipefisher.schedules.dualpipe import dualpipev
from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.shapes import bidirectional_placement, check_common, linear_placement, multiple_hint, replicate
from pipefisher.schedules.v_schedules import v_half, v_min
from pipefisher.schedules.zero_bubble import zb_h1, zb_v

__all__ = [
    "GENERATORS",
    "HOIST_POLICY",
    "GeneratorFn",
    "get_generator",
    "gpipe",
    "one_f_one_b",
    "chimera",
    "chimera_slots",
    "interleaved",
]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD

GeneratorFn = Callable[..., Schedule]


# -- GPipe -------------------------------------------------------------------------------------


def gpipe(num_stages: int, num_micro_batches: int, dp_width: int = 1) -> Schedule:
    """GPipe: every stage runs all N forwards, then all N backwards.

    Backwards run in ascending micro-batch order, as ``torch.distributed.pipelining``'s
    ``ScheduleGPipe`` does; with uniform costs descending order gives the same bubble,
    (D−1)/(N+D−1). Every stage holds N activations at its peak. With one stage there is no pipeline
    to fill: each micro-batch's F is followed by its B (one activation held, as one-process training
    does; the same sums in the same order), since every run, one process included, trains through
    the worker.

    Args:
        num_stages: D, pipeline stages (one worker each per data-parallel group).
        num_micro_batches: N >= 1, micro-batches per step per data-parallel group.
        dp_width: W, data-parallel copies of the whole pipeline.

    Returns:
        A compute-only schedule with D·W workers.
    """
    check_common(num_stages, num_micro_batches, dp_width)
    d, n = num_stages, num_micro_batches
    if d == 1:
        orders = [[a for j in range(n) for a in (Action(F, 0, j), Action(B, 0, j))]]
    else:
        orders = [[Action(F, s, j) for j in range(n)] + [Action(B, s, j) for j in range(n)] for s in range(d)]
    return Schedule(
        method="gpipe",
        num_stages=d,
        num_micro_batches=n,
        placement=linear_placement(d, d, dp_width, lambda s: s),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=(0,) * n,
    )


# -- 1F1B --------------------------------------------------------------------------------------


def _one_f_one_b_order(stage: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    warmup = min(num_stages - 1 - stage, num_micro_batches)
    order = [Action(F, stage, j) for j in range(warmup)]
    for i in range(num_micro_batches - warmup):
        order += [Action(F, stage, warmup + i), Action(B, stage, i)]
    order += [Action(B, stage, j) for j in range(num_micro_batches - warmup, num_micro_batches)]
    return order


def one_f_one_b(num_stages: int, num_micro_batches: int, dp_width: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): D−1−s warm-up forwards, then alternate F and B, then cool down.

    [Note: 1F1B]
    Same bubble as GPipe, (D−1)/(N+D−1), but stage s holds at most min(N, D−s) activations::

        D=3, N=4 (time →, equal F and B cost)
        W0: F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3
        W1: .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..
        W2: .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..

    Args:
        num_stages: D, pipeline stages (one worker each per data-parallel group).
        num_micro_batches: N >= 1, micro-batches per step per data-parallel group.
        dp_width: W, data-parallel copies of the whole pipeline.

    Returns:
        A compute-only schedule with D·W workers.
    """
    check_common(num_stages, num_micro_batches, dp_width)
    d, n = num_stages, num_micro_batches
    orders = [_one_f_one_b_order(s, d, n) for s in range(d)]
    return Schedule(
        method="1f1b",
        num_stages=d,
        num_micro_batches=n,
        placement=linear_placement(d, d, dp_width, lambda s: s),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=(0,) * n,
    )


# -- Chimera -----------------------------------------------------------------------------------


def chimera_slots(num_stages: int, num_micro_batches: int) -> dict[int, list[tuple[int, Action]]]:
    """Unit-cost time slot of every compute action of Chimera, per pipeline position.

    Micro-batch ``j`` lies in basic unit ``u = j // D`` at index ``k = j % D``; the first D/2 of a
    unit go down (pipe 0), the rest up (pipe 1), ``i = k mod D/2`` being the index within its pipe.
    Stage ``s`` of pipe 0 lives on position ``s``, stage ``s`` of pipe 1 on position ``D−1−s``.
    Slots (DESIGN.md, "Schedules"; Chimera paper, Sec. 3.2 and 3.5)::

        F(s) at 2D·u + s + 2i          B(s) at 2D·u + 2D−1−s + 2i

    See [Note: Chimera concatenation] in :func:`chimera` for why units are 2D slots apart.

    Args:
        num_stages: D, even.
        num_micro_batches: N, a multiple of D.

    Returns:
        ``{position: [(slot, action), ...]}`` sorted by slot.
    """
    d, n = num_stages, num_micro_batches
    half = d // 2
    slots: dict[int, list[tuple[int, Action]]] = {r: [] for r in range(d)}
    for j in range(n):
        unit, k = divmod(j, d)
        pipe, i = divmod(k, half)
        base = 2 * d * unit + 2 * i
        for s in range(d):
            pos = s if pipe == 0 else d - 1 - s
            slots[pos].append((base + s, Action(F, s, j, pipe)))
            slots[pos].append((base + 2 * d - 1 - s, Action(B, s, j, pipe)))
    for pos, entries in slots.items():
        entries.sort(key=lambda e: e[0])
        taken = [slot for slot, _ in entries]
        # Down and up actions of a position never share a slot (parities differ; see the Note).
        assert len(set(taken)) == len(taken), f"chimera slot clash on position {pos}"
    return slots


def chimera(num_stages: int, num_micro_batches: int, dp_width: int = 1) -> Schedule:
    """Chimera: two pipelines in opposite directions over the same D workers.

    Worker ``dp·D + r`` holds stage r of the down pipeline (pipe 0) and stage D−1−r of the up
    pipeline (pipe 1). Each basic unit of D micro-batches sends D/2 down and D/2 up.

    [Note: Chimera concatenation]
    For N > D the basic units are concatenated with unit u shifted by exactly 2D slots, so the
    forwards of unit u+1 fill the idle tail of unit u (the Chimera paper's "direct
    concatenation", Sec. 3.5, Fig. 6a). A worker does 2D slots of work per unit, so with equal F
    and B cost the step takes 2N + D − 2 slots and the bubble is (D−2)/(2N+D−2) for every N.
    Placing unit u+1 after unit u has fully drained would cost (D−2) idle slots per unit instead.
    The shifted slots never clash (a position's F-down and B-up slots have the parity of r, its
    F-up and B-down slots the other parity, and unit u ends before unit u+1's same-parity work
    starts), so the order is the slot order; ``chimera_slots`` asserts it. D=4, N=8 (F = B = 1
    unit; the down pipe carries 0, 1, 4, 5 and the up pipe 2, 3, 6, 7; ``.`` = bubble)::

        W0  F0 F1 .  F2 B2 F3 B3 B0 F4 B1 F5 F6 B6 F7 B7 B4 .  B5
        W1  .  F0 F2 F1 F3 B2 B0 B3 B1 F4 F6 F5 F7 B6 B4 B7 B5 .
        W2  .  F2 F0 F3 F1 B0 B2 B1 B3 F6 F4 F7 F5 B4 B6 B5 B7 .
        W3  F2 F3 .  F0 B0 F1 B1 B2 F6 B3 F7 F4 B4 F5 B5 B6 .  B7     bubble 2/18

    With B = 2F the fixed slot order leaves gaps where units meet (simulated bubble for D=8,
    N=32: 0.24 against 1F1B's 0.18); the paper's forward doubling (Sec. 3.5, :func:`chimera_doubling`)
    closes them, and its backward halving is that schedule on half-size micro-batches.

    Peak activations per worker for one unit are D/2+1 .. D .. D/2+1 (D=8: 5 6 7 8 8 7 6 5).

    Args:
        num_stages: D, even (two pipelines of D stages share D workers).
        num_micro_batches: N, a multiple of D (whole basic units).
        dp_width: W, data-parallel copies of the Chimera pair.

    Returns:
        A compute-only schedule with D·W workers and two pipes.

    Raises:
        ValueError: D odd, or N not a multiple of D.
    """
    check_common(num_stages, num_micro_batches, dp_width)
    d, n = num_stages, num_micro_batches
    if d % 2:
        options = " or ".join(f"stages={x}" for x in (d - 1, d + 1) if x >= 2)
        raise ValueError(f"stages={d}: chimera needs an even number of stages; use {options}")
    if n % d:
        raise ValueError(
            f"num_micro_batches={n}: chimera needs a multiple of stages={d} (whole basic units); "
            f"use {multiple_hint(n, d)}"
        )
    slots = chimera_slots(d, n)
    orders = [[a for _, a in slots[r]] for r in range(d)]
    half = d // 2
    return Schedule(
        method="chimera",
        num_stages=d,
        num_micro_batches=n,
        placement=bidirectional_placement(d, dp_width),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=tuple((j % d) // half for j in range(n)),
    )


# -- interleaved 1F1B --------------------------------------------------------------------------


def _interleaved_order(rank: int, num_workers: int, num_micro_batches: int,
                       num_virtual: int) -> list[Action]:
    d, n, v = num_workers, num_micro_batches, num_virtual
    total = n * v

    def action(kind: ActionKind, k: int) -> Action:
        chunk = (k // d) % v
        if kind == B:
            chunk = v - 1 - chunk
        micro_batch = (k // (d * v)) * d + k % d
        return Action(kind, chunk * d + rank, micro_batch)

    warmup = (d - rank - 1) * 2 + (v - 1) * d if v > 1 else d - rank - 1
    warmup = min(warmup, total)
    order = [action(F, k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action(F, warmup + i), action(B, i)]
    order += [action(B, k) for k in range(total - warmup, total)]
    return order


def interleaved(num_stages: int, num_micro_batches: int, dp_width: int = 1,
                num_virtual: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): v model chunks per worker.

    The model is cut into D·v stages; stage k lives on worker ``dp·D + k mod D`` (chunk k // D).
    Forwards go through micro-batches in groups of D: chunk 0 of the group, then chunk 1, …;
    backwards take the chunks in reverse. Worker r warms up with 2(D−1−r) + (v−1)·D forwards
    (Megatron's ``num_warmup_microbatches``), then alternates F and B. The bubble shrinks to about
    (D−1)/(v·N+D−1) at the price of v times more messages.

    Note: ``num_stages`` is the number of *workers* per pipeline (the config's ``stages``); the
    returned ``Schedule.num_stages`` is D·v.

    Args:
        num_stages: D, workers per pipeline.
        num_micro_batches: N, a multiple of D when v > 1.
        dp_width: W, data-parallel copies.
        num_virtual: v >= 1, model chunks per worker (v = 1 is plain 1F1B).

    Returns:
        A compute-only schedule with D·W workers and D·v stages.
    """
    check_common(num_stages, num_micro_batches, dp_width)
    d, n, v = num_stages, num_micro_batches, num_virtual
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"pipeline.num_virtual={v!r}: must be a positive integer; use 2 or more")
    if v > 1 and n % d:
        raise ValueError(
            f"num_micro_batches={n}: interleaved needs a multiple of stages={d}; "
            f"use {multiple_hint(n, d)}"
        )
    orders = [_interleaved_order(r, d, n, v) for r in range(d)]
    return Schedule(
        method="interleaved",
        num_stages=d * v,
        num_micro_batches=n,
        placement=linear_placement(d * v, d, dp_width, lambda k: k % d),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=(0,) * n,
    )


# -- registry ----------------------------------------------------------------------------------

GENERATORS: dict[str, GeneratorFn] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "chimera": chimera,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zb-v": zb_v,
    "chimera-doubling": chimera_doubling,  # pipeline=chimera pipeline.chimera_stacking=doubling
    "dualpipev": dualpipev,
    "v-half": v_half,
    "v-min": v_min,
}
# Receive hoisting per method (passes, [Note: hoisting the nearest receive]); default earliest_send.
# DualPipeV: simulated with B = 2F at D=8, N=32 the earliest-send receives stretch its step by 25 %
# over its compute order, the nearest-consumer ones by 5 % (zb-v, v-half, v-min: earliest_send is better).
HOIST_POLICY: dict[str, str] = {"chimera-doubling": "nearest_consumer", "dualpipev": "nearest_consumer"}


def get_generator(method: str) -> GeneratorFn:
    """The generator registered under ``method``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return GENERATORS[method]
    except KeyError:
        valid = ", ".join(GENERATORS)
        raise ValueError(f"pipeline.method={method!r}: unknown schedule; use one of {valid}") from None
