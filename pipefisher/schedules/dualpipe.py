"""DualPipeV (DeepSeek-V3 technical report, arXiv 2412.19437, Sec. 3.2.1; torch 2.13's
``ScheduleDualPipeV``): two model chunks per worker in a V, the backward split where it fills a gap.

[Note: DualPipeV]
DualPipe runs two pipes in opposite directions over PP ranks, each rank holding a chunk of both
(2× the parameters). DualPipeV folds it in half: D workers, 2D stages, worker r holds stage r (its
"down" chunk, s0) and stage 2D−1−r (its "up" chunk, s1), the V placement of zb-v
(:func:`~pipefisher.schedules.zero_bubble.v_position`). The two directions of DualPipe become the
two arms of the V, so every micro-batch enters at worker 0's stage 0 and leaves at its stage 2D−1;
what remains of "both ends" is that every worker interleaves work of both arms. Worker r's order, in
eight phases (torch's ``_calculate_single_rank_operations``; N ≥ 2D)::

    1  2(D−1−r) × F(s0)
    2  (r+1)    × F(s0) F(s1)
    3  (D−1−r)  × I(s1) W F(s1)
    4  (N−2D+r+1) × F(s0) B(s1) F(s1) B(s0)      "F&B": a forward beside another micro-batch's backward
    5  (D−1−r)  × B(s1) F(s1) B(s0)
    6  (r+1)    × x(s1) x(s0)                    x = B for the first half, then I (r odd: from
                                                 pair ⌊(r+1)/2⌋ on; r even: s0 of that pair on)
    7  (D−1−r)  × W I(s0)
    8  (r+1)    × W

Forwards and input backwards of each stage run in micro-batch order; each ``W`` is the oldest
pending one (the I's in the order they ran). DeepSeek overlaps the two halves of an "F&B" pair
(one's communication behind the other's compute); torch's implementation "doesn't perform the
actual overlap" and neither does this one: on one CPU core per worker F&B costs F + B. D=2, N=4::

    W0  0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
    W1  1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3

(before merging: :func:`~pipefisher.schedules.zero_bubble.merge_adjacent_backwards` then joins W0's
``0I2 0W2`` and ``0I3 0W3`` into ``0B2`` and ``0B3``, stage 0's gradient going nowhere; ``3I0 3W0``
stays split, since stage 2 on W1 waits for 3I0's gradient.)

Simulated step with equal chunk costs F = I = W (B = I + W), no overlap and no communication cost:
N·2(F+I+W) + (D−1)·F, the synchronous lower bound, as zb-v (tests/test_dualpipev.py). DeepSeek's
bubble (PP/2−1)(F&B + B − 3W) counts PP = DualPipe's ranks = 2D here, and charges every F&B block to
the critical path; with F&B = F + B it gives (D−1)(F + 2B − 3W) = 2(D−1)F at equal costs, twice what
the order needs here: in the executed order the F of each pair lies off the critical path (the
backwards chain through the V does not wait for it).
"""

from __future__ import annotations

from collections import deque

from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.shapes import check_v_shape, linear_placement, replicate
from pipefisher.schedules.zero_bubble import merge_adjacent_backwards, v_position

__all__ = ["dualpipev", "dualpipev_order"]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the IR's name
W = ActionKind.BACKWARD_WEIGHT


def dualpipev_order(position: int, num_workers: int, num_micro_batches: int) -> list[Action]:
    """The compute order of worker ``position`` ([Note: DualPipeV]), before merging.

    Args:
        position: r in [0, D).
        num_workers: D.
        num_micro_batches: N >= 2D.

    Returns:
        F, B, I and W actions of stages r and 2D−1−r.
    """
    d, n, r = num_workers, num_micro_batches, position
    down, up = r, 2 * d - 1 - r
    next_f = {down: 0, up: 0}
    next_b = {down: 0, up: 0}  # next micro-batch of the stage's input backward (B or I)
    pending_w: deque[tuple[int, int]] = deque()
    order: list[Action] = []

    def forward(stage: int) -> None:
        order.append(Action(F, stage, next_f[stage]))
        next_f[stage] += 1

    def backward(stage: int, split: bool) -> None:
        j = next_b[stage]
        order.append(Action(I if split else B, stage, j))
        if split:
            pending_w.append((stage, j))
        next_b[stage] += 1

    def weight() -> None:
        if pending_w:
            stage, j = pending_w.popleft()
            order.append(Action(W, stage, j))

    for _ in range(2 * (d - 1 - r)):  # 1
        forward(down)
    for _ in range(r + 1):  # 2
        forward(down)
        forward(up)
    for _ in range(d - 1 - r):  # 3
        backward(up, split=True)
        weight()
        forward(up)
    for _ in range(n - 2 * d + r + 1):  # 4
        forward(down)
        backward(up, split=False)
        forward(up)
        backward(down, split=False)
    for _ in range(d - 1 - r):  # 5
        backward(up, split=False)
        forward(up)
        backward(down, split=False)
    split = False
    for i in range(r + 1):  # 6: the second half splits its backwards
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(up, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(down, split)
    for _ in range(d - 1 - r):  # 7
        weight()
        backward(down, split=True)
    for _ in range(r + 1):  # 8
        weight()
    assert not pending_w, f"dualpipev: W left pending on worker {r}"
    return order


def dualpipev(num_stages: int, num_micro_batches: int, dp_width: int = 1, num_virtual: int = 2,
              merge: bool = True) -> Schedule:
    """DualPipeV: the V placement of zb-v with DeepSeek's fixed order ([Note: DualPipeV]).

    The order equals torch 2.13's ``ScheduleDualPipeV.pipeline_order`` action for action (with each
    ``OVERLAP_F_B`` as its forward then its backward) when ``merge=False``
    (tests/test_dualpipev.py); ``merge=True`` joins an I and its own W that run back to back where
    no other worker waits for the gradient (:func:`merge_adjacent_backwards`).

    Note: ``num_stages`` is the number of *workers* per pipeline (the config's ``stages``); the
    returned ``Schedule.num_stages`` is 2D.

    Args:
        num_stages: D, workers per pipeline.
        num_micro_batches: N >= 2D (torch refuses fewer micro-batches than stages, 2D).
        dp_width: W, data-parallel copies.
        num_virtual: model chunks per worker; must be 2 (the config's ``pipeline.num_virtual``).
        merge: merge adjacent I and W where nobody waits.

    Returns:
        A compute-only schedule with D·W workers and 2D stages (``method="dualpipev"``).

    Raises:
        ValueError: N < 2D or num_virtual != 2, naming the field and the fix.
    """
    check_v_shape("dualpipev", num_stages, num_micro_batches, dp_width, num_virtual,
                  why="micro-batches (one per model stage)")
    d, n = num_stages, num_micro_batches
    positions = [v_position(s, d) for s in range(2 * d)]
    schedule = Schedule(
        method="dualpipev",
        num_stages=2 * d,
        num_micro_batches=n,
        placement=linear_placement(2 * d, d, dp_width, positions.__getitem__),
        actions=replicate([dualpipev_order(r, d, n) for r in range(d)], dp_width),
        pipe_of_micro_batch=(0,) * n,
    )
    return merge_adjacent_backwards(schedule) if merge else schedule
