"""``schedule.py``: a profile (or an estimate) → a PipeFisher work assignment, a predicted timeline
and a summary; or, with ``whatif=true``, a ranking of configurations under a memory budget.

Why one module: it is ``schedule.py``'s program; the helpers that turn a profile, an export or a config into a
run shape and check the command line against it serve only :func:`plan_run`, :func:`run_whatif` and the entry
point.

The entry point :func:`schedule_main` (``schedule.py``, console script ``pipefisher-schedule``)
composes ``conf/schedule.yaml``; :func:`plan_run` and :func:`run_whatif` do the work and return
the summary text, so tests call them without a subprocess.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pipefisher.config import KFAC_OPTIMIZERS, ModelConfig, refuse_unknown_keys, schedule_method
from pipefisher.model.config import BertConfig
from pipefisher.planning.config import ScheduleConfig, register_schedule_configs, to_schedule_config
from pipefisher.planning.costs import Hardware, RunShape, costs_from_profile, estimate_run_costs
from pipefisher.planning.infer import ProfiledShape, infer_shape
from pipefisher.planning.predict import Comparison, StepSplit, compare_optimizers, predict_schedule, split_steps
from pipefisher.planning.staleness import load_staleness_curve
from pipefisher.planning.step_placement import global_step_costs
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.strategy_file import refusal as strategy_refusal
from pipefisher.planning.strategy_file import strategy_document, write_strategy
from pipefisher.planning.calibration import read_calibration
from pipefisher.planning.pipefisher_plan import PlanOptions
from pipefisher.planning.time_to_target import rank_by_time_to_target
from pipefisher.planning.strategy_search import Strategy, format_strategies, search_strategies, strategy_plan
from pipefisher.profiling import OVERSUBSCRIBED_NOTE, Profile, plot_timeline, read_profile
from pipefisher.run_folder import clean_up_failed_run
from pipefisher.schedules import GENERATORS
from pipefisher.schedules.kfac import assignment_to_json, curvature_age_bound
from pipefisher.schedules.passes import per_stage_steps

__all__ = ["PlanResult", "plan_run", "run_whatif", "schedule_main", "latest_profile"]

log = logging.getLogger(__name__)
register_schedule_configs()
_CONF = Path(__file__).resolve().parent.parent / "conf"

# Keys shared with train.py's config that describe the run (compared against a profile's run).
_RUN_KEYS = ("stages", "data_parallel", "micro_batch_size", "num_micro_batches", "recompute", "precision")
_GROUP_FIELDS = {
    "model": ("name", "num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size"),
    "pipeline": ("method", "num_virtual", "layers_per_stage", "chimera_stacking"),
    "data": ("seq_len", "max_predictions"),
}


@dataclass(frozen=True)
class PlanResult:
    """What :func:`plan_run` produced.

    ``measured`` / ``predicted``: with a profile, its steps and the predicted "before" (nvlamb)
    step, split under one definition (:func:`~pipefisher.planning.predict.split_steps`); None
    without one.
    """

    run: RunShape
    comparison: Comparison
    assignment_path: Path
    pictures: list[Path]
    summary: str
    measured: StepSplit | None = None
    predicted: StepSplit | None = None


def _hardware(cfg: ScheduleConfig) -> Hardware:
    return Hardware(cfg.flops_per_s, cfg.p2p_bytes_per_s, cfg.allreduce_bytes_per_s, cfg.memory_bytes_per_s)


def _bert(cfg: ScheduleConfig) -> BertConfig:
    m = cfg.model
    return BertConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_layers=m.num_layers,
                      num_heads=m.num_heads, intermediate_size=m.intermediate_size,
                      max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size)


def _method(cfg: ScheduleConfig) -> str:
    """The schedule generator the keys name (``chimera-doubling`` for chimera with doubling)."""
    return schedule_method(cfg.pipeline.method, cfg.pipeline.chimera_stacking)


def _run_from_config(cfg: ScheduleConfig) -> RunShape:
    lps = cfg.pipeline.layers_per_stage
    return RunShape(_bert(cfg), _method(cfg), cfg.stages, cfg.num_micro_batches, cfg.micro_batch_size,
                    cfg.data_parallel, cfg.pipeline.num_virtual, cfg.data.seq_len, cfg.data.max_predictions,
                    tuple(lps) if lps else None, cfg.recompute, cfg.precision,
                    preconditioner=cfg.preconditioner)


def _norm(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _conflicts(cfg: ScheduleConfig, run_cfg: Mapping[str, Any], requested: Collection[str]) -> list[str]:
    """Keys the user set that differ from the profiled run."""
    out = []
    for key in sorted(requested):
        head, _, rest = key.partition(".")
        if head in _GROUP_FIELDS:
            names = [rest] if rest in _GROUP_FIELDS[head] else ([] if rest else _GROUP_FIELDS[head])
            for name in names:
                mine, theirs = getattr(getattr(cfg, head), name), run_cfg.get(head, {}).get(name)
                if _norm(mine) != _norm(theirs):
                    out.append(f"{head}.{name}={mine!r} (the profiled run has {theirs!r})")
        elif key in _RUN_KEYS and getattr(cfg, key) != run_cfg.get(key):
            out.append(f"{key}={getattr(cfg, key)!r} (the profiled run has {run_cfg.get(key)!r})")
        elif key == "preconditioner":
            theirs = (run_cfg.get("optimizer") or {}).get("preconditioner", "kfac")
            if cfg.preconditioner != theirs:
                out.append(f"preconditioner={cfg.preconditioner!r} (the profiled run has optimizer.preconditioner="
                           f"{theirs!r})")
    return out


_SHAPE_KEYS = ("stages", "num_micro_batches", "data_parallel", "pipeline", "pipeline.method", "pipeline.num_virtual")


def _shape_conflicts(cfg: ScheduleConfig, shape: ProfiledShape, requested: Collection[str]) -> list[str]:
    """Keys the user set that contradict what the profile's actions say, each naming both."""
    out = []
    if "stages" in requested and cfg.stages != shape.stages:
        out.append(f"stages={cfg.stages} (the profile has {shape.stages}: its forwards name stages "
                   f"0-{shape.model_stages - 1} on {shape.num_workers} worker(s))")
    if "num_micro_batches" in requested and cfg.num_micro_batches != shape.num_micro_batches:
        out.append(f"num_micro_batches={cfg.num_micro_batches} (the profile has {shape.num_micro_batches}: "
                   f"micro-batches 0-{shape.num_micro_batches - 1})")
    if "data_parallel" in requested and cfg.data_parallel != shape.data_parallel:
        out.append(f"data_parallel={cfg.data_parallel} (the profile has {shape.data_parallel})")
    if shape.methods and ({"pipeline", "pipeline.method"} & set(requested)) and _method(cfg) not in shape.methods:
        out.append(f"pipeline.method={cfg.pipeline.method} (the profile's order of forwards and backwards is "
                   f"{' or '.join(shape.methods)})")
    if "pipeline.num_virtual" in requested and shape.methods and cfg.pipeline.num_virtual != shape.num_virtual:
        out.append(f"pipeline.num_virtual={cfg.pipeline.num_virtual} (the profile has {shape.num_virtual})")
    return out


def _run_from_export(cfg: ScheduleConfig, path: str, profile: Profile, requested: Collection[str],
                     notes: list[str]) -> RunShape:
    """The run of an nsys export: method, D, N and W from its actions, the model from the keys."""
    if not any(k.partition(".")[0] in (*_RUN_KEYS, *_GROUP_FIELDS) for k in requested):
        raise ValueError(f"{path}: field metadata.config is missing (an nsys export, or not written by "
                         f"profile.py); give the run's model keys (model=, micro_batch_size=, data.seq_len=; "
                         f"method, stages and micro-batches are read from the profile) or rerun profile.py")
    shape = infer_shape(profile.events)
    run = _run_from_config(cfg)
    if shape is None:
        return run
    conflicts = _shape_conflicts(cfg, shape, requested)
    if conflicts:
        raise ValueError(f"{path}: key(s) contradict the profile: {'; '.join(conflicts)}. Drop them (method, "
                         f"stages, micro-batches and width are read from the profile), profile the run you plan "
                         f"for, or, with one export per rank, pass them all (from='report_rank*.sqlite')")
    if not shape.methods:
        note = (f"the profile's order of forwards and backwards matches no {', '.join(GENERATORS)} "
                f"schedule of D={shape.stages} N={shape.num_micro_batches}: planned for the keys' "
                f"pipeline={run.method} stages={run.stages}")
        log.warning("%s: %s", path, note)
        notes.append(note)
        return run
    method = _method(cfg) if _method(cfg) in shape.methods else shape.methods[0]
    return replace(run, method=method, stages=shape.stages, num_micro_batches=shape.num_micro_batches,
                   dp_width=shape.data_parallel, num_virtual=shape.num_virtual)


def _run_from_profile(cfg: ScheduleConfig, path: Path, metadata: Mapping[str, Any],
                      requested: Collection[str]) -> RunShape:
    run_cfg = metadata.get("config")
    if not isinstance(run_cfg, Mapping):
        raise ValueError(f"{path}: field metadata.config is missing (not written by profile.py); give the "
                         f"run's keys too (model=, pipeline=, stages=, num_micro_batches=, micro_batch_size=) "
                         f"or rerun profile.py")
    for field, key in (("num_stages", "stages"), ("num_micro_batches", "num_micro_batches")):
        if field in metadata and metadata[field] != run_cfg.get(key):
            raise ValueError(f"{path}: field metadata.{field}={metadata[field]!r} disagrees with "
                             f"metadata.config.{key}={run_cfg.get(key)!r}; the file is damaged: rerun profile.py")
    if "method" in metadata and metadata["method"] != run_cfg.get("pipeline", {}).get("method"):
        raise ValueError(f"{path}: field metadata.method={metadata['method']!r} disagrees with "
                         f"metadata.config.pipeline.method; rerun profile.py")
    conflicts = _conflicts(cfg, run_cfg, requested)
    if conflicts:
        raise ValueError(f"{path}: the profile is of another run than requested: {'; '.join(conflicts)}. "
                         f"Profile the run you plan for (python profile.py with those keys) or drop "
                         f"those keys to plan the profiled run")
    try:
        return RunShape.from_train_config(run_cfg)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: field metadata.config is not a train config ({exc!r}); rerun profile.py "
                         f"with this version of pipefisher") from None


def _override_keys(overrides: Sequence[str]) -> set[str]:
    return {o.lstrip("+~").split("=", 1)[0] for o in overrides}


def _model_keys(run: RunShape, model_name: str) -> str:
    """`` model=<name>`` and the ``model.*`` keys where the planned model differs from that config
    (profile.py gives its default model a layer per stage: ``model.num_layers=8``)."""
    yaml = _CONF / "model" / f"{model_name}.yaml"
    if not yaml.is_file():
        return ""
    named = OmegaConf.to_container(OmegaConf.load(yaml), resolve=False)
    named.pop("defaults", None)
    base = {**asdict(ModelConfig()), **named}
    fields = ("num_layers", "hidden_size", "num_heads", "vocab_size")
    keys = "".join(f" model.{k}={getattr(run.bert, k)}" for k in fields if getattr(run.bert, k) != base[k])
    return f" model={model_name}{keys}"


def _pipefisher_defaults() -> dict[str, Any]:
    """What ``optimizer=pipefisher`` sets in train.py (``conf/optimizer/pipefisher.yaml``)."""
    named = OmegaConf.to_container(OmegaConf.load(_CONF / "optimizer" / "pipefisher.yaml"), resolve=False)
    named.pop("defaults", None)
    return named


def _staleness_keys(cfg: ScheduleConfig) -> str:
    """`` optimizer.promote_inverses=… optimizer.max_staleness=…`` where this plan's rule or bound
    differs from what ``optimizer=pipefisher`` runs with (train.py must apply the curvature as planned)."""
    defaults = _pipefisher_defaults()
    keys = ""
    if cfg.promote_inverses != defaults.get("promote_inverses"):
        keys += f" optimizer.promote_inverses={cfg.promote_inverses}"
    if cfg.max_staleness != defaults.get("max_staleness"):
        keys += f" optimizer.max_staleness={'null' if cfg.max_staleness is None else cfg.max_staleness}"
    return keys


def _age_line(a: Any, cfg: ScheduleConfig) -> str:
    """``curvature age <= n steps (…)``: the bound train.py states for this plan at its start
    (``runtime.build.describe_kfac``): the plan's own, under the rule the run applies."""
    bound = f" and max_staleness={cfg.max_staleness}" if cfg.max_staleness is not None else ""
    return (f"curvature age <= {curvature_age_bound(a, cfg.promote_inverses)} steps with "
            f"promote_inverses={cfg.promote_inverses}{bound}")


def _train_keys(run: RunShape, path: Path, model_name: str = "", staleness: str = "") -> str:
    v = f" pipeline.num_virtual={run.num_virtual}" if run.method == "interleaved" else ""
    pipeline = "chimera pipeline.chimera_stacking=doubling" if run.method == "chimera-doubling" else run.method
    return (f"python train.py optimizer=pipefisher optimizer.schedule={path}{_model_keys(run, model_name)} "
            f"pipeline={pipeline}{v} "
            f"stages={run.stages} num_micro_batches={run.num_micro_batches} "
            f"micro_batch_size={run.micro_batch_size} data_parallel={run.dp_width}"
            + (f" optimizer.curvature_micro_batches={n}" if (n := _subset(path)) else "") + staleness)


def _subset(path: Path) -> int:
    return int(json.loads(Path(path).read_text()).get("curvature_micro_batches", 0))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.2f} ms"


# The parts of a step (StepSplit fields): how the summary names each, and why a measured step can
# spend more in it than the predicted one.
_PARTS = {
    "busy": ("busy", "actions took longer than their mean cost, or the run did work the prediction has not"),
    "allreduce": ("all-reduces", "the cost model charges an all-reduce what starting it took (sync_ns), "
                                 "not the wait for it"),
    "message": ("messages", "the cost model charges a message its median latency (p2p_ns)"),
    "untracked": ("in no action", "the executor's own time between actions is in no cost"),
}


def _measured_lines(profile: Profile, measured: StepSplit, predicted: StepSplit) -> list[str]:
    """Two lines: the profile's utilization beside the predicted "before", and where they differ."""
    optimizer = profile.metadata.get("config", {}).get("optimizer", {}).get("name", "nvlamb")
    kfac = f"; the profiled run (optimizer={optimizer}) did K-FAC work, counted busy" if optimizer in KFAC_OPTIMIZERS else ""
    pairs = {part: (getattr(measured, f"{part}_ns"), getattr(predicted, f"{part}_ns")) for part in _PARTS}
    split = ", ".join(f"{_PARTS[part][0]} {m / 1e6:.1f} vs {p / 1e6:.1f}" for part, (m, p) in pairs.items())
    worst = max(pairs, key=lambda part: pairs[part][0] - pairs[part][1])
    why = ("" if abs(measured.utilization - predicted.utilization) < 0.005
           else f"; the gap is mostly {_PARTS[worst][0]}: {_PARTS[worst][1]}")
    return [
        f"measured in the profile: {measured.utilization:.1%} over {measured.num_steps} step(s) vs "
        f"{predicted.utilization:.1%} predicted before, under one definition (busy: F, B, K-FAC units, STEP; "
        f"a step: its first start to its last STEP){kfac}",
        f"  per worker and step, measured vs predicted ms: {split}; "
        f"{measured.between_ns / 1e6:.1f} ms between steps (in neither figure){why}",
    ]


def plan_run(cfg: ScheduleConfig, out_dir: str | Path, requested: Collection[str] = ()) -> PlanResult:
    """Plan PipeFisher for the configured run; write assignment.json and timeline.pdf/png.

    Args:
        cfg: the schedule config; with ``from_`` the run and its costs come from that profile.
        out_dir: where to write.
        requested: config keys the user set (checked against a profile's run).

    Returns:
        The run, the comparison, the paths written and the summary text.

    Raises:
        ValueError: a profile that does not fit the requested run, or a bad config; the message
            names the file/field and the fix.
    """
    out_dir = Path(out_dir)
    notes = []
    model_name = cfg.model.name
    profile: Profile | None = None
    if cfg.from_:
        path = Path(cfg.from_)
        profile = read_profile(cfg.from_, gpu=cfg.gpu, warmup_steps=cfg.warmup_steps, names=cfg.ranges)
        notes += profile.notes
        if profile.source != "nsys" and cfg.ranges.name != "ours":
            notes.append(f"ranges={cfg.ranges.name} has no effect: {cfg.from_} was written by profile.py, whose "
                         f"events carry their actions")
            log.warning("%s", notes[-1])
        if profile.source == "nsys":
            seen = {e.worker for e in profile.events}
            missing = sorted(set(range(max(seen) + 1)) - seen)
            if not missing:
                run = _run_from_export(cfg, cfg.from_, profile, requested, notes)
                missing = sorted(set(range(run.num_workers)) - seen)
            if missing:
                raise ValueError(f"{cfg.from_}: no events of worker(s) {missing} (the profile has worker(s) {sorted(seen)}) "
                                 f"(stages × data_parallel); with one export per rank, pass every rank's: "
                                 f"from='report_rank*.sqlite' or from='a.sqlite,b.sqlite'")
        else:
            run = _run_from_profile(cfg, path, profile.metadata, requested)
        workers = {e.worker for e in profile.events}
        if workers and max(workers) >= run.num_workers:
            raise ValueError(f"{path}: events of worker {max(workers)} but the run has {run.num_workers} workers "
                             f"(stages × data_parallel); profile that run or pass its stages=/data_parallel=")
        cost = costs_from_profile(profile, run, path=path)
        model_name = profile.metadata.get("config", {}).get("model", {}).get("name", "the profiled model")
        timing = "kernel time of CUDA kernels" if profile.gpu else "CPU ranges"
        source = (f"measured in {cfg.from_} ({len(profile.events)} events, {timing}; K-FAC units measured or "
                  f"estimated at the measured FLOP rate)")
        if profile.metadata.get("oversubscribed"):
            notes.append(OVERSUBSCRIBED_NOTE)
        if str(profile.metadata.get("device", "")).startswith("cpu"):
            notes.append("costs measured on CPU: the prediction is for devices that run each action as fast "
                         "as these CPU workers did, with workers <= cores (DESIGN.md, Conventions)")
    else:
        run = _run_from_config(cfg)
        cost = estimate_run_costs(run, _hardware(cfg))
        source = (f"estimated from FLOPs (flops_per_s={cfg.flops_per_s:g}, p2p_bytes_per_s={cfg.p2p_bytes_per_s:g}, "
                  f"allreduce_bytes_per_s={cfg.allreduce_bytes_per_s or cfg.p2p_bytes_per_s:g})")
    schedule = run.build_schedule()
    ran, measured_cost = schedule, cost  # what the profiled run ran and cost, for measured against predicted
    if profile is not None and any(cost.stage_step_ns):
        # A run with optimizer_placement=per_stage: the plan is made on the global step's schedule (train.py makes
        # each phase per-stage itself), whose STEPs must carry the stage STEPs' work, or the plan drops it.
        ran, cost = per_stage_steps(schedule), global_step_costs(cost, schedule)
        notes.append(f"the profiled run stepped each stage apart (optimizer_placement=per_stage, stage STEPs "
                     f"{', '.join(f'{x / 1e6:.2f}' for x in measured_cost.stage_step_ns)} ms): the plan and the "
                     f"predicted step times price them in each worker's STEP, as the global step runs them")
    comparison = compare_optimizers(schedule, cost, run.kfac_layers, max_interval=cfg.max_interval,
                                    kfac_interval=cfg.kfac_interval, max_staleness=cfg.max_staleness,
                                    curvature_micro_batches=cfg.curvature_micro_batches,
                                    curvature_placement=cfg.curvature_placement, promote=cfg.promote_inverses,
                                    staleness=load_staleness_curve(cfg.staleness_curve) if cfg.staleness_curve else None)
    a = comparison.assignment
    meta = dict(a.metadata)
    meta.update(source=source, model_name=model_name, model=asdict(run.bert), micro_batch_size=run.micro_batch_size,
                seq_len=run.seq_len, max_predictions=run.max_predictions, costs=asdict(cost))
    a = replace(a, metadata=meta)
    path = assignment_to_json(a, out_dir / "assignment.json")
    title = (f"PipeFisher plan: {run.method} D={run.stages} N={run.num_micro_batches} W={run.dp_width}, "
             f"k={a.interval} (predicted)")
    pictures = plot_timeline(comparison.events, out_dir / "timeline", title=title,
                             num_workers=schedule.num_workers) if cfg.plot else []
    c = comparison
    k = c.pipefisher.interval
    measured = predicted = None
    if profile is not None and profile.events:
        measured = split_steps(profile.events, run.num_workers)
        predicted = split_steps(predict_schedule(ran, measured_cost)[1], schedule.num_workers)
    lines = [
        f"PipeFisher plan for {model_name} "
        f"(L={run.bert.num_layers}, H={run.bert.hidden_size}): {run.method} D={run.stages} "
        f"N={run.num_micro_batches} W={run.dp_width}, micro-batch {run.micro_batch_size} × {run.seq_len} tokens",
        f"costs: {source}",
        f"bubble utilization: {c.nvlamb.utilization:.1%} before (nvlamb) -> {c.pipefisher.utilization:.1%} "
        f"after (pipefisher, k={k}), predicted",
        *(_measured_lines(profile, measured, predicted) if measured is not None else []),
        "predicted step time:",
        f"  {'nvlamb':<44}{_ms(c.nvlamb.step_time_s)}",
        f"  {f'kfac (critical path), refresh every {c.kfac.interval} step(s)':<44}{_ms(c.kfac.step_time_s)}",
        f"  {f'kfac (critical path), refresh every {k} step(s)':<44}{_ms(c.kfac_same_interval.step_time_s)}",
        f"  {f'pipefisher, refresh every k={k} step(s)':<44}{_ms(c.pipefisher.step_time_s)}",
        f"refresh interval {a.metadata['choice']}; lower bound k_min = K-FAC work / bubble time = "
        f"{a.metadata['kfac_work_ns'] / 1e6:.2f} ms / {a.metadata['bubble_ns'] / 1e6:.2f} ms -> {a.metadata['k_min']} "
        f"(max_interval={cfg.max_interval}, {_age_line(a, cfg)}); per refresh {a.metadata['spilled_ns'] / 1e6:.2f} ms spilled before STEP, "
        f"{a.metadata['tail_ns'] / 1e6:.2f} ms no k would hide (after the last backward, or a layer's curvature "
        f"larger than one step's bubbles)"
        + (f"; fallback to critical-path K-FAC: {a.metadata.get('fallback_reason')}"
           if a.metadata.get("fallback") else ""),
        f"wrote {', '.join(p.name for p in [path, *pictures])}, summary.txt in {out_dir}",
        f"use it: {_train_keys(run, path, model_name, _staleness_keys(cfg))}",
    ] + [f"note: {n}" for n in notes]
    summary = "\n".join(lines)
    (out_dir / "summary.txt").write_text(summary + "\n")
    log.debug("%s", summary)
    return PlanResult(run, comparison, path, pictures, summary, measured, predicted)


def run_whatif(cfg: ScheduleConfig, out_dir: str | Path) -> str:
    """Rank hybrid strategies (``whatif=true``: pipeline × dp × sdp × tp, ``planning.strategy_search``);
    writes whatif.json (every row) and strategy.json (the best one train.py accepts, for
    ``python train.py strategy=<file>``); returns the text to print."""
    out_dir = Path(out_dir)
    s = cfg.search
    hardware = _hardware(cfg)
    comm = CommCosts.from_json(cfg.comm_costs, hardware) if cfg.comm_costs else None

    def refused(candidate: Strategy) -> str | None:
        return strategy_refusal(candidate, cfg.model, cfg.data, cfg.precision)

    calibration = read_calibration(cfg.calibration) if cfg.calibration else None

    found = search_strategies(_bert(cfg), devices=cfg.devices, memory_gb=cfg.memory_gb, global_batch=cfg.global_batch,
                              hardware=hardware, comm=comm, methods=s.methods, micro_batch_sizes=s.micro_batch_sizes,
                              optimizers=s.optimizers, recompute=s.recompute, sdp_degrees=s.sdp, tp_degrees=s.tp,
                              num_virtual=s.num_virtual, seq_len=cfg.data.seq_len,
                              max_predictions=cfg.data.max_predictions, precision=cfg.precision,
                              plan_options=PlanOptions.from_optimizer(cfg), split_backward_ratio=s.split_backward_ratio,
                              refusal=refused, calibration=calibration, target_loss=cfg.target_loss,
                              device=cfg.memory_device, kfac_owners=s.kfac_owners)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "whatif.json").write_text(json.dumps([asdict(c) for c in found], indent=1) + "\n")
    costs = (comm or CommCosts({}, hardware)).describe()
    header = (f"what-if: {cfg.model.name} on {cfg.devices} devices × {cfg.memory_gb:g} GB, global batch "
              f"{cfg.global_batch}, {cfg.data.seq_len} tokens; predicted by simulation from FLOP estimates "
              f"(flops_per_s={cfg.flops_per_s:g} unless measured below); {costs}; memory: {cfg.memory_device}'s peak "
              f"(planning.memory), without the interpreter and torch")
    _, notes = rank_by_time_to_target([c for c in found if c.excluded is None], calibration, cfg.target_loss,
                                      model=cfg.model, global_batch=cfg.global_batch, promote=cfg.promote_inverses)
    text = header + "\n" + format_strategies(found, cfg.search.top, notes)
    best = next((c for c in found if c.excluded is None), None)
    if best is not None:
        plan = None
        if best.optimizer == "pipefisher":  # the plan train.py will run: every data-parallel group's
            plan = strategy_plan(best, _bert(cfg), hardware=hardware, comm=comm, seq_len=cfg.data.seq_len,
                                 max_predictions=cfg.data.max_predictions, precision=cfg.precision,
                                 plan_options=PlanOptions.from_optimizer(cfg),
                                 split_backward_ratio=s.split_backward_ratio, dp_width=None)
            if plan.k != best.interval:
                log.warning("PipeFisher's plan of %s over all %d data-parallel groups refreshes every %d steps, the "
                            "one group the search simulated every %d; the file carries the former", best.label,
                            best.dp * best.sdp, plan.k, best.interval)
        doc = strategy_document(best, cfg.model, cfg.data, cfg.precision, search={
            "devices": cfg.devices, "memory_gb": cfg.memory_gb, "comm_costs": cfg.comm_costs,
            "flops_per_s": (comm.hardware_for(best.micro_batch_size) if comm else hardware).flops_per_s}, plan=plan)
        path = write_strategy(out_dir / "strategy.json", doc)
        text += f"\nwrote whatif.json and strategy.json in {out_dir}; run the best: python train.py strategy={path}"
    else:
        text += f"\nwrote whatif.json in {out_dir} (no strategy.json: nothing fits)"
    log.debug("%s", text)
    return text


def _run_roots() -> list[str]:
    """The folders profile.py's runs go below: the first part of its ``hydra.run.dir`` and
    ``hydra.sweep.dir`` (``conf/profile.yaml``, else train.py's ``conf/config.yaml``)."""
    roots = []
    for key in ("run", "sweep"):
        for name in ("profile.yaml", "config.yaml"):
            raw = OmegaConf.to_container(OmegaConf.load(_CONF / name), resolve=False)
            node = raw.get("hydra", {}).get(key, {}).get("dir")
            if node is not None:
                first = Path(str(node)).parts[0]
                if "$" not in first and first not in roots:
                    roots.append(first)
                break
    return roots


def latest_profile(name: str, where: str | Path = ".") -> Path | None:
    """The newest file called ``name`` (by modification time) below the run folders of ``where``
    (``outputs/**/`` and ``multirun/**/`` with the shipped config), or None."""
    found = [p for root in _run_roots() for p in (Path(where) / root).glob(f"**/{name}") if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _resolve_from(args: list[str]) -> list[str]:
    """``from=<bare name>`` that is no file here means the latest profile run's file of that name
    (issue 16, item 1: ``python profile.py …`` then ``python schedule.py from=profile.sqlite``).

    Resolved before Hydra starts, so that the run's ``.hydra/overrides.yaml`` holds the file taken
    and a missing one leaves no output folder behind.

    Raises:
        SystemExit: there is no such file below the run folders either; the message names where
            it looked and how to make one.
    """
    out = list(args)
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if (key != "from" or not value or os.path.dirname(value) or Path(value).exists() or "," in value
                or any(c in value for c in "*?")):  # a list or glob of per-rank exports
            continue
        path = latest_profile(value)
        if path is None:
            looked = " and ".join(f"{root}/**/{value}" for root in _run_roots())
            raise SystemExit(f"schedule.py: from={value}: no such file in {Path.cwd()}, nor below it in {looked} "
                             f"(where profile.py writes); profile a run first, e.g. `python profile.py "
                             f"pipeline=chimera stages=8`, or give the profile's path")
        print(f"schedule.py: from={value}: using the latest profile run's file, {path} "
              f"(no {value} in the working directory)", flush=True)
        out[i] = f"from={path}"
    return out


def schedule_main() -> None:
    """``schedule.py``: refuse unknown keys naming the closest one (Hydra would suggest ``+key``),
    take ``from=profile.sqlite`` from the latest profile run, then compose, validate, plan (or
    rank) and print the summary; bad input exits with the message."""
    refuse_unknown_keys(sys.argv[1:], "schedule.py", ScheduleConfig, rename={"from_": "from"})
    sys.argv[1:] = _resolve_from(sys.argv[1:])
    _schedule()


@hydra.main(config_path="../conf", config_name="schedule", version_base="1.3")
def _schedule(dcfg: DictConfig) -> None:
    hc = HydraConfig.get()
    try:
        cfg = to_schedule_config(dcfg)
        if cfg.whatif:
            text = run_whatif(cfg, hc.runtime.output_dir)
        else:
            text = plan_run(cfg, hc.runtime.output_dir, _override_keys(hc.overrides.task)).summary
    except ValueError as exc:  # ConfigError, ProfileError, ScheduleError are ValueErrors
        clean_up_failed_run(str(exc))  # a refused command leaves no folder behind
        raise SystemExit(f"schedule.py: {exc}") from None
    print(text)
