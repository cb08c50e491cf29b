"""Communication ablation: step time with real messages against 1-byte messages (``comm_ablation=true``).

    python bench/comm_ablation.py            # bert-mini, gpipe/1f1b/chimera, D=2 and D=4, N=8, B=4, seq 128,
                                             # 2 warm-up + 10 measured rounds: ~3-6 min on 2 cores
    python bench/comm_ablation.py --quick    # B=2, seq 64, 1 warm-up + 3 rounds: ~40 s

Each shape (method, D) is built twice in the same worker processes, as ``train.py`` builds it
(``PipelineWorker`` from the composed config): once as configured, once with ``comm_ablation=true``.
Under ablation activations, activation gradients and every all-reduce (the tied word-embedding/
decoder gradient, Chimera's replica all-reduces) are 1-byte messages and receivers compute on zeros
of the right shape, so the ablated step is compute plus the waits the pipeline's dependencies
impose; the difference to the normal step is what moving the bytes costs: gloo's send/receive and
all-reduce time, the copies around them (flattening a stage's gradients for its all-reduce and
copying them back), and the later start of a peer that waited for them. The step time is the
slowest worker's (``_harness.timed_step``); ``bubble_utilization`` is the metrics' figure (Σ busy
F/B/STEP time / (workers × the step's span), ``pipefisher.timeline``) from all workers' events.

[Note: interleaving on a shared machine]
The normal and ablated variants take turns step by step (per round: every method once normal and
once ablated, the methods rotated and the on/off order flipped every round), so that a slow spell
of the shared machine hits both alike. The table gives medians over the rounds, the median of the
share computed from each round's back-to-back pair (with its range: the noise), and the share from
the fastest step of each side (another job only ever slows a step down). A first version ran whole
``train.py`` runs alternately (normal, ablated, … 3 times); with the machine at load 3-7 from other
jobs its run-to-run noise (paired shares from -0.74 to +0.39) buried the effect.

[Note: what 2 cores do to these figures]
On this machine gloo moves bytes over loopback TCP: the communication is CPU work on the same cores
that compute, not time on a separate link, so a share measured here is not what a NIC or NVLink
with its own engine would cost, and says nothing of overlap on one. With D=4 (4 workers on 2 cores)
the ablated step is not "compute + bubbles" either: a worker waiting for its predecessor does not
hold a core, another worker computes in its place, so the ablated time is roughly all workers'
compute over 2 cores, and the share is the CPU cost of the transfers on a saturated machine.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist

import _harness as h
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.timeline import bubble_utilization

METHODS = ("gpipe", "1f1b", "chimera")


def _run(rank: int, world: int, overrides: list[str], methods: tuple[str, ...], warmup: int,
         rounds: int) -> dict | None:
    """Every (method, ablated) variant in these worker processes, taking turns step by step."""
    variants = [(m, a) for m in methods for a in (False, True)]
    workers = {(m, a): PipelineWorker(h.compose(overrides + [f"pipeline={m}", f"comm_ablation={str(a).lower()}"]),
                                      rank, world, torch.device("cpu"))
               for m, a in variants}
    figures: dict[str, list[dict[str, float]]] = {_key(m, a): [] for m, a in variants}
    for step in range(warmup + rounds):
        order = h.rotated(methods, step)
        for i, m in enumerate(order):
            for a in ((False, True) if (step + i) % 2 == 0 else (True, False)):
                seconds, (losses, result) = h.timed_step(lambda: workers[(m, a)].train_step(step))
                gathered: list | None = [None] * world if rank == 0 else None
                dist.gather_object(result.events, gathered, dst=0)
                if rank == 0 and step >= warmup:
                    events = [e for evs in gathered for e in evs]
                    figures[_key(m, a)].append({"s": seconds, "util": bubble_utilization(events, world),
                                                "loss": losses[0] + losses[1]})
    return figures if rank == 0 else None


def _key(method: str, ablated: bool) -> str:
    return f"{method}-{'ablated' if ablated else 'normal'}"


def _share(normal: float, ablated: float) -> float:
    return 1.0 - ablated / normal


def main() -> None:
    load_before = h.load()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=2, seq 64, 3 rounds (about 40 s)")
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--stages", default="2,4", help="comma-separated D values (even, for chimera)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of gpipe,1f1b,chimera")
    parser.add_argument("--micro-batches", type=int, default=8, help="N (a multiple of every D)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="B (default 4, --quick 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 128, --quick 64)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measured rounds (one normal and one ablated step per method each; default 10, --quick 3)")
    args = parser.parse_args()
    methods = tuple(m for m in METHODS if m in args.methods.split(","))
    b = args.micro_batch_size or (2 if args.quick else 4)
    seq = args.seq_len or (64 if args.quick else 128)
    rounds = args.rounds or (3 if args.quick else 10)
    warmup = 1 if args.quick else 2
    rows, notes, nonfinite = [], [], []
    for d in [int(x) for x in args.stages.split(",")]:
        overrides = [f"model={args.model}", f"stages={d}", f"num_micro_batches={args.micro_batches}",
                     f"micro_batch_size={b}", f"data.seq_len={seq}", f"steps={warmup + rounds}"]
        figures = h.launch(_run, d, overrides, methods, warmup, rounds)[0]["result"]
        for m in methods:
            normal, ablated = figures[_key(m, False)], figures[_key(m, True)]
            t_n, t_a = [x["s"] for x in normal], [x["s"] for x in ablated]
            paired = [_share(n, a) for n, a in zip(t_n, t_a)]  # the two steps of one round, back to back
            if not all(math.isfinite(x["loss"]) for x in normal + ablated):
                nonfinite.append(f"D={d} {m}")
            rows.append([d, m, 1e3 * h.median(t_n), 1e3 * h.median(t_a), _share(h.median(t_n), h.median(t_a)),
                         h.median(paired), f"{min(paired):.2f} to {max(paired):.2f}", 1e3 * min(t_n), 1e3 * min(t_a),
                         _share(min(t_n), min(t_a)), h.median([x["util"] for x in normal]),
                         h.median([x["util"] for x in ablated])])
        notes.append(f"D={d}: {h.caveat(d)}")
    print(f"{args.model}, N={args.micro_batches}, B={b}, seq {seq}, fp32, NVLAMB, dropout 0.1; {rounds} measured rounds "
          f"after {warmup} warm-up, normal and ablated steps interleaved in the same workers; gloo on CPU")
    print(h.table(["D", "method", "normal ms", "ablated ms", "comm share", "paired share", "paired range",
                   "normal min ms", "ablated min ms", "share (min)", "util normal", "util ablated"], rows))
    print("normal: real messages; ablated: comm_ablation=true (1-byte messages, compute on zeros) = compute + "
          "pipeline dependency waits; ms: median step time (slowest worker); comm share = 1 - ablated/normal; "
          "paired: median (range) over rounds of the share of back-to-back steps; min: the least disturbed step; "
          "util: median bubble_utilization")
    if nonfinite:
        print(f"Non-finite losses in: {', '.join(nonfinite)} (ablated losses are meaningless anyway; timings stand)")
    for line in notes:
        print(line)
    print(f"Machine: {load_before} before, {h.load()} after (other jobs on the machine count too).")


if __name__ == "__main__":
    h.main_guard(main)
