"""Muon's step against NVLAMB's at D=2, with Newton–Schulz spread over the pipeline (issue 36 item 3).

    python bench/ns_spread.py                                   # bert-tiny, 1f1b and chimera, clip 0 and 1.0
    python bench/ns_spread.py --methods 1f1b --clips 0 --rounds 12
    python bench/ns_spread.py --simulate-only                   # D=4 and D=8, 1f1b, through the simulator

Measured (D=2, two worker processes on this machine's cores): six arms of one run shape live in the
same two processes and take turns step by step, the order rotated every round (``_harness``
[Note: measuring on a shared CPU]): NVLAMB and Muon, each with ``optimizer_placement=global`` and
``per_stage``, and Muon with ``optimizer.ns_owners=pipeline`` ("+spread") under both placements
(``runtime.ns_spread`` [Note: NS owners across the pipeline]). Reported, medians over rounds: the
step's wall time (slowest worker, after a barrier); Muon against NVLAMB as the median of per-round
ratios (the two arms ran back to back), against NVLAMB with the same placement and against NVLAMB's
global step (today's default), and +spread against Muon's holder arm of the same placement (a fused-AdamW
holder arm against its single-tensor twin); each worker's final STEP, the stage STEPs, and under +spread the
final STEP's resolve (flag all-reduce, exchanges, NS) and its NS alone, per worker, with the number
of matrices a worker orthogonalized for the other.

Simulated (1f1b, D=4 and D=8, ``--simulate-only``): ``optimizer_placement.py``'s cost model (the FLOP and
memory estimate of ``planning.costs`` with ``CPU_HARDWARE``; each stage's elementwise step at 28 B per
parameter, the tied weight at the final STEP of the workers holding the first or last stage) plus Muon's
Newton–Schulz, ``ns_flops`` of each encoder matrix at the hardware's FLOP rate, where it runs: in the
global STEP, in its stage STEP, or (+spread) in the final STEP of the owner ``plan_owners`` gives it,
with two transfers of each moved matrix (fp32, at the p2p bandwidth) and, when a matrix moves, every
worker's final STEP lasting as long as the slowest one's (the result exchange is a collective over all
workers). Chimera is not modelled: the simulator prices a stage STEP per stage, not per replica.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

import _harness as h
from optimizer_placement import _costs, _steady, _step_parts, hardware_line
from pipefisher.optim.muon import ns_flops
from pipefisher.runtime.build import CPU_HARDWARE, encoder_layers_per_stage
from pipefisher.runtime.ns_spread import late_workers, plan_owners
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.schedules.passes import per_stage_steps
from pipefisher.timeline import Event

# (label, optimizer, placement, ns_owners)
ARMS = [("nvlamb global", "nvlamb", "global", "holder"), ("nvlamb per_stage", "nvlamb", "per_stage", "holder"),
        ("muon global", "muon", "global", "holder"), ("muon per_stage", "muon", "per_stage", "holder"),
        ("muon global+spread", "muon", "global", "pipeline"),
        ("muon per_stage+spread", "muon", "per_stage", "pipeline")]
# --fused-adamw: the same Muon arms with AdamW's half on torch's fused kernel, ``optimizer.adamw_kernel=fused``
# (``pipefisher.optim.baselines`` [Note: AdamW's kernel]; the other arms keep ``auto``, the per-tensor loop on CPU)
FUSED = " (AdamW fused)"


def _overrides(model: str, method: str, clip: str, micro_batches: int, steps: int, arm: tuple) -> list[str]:
    label, opt, placement, owners = arm
    return (["optimizer.adamw_kernel=fused"] if label.endswith(FUSED) else []) + [f"model={model}", f"pipeline={method}", "stages=2", f"num_micro_batches={micro_batches}",
            "micro_batch_size=2", "data.seq_len=128", f"optimizer={opt}", f"optimizer.max_grad_norm={clip}",
            f"optimizer_placement={placement}", f"steps={steps}", "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0"] + ([f"optimizer.ns_owners={owners}"] if opt == "muon" else [])


def _timed(spent: dict[str, float], name: str, fn: Callable) -> Callable:
    """``fn``, adding its wall time in ms to ``spent[name]``."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + (time.perf_counter() - start) * 1e3
    return run


def _phases(worker: PipelineWorker) -> dict[str, float]:
    """Per-phase optimizer time of one worker, summed over a step's STEPs (reset by the caller): the
    whole ``optimizer.step`` calls ("opt"), and for Muon its Newton–Schulz runs ("NS", in the holder's
    step and in the spread's resolve alike), Muon's step without them ("momentum", with the update's
    decay and add) and AdamW's half ("adamw")."""
    spent: dict[str, float] = {}
    opt = worker.optimizer
    opt.step = _timed(spent, "opt", opt.step)
    muon = getattr(opt, "muon", None)
    if muon is not None:
        muon._orthogonalize = _timed(spent, "NS", muon._orthogonalize)  # the holder's NS
        muon.orthogonalize = _timed(spent, "NS spread", muon.orthogonalize)  # the spread's (and the holder's inside)
        muon.step = _timed(spent, "muon", muon.step)
        opt.adamw.step = _timed(spent, "adamw", opt.adamw.step)
    return spent


def _run(rank: int, world: int, shapes: list[tuple[str, list[list[str]]]], warmup: int, rounds: int) -> dict:
    workers = {(shape, i): PipelineWorker(h.compose(ov), rank, world, torch.device("cpu"))
               for shape, arms in shapes for i, ov in enumerate(arms)}
    spent = {key: _phases(w) for key, w in workers.items()}
    rows: dict[str, list[dict]] = defaultdict(list)
    keys = list(workers)
    for step in range(warmup + rounds):
        order = keys[step % len(keys):] + keys[:step % len(keys)]
        for key in order:
            worker = workers[key]
            spent[key].clear()
            seconds, (_, result) = h.timed_step(lambda: worker.train_step(step))
            spread = worker.ns_spread
            phases = dict(spent[key])
            # the holder's NS goes through _orthogonalize (which calls orthogonalize); the spread's through
            # orthogonalize alone: NS = the latter; Muon's step less its own NS is the momentum and update
            ns = phases.pop("NS spread", 0.0)
            phases["momentum"] = phases.get("muon", 0.0) - phases.pop("NS", 0.0)
            phases["NS"] = ns
            mine = [spread.resolve_s * 1e3 if spread else 0.0, spread.ns_s * 1e3 if spread else 0.0,
                    spread.received if spread else 0, phases]
            gathered: list[list] = [None] * world  # type: ignore[list-item]
            dist.all_gather_object(gathered, (result.events, mine))
            if rank != 0 or step < warmup:
                continue
            events: list[Event] = [e for evs, _ in gathered for e in evs]
            row = {"step": step, "wall_ms": seconds * 1e3, "rollbacks": worker.rollbacks, **_step_parts(events)}
            for r, (_, (res, ns, got, phases)) in enumerate(gathered):
                row.update({f"W{r} resolve": res, f"W{r} NS": ns, f"W{r} got": got,
                            **{f"W{r} {k}": v for k, v in phases.items()}})
            rows[f"{key[0]}|{key[1]}"].append(row)
    return {"rows": dict(rows), "threads": torch.get_num_threads()}


def _muon_costs(model: str, method: str, d: int, n: int) -> dict[str, tuple]:
    """(schedule, cost model) of each simulated arm ([module docstring]); 1F1B-like: worker w holds stage w."""
    schedule, glob, per = _costs(model, method, d, n)
    cfg = h.compose([f"model={model}", f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}",
                     "micro_batch_size=2", "data.seq_len=128"])
    hidden = cfg.model.hidden_size
    ffn = cfg.model.intermediate_size or 4 * hidden
    layer = [(hidden, hidden)] * 4 + [(ffn, hidden), (hidden, ffn)]  # Q, K, V, output; FFN in, out
    shapes = [layer * k for k in encoder_layers_per_stage(cfg, d)]  # per stage
    ns = [round(sum(ns_flops(x) for x in stage) / CPU_HARDWARE.flops_per_s * 1e9) for stage in shapes]
    tied = per.worker_step_ns  # the final STEP: the tied weight's elementwise step (first and last worker)
    elem = per.stage_step_ns
    arms = {"nvlamb global": (schedule, glob), "nvlamb per_stage": (per_stage_steps(schedule), per)}
    arms["muon global"] = (schedule, replace(glob, worker_step_ns=tuple(
        g + ns[w] for w, g in enumerate(glob.worker_step_ns))))
    arms["muon per_stage"] = (per_stage_steps(schedule), replace(per, stage_step_ns=tuple(
        e + ns[s] for s, e in enumerate(elem))))

    def spread(pending_workers: list[int], base: list[int]) -> tuple[int, ...]:
        """Each worker's final STEP: ``base`` plus its owners' share of the pending matrices' NS."""
        items = [(w, x) for w in pending_workers for x in shapes[w]]
        takers = [w for w in range(d) if shapes[w]]
        owners = plan_owners([ns_flops(x) for _, x in items], [[w] for w, _ in items], d, takers)
        load = [0.0] * d
        comm = [0.0] * d
        for (w, x), o in zip(items, owners):
            load[o] += ns_flops(x) / CPU_HARDWARE.flops_per_s * 1e9
            if o != w:  # there and back, on both ends' links
                t = 2 * 4 * x[0] * x[1] / CPU_HARDWARE.p2p_bytes_per_s * 1e9
                comm[o] += t
                comm[w] += t
        final = [base[w] + load[w] + comm[w] for w in range(d)]
        if any(o != w for (w, _), o in zip(items, owners)):
            final = [max(final)] * d  # the result exchange is a collective over all workers
        return tuple(round(f) for f in final)

    late = sorted(late_workers(per_stage_steps(schedule)))
    arms["muon global+spread"] = (schedule, replace(glob, worker_step_ns=spread(list(range(d)), list(glob.worker_step_ns))))
    arms["muon per_stage+spread"] = (per_stage_steps(schedule), replace(
        per, stage_step_ns=tuple(e + (0 if s in late else ns[s]) for s, e in enumerate(elem)),
        worker_step_ns=spread(late, list(tied))))
    return arms


def simulated(cases: list[tuple[str, str, int, int]]) -> None:
    print("Simulated (planning.costs estimate, CPU_HARDWARE: 3e10 FLOP/s, 1e10 B/s memory, 2e9 B/s p2p; "
          "NS = ns_flops at the FLOP rate; steady-state step, ms):")
    table = []
    for model, method, d, n in cases:
        arms = {k: _steady(s, c) / 1e6 for k, (s, c) in _muon_costs(model, method, d, n).items()}
        for label in ("muon global", "muon per_stage", "muon global+spread", "muon per_stage+spread"):
            placement = label.split()[1].split("+")[0]
            table.append([f"{model} {method} D={d} N={n}", label, arms[label], arms[f"nvlamb {placement}"],
                          arms[label] / arms[f"nvlamb {placement}"], arms[label] / arms["nvlamb global"]])
    print(h.table(["run", "arm", "Muon ms", "NVLAMB same placement ms", "Muon / NVLAMB same placement",
                   "Muon / NVLAMB global"], table))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-tiny")
    p.add_argument("--methods", nargs="+", default=["1f1b", "chimera"])
    p.add_argument("--clips", nargs="+", default=["0", "1.0"],
                   help="optimizer.max_grad_norm (0: off, every stage step confirmed; 1.0: the default, active "
                        "early in training, so every stage defers to the final STEP)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--simulate-only", action="store_true")
    p.add_argument("--fused-adamw", action="store_true",
                   help="add Muon arms with optimizer.adamw_kernel=fused (AdamW's half on torch's fused kernel)")
    args = p.parse_args()
    arms = ARMS + ([(label + FUSED, *rest) for label, *rest in ARMS if rest[0] == "muon"] if args.fused_adamw else [])
    sims = [("bert-tiny", "1f1b", 2, 4), ("bert-mini", "1f1b", 4, 8), ("bert-medium", "1f1b", 4, 8),
            ("bert-medium", "1f1b", 8, 16), ("bert-large", "1f1b", 8, 16)]
    if args.simulate_only:
        simulated(sims)
        return
    steps = args.warmup + args.rounds + 1
    shapes = [(f"{args.model} {m} clip {c}", [_overrides(args.model, m, c, args.micro_batches, steps, a) for a in arms])
              for m in args.methods for c in args.clips]
    before = h.load()
    out = h.launch(_run, 2, shapes, args.warmup, args.rounds)
    rows, threads = out[0]["result"]["rows"], out[0]["result"]["threads"]
    print(f"Measured: D=2, N={args.micro_batches}, micro-batch 2, seq 128, fp32 model, dropout 0; {args.rounds} "
          f"rounds after {args.warmup} warm-up, {len(arms)} arms per shape, order rotated; medians over rounds. "
          f"{h.caveat(2)} {before} before the run, {h.load()} after.")
    print(f"Hardware: {hardware_line(threads)}")
    for shape, _ in shapes:
        arm = {label: rows[f"{shape}|{i}"] for i, (label, *_) in enumerate(arms)}
        med = lambda rs, k: statistics.median(r.get(k, 0.0) for r in rs)  # noqa: E731
        ratio = lambda a, b: statistics.median(x["wall_ms"] / y["wall_ms"] for x, y in zip(arm[a], arm[b]))  # noqa: E731
        table = []
        for label, opt, placement, owners in arms:
            rs = arm[label]
            same = f"nvlamb {placement}"
            stage_keys = sorted(k for k in rs[0] if k.startswith("stage"))
            table.append([
                label, med(rs, "wall_ms"), ratio(label, same) if opt == "muon" else 1.0, ratio(label, "nvlamb global"),
                ratio(label, label.split("+")[0] + (FUSED if label.endswith(FUSED) else "")) if owners == "pipeline"
                else ratio(label, label[:-len(FUSED)]) if label.endswith(FUSED) else "-",
                ", ".join(f"{med(rs, f'W{w} STEP'):.1f}" for w in (0, 1)),
                ", ".join(f"{k[6:]}: {med(rs, k):.1f}" for k in stage_keys) or "-",
                ", ".join(f"{med(rs, f'W{w} resolve'):.1f} ({med(rs, f'W{w} NS'):.1f})" for w in (0, 1))
                if owners == "pipeline" else "-",
                ", ".join(f"{med(rs, f'W{w} got'):g}" for w in (0, 1)) if owners == "pipeline" else "-",
                sum(r["rollbacks"] for r in rs)])
        print(f"\n{shape}")
        print(h.table(["arm", "step ms", "/ NVLAMB same placement", "/ NVLAMB global", "/ Muon holder", "final STEP ms (W0, W1)",
                       "stage STEP ms", "resolve ms (NS ms) W0, W1", "NS for the other (W0, W1)", "rollbacks"],
                      table))
        phases = []
        for label, opt, _, _ in arms:
            rs = arm[label]
            cells = [label]
            for w in (0, 1):
                cells.append(f"{med(rs, f'W{w} opt'):.1f}" if opt == "nvlamb" else
                             " / ".join(f"{med(rs, f'W{w} {k}'):.1f}" for k in ("opt", "NS", "momentum", "adamw")))
            phases.append(cells)
        print(f"\n{shape}: optimizer phases per worker, ms per step (summed over its STEPs; NVLAMB: its step; "
              "Muon: optimizer.step calls / NS / Muon's momentum and update / AdamW's half; the spread's NS "
              "runs in the final STEP's resolve, outside optimizer.step)")
        print(h.table(["arm", "W0", "W1"], phases))


if __name__ == "__main__":
    h.main_guard(main)
