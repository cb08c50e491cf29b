"""A worker process of a run: join the process group, then the training loop.

The loop (:func:`train_worker`) only orders the parts, each of which has a module of its own:

==========================  ===================================================================
part                        module
==========================  ===================================================================
what a worker holds, a step ``pipeline_worker.PipelineWorker`` (built by ``build``)
the step's reported figures ``step_metrics`` (timeline → utilization, simulation, K-FAC fields)
                            and ``pipefisher.measure`` (model FLOPs, MFU, peak memory)
rank 0's outputs            ``reporting.StepReporter`` (metrics.jsonl, wandb, progress bar, summary)
held-out evaluation         ``evaluation.PipelineEvaluator`` (forward-only schedule)
checkpoints and stopping    ``stopping.StopPolicy``, ``checkpoint``, ``resume``, ``preemption``
profile                     ``run_profile`` (profile.sqlite, timeline.json, pictures)
fault injection             ``faults``
==========================  ===================================================================

With ``checkpoint.every_steps`` / ``checkpoint.every_minutes`` every worker saves its shard of a
checkpoint after the due steps, and ``resume=auto|<path>`` continues a run at the step after its
checkpoint with the loss trajectory of an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch

from pipefisher.config import TrainConfig
from pipefisher.measure import current_bytes
from pipefisher.runtime import preemption
from pipefisher.runtime.build import (CPU_HARDWARE, build_stage_modules, check_world_size, describe_kfac,
                                      encoder_layers_per_stage, kfac_assignment, run_shape, schedule_for,
                                      seed_worker_rngs, stage_slices)
from pipefisher.runtime.checkpoint import checkpoint_root, resume_worker
from pipefisher.runtime.device import check_local_gpus, resolve_device, set_cpu_threads
from pipefisher.runtime.evaluation import PipelineEvaluator
from pipefisher.runtime.final_weights import save_final_weights
from pipefisher.runtime.pipeline_worker import PipelineWorker
from pipefisher.runtime.preemption import PREEMPTED_FILE
from pipefisher.runtime.reporting import StepReporter, StepMeter
from pipefisher.runtime.run_profile import gather_origins, write_run_profile
from pipefisher.runtime.step_metrics import kfac_plan_label
from pipefisher.runtime.step_timer import StepTimer
from pipefisher.runtime.stopping import StopPolicy, requeue_from_rank0
from pipefisher.runtime.teardown import release_process_group
from pipefisher.timeline import Event

__all__ = ["run_worker", "train_worker", "PipelineWorker", "schedule_for", "run_shape", "kfac_assignment",
           "kfac_plan_label", "describe_kfac", "build_stage_modules", "gather_origins", "write_run_profile",
           "check_world_size", "seed_worker_rngs", "stage_slices", "encoder_layers_per_stage", "CPU_HARDWARE"]

log = logging.getLogger(__name__)


def run_worker(
    cfg: TrainConfig,
    rank: int,
    world_size: int,
    output_dir: str | os.PathLike,
    run_name: str | None = None,
    group: str | None = None,
    local_rank: int = 0,
    local_world_size: int | None = None,
    external_store: bool = False,
    requeue_here: bool = False,
) -> dict[str, Any]:
    """Train as worker ``rank`` of ``world_size``; the process group is set up from ``MASTER_ADDR``
    and ``MASTER_PORT`` in the environment (``external_store``: a store already listens there,
    hosted by the launcher; otherwise rank 0 hosts it).

    Returns:
        The last step's metrics on rank 0 (other ranks: their last loss).
    """
    check_world_size(cfg, world_size)
    if preemption.watching(cfg.cluster.requeue):
        preemption.install()  # from now on SLURM's warning signal is recorded, not fatal
    check_local_gpus(cfg.device, local_world_size or 1)  # every worker of the node refuses, not only the extra ones
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cpu":
        set_cpu_threads(local_world_size or world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=cfg.cluster.worker_timeout_s)
    store = None
    if external_store:  # the launcher hosts the rendezvous store: every worker is a client
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timeout)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, store=store)
    try:
        result = train_worker(cfg, rank, world_size, device, output_dir, run_name, group, requeue_here=requeue_here)
        dist.barrier()  # nobody tears down its connections while a peer still talks to it
        return result
    finally:
        release_process_group()  # cycles freed first: [Note: free cycles before destroying the process group]


def _first_step_note(worker: PipelineWorker) -> str:
    """Why the first step may be long, for the log line before it: K-FAC's inversions."""
    if worker.kfac is None or worker.kfac_interval is None:
        return ""
    dims = [d for pre in worker.kfac.pre.values() for name in pre.layer_names for d in pre.layer(name).dims]
    return (f"; K-FAC inverts {len(dims)} factors ({len(dims) // 2} layers) of up to {max(dims)} x {max(dims)} "
            f"on this worker every {worker.kfac_interval} step(s), and the progress bar shows an ETA from the "
            f"first step's end on" if dims else "")


def train_worker(cfg: TrainConfig, rank: int, world_size: int, device: torch.device,
                 output_dir: str | os.PathLike, run_name: str | None = None,
                 group: str | None = None, requeue_here: bool = False) -> dict[str, Any]:
    """Train as worker ``rank`` in an initialized process group: resume if asked, run the
    remaining steps, evaluate and save checkpoints when due; rank 0 writes ``metrics.jsonl`` and wandb.

    On SLURM's preemption signal the workers checkpoint and stop (the result then holds
    ``"preempted": True``); with ``requeue_here`` worker 0 also requeues the job, otherwise it
    leaves :data:`~pipefisher.runtime.preemption.PREEMPTED_FILE` for the launcher process.

    Returns:
        The last step's metrics on rank 0 (other ranks: their last loss); empty when a resumed
        run had no step left.
    """
    output_dir = Path(output_dir)
    baseline = current_bytes(device)  # interpreter, torch and libraries: what the planner does not predict
    worker = PipelineWorker(cfg, rank, world_size, device)
    if worker.watch_preemption:  # the handler is installed (run_worker); a requeued job resumes
        resume = preemption.resume_mode(cfg.resume, cfg.cluster.requeue)
        if resume != cfg.resume:
            cfg = dataclasses.replace(cfg, resume=resume)
    if rank == 0:
        (output_dir / PREEMPTED_FILE).unlink(missing_ok=True)
    root = checkpoint_root(cfg, output_dir)
    first = resume_worker(cfg, worker, root, output_dir)
    if cfg.comm_ablation and rank == 0:
        log.warning("comm_ablation=true: activations, gradients and all-reduces are 1-byte messages; "
                    "step times split compute from communication, but the loss and the model are meaningless")
    meter = StepMeter(cfg, worker, baseline_bytes=baseline)  # FLOPs, MFU, this worker's peak memory
    evaluator = PipelineEvaluator(cfg, worker) if cfg.eval.every_steps > 0 else None
    stopper = StopPolicy(cfg, worker, root)
    reporter = StepReporter(cfg, worker, output_dir, first, run_name=run_name, group=group, meter=meter) \
        if rank == 0 else None
    timer = StepTimer(device)
    last: dict[str, Any] = {}
    profiled: list[Event] = []
    if rank == 0 and first < cfg.steps:
        log.info("training steps %d to %d%s", first, cfg.steps - 1, _first_step_note(worker))
    # Each worker's own host, pid, tid and clock, for profile.sqlite and timeline.json (issue 15).
    origins = gather_origins(rank, world_size) if cfg.profile.enabled else {}
    try:
        for step in (reporter.steps() if reporter is not None else range(first, cfg.steps)):
            lr = worker.optimizer.param_groups[0]["lr"]
            timer.start()
            meter.begin_step()
            losses, result = worker.train_step(step)
            train_time = timer.stop()
            # One gather carries the timeline and the peak memory of every worker to rank 0.
            mine = (result.events, meter.end_step())
            gathered: list[Any] | None = [None] * world_size if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
            last = {"step": step, "loss": losses[0] + losses[1], "mlm_loss": losses[0], "nsp_loss": losses[1]}
            if cfg.comm_ablation:
                last["comm_ablation"] = True  # this loss is meaningless: the stages computed on zeros
            if worker.step_skipped:
                last["skipped"] = True  # non-finite gradients: no update (on_nonfinite=skip)
            if cfg.optimizer_placement == "per_stage":  # stage steps redone after the global norm's check
                last["rollbacks"] = worker.rollbacks
            if reporter is not None:
                events = [e for evs, _ in gathered for e in evs]
                if cfg.profile.enabled and step >= cfg.profile.warmup_steps:
                    profiled += events
                # Step time: from this step's start until rank 0 has the step's row ready, so it holds
                # rank 0's bookkeeping (gathering the timeline, simulating, metrics: bookkeeping_s), which
                # every worker waits for at the next step; writing the row and wandb come after (µs to
                # ms); evaluation and checkpoints are not in it.
                last.update(reporter.step_fields(step, lr, events, [memory for _, memory in gathered]))
                step_time = timer.stop()
                last.update(step_time_s=step_time, samples_per_s=cfg.global_batch_size / step_time,
                            bookkeeping_s=step_time - train_time, **meter.rates(step_time))
            if evaluator is not None and evaluator.due(step):  # a collective: every worker evaluates
                figures = evaluator.evaluate(step)
                last.update(figures)
            if reporter is not None:
                reporter.write(step, last)
            if stopper.after_step(step, last):
                break
        if reporter is not None and profiled:
            reporter.log_pictures(write_run_profile(cfg, profiled, world_size, output_dir, device, origins))
        if reporter is not None:
            reporter.summarize()
    finally:
        if reporter is not None:
            reporter.close()
    if cfg.save_final and stopper.preempted is None:  # a collective: <run>/final/ (issue 24)
        save_final_weights(worker, output_dir, cfg.steps - 1)
    # Requeue only now: the requeue's SIGTERM also reaches helper processes (wandb's service).
    preempted = stopper.preempted
    if preempted is not None and requeue_here:
        requeue_from_rank0(rank, *preempted)
    elif preempted is not None and rank == 0:  # the launcher process requeues once the workers exited
        saved_in = str(preempted[1]) if preempted[1] else None
        (output_dir / PREEMPTED_FILE).write_text(json.dumps({"step": preempted[0], "checkpoint": saved_in}))
    return last
