"""Where our executor's step differs from the simulator's prediction, per schedule (issue 26, item 7).

    python bench/v_gap.py                                    # bert-medium, D=2, N=8, B=2: 1f1b, zb-h1, zb-v, dualpipev
    python bench/v_gap.py --model bert-mini --rounds 4       # a model too shallow for a balanced V
    python bench/v_gap.py --variants 1f1b zb-v zb-v+pipeline.layers_per_stage=[1,2,3,2]   # overrides after '+'
    python bench/v_gap.py --model bert-base --set data.seq_len=64 --variants 1f1b zb-v dualpipev   # 12 layers

Every variant runs ``PipelineWorker.train_step`` in the same two worker processes, rotated every
round (``_harness`` [Note: measuring on a shared CPU]); dropout 0, NVLAMB. After each step both
workers' timelines are gathered on rank 0 and set against three predictions from that same step:

- ``sim``: ``simulate(schedule, measured_costs(events))``, the per-stage mean F/B/I/W of the step
  (so an unbalanced partition is in it), no communication cost;
- ``sim+p2p``: the same with ``p2p_ns`` = the step's median message latency (receive end − send
  start, over receives already waiting when the send was issued);
- ``replay``: every action at its own measured duration (not the stage mean) on the schedule's
  order and dependencies, with the measured latency: what is left of the gap after it is neither
  cost, variance nor message latency, but time the executor spends outside the recorded actions.

And per worker, the measured step split into compute (F/B/I/W events), receive waits, sends, STEP
(its compute), waits for collectives (the tied weight's all-reduce, the global norm) and untracked (the step's span on that worker minus every event's):
the executor's own overhead between actions.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from dataclasses import replace

import torch

import _harness as h
from pipefisher.runtime.worker import PipelineWorker
from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.passes import matching_send
from pipefisher.simulate import CostModel, simulate
from pipefisher.runtime.step_metrics import measured_costs
from pipefisher.timeline import Event, is_wait, union_length

VARIANTS = ("1f1b", "zb-h1", "zb-v", "dualpipev")
K = ActionKind


def _span(events: list[Event]) -> int:
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def message_latency(events: list[Event]) -> int:
    """Median, over receives already waiting when their send was issued, of (receive end − send
    start), in ns; 0 if none was. (A receive reached after its send would add the time it arrived late.)"""
    sends = {(e.worker, e.name): e for e in events if e.kind in ("SEND_F", "SEND_B")}
    lat = []
    for e in events:
        if e.kind not in ("RECV_F", "RECV_B"):
            continue
        a = Action.from_str(e.name)
        send = sends.get((a.peer, str(matching_send(a, e.worker))))
        if send is not None and e.start_ns <= send.start_ns < e.end_ns:  # it was waiting when the send left
            lat.append(e.end_ns - send.start_ns)
    return round(statistics.median(lat)) if lat else 0


def replay(schedule: Schedule, events: list[Event], p2p_ns: int) -> int:
    """Span of the schedule with every compute action at its own measured duration.

    Same rules as the simulator ([Note: simulated semantics]) for compute and point-to-point
    actions; STEP at each worker's measured duration once every worker has reached it.
    """
    took = {(e.worker, e.name): e.end_ns - e.start_ns for e in events
            if e.kind in ("F", "B", "I", "W", "STEP")}
    clock = {w: 0 for w in schedule.actions}
    ptr = {w: 0 for w in schedule.actions}
    sent: dict[tuple[int, str], int] = {}
    ready: dict[int, int] = {}
    progress = True
    while progress:
        progress = False
        for w, acts in schedule.actions.items():
            while ptr[w] < len(acts):
                a = acts[ptr[w]]
                if a.kind in (K.RECV_F, K.RECV_B):
                    issued = sent.get((a.peer, str(matching_send(a, w))))
                    if issued is None:
                        break
                    clock[w] = max(clock[w], issued + p2p_ns)
                elif a.kind in (K.SEND_F, K.SEND_B):
                    sent[(w, str(a))] = clock[w]
                elif a.kind == K.STEP:  # the global norm's all-reduce joins every worker first
                    ready[w] = clock[w]
                    if len(ready) < len(schedule.actions):
                        break
                    clock[w] = max(ready.values()) + took.get((w, str(a)), 0)
                else:
                    clock[w] += took.get((w, str(a)), 0)
                ptr[w] += 1
                progress = True
    if any(ptr[w] < len(acts) for w, acts in schedule.actions.items()):
        raise RuntimeError(f"replay of {schedule.method} stuck (not a SEND/RECV schedule?)")
    return max(clock.values())


def breakdown(events: list[Event]) -> dict[int, dict[str, int]]:
    """Per worker: compute, receive waits, sends, STEP, waits for collectives, untracked, span (ns)."""
    out: dict[int, dict[str, int]] = {}
    for w in sorted({e.worker for e in events}):
        mine = [e for e in events if e.worker == w]
        parts: dict[str, int] = defaultdict(int)
        for e in mine:
            d = e.end_ns - e.start_ns
            if e.kind in ("F", "B", "I", "W"):
                parts["compute"] += d
            elif e.kind in ("RECV_F", "RECV_B"):
                parts["recv wait"] += d
            elif e.kind in ("SEND_F", "SEND_B"):
                parts["send"] += d
            elif is_wait(e):
                parts["sync wait"] += d
            else:
                parts["step"] += d
        span = _span(mine)
        parts["untracked"] = span - union_length((e.start_ns, e.end_ns) for e in mine)
        parts["span"] = span
        out[w] = dict(parts)
    return out


def _run(rank: int, world: int, overrides: list[str], warmup: int, rounds: int, variants: tuple[str, ...]) -> dict:
    workers = {v: PipelineWorker(h.compose(overrides + [f"pipeline={v.split('+')[0]}", *v.split("+")[1:]]), rank, world,
                                 torch.device("cpu"))
               for v in variants}
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    for v, seconds, events in h.timed_rounds(workers, warmup, rounds):
        schedule = workers[v].schedule
        steps = [e.end_ns - e.start_ns for e in events if e.kind == "STEP"]
        cost: CostModel = replace(measured_costs(events, schedule), step_ns=round(statistics.fmean(steps)))
        lat = message_latency(events)
        sim = _span(simulate(schedule, cost))
        sim_p2p = _span(simulate(schedule, replace(cost, p2p_ns=lat)))
        per_stage = {f"{kind}{s}": t / 1e6 for kind, values in
                     (("F", cost.forward), ("B", cost.backward), ("I", cost.input_grad_ns or ()),
                      ("W", cost.weight_grad_ns or ())) for s, t in enumerate(values)}
        rows[v].append({"wall": seconds * 1e9, "span": _span(events), "sim": sim, "sim_p2p": sim_p2p,
                        "replay": replay(schedule, events, lat), "latency": lat,
                        "breakdown": breakdown(events), "stage_ms": per_stage,
                        "stages_of_worker": {w: sorted({a.stage for a in acts if a.kind.is_compute})
                                             for w, acts in schedule.actions.items()}})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bert-medium")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--set", action="append", default=[], help="extra train.py override for every variant (repeatable)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS),
                   help="pipeline methods, each optionally followed by '+key=value' overrides")
    args = p.parse_args()
    variants = tuple(args.variants)
    overrides = [f"model={args.model}", "stages=2", f"num_micro_batches={args.micro_batches}",
                 f"micro_batch_size={args.micro_batch_size}", f"steps={args.warmup + args.rounds + 1}",
                 "model.hidden_dropout=0.0", "model.attention_dropout=0.0", "optimizer=nvlamb", *args.set]
    load_before = h.load()
    rows = h.launch(_run, 2, overrides, args.warmup, args.rounds, variants)[0]["result"]
    model = " ".join([args.model, *args.set])
    print(f"{model}, D=2, N={args.micro_batches}, B={args.micro_batch_size}, fp32, NVLAMB, dropout 0; "
          f"{args.rounds} rounds after {args.warmup} warm-up, order rotated; medians over rounds (ms)")
    med = lambda v, key: statistics.median(r[key] for r in rows[v]) / 1e6  # noqa: E731
    table = []
    for v in variants:
        ratio = statistics.median(r["span"] / r["sim"] for r in rows[v])
        table.append([v, med(v, "span"), med(v, "sim"), med(v, "sim_p2p"), med(v, "replay"), med(v, "latency"),
                      ratio, statistics.median(r["span"] / r["sim_p2p"] for r in rows[v]),
                      statistics.median(r["span"] / r["replay"] for r in rows[v])])
    print(h.table(["schedule", "measured", "sim", "sim+p2p", "replay", "msg latency", "measured/sim",
                   "measured/sim+p2p", "measured/replay"], table))
    print()
    base = "1f1b" if "1f1b" in variants else variants[0]
    ratios = []
    for v in variants:
        if v == base:
            continue
        pairs = list(zip(rows[v], rows[base]))
        ratios.append([f"{v} / {base}", statistics.median(a["span"] / b["span"] for a, b in pairs),
                       statistics.median(a["sim"] / b["sim"] for a, b in pairs),
                       statistics.median(a["sim_p2p"] / b["sim_p2p"] for a, b in pairs)])
    print(h.table(["ratio (paired)", "measured", "sim", "sim+p2p"], ratios))
    print()
    parts = ("compute", "recv wait", "send", "step", "sync wait", "untracked", "span")
    brk = []
    for v in variants:
        for w in sorted(rows[v][0]["breakdown"]):
            stages = rows[v][0]["stages_of_worker"][w]
            brk.append([v, f"{w} (stages {','.join(map(str, stages))})",
                        *[statistics.median(r["breakdown"][w].get(k, 0) for r in rows[v]) / 1e6 for k in parts]])
    print("Per worker, measured (ms, median over rounds)")
    print(h.table(["schedule", "worker", *parts], brk))
    print()
    print("Per-stage mean costs (ms, median over rounds)")
    for v in variants:
        keys = rows[v][0]["stage_ms"]
        print(f"  {v}: " + ", ".join(f"{k} {statistics.median(r['stage_ms'][k] for r in rows[v]):.1f}" for k in keys))
    print(f"Machine: {load_before} before, {h.load()} after.")


if __name__ == "__main__":
    h.main_guard(main)
