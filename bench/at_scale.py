"""At scale, by simulation: bubble utilization and step time of BERT-Base/-Large pipelines with and without PipeFisher.

    python bench/at_scale.py                           # base + large, D = 8, 16, 32, N = D and 4D: ~2 min
    python bench/at_scale.py --quick                   # D = 8, N = D only: ~5 s
    python bench/at_scale.py --stages 8,12,16,24,32    # also the largest D each model allows: ~5 min

Nothing here is measured: every figure is the simulator's (``pipefisher.simulate``) under the
planner's FLOP-based cost model (``pipefisher.planning.estimate_run_costs(RunShape, Hardware())``:
an A100/H100-class device at 1e14 FLOP/s, 50 GB/s between stages; one data-parallel group, W = 1).
For each model, method, D and N the table gives

- ``closed``: the closed-form utilization of DESIGN.md, 1 − (D−1)/(N+D−1) for GPipe and 1F1B,
  1 − (D−2)/(2N+D−2) for Chimera (equal stages, F = B, free communication);
- ``sim F=B``: the simulator under exactly those assumptions (a check: it must equal ``closed``);
  ``sim stages``: the simulator with the cost model's F and B of each stage, communication and the
  optimizer step still free (what stage imbalance and B = 2F alone cost);
- ``nvlamb`` / ``pipefisher`` utilization: the simulated step under the cost model without and
  with the K-FAC work the planner (``plan_pipefisher``) put into the bubbles; K-FAC work counts as
  busy. These are lower than ``closed`` because stages are not equal (a stage holds a whole number
  of encoder layers, the first the embeddings, the last the heads: ``enc/stage``), B = 2F, and
  stage-to-stage messages are not free (16 MiB per BERT-Large micro-batch here, 0.34 ms, against
  about 1 ms for the forward of one encoder layer);
- ``k``: the refresh interval the planner chose (smallest k whose bubbles hold one refresh; if none
  up to ``--max-interval`` does, the k with the least work spilled per step; "k (cp)" where the
  plan was predicted slower than the same refresh on the critical path, which it then uses),
  ``spill``: K-FAC work per step that found no bubble though an empty step's bubbles would hold
  it, ``tail``: work no k hides: curvature of a worker's last backwards, which has no bubble after
  it, and the part of a layer's curvature that outgrows one step's bubbles (with N >> D) and found
  no room (both in ms per step, averaged over the workers; both run before the optimizer step; they
  and the preconditioning, which runs before every step, are why pipefisher's step is longer than
  nvlamb's);
- predicted step times: nvlamb; kfac with all K-FAC work on the critical path, refreshed every step
  (k=1) and every k steps (the same staleness as PipeFisher); pipefisher;
- ``plan s``: wall time of planning and predicting that row here.

A shape with more stages than encoder layers cannot be built (``partition_layers`` gives every
stage at least one layer) and is reported as not possible.
"""

from __future__ import annotations

import argparse
import time

import _harness as h
from pipefisher.model.config import BertConfig
from pipefisher.planning import Hardware, RunShape, compare_optimizers, estimate_run_costs
from pipefisher.schedules import build_schedule
from pipefisher.schedules.kfac import kfac_layer_counts
from pipefisher.simulate import simulated_bubble_ratio

METHODS = ("gpipe", "1f1b", "chimera")
HEADERS = ("model", "method", "D", "N", "enc/stage", "closed", "sim F=B", "sim stages", "nvlamb util",
           "pipefisher util", "k", "spill ms", "tail ms", "nvlamb ms", "kfac ms (k=1)", "kfac ms (same k)",
           "pipefisher ms", "plan s")


def closed_form_utilization(method: str, d: int, n: int) -> float:
    """1 − the closed-form bubble ratio of DESIGN.md ("Schedules")."""
    if method == "chimera":
        return 1.0 - (d - 2) / (2 * n + d - 2)
    return 1.0 - (d - 1) / (n + d - 1)


def _not_possible(size: str, method: str, d: int, n: int | str, why: str) -> list:
    closed = closed_form_utilization(method, d, n) if isinstance(n, int) else "-"
    return [size, method, d, n, "-", closed, f"not possible: {why}"] + ["-"] * (len(HEADERS) - 7)


def _row(size: str, bert: BertConfig, method: str, d: int, n: int, args: argparse.Namespace) -> list:
    start = time.perf_counter()
    run = RunShape(bert, method, d, n, args.micro_batch_size, seq_len=args.seq_len,
                   max_predictions=args.max_predictions)
    try:
        schedule = build_schedule(method, d, n)
    except ValueError as exc:  # a shape the method does not support
        return _not_possible(size, method, d, n, str(exc).split(";")[0])
    layers = kfac_layer_counts(schedule, run.encoder_layers)
    cost = estimate_run_costs(run, Hardware())
    cmp = compare_optimizers(schedule, cost, layers, max_interval=args.max_interval)
    plan_s = time.perf_counter() - start
    k = cmp.pipefisher.interval
    ns_per_ms_worker_step = k * schedule.num_workers * 1e6  # cycle totals (ns) → ms per worker per step
    enc = run.encoder_layers
    return [size, method, d, n, f"{min(enc)}-{max(enc)}" if min(enc) != max(enc) else str(enc[0]),
            closed_form_utilization(method, d, n), 1.0 - simulated_bubble_ratio(schedule),
            1.0 - simulated_bubble_ratio(schedule, cost),
            cmp.nvlamb.utilization, cmp.pipefisher.utilization,
            f"{k} (cp)" if cmp.assignment.metadata.get("fallback") else k,
            cmp.assignment.metadata["spilled_ns"] / ns_per_ms_worker_step,
            cmp.assignment.metadata["tail_ns"] / ns_per_ms_worker_step,
            cmp.nvlamb.step_time_s * 1e3, cmp.kfac.step_time_s * 1e3, cmp.kfac_same_interval.step_time_s * 1e3,
            cmp.pipefisher.step_time_s * 1e3, plan_s]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="D = 8 and N = D only")
    p.add_argument("--models", default="base,large", help="BERT sizes (default: base,large)")
    p.add_argument("--stages", default="8,16,32", help="D values (12 and 24 are the most base / large allow)")
    p.add_argument("--micro-batches", default="1,4", help="N as multiples of D (default: N = D and N = 4D)")
    p.add_argument("--micro-batch-size", type=int, default=32, help="sequences per micro-batch (default 32)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=20)
    p.add_argument("--max-interval", type=int, default=8, help="largest refresh interval k the planner tries")
    args = p.parse_args()
    stages = [8] if args.quick else [int(x) for x in args.stages.split(",")]
    factors = [1] if args.quick else [int(x) for x in args.micro_batches.split(",")]

    hw = Hardware()
    print(f"Simulated, not measured: FLOP-based costs at {hw.flops_per_s:.0e} FLOP/s, "
          f"{hw.p2p_bytes_per_s / 1e9:g} GB/s between stages, W=1; micro-batch {args.micro_batch_size} x "
          f"{args.seq_len} tokens, P={args.max_predictions}; planner max_interval={args.max_interval}.")
    rows = []
    total = time.perf_counter()
    for size in args.models.split(","):
        bert = BertConfig.from_size(size)
        for d in stages:
            if d > bert.num_layers:  # partition_layers gives every stage at least one encoder layer
                rows.append(_not_possible(f"bert-{size}", "all", d, "-", f"stages {d} > layers {bert.num_layers}"))
                continue
            for f in factors:
                for method in METHODS:
                    rows.append(_row(f"bert-{size}", bert, method, d, f * d, args))
                    plan_s = rows[-1][-1]
                    done = f"{plan_s:.1f} s" if isinstance(plan_s, float) else rows[-1][6]
                    print(f"  bert-{size} {method} D={d} N={f * d}: {done}", flush=True)
    print()
    print(h.table(HEADERS, rows))
    print(f"\n{len(rows)} shapes in {time.perf_counter() - total:.0f} s; slowest plan "
          f"{max((r[-1] for r in rows if isinstance(r[-1], float)), default=0.0):.1f} s.")


if __name__ == "__main__":
    h.main_guard(main)
