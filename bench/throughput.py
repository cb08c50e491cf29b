"""Throughput sweep: samples/s, tokens/s and peak memory against micro-batch size.

    python bench/throughput.py            # bert-mini B 4/8/16/32 and bert-small B 4/8/16, recompute
                                          # off/on, one process and D=2 gpipe, N=4: ~5 min on 2 cores
    python bench/throughput.py --quick    # bert-mini, B 4 and 16: ~45 s
    python bench/throughput.py --models bert-small --micro-batch-sizes 32   # the costly corner: ~3 min

"one process" is the worker's loop (``train_worker``) in a process group of one: what ``train.py``
runs with stages=1, step time as its metrics.jsonl reports it, given all cores as intra-op threads;
"D=2 gpipe" is two pipeline workers (``PipelineWorker``), one thread each. Every configuration runs in fresh worker processes, so that each process's peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) belongs to that configuration alone. Workers are forked from
this script after its imports, so every peak includes that baseline (peak − Δ, about 185 MiB); the
"Δ" column is the growth during the run: weights, gradients, optimizer state, activations and
allocator caching. The four (mode, recompute) runs of one (model, B) go back to back, so that
shared-machine noise hits them alike. tokens/s counts sequence slots (samples × 128), padding included
(about 4% of the synthetic data's slots).

[Note: noise]
The step time is the fastest of the measured steps: another job taking a core for a while only ever
slows a step down, and the one process with two OpenMP threads suffers most (a thread that loses its
core stalls the other at every parallel region), so the minimum is the closest to the machine's own
speed. Memory peaks are not affected by other jobs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import _harness as h
from pipefisher.runtime.worker import PipelineWorker, train_worker
from pipefisher.tracking import read_metrics


def _single(rank: int, world: int, overrides: list[str], warmup: int) -> list[float]:
    cfg = h.compose(overrides)
    with tempfile.TemporaryDirectory() as out:
        train_worker(cfg, rank, world, torch.device("cpu"), out)  # the harness joined the group of one
        return [m["step_time_s"] for m in read_metrics(Path(out) / "metrics.jsonl")][warmup:]


def _pipeline(rank: int, world: int, overrides: list[str], warmup: int) -> list[float]:
    cfg = h.compose(overrides)
    worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
    times = []
    for step in range(cfg.steps):
        seconds, _ = h.timed_step(lambda: worker.train_step(step))
        times.append(seconds)
    return times[warmup:]


def main() -> None:
    load_before = h.load()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="bert-mini, B 4 and 16 (about a minute)")
    parser.add_argument("--models", default=None, help="comma-separated (default bert-mini,bert-small)")
    parser.add_argument("--micro-batch-sizes", default=None,
                        help="comma-separated (default 4,8,16,32 for bert-mini, 4,8,16 for larger models)")
    parser.add_argument("--micro-batches", type=int, default=4, help="N per step")
    parser.add_argument("--steps", type=int, default=2,
                        help="measured steps per configuration, after one warm-up (the fastest is reported)")
    args = parser.parse_args()
    models = (args.models or ("bert-mini" if args.quick else "bert-mini,bert-small")).split(",")

    def sizes(model: str) -> list[int]:
        default = "4,16" if args.quick else "4,8,16,32" if model in ("bert-tiny", "bert-mini") else "4,8,16"
        return [int(x) for x in (args.micro_batch_sizes or default).split(",")]

    n, warmup, seq = args.micro_batches, 1, 128
    rows = []
    for model in models:
        for b in sizes(model):
            for mode in ("1 proc", "D=2 gpipe"):
                for recompute in (False, True):
                    overrides = [f"model={model}", f"micro_batch_size={b}", f"num_micro_batches={n}",
                                 f"steps={warmup + args.steps}", f"recompute={str(recompute).lower()}",
                                 f"data.seq_len={seq}"]
                    if mode == "1 proc":
                        out = h.launch(_single, 1, overrides, warmup)
                    else:
                        out = h.launch(_pipeline, 2, overrides + ["stages=2", "pipeline=gpipe"], warmup)
                    step_s = min(out[0]["result"])  # the least disturbed step (see the note on noise)
                    samples = b * n / step_s
                    peak = max(r["peak_rss_mib"] for r in out)
                    start = max(r["rss_at_start_mib"] for r in out)
                    rows.append([model, b, mode, "on" if recompute else "off", out[0]["threads"], 1e3 * step_s,
                                 samples, samples * seq, peak, peak - start])
    print(f"N={n} micro-batches per step, seq {seq}, fp32, NVLAMB, dropout 0.1; fastest of {args.steps} measured "
          f"step(s) after {warmup} warm-up per configuration; peak RSS = max over the configuration's workers of "
          "ru_maxrss (start = the forked worker's RSS before any work, Δ = peak - start)")
    print(h.table(["model", "B", "mode", "recompute", "threads/worker", "step ms", "samples/s", "tokens/s",
                   "peak RSS MiB", "Δ MiB"], rows))
    print(f"1 proc: {h.caveat(1)}")
    print(f"D=2: {h.caveat(2)}")
    print(f"Machine: {load_before} before, {h.load()} after (other jobs on the machine count too).")


if __name__ == "__main__":
    h.main_guard(main)
