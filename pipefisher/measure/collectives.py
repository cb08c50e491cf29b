"""Measure collectives like nccl-tests and write the fitted costs the strategy search reads.

``python -m pipefisher.measure.collectives --out collectives.json [--world 2] [--max-bytes 16M]``
starts ``--world`` processes on this machine (gloo on CPU, NCCL when CUDA is there: chosen at run
time, or ``--backend``), and for every group size g from 2 to the world (the first g ranks) times
``all_reduce``, ``all_gather_single``, ``reduce_scatter_single`` and a one-way ``send``/``recv``
(half a ping-pong, pairs only) over message sizes from ``--min-bytes`` to ``--max-bytes`` (×4
apart). Each point is the median over repeats of the slowest rank's time; the points of each op
and group size are fitted as latency + bytes / bandwidth (``planning.comm_costs``, [Note: the fit];
bytes as in [Note: what a message's bytes are]). The file holds the points and the fits.

With ``--model bert-mini --micro-batch-sizes 8`` (``--vocab-size``: the run's vocabulary) the same processes also time the whole model's forward
and backward (one micro-batch, synthetic data, all processes at once, as a run's workers compute side by
side) and store the FLOP rate that achieves under the planner's FLOP count (``model.partition.layer_costs``
× 3 for forward and backward): ``compute.flops_per_s`` per micro-batch size, which the search then uses
in place of a data-sheet ``flops_per_s`` (Galvatron profiles its layers' compute the same way); and one
NVLAMB step over the whole model's parameters, stored as the memory bandwidth the planner's step cost
assumes (``STEP_BYTES_PER_PARAM`` bytes per parameter: ``compute.optimizer_step.memory_bytes_per_s``).
Each piece a stage is made of (the embeddings, one encoder layer, the heads) is timed alone too, forward and
forward + backward (``micro_batch.<size>.pieces``): the search prices a stage as the sum of its pieces, each at
its own measured rate, where the file has them (``planning.strategy_search.hybrid_costs``).
With ``--executor-micro-batches N`` (default 4) a GPipe pipeline of the model over the ``world`` processes runs a
few steps with the real executor; what its step takes beyond the simulator's step from the same step's F, B and
STEP times, per compute action on the critical path, is ``compute.executor.overhead_per_action_s``: the search adds
it to every F, B, I and W (``measure.executor_overhead``). With ``--executor-methods`` (default every schedule the
search ranks) each of those schedules runs the same way, all of them (GPipe again among them) workers of the same
processes taking turns one step each, and its measured step is stored
(``compute.executor.methods.<method>``): the search scales that schedule's F, B, I and W at this D so that its
simulated step equals the measured one (``planning.executor_calibration``); with ``--executor-kfac-methods``
(default every schedule the search ranks) each schedule runs with K-FAC every step and with NVLAMB, taking turns
step by step in the same processes (``compute.executor.kfac.<method>``), from which the search solves that
schedule's factor on K-FAC's units; with ``--executor-muon-methods`` (default none) the same with Muon
(``compute.executor.muon.<method>``), from which the search scales Muon's step beyond NVLAMB's. Each of those runs
also times rank 0's
bookkeeping after a step, as train.py does it (the timeline gathered and read:
``compute.executor.bookkeeping_seconds``), which train.py's ``step_time_s`` includes: the search adds it to every
step it predicts.
Beside each forward + backward the forward alone is timed (``seconds_f``: the search splits a stage's time
into F and B by that share, not by the FLOP count's 1:2), and K-FAC's per-micro-batch units on one encoder
layer's Linear shapes with the runtime's own kernels (``optim.kfac_factors``: the curvature sums of the
inputs and output gradients, B⁻¹ G A⁻¹, and the damped Cholesky inverses):
``compute.kfac.<size>.curvature_flops_per_s``, ``precondition_flops_per_s`` and ``invert_flops_per_s`` under the planner's FLOP counts (``planning.costs`` [Note: FLOP estimates]).
These are small matrix products with a long inner dimension, which run at another rate than the model's mix
of products, attention and element-wise work (on a 2-core EPYC about twice the model's). Muon's Newton–Schulz on
the same Linear weights, in the precision ``optimizer.ns_dtype=auto`` picks here, is timed too
(``compute.newton_schulz.flops_per_s`` under ``optim.muon.ns_flops``): the search prices Muon's orthogonalization
by it where the file has it (the model's forward + backward rate over-priced it on CPUs with bf16 arithmetic: study 20). They are recorded for
diagnosis; the search prices K-FAC's units by them only where the file sets ``compute.kfac_in_search: true``
(on two idle validations that pricing made the predicted steps worse: bench/studies/20-time-to-target-validation.md).

On CPU each process gets ``cores // world`` threads (as train.py's workers do), so the figures are
the ones a run of that many workers sees; with more processes than cores they mean little.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import socket
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.atomic import write_text_atomic
from pipefisher.measure.compute_rates import (compute_rate, kfac_rates, measured_bert, newton_schulz_rate,
                                              optimizer_rate, piece_seconds, tp_seconds)
from pipefisher.measure.executor_overhead import executor_overhead, executor_steps, optimizer_executor_steps
from pipefisher.planning.comm_costs import OPS, collectives_json
from pipefisher.planning.costs import STEP_BYTES_PER_PARAM
from pipefisher.runtime.teardown import release_process_group

__all__ = ["main", "measure_collectives", "message_sizes"]

log = logging.getLogger(__name__)

# torch 2.13 renamed the tensor forms (the old names warn); FSDP2 calls the same collectives.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """Sizes from ``min_bytes`` to ``max_bytes`` (inclusive when reached), ``factor`` apart, multiples of 64."""
    if min_bytes < 64 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"min_bytes={min_bytes}, max_bytes={max_bytes}, factor={factor}: need 64 <= min <= max, factor >= 2")
    out, n = [], min_bytes
    while n <= max_bytes:
        out.append(n // 64 * 64)
        n *= factor
    return out


def _time_op(op: str, g: int, rank: int, num_bytes: int, group: dist.ProcessGroup, device: torch.device,
             repeats: int, budget_s: float) -> float | None:
    """Median seconds of one op on this rank (None for ranks outside the group)."""
    if rank >= g:
        return None
    elems = max(g, num_bytes // 4 // g * g)  # fp32, divisible by g for the sharded ops
    full = torch.ones(elems, device=device)
    shard = torch.ones(elems // g, device=device)

    def once() -> None:
        if op == "all_reduce":
            dist.all_reduce(full, group=group)
        elif op == "all_gather":
            _all_gather(full, shard, group=group)
        elif op == "reduce_scatter":
            _reduce_scatter(shard, full, group=group)
        elif rank == 0:  # p2p ping-pong between ranks 0 and 1 of the pair group
            dist.send(full, 1, group=group)
            dist.recv(full, 1, group=group)
        else:
            dist.recv(full, 0, group=group)
            dist.send(full, 0, group=group)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):  # warm-up: connections, buffers
        once()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    for i in range(repeats):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        once()
        sync()
        times.append(time.perf_counter() - t0)
        # All ranks stop together: rank 0 decides (a broadcast keeps their loops in step).
        stop = torch.tensor([1.0 if i >= 2 and time.perf_counter() - start > budget_s else 0.0], device=device)
        dist.broadcast(stop, group_src=0, group=group)
        if stop.item():
            break
    t = statistics.median(times)
    return t / 2 if op == "p2p" else t  # one way


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (a collective over the world)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank: int, world: int, port: int, backend: str, sizes: Sequence[int], repeats: int, budget_s: float,
            threads: int, out: str, compute: dict[str, Any] | None = None) -> None:
    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    points: dict[str, dict[int, list[tuple[float, float]]]] = {}
    try:
        for g in range(2, world + 1):
            group = dist.new_group(list(range(g)), timeout=datetime.timedelta(seconds=300))
            for op in OPS:
                if op == "p2p" and g != 2:
                    continue
                for n in sizes:
                    t = _time_op(op, g, rank, n, group, device, repeats, budget_s)
                    # The slowest rank of the group sets the point (as nccl-tests reports).
                    elems = max(g, n // 4 // g * g)
                    points.setdefault(op, {}).setdefault(g, []).append((4.0 * elems, _slowest(t or 0.0, device)))
        extra: dict[str, Any] = {}
        if compute:
            rates, kfac = {}, {}
            for mbs in compute["micro_batch_sizes"]:
                dist.barrier()
                seconds, forward, flops = compute_rate(compute["model"], mbs, compute["seq_len"],
                                                        compute["max_predictions"], device, repeats, 2 * budget_s,
                                                        compute["vocab_size"])
                seconds, forward = _slowest(seconds, device), _slowest(forward, device)
                rates[str(mbs)] = {"seconds_fb": seconds, "seconds_f": forward, "flops_fb": flops,
                                   "flops_per_s": flops / seconds}
                dist.barrier()
                pieces = piece_seconds(compute["model"], mbs, compute["seq_len"], compute["max_predictions"], device,
                                       repeats, budget_s, compute["vocab_size"])
                rates[str(mbs)]["pieces"] = {name: {k: (_slowest(x, device) if k.startswith("seconds") else x)
                                                    for k, x in row.items()} for name, row in pieces.items()}
                dist.barrier()
                units = kfac_rates(compute["model"], mbs, compute["seq_len"], device, repeats, budget_s)
                for name in ("curvature", "precondition", "invert"):  # the slowest rank's time sets the rate
                    slowest = _slowest(units[f"{name}_seconds"], device)
                    units[f"{name}_flops_per_s"] *= units[f"{name}_seconds"] / slowest
                    units[f"{name}_seconds"] = slowest
                kfac[str(mbs)] = units
            dist.barrier()
            ns = newton_schulz_rate(compute["model"], device, repeats, budget_s)
            slowest = _slowest(ns["seconds"], device)  # the slowest rank's time sets the rate
            ns.update(flops_per_s=ns["flops"] / slowest, seconds=slowest)
            dist.barrier()
            seconds, params = optimizer_rate(compute["model"], device, repeats, 2 * budget_s, compute["vocab_size"])
            seconds = _slowest(seconds, device)
            step = {"seconds": seconds, "parameters": params, "memory_bytes_per_s": STEP_BYTES_PER_PARAM * params / seconds}
            tp_rows = {}
            bert = measured_bert(compute["model"], compute["vocab_size"])
            for mbs in compute["micro_batch_sizes"] if bert.splits_over(world) else ():
                dist.barrier()
                seconds = tp_seconds(compute["model"], mbs, compute["seq_len"], compute["max_predictions"], device,
                                      repeats, 2 * budget_s, world, compute["vocab_size"])
                tp_rows[str(mbs)] = {"seconds_fb": _slowest(seconds, device)}
            extra["compute"] = {"model": compute["model"], "vocab_size": bert.vocab_size, "seq_len": compute["seq_len"],
                                "max_predictions": compute["max_predictions"], "processes": world, "micro_batch": rates,
                                "kfac": kfac, "newton_schulz": ns, "optimizer_step": step,
                                "tensor_parallel": {str(world): tp_rows}}
            if compute.get("executor_micro_batches") and world <= bert.num_pipeline_layers:
                dist.barrier()
                extra["compute"]["executor"] = executor_overhead(
                    compute["model"], compute["micro_batch_sizes"][0], compute["seq_len"], compute["max_predictions"],
                    device, compute["executor_micro_batches"], vocab_size=compute["vocab_size"])
                others = [m for m in compute.get("executor_methods", ()) if m != "gpipe"]
                gpipe = {k: v for k, v in extra["compute"]["executor"].items() if k != "overhead_per_action_s"}
                if others:  # GPipe again among them: every schedule's step measured under the same drift
                    extra["compute"]["executor"]["methods"] = executor_steps(
                        ["gpipe", *others], compute["model"], compute["micro_batch_sizes"][0], compute["seq_len"],
                        compute["max_predictions"], device, compute["executor_micro_batches"],
                        vocab_size=compute["vocab_size"])
                elif compute.get("executor_methods"):
                    extra["compute"]["executor"]["methods"] = {"gpipe": gpipe}
                for optimizer in ("kfac", "muon"):
                    if compute.get(f"executor_{optimizer}_methods"):
                        extra["compute"]["executor"][optimizer] = optimizer_executor_steps(
                            compute[f"executor_{optimizer}_methods"], compute["model"],
                            compute["micro_batch_sizes"][0], compute["seq_len"], compute["max_predictions"], device,
                            compute["executor_micro_batches"], vocab_size=compute["vocab_size"], optimizer=optimizer)
        if rank == 0:
            doc = collectives_json(backend, device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
                                   world, points, threads_per_process=threads, torch=torch.__version__,
                                   host=socket.gethostname(), cpu=platform.processor() or platform.machine(),
                                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **extra)
            write_text_atomic(Path(out), json.dumps(doc, indent=1) + "\n")
    finally:
        release_process_group()


def measure_collectives(out: str | os.PathLike, world: int = 2, backend: str = "auto", min_bytes: int = 4096,
                        max_bytes: int = 16 << 20, repeats: int = 20, budget_s: float = 0.5, model: str | None = None,
                        micro_batch_sizes: Sequence[int] = (8,), seq_len: int = 128,
                        max_predictions: int = 20, vocab_size: int | None = None,
                        executor_micro_batches: int = 0,
                        executor_methods: Sequence[str] = (),
                        executor_kfac_methods: Sequence[str] = (),
                        executor_muon_methods: Sequence[str] = ()) -> dict[str, Any]:
    """Measure and write ``out``; returns the document written.

    Args:
        out: the JSON file to write.
        world: processes (GPUs on CUDA); group sizes 2..world are measured.
        backend: ``auto`` (nccl when CUDA is available with ``world`` devices, else gloo), gloo or nccl.
        min_bytes, max_bytes: the range of message sizes (×4 apart).
        repeats: most timed repetitions per point (after 2 warm-ups).
        budget_s: a point stops repeating after this long (and at least 3 repeats).
        model: a BERT size (``bert-mini``) whose forward + backward rate is measured too, in one process
            and with tensor parallel over all ``world`` processes (where ``world`` divides its heads and
            FFN width); None: none.
        micro_batch_sizes, seq_len, max_predictions: the compute measurement's shapes.
        vocab_size: the measured model's vocabulary (a run's ``model.vocab_size``); None: the preset's.
        executor_micro_batches: with ``model``, N of a GPipe pipeline over the ``world`` processes whose executor
            overhead per action is measured (``measure.executor_overhead``; at the first micro-batch size; where
            the model has at least ``world`` pipeline layers); 0: not measured.
        executor_methods: with ``executor_micro_batches``, the schedules (``planning.whatif.METHODS``) whose
            step is measured the same way (``compute.executor.methods``; those the shape refuses are recorded with
            the reason), all of them workers of the same processes taking turns one step each, GPipe again among
            them (GPipe's is the overhead's own run where it is the only one).
        executor_kfac_methods: with ``executor_micro_batches``, the schedules whose step is measured the same way
            with K-FAC every step and with NVLAMB taking turns in the same processes (``compute.executor.kfac.<method>``:
            K-FAC's extra time per step, a paired difference), from which the search solves that schedule's factor on
            K-FAC's units (``planning.executor_calibration``).
        executor_muon_methods: the same with Muon (``compute.executor.muon.<method>``): the search's factor on
            Muon's step beyond NVLAMB's.

    Raises:
        ValueError: a bad argument, naming it.
    """
    if world < 2:
        raise ValueError(f"--world={world}: a collective needs at least 2 processes")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"--backend={backend}: choose auto, gloo or nccl")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"--backend=nccl --world={world}: only {torch.cuda.device_count()} CUDA device(s) visible")
    sizes = message_sizes(min_bytes, max_bytes)
    compute = None
    if model is not None:
        from pipefisher.model.config import BERT_SIZES

        if model.removeprefix("bert-") not in BERT_SIZES:
            raise ValueError(f"--model={model}: choose one of {', '.join('bert-' + k for k in BERT_SIZES)}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"--vocab-size={vocab_size}: give the run's model.vocab_size (a positive count)")
        if executor_micro_batches < 0:
            raise ValueError(f"--executor-micro-batches={executor_micro_batches}: give N >= 1, or 0 for none")
        from pipefisher.planning.whatif import METHODS

        for flag, given in (("--executor-methods", executor_methods), ("--executor-kfac-methods", executor_kfac_methods),
                            ("--executor-muon-methods", executor_muon_methods)):
            unknown = [m for m in given if m not in METHODS]
            if unknown:
                raise ValueError(f"{flag}={','.join(given)}: {', '.join(unknown)} unknown; choose from "
                                 f"{', '.join(METHODS)}" + (", or all" if flag == "--executor-methods" else ""))
        compute = {"model": model, "micro_batch_sizes": list(micro_batch_sizes), "seq_len": seq_len,
                   "max_predictions": max_predictions, "vocab_size": vocab_size,
                   "executor_micro_batches": executor_micro_batches, "executor_methods": list(executor_methods),
                   "executor_kfac_methods": list(executor_kfac_methods),
                   "executor_muon_methods": list(executor_muon_methods)}
    threads = max(1, (os.cpu_count() or 1) // world) if backend == "gloo" else 1
    port = _free_port()
    mp.start_processes(_worker, args=(world, port, backend, sizes, repeats, budget_s, threads, str(out), compute),
                       nprocs=world, join=True, start_method="spawn")
    return json.loads(Path(out).read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("b")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: measure, write the file, print one line per op and group size."""
    p = argparse.ArgumentParser(prog="python -m pipefisher.measure.collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (read by schedule.py whatif=true comm_costs=<file>)")
    p.add_argument("--world", type=int, default=2, help="processes; group sizes 2..world are measured (default 2)")
    p.add_argument("--backend", default="auto", help="auto (nccl with CUDA, else gloo), gloo or nccl")
    p.add_argument("--min-bytes", default="4k", help="smallest message (default 4k)")
    p.add_argument("--max-bytes", default="16m", help="largest message (default 16m)")
    p.add_argument("--repeats", type=int, default=20, help="most timed repetitions per point (default 20)")
    p.add_argument("--model", default=None, help="also time this BERT's forward+backward (e.g. bert-mini)")
    p.add_argument("--micro-batch-sizes", default="8", help="--model: comma-separated micro-batch sizes (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="--model: tokens per sequence (default 128)")
    p.add_argument("--max-predictions", type=int, default=20, help="--model: masked positions (default 20)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="--model: vocabulary of the measured model (a run's model.vocab_size; default the preset's)")
    p.add_argument("--executor-micro-batches", type=int, default=4,
                   help="--model: N of the GPipe pipeline over --world processes whose executor overhead per action "
                        "is measured (default 4; 0: none)")
    p.add_argument("--executor-methods", default="all",
                   help="--model: schedules whose executor step is measured at N=--executor-micro-batches over --world "
                        "processes, comma-separated, 'all' (the default: every schedule the search ranks) or 'gpipe' "
                        "(the overhead's run alone)")
    p.add_argument("--executor-kfac-methods", default="all",
                   help="--model: schedules run with K-FAC every step and with NVLAMB taking turns in the same processes, "
                        "comma-separated, 'all' (the default: every schedule the search ranks), 'gpipe' or '' for none: "
                        "K-FAC's extra step per schedule, from which the search solves its factor on K-FAC's units")
    p.add_argument("--executor-muon-methods", default="",
                   help="--model: the same with Muon: its step beyond NVLAMB's per schedule, from which the search solves "
                        "its factor on that part of Muon's step (comma-separated or 'all'; default none: on the Zen 4 "
                        "EPYC the extras were 0-13 ms, too small against their noise for a factor per schedule)")
    args = p.parse_args(argv)
    from pipefisher.planning.whatif import METHODS

    def schedules(arg: str) -> list[str]:
        return list(METHODS) if arg == "all" else [m for m in arg.split(",") if m]

    methods = schedules(args.executor_methods)
    try:
        doc = measure_collectives(args.out, args.world, args.backend, _bytes(args.min_bytes), _bytes(args.max_bytes),
                                  args.repeats, model=args.model,
                                  micro_batch_sizes=[int(x) for x in args.micro_batch_sizes.split(",")],
                                  seq_len=args.seq_len, max_predictions=args.max_predictions,
                                  vocab_size=args.vocab_size, executor_micro_batches=args.executor_micro_batches,
                                  executor_methods=methods,
                                  executor_kfac_methods=schedules(args.executor_kfac_methods),
                                  executor_muon_methods=schedules(args.executor_muon_methods))
    except ValueError as exc:
        raise SystemExit(f"collectives: {exc}") from None
    print(f"{doc['backend']} on {doc['device']}, {doc['world_size']} processes, "
          f"{doc.get('threads_per_process', '-')} thread(s) each:")
    for op, groups in doc["ops"].items():
        for g, row in groups.items():
            print(f"  {op:>14} g={g}: {row['latency_s'] * 1e6:8.1f} us + bytes / {row['bytes_per_s'] / 1e9:6.3f} GB/s")
    for mbs, row in doc.get("compute", {}).get("micro_batch", {}).items():
        print(f"  compute {doc['compute']['model']} (vocabulary {doc['compute'].get('vocab_size', '?')}) micro-batch {mbs}: forward+backward {row['seconds_fb'] * 1e3:.1f} ms "
              f"= {row['flops_per_s'] / 1e9:.2f} GFLOP/s (planner FLOPs)")
    if "optimizer_step" in doc.get("compute", {}):
        step = doc["compute"]["optimizer_step"]
        print(f"  optimizer step (NVLAMB, {step['parameters'] / 1e6:.1f}M parameters): {step['seconds'] * 1e3:.1f} ms "
              f"= {step['memory_bytes_per_s'] / 1e9:.2f} GB/s at {STEP_BYTES_PER_PARAM} B per parameter")
    if "executor" in doc.get("compute", {}):
        e = doc["compute"]["executor"]
        print(f"  executor (GPipe, D={e['stages']}, N={e['micro_batches']}): step {e['step_seconds'] * 1e3:.1f} ms "
              f"against {e['simulated_seconds'] * 1e3:.1f} ms simulated from its own F/B/STEP: "
              f"{e['overhead_per_action_s'] * 1e3:.2f} ms per compute action; train.py's bookkeeping after a step "
              f"{e.get('bookkeeping_seconds', 0.0) * 1e3:.1f} ms")
        for m, row in e.get("methods", {}).items():
            print(f"    {m:>16}: " + (f"refused ({row['refused']})" if "refused" in row else
                                     f"step {row['step_seconds'] * 1e3:.1f} ms, {row['simulated_seconds'] * 1e3:.1f} ms "
                                     f"simulated from its own F/B/STEP"))
        for key, name in (("kfac", "K-FAC"), ("muon", "Muon")):
            for m, row in e.get(key, {}).items():
                print(f"    {m + ' ' + name:>16}: " + (f"refused ({row['refused']})" if "refused" in row else
                                                    f"step {row['step_seconds'] * 1e3:.1f} ms with {name}, "
                                                    f"{row['nvlamb_step_seconds'] * 1e3:.1f} ms with NVLAMB, taking "
                                                    f"turns: {name}'s extra {row['extra_seconds'] * 1e3:+.1f} ms"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
