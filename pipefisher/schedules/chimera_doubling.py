"""Chimera with forward doubling (Li & Hoefler, SC'21, Sec. 3.5): every forward slot runs two
micro-batches back to back, so one F slot costs about one B when B ≈ 2F.

[Note: forward doubling]
Direct concatenation (:func:`pipefisher.schedules.generators.chimera`) fixes every action to a slot
of unit cost; with B = 2F the slots of the forwards are half empty and the units meet with gaps
(simulated bubble 0.20 at D=4, N=8; 0.24 at D=8, N=32, worse than 1F1B's 0.18). Doubling gives a
unit 2D micro-batches per worker: the first D of unit u go down (pipe 0), the next D up (pipe 1),
and forwards run in pairs. Worker r's "own" pipe P is the one whose early stage it holds (down for
r < D/2, up otherwise; its stage there is s = min(r, D−1−r)), Q the other. With a = D/2 − s
(the public code's |D/2 − stage|, +1 on the second half), b = D/2 − a and c = b + D/2, a unit is::

    a × (F_P, F_P)          later units: a × (B_P, F_P, F_P), the B_P the previous unit's tail
    b × (F_Q, F_Q, F_P, F_P)
    a × (F_Q, F_Q, B_Q)
    c × (B_P, B_Q)
    tail: a × B_P           (after the last unit)

Forwards and backwards of a pipe run in ascending micro-batch order. D=4, N=8 (down 0–3, up 4–7)::

    W0  F0 F1 F2 F3 F4 F5 B4 F6 F7 B5 B0 B6 B1 B7 B2 B3
    W1  F0 F1 F4 F5 F2 F3 F6 F7 B4 B0 B5 B1 B6 B2 B7 B3
    W2  F4 F5 F0 F1 F6 F7 F2 F3 B0 B4 B1 B5 B2 B6 B3 B7
    W3  F4 F5 F6 F7 F0 F1 B0 F2 F3 B1 B4 B2 B5 B3 B6 B7

With B = 2F the simulated bubble is (D−2)/(2N+D−2), Chimera's ideal, at every D and N (a multiple
of 2D): 0.111 at D=4, N=8 and 0.086 at D=8, N=32, where direct concatenation leaves 0.20 and 0.24.
The built schedule keeps it only when its receives are hoisted with ``hoist="nearest_consumer"``
([Note: hoisting the nearest receive] in ``passes``). The price is memory: a worker holds D more
activations than direct concatenation (D=4: 7 8 8 7 against 3 4 4 3; :func:`chimera_doubling_peaks`),
which is why the public code recomputes (``recompute=true`` here).
"""

from __future__ import annotations

from collections.abc import Iterator

from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.shapes import bidirectional_placement, check_common, replicate

__all__ = ["chimera_doubling", "chimera_doubling_order", "chimera_doubling_peaks"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD


def _unit_phases(position: int, d: int, unit: int, first: bool,
                 carried: list[Action]) -> tuple[list[Action], list[Action]]:
    """One unit of ``position``'s order ([Note: forward doubling]) and its tail of B_P."""
    half = d // 2
    own = 0 if position < half else 1  # P
    s = min(position, d - 1 - position)  # P's stage on this worker; Q's is D-1-s
    a = half - s
    b, c = half - a, half - a + half

    def stream(kind: ActionKind, pipe: int) -> Iterator[Action]:
        stage = s if pipe == own else d - 1 - s
        base = 2 * d * unit + pipe * d
        return iter(Action(kind, stage, base + k, pipe) for k in range(d))

    fp, fq, bp, bq = stream(F, own), stream(F, 1 - own), stream(B, own), stream(B, 1 - own)
    order: list[Action] = []
    for i in range(a):
        order += ([] if first else [carried[i]]) + [next(fp), next(fp)]
    for _ in range(b):
        order += [next(fq), next(fq), next(fp), next(fp)]
    for _ in range(a):
        order += [next(fq), next(fq), next(bq)]
    for _ in range(c):
        order += [next(bp), next(bq)]
    return order, list(bp)


def chimera_doubling_order(position: int, num_stages: int, num_micro_batches: int) -> list[Action]:
    """The compute order of pipeline position ``position`` ([Note: forward doubling])."""
    order: list[Action] = []
    tail: list[Action] = []
    for unit in range(num_micro_batches // (2 * num_stages)):
        phases, tail = _unit_phases(position, num_stages, unit, unit == 0, tail)
        order += phases
    return order + tail


def chimera_doubling(num_stages: int, num_micro_batches: int, dp_width: int = 1) -> Schedule:
    """Chimera with forward doubling: Chimera's two pipes and placement, forwards in pairs.

    Worker ``dp·D + r`` holds stage r of the down pipe and stage D−1−r of the up pipe, as in
    :func:`~pipefisher.schedules.generators.chimera`; micro-batch j goes down when
    ``j mod 2D < D``. Order and bubble: [Note: forward doubling].

    Args:
        num_stages: D, even.
        num_micro_batches: N, a multiple of 2D (whole doubled units).
        dp_width: W, data-parallel copies of the Chimera pair.

    Returns:
        A compute-only schedule with D·W workers and two pipes (``method="chimera-doubling"``).

    Raises:
        ValueError: D odd, or N not a multiple of 2D, naming the field and the fix.
    """
    check_common(num_stages, num_micro_batches, dp_width)
    d, n = num_stages, num_micro_batches
    if d % 2:
        options = " or ".join(f"stages={x}" for x in (d - 1, d + 1) if x >= 2)
        raise ValueError(f"stages={d}: chimera needs an even number of stages; use {options}")
    if n % (2 * d):
        lower = n // (2 * d) * 2 * d
        hint = f"{lower} or {lower + 2 * d}" if lower else f"{2 * d}"
        raise ValueError(f"num_micro_batches={n}: chimera with pipeline.chimera_stacking=doubling needs a "
                         f"multiple of 2 x stages = {2 * d}; use num_micro_batches={hint}, or "
                         f"pipeline.chimera_stacking=direct")
    orders = [chimera_doubling_order(r, d, n) for r in range(d)]
    return Schedule(
        method="chimera-doubling",
        num_stages=d,
        num_micro_batches=n,
        placement=bidirectional_placement(d, dp_width),
        actions=replicate(orders, dp_width),
        pipe_of_micro_batch=tuple((j % (2 * d)) // d for j in range(n)),
    )


def chimera_doubling_peaks(num_stages: int) -> list[int]:
    """Most micro-batch activations each position holds (``simulate.peak_activations``), at any N.

    3D/2 + 1 + s with s = min(r, D−1−r): D=4: 7 8 8 7, D=8: 13 14 15 16 16 15 14 13; direct
    concatenation holds D/2 + 1 + s (3 4 4 3), so doubling adds D per worker and reaches 2D in the
    middle. ``check_schedule(..., max_activations=...)`` holds a schedule to such a bound.
    """
    d = num_stages
    return [3 * d // 2 + 1 + min(r, d - 1 - r) for r in range(d)]
