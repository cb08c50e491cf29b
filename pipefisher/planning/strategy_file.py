"""The strategy file: what the search chose, written as JSON that ``python train.py strategy=<file>`` runs.

Entry points: :func:`strategy_document` / :func:`write_strategy` (the search's best), :func:`read_strategy`
(checked, one ``ConfigError`` naming the field), :func:`strategy_overrides` (the train keys it sets),
:func:`apply_strategy` (into a composed config, before validation), :func:`refusal` (whether train.py's
checks accept a candidate), :func:`report_strategy_run` (the prediction beside what a run measured).

[Note: the strategy file] (Galvatron's JSON config mode, in this project's words)::

    format                 "pipefisher-strategy/1"
    pp_deg, dp_deg,        pipeline stages, data-parallel copies, sharded data parallel (FSDP2), tensor
    sdp_deg, tp_deg        parallel; their product is the world size
    pipeline               {"method", "num_virtual", "chimera_stacking"}
    global_bsz, micro_batch_size, chunks     global batch = micro_batch_size x chunks x dp_deg x sdp_deg
    checkpoint             activation recomputation in every stage (train.py's recompute)
    optimizer, precision   train.py's optimizer name and precision
    model, data            the model (name, num_layers, hidden_size, num_heads, intermediate_size,
                           vocab_size) and the sequence shape (seq_len, max_predictions) it was chosen for
    per_stage              one {"dp_type": "dp" | "sdp", "tp": t, "checkpoint": bool} per model stage
                           (Galvatron's dp_types_enc / tp_sizes_enc / checkpoint per layer); train.py runs
                           one dp_type and tp for every stage, so those must agree with each other and
                           with the degrees; checkpoint may differ (train.py's recompute_stages, issue 27),
                           and is true in every stage where the top-level checkpoint is
    predicted              {"step_time_s", "samples_per_s", "peak_memory_bytes",
                           "peak_memory_per_worker_bytes", "memory_model"} (what the search predicted;
                           with a calibration also "steps_multiplier", "time_to_target_s")
    pipefisher             optimizer pipefisher only: {"k", "curvature_age_bound", "ages" (per model stage),
                           "options" (the planner's keys, train.py's optimizer.* names), "describe",
                           "assignment" (the plan, schedules.kfac's assignment JSON, for every data-parallel
                           group)}: train.py runs this plan (optimizer.schedule=<this file>) with these options
    search                 how it was found (devices, budget, cost sources), for the record

``train.py strategy=<file>`` sets the keys the file implies (:func:`strategy_overrides`; for PipeFisher its
planner options and ``optimizer.schedule`` = the file, so the searched plan runs as written and is logged) before
the config is validated; a key also given on the command line with another value is refused in one line
naming both, as is a key of the groups the file decides (``pipeline.*``, ``model.*``) that the file does
not set (e.g. ``pipeline.layers_per_stage``: it changes the stages the search priced), and a file train.py
cannot run (a per-stage choice that differs, tp without a ``tp``
key, a damaged field). After the run, :func:`report_strategy_run` logs the predicted step time and
peak memory beside the measured ones and writes ``strategy_report.json`` in the run folder.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Collection, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipefisher.atomic import write_text_atomic
from pipefisher.config import (PIPELINE_METHODS, ConfigError, schedule_method, DataConfig, ModelConfig, OptimizerConfig, PipelineConfig,
                               TrainConfig)
from pipefisher.planning.pipefisher_plan import PipeFisherPlan, PlanOptions
from pipefisher.planning.strategy_search import Strategy, model_stages, tp_available
from pipefisher.schedules.kfac import assignment_from_dict, assignment_to_dict, curvature_age_bound

__all__ = ["STRATEGY_FORMAT", "apply_strategy", "read_strategy", "refusal", "report_strategy_run",
           "strategy_document", "strategy_overrides", "write_strategy"]

log = logging.getLogger(__name__)

STRATEGY_FORMAT = "pipefisher-strategy/1"
REPORT_FILE = "strategy_report.json"
_MODEL_KEYS = ("name", "num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size")
_DECIDED_GROUPS = ("pipeline", "model")  # config groups whose every key changes what a strategy runs


def _pipeline_keys(method: str) -> dict[str, Any]:
    if method == "chimera-doubling":
        return {"method": "chimera", "chimera_stacking": "doubling"}
    return {"method": method, "chimera_stacking": "direct"}


def strategy_document(s: Strategy, model: ModelConfig, data: DataConfig, precision: str = "fp32",
                      search: Mapping[str, Any] | None = None, plan: PipeFisherPlan | None = None) -> dict[str, Any]:
    """The JSON document of a ranked strategy ([Note: the strategy file]).

    ``plan``: PipeFisher's plan of ``s`` for every data-parallel group (``strategy_search.strategy_plan`` with
    ``dp_width=None``); required for optimizer pipefisher, refused for the others.
    """
    if s.excluded is not None or s.step_time_s is None:
        raise ValueError(f"{s.label}: an excluded strategy ({s.excluded}) is no strategy to run")
    if (plan is None) != (s.optimizer != "pipefisher"):
        raise ValueError(f"{s.label}: a strategy file carries PipeFisher's plan for optimizer pipefisher, and only "
                         f"there (plan given: {plan is not None})")
    pipeline = {**_pipeline_keys(s.method), "num_virtual": s.num_virtual}
    per_worker = [round(gb * 1e9) for gb in s.memory_per_worker_gb]
    return {
        "format": STRATEGY_FORMAT,
        "pp_deg": s.stages, "dp_deg": s.dp, "sdp_deg": s.sdp, "tp_deg": s.tp,
        "pipeline": pipeline,
        "global_bsz": s.global_batch, "micro_batch_size": s.micro_batch_size, "chunks": s.num_micro_batches,
        "checkpoint": all(s.recompute_flags),
        "optimizer": s.optimizer,
        "precision": precision,
        "model": {k: getattr(model, k) for k in _MODEL_KEYS},
        "data": {"seq_len": data.seq_len, "max_predictions": data.max_predictions},
        "per_stage": _per_stage(s),
        "predicted": {"step_time_s": s.step_time_s, "samples_per_s": s.samples_per_s,
                      "peak_memory_bytes": max(per_worker), "peak_memory_per_worker_bytes": per_worker,
                      "memory_model": "planning.strategy_search [Note: the memory model]: model state, "
                                      "activations, sync buffers and the search's memory_device terms",
                      **({"steps_multiplier": s.steps_multiplier, "time_to_target_s": s.time_to_target_s}
                         if s.steps_multiplier is not None else {})},
        **({"pipefisher": {"k": plan.k, "curvature_age_bound": plan.age_bound, "ages": list(plan.ages),
                           "options": plan.options.to_dict(), "describe": plan.describe(),
                           "assignment": assignment_to_dict(plan.assignment)}} if plan is not None else {}),
        "search": dict(search or {}),
    }


def _per_stage(s: Strategy) -> list[dict[str, Any]]:
    """One {dp_type, tp, checkpoint} per model stage of ``s`` (checkpoint: that stage recomputes)."""
    return [{"dp_type": "sdp" if s.sdp > 1 else "dp", "tp": s.tp, "checkpoint": rc} for rc in s.recompute_flags]


def write_strategy(path: str | Path, doc: Mapping[str, Any]) -> Path:
    """Write ``doc`` (atomically); returns the path."""
    return write_text_atomic(Path(path), json.dumps(doc, indent=1) + "\n")


def _field(path: str, name: str, why: str) -> ConfigError:
    return ConfigError(f"strategy={path}: field {name} {why}; write the file with `python schedule.py whatif=true "
                       f"...` (it writes strategy.json) or fix that field")


def _int(doc: Mapping[str, Any], name: str, path: str, minimum: int = 1) -> int:
    value = doc.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _field(path, name, f"is {value!r}, not an integer >= {minimum}")
    return value


def read_strategy(path: str | Path) -> dict[str, Any]:
    """Read and check a strategy file ([Note: the strategy file]).

    Raises:
        ConfigError: unreadable, not JSON, a missing or bad field, per-stage choices that differ or
            disagree with the degrees, ``tp_deg`` > 1 where train.py has no ``tp``; one line naming
            the field and the fix.
    """
    p = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"strategy={p}: cannot be read ({exc.strerror}); give the strategy.json that "
                          f"`python schedule.py whatif=true ...` wrote") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"strategy={p}: not JSON ({exc.msg}, line {exc.lineno}); give the strategy.json "
                          f"that `python schedule.py whatif=true ...` wrote") from None
    if not isinstance(doc, dict) or doc.get("format") != STRATEGY_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _field(p, "format", f"is {got!r}, not {STRATEGY_FORMAT!r}")
    for name in ("pp_deg", "dp_deg", "sdp_deg", "tp_deg", "global_bsz", "micro_batch_size", "chunks"):
        _int(doc, name, p)
    if doc["micro_batch_size"] * doc["chunks"] * doc["dp_deg"] * doc["sdp_deg"] != doc["global_bsz"]:
        raise _field(p, "global_bsz", f"is {doc['global_bsz']}, but micro_batch_size x chunks x dp_deg x sdp_deg = "
                     f"{doc['micro_batch_size'] * doc['chunks'] * doc['dp_deg'] * doc['sdp_deg']}")
    if not isinstance(doc.get("checkpoint"), bool):
        raise _field(p, "checkpoint", f"is {doc.get('checkpoint')!r}, not true or false")
    pipeline = doc.get("pipeline")
    if not isinstance(pipeline, dict) or pipeline.get("method") not in PIPELINE_METHODS or pipeline["method"] == "csv":
        raise _field(p, "pipeline.method", f"is {pipeline.get('method') if isinstance(pipeline, dict) else pipeline!r}; "
                     f"choose one of {', '.join(m for m in PIPELINE_METHODS if m != 'csv')}")
    _int(pipeline, "num_virtual", p)
    if not isinstance(doc.get("optimizer"), str):
        raise _field(p, "optimizer", f"is {doc.get('optimizer')!r}, not an optimizer name")
    for group, keys in (("model", ("num_layers", "hidden_size", "num_heads", "vocab_size")),
                        ("data", ("seq_len", "max_predictions"))):
        if not isinstance(doc.get(group), dict):
            raise _field(p, group, "is missing")
        for k in keys:
            value = doc[group].get(k)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _field(p, f"{group}.{k}", f"is {value!r}, not an integer")
    _check_per_stage(doc, p)
    _check_pipefisher(doc, p)
    if doc["tp_deg"] > 1 and not tp_available():
        raise _field(p, "tp_deg", f"is {doc['tp_deg']}, but this version's train.py has no tensor parallel (tp); "
                     f"search again without it (search.tp=[1])")
    return doc


def _check_pipefisher(doc: Mapping[str, Any], p: str) -> None:
    """Optimizer pipefisher carries its plan: a checked assignment for the file's pipeline, options the planner
    takes, and k and the age bound that plan has under them."""
    block = doc.get("pipefisher")
    if doc["optimizer"] != "pipefisher":
        if block is not None:
            raise _field(p, "pipefisher", f"is set, but optimizer is {doc['optimizer']!r}; drop it or set optimizer "
                         f"pipefisher")
        return
    if not isinstance(block, dict):
        raise _field(p, "pipefisher", "is missing: optimizer pipefisher needs its plan (k, options, assignment)")
    try:
        options = PlanOptions.from_dict(block.get("options") or {})
    except (TypeError, ValueError) as exc:
        raise _field(p, "pipefisher.options", f"is {block.get('options')!r} ({exc})") from None
    try:
        a = assignment_from_dict(block.get("assignment"), source=f"{p}: pipefisher.assignment")
    except (TypeError, ValueError, AttributeError) as exc:
        raise _field(p, "pipefisher.assignment", f"is not a plan ({str(exc).splitlines()[0][:200]})") from None
    if block.get("k") != a.interval:
        raise _field(p, "pipefisher.k", f"is {block.get('k')!r}, but the plan refreshes every {a.interval} steps")
    age = curvature_age_bound(a, options.promote_inverses)
    if block.get("curvature_age_bound") != age:
        raise _field(p, "pipefisher.curvature_age_bound", f"is {block.get('curvature_age_bound')!r}, but the plan "
                     f"under promote_inverses={options.promote_inverses} has {age}")
    base = a.phases[0]
    want = (schedule_method(doc["pipeline"]["method"], doc["pipeline"].get("chimera_stacking", "direct")),
            doc["chunks"], doc["dp_deg"] * doc["sdp_deg"])
    got = (base.method, base.num_micro_batches, base.dp_width)
    if got != want:
        raise _field(p, "pipefisher.assignment", f"is planned for (method, chunks, data-parallel) = {got}, but the "
                     f"file's pipeline is {want}; search again to rewrite the file")


def _num_model_stages(doc: Mapping[str, Any]) -> int:
    return model_stages(doc["pipeline"]["method"], doc["pp_deg"], doc["pipeline"]["num_virtual"])


def _check_per_stage(doc: Mapping[str, Any], p: str) -> None:
    """Per-stage dp_type and tp must be uniform and match the degrees (train.py runs one of each);
    per-stage checkpoint flags are booleans, one per model stage, all true where ``checkpoint`` is."""
    per_stage = doc.get("per_stage")
    if per_stage is None:
        return
    if not isinstance(per_stage, list) or not all(isinstance(x, dict) for x in per_stage) or not per_stage:
        raise _field(p, "per_stage", "is not a list of {dp_type, tp, checkpoint} objects")
    if len(per_stage) != _num_model_stages(doc):
        raise _field(p, "per_stage", f"has {len(per_stage)} entries for {_num_model_stages(doc)} model stages "
                     f"(pp_deg x the pipeline's virtual stages); give one per model stage")
    for i, stage in enumerate(per_stage):
        flag = stage.get("checkpoint", doc["checkpoint"])
        if not isinstance(flag, bool) or (doc["checkpoint"] and not flag):
            raise _field(p, f"per_stage[{i}].checkpoint", f"is {flag!r}, but checkpoint={doc['checkpoint']!r}; give "
                         f"true or false, and true in every stage where checkpoint is true")
    want = {"dp_type": "sdp" if doc["sdp_deg"] > 1 else "dp", "tp": doc["tp_deg"]}
    for i, stage in enumerate(per_stage):
        for key, value in want.items():
            if stage.get(key, value) != value:
                raise _field(p, f"per_stage[{i}].{key}", f"is {stage.get(key)!r}, but train.py runs one choice for "
                             f"every stage ({key}={value!r} from the file's degrees); per-stage {key} is not built: "
                             f"make every stage's {key} {value!r}")


def _recompute_keys(doc: Mapping[str, Any]) -> tuple[bool, list[int] | None]:
    """train.py's (recompute, recompute_stages) from the file's checkpoint flags: every stage, or some."""
    flags = [stage.get("checkpoint", doc["checkpoint"]) for stage in doc.get("per_stage") or ()]
    if doc["checkpoint"] or not any(flags):
        return bool(doc["checkpoint"]), None
    if all(flags):
        return True, None
    return False, [i for i, flag in enumerate(flags) if flag]


def strategy_overrides(doc: Mapping[str, Any], path: str | Path | None = None) -> dict[str, Any]:
    """The train.py keys (dotted) a checked strategy file sets, and their values; for PipeFisher its planner
    options and, with ``path`` (the file), ``optimizer.schedule``: the file's plan."""
    recompute, recompute_stages = _recompute_keys(doc)
    out: dict[str, Any] = {
        "stages": doc["pp_deg"], "data_parallel": doc["dp_deg"], "sdp": doc["sdp_deg"],
        "global_batch_size": doc["global_bsz"], "micro_batch_size": doc["micro_batch_size"],
        "num_micro_batches": doc["chunks"], "recompute": recompute, "recompute_stages": recompute_stages,
        "optimizer.name": doc["optimizer"],
        "pipeline.method": doc["pipeline"]["method"], "pipeline.num_virtual": doc["pipeline"]["num_virtual"],
        "pipeline.chimera_stacking": doc["pipeline"].get("chimera_stacking", "direct"),
    }
    if doc.get("precision"):
        out["precision"] = doc["precision"]
    if doc["optimizer"] == "pipefisher" and doc.get("pipefisher"):
        out.update(PlanOptions.from_dict(doc["pipefisher"]["options"]).overrides())
        if path is not None:
            out["optimizer.schedule"] = str(path)
    if doc["sdp_deg"] > 1:
        out["sdp_reshard_after_forward"] = False  # what the search modelled
    if tp_available():
        out["tp"] = doc["tp_deg"]
    for k in _MODEL_KEYS:
        if k in doc["model"]:
            out[f"model.{k}"] = doc["model"][k]
    for k in ("seq_len", "max_predictions"):
        out[f"data.{k}"] = doc["data"][k]
    return out


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, Mapping) or hasattr(cfg, "__getitem__") else getattr(cfg, part)
    return cfg


def apply_strategy(dcfg: Any, explicit: Collection[str], path: str | None = None) -> dict[str, Any]:
    """Set the strategy's keys in a composed config (a DictConfig), before validation.

    Args:
        dcfg: the composed config (``strategy`` names the file unless ``path`` does).
        explicit: the command line's overrides (``key=value``); a key the file sets, or its group
            (``model=``, ``pipeline=``), given there with another value is refused.
        path: the file; default ``dcfg.strategy``.

    Returns:
        The checked document.

    Raises:
        ConfigError: the file is bad (:func:`read_strategy`), disagrees with the command line (one
            line naming every disagreeing key beside the file's value), or the command line sets a key
            of ``pipeline.*`` / ``model.*`` the file does not (one line naming them and what is allowed).
    """
    path = path or dcfg.strategy
    doc = read_strategy(path)
    keys = {o.lstrip("+~").split("=", 1)[0] for o in explicit}
    sets = strategy_overrides(doc, path)
    unset = sorted(k for k in keys if k.split(".", 1)[0] in _DECIDED_GROUPS and "." in k and k not in sets)
    if unset:
        decided = " and ".join(f"{g}.*" for g in _DECIDED_GROUPS)
        raise ConfigError(f"strategy={path}: {', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set by the "
                          f"file but change{'s' if len(unset) == 1 else ''} what runs (the search priced the file's "
                          f"own {decided}); drop {'it' if len(unset) == 1 else 'them'}, or search again with "
                          f"{'it' if len(unset) == 1 else 'them'}. Beside strategy= the command line may set the "
                          f"file's own keys to the file's values ({', '.join(k for k in sets if '.' in k and k.split('.', 1)[0] in _DECIDED_GROUPS)}) "
                          f"and keys outside {decided} (e.g. steps, lr, seed, data.path)")
    conflicts = []
    for key, value in sets.items():
        group = key.split(".", 1)[0]
        if key in keys or (group != key and group in keys and key != "optimizer.schedule"):
            mine = _get(dcfg, key)
            if mine != value:
                conflicts.append(f"{key}={mine} (the file has {value!r})")
    if conflicts:
        raise ConfigError(f"strategy={path}: the command line disagrees with the file: {'; '.join(conflicts)}; drop "
                          f"those keys to run the strategy as it is, or search again with them")
    for key, value in sets.items():
        node = dcfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    if doc["optimizer"] == "pipefisher":
        log.info("strategy %s: PipeFisher runs the searched plan, %s", path, doc["pipefisher"]["describe"])
    return doc


def refusal(s: Strategy, model: ModelConfig, data: DataConfig, precision: str = "fp32") -> str | None:
    """Why train.py's config checks refuse strategy ``s`` (their one-line message), or None."""
    doc = {"pp_deg": s.stages, "dp_deg": s.dp, "sdp_deg": s.sdp, "tp_deg": s.tp,
           "global_bsz": s.global_batch, "micro_batch_size": s.micro_batch_size, "chunks": s.num_micro_batches,
           "checkpoint": all(s.recompute_flags), "per_stage": _per_stage(s), "optimizer": s.optimizer,
           "precision": precision, "pipeline": {**_pipeline_keys(s.method), "num_virtual": s.num_virtual},
           "model": {k: getattr(model, k) for k in _MODEL_KEYS}, "data": asdict(data)}
    if s.tp > 1 and not tp_available():
        return "tensor parallel (tp) is not in this version's train.py"
    values = strategy_overrides(doc)
    groups: dict[str, dict[str, Any]] = {"model": asdict(model), "data": asdict(data), "pipeline": {}, "optimizer": {}}
    top: dict[str, Any] = {}
    for key, value in values.items():
        group, _, leaf = key.partition(".")
        if leaf:
            groups[group][leaf] = value
        else:
            top[key] = value
    config_log = logging.getLogger("pipefisher.config")
    level = config_log.level
    config_log.setLevel(logging.ERROR)  # its "has no effect" warnings, once per candidate, say nothing here
    try:
        TrainConfig(model=ModelConfig(**groups["model"]), data=DataConfig(**groups["data"]),
                    pipeline=PipelineConfig(**groups["pipeline"]), optimizer=OptimizerConfig(**groups["optimizer"]),
                    **top)
    except ConfigError as err:
        return f"train.py refuses it: {err}"
    finally:
        config_log.setLevel(level)
    return None


# -- after the run -------------------------------------------------------------------------------


def report_strategy_run(path: str | Path, output_dir: str | Path) -> dict[str, Any] | None:
    """Set the strategy's predicted step time and peak memory beside what the run in ``output_dir``
    measured (``metrics.jsonl``: the median step time after the first step; the largest per-step peak
    of any worker, also less its memory before the model was built). Logs one line and writes
    ``strategy_report.json`` there; returns the report (None without metrics)."""
    doc = read_strategy(path)
    metrics = Path(output_dir) / "metrics.jsonl"
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step_time_s") is not None]
    if not rows:
        return None
    steady = rows[1:] if len(rows) > 1 else rows
    step = statistics.median(r["step_time_s"] for r in steady)
    peaks = [r["peak_memory_per_worker_bytes"] for r in steady if r.get("peak_memory_per_worker_bytes")]
    base = next((r["memory_baseline_per_worker_bytes"] for r in reversed(rows)
                 if r.get("memory_baseline_per_worker_bytes")), None)
    pred = doc.get("predicted", {})
    report: dict[str, Any] = {"strategy": str(path), "steps": len(rows), "measured_step_time_s": step,
                              "predicted_step_time_s": pred.get("step_time_s")}
    parts = [f"step {step:.3f} s measured (median of {len(steady)})"]
    if pred.get("step_time_s"):
        report["step_time_ratio"] = step / pred["step_time_s"]
        parts[0] += f" vs {pred['step_time_s']:.3f} s predicted (measured {report['step_time_ratio']:.2f}x the prediction)"
    if peaks:
        per_worker = [max(col) for col in zip(*peaks)]
        report["measured_peak_memory_per_worker_bytes"] = per_worker
        report["measured_peak_memory_bytes"] = max(per_worker)
        shown = f"peak memory {max(per_worker) / 1e6:.0f} MB measured"
        if base:
            above = [p - b for p, b in zip(per_worker, base)]
            report["measured_peak_above_baseline_per_worker_bytes"] = above
            report["measured_peak_above_baseline_bytes"] = max(above)
            shown += f" ({max(above) / 1e6:.0f} MB above the process before its model)"
        if pred.get("peak_memory_bytes"):
            report["predicted_peak_memory_bytes"] = pred["peak_memory_bytes"]
            shown += f" vs {pred['peak_memory_bytes'] / 1e6:.0f} MB predicted (planning's memory model)"
        parts.append(shown)
    write_text_atomic(Path(output_dir) / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    log.info("strategy %s: %s; wrote %s", path, "; ".join(parts), REPORT_FILE)
    return report

