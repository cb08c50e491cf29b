"""Executor overhead: measured step time against the simulator's prediction from the same steps' costs.

    python bench/executor_overhead.py            # bert-mini, gpipe/1f1b/chimera, D=2 and D=4, N=8, B=4: ~2 min
    python bench/executor_overhead.py --quick    # B=2, fewer steps: ~30 s
    python bench/executor_overhead.py --quick --stages 8 --model bert-medium   # rank 0's bookkeeping at D=8
    python bench/executor_overhead.py --simulation-cost   # the bookkeeping on simulated timelines: D=8, N=8/32,
                                                          # NVLAMB and PipeFisher (no workers; seconds)

The last table is rank 0's bookkeeping of a training step (``runtime.step_metrics.timeline_fields``
on the gathered timeline, which every worker waits for): with the simulation (a logged step) and
without it, and what it costs a run per step at ``log_every=1`` and at the default ``log_every``.

For every measured step, the mean F and B time of each stage in that step's timeline (the executor's
events, all workers) becomes a ``CostModel``; ``simulate`` then predicts the step's span with zero
communication cost, once for F/B alone and once adding the step's mean measured ``STEP`` (optimizer
update) time. What the prediction leaves out is the executor's cost: waiting for point-to-point
messages beyond the schedule's dependencies (``RECV_*`` events), waiting for gradient all-reduces
and the global norm (``SYNC_GRAD`` events: the issue of each all-reduce and STEP's wait), and time
outside any action ("untracked": Python between actions, the loss all-reduce of ``train_step``).
The three methods take turns step by step in the same worker processes.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import _harness as h
from pipefisher.config import TrainConfig
from pipefisher.runtime.step_metrics import timeline_fields
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.schedules.ir import Schedule
from pipefisher.simulate import CostModel, simulate
from pipefisher.timeline import Event, bubble_utilization

METHODS = ("gpipe", "1f1b", "chimera")
_BREAKDOWN = ("F", "B", "RECV", "SEND", "SYNC_GRAD", "STEP")


def _costs(events: list[Event], schedule: Schedule, step_ns: int = 0) -> CostModel:
    """Mean F and B time of each stage over ``events`` (both Chimera pipes pooled)."""
    sums: dict[tuple[str, int], list[int]] = defaultdict(list)
    for e in events:
        if e.kind in ("F", "B"):
            sums[(e.kind, int(e.name.split(e.kind, 1)[0]))].append(e.duration_ns)
    mean = {k: round(sum(v) / len(v)) for k, v in sums.items()}
    d = schedule.num_stages
    return CostModel(forward_ns=[mean.get(("F", s), 0) for s in range(d)],
                     backward_ns=[mean.get(("B", s), 0) for s in range(d)], step_ns=step_ns)


def _span_ns(events: list[Event]) -> int:
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def _per_kind_ms(events: list[Event], workers: int) -> dict[str, float]:
    """Summed duration of each kind of event (RECV_F/RECV_B pooled, SEND_* too), ms per worker."""
    per_kind: dict[str, float] = defaultdict(float)
    for e in events:
        group = "RECV" if e.kind.startswith("RECV") else "SEND" if e.kind.startswith("SEND") else e.kind
        per_kind[group] += e.duration_ns / 1e6 / workers
    return per_kind


def _analyse(events: list[Event], wall_s: float, schedule: Schedule) -> dict[str, float]:
    """One step's figures (times in ms, per worker averaged over workers)."""
    workers = schedule.num_workers
    steps = [e for e in events if e.kind == "STEP"]
    step_ns = round(sum(e.duration_ns for e in steps) / len(steps))
    fb_only = simulate(schedule, _costs(events, schedule))
    with_step = simulate(schedule, _costs(events, schedule, step_ns))
    per_kind = _per_kind_ms(events, workers)
    tracked = sum(per_kind[k] for k in _BREAKDOWN)
    fb = frozenset({"F", "B"})
    return {
        "wall": 1e3 * wall_s,
        "span": _span_ns(events) / 1e6,
        "pred_fb": _span_ns(fb_only) / 1e6,
        "pred": _span_ns(with_step) / 1e6,
        "util": bubble_utilization(events, workers),
        "util_sim": bubble_utilization(with_step, workers),
        "util_fb": bubble_utilization(events, workers, kinds=fb),
        "util_fb_sim": bubble_utilization(fb_only, workers, kinds=fb),
        **{k: per_kind[k] for k in _BREAKDOWN},
        "untracked": 1e3 * wall_s - tracked,
        "RECV_sim": _per_kind_ms(with_step, workers)["RECV"],
    }


def _bookkeeping_ms(events: list[Event], schedule: Schedule, num_workers: int, assignment=None,
                    repeats: int = 1) -> dict[str, float]:
    """Rank 0's row fields from a step's timeline (``timeline_fields``), with the simulation
    (``keep_sim``) and without it (``keep``): ms, the mean of ``repeats`` calls."""
    out = {}
    for name, simulated in (("keep_sim", True), ("keep", False)):
        t0 = time.perf_counter()
        for _ in range(repeats):
            timeline_fields(events, schedule, num_workers, 0, simulated=simulated, assignment=assignment,
                            curvature_age=0)
        out[name] = 1e3 * (time.perf_counter() - t0) / repeats
    return out


def _run(rank: int, world: int, overrides: list[str], warmup: int, repeats: int) -> dict | None:
    workers = {m: PipelineWorker(h.compose(overrides + [f"pipeline={m}"]), rank, world, torch.device("cpu"))
               for m in METHODS}
    figures: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for m, wall, events in h.timed_rounds(workers, warmup, repeats):
        figures[m].append(_analyse(events, wall, workers[m].schedule))
        figures[m][-1].update(_bookkeeping_ms(events, workers[m].schedule, world))
    return figures if rank == 0 else None


def simulation_cost() -> None:
    """Rank 0's bookkeeping on a simulated step timeline (the built-in CPU cost estimate) of bert-medium
    at D=8: the events a real step would gather, without running the workers."""
    from pipefisher.planning.costs import estimate_run_costs
    from pipefisher.runtime.build import CPU_HARDWARE, kfac_assignment, run_shape, schedule_for

    rows = []
    for optimizer in ("nvlamb", "pipefisher"):
        for n in (8, 32):
            cfg = h.compose(["model=bert-medium", "pipeline=1f1b", "stages=8", f"num_micro_batches={n}",
                             f"optimizer={optimizer}"])
            schedule = schedule_for(cfg)
            plan = kfac_assignment(cfg, schedule) if optimizer != "nvlamb" else None
            events = simulate(plan.phases[0] if plan else schedule, estimate_run_costs(run_shape(cfg), CPU_HARDWARE))
            ms = _bookkeeping_ms(events, schedule, 8, plan, repeats=5)
            rows.append([optimizer, n, len(events), ms["keep_sim"], ms["keep"]])
    print(f"Rank 0's bookkeeping per step, bert-medium 1f1b D=8, on simulated timelines (ms; load {h.load()})")
    print(h.table(["optimizer", "N", "events", "with simulation", "without"], rows))


def main() -> None:
    load_before = h.load()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=2 and fewer steps (about 30 s)")
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--stages", default="2,4", help="comma-separated D values (even, for chimera)")
    parser.add_argument("--micro-batches", type=int, default=8, help="N (a multiple of every D)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="B (default 4, --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="measured steps per method (default 8, --quick 3)")
    parser.add_argument("--simulation-cost", action="store_true",
                        help="only time rank 0's bookkeeping on simulated D=8 timelines (no workers)")
    args = parser.parse_args()
    if args.simulation_cost:
        simulation_cost()
        return
    b = args.micro_batch_size or (2 if args.quick else 4)
    repeats = args.repeats or (3 if args.quick else 8)
    warmup = 1 if args.quick else 2
    timing, breakdown, notes, keeping = [], [], [], []
    default_every = TrainConfig.log_every
    for d in [int(x) for x in args.stages.split(",")]:
        overrides = [f"model={args.model}", f"stages={d}", f"num_micro_batches={args.micro_batches}",
                     f"micro_batch_size={b}", f"steps={warmup + repeats}"]
        figures = h.launch(_run, d, overrides, warmup, repeats)[0]["result"]
        for m in METHODS:
            f = figures[m]
            med = {k: h.median([x[k] for x in f]) for k in f[0]}
            ratio = h.median([x["wall"] / x["pred"] for x in f])
            timing.append([d, m, med["wall"], med["pred_fb"], med["pred"], ratio, med["wall"] - med["pred"],
                           med["util_fb"], med["util_fb_sim"], med["util"], med["util_sim"]])
            breakdown.append([d, m, med["F"], med["B"], med["RECV"], med["RECV_sim"], med["SEND"], med["SYNC_GRAD"],
                              med["STEP"], med["untracked"]])
            keeping.append([d, m, med["wall"], med["keep_sim"], med["keep"], med["keep_sim"] / med["wall"],
                            (med["keep_sim"] + (default_every - 1) * med["keep"]) / default_every / med["wall"]])
        notes.append(f"D={d}: {h.caveat(d)}")
    print(f"{args.model}, N={args.micro_batches}, B={b}, seq 128, fp32, NVLAMB, dropout 0.1, {repeats} measured "
          f"steps per method after {warmup} warm-up, interleaved; gloo on CPU; medians over steps")
    print()
    print("Step time: measured vs simulated from the same step's per-stage F/B means (p2p cost 0)")
    print(h.table(["D", "method", "measured ms", "sim F/B ms", "sim F/B+STEP ms", "measured/sim", "gap ms",
                   "F/B util", "F/B util sim", "util", "util sim"], timing))
    print()
    print("Per worker per step (ms, mean over workers): compute, waits, optimizer, untracked")
    print(h.table(["D", "method", "F", "B", "RECV wait", "RECV wait sim", "SEND issue", "SYNC_GRAD wait", "STEP",
                   "untracked"],
                  breakdown))
    print()
    print(f"Rank 0's bookkeeping per step (ms; the simulation runs on logged steps only, default log_every={default_every})")
    print(h.table(["D", "method", "step ms", "with simulation", "without", "share at log_every=1",
                   f"share at log_every={default_every}"], keeping))
    for line in notes:
        print(line)
    print(f"Machine: {load_before} before, {h.load()} after (other jobs on the machine count too).")


if __name__ == "__main__":
    h.main_guard(main)
