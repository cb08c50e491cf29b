"""Per-stage optimizer steps against the global step, same optimizer (issue 36, items 1, 2 and 5).

    python bench/optimizer_placement.py                                  # bert-tiny and bert-mini, D=2: 1f1b, chimera
    python bench/optimizer_placement.py --models bert-mini --optimizers nvlamb muon --rounds 8
    python bench/optimizer_placement.py --simulate-only                  # D=4 and D=8 through the simulator
    python bench/optimizer_placement.py --models bert-tiny --optimizers nvlamb pipefisher --micro-batch-size 8 \
        --seq-len 64 --vocab-size 8192 --rounds 42                      # study 7's D=2 shape, PipeFisher vs NVLAMB
    python bench/optimizer_placement.py --stages 4 --models bert-mini --layers 8 --methods 1f1b zb-v  # >= 16 cores
    python bench/optimizer_placement.py --models bert-tiny --methods chimera --micro-batch-size 8 --seq-len 64 \
        --vocab-size 8192 --rounds 84 --optimizers nvlamb pipefisher pipefisher:kfac_owners=replicas  # K-FAC owners

Measured (D=2 by default, ``--stages`` worker processes on this machine's cores): each variant runs
``PipelineWorker.train_step`` with ``optimizer_placement=global`` and ``per_stage`` in the same two
processes, alternating step by step, the order rotated every round (``_harness`` [Note: measuring
on a shared CPU]); dropout 0. Reported, medians over rounds: the step's wall time (slowest worker,
after a barrier), the global STEP of each worker (its compute, after the wait for the global norm),
each stage's STEP under per_stage (its optimizer work, in the bubble), the final STEP that remains
(the tied weight, the norm's check), and the rollbacks ([Note: post-validation]); beside the
median step, the mean step over all rounds (K-FAC and PipeFisher: give ``--rounds`` a multiple of the
refresh interval, so the mean covers whole cycles).

Simulated (D=4, D=8): the FLOP and memory-bandwidth estimate of ``planning.costs`` (``CPU_HARDWARE``,
the runtime's start-up model), each stage's step priced for each optimizer by ``planning.optimizer_costs``
(NVLAMB and AdamW by the stage's own parameters, memory-bound; Muon's Newton–Schulz on the stage's encoder
matrices besides), the tied weight at the final STEP of the workers holding the first or last stage, the global
step by the sum over the worker's stages; per_stage with the pass's default placement and with
``place_stage_steps``.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import replace

import torch

import _harness as h
from pipefisher.config import KFAC_OPTIMIZERS
from pipefisher.hardware import describe_hardware
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import estimate_run_costs, stage_parameters
from pipefisher.planning.optimizer_costs import ELEMENTWISE_OPTIMIZERS, muon_matrices, optimizer_step_seconds
from pipefisher.planning.owner_costs import with_owners
from pipefisher.planning.step_placement import global_step_costs, place_stage_steps
from pipefisher.runtime.build import CPU_HARDWARE, encoder_layers_per_stage, kfac_assignment, run_shape, stage_slices
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.schedules.passes import per_stage_steps
from pipefisher.simulate import CostModel, simulate_phases
from pipefisher.timeline import Event, is_wait

PLACEMENTS = ("global", "per_stage")
SIMULATED_ARMS = ("nvlamb", "adamw", "muon", "kfac", "ekfac", "pipefisher")


def hardware_line(threads: int) -> str:
    """The CPU (model, cores, the flags that decide its arithmetic) and torch version, with the threads each
    worker ran on (``describe_hardware`` counts the driver's)."""
    return f"{describe_hardware('cpu')} in the driver; {threads} thread(s) per worker"


def _step_parts(events: list[Event]) -> dict[str, float]:
    """This step's optimizer events in ms: per worker its global or final STEP and its PRECONDs (K-FAC: they go
    with the stage steps under per_stage), per stage its STEP."""
    out: dict[str, float] = {}
    for e in events:
        if e.kind not in ("STEP", "PRECOND") or is_wait(e):
            continue
        if e.kind == "PRECOND":
            key = f"W{e.worker} PRECOND"
        else:
            key = f"W{e.worker} STEP" if e.name == "STEP" else \
                f"stage {e.name.split('STEP')[0]}{e.name.split('STEP')[1]}"
        out[key] = out.get(key, 0.0) + e.duration_ns / 1e6
    return out


def _run(rank: int, world: int, variants: list[tuple[str, list[str]]], warmup: int, rounds: int) -> dict:
    workers = {(name, placement): PipelineWorker(h.compose(overrides + [f"optimizer_placement={placement}"]), rank,
                                                 world, torch.device("cpu"))
               for name, overrides in variants for placement in PLACEMENTS}
    rows: dict[str, list[dict]] = defaultdict(list)
    for key, seconds, events in h.timed_rounds(workers, warmup, rounds):
        rows[f"{key[0]}|{key[1]}"].append({"wall_ms": seconds * 1e3, "rollbacks": workers[key].rollbacks,
                                           **_step_parts(events)})
    return {"rows": dict(rows), "threads": torch.get_num_threads()}


def measure(models: list[str], methods: list[str], optimizers: list[str], clips: list[str], micro_batches: int,
            warmup: int, rounds: int, stages: int = 2, layers: int | None = None, micro_batch_size: int = 2,
            seq_len: int = 128, vocab_size: int | None = None) -> None:
    depth = [f"model.num_layers={layers}"] if layers else []
    depth += [f"model.vocab_size={vocab_size}"] if vocab_size else []
    variants = []
    for model in models:
        for method in methods:
            for arm, clip in [(o, c) for o in optimizers for c in clips]:
                variants.append((f"{model} {method} {arm} clip {clip}", [f"optimizer.max_grad_norm={clip}",
                    f"model={model}", *depth, f"pipeline={method}", f"stages={stages}",
                    f"num_micro_batches={micro_batches}", f"micro_batch_size={micro_batch_size}",
                    f"data.seq_len={seq_len}", *_arm_overrides(arm),
                    f"steps={warmup + rounds + 1}", "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]))
    load = h.load()
    out = h.launch(_run, stages, variants, warmup, rounds)
    rows, threads = out[0]["result"]["rows"], out[0]["result"]["threads"]
    shape = (f"{layers} layers, " if layers else "") + (f"vocabulary {vocab_size}, " if vocab_size else "")
    print(f"Measured: D={stages}, N={micro_batches}, {shape}micro-batch {micro_batch_size}, seq {seq_len}, fp32, "
          f"dropout 0; {rounds} rounds "
          f"after {warmup} warm-up, order rotated; medians over rounds. {h.caveat(stages)} {load} before the run.")
    print(f"Hardware: {hardware_line(threads)}")
    table = []
    for name, _ in variants:
        g, p = rows[f"{name}|global"], rows[f"{name}|per_stage"]
        med = lambda rs, k: statistics.median(r.get(k, 0.0) for r in rs)  # noqa: E731
        ratio = statistics.median(b["wall_ms"] / a["wall_ms"] for a, b in zip(g, p))
        glob_steps = ", ".join(f"{med(g, k):.1f}" for k in sorted(k for k in g[0] if k.endswith(" STEP")))
        stage_keys = sorted(k for k in p[0] if k.startswith("stage"))
        stage_steps = ", ".join(f"{k[6:]}: {med(p, k):.1f}" for k in stage_keys)
        final = ", ".join(f"{med(p, k):.1f}" for k in sorted(k for k in p[0] if k.endswith(" STEP")))
        workers = sorted(k.split()[0] for k in g[0] if k.endswith(" STEP"))
        precond = ", ".join(f"{med(g, f'{w} PRECOND'):.1f}" for w in workers) if any(
            k.endswith("PRECOND") for k in g[0]) else "-"
        # The work per_stage can take off the critical path: the slowest worker's global STEP (with its PRECONDs,
        # which move with the stage steps) less the slowest final STEP that remains (every stage's STEP hidden in
        # a bubble); the wall time saved should match it.
        hideable = (max(med(g, f"{w} STEP") + med(g, f"{w} PRECOND") for w in workers)
                    - max((med(p, k) for k in p[0] if k.endswith(" STEP")), default=0.0))
        saved = med(g, "wall_ms") - med(p, "wall_ms")
        mean = lambda rs: statistics.fmean(r["wall_ms"] for r in rs)  # noqa: E731  (K-FAC: over refresh cycles)
        table.append([name, med(g, "wall_ms"), med(p, "wall_ms"), mean(g), mean(p), ratio, saved, hideable,
                      saved / hideable if hideable > 0 else float("nan"), glob_steps, precond, stage_steps, final,
                      sum(r["rollbacks"] for r in p)])
    print(h.table(["variant", "global step ms", "per_stage step ms", "global mean ms", "per_stage mean ms",
                   "per_stage / global", "saved ms",
                   "hideable STEP ms", "saved / hideable", "global STEP ms (W0..)", "global PRECOND ms (W0..)",
                   "stage STEP ms", "final STEP ms (W0..)", "rollbacks"], table))
    # Each optimizer against NVLAMB of the same model, schedule and clip, both placements: ratios of the mean
    # steps over all rounds (the arms ran interleaved in the same processes; K-FAC's refresh cycles included).
    means = {name: {q: statistics.fmean(r["wall_ms"] for r in rows[f"{name}|{q}"]) for q in PLACEMENTS}
             for name, _ in variants}
    against = []
    for name, _ in variants:
        model, method, opt, *clip = name.split(" ")
        ref = " ".join([model, method, "nvlamb", *clip])
        if opt != "nvlamb" and ref in means:
            against.append([name, *(means[name][q] / means[ref][q] for q in PLACEMENTS),
                            means[name]["per_stage"] / means[ref]["global"]])
    if against:
        print("\nAgainst NVLAMB (same model, schedule, clip), ratio of mean steps:")
        print(h.table(["variant", "global / nvlamb global", "per_stage / nvlamb per_stage",
                       "per_stage / nvlamb global"], against))


def _arm_overrides(arm: str) -> list[str]:
    """``optimizer=<name>`` and its ``optimizer.*`` options from an arm such as ``pipefisher:kfac_owners=replicas``."""
    opt, *options = arm.split(":")
    return [f"optimizer={opt}", *(f"optimizer.{x}" for x in options)]


def _costs(model: str, method: str, stages: int, micro_batches: int, arm: str = "nvlamb") -> tuple:
    """The phases train.py runs for ``arm`` (one schedule, or a K-FAC assignment's) and their global and
    per-stage cost models from the start-up estimate; each stage's step priced by ``planning.optimizer_costs``
    (NVLAMB and AdamW memory-bound, Muon's Newton–Schulz on the stage's encoder matrices; K-FAC, PipeFisher and
    EKFAC: their LAMB update as NVLAMB's, their PRECOND and other units by ``planning.costs``, each layer's on its
    owner with ``kfac_owners=replicas``, as the search prices them), the tied weight element-wise at the final STEP.
    Also returns whether stage steps wait for the owners' exchanges."""
    cfg = h.compose([f"model={model}", f"pipeline={method}", f"stages={stages}", f"num_micro_batches={micro_batches}",
                     "micro_batch_size=2", "data.seq_len=128", *_arm_overrides(arm)])
    run = run_shape(cfg)
    cost = estimate_run_costs(run, CPU_HARDWARE)  # K-FAC's units by run.preconditioner (kfac or ekfac)
    schedule = run.build_schedule()
    exchanges = cfg.optimizer.kfac_owners == "replicas"  # as PipelineWorker builds per_stage's phases
    if exchanges and cfg.optimizer.name in KFAC_OPTIMIZERS:  # each layer inverted and preconditioned on its owner
        cost = with_owners(cost, schedule, run, CommCosts({}, CPU_HARDWARE))
    element_wise = cfg.optimizer.name if cfg.optimizer.name in ELEMENTWISE_OPTIMIZERS else "nvlamb"
    params = stage_parameters(run.bert, stage_slices(cfg, schedule.num_stages))
    layers = encoder_layers_per_stage(cfg, schedule.num_stages)
    tied = run.bert.vocab_size * run.bert.hidden_size
    last = schedule.num_stages - 1
    own = [p - (tied if s in (0, last) and last > 0 else 0) for s, p in enumerate(params)]
    stage_ns = tuple(round(1e9 * optimizer_step_seconds(element_wise, p, muon_matrices(run.bert, n), CPU_HARDWARE))
                     for p, n in zip(own, layers))
    tied_step_ns = round(1e9 * optimizer_step_seconds("nvlamb", tied, [], CPU_HARDWARE))  # element-wise in every arm
    worker_final = tuple(tied_step_ns if any(s in (0, last) for _, _, s in schedule.placement.stages_of(w)) else 0
                         for w in sorted(schedule.actions))
    per = replace(cost, step_ns=0, worker_step_ns=worker_final, stage_step_ns=stage_ns)
    glob = global_step_costs(per, schedule)  # each worker's stage steps in its one STEP
    phases = kfac_assignment(cfg, schedule).phases if cfg.optimizer.name in KFAC_OPTIMIZERS else (schedule,)
    return phases, glob, per, exchanges


def _steady(phases: tuple, cost: CostModel) -> int:
    """Mean simulated step of the third of three cycles (a cycle: one step, or a K-FAC plan's k phases)."""
    return _simulated_step(phases, cost)[0]


def _simulated_step(phases: tuple, cost: CostModel) -> tuple[int, int]:
    """The mean step of the third of three cycles and the largest worker's PRECOND per step in it, ns."""
    events = simulate_phases(phases, cost, cycles=3)
    k = len(phases)
    ends = [max(e.end_ns for e in events if e.step // k == c) for c in range(3)]
    precond: dict[int, int] = defaultdict(int)
    for e in events:
        if e.kind == "PRECOND" and e.step // k == 2:
            precond[e.worker] += e.duration_ns
    return round((ends[2] - ends[1]) / k), round(max(precond.values(), default=0) / k)


def simulated(cases: list[tuple[str, str, int, int]], optimizers: list[str]) -> None:
    print(f"Simulated (planning.costs estimate, CPU_HARDWARE: {CPU_HARDWARE.flops_per_s / 1e9:.0f} GFLOP/s, "
          f"{CPU_HARDWARE.memory_bytes_per_s / 1e9:.0f} GB/s; steps by planning.optimizer_costs; K-FAC arms: the "
          f"plan train.py runs, mean step over its refresh cycle of k steps; ms):")
    table = []
    for model, method, d, n in cases:
        for arm in optimizers:
            phases, glob, per, exchanges = _costs(model, method, d, n, arm)
            t_glob, precond = _simulated_step(phases, glob)
            t_per = _steady(tuple(per_stage_steps(p, exchanges=exchanges) for p in phases), per)
            placed = tuple(per_stage_steps(p, exchanges=exchanges) if exchanges else place_stage_steps(p, per)
                           for p in phases)
            t_placed = _steady(placed, per)
            table.append([f"{model} {method} D={d} N={n} {arm}", len(phases), t_glob / 1e6, t_per / 1e6,
                          t_placed / 1e6, t_per / t_glob, t_placed / t_glob, max(glob.worker_step_ns) / 1e6,
                          precond / 1e6, (t_glob - t_placed) / 1e6])
    print(h.table(["run", "k", "global ms", "per_stage ms", "per_stage placed ms", "per_stage / global",
                   "placed / global", "largest worker STEP ms", "largest worker PRECOND ms", "saved ms"], table))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["bert-tiny", "bert-mini"])
    p.add_argument("--methods", nargs="+", default=["1f1b", "chimera"])
    p.add_argument("--optimizers", nargs="+", default=["nvlamb"],
                   help="arms: an optimizer, with optimizer.* options after colons (pipefisher:kfac_owners=replicas)")
    p.add_argument("--clips", nargs="+", default=["1.0", "0"],
                   help="optimizer.max_grad_norm values (1.0: the default, active early in training; 0: off)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--stages", type=int, default=2, help="D: worker processes (one pipeline); at least D cores")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=None, help="model.vocab_size (study 7's WikiText-2 shards: 8192)")
    p.add_argument("--layers", type=int, default=None,
                   help="model.num_layers (V schedules need stages * 2 <= layers + 2)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--simulate-only", action="store_true")
    p.add_argument("--simulate-optimizers", nargs="+", default=list(SIMULATED_ARMS),
                   help="arms the simulated D=4/D=8 table prices (optimizer.* options after colons, as --optimizers)")
    args = p.parse_args()
    if not args.simulate_only:
        measure(args.models, args.methods, args.optimizers, args.clips, args.micro_batches, args.warmup, args.rounds,
                args.stages, args.layers, args.micro_batch_size, args.seq_len, args.vocab_size)
        print()
    simulated([(m, method, d, n) for m, d, n in (("bert-medium", 4, 8), ("bert-large", 8, 16))
               for method in ("1f1b", "chimera", "zb-v")], args.simulate_optimizers)


if __name__ == "__main__":
    h.main_guard(main)
