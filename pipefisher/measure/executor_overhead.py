"""The executor's own cost per action, measured on the run's model: what the strategy search adds to every F, B, I
and W it simulates (``planning.strategy_search.pipeline_costs``).

A pipeline step takes longer than the simulator says even when the simulator is given the step's own measured F,
B and STEP times: the executor spends time outside them (Python between actions, issuing sends and receives, the
waits of its collectives, the loss all-reduce). ``bench/executor_overhead.py`` measured that gap at 3–12 % of a
step on two EPYC cores (D=2, bert-mini) and 11–25 % on a 16-core Xeon (D=4, bert-tiny). Here the gap is measured
the same way on one GPipe pipeline of ``world`` stages (the real ``PipelineWorker``, synthetic data, NVLAMB):
``overhead_per_action_s`` = (the measured step − the simulated one) / the compute actions on GPipe's critical path,
2 (N + D − 1). ``measure.collectives --model`` runs it in its own process group and stores it as
``compute.executor``.

The same run of every schedule (:func:`executor_steps`; ``measure.collectives --executor-methods``), all of them
workers of the same processes taking turns one step each per round, stores each one's measured step (``compute.executor.methods.<method>``): the search solves for the factor by which that
schedule's F, B, I and W run longer in the executor than the pieces measured alone
(``planning.executor_calibration``), which the gap per action cannot carry where a schedule keeps every worker
busy at once (Chimera's F and B took 1.46× GPipe's on two EPYC cores, bench/studies/20-time-to-target-validation.md).

:func:`kfac_executor_steps` runs a schedule with K-FAC every step (its units on the critical path) and with NVLAMB
as two workers of the same processes, one step each in turn, so that K-FAC's extra time per step is a paired
difference, not one of two steps measured apart on a machine whose speed drifts (on the 2-core Zen 4 EPYC two GPipe
runs a minute apart took 147 and 188 ms). The search solves from it how much longer K-FAC's units take in the
executor than measured alone (the captures in F and B, one action per unit and layer:
``planning.executor_calibration`` [Note: K-FAC unit factor]). :func:`optimizer_executor_steps` does the same for
Muon, whose step beyond NVLAMB's the search scales alike ([Note: Muon step factor]).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["executor_overhead", "executor_steps", "gpipe_config", "kfac_executor_steps", "optimizer_executor_steps",
           "pipeline_config"]


def gpipe_config(model: str, micro_batch_size: int, num_micro_batches: int, seq_len: int, max_predictions: int,
                 stages: int, device: torch.device, vocab_size: int | None = None) -> Any:
    """train.py's config of a GPipe pipeline of ``stages`` stages on ``model`` at this shape (synthetic data,
    NVLAMB, no evaluation, no logging): what the overhead is measured on."""
    return pipeline_config("gpipe", model, micro_batch_size, num_micro_batches, seq_len, max_predictions, stages,
                           device, vocab_size)


def pipeline_config(method: str, model: str, micro_batch_size: int, num_micro_batches: int, seq_len: int,
                    max_predictions: int, stages: int, device: torch.device, vocab_size: int | None = None,
                    optimizer: str = "nvlamb") -> Any:
    """train.py's config of a ``method`` pipeline (a schedule name the search uses: ``chimera-doubling`` is
    Chimera with forward doubling) of ``stages`` stages on ``model`` at this shape (synthetic data, ``optimizer``
    with its defaults: NVLAMB, or K-FAC every step; no evaluation, no logging).

    Raises:
        ValueError: the shape does not admit the method (train.py's own check, naming the field).
    """
    from hydra import compose, initialize_config_dir

    import pipefisher
    from pipefisher.config.schema import register_configs, to_train_config
    from pipefisher.config.validation import validate

    pipeline = ["pipeline=chimera", "pipeline.chimera_stacking=doubling"] if method == "chimera-doubling" \
        else [f"pipeline={method}"]
    overrides = [f"model={model}", *pipeline, f"stages={stages}", f"micro_batch_size={micro_batch_size}",
                 f"num_micro_batches={num_micro_batches}", f"data.seq_len={seq_len}",
                 f"data.max_predictions={max_predictions}", f"optimizer={optimizer}", f"device={device.type}",
                 "progress=false", "wandb.mode=disabled", "eval.every_steps=0"]
    if vocab_size is not None:
        overrides.append(f"model.vocab_size={vocab_size}")
    register_configs()
    with initialize_config_dir(config_dir=str(Path(pipefisher.__file__).resolve().parent / "conf"),
                               version_base="1.3"):
        cfg = to_train_config(compose(config_name="config", overrides=overrides))
    validate(cfg)
    return cfg


def executor_overhead(model: str, micro_batch_size: int, seq_len: int, max_predictions: int, device: torch.device,
                      num_micro_batches: int = 4, steps: int = 6, warmup: int = 2,
                      vocab_size: int | None = None) -> dict[str, Any]:
    """Run ``warmup + steps`` GPipe steps over every rank of the default process group (one stage each) and return,
    on every rank, ``{"method", "stages", "micro_batches", "micro_batch_size", "step_seconds",
    "simulated_seconds", "bookkeeping_seconds", "overhead_per_action_s"}``: the median over the measured steps of
    the slowest rank's step, the median of the simulator's step from each step's own per-stage F/B means and each
    worker's STEP, the median of rank 0's bookkeeping after a step (what train.py does after each: the timeline
    gathered to rank 0 and its fields read; train.py's ``step_time_s`` includes it), and the step's difference from
    the simulated one (0 if negative) per compute action on the critical path. Call it on every rank."""
    row = _timed_steps("gpipe", model, micro_batch_size, seq_len, max_predictions, device, num_micro_batches, steps,
                       warmup, vocab_size)
    critical = 2 * (num_micro_batches + dist.get_world_size() - 1)
    return {**row, "overhead_per_action_s": max(0.0, row["step_seconds"] - row["simulated_seconds"]) / critical}


def executor_steps(methods: Sequence[str], model: str, micro_batch_size: int, seq_len: int, max_predictions: int,
                   device: torch.device, num_micro_batches: int = 4, steps: int = 6, warmup: int = 2,
                   vocab_size: int | None = None) -> dict[str, dict[str, Any]]:
    """Each of ``methods`` run as :func:`executor_overhead` runs GPipe (one stage per rank of the default process
    group), all of them workers of the same processes taking turns, one step each per round, so that their steps
    are measured under the same drift of the machine (on the 2-core Zen 4 EPYC, measured one after the other, zb-v
    took 280 ms where v-half and v-min, the same action lists at D=2, took 232 and 239 ms): ``method -> {"stages",
    "micro_batches", "micro_batch_size", "num_virtual", "step_seconds", "simulated_seconds",
    "bookkeeping_seconds"}``, or ``{"refused": reason}`` where train.py's check refuses the method at this shape.
    Call it on every rank."""
    out: dict[str, dict[str, Any]] = {}
    runnable = []
    for method in methods:
        try:
            pipeline_config(method, model, micro_batch_size, num_micro_batches, seq_len, max_predictions,
                            dist.get_world_size(), device, vocab_size)
            runnable.append(method)
        except ValueError as exc:  # the same config on every rank: every rank refuses it alike
            out[method] = {"refused": str(exc).splitlines()[0]}
    if runnable:
        out.update(_interleaved_steps(runnable, model, micro_batch_size, seq_len, max_predictions, device,
                                      num_micro_batches, steps, warmup, vocab_size))
    return {m: out[m] for m in methods}


def kfac_executor_steps(methods: Sequence[str], model: str, micro_batch_size: int, seq_len: int,
                        max_predictions: int, device: torch.device, num_micro_batches: int = 4, rounds: int = 12,
                        warmup: int = 2, vocab_size: int | None = None) -> dict[str, dict[str, Any]]:
    """:func:`optimizer_executor_steps` with K-FAC every step."""
    return optimizer_executor_steps(methods, model, micro_batch_size, seq_len, max_predictions, device,
                                    num_micro_batches, rounds, warmup, vocab_size, "kfac")


def optimizer_executor_steps(methods: Sequence[str], model: str, micro_batch_size: int, seq_len: int,
                             max_predictions: int, device: torch.device, num_micro_batches: int = 4, rounds: int = 12,
                             warmup: int = 2, vocab_size: int | None = None,
                             optimizer: str = "kfac") -> dict[str, dict[str, Any]]:
    """Each of ``methods`` (one stage per rank of the default process group) with ``optimizer`` (its defaults:
    K-FAC every step, or Muon) and with NVLAMB, two workers of the same processes taking turns (NVLAMB first in even
    rounds, the other first in odd ones): ``method -> {"stages", "micro_batches", "micro_batch_size",
    "num_virtual", "step_seconds" (``optimizer``'s median step), "nvlamb_step_seconds" (NVLAMB's), "extra_seconds"
    (the median over rounds of its step less NVLAMB's in the same round), "rounds"}``, or ``{"refused": reason}``.
    Steps are the slowest rank's; call it on every rank."""
    from pipefisher.runtime.pipeline_worker import PipelineWorker

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        try:
            cfgs = {opt: pipeline_config(method, model, micro_batch_size, num_micro_batches, seq_len, max_predictions,
                                         world, device, vocab_size, opt) for opt in ("nvlamb", optimizer)}
        except ValueError as exc:  # the same config on every rank: every rank refuses it alike
            out[method] = {"refused": str(exc).splitlines()[0]}
            continue
        workers = {opt: PipelineWorker(cfg, rank, world, device) for opt, cfg in cfgs.items()}
        times: dict[str, list[float]] = {opt: [] for opt in workers}
        for r in range(warmup + rounds):
            for opt in (("nvlamb", optimizer) if r % 2 == 0 else (optimizer, "nvlamb")):
                dist.barrier()
                start = time.perf_counter()
                workers[opt].train_step(r)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                if r >= warmup:
                    times[opt].append(float(wall.item()))
        del workers
        out[method] = {"method": method, "stages": world, "micro_batches": num_micro_batches,
                       "micro_batch_size": micro_batch_size, "num_virtual": int(cfgs[optimizer].pipeline.num_virtual),
                       "step_seconds": statistics.median(times[optimizer]),
                       "nvlamb_step_seconds": statistics.median(times["nvlamb"]),
                       "extra_seconds": statistics.median(k - n for k, n in zip(times[optimizer], times["nvlamb"])),
                       "rounds": rounds}
    return out


def _timed_steps(method: str, model: str, micro_batch_size: int, seq_len: int, max_predictions: int,
                 device: torch.device, num_micro_batches: int, steps: int, warmup: int,
                 vocab_size: int | None) -> dict[str, Any]:
    return _interleaved_steps([method], model, micro_batch_size, seq_len, max_predictions, device, num_micro_batches,
                              steps, warmup, vocab_size)[method]


def _interleaved_steps(methods: Sequence[str], model: str, micro_batch_size: int, seq_len: int,
                       max_predictions: int, device: torch.device, num_micro_batches: int, steps: int, warmup: int,
                       vocab_size: int | None) -> dict[str, dict[str, Any]]:
    """``warmup + steps`` rounds, each one step of every method's worker in turn (the order rotated by one each
    round), all workers held by the same processes: a drift of the machine's speed moves every method alike.
    Per method its median step (the slowest rank's), the simulator's step from each step's own measured actions,
    and rank 0's bookkeeping after a step (what train.py does: the timeline gathered to rank 0, its fields read)."""
    from pipefisher.runtime.pipeline_worker import PipelineWorker
    from pipefisher.runtime.step_metrics import measured_costs, timeline_fields
    from pipefisher.simulate import simulate

    rank, world = dist.get_rank(), dist.get_world_size()
    cfgs = {m: pipeline_config(m, model, micro_batch_size, num_micro_batches, seq_len, max_predictions, world, device,
                               vocab_size) for m in methods}
    workers = {m: PipelineWorker(cfg, rank, world, device) for m, cfg in cfgs.items()}
    walls: dict[str, list[float]] = {m: [] for m in methods}
    simulated: dict[str, list[float]] = {m: [] for m in methods}
    books: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    for step in range(warmup + steps):
        for method in order[step % len(order):] + order[:step % len(order)]:
            worker = workers[method]
            dist.barrier()
            start = time.perf_counter()
            _, result = worker.train_step(step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            # train.py's bookkeeping after each step (runtime.worker: gather the timeline to rank 0, read its fields)
            start = time.perf_counter()
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(result.events, gathered, dst=0)
            events = [e for evs in gathered or [] for e in evs]
            if rank == 0:
                timeline_fields(events, worker.schedule, world, step, simulated=False)
            book = time.perf_counter() - start
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            if step < warmup:
                continue
            walls[method].append(float(wall.item()))
            books[method].append(book)
            if rank == 0:
                timeline = simulate(worker.schedule, measured_costs(events, worker.schedule))
                simulated[method].append((max(e.end_ns for e in timeline) - min(e.start_ns for e in timeline)) / 1e9)
    out: dict[str, dict[str, Any]] = {}
    for method in methods:
        sim = [statistics.median(simulated[method]) if simulated[method] else 0.0, statistics.median(books[method])]
        dist.broadcast_object_list(sim, src=0)  # rank 0's bookkeeping: what train.py's step time carries
        out[method] = {"method": method, "stages": world, "micro_batches": num_micro_batches,
                       "micro_batch_size": micro_batch_size, "num_virtual": int(cfgs[method].pipeline.num_virtual),
                       "step_seconds": statistics.median(walls[method]), "simulated_seconds": sim[0],
                       "bookkeeping_seconds": sim[1]}
    del workers
    return out
