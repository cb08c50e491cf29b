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
                           "peak_memory_per_worker_bytes", "memory_model"} (what the search predicted)
    search                 how it was found (devices, budget, cost sources), for the record

``train.py strategy=<file>`` sets the keys the file implies (:func:`strategy_overrides`) before the
config is validated; a key also given on the command line with another value is refused in one line
naming both, as is a file train.py cannot run (a per-stage choice that differs, tp without a ``tp``
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
from pipefisher.config import (PIPELINE_METHODS, ConfigError, DataConfig, ModelConfig, OptimizerConfig, PipelineConfig,
                               TrainConfig)
from pipefisher.planning.strategy_search import Strategy, model_stages, tp_available

__all__ = ["STRATEGY_FORMAT", "apply_strategy", "read_strategy", "refusal", "report_strategy_run",
           "strategy_document", "strategy_overrides", "write_strategy"]

log = logging.getLogger(__name__)

STRATEGY_FORMAT = "pipefisher-strategy/1"
REPORT_FILE = "strategy_report.json"
_MODEL_KEYS = ("name", "num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size")


def _pipeline_keys(method: str) -> dict[str, Any]:
    if method == "chimera-doubling":
        return {"method": "chimera", "chimera_stacking": "doubling"}
    return {"method": method, "chimera_stacking": "direct"}


def strategy_document(s: Strategy, model: ModelConfig, data: DataConfig, precision: str = "fp32",
                      search: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of a ranked strategy ([Note: the strategy file])."""
    if s.excluded is not None or s.step_time_s is None:
        raise ValueError(f"{s.label}: an excluded strategy ({s.excluded}) is no strategy to run")
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
                                      "activations, sync buffers and the search's memory_device terms"},
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
    if doc["tp_deg"] > 1 and not tp_available():
        raise _field(p, "tp_deg", f"is {doc['tp_deg']}, but this version's train.py has no tensor parallel (tp); "
                     f"search again without it (search.tp=[1])")
    return doc


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


def strategy_overrides(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The train.py keys (dotted) a checked strategy file sets, and their values."""
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
        ConfigError: the file is bad (:func:`read_strategy`) or disagrees with the command line (one
            line naming every disagreeing key beside the file's value).
    """
    path = path or dcfg.strategy
    doc = read_strategy(path)
    keys = {o.lstrip("+~").split("=", 1)[0] for o in explicit}
    conflicts = []
    for key, value in strategy_overrides(doc).items():
        group = key.split(".", 1)[0]
        if key in keys or (group != key and group in keys):
            mine = _get(dcfg, key)
            if mine != value:
                conflicts.append(f"{key}={mine} (the file has {value!r})")
    if conflicts:
        raise ConfigError(f"strategy={path}: the command line disagrees with the file: {'; '.join(conflicts)}; drop "
                          f"those keys to run the strategy as it is, or search again with them")
    for key, value in strategy_overrides(doc).items():
        node = dcfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
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

