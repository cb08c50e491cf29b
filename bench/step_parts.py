"""Where a step's time goes, per action kind and worker, for arms taking turns in the same processes.

    python bench/step_parts.py                     # PipeFisher with kfac_owners holder / replicas against NVLAMB
    python bench/step_parts.py --arm muon:optimizer=muon --arm nvlamb:optimizer=nvlamb --rounds 20
    python bench/step_parts.py --predict-from pf-holder   # also the owners pricing, predicted against measured
    python bench/step_parts.py --predict-from pf-holder --collectives FILE   # the exchange by measured collectives

Each arm is a ``PipelineWorker`` of the same D=2 processes (``--base`` overrides, then the arm's), stepped once per
round in rotated order (``_harness.timed_rounds``); per arm the mean wall step over the rounds (whole refresh
cycles when ``--rounds`` is a multiple of K-FAC's k) and, per worker and action kind, the mean ms per step of its
compute events and, apart, of its waits ([Note: waits are not compute] in ``runtime.executor``). Default: study
7's shape (bert-tiny, vocabulary 8,192, Chimera D=2, 4 micro-batches of 8, seq 64), dropout 0, clip 1.0.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import replace

import torch

import _harness as h
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import costs_from_profile
from pipefisher.planning.owner_costs import with_owners
from pipefisher.planning.predict import predict_assignment
from pipefisher.profiling.types import Profile
from pipefisher.runtime.build import run_shape
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.timeline import Event, is_wait

BASE = ["model=bert-tiny", "model.vocab_size=8192", "pipeline=chimera", "stages=2", "num_micro_batches=4",
        "micro_batch_size=8", "data.seq_len=64", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
        "optimizer.max_grad_norm=1.0"]
ARMS = ["nvlamb:optimizer=nvlamb", "pf-holder:optimizer=pipefisher",
        "pf-replicas:optimizer=pipefisher;optimizer.kfac_owners=replicas"]


def _run(rank: int, world: int, base: list[str], arms: dict[str, list[str]], warmup: int, rounds: int,
         predict_from: str | None = None, collectives: str | None = None) -> dict:
    workers = {a: PipelineWorker(h.compose(base + [f"steps={warmup + rounds + 1}", *o]), rank, world,
                                 torch.device("cpu")) for a, o in arms.items()}
    busy: dict[str, dict[str, float]] = {a: defaultdict(float) for a in arms}
    waits: dict[str, dict[str, float]] = {a: defaultdict(float) for a in arms}
    walls: dict[str, list[float]] = defaultdict(list)
    timelines: dict[str, list[Event]] = defaultdict(list)
    for key, seconds, events in h.timed_rounds(workers, warmup, rounds):  # rank 0 only
        walls[key].append(seconds * 1e3)
        step = len(walls[key])
        timelines[key].extend(replace(e, step=step) for e in events)
        for e in events:
            (waits if is_wait(e) else busy)[key][f"W{e.worker} {e.kind}"] += e.duration_ns / 1e6
    out = {a: {"wall_ms": statistics.fmean(walls[a]), "busy": {k: v / len(walls[a]) for k, v in busy[a].items()},
               "wait": {k: v / len(walls[a]) for k, v in waits[a].items()}} for a in walls}
    if predict_from is not None and rank == 0:
        comm = CommCosts.from_json(collectives) if collectives else None
        for a, ms in predicted_steps(workers, timelines[predict_from], comm).items():
            out[a]["predicted_ms"] = ms
    return out


def predicted_steps(workers: dict[str, PipelineWorker], events: list[Event],
                    comm: CommCosts | None = None) -> dict[str, float]:
    """Per K-FAC arm, the simulator's mean step (ms) of the refresh cycle the arm ran, every arm on the unit costs
    measured in ``events`` (one arm's timeline, ``costs_from_profile``); an arm with ``optimizer.kfac_owners=replicas``
    through ``with_owners`` ([Note: pricing owners]): its INVERTs and PRECONDs of the layers it owns, the owners'
    exchange. So with ``events`` from ``kfac_owners=holder``, the owners arm's figure is the pricing's prediction
    of a run it did not see; with ``comm`` (a ``measure.collectives`` file) the exchange is priced by its measured
    latency and bandwidth (``owner_costs.exchange_seconds``), else by the profile's gradient all-reduce."""
    out = {}
    for a, w in workers.items():
        if w.assignment is None:
            continue
        run = run_shape(w.cfg)
        cost = costs_from_profile(Profile(events), run)
        if w.cfg.optimizer.kfac_owners == "replicas":
            cost = with_owners(cost, w.assignment.phases[0], run, comm)
        out[a] = predict_assignment(w.assignment, cost)[0].step_time_s * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", nargs="*", default=BASE, help="overrides of every arm")
    p.add_argument("--arm", action="append", default=None, metavar="NAME:KEY=VALUE;KEY=VALUE",
                   help=f"an arm and its overrides (repeatable; default: {' '.join(ARMS)})")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=42, help="a multiple of K-FAC's k (7 here) covers whole cycles")
    p.add_argument("--predict-from", default=None, metavar="ARM",
                   help="also print each K-FAC arm's predicted step from ARM's measured unit costs (e.g. pf-holder: "
                        "the owners pricing checked against the replicas arm it did not see)")
    p.add_argument("--collectives", default=None, metavar="FILE",
                   help="with --predict-from: price the owners' exchange by this `python -m pipefisher.measure."
                        "collectives` file's all-gather / all-reduce (measured here) instead of the profile's")
    args = p.parse_args()
    arms = {}
    for spec in args.arm or ARMS:
        name, _, keys = spec.partition(":")
        if not keys:
            raise SystemExit(f"--arm {spec!r}: give NAME:KEY=VALUE[;KEY=VALUE], e.g. muon:optimizer=muon")
        arms[name] = keys.split(";")
    load = h.load()
    if args.predict_from is not None and args.predict_from not in arms:
        raise SystemExit(f"--predict-from {args.predict_from}: not an arm (arms: {', '.join(arms)})")
    out = h.launch(_run, 2, args.base, arms, args.warmup, args.rounds, args.predict_from, args.collectives)[0]
    result = out["result"]
    from pipefisher.hardware import describe_hardware  # after the fork: the parent runs no torch op before it

    print(f"{describe_hardware()} ({out['threads']} thread(s) per worker); {load} before; `{' '.join(args.base)}`; "
          f"{args.rounds} rounds after {args.warmup} warm-up, arms taking turns; ms per step, mean over the rounds")
    kinds = sorted({k for r in result.values() for k in r["busy"]})
    print(h.table(["action (worker kind)", *(f"{a} busy" for a in result)],
                  [[k, *(result[a]["busy"].get(k, 0.0) for a in result)] for k in kinds]
                  + [[f"{k} (wait)", *(result[a]["wait"].get(k, 0.0) for a in result)]
                     for k in sorted({k for r in result.values() for k in r["wait"]})]
                  + [["wall step", *(result[a]["wall_ms"] for a in result)]]))
    if args.predict_from is not None:
        print(f"predicted from {args.predict_from}'s unit costs (simulator, the cycle each arm ran) against measured:")
        rows = [[a, r["predicted_ms"], r["wall_ms"], r["predicted_ms"] / r["wall_ms"]]
                for a, r in result.items() if "predicted_ms" in r]
        print(h.table(["arm", "predicted ms", "measured ms", "predicted / measured"], rows))
        base = result[args.predict_from]
        for a, r in result.items():
            if a != args.predict_from and "predicted_ms" in r:
                print(f"{a} / {args.predict_from}: predicted {r['predicted_ms'] / base['predicted_ms']:.3f}, "
                      f"measured {r['wall_ms'] / base['wall_ms']:.3f}")


if __name__ == "__main__":
    h.main_guard(main)
