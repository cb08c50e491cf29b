"""Build what a worker of a run holds, from the config alone: the schedule, the stage replicas,
the process groups, the K-FAC plan, and the planner's view of the run (:class:`RunShape`).

Every function here is a pure function of the config (and the rank), so every worker builds the
same schedule and plan; only :func:`new_groups` talks to torch.distributed (every rank creates
every group, in one order).
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipefisher.config import V_METHODS, TrainConfig, schedule_method
from pipefisher.model import BertStage, partition_layers
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import Hardware, RunShape
from pipefisher.planning.pipefisher_plan import PlanOptions, plan_for, plan_from_file
from pipefisher.planning.strategy_search import pipeline_costs
from pipefisher.run_spec import bert_config
from pipefisher.runtime.device import device_type
from pipefisher.runtime.kfac_work import StageKey
from pipefisher.runtime.step_metrics import kfac_plan_label
from pipefisher.runtime.tensor_parallel import is_tp_sharded
from pipefisher.schedules.ir import Schedule
from pipefisher.schedules.kfac import Assignment, critical_path_assignment, curvature_age_bound, kfac_layer_counts
from pipefisher.schedules.kfac_baseline import on_critical_path
from pipefisher.schedules.torch_csv import CSV_METHOD, build_from_torch_csv

__all__ = ["CPU_HARDWARE", "schedule_for", "build_stage_modules", "new_groups", "tie_local_copies", "tied_params", "norm_params",
           "stage_slices", "encoder_layers_per_stage", "kfac_assignment", "kfac_plan_label", "describe_kfac",
           "run_shape", "seed_worker_rngs", "check_world_size"]

log = logging.getLogger(__name__)
# A rough CPU core for start-up PipeFisher plans: fp32 matmul rate, loopback p2p, memory bandwidth.
CPU_HARDWARE = Hardware(flops_per_s=3e10, p2p_bytes_per_s=2e9, memory_bytes_per_s=1e10)


def schedule_for(cfg: TrainConfig) -> Schedule:
    """The checked schedule of a run (pure function of the config; ``RunShape.build_schedule``, or
    the file of pipeline=csv completed by our passes: ``build_from_torch_csv``)."""
    if cfg.pipeline.method == CSV_METHOD:
        with open(cfg.pipeline.csv, encoding="utf-8") as f:
            return build_from_torch_csv(f.read(), cfg.num_micro_batches, cfg.data_parallel)
    return run_shape(cfg).build_schedule()


def build_stage_modules(cfg: TrainConfig, schedule: Schedule, rank: int) -> dict[StageKey, BertStage]:
    """The stage replicas ``rank`` holds, keyed by (pipe, stage); replicas of a stage are identical."""
    bert = bert_config(cfg)
    slices = stage_slices(cfg, schedule.num_stages)
    modules: dict[StageKey, BertStage] = {}
    for _dp, pipe, stage in schedule.placement.stages_of(rank):
        first, last = slices[stage]
        modules[(pipe, stage)] = BertStage(bert, first, last, seed=cfg.seed,
                                           recompute=cfg.recomputes(stage))
    if cfg.sdp == 1 and cfg.tp == 1:
        tie_local_copies(modules, schedule.num_stages)
    return modules


def tie_local_copies(modules: dict[StageKey, BertStage], num_stages: int) -> int:
    """Make every copy of the tied word-embedding / decoder weight on this worker one Parameter.

    [Note: one tied weight per worker]
    A V schedule puts the first and the last stage on one worker, as Chimera does with its two
    pipes. Each stage built alone owns a copy of the tied weight; kept apart, the worker would add
    the copies' gradients, update each copy with the optimizer and hold each copy's moments: on
    bert-medium that is a second [30522, 512] update, which made zb-v's worker 0 take 370 ms at STEP
    against worker 1's 40 (``bench/v_gap.py``). Tied here, both uses accumulate into one ``.grad``
    (as in single-process BERT) and the executor's sum over workers sees one local copy. Under sdp
    or tp the copies are sharded or placed per stage, so they stay apart.

    Returns:
        How many copies now alias the first one.
    """
    holders = [m for (_, stage), m in sorted(modules.items())
               if stage in (0, num_stages - 1) and m.tied_parameter_name is not None]
    if len(holders) < 2:
        return 0
    shared = holders[0].get_parameter(holders[0].tied_parameter_name)
    for m in holders[1:]:
        owner, _, attr = m.tied_parameter_name.rpartition(".")
        setattr(m.get_submodule(owner), attr, shared)
    return len(holders) - 1


def new_groups(schedule: Schedule, rank: int, sdp: int = 1, tp: int = 1) -> tuple[dict[int, Any], Any]:
    """Gradient groups per stage and the tied-weight group; every rank creates all, in one order.

    With ``sdp`` > 1 the groups join the workers holding the same shard (the same sdp index, see
    ``runtime.sharding``): one set of groups per sdp index. With ``tp`` > 1 ``rank`` is a process
    rank and each schedule worker is ``tp`` processes: one set of groups per tp index, joining the
    processes of that index ([Note: tp inside the pipeline])."""
    placement = schedule.placement
    groups: dict[int, Any] = {}
    tied_group = None
    for t in range(tp):
        for i in range(sdp):
            def holders_of(stage: int) -> set[int]:
                return {w * tp + t for w in placement.replicas_of_stage(stage) if placement.dp_group_of(w) % sdp == i}

            for s in range(schedule.num_stages):
                ranks = sorted(holders_of(s))
                g = dist.new_group(ranks) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[s] = g
                else:
                    groups.setdefault(s, None)
            if schedule.num_stages > 1:
                holders = sorted(holders_of(0) | holders_of(schedule.num_stages - 1))
                g = dist.new_group(holders)
                tied_group = g if rank in holders else tied_group
    return groups, tied_group


def tied_params(modules: dict[StageKey, BertStage], num_stages: int) -> list[nn.Parameter]:
    """This worker's distinct copies of the tied weight (one when tied: [Note: one tied weight per worker])."""
    out: list[nn.Parameter] = []
    for (_, stage), m in sorted(modules.items()):
        if stage in (0, num_stages - 1) and m.tied_parameter_name is not None:
            p = m.get_parameter(m.tied_parameter_name)
            if all(p is not q for q in out):
                out.append(p)
    return out


def norm_params(modules: dict[StageKey, BertStage], schedule: Schedule, rank: int, sdp: int = 1,
                tp: int = 1) -> list[nn.Parameter]:
    """Parameters this rank counts in the global gradient norm: one replica of each stage
    (data-parallel group 0, pipe 0; with ``sdp`` > 1 the shards of the first block) and the tied
    weight only on the first stage. With ``tp`` > 1 (``rank`` a process rank) every tp rank counts
    its part of the split weights and tp index 0 alone the whole ones, so each is counted once."""
    mine = {(p, s) for dp, p, s in schedule.placement.stages_of(rank // tp) if dp < sdp and p == 0}
    whole_too = rank % tp == 0
    params = []
    for (pipe, stage), m in modules.items():
        if (pipe, stage) not in mine:
            continue
        skip = m.tied_parameter_name if (stage == schedule.num_stages - 1 and stage != 0) else None
        params += [p for n, p in m.named_parameters() if n != skip and (whole_too or is_tp_sharded(p))]
    return params


def stage_slices(cfg: TrainConfig, num_stages: int) -> list[tuple[int, int]]:
    """The run's partition: (first, last) pipeline layer of each of ``num_stages`` stages (balanced
    for the workers of a V on zb-v, dualpipev, v-half and v-min)."""
    return partition_layers(bert_config(cfg), num_stages, seq_len=cfg.data.seq_len,
                            max_predictions=cfg.data.max_predictions,
                            layers_per_stage=cfg.pipeline.layers_per_stage, v_shape=cfg.pipeline.method in V_METHODS)


def encoder_layers_per_stage(cfg: TrainConfig, num_stages: int) -> list[int]:
    """How many encoder layers each of the ``num_stages`` stages holds (the partition's choice)."""
    num_layers = cfg.model.num_layers
    return [sum(1 for j in range(first, last + 1) if 1 <= j <= num_layers) for first, last in stage_slices(cfg, num_stages)]


def kfac_assignment(cfg: TrainConfig, schedule: Schedule) -> Assignment:
    """Where K-FAC's work runs: after the flush (``kfac``), or in the bubbles (``pipefisher``, from
    ``optimizer.schedule`` when given: schedule.py's assignment.json or a strategy file's plan; else planned now
    from the built-in cost estimate through the search's own path, ``planning.pipefisher_plan``).

    ``kfac`` with ``optimizer.schedule`` runs that plan's work on the critical path
    (:func:`~pipefisher.schedules.kfac_baseline.on_critical_path`)."""
    o = cfg.optimizer
    kfac_layers = kfac_layer_counts(schedule, encoder_layers_per_stage(cfg, schedule.num_stages))
    if o.name == "kfac" and not o.schedule:  # factors every curvature_interval, inverses every inverse_interval
        factors = 0 if o.curvature_interval == o.inverse_interval else o.curvature_interval
        return critical_path_assignment(schedule, kfac_layers, o.inverse_interval, deferred=o.deferred_inverse,
                                        curvature_micro_batches=o.curvature_micro_batches, factor_interval=factors)
    if o.schedule:
        assignment, block = plan_from_file(o.schedule)
        if block is not None and block.get("k") != assignment.interval:
            raise ValueError(f"optimizer.schedule={o.schedule}: field pipefisher.k is {block.get('k')!r}, but its "
                             f"plan refreshes every {assignment.interval} steps; search again to rewrite the file")
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
        age = curvature_age_bound(assignment, o.promote_inverses)
        if o.max_staleness is not None and age > o.max_staleness:
            raise ValueError(
                f"optimizer.schedule={o.schedule}: refresh interval k={assignment.interval} lets the curvature "
                f"age reach {age} steps (optimizer.promote_inverses={o.promote_inverses}) > optimizer.max_staleness="
                f"{o.max_staleness}; re-plan with a bound, or raise optimizer.max_staleness")
        if block is not None:
            log.info("PipeFisher plan from the strategy file %s: k=%d, curvature age <= %d step(s) (searched: %s)",
                     o.schedule, assignment.interval, age, block.get("describe", "?"))
        # kfac with a plan: the plan's work on the critical path (same interval and staleness).
        return on_critical_path(assignment) if o.name == "kfac" else assignment
    # No plan given: plan now from the built-in estimate of this kind of device (schedule.py from a
    # profile of this run gives a plan from measured costs).
    # The search's cost model of one pipeline and its planner call ([Note: one planning path]).
    hw = Hardware() if device_type(cfg.device) == "cuda" else CPU_HARDWARE
    run = run_shape(cfg)
    cost = pipeline_costs(run, hw, sdp=cfg.sdp, tp=cfg.tp, schedule=schedule)
    return plan_for(schedule, cost, kfac_layers, PlanOptions.from_optimizer(o), run, CommCosts({}, hw)).assignment


def describe_kfac(cfg: TrainConfig, assignment: Assignment) -> str:
    """One paragraph for the start-up log: who runs K-FAC's work, k, the staleness bound, the plan's
    lower bound k_min, and any fallback with its reason."""
    k, promote = assignment.interval, cfg.optimizer.promote_inverses
    age = curvature_age_bound(assignment, promote)
    subset = assignment.curvature_micro_batches
    meta = assignment.metadata
    when = ("from the step after their INVERT" if promote == "when_ready" else "from the next cycle") \
        if assignment.deferred else "used at once"
    factors = f" (factors every {assignment.factor_every})" if assignment.factor_every != k else ""
    kind = "" if cfg.optimizer.preconditioner == "kfac" else \
        f", preconditioner {cfg.optimizer.preconditioner}: INVERT computes eigenbases, PRECOND rescales in them"
    every = " (all of them: as 0)" if subset >= cfg.micro_batches_per_pipe else ""
    source = f"{subset} micro-batch(es){every}" if subset else "every micro-batch"
    parts = [f"K-FAC ({cfg.optimizer.name}{kind}): {kfac_plan_label(assignment)}; refresh every k={k} step(s){factors}, "
             f"curvature from {source} per pipe; "
             f"inverses {when}, curvature age <= {age} step(s)"
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
        method=schedule_method(cfg.pipeline.method, cfg.pipeline.chimera_stacking),
        stages=cfg.stages,
        num_micro_batches=cfg.num_micro_batches,
        micro_batch_size=cfg.micro_batch_size,
        dp_width=cfg.data_replicas,
        num_virtual=cfg.pipeline.num_virtual,
        seq_len=cfg.data.seq_len,
        max_predictions=cfg.data.max_predictions,
        layers_per_stage=tuple(encoder_layers_per_stage(cfg, cfg.stages * cfg.pipeline.num_virtual)),
        recompute=cfg.recompute,
        recompute_stages=tuple(cfg.recompute_stages) if cfg.recompute_stages else None,
        precision=cfg.precision,
        order_costs=tuple(cfg.pipeline.order_costs) if cfg.pipeline.order_costs else None,
        activation_memory=cfg.pipeline.activation_memory,
        preconditioner=cfg.optimizer.preconditioner,
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
        sdp = f" x sdp={cfg.sdp}" if cfg.sdp > 1 else ""
        sdp += f" x tp={cfg.tp}" if cfg.tp > 1 else ""
        raise ValueError(
            f"world size {world_size} does not fit stages={cfg.stages} x data_parallel="
            f"{cfg.data_parallel}{sdp} = {cfg.num_workers} workers; start {cfg.num_workers} processes"
            " (e.g. SLURM tasks) or change stages/data_parallel"
        )
