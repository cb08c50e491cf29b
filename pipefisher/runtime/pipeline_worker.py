"""One pipeline worker's state: its stage replicas, optimizer, K-FAC work, executor and data
stream, and what one training step does with them (:class:`PipelineWorker`).

The process group must be initialized. The loop around the steps (metrics, checkpoint policy,
preemption, evaluation, profile) is ``pipefisher.runtime.worker.train_worker``.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from pipefisher.config import KFAC_OPTIMIZERS, TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.optim import build_preconditioner
from pipefisher.optim.factory import make_optimizer, refresh_decay
from pipefisher.optim.muon import resolve_ns_dtype
from pipefisher.profiling.nvtx import mark_rank
from pipefisher.run_spec import data_plan, data_source
from pipefisher.runtime import preemption
from pipefisher.runtime.batch_feed import BatchFeed
from pipefisher.runtime.build import (build_stage_modules, check_world_size, describe_kfac, kfac_assignment,
                                      new_groups, norm_params, schedule_for, seed_worker_rngs, tied_params)
from pipefisher.runtime.checkpoint import CheckpointError, load_shard, save_checkpoint
from pipefisher.runtime.device import autocast_context, set_flush_denormal
from pipefisher.runtime.executor import CommSpec, StepResult, WorkerExecutor
from pipefisher.runtime.init_weights import load_initial_weights
from pipefisher.runtime.faults import fault_here, inject_fault, poison_gradient, poison_outputs
from pipefisher.runtime.kfac_owners import owned_layers
from pipefisher.runtime.kfac_work import KfacWork
from pipefisher.runtime.ns_spread import NsSpread, late_workers
from pipefisher.runtime.sharded_checkpoint import ShardedCheckpointer, checkpoint_groups
from pipefisher.runtime.sharding import dp_block, local, sdp_groups, shard_stages
from pipefisher.runtime.stage_steps import StageSteps
from pipefisher.runtime.tensor_parallel import parallelize_stages, schedule_worker, stage_meshes, tp_group, tp_index
from pipefisher.runtime.state import (capture_rng_state, kfac_state, load_kfac_state, load_module_states,
                                      load_optimizer_state, module_key, optimizer_state, restore_rng_state, to_cpu)
from pipefisher.schedules.kfac import Assignment, check_assignment
from pipefisher.schedules.checks import check_schedule
from pipefisher.schedules.passes import per_stage_steps

__all__ = ["PipelineWorker"]

log = logging.getLogger(__name__)


class PipelineWorker:
    """Everything one worker holds: its stage replicas, optimizer, executor and data stream.

    The process group must be initialized. :meth:`train_step` runs one step; hooks in
    ``before_optimizer_step`` see the synchronized gradients just before the optimizer uses them
    (the tests compare them with a single-process run).
    """

    def __init__(self, cfg: TrainConfig, rank: int, world_size: int, device: torch.device) -> None:
        check_world_size(cfg, world_size)
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        set_flush_denormal(cfg.cpu_flush_denormal, device)  # [Note: subnormals on CPU]
        self.schedule = schedule_for(cfg)
        # Under tp each schedule worker is cfg.tp processes: [Note: tp inside the pipeline].
        self.schedule_worker, self.tp_index = schedule_worker(rank, cfg.tp), tp_index(rank, cfg.tp)
        self.modules = build_stage_modules(cfg, self.schedule, self.schedule_worker)
        if cfg.init_from is not None:  # weights only; a checkpoint to resume from replaces them later
            load_initial_weights(cfg, self.modules, log_here=rank == 0)
        for m in self.modules.values():
            m.to(device).train()
        grad_groups, tied_group = new_groups(self.schedule, rank, cfg.sdp, cfg.tp)
        # Tensor parallel, then sharded data parallel, before anything holds a parameter (both replace
        # them): TP on the tp (sub)mesh, then fully_shard on the sdp one (DESIGN.md, "Hybrid parallelism").
        timeout = datetime.timedelta(seconds=cfg.cluster.worker_timeout_s)
        groups = sdp_groups(self.schedule, cfg.sdp, rank, timeout, cfg.tp) if cfg.sdp > 1 else {}
        meshes, group = {}, None
        if cfg.tp > 1:
            group = tp_group(self.schedule.num_workers, cfg.tp, rank, timeout)
            meshes = stage_meshes(self.schedule, rank, cfg.tp, group, cfg.sdp, groups, device.type)
            parallelize_stages(self.modules, meshes)
        self.sdp = None
        if cfg.sdp > 1:
            self.sdp = shard_stages(self.modules, groups, cfg.sdp_reshard_after_forward, device.type, meshes=meshes)
        tied = (tied_params(self.modules, self.schedule.num_stages), tied_group) if tied_group is not None else None
        named, seen = [], set()  # a tied weight held once per worker is stepped once
        for (pipe, stage), m in sorted(self.modules.items()):
            for n, p in m.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    named.append((f"{pipe}.{stage}.{n}", p))
        self.optimizer, self.scheduler = make_optimizer(cfg, named, device, log_here=rank == 0)
        self.dcp: ShardedCheckpointer | None = None  # sdp/tp: replicas and moments go through DCP
        if cfg.sdp > 1 or cfg.tp > 1:
            writes = {(p, s) for g, p, s in self.schedule.placement.stages_of(self.schedule_worker)
                      if dp_block(g, cfg.sdp) == 0}
            self.dcp = ShardedCheckpointer(self.modules, self.optimizer,
                                           checkpoint_groups(list(self.modules), groups, group, meshes, timeout), writes)
        self._norm_params = norm_params(self.modules, self.schedule, rank, cfg.sdp, cfg.tp)
        self.before_optimizer_step: list[Callable[[], None]] = []
        loss_scale = 1.0 / (cfg.num_micro_batches * cfg.data_replicas)
        self.assignment: Assignment | None = None
        self.kfac: KfacWork | None = None
        if cfg.optimizer.name in KFAC_OPTIMIZERS:
            self.assignment = kfac_assignment(cfg, self.schedule)
            o = cfg.optimizer
            decay = refresh_decay(o.factor_decay, o.factor_decay_per, self.assignment.factor_every)
            preconditioners = {
                key: build_preconditioner(o.preconditioner, m, damping=o.damping, factor_decay=decay,
                                          loss_scale=loss_scale, inverse_dtype=o.inverse_dtype,
                                          beta2=o.ekfac_beta2, eps=o.ekfac_eps,
                                          warn_if_empty=False)  # a stage of embeddings or heads alone has none
                for key, m in self.modules.items()
            }
            owned = owned_layers(preconditioners, grad_groups) if o.kfac_owners == "replicas" else None
            self.kfac = KfacWork(preconditioners, grad_groups, deferred=self.assignment.deferred,
                                 ablate=cfg.comm_ablation, promote=o.promote_inverses, owned=owned)
        # optimizer_placement=per_stage: [Note: per-stage optimizer steps], [Note: post-validation].
        self.stage_steps: StageSteps | None = None
        if cfg.optimizer_placement == "per_stage":
            self.schedule = per_stage_steps(self.schedule)
            check_schedule(self.schedule)
            if self.assignment is not None:
                exchanges = cfg.optimizer.kfac_owners == "replicas"  # [Note: stage steps after the exchanges]
                self.assignment = dataclasses.replace(self.assignment, phases=tuple(
                    per_stage_steps(p, exchanges=exchanges) for p in self.assignment.phases))
                check_assignment(self.assignment, exchanges=exchanges)
        # optimizer.ns_owners=pipeline: [Note: NS owners across the pipeline] (a collective: every worker builds it)
        self.ns_spread: NsSpread | None = None
        if cfg.optimizer.name == "muon" and cfg.optimizer.ns_owners == "pipeline":
            self.ns_spread = NsSpread(self.optimizer.muon, self.modules, late_workers(self.schedule),
                                      resolve_ns_dtype(cfg.optimizer.ns_dtype, device)[0], device)
        if cfg.optimizer_placement == "per_stage":
            self.stage_steps = StageSteps(self.optimizer, self.modules, tied_params(self.modules, self.schedule.num_stages),
                                          cfg.optimizer.max_grad_norm, may_defer=cfg.sdp == 1 and cfg.tp == 1,
                                          stop_on_nonfinite=cfg.on_nonfinite == "stop", ns=self.ns_spread)
        self.rollbacks = 0  # stage steps rolled back in the last step, over all workers
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
            sdp=self.sdp,
            tp=cfg.tp,
            stage_step=self.stage_steps.step_stage if self.stage_steps is not None else None,
        )
        if device.type == "cuda":
            mark_rank(rank)  # an nsys capture maps this process to its rank (issue 15)
        self.source = data_source(cfg)
        self.plan = data_plan(cfg)
        self.batches = BatchFeed(self._host_batch, device)
        self.dp_rank = self.schedule.placement.dp_group_of(self.schedule_worker)
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
        """Write this worker's shard of the checkpoint after ``step`` (a collective: every worker calls it);
        under sdp/tp the stage replicas and optimizer moments go to DCP folders beside it
        ([Note: sharded checkpoint layout])."""
        state = {"step": step, **self.state_dict()}
        if self.dcp is None:
            return save_checkpoint(root, step, self.rank, self.world_size, state, self.cfg, self.kfac_interval)
        plain, tensors = self.dcp.split(state)
        return save_checkpoint(root, step, self.rank, self.world_size, plain, self.cfg, self.kfac_interval,
                               write_more=lambda folder: self.dcp.save(folder, tensors))

    def load_checkpoint(self, folder: Path) -> int:
        """Load this worker's shard of the checkpoint in ``folder`` (a collective); returns its step.

        Raises:
            CheckpointError: on every worker when any worker's shard failed to load.
        """
        error, step = None, -1
        try:
            state = load_shard(folder, self.rank)
        except (CheckpointError, ValueError, RuntimeError, KeyError) as err:
            error = f"worker {self.rank}: {type(err).__name__}: {err}"
        if self.dcp is not None:  # DCP's reads are collectives: every shard must have been read
            self._raise_errors(folder, error)
        if error is None:
            try:
                if self.dcp is not None:
                    state = self.dcp.merge(folder, state)
                self.load_state_dict(state)
                step = int(state["step"])
            except (CheckpointError, ValueError, RuntimeError, KeyError, CheckpointException) as err:
                error = f"worker {self.rank}: {type(err).__name__}: {err}"
        answers = self._raise_errors(folder, error, step)
        if len({s for _, s in answers}) != 1:
            raise CheckpointError(f"cannot resume from {folder}: the shards hold different steps {[s for _, s in answers]}")
        return step

    def _raise_errors(self, folder: Path, error: str | None, step: int = -1) -> list[tuple[str | None, int]]:
        """Every worker's (error, step); raises CheckpointError on every worker when any failed (a collective)."""
        answers: list[Any] = [None] * self.world_size
        dist.all_gather_object(answers, (error, step))
        errors = [e for e, _ in answers if e]
        if errors:
            raise CheckpointError(f"cannot resume from {folder}: " + "; ".join(dict.fromkeys(errors)))
        return answers

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
            elif p.grad is not None:  # under sdp the local shard: the all-reduce counts every shard once
                sq += local(p.grad).detach().float().pow(2).sum()
        dist.all_reduce(sq)
        return sq.sqrt()

    def _optimizer_step(self, grad_norm: torch.Tensor) -> None:
        for hook in self.before_optimizer_step:
            hook()
        norm = float(grad_norm)  # all-reduced over every worker: all of them decide alike
        if self.stage_steps is not None:  # confirm or redo the stage steps, step the rest
            self.stage_steps.finish(grad_norm, self._nonfinite_update)
            if not math.isfinite(norm):
                return
        elif not math.isfinite(norm):
            self._nonfinite_update(norm)
            return
        elif self.ns_spread is not None:  # every matrix's NS is left to the spread
            params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.ns_spread.step(self.optimizer, params, grad_norm, everything=True)
        else:
            self.optimizer.step(grad_norm=grad_norm)
        if self.ns_spread is not None:  # every pending Newton–Schulz, on its owner (a collective)
            self.ns_spread.resolve()
        self.skipped_in_row = 0
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
        if self.ns_spread is not None:  # nothing is applied: no Newton–Schulz to spread
            self.ns_spread.clear()
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
        """This worker's data-parallel group's micro-batch (the same on every stage), on the device."""
        return self.batches.get(step, micro_batch)

    def _host_batch(self, step: int, micro_batch: int) -> dict[str, torch.Tensor]:
        return get_micro_batch(self.source, step, micro_batch, self.dp_rank, **self.plan)

    def train_step(self, step: int) -> tuple[list[float], StepResult]:
        """Run one step on this worker; returns the step's [mlm, nsp] loss (same on every rank)
        and this worker's step result (its timeline events)."""
        self._step, self.step_skipped = step, False
        inject_fault(self.cfg, self.rank, step)
        with poison_outputs(self.modules.values(), fault_here(self.cfg, "nan", self.rank, step)), \
                poison_gradient(self.modules.values(), fault_here(self.cfg, "nan_grad", self.rank, step)):
            self.batches.start_step(step)  # on CUDA: last step's micro-batches copied before any action is timed
            result = self.executor.run_step(step, lambda mb: self.get_batch(step, mb))
        # The preemption flag rides on the loss all-reduce (see [Note: stopping on a signal]).
        # Recorded only where a handler is installed: SLURM's signal, or SIGINT in a local worker.
        stop = float(preemption.requested())
        # Every tp rank of the last stage computed the same losses: tp index 0 alone adds them.
        loss_sum = result.loss_sum.float() if self.tp_index == 0 else torch.zeros_like(result.loss_sum, dtype=torch.float)
        # Rollbacks of stage steps ([Note: post-validation]) ride along: tp index 0 counts its worker's.
        rolled = float(self.stage_steps.rollbacks) if self.stage_steps is not None and self.tp_index == 0 else 0.0
        totals = torch.cat([loss_sum, torch.tensor([stop, rolled], device=result.loss_sum.device)])
        dist.all_reduce(totals)
        self.stop_agreed = bool(totals[2].item() > 0)
        self.rollbacks = int(totals[3].item())
        losses = (totals[:2] / (self.cfg.num_micro_batches * self.cfg.data_replicas)).tolist()
        if self.kfac is not None:  # the oldest curvature any worker used this step (-1: none yet)
            age = self.kfac.curvature_age()
            oldest = torch.tensor([-1 if age is None else age], device=result.loss_sum.device)
            dist.all_reduce(oldest, op=dist.ReduceOp.MAX)
            self.curvature_age = None if oldest.item() < 0 else int(oldest.item())
        if not all(math.isfinite(v) for v in losses) and not self.step_skipped:
            raise FloatingPointError(f"step {step}: loss is {losses} but the gradients were finite and the update "
                                     "was applied; lower lr or check the data")
        return losses, result
