"""The memory / step-time front of the pipeline schedules (issue 26, item 3): simulated step time
against peak activation memory, per schedule, at one D and N.

    python -m pipefisher.planning.front                      # D=4 and D=8, N=4D, both cost sets below
    python -m pipefisher.planning.front --stages 8 --micro-batches 32 --costs 185 332 161 217

Costs are per worker share of the model (a V schedule's chunk costs half): F, a full backward B, and
the split backward's I and W. Two sets are printed by default: the zero-bubble paper's F = I = W with
B = I + W = 2F, and bert-medium's as measured on this CPU (``bench/zero_bubble.py --quick --model
bert-medium``: F 185, B 332, I 161, W 217 ms, issue 26), where a split costs (I+W)/B = 1.14 of a full
backward. Communication is free and nothing overlaps (one core per worker). The step is the built
schedule's (what train.py runs: its receives wait where the passes put them, [Note: hoisting the
nearest receive]); the compute order's own step (each action as soon as its inputs exist) is shown
beside it: the difference is what the receive placement costs. Memory is the most
activations a worker holds between F and its B or W (``simulate.peak_activations``), as a fraction of
1F1B's peak (D shares): a chunk activation is half a share.

A schedule is on the front when no other one is at most as slow and holds at most as much, one of
the two strictly.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipefisher.schedules import Schedule, build_schedule
from pipefisher.simulate import CostModel, peak_activations, simulate

__all__ = ["FRONT_METHODS", "FrontPoint", "format_front", "memory_step_front"]

FRONT_METHODS = ("1f1b", "zb-h1", "zb-v", "dualpipev", "v-half", "v-min")
EQUAL_COSTS = (1.0, 2.0, 1.0, 1.0)  # F, B, I, W per worker share
MEASURED_COSTS = (185.0, 332.0, 161.0, 217.0)  # bert-medium on this CPU (issue 26), ms
_V = ("zb-v", "dualpipev", "v-half", "v-min")


@dataclass(frozen=True)
class FrontPoint:
    """One schedule's simulated step and memory.

    Attributes:
        method: the schedule.
        step: simulated step time of the built schedule, in the cost unit.
        step_vs_1f1b: step / 1F1B's step at the same D, N and costs.
        order_step_vs_1f1b: the compute order's step (receives as data dependencies) / 1F1B's.
        memory_vs_1f1b: peak activations of the most loaded worker / 1F1B's (D shares).
        on_front: no other point dominates it.
    """

    method: str
    step: float
    step_vs_1f1b: float
    order_step_vs_1f1b: float
    memory_vs_1f1b: float
    on_front: bool


def _cost(num_stages: int, chunks: int, costs: Sequence[float]) -> CostModel:
    f, b, i, w = (round(1000 * c / chunks) for c in costs)
    return CostModel.uniform(num_stages, f, b, input_grad_ns=i, weight_grad_ns=w)


def _span(schedule: Schedule, cost: CostModel) -> float:
    events = simulate(schedule, cost)
    return (max(e.end_ns for e in events) - min(e.start_ns for e in events)) / 1000


def memory_step_front(num_stages: int, num_micro_batches: int, costs: Sequence[float] = EQUAL_COSTS,
                      methods: Sequence[str] = FRONT_METHODS) -> list[FrontPoint]:
    """Simulate each method's built schedule (what train.py runs: merged I+W where nobody waits).

    Args:
        num_stages: D workers.
        num_micro_batches: N (>= 2D for the V schedules).
        costs: (F, B, I, W) of one worker share; a V chunk costs half of each.
        methods: schedules to compare; 1F1B is the reference and always simulated.

    Returns:
        One point per method, in the given order.
    """
    d, n = num_stages, num_micro_batches
    raw = {}
    for m in dict.fromkeys(("1f1b", *methods)):
        chunks = 2 if m in _V else 1
        schedule = build_schedule(m, d, n, num_virtual=chunks)
        cost = _cost(schedule.num_stages, chunks, costs)
        order = replace(schedule, actions={w: tuple(a for a in acts if a.kind.is_compute)
                                           for w, acts in schedule.actions.items()})
        raw[m] = (_span(schedule, cost), _span(order, cost), max(peak_activations(schedule).values()) / chunks / d)
    points = []
    for m in methods:
        step, order_step, mem = raw[m]
        dominated = any(s <= step and x <= mem and (s < step or x < mem) for o, (s, _, x) in raw.items() if o != m)
        points.append(FrontPoint(m, step, step / raw["1f1b"][0], order_step / raw["1f1b"][1], mem, not dominated))
    return points


def format_front(points: Sequence[FrontPoint], title: str) -> str:
    """A markdown table of ``points``."""
    lines = [title, "", "| schedule | step / 1F1B's | compute order's step / 1F1B's | activation memory / 1F1B's "
             "| on the front |", "|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p.method} | {p.step_vs_1f1b:.3f} | {p.order_step_vs_1f1b:.3f} | {p.memory_vs_1f1b:.2f} "
                     f"| {'yes' if p.on_front else 'no'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the front tables (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pipefisher.planning.front", description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--micro-batches", type=int, default=None, help="N (default 4 x stages)")
    parser.add_argument("--costs", type=float, nargs=4, default=None, metavar=("F", "B", "I", "W"),
                        help="per worker share (default: both built-in sets)")
    args = parser.parse_args(argv)
    sets = [("F = I = W, B = 2F", EQUAL_COSTS), ("bert-medium measured here (F 185, B 332, I 161, W 217 ms)",
                                                  MEASURED_COSTS)] if args.costs is None else [("given costs", args.costs)]
    for d in args.stages:
        n = args.micro_batches or 4 * d
        for name, costs in sets:
            print(format_front(memory_step_front(d, n, costs), f"D={d}, N={n}, {name}; simulated, no communication"))
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
