"""One pipeline worker: build its stage replicas, process groups and optimizer, then run the steps.

Every worker builds the same schedule and the same data stream from the config (both are pure
functions of it), holds the stage replicas the schedule's placement gives it, and runs its action
list with :class:`~pipefisher.runtime.executor.WorkerExecutor`. Rank 0 gathers the step's timeline,
computes the measured and simulated bubble utilization and writes ``metrics.jsonl`` and wandb.

With ``checkpoint.every_steps`` / ``checkpoint.every_minutes`` every worker saves its shard of a
checkpoint after the due steps, and ``resume=auto|<path>`` continues a run at the step after its
checkpoint with the loss trajectory of an uninterrupted run (``pipefisher.runtime.checkpoint``,
``pipefisher.runtime.state``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import hashlib
import logging
import math
import os
import random
import signal
import time
from dataclasses import asdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import BertStage, partition_layers
from pipefisher.profiling.nvtx import mark_rank
from pipefisher.profiling import (WorkerOrigin, local_origin, plot_timeline, utilization_table, write_profile,
                                  write_trace_json)
from pipefisher.optim import KFACPreconditioner
from pipefisher.planning.assign import plan_pipefisher
from pipefisher.planning.costs import Hardware, RunShape, estimate_run_costs
from pipefisher.runtime.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    agree_on_resume,
    checkpoint_root,
    load_shard,
    save_checkpoint,
    step_dir,
    trim_metrics,
)
from pipefisher.runtime import preemption
from pipefisher.runtime.preemption import PREEMPTED_FILE
from pipefisher.runtime.executor import CommSpec, StageKey, StepResult, WorkerExecutor
from pipefisher.runtime.state import (
    capture_rng_state,
    kfac_state,
    load_kfac_state,
    load_module_states,
    load_optimizer_state,
    module_key,
    optimizer_state,
    restore_rng_state,
    to_cpu,
)
from pipefisher.runtime.kfac_work import KfacWork
from pipefisher.schedules.kfac_baseline import on_critical_path
from pipefisher.schedules.kfac import Assignment, assignment_from_json, critical_path_assignment, kfac_layer_counts
from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.simulate import CostModel, compute_cost_fields, simulate
from pipefisher.timeline import COMPUTE_KINDS, Event, bubble_utilization, busy_ns, is_wait
from pipefisher.tracking import METRICS_FILE, MetricsWriter, WandbLogger
from pipefisher.training import (
    StepTimer,
    autocast_context,
    bert_config,
    data_plan,
    data_source,
    make_optimizer,
    resolve_device,
    set_cpu_threads,
)

__all__ = ["run_shape", "kfac_assignment", "kfac_plan_label", "describe_kfac", "run_worker", "train_worker", "PipelineWorker", "schedule_for",
           "build_stage_modules", "gather_origins", "write_run_profile", "check_world_size", "seed_worker_rngs"]

log = logging.getLogger(__name__)
_KFAC_KINDS = frozenset(k.value for k in ActionKind if k.is_kfac)
# A rough CPU core for start-up PipeFisher plans: fp32 matmul rate, loopback p2p, memory bandwidth.
CPU_HARDWARE = Hardware(flops_per_s=3e10, p2p_bytes_per_s=2e9, memory_bytes_per_s=1e10)


def schedule_for(cfg: TrainConfig) -> Schedule:
    """The checked schedule of a run (pure function of the config; ``RunShape.build_schedule``)."""
    return run_shape(cfg).build_schedule()


def build_stage_modules(cfg: TrainConfig, schedule: Schedule, rank: int) -> dict[StageKey, BertStage]:
    """The stage replicas ``rank`` holds, keyed by (pipe, stage); replicas of a stage are identical."""
    bert = bert_config(cfg)
    slices = stage_slices(cfg, schedule.num_stages)
    modules: dict[StageKey, BertStage] = {}
    for _dp, pipe, stage in schedule.placement.stages_of(rank):
        first, last = slices[stage]
        modules[(pipe, stage)] = BertStage(bert, first, last, seed=cfg.seed, recompute=cfg.recompute)
    return modules


def _new_groups(schedule: Schedule, rank: int) -> tuple[dict[int, Any], Any]:
    """Gradient groups per stage and the tied-weight group; every rank creates all, in one order."""
    placement = schedule.placement
    groups: dict[int, Any] = {}
    for s in range(schedule.num_stages):
        ranks = placement.replicas_of_stage(s)
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        groups[s] = g if rank in ranks else None
    tied_group = None
    if schedule.num_stages > 1:
        holders = sorted(set(placement.replicas_of_stage(0)) | set(placement.replicas_of_stage(schedule.num_stages - 1)))
        g = dist.new_group(holders)
        tied_group = g if rank in holders else None
    return groups, tied_group


def _tied_params(modules: dict[StageKey, BertStage], num_stages: int) -> list[nn.Parameter]:
    out = []
    for (_, stage), m in sorted(modules.items()):
        if stage in (0, num_stages - 1) and m.tied_parameter_name is not None:
            out.append(m.get_parameter(m.tied_parameter_name))
    return out


def _norm_params(modules: dict[StageKey, BertStage], schedule: Schedule, rank: int) -> list[nn.Parameter]:
    """Parameters this rank counts in the global gradient norm: one replica of each stage
    (data-parallel group 0, pipe 0) and the tied weight only on the first stage."""
    mine = {(p, s) for dp, p, s in schedule.placement.stages_of(rank) if dp == 0 and p == 0}
    params = []
    for (pipe, stage), m in modules.items():
        if (pipe, stage) not in mine:
            continue
        skip = m.tied_parameter_name if (stage == schedule.num_stages - 1 and stage != 0) else None
        params += [p for n, p in m.named_parameters() if n != skip]
    return params


def _step_utilization(events: list[Event], num_workers: int, kinds: frozenset[str] = COMPUTE_KINDS) -> float:
    """Σ busy / (workers × wall), wall = the longest worker's step (robust to clock offsets)."""
    busy = busy_ns(events, kinds)
    spans: dict[int, tuple[int, int]] = {}
    for e in events:
        lo, hi = spans.get(e.worker, (e.start_ns, e.end_ns))
        spans[e.worker] = (min(lo, e.start_ns), max(hi, e.end_ns))
    wall = max(hi - lo for lo, hi in spans.values())
    return sum(busy.values()) / (num_workers * wall) if wall > 0 else 0.0


def _mean_ns(durations: Sequence[int]) -> int:
    return round(sum(durations) / len(durations))


def _measured_costs(events: list[Event], schedule: Schedule, kfac_layers: Sequence[int] = ()) -> CostModel:
    """Mean F, B (and split I, W) time per stage in this step's timeline → a cost model for the simulator.

    With ``kfac_layers`` (K-FAC layers per stage) the K-FAC units the step ran are costed too, as
    measured (a unit run for all of a stage's layers at once is split evenly over them; what the
    step did not run costs 0, and the step's schedule does not hold it either).
    """
    sums: dict[tuple[str, int], list[int]] = {}
    kfac: dict[tuple[str, int, int | None], list[int]] = {}
    for e in events:
        if e.kind in ("F", "B", "I", "W"):
            stage = int(e.name.split(e.kind, 1)[0])
            sums.setdefault((e.kind, stage), []).append(e.duration_ns)
        elif kfac_layers and e.kind in _KFAC_KINDS and not is_wait(e):  # a wait costs no unit
            a = Action.from_str(e.name)
            kfac.setdefault((e.kind, a.stage, a.layer), []).append(e.duration_ns)
    mean = {k: _mean_ns(v) for k, v in sums.items()}
    d = schedule.num_stages
    compute = compute_cost_fields(mean, d)
    if not kfac_layers:
        return CostModel(**compute)

    def table(kind: ActionKind) -> list[list[int]]:
        rows = []
        for s in range(d):
            whole = kfac.get((kind.value, s, None))
            rows.append([_mean_ns(v) if (v := kfac.get((kind.value, s, layer)))
                         else (round(sum(whole) / len(whole) / kfac_layers[s]) if whole else 0)
                         for layer in range(kfac_layers[s])])
        return rows

    precond = [kfac.get((ActionKind.PRECOND.value, s, None), []) for s in range(d)]
    return CostModel(
        **compute,
        curv_a_ns=table(ActionKind.CURV_A), curv_b_ns=table(ActionKind.CURV_B),
        sync_factor_ns=table(ActionKind.SYNC_FACTOR), invert_ns=table(ActionKind.INVERT),
        precond_ns=[_mean_ns(v) if v else 0 for v in precond],
    )


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
        # The worker's objects hold the subgroups in reference cycles (executor <-> worker); free
        # them while the process group still exists, not during interpreter shutdown, where a
        # gloo group destroyed late aborts the process ("terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()


def stage_slices(cfg: TrainConfig, num_stages: int) -> list[tuple[int, int]]:
    """The run's partition: (first, last) pipeline layer of each of ``num_stages`` stages (balanced
    for the workers of a V on zb-v)."""
    return partition_layers(bert_config(cfg), num_stages, seq_len=cfg.data.seq_len,
                            max_predictions=cfg.data.max_predictions,
                            layers_per_stage=cfg.pipeline.layers_per_stage, v_shape=cfg.pipeline.method == "zb-v")


def encoder_layers_per_stage(cfg: TrainConfig, num_stages: int) -> list[int]:
    """How many encoder layers each of the ``num_stages`` stages holds (the partition's choice)."""
    num_layers = cfg.model.num_layers
    return [sum(1 for j in range(first, last + 1) if 1 <= j <= num_layers) for first, last in stage_slices(cfg, num_stages)]


def kfac_assignment(cfg: TrainConfig, schedule: Schedule) -> Assignment:
    """Where K-FAC's work runs: after the flush (``kfac``), or in the bubbles (``pipefisher``, from
    ``optimizer.schedule`` when given, else planned now from the built-in cost estimate).

    ``kfac`` with ``optimizer.schedule`` runs that plan's work on the critical path
    (:func:`~pipefisher.schedules.kfac_baseline.on_critical_path`)."""
    o = cfg.optimizer
    kfac_layers = kfac_layer_counts(schedule, encoder_layers_per_stage(cfg, schedule.num_stages))
    if o.name == "kfac" and not o.schedule:
        return critical_path_assignment(schedule, kfac_layers, o.curvature_interval, deferred=o.deferred_inverse,
                                        curvature_micro_batches=o.curvature_micro_batches)
    if o.schedule:
        assignment = assignment_from_json(o.schedule)
        base = assignment.phases[0]
        found = (base.method, base.num_stages, base.num_micro_batches, base.dp_width)
        wanted = (schedule.method, schedule.num_stages, schedule.num_micro_batches, schedule.dp_width)
        if found != wanted:
            raise ValueError(
                f"optimizer.schedule={o.schedule}: planned for (method, stages, micro-batches, data-parallel) = "
                f"{found}, but this run is {wanted}; re-plan with `python schedule.py from=<profile of this run>`"
            )
        if tuple(assignment.kfac_layers) != tuple(kfac_layers):
            raise ValueError(
                f"optimizer.schedule={o.schedule}: planned for K-FAC layers per stage {list(assignment.kfac_layers)}, "
                f"but this run's stages hold {kfac_layers}; re-plan for this model and partition"
            )
        if assignment.curvature_micro_batches != o.curvature_micro_batches:
            raise ValueError(
                f"optimizer.schedule={o.schedule}: planned with curvature from {assignment.curvature_micro_batches or 'all'} "
                f"micro-batch(es) per pipe, but optimizer.curvature_micro_batches={o.curvature_micro_batches}; set "
                f"optimizer.curvature_micro_batches={assignment.curvature_micro_batches} or re-plan")
        if o.max_staleness is not None and 2 * assignment.interval - 1 > o.max_staleness:
            raise ValueError(
                f"optimizer.schedule={o.schedule}: refresh interval k={assignment.interval} lets the curvature "
                f"age reach {2 * assignment.interval - 1} steps > optimizer.max_staleness={o.max_staleness}; "
                f"re-plan with a bound, or raise optimizer.max_staleness")
        # kfac with a plan: the plan's work on the critical path (same interval and staleness).
        return on_critical_path(assignment) if o.name == "kfac" else assignment
    # No plan given: plan now from the built-in estimate of this kind of device (schedule.py from a
    # profile of this run gives a plan from measured costs).
    hw = Hardware() if resolve_device(cfg.device).type == "cuda" else CPU_HARDWARE
    return plan_pipefisher(schedule, estimate_run_costs(run_shape(cfg), hw), kfac_layers,
                           max_interval=o.max_interval, max_staleness=o.max_staleness,
                           curvature_micro_batches=o.curvature_micro_batches,
                           curvature_placement=o.curvature_placement)


def kfac_plan_label(assignment: Assignment) -> str:
    """What runs K-FAC's work, for ``metrics.jsonl``'s ``kfac_plan``: ``pipefisher``,
    ``critical-path fallback: <reason>``, or ``critical path`` (``optimizer=kfac``)."""
    meta = assignment.metadata
    if meta.get("fallback"):
        return f"critical-path fallback: {meta.get('fallback_reason', 'predicted faster than the plan')}"
    return "pipefisher" if meta.get("planner") == "pipefisher" else "critical path"


def describe_kfac(cfg: TrainConfig, assignment: Assignment) -> str:
    """One paragraph for the start-up log: who runs K-FAC's work, k, the staleness bound, the plan's
    lower bound k_min, and any fallback with its reason."""
    k = assignment.interval
    age = 2 * k - 1 if assignment.deferred else k - 1
    subset = assignment.curvature_micro_batches
    meta = assignment.metadata
    parts = [f"K-FAC ({cfg.optimizer.name}): {kfac_plan_label(assignment)}; refresh every k={k} step(s), "
             f"curvature from {f'{subset} micro-batch(es)' if subset else 'every micro-batch'} per pipe; "
             f"inverses {'from the previous cycle' if assignment.deferred else 'used at once'}, "
             f"curvature age <= {age} step(s)"
             + (f" (optimizer.max_staleness={cfg.optimizer.max_staleness})" if cfg.optimizer.max_staleness else "")]
    if "k_min" in meta:
        parts.append(f"lower bound k_min={meta['k_min']} (work {meta['kfac_work_ns'] / 1e6:.1f} ms per refresh, "
                     f"bubbles {meta['bubble_ns'] / 1e6:.1f} ms per step, summed over workers)")
    if meta.get("choice"):
        parts.append(str(meta["choice"]))
    if meta.get("spilled_ns"):
        parts.append(f"{meta['spilled_ns'] / 1e6:.1f} ms of K-FAC work per refresh runs on the critical path")
    parts.append(f"update: {cfg.optimizer.kfac_update}, clip "
                 f"{'before' if cfg.optimizer.clip_before_precondition else 'after'} preconditioning")
    return "; ".join(parts)


def run_shape(cfg: TrainConfig) -> RunShape:
    """The planner's description of this run (model, pipeline, batch and sequence shape)."""
    return RunShape(
        bert=bert_config(cfg),
        method=cfg.pipeline.method,
        stages=cfg.stages,
        num_micro_batches=cfg.num_micro_batches,
        micro_batch_size=cfg.micro_batch_size,
        dp_width=cfg.data_parallel,
        num_virtual=cfg.pipeline.num_virtual,
        seq_len=cfg.data.seq_len,
        max_predictions=cfg.data.max_predictions,
        layers_per_stage=tuple(encoder_layers_per_stage(cfg, cfg.stages * cfg.pipeline.num_virtual)),
        recompute=cfg.recompute,
        precision=cfg.precision,
        order_costs=tuple(cfg.pipeline.order_costs) if cfg.pipeline.order_costs else None,
        activation_memory=cfg.pipeline.activation_memory,
    )


def seed_worker_rngs(seed: int, rank: int) -> None:
    """Seed this process's torch (CPU and CUDA), Python and numpy generators from (seed, rank).

    Each worker gets its own stream, and a run is reproducible. The model's dropout does not draw
    from them: its masks are keyed by (seed, step, micro-batch, site), whichever worker runs it
    (``pipefisher.model.rng``); only code outside a ``dropout_key`` does.
    """
    digest = hashlib.sha256(f"pipefisher/worker-rng/{seed}/{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") >> 1
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


def check_world_size(cfg: TrainConfig, world_size: int) -> None:
    """Raise ValueError when ``world_size`` processes cannot run ``cfg``'s pipeline."""
    if world_size != cfg.num_workers:
        raise ValueError(
            f"world size {world_size} does not fit stages={cfg.stages} x data_parallel="
            f"{cfg.data_parallel} = {cfg.num_workers} workers; start {cfg.num_workers} processes"
            " (e.g. SLURM tasks) or change stages/data_parallel"
        )


class PipelineWorker:
    """Everything one worker holds: its stage replicas, optimizer, executor and data stream.

    The process group must be initialized. :meth:`train_step` runs one step; hooks in
    ``before_optimizer_step`` see the synchronized gradients just before the optimizer uses them
    (the tests compare them with a single-process run).
    """

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device) -> None:
        check_world_size(cfg, world_size)
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.schedule = schedule_for(cfg)
        self.modules = build_stage_modules(cfg, self.schedule, rank)
        for m in self.modules.values():
            m.to(device).train()
        grad_groups, tied_group = _new_groups(self.schedule, rank)
        tied = (_tied_params(self.modules, self.schedule.num_stages), tied_group) if tied_group is not None else None
        named = [(f"{pipe}.{stage}.{n}", p) for (pipe, stage), m in sorted(self.modules.items())
                 for n, p in m.named_parameters()]
        self.optimizer, self.scheduler = make_optimizer(cfg, named, device)
        self._norm_params = _norm_params(self.modules, self.schedule, rank)
        self.before_optimizer_step: list[Callable[[], None]] = []
        loss_scale = 1.0 / (cfg.num_micro_batches * cfg.data_parallel)
        self.assignment: Assignment | None = None
        self.kfac: KfacWork | None = None
        if cfg.optimizer.name in ("kfac", "pipefisher"):
            self.assignment = kfac_assignment(cfg, self.schedule)
            o = cfg.optimizer
            preconditioners = {
                key: KFACPreconditioner(m, damping=o.damping, factor_decay=o.factor_decay, loss_scale=loss_scale,
                                        inverse_dtype=o.inverse_dtype)
                for key, m in self.modules.items()
            }
            self.kfac = KfacWork(preconditioners, grad_groups, deferred=self.assignment.deferred,
                                 ablate=cfg.comm_ablation)
        self.executor = WorkerExecutor(
            self.assignment.phases if self.assignment is not None else self.schedule,
            rank,
            self.modules,
            CommSpec((cfg.micro_batch_size, cfg.data.seq_len, cfg.model.hidden_size), torch.float32, device,
                     ablate=cfg.comm_ablation),
            grad_groups,
            tied,
            self.global_grad_norm,
            self._optimizer_step,
            loss_scale=loss_scale,
            autocast=lambda: autocast_context(cfg, device),
            kfac=self.kfac,
            cuda_timing="sync" if cfg.profile.enabled else "events",  # [Note: timing on a GPU]
        )
        if device.type == "cuda":
            mark_rank(rank)  # an nsys capture maps this process to its rank (issue 15)
        self.source = data_source(cfg)
        self.plan = data_plan(cfg)
        self.dp_rank = self.schedule.placement.dp_group_of(rank)
        seed_worker_rngs(cfg.seed, rank)
        # Preemption (SLURM) and non-finite steps; see [Note: stopping on a signal] and train_step.
        self.watch_preemption = preemption.watching(cfg.cluster.requeue)
        self.stop_agreed = False  # a worker got the preemption signal: all stop after this step
        self.step_skipped = False  # this step's update was dropped (on_nonfinite=skip)
        self.skipped_in_row = 0
        self._step = -1
        self.curvature_age: int | None = None  # K-FAC: steps since the curvature in use was captured
        if self.assignment is not None and rank == 0:
            log.info("%s", describe_kfac(cfg, self.assignment))

    @property
    def kfac_interval(self) -> int | None:
        """The K-FAC refresh cycle's length k (None without K-FAC)."""
        return self.assignment.interval if self.assignment is not None else None

    def state_dict(self) -> dict[str, Any]:
        """This worker's training state between steps, on the CPU (see ``pipefisher.runtime.state``)."""
        return to_cpu({
            "rank": self.rank,
            "world_size": self.world_size,
            "modules": {module_key(*key): m.state_dict() for key, m in sorted(self.modules.items())},
            **optimizer_state(self.optimizer, self.scheduler),
            "kfac": {} if self.kfac is None else {module_key(*k): kfac_state(p) for k, p in sorted(self.kfac.pre.items())},
            "rng": capture_rng_state(self.device),
        })

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same worker of a run with the same shape.

        Raises:
            ValueError: the state belongs to another worker or another shape of run.
        """
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"state of worker {state['rank']} of {state['world_size']} given to worker "
                             f"{self.rank} of {self.world_size}")
        load_module_states(self.modules, state["modules"])
        load_optimizer_state(self.optimizer, self.scheduler, state)
        wanted = {} if self.kfac is None else {module_key(*k): p for k, p in self.kfac.pre.items()}
        if set(state["kfac"]) != set(wanted):
            raise ValueError(f"K-FAC state of stage replicas {sorted(state['kfac'])}, this worker has {sorted(wanted)}")
        for key, pre in wanted.items():
            load_kfac_state(pre, state["kfac"][key])
        restore_rng_state(state["rng"], self.device)

    def save_checkpoint(self, root: Path, step: int) -> Path:
        """Write this worker's shard of the checkpoint after ``step`` (a collective: every worker calls it)."""
        return save_checkpoint(root, step, self.rank, self.world_size, {"step": step, **self.state_dict()},
                               self.cfg, self.kfac_interval)

    def load_checkpoint(self, folder: Path) -> int:
        """Load this worker's shard of the checkpoint in ``folder`` (a collective); returns its step.

        Raises:
            CheckpointError: on every worker when any worker's shard failed to load.
        """
        error, step = None, -1
        try:
            state = load_shard(folder, self.rank)
            self.load_state_dict(state)
            step = int(state["step"])
        except (CheckpointError, ValueError, RuntimeError, KeyError) as err:
            error = f"worker {self.rank}: {type(err).__name__}: {err}"
        answers: list[Any] = [None] * self.world_size
        dist.all_gather_object(answers, (error, step))
        errors = [e for e, _ in answers if e]
        if errors:
            raise CheckpointError(f"cannot resume from {folder}: " + "; ".join(errors))
        if len({s for _, s in answers}) != 1:
            raise CheckpointError(f"cannot resume from {folder}: the shards hold different steps {[s for _, s in answers]}")
        return step

    def global_grad_norm(self) -> torch.Tensor:
        """L2 norm of the gradient over all stages, each stage and the tied weight counted once.

        With K-FAC: K-FAC layers count with their gradient before preconditioning when
        ``optimizer.clip_before_precondition`` (the clip then means what it means for NVLAMB),
        and not at all under ``optimizer.kfac_update=momentum`` (they clip on their own).
        """
        o = self.cfg.optimizer
        raw = self.kfac.raw_grad_sq() if self.kfac is not None and o.clip_before_precondition else {}
        skip = self.kfac.parameter_ids() if self.kfac is not None and o.kfac_update == "momentum" else set()
        sq = torch.zeros((), device=self.device)
        for p in self._norm_params:
            if id(p) in skip:
                continue
            if id(p) in raw:
                sq += raw[id(p)]
            elif p.grad is not None:
                sq += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt()

    def _optimizer_step(self, grad_norm: torch.Tensor) -> None:
        for hook in self.before_optimizer_step:
            hook()
        norm = float(grad_norm)  # all-reduced over every worker: all of them decide alike
        if not math.isfinite(norm):
            self._nonfinite_update(norm)
            return
        self.skipped_in_row = 0
        self.optimizer.step(grad_norm=grad_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _nonfinite_update(self, norm: float) -> None:
        """Stop (``on_nonfinite=stop``) or drop this step's update (``skip``) on a NaN/inf gradient norm.

        The learning-rate schedule still advances when a step is skipped, so the rate stays a
        function of the step number.

        Raises:
            FloatingPointError: naming the step, on every worker at once (the norm is global).
        """
        cfg, step = self.cfg, self._step
        if cfg.on_nonfinite == "stop":
            raise FloatingPointError(
                f"step {step}: the global gradient norm is {norm} (NaN/inf in the loss or gradients); "
                "lower lr, check the data, or set on_nonfinite=skip to drop such steps")
        self.skipped_in_row += 1
        if self.skipped_in_row > cfg.max_skipped_steps:
            raise FloatingPointError(
                f"step {step}: the gradient norm is {norm}; non-finite steps in a row: {self.skipped_in_row} "
                f"(max_skipped_steps={cfg.max_skipped_steps}); lower lr or check the data")
        if self.rank == 0:
            log.warning("step %d: gradient norm %s; update skipped (on_nonfinite=skip, %d in a row)",
                        step, norm, self.skipped_in_row)
        self.step_skipped = True
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def get_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        """This worker's data-parallel group's micro-batch (the same on every stage)."""
        batch = get_micro_batch(self.source, step, micro_batch, self.dp_rank, **self.plan)
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def train_step(self, step: int) -> tuple[list[float], StepResult]:
        """Run one step on this worker; returns the step's [mlm, nsp] loss (same on every rank)
        and this worker's step result (its timeline events)."""
        self._step, self.step_skipped = step, False
        inject_fault(self.cfg, self.rank, step)
        with poison_outputs(self.modules.values(), _fault_here(self.cfg, "nan", self.rank, step)):
            result = self.executor.run_step(step, lambda mb: self.get_batch(step, mb))
        # The preemption flag rides on the loss all-reduce (see [Note: stopping on a signal]).
        # Recorded only where a handler is installed: SLURM's signal, or SIGINT in a local worker.
        stop = float(preemption.requested())
        totals = torch.cat([result.loss_sum.float(), torch.tensor([stop], device=result.loss_sum.device)])
        dist.all_reduce(totals)
        self.stop_agreed = bool(totals[2].item() > 0)
        losses = (totals[:2] / (self.cfg.num_micro_batches * self.cfg.data_parallel)).tolist()
        if self.kfac is not None:  # the oldest curvature any worker used this step (-1: none yet)
            age = self.kfac.curvature_age()
            oldest = torch.tensor([-1 if age is None else age], device=result.loss_sum.device)
            dist.all_reduce(oldest, op=dist.ReduceOp.MAX)
            self.curvature_age = None if oldest.item() < 0 else int(oldest.item())
        if not all(math.isfinite(v) for v in losses) and not self.step_skipped:
            raise FloatingPointError(f"step {step}: loss is {losses} but the gradients were finite and the update "
                                     "was applied; lower lr or check the data")
        return losses, result


def _fault_here(cfg: TrainConfig, mode: str, rank: int, step: int) -> bool:
    f = cfg.fault
    return f.mode == mode and (f.rank, f.step) == (rank, step)


@contextlib.contextmanager
def poison_outputs(modules: Iterable[nn.Module], enabled: bool) -> Iterator[None]:
    """While active, every floating-point output of ``modules`` is NaN (``fault.mode=nan``): the
    NaN flows into the loss, every gradient and the K-FAC curvature, as a numerical blow-up would."""
    if not enabled:
        yield
        return

    def hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            return output * float("nan")
        if isinstance(output, tuple):
            return tuple(o * float("nan") if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                         for o in output)
        return output

    log.error("injecting fault 'nan': this worker's stage outputs are NaN for this step")
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def inject_fault(cfg: TrainConfig, rank: int, step: int) -> None:
    """Fail as ``cfg.fault`` asks, at the start of ``step`` on worker ``rank`` (a testing aid;
    ``nan`` is done by :func:`poison_outputs` around the step)."""
    f = cfg.fault
    if f.mode in ("none", "nan") or not _fault_here(cfg, f.mode, rank, step):
        return
    log.error("injecting fault %r on worker %d at step %d", f.mode, rank, step)
    if f.mode == "raise":
        raise RuntimeError(f"injected fault on worker {rank} at step {step} (fault.mode=raise)")
    if f.mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if f.mode == "stall":
        while True:
            time.sleep(3600)


def _step_range(cfg: TrainConfig, first: int, enabled: bool) -> range | tqdm:
    """Steps ``first … steps-1``, in a progress bar when ``enabled`` and ``cfg.progress``."""
    steps = range(first, cfg.steps)
    if not (enabled and cfg.progress):
        return steps
    return tqdm(steps, initial=first, total=cfg.steps, desc="train", unit="step", dynamic_ncols=True)


def _checkpoint_due(policy: CheckpointPolicy, step: int, device: torch.device) -> bool:
    """Whether every worker saves after ``step``; the time rule follows rank 0's clock."""
    due = policy.due_by_steps(step)
    if policy.every_minutes > 0:
        flag = torch.tensor([float(due or policy.due_by_time())], device=device)
        dist.broadcast(flag, src=0)
        due = bool(flag.item())
    return due


def _trained_long_enough(cfg: TrainConfig, trained_s: float, device: torch.device) -> bool:
    """Whether a run stopped by Ctrl-C or SIGTERM saves: rank 0 trained for
    ``checkpoint.on_stop_after_s`` (a collective: every worker calls it)."""
    limit = cfg.checkpoint.on_stop_after_s
    flag = torch.tensor([float(0 <= limit <= trained_s)], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _first_step_note(worker: PipelineWorker) -> str:
    """Why the first step may be long, for the log line before it: K-FAC's inversions."""
    if worker.kfac is None or worker.kfac_interval is None:
        return ""
    dims = [d for pre in worker.kfac.pre.values() for name in pre.layer_names for d in pre.layer(name).dims]
    return (f"; K-FAC inverts {len(dims)} factors ({len(dims) // 2} layers) of up to {max(dims)} x {max(dims)} "
            f"on this worker every {worker.kfac_interval} step(s), and the progress bar shows an ETA from the "
            f"first step's end on" if dims else "")


def _requeue_from_rank0(rank: int, step: int, folder: Path) -> None:
    """Worker 0 requeues the SLURM job; every worker learns whether it worked.

    Raises:
        RequeueError: on every worker, when the job was not requeued (the checkpoint is kept).
    """
    outcome: list[Any] = [None]
    if rank == 0:
        try:
            preemption.requeue(step, folder)
        except preemption.RequeueError as err:
            outcome[0] = str(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise preemption.RequeueError(outcome[0])


def train_worker(cfg: TrainConfig, rank: int, world_size: int, device: torch.device,
                 output_dir: str | os.PathLike, run_name: str | None = None,
                 group: str | None = None, requeue_here: bool = False) -> dict[str, Any]:
    """Train as worker ``rank`` in an initialized process group: resume if asked, run the
    remaining steps, save checkpoints when due; rank 0 writes ``metrics.jsonl`` and wandb.

    On SLURM's preemption signal the workers checkpoint and stop (the result then holds
    ``"preempted": True``); with ``requeue_here`` worker 0 also requeues the job, otherwise it
    leaves :data:`~pipefisher.runtime.preemption.PREEMPTED_FILE` for the launcher process.

    Returns:
        The last step's metrics on rank 0 (other ranks: their last loss); empty when a resumed
        run had no step left.
    """
    output_dir = Path(output_dir)
    worker = PipelineWorker(cfg, rank, world_size, device)
    if worker.watch_preemption:  # the handler is installed (run_worker); a requeued job resumes
        resume = preemption.resume_mode(cfg.resume, cfg.cluster.requeue)
        if resume != cfg.resume:
            cfg = dataclasses.replace(cfg, resume=resume)
    if rank == 0:
        (output_dir / PREEMPTED_FILE).unlink(missing_ok=True)
    schedule = worker.schedule
    root = checkpoint_root(cfg, output_dir)
    first = 0
    resumed = agree_on_resume(cfg, root, rank, world_size, worker.kfac_interval)
    if resumed is not None:
        folder, saved_step = resumed
        first = worker.load_checkpoint(folder) + 1
        if rank == 0:
            trim_metrics(output_dir / METRICS_FILE, saved_step)
            log.info("resumed from %s: continuing at step %d of %d", folder, first, cfg.steps)
    elif cfg.resume != "none" and rank == 0:  # starting over: records of an unsaved earlier attempt go
        trim_metrics(output_dir / METRICS_FILE, -1)
    policy = CheckpointPolicy(cfg.checkpoint.every_steps, cfg.checkpoint.every_minutes, last_step=cfg.steps - 1)
    timer = StepTimer(device)
    writer = MetricsWriter(output_dir / METRICS_FILE) if rank == 0 else None
    if cfg.comm_ablation and rank == 0:
        log.warning("comm_ablation=true: activations, gradients and all-reduces are 1-byte messages; "
                    "step times split compute from communication, but the loss and the model are meaningless")
    logger = (
        WandbLogger(asdict(cfg), project=cfg.wandb.project, group=group, name=run_name, mode=cfg.wandb.mode,
                    dir=str(output_dir), enabled=True)
        if rank == 0 else None
    )
    last: dict[str, Any] = {}
    preempted: tuple[int, Path | None] | None = None  # (step, checkpoint or None) when stopped on a signal
    profiled: list[Event] = []
    if rank == 0 and first < cfg.steps:
        log.info("training steps %d to %d%s", first, cfg.steps - 1, _first_step_note(worker))
    # Each worker's own host, pid, tid and clock, for profile.sqlite and timeline.json (issue 15).
    origins = gather_origins(rank, world_size) if cfg.profile.enabled else {}
    started = time.monotonic()  # training time of this attempt: a stop saves after checkpoint.on_stop_after_s
    bar = _step_range(cfg, first, enabled=rank == 0)
    try:
        for step in bar:
            lr = worker.optimizer.param_groups[0]["lr"]
            timer.start()
            losses, result = worker.train_step(step)
            train_time = timer.stop()
            gathered: list[list[Event]] | None = [[] for _ in range(world_size)] if rank == 0 else None
            dist.gather_object(result.events, gathered, dst=0)
            last = {"step": step, "loss": losses[0] + losses[1], "mlm_loss": losses[0], "nsp_loss": losses[1]}
            if cfg.comm_ablation:
                last["comm_ablation"] = True  # this loss is meaningless: the stages computed on zeros
            if worker.step_skipped:
                last["skipped"] = True  # non-finite gradients: no update (on_nonfinite=skip)
            if rank == 0:
                events = [e for evs in gathered for e in evs]
                if cfg.profile.enabled and step >= cfg.profile.warmup_steps:
                    profiled += events
                # Step time: from this step's start until rank 0 has the step's row ready, so it holds
                # rank 0's bookkeeping (gathering the timeline, simulating, metrics: bookkeeping_s), which
                # every worker waits for at the next step; writing the row and wandb come after (µs to
                # ms), checkpoints are not in it. The simulation (17–130 ms at D=8) runs on logged steps.
                logged = step % cfg.log_every == 0 or step == cfg.steps - 1
                last.update(lr=lr, step_time_s=None, samples_per_s=None, bookkeeping_s=None,
                            bubble_utilization=_step_utilization(events, world_size))
                if logged:
                    if worker.assignment is None:
                        simulated = simulate(schedule, _measured_costs(events, schedule))
                    else:  # this step's phase of the K-FAC plan, K-FAC units at their measured cost
                        phase = worker.assignment.phases[step % worker.assignment.interval]
                        simulated = simulate(phase, _measured_costs(events, schedule, worker.assignment.kfac_layers))
                    last.update(simulated_bubble_utilization=bubble_utilization(simulated, world_size))
                if worker.assignment is not None:
                    kfac_events = [e for e in events if e.kind in _KFAC_KINDS and not is_wait(e)]
                    last.update(
                        kfac_plan=kfac_plan_label(worker.assignment),
                        curvature_age=worker.curvature_age,
                        refresh_interval=worker.assignment.interval,
                        kfac_phase=step % worker.assignment.interval,
                        kfac_work={kind: sum(e.kind == kind for e in kfac_events) for kind in sorted(_KFAC_KINDS)},
                        kfac_time_s=sum(e.duration_ns for e in kfac_events) / 1e9,
                        bubble_utilization_without_kfac=_step_utilization(events, world_size,
                                                                          COMPUTE_KINDS - _KFAC_KINDS),
                    )
                step_time = timer.stop()
                last.update(step_time_s=step_time, samples_per_s=cfg.global_batch_size / step_time,
                            bookkeeping_s=step_time - train_time)
                writer.write(last)
                if logged:
                    logger.log(last, step=step)
                    if hasattr(bar, "set_postfix"):
                        bar.set_postfix(loss=f"{last['loss']:.3f}", bubble_util=f"{last['bubble_utilization']:.2f}")
            saved = _checkpoint_due(policy, step, device)
            if saved:
                worker.save_checkpoint(root, step)
                policy.saved()
            if worker.stop_agreed and step < cfg.steps - 1:  # preempted: see [Note: stopping on a signal]
                # SLURM's signal always saves (the requeued job resumes); Ctrl-C and SIGTERM with
                # checkpointing on, or after checkpoint.on_stop_after_s of training (rank 0's clock).
                keep = (saved or worker.watch_preemption or cfg.checkpoint.enabled
                        or _trained_long_enough(cfg, time.monotonic() - started, device))
                folder = step_dir(root, step) if saved else worker.save_checkpoint(root, step) if keep else None
                if rank == 0:
                    log.warning("stop signal: stopped after step %d of %d, checkpoint: %s",
                                step, cfg.steps, folder or "none")
                preempted = (step, folder)
                last["preempted"] = True
                break
        if rank == 0 and profiled:
            for picture in write_run_profile(cfg, profiled, world_size, output_dir, device, origins):
                if picture.suffix == ".png":
                    logger.log_image("timeline", str(picture))
        if rank == 0 and first >= cfg.steps:
            log.info("nothing to train: the checkpoint is at the last step (steps=%d)", cfg.steps)
    finally:
        if writer is not None:
            writer.close()
        if logger is not None:
            logger.finish()
        if hasattr(bar, "close"):
            bar.close()
    # Requeue only now: the requeue's SIGTERM also reaches helper processes (wandb's service).
    if preempted is not None and requeue_here:
        _requeue_from_rank0(rank, *preempted)
    elif preempted is not None and rank == 0:  # the launcher process requeues once the workers exited
        saved_in = str(preempted[1]) if preempted[1] else None
        (output_dir / PREEMPTED_FILE).write_text(json.dumps({"step": preempted[0], "checkpoint": saved_in}))
    return last


def gather_origins(rank: int, world_size: int) -> dict[int, WorkerOrigin]:
    """Every worker's :func:`~pipefisher.profiling.local_origin` (host, pid, tid, clock), on rank 0.

    A collective: every rank calls it. Each origin is taken in its worker's own process, so a
    multi-node run records each node's hostname and clock offset, not rank 0's.

    Returns:
        ``{rank: origin}`` on rank 0; empty on the other ranks.
    """
    mine = local_origin()
    if world_size == 1 or not dist.is_initialized():
        return {rank: mine}
    gathered: list[WorkerOrigin] | None = [mine] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return dict(enumerate(gathered)) if gathered is not None else {}


def write_run_profile(cfg: TrainConfig, events: list[Event], num_workers: int, output_dir: Path,
                      device: torch.device, origins: Mapping[int, WorkerOrigin] | None = None) -> list[Path]:
    """Write ``profile.sqlite``, ``timeline.json`` (Perfetto, chrome://tracing) and
    ``timeline.pdf/png`` of a run; log the utilization table (each host on its own clock).

    Args:
        origins: ``{worker: origin}`` from :func:`gather_origins`; hosts, pids and clocks.

    Returns:
        The paths of the pictures.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    oversubscribed = device.type == "cpu" and num_workers > cores
    metadata = {
        "config": asdict(cfg),
        "method": cfg.pipeline.method,
        "num_stages": cfg.stages,
        "num_micro_batches": cfg.num_micro_batches,
        "num_steps": cfg.steps - cfg.profile.warmup_steps,
        "device": str(device),
        "oversubscribed": oversubscribed,
        "cores": cores,
    }
    origins = dict(origins or {})
    ranks = {w: w for w in range(num_workers)}
    hosts = {w: o.host for w, o in origins.items()}
    write_profile(output_dir / "profile.sqlite", events, metadata=metadata, worker_ranks=ranks, origins=origins)
    write_trace_json(output_dir / "timeline.json", events, ranks=ranks, origins=origins,
                     metadata={k: v for k, v in metadata.items() if k != "config"})
    title = (f"{cfg.model.name} {cfg.pipeline.method} D={cfg.stages} N={cfg.num_micro_batches}"
             f" W={cfg.data_parallel} on {device.type}")
    pictures = plot_timeline(events, output_dir / "timeline", title=title, num_workers=num_workers,
                             oversubscribed=oversubscribed, hosts=hosts)
    log.info("profile written to %s (and timeline.json)\n%s", output_dir / "profile.sqlite",
             utilization_table(events, num_workers, oversubscribed=oversubscribed, hosts=hosts))
    return pictures
