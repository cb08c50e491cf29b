"""Memory-controlled V schedules (Qi, Wan, Amar, Lin: "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024, arXiv 2405.15362): the V placement of zb-v with less activation memory.

[Note: controllable memory]
The paper builds a schedule by repeating one micro-batch's "building block"; the block's lifespan
fixes the peak activation memory. On the V placement (worker r holds stages r and 2D−1−r) it
gives a family between two ends. Its figures, F = I = W, p = D workers, m = N micro-batches,
memory in micro-batches of a worker's share of the model (1F1B: p)::

    schedule   activation memory   bubble rate
    1F1B       p                   ~ p/m
    V-Min      (p+4) // 3          ~ 2p/3m
    V-Half     (p+2) // 2          ~ p/2m
    V-ZB       p                   0            (zb-v here)

Here the V schedules come from one list scheduler, :func:`greedy_split_orders` (zb-v's), given the
paper's memory as its cap: a chunk is half a worker's share, so the cap is twice the figure above in
chunk activations (:func:`v_half_cap`, :func:`v_min_cap`). The orders are the scheduler's, not the
paper's building blocks: simulated with F = I = W per chunk and N = 4D, the step's idle time is
(1F1B's is 6(D−1) chunk units there)::

    D   zb-v (2D)   V-Half         V-Min          1F1B
    4   3           5  (cap 6)     13 (cap 4)     18
    8   7           27 (cap 10)    33 (cap 8)     42

so V-Half has 0.28× (D=4) and 0.64× (D=8) of 1F1B's bubble at (p+2)/2p of its memory, and V-Min
0.72× and 0.79× at (p+4)/3p. The paper's rates are leading order in p: in idle time (rate × m(F+B+W),
6 chunk units a micro-batch) V-Half 3p, V-Min 4p, 1F1B 6p (exactly 6(p−1), which is why the ratios to
1F1B's exact bubble look worse than 1/2 and 2/3). Against 3p and 4p: at most that for D = 3, 4, 5
(and V-Half at D=6); 3 and 1 units over at D=8 (27 and 33), the greedy order not reaching the paper's
hand-placed blocks; V-Min at D=6 (cap 6) idles 25, 33, 49 at N = 2D, 4D, 8D, growing with N, above
1F1B's 30 — a known defect of the list scheduler under that cap (tests/test_v_schedules.py holds every
figure; docs/schedules.md). For D ≤ 2 both caps equal zb-v's 2D (the formulas give p), so
the schedules are zb-v's order.

ZB-H2 (one stage per worker, no bubble at about 2p micro-batches) is not built: any one-chunk
schedule needs at least N(F+I+W) + (D−1)·F per worker share, which zb-v reaches within (D−1)·F/2 at
p micro-batches, so on the memory / step-time front zb-v dominates it.

The front with the built schedules (receives placed by ``passes``, which cost the V schedules up to 11 %
over their compute orders at D=8): ``python -m pipefisher.planning.front``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipefisher.schedules.ir import Schedule
from pipefisher.schedules.shapes import check_v_shape
from pipefisher.schedules.zero_bubble import capped_v_schedule

__all__ = ["V_METHODS", "v_half", "v_half_cap", "v_min", "v_min_cap"]

V_METHODS = ("zb-v", "dualpipev", "v-half", "v-min")  # two chunks per worker in a V (stages r, 2D-1-r)


def v_half_cap(num_stages: int) -> int:
    """V-Half's activation bound in chunk activations: 2·⌊(D+2)/2⌋ (the paper's (p+2)//2 micro-batches)."""
    return min(2 * num_stages, 2 * ((num_stages + 2) // 2))


def v_min_cap(num_stages: int) -> int:
    """V-Min's activation bound in chunk activations: 2·⌊(D+4)/3⌋ (the paper's (p+4)//3 micro-batches)."""
    return min(2 * num_stages, 2 * ((num_stages + 4) // 3))


def _v(method: str, cap: int, num_stages: int, num_micro_batches: int, dp_width: int, num_virtual: int,
       merge: bool, order_costs: Sequence[float] | None, stage_costs: Sequence[float] | None) -> Schedule:
    check_v_shape(method, num_stages, num_micro_batches, dp_width, num_virtual)
    return capped_v_schedule(method, num_stages, num_micro_batches, dp_width, cap, merge, order_costs, stage_costs)


def v_half(num_stages: int, num_micro_batches: int, dp_width: int = 1, num_virtual: int = 2, merge: bool = True,
           order_costs: Sequence[float] | None = None, stage_costs: Sequence[float] | None = None) -> Schedule:
    """V-Half: the V ordered under about half of 1F1B's activation memory ([Note: controllable memory]).

    Args:
        num_stages: D, workers per pipeline (the returned schedule has 2D stages).
        num_micro_batches: N >= 2D.
        dp_width: W, data-parallel copies.
        num_virtual: must be 2.
        merge: merge an I and its own W that run back to back where nobody waits for the gradient.
        order_costs, stage_costs: relative costs the list scheduler orders by, as for zb-v.

    Returns:
        A compute-only schedule (``method="v-half"``) whose workers hold at most
        :func:`v_half_cap` chunk activations.

    Raises:
        ValueError: N < 2D or num_virtual != 2, naming the field and the fix.
    """
    return _v("v-half", v_half_cap(num_stages), num_stages, num_micro_batches, dp_width, num_virtual, merge,
              order_costs, stage_costs)


def v_min(num_stages: int, num_micro_batches: int, dp_width: int = 1, num_virtual: int = 2, merge: bool = True,
          order_costs: Sequence[float] | None = None, stage_costs: Sequence[float] | None = None) -> Schedule:
    """V-Min: the V ordered under about a third of 1F1B's activation memory ([Note: controllable memory]).

    Arguments as :func:`v_half`; workers hold at most :func:`v_min_cap` chunk activations
    (``method="v-min"``).
    """
    return _v("v-min", v_min_cap(num_stages), num_stages, num_micro_batches, dp_width, num_virtual, merge,
              order_costs, stage_costs)
