"""Zero-bubble schedules: ours (zb-h1, zb-v) against our 1F1B and torch's zero-bubble schedules,
measured at D=2 on the same BERT stages; then by simulation against the closed forms and the lower
bound, and PipeFisher's K-FAC work on each schedule.

    python bench/zero_bubble.py             # bert-mini, D=2, N=8, B=4, 12 paired rounds + simulation (~15 min)
    python bench/zero_bubble.py --quick     # B=2, 3 rounds, the PipeFisher simulation at D=8 only (~3 min)
    python bench/zero_bubble.py --sim-only  # the simulation tables, with I/W/B ratios given on the command line
    python bench/zero_bubble.py --quick --model bert-medium --dualpipev --no-pipefisher   # + DualPipeV, ours and torch's

Measured variants (every one in the same two worker processes, rotated every round, DESIGN.md
"Conventions" and ``_harness`` [Note: measuring on a shared CPU]):

- ``ours-1f1b``, ``ours-zb-h1``, ``ours-zb-v``: ``PipelineWorker.train_step`` with the run's
  schedule (zb-v with its V partition, ``partition_layers(..., v_shape=True)``).
- ``torch-izb``: ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` on the stages of our
  zb-h1 (one ``BertStage`` per rank); ``torch-zbv``: ``ScheduleZBVZeroBubble`` on the stages of our
  zb-v (two per rank, V placement). Stages are wrapped as in ``vs_torch_pipelining.py`` ([Note: one
  BERT stage, two calling conventions]) with one batch feed per stage (each stage runs its forwards
  in micro-batch order in both torch schedules).
- with ``--dualpipev``: ``ours-dualpipev`` (pipeline=dualpipev) and ``torch-dualpipev``
  (``ScheduleDualPipeV`` on the same V stages; its OVERLAP_F_B runs forward then backward, as ours).

Every variant's step: forward and backward of N micro-batches, the tied word-embedding/decoder
gradient summed over its copies, the global gradient norm, an NVLAMB update; dropout 0, so the
losses must agree (``max |Δloss|`` against ours-1f1b).

Simulation: F, B, I, W costs per stage are the means measured above (or ``--ratios``), scaled to
D = 8, 16, 32 stages of equal cost, with N = 2D.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

import _harness as h
from pipefisher.config import TrainConfig
from pipefisher.model import BertConfig
from pipefisher.planning.assign import plan_pipefisher
from pipefisher.planning.costs import Hardware, RunShape, estimate_run_costs
from pipefisher.runtime.split_backward import disable_split_backward
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.schedules import build_schedule
from pipefisher.schedules.kfac import kfac_layer_counts
from pipefisher.simulate import CostModel, simulate, simulate_phases

VARIANTS = ("ours-1f1b", "ours-zb-h1", "ours-zb-v", "torch-izb", "torch-zbv")
# PipeFisher (K-FAC in the bubbles, planned from the built-in CPU estimate) on our schedules.
PF_VARIANTS = ("pf-1f1b", "pf-zb-h1", "pf-zb-v")
DPV_VARIANTS = ("ours-dualpipev", "torch-dualpipev")  # --dualpipev
_METHOD = {"ours-1f1b": "1f1b", "ours-zb-h1": "zb-h1", "ours-zb-v": "zb-v", "torch-izb": "zb-h1", "torch-zbv": "zb-v",
           "pf-1f1b": "1f1b", "pf-zb-h1": "zb-h1", "pf-zb-v": "zb-v", "ours-dualpipev": "dualpipev",
           "torch-dualpipev": "dualpipev"}


class _TorchZeroBubble:
    """torch's zero-bubble schedule over this rank's stages of our ``PipelineWorker`` (same weights,
    data, optimizer and tied-weight group as ours)."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, kind: str) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble
        from torch.distributed.pipelining.schedules import ScheduleDualPipeV

        self.cfg, self.rank = cfg, rank
        self.worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
        # torch's own runtime on plain layers: our executor's deferrable ones would make torch's I compute W too
        disable_split_backward(self.worker.modules.values())
        n, b, s, hid = cfg.num_micro_batches, cfg.micro_batch_size, cfg.data.seq_len, cfg.model.hidden_size
        total = self.worker.schedule.num_stages
        self.feeds, stages = [], []
        for (_, stage), module in sorted(self.worker.modules.items()):
            feed = h.BatchFeed(self.worker)
            self.feeds.append(feed)
            example_in = torch.zeros(1, 1) if stage == 0 else torch.zeros(b, s, hid, requires_grad=True)
            example_out = (torch.zeros(2, requires_grad=True) if stage == total - 1
                           else torch.zeros(b, s, hid, requires_grad=True))
            stages.append(PipelineStage(h.TensorStage(module, feed), stage, total, torch.device("cpu"),
                                        input_args=example_in, output_args=example_out))
        self.has_first = any(st.stage_index == 0 for st in stages)
        self.has_last = any(st.stage_index == total - 1 for st in stages)
        scale = 1.0 / n
        schedule_cls = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}.get(kind, ScheduleInterleavedZeroBubble)
        self.schedule = schedule_cls(stages, n, loss_fn=lambda out, _t: out.float().sum() * scale, scale_grads=False)
        self.root, self.target = torch.zeros(n, 1), torch.zeros(n)

    def train_step(self, step: int) -> tuple[float, dict]:
        w = self.worker
        for feed in self.feeds:
            feed.start(step)
        losses: list[torch.Tensor] = []
        args = (self.root,) if self.has_first else ()
        kwargs = {"target": self.target, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        total = torch.tensor([float(sum(x.detach().float() for x in losses))]) if losses else torch.zeros(1)
        w.executor.reduce_tied_grads()  # every copy of the tied weight gets the sum of all copies' gradients
        norm = w.global_grad_norm()
        w.optimizer.step(grad_norm=norm)
        w.scheduler.step()
        w.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return float(total.item()), {}


def _ours(cfg: TrainConfig, rank: int, world: int):
    worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
    k = worker.assignment.interval if worker.assignment is not None else 0

    def step(i: int) -> tuple[float, dict]:
        losses, result = worker.train_step(i)
        costs: dict[str, list[int]] = defaultdict(list)
        for e in result.events:
            if e.kind in ("F", "B", "I", "W"):
                costs[e.kind].append(e.duration_ns)
                costs[e.name.split(e.kind, 1)[0] + e.kind].append(e.duration_ns)  # per stage, e.g. 1I
        costs["k"] = [k]
        return float(sum(losses)), costs

    step.interval = k  # the refresh cycle's length (0 without K-FAC)
    return step


def _run(rank: int, world: int, overrides: list[str], warmup: int, repeats: int, variants: tuple[str, ...]) -> dict:
    runners = {}
    for v in variants:
        cfg = h.compose(overrides + [f"pipeline={_METHOD[v]}"] + (["optimizer=pipefisher"] if v.startswith("pf") else []))
        runners[v] = _TorchZeroBubble(cfg, rank, world, v.split("-")[1]).train_step if v.startswith("torch") else \
            _ours(cfg, rank, world)
    times = {v: [] for v in variants}
    losses = {v: [] for v in variants}
    costs = {v: defaultdict(list) for v in variants}
    # PipeFisher: measure whole refresh cycles after the first one. In the first cycle most layers have
    # no inverses yet and skip part of PRECOND (on the critical path), which would flatter its step time.
    cycle = max([k for r in runners.values() for k in [getattr(r, "interval", 0)]] + [1])
    if cycle > 1:
        warmup = max(warmup, cycle)
        repeats = -(-repeats // cycle) * cycle
    for step, v, seconds, (loss, c) in h.timed_rotation(runners, warmup, repeats):
        losses[v].append(loss)
        if step >= warmup:
            times[v].append(seconds)
            for kind, values in c.items():
                costs[v][kind] += values
    return {"times": times, "losses": losses, "costs": {v: dict(c) for v, c in costs.items()},
            "warmup": warmup, "repeats": repeats}


def _measure(args: argparse.Namespace) -> dict[str, float]:
    b = args.micro_batch_size or (2 if args.quick else 4)
    repeats = args.repeats or (3 if args.quick else 12)
    warmup = 1
    overrides = [f"model={args.model}", "stages=2", f"num_micro_batches={args.micro_batches}", f"micro_batch_size={b}",
                 # room for PipeFisher's first refresh cycle and whole cycles after it (k <= max_interval=8)
                 f"steps={warmup + repeats + 24}", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
                 "optimizer=nvlamb"]
    load_before = h.load()
    measured = VARIANTS + (DPV_VARIANTS if args.dualpipev else ())
    variants = measured + (PF_VARIANTS if args.pipefisher else ())
    results = [r["result"] for r in h.launch(_run, 2, overrides, warmup, repeats, variants)]
    out = results[0]
    warmup, repeats = out["warmup"], out["repeats"]  # PipeFisher: after its first refresh cycle, whole cycles
    times = out["times"]
    base_loss = out["losses"]["ours-1f1b"]

    def paired(a: str, c: str) -> tuple[float, str]:
        r = [x / y for x, y in zip(times[a], times[c])]
        return h.median(r), f"{min(r):.2f}-{max(r):.2f}"

    print(f"{args.model}, D=2, N={args.micro_batches}, B={b}, seq 128, fp32, NVLAMB, dropout 0; {repeats} paired rounds "
          f"after {warmup} warm-up, order rotated; gloo on CPU")
    rows = []
    for v in measured:
        dloss = max(abs(x - y) for x, y in zip(out["losses"][v], base_loss))
        rows.append([v, 1e3 * h.median(times[v]), 1e3 * min(times[v]), f"{dloss:.1e}"])
    print(h.table(["variant", "median ms", "min ms", "max |Δloss| vs ours-1f1b"], rows))
    print()
    if args.pipefisher:
        rows = []
        for v in PF_VARIANTS:
            base = "ours-" + _METHOD[v]
            k = out["costs"][v]["k"][0]
            # mean over whole cycles of k steps (a refresh's steps differ), against the same rounds without K-FAC
            cycles = max(len(times[v]) // k * k, 1)  # at least one step (a quick run may hold no whole cycle)
            ratio = statistics.fmean(times[v][:cycles]) / statistics.fmean(times[base][:cycles])
            rows.append([v, k, 1e3 * statistics.fmean(times[v][:cycles]), ratio, paired(v, "pf-1f1b")[0]])
        print("PipeFisher (optimizer=pipefisher, plan from the built-in CPU estimate), same rounds")
        print(h.table(["variant", "k", "mean step ms (whole cycles)", "step / same schedule without K-FAC",
                       "paired / pf-1f1b"], rows))
        print()
    pairs = [("ours-zb-v", "ours-1f1b"), ("ours-zb-h1", "ours-1f1b"), ("ours-zb-v", "torch-zbv"),
             ("ours-zb-h1", "torch-izb"), ("torch-zbv", "ours-1f1b")]
    if args.dualpipev:
        pairs += [("ours-dualpipev", "torch-dualpipev"), ("ours-dualpipev", "ours-zb-v"), ("ours-dualpipev", "ours-1f1b"),
                  ("torch-dualpipev", "ours-1f1b")]
    print(h.table(["ratio", "paired median", "paired range"], [[f"{a} / {c}", *paired(a, c)] for a, c in pairs]))
    print()
    # Measured action costs (ms, mean per stage over the rounds): what the simulation below uses.
    merged: dict[str, list[int]] = defaultdict(list)
    for r in results:
        for v in ("ours-1f1b", "ours-zb-h1"):
            for kind, values in r["costs"][v].items():
                merged[(v, kind)] += values
    mean = {key: statistics.fmean(vals) / 1e6 for key, vals in merged.items()}
    # Per stage, I and W of zb-h1 against the same stage's B under 1f1b (zb-h1's first stage runs
    # full Bs: nothing waits for an input gradient there). The simulation takes the last split stage.
    rows, split = [], []
    for s in (0, 1):
        f, full = mean[("ours-1f1b", f"{s}F")], mean[("ours-1f1b", f"{s}B")]
        i, w = mean.get(("ours-zb-h1", f"{s}I")), mean.get(("ours-zb-h1", f"{s}W"))
        if i is None or w is None:
            rows.append([s, f, full, "-", "-", "-", "-", "-"])
            continue
        split.append((f, full, i, w))
        rows.append([s, f, full, i, w, (i + w) / full, i / full, w / full])
    print(h.table(["stage", "F ms", "B ms (1f1b)", "I ms", "W ms", "(I+W)/B", "I/B", "W/B"], rows))
    nan = float("nan")
    f, full, i, w = split[-1] if split else (mean[("ours-1f1b", "F")], mean[("ours-1f1b", "B")], nan, nan)
    print(f"D=2: {h.caveat(2)}")
    print(f"Machine: {load_before} before, {h.load()} after.")
    print()
    return {"F": f / f, "B": full / f, "I": i / f, "W": w / f}


def _uniform(d: int, ratios: dict[str, float], chunks: int = 1) -> CostModel:
    """Equal stages whose costs have the measured ratios; a worker's share split into ``chunks``."""
    unit = 10_000 // chunks
    return CostModel.uniform(d * chunks, round(unit * ratios["F"]), round(unit * ratios["B"]),
                             input_grad_ns=round(unit * ratios["I"]), weight_grad_ns=round(unit * ratios["W"]))


def _span(schedule, cost: CostModel) -> int:
    events = simulate(schedule, cost)
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def _simulate(ratios: dict[str, float]) -> None:
    print(f"Simulated step (no communication cost), stage costs F={ratios['F']:.2f} B={ratios['B']:.2f} "
          f"I={ratios['I']:.2f} W={ratios['W']:.2f} (F = 1); N = 2D; each worker holds 1/D of the model")
    rows = []
    for d in (2, 4, 8, 16, 32):
        n = 2 * d
        one = _uniform(d, ratios)
        f, i, w = ratios["F"], ratios["I"], ratios["W"]
        lower = n * (f + i + w) + (d - 1) * f / 2  # ZB-V's bound: v = 2 chunks per worker
        t = {m: _span(build_schedule(m, d, n), one) / 10_000 for m in ("1f1b", "zb-h1")}
        t["chimera"] = _span(build_schedule("chimera", d, n), one) / 10_000
        two = _uniform(d, ratios, 2)
        measured = (ratios["F"], ratios["I"], ratios["W"])
        t["zb-v"] = _span(build_schedule("zb-v", d, n, num_virtual=2), two) / 10_000
        t["zb-v costs"] = _span(build_schedule("zb-v", d, n, num_virtual=2, order_costs=measured), two) / 10_000
        t["zb-v 1.5x"] = _span(build_schedule("zb-v", d, n, num_virtual=2, order_costs=measured,
                                              activation_memory=1.5), two) / 10_000
        h1_closed = n * (f + i + w) + (d - 1) * (f + i - w)
        rows.append([d, n, t["1f1b"], t["chimera"], t["zb-h1"], h1_closed, t["zb-v"], t["zb-v costs"], t["zb-v 1.5x"],
                     lower, t["zb-v"] / lower, t["zb-v costs"] / lower, t["zb-v 1.5x"] / lower,
                     t["zb-h1"] / t["1f1b"], t["zb-v costs"] / t["1f1b"]])
    print(h.table(["D", "N", "1f1b", "chimera", "zb-h1", "ZB-H1 form", "zb-v", "zb-v (order by costs)",
                   "zb-v (costs, 1.5x memory)", "lower bound", "zb-v / bound", "by costs / bound",
                   "1.5x memory / bound", "zb-h1 / 1f1b", "zb-v (costs) / 1f1b"], rows))
    print("Times in units of F; ZB-H1 form: N(F+I+W)+(D-1)(F+I-W), exact for F = I = W "
          "(tests/test_zero_bubble.py); lower bound: N(F+I+W)+(D-1)F/2; zb-v orders by equal costs unless "
          "'order by costs' (pipeline.order_costs=[F,I,W]); 1.5x memory: pipeline.activation_memory=1.5.")
    print()


def _pipefisher_table(ratios: dict[str, float], dims: tuple[int, ...] = (8, 16, 32)) -> None:
    """PipeFisher on each schedule: the K-FAC work of one refresh, the bubbles of one step, the k the
    planner reaches and the step time it predicts, from the built-in GPU cost estimate
    (``Hardware()``) of a BERT-large-width model with 2 encoder layers per worker."""
    print("PipeFisher by simulation (built-in GPU cost estimate; hidden 1024, 2 encoder layers per worker; "
          "N = 2D; I and W split B in the measured ratio)")
    rows = []
    for d in dims:
        for method, placement in (("1f1b", "after_capture"), ("chimera", "after_capture"), ("zb-h1", "after_capture"),
                                  ("zb-h1", "beside_w"), ("zb-v", "after_capture"), ("zb-v", "beside_w")):
            n = 2 * d
            chunks = 2 if method == "zb-v" else 1
            bert = BertConfig(hidden_size=1024, num_layers=2 * d, num_heads=16)
            shape = RunShape(bert=bert, method=method, stages=d, num_micro_batches=n, micro_batch_size=4,
                             dp_width=1, num_virtual=chunks, seq_len=128, max_predictions=20,
                             layers_per_stage=tuple([2 // chunks] * (d * chunks)) if chunks == 2 else None)
            cost = estimate_run_costs(shape, Hardware())
            share = ratios["I"] / (ratios["I"] + ratios["W"])
            cost = dataclasses.replace(cost, input_grad_ns=tuple(round(b * share) for b in cost.backward_ns),
                                       weight_grad_ns=tuple(b - round(b * share) for b in cost.backward_ns))
            schedule = build_schedule(method, d, n, num_virtual=chunks)
            layers = kfac_layer_counts(schedule, [2 // chunks] * schedule.num_stages)
            base = _span(schedule, cost)
            a = plan_pipefisher(schedule, cost, layers, max_interval=16, curvature_placement=placement)
            events = simulate_phases(a.phases, cost, cycles=2)
            k = a.interval
            step = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) / (2 * k)
            meta = a.metadata
            hidden = 1 - (meta.get("spilled_ns", 0) + meta.get("tail_ns", 0)) / max(1, meta["kfac_work_ns"])
            print(f"  planned D={d} {method} ({placement}): k={k}", file=sys.stderr, flush=True)
            rows.append([d, method, placement, base / 1e6, meta["kfac_work_ns"] / 1e6, meta["bubble_ns"] / 1e6, meta["k_min"], k,
                         f"{hidden:.0%}", step / base, step / 1e6, "fallback" if meta.get("fallback") else ""])
    print(h.table(["D", "schedule", "curvature", "step ms (no K-FAC)", "K-FAC work ms/refresh", "bubbles ms/step", "k_min", "k",
                   "work hidden", "step with PipeFisher / without", "step with PipeFisher ms", "note"], rows))
    print("work and bubbles are summed over workers; hidden = 1 - (spilled + tail work) / work")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sim-only", action="store_true", help="skip the measured part")
    parser.add_argument("--ratios", default="1,2,1.2,1", help="F,B,I,W for --sim-only (F = 1)")
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--dualpipev", action="store_true", help="also measure ours-dualpipev and torch-dualpipev")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-pipefisher", dest="pipefisher", action="store_false",
                        help="skip the PipeFisher variants of the measured part")
    args = parser.parse_args()
    if args.sim_only:
        f, b, i, w = (float(x) for x in args.ratios.split(","))
        ratios = {"F": 1.0, "B": b / f, "I": i / f, "W": w / f}
    else:
        ratios = _measure(args)
    _simulate(ratios)
    _pipefisher_table(ratios, (8,) if args.quick else (8, 16, 32))


if __name__ == "__main__":
    h.main_guard(main)
