"""What a CPU pipeline worker's peak memory is made of, against the planner's memory model.

    python bench/memory_model.py                       # bert-mini and bert-medium x 1f1b, zb-v, chimera, D=2
    python bench/memory_model.py --models bert-mini --schedules 1f1b --steps 3

Each case runs in two fresh forked worker processes (``_harness.launch``, one intra-op thread each on
2 cores), N=4 micro-batches of 8 x 128 tokens, fp32, NVLAMB, synthetic data. Per worker:

- measured: the largest per-step peak resident set (``PeakMemory``, reset before every step, the
  figure ``train.py`` reports) less the RSS before the model was built (``current_bytes``), over
  ``--steps`` steps;
- the tensors: parameters and optimizer state counted from the live objects at a step boundary,
  and the peak of live tensor bytes inside one step from the profiler's allocation records
  (``profile_memory=True``: every CPU tensor allocation and free, in order), on a step of its own;
- the C heap (glibc ``mallinfo2``) after the steps: bytes in use, and bytes freed but kept in the
  arenas (resident: glibc returns them only from the top of an arena);
- the planner's prediction (``planning.memory.estimate_memory_per_worker``) and its components.

See bench/studies/15-memory-model.md for the figures and what they show.
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch

import _harness as h
from pipefisher.measure import PeakMemory, current_bytes
from pipefisher.planning.memory import MemoryEstimate, estimate_memory_per_worker
from pipefisher.runtime.build import run_shape
from pipefisher.runtime.worker import PipelineWorker

MB = 1e6


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap() -> dict[str, int]:
    """glibc's heap: ``in_use`` (arena chunks in use + mmapped chunks), ``cached`` (free in the arenas)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m = libc.mallinfo2()
    return {"in_use": m.uordblks + m.hblkhd, "cached": m.fordblks, "mmapped": m.hblkhd, "arena": m.arena}


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _state(worker: PipelineWorker) -> dict[str, int]:
    params = [p for m in worker.modules.values() for p in m.parameters()]
    opt = [v for s in worker.optimizer.state.values() for v in s.values()]
    return {"params": _tensor_bytes(params), "optimizer_state": _tensor_bytes(opt),
            "grads": _tensor_bytes(p.grad for p in params if p.grad is not None)}


def _profiled_peak(worker: PipelineWorker, step: int) -> tuple[int, int]:
    """Peak and end of the live tensor bytes allocated during ``step`` (profiler allocation records)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        worker.train_step(step)
    allocs: list[tuple[int, int]] = []

    def walk(nodes) -> None:
        for e in nodes:
            if str(getattr(e, "tag", "")).endswith("Allocation"):
                allocs.append((e.start_time_ns, e.extra_fields.alloc_size))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    cum = peak = 0
    for _, size in sorted(allocs):
        cum += size
        peak = max(peak, cum)
    return peak, cum


def _probe(rank: int, world: int, overrides: list[str], steps: int, mmap_threshold: int | None) -> dict:
    if mmap_threshold is not None:  # fixed: every larger block is mmapped and unmapped at its free
        ctypes.CDLL("libc.so.6").mallopt(-3, mmap_threshold)  # M_MMAP_THRESHOLD (also stops its growth)
    cfg = h.compose(overrides)
    baseline = current_bytes("cpu")
    worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
    built = current_bytes("cpu") - baseline
    meter, peaks, starts = PeakMemory("cpu"), [], []
    for step in range(steps):
        starts.append(current_bytes("cpu") - baseline)
        meter.reset()
        worker.train_step(step)
        peaks.append(meter.read() - baseline)
    heap_after = heap()
    boundary = current_bytes("cpu") - baseline
    state = _state(worker)
    live_peak, live_end = _profiled_peak(worker, steps)
    pred = estimate_memory_per_worker(run_shape(cfg), cfg.optimizer.name, worker.schedule, worker.assignment, "cpu")
    est = pred[rank]
    return {"rank": rank, "baseline": baseline, "built": built, "peaks": peaks, "starts": starts,
            "boundary": boundary, "state": state, "heap": heap_after, "live_peak": live_peak, "live_end": live_end,
            "predicted": {k: getattr(est, k) for k in ("weights", "gradients", "optimizer", "activations",
                                                        "captures", "allocator", "runtime")} | {"tensors": est.tensors, "total": est.total}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="bert-mini,bert-medium")
    parser.add_argument("--schedules", default="1f1b,zb-v,chimera")
    parser.add_argument("--steps", type=int, default=3, help="steps measured per case (the peak is their largest)")
    parser.add_argument("--extra", default="", help="more overrides, comma-separated (e.g. optimizer=kfac)")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="glibc M_MMAP_THRESHOLD in bytes for the workers (default: glibc's, which grows)")
    parser.add_argument("--json", default=None, help="write every worker's record here")
    parser.add_argument("--table", nargs="*", default=None, metavar="JSON",
                        help="no run: the table of these --json files, predicted by the current model")
    args = parser.parse_args()
    if args.table is not None:
        print(table([r for path in args.table for r in json.load(open(path))]))
        return
    records = []
    for model in args.models.split(","):
        for sched in args.schedules.split(","):
            overrides = [f"model={model}", f"pipeline={sched}", "stages=2", "num_micro_batches=4",
                         "micro_batch_size=8", f"steps={args.steps + 1}"] + [x for x in args.extra.split(",") if x]
            out = h.launch(_probe, 2, overrides, args.steps, args.mmap_threshold)
            for r in out:
                rec = r["result"] | {"model": model, "schedule": sched, "threads": r["threads"], "extra": args.extra}
                records.append(rec)
                m = max(rec["peaks"])
                p = rec["predicted"]["total"]
                print(f"{model} {sched} w{rec['rank']}: measured {m / MB:.0f} MB beyond {rec['baseline'] / MB:.0f}, "
                      f"predicted {p / MB:.0f} ({p / m:.2f}x); built {rec['built'] / MB:.0f}, step starts "
                      f"{[round(s / MB) for s in rec['starts']]}, peaks {[round(s / MB) for s in rec['peaks']]}; "
                      f"params {rec['state']['params'] / MB:.0f}, opt state {rec['state']['optimizer_state'] / MB:.0f}, "
                      f"live peak in step {rec['live_peak'] / MB:.0f} (end {rec['live_end'] / MB:.0f}); heap in use "
                      f"{rec['heap']['in_use'] / MB:.0f}, cached {rec['heap']['cached'] / MB:.0f}, arena "
                      f"{rec['heap']['arena'] / MB:.0f}; pred {({k: round(v / MB) for k, v in rec['predicted'].items()})}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(table(records))


def table(records: list[dict]) -> str:
    """Measured against predicted per worker, MB, the prediction from the current model (``device="cpu"``)."""
    from pipefisher.planning.costs import RunShape
    from pipefisher.model.config import BertConfig

    rows, worst = [], 0.0
    for rec in records:
        v = 2 if rec["schedule"] == "zb-v" else 1
        run = RunShape(BertConfig.from_size(rec["model"].removeprefix("bert-")), rec["schedule"], 2, 4, 8,
                       num_virtual=v)
        est = estimate_memory_per_worker(run, "nvlamb", device="cpu")[rec["rank"]]
        if rec.get("extra"):  # another optimizer (K-FAC's assignment): the prediction made in the run
            est = MemoryEstimate(rec["rank"], **{k: v for k, v in rec["predicted"].items() if k not in ("tensors", "total")})
        measured = max(rec["peaks"])
        live = rec["state"]["params"] + rec["state"]["optimizer_state"] + rec["live_peak"]
        worst = max(worst, abs(est.total / measured - 1))
        rows.append([rec["model"], rec["schedule"] + (f" {rec['extra']}" if rec.get("extra") else ""), rec["rank"], len(rec["peaks"]), round(measured / MB),
                     round(live / MB), round(est.tensors / MB), round(est.allocator / MB), round(est.runtime / MB),
                     round(est.total / MB), f"{est.total / measured:.2f}"])
    head = ["model", "schedule", "worker", "steps", "measured MB", "live tensors MB", "predicted tensors",
            "+ allocator", "+ runtime", "= predicted MB", "predicted / measured"]
    return h.table(head, rows) + f"\nlargest |predicted / measured - 1|: {worst:.2f} (goal 0.25)"


if __name__ == "__main__":
    h.main_guard(main)
