"""Compare the runs of a Hydra sweep offline: a table and loss / utilization plots.

Why one module: it is one offline program (load a sweep, summarize each run, tabulate, plot) whose steps pass
the same :class:`Run` and :class:`Summary` records along, and nothing else imports its parts.

``python -m pipefisher.compare <multirun dir> [--out DIR] [--last N]`` reads every job under the
sweep directory (any folder holding ``metrics.jsonl`` or ``.hydra/config.yaml``), prints one table
row per run and writes ``compare_loss_vs_step``, ``compare_loss_vs_time``,
``compare_utilization_vs_step`` and, when some run evaluated, ``compare_eval_mlm_loss_vs_step`` and
``compare_eval_mlm_loss_vs_time`` as PNG and PDF. Entry points: :func:`load_sweep`,
:func:`comparison_table`, :func:`plot_sweep`, :func:`main`.

[Note: where the numbers come from] ``metrics.jsonl`` is the source of truth. When a job also has an
offline wandb run (``<job>/wandb/offline-run-*/run-*.wandb``), its history only fills keys that
``metrics.jsonl`` lacks at the same step, or stands in for a missing or unreadable
``metrics.jsonl`` (with a warning). The ``.wandb`` file is a LevelDB-style log of protobuf
``Record`` messages; it is read here with wandb's own message classes, so nothing goes online.

[Note: summary statistics]
- final loss: mean of the last ``N`` recorded losses (all when fewer). A non-finite loss among
  them (written as ``null``, see ``tracking.metrics``) makes the result NaN: a diverged run must
  not look converged because its finite steps were averaged.
- samples/s and both bubble utilizations: median over the steps after the first. Step 0 pays for
  allocator warm-up and first-touch costs (several times slower in our CPU runs), so it is left
  out; a run with one step has no value.
- TFLOP/s and MFU: median over the steps after the first as well, except that a run with one step
  keeps it (a warm-up-inflated number beats none for a one-step smoke run).
- peak memory: the largest ``peak_memory_bytes`` of any step (already the max over workers).
- held-out MLM loss, MLM accuracy and NSP accuracy: the values of the last evaluated record (one
  carrying ``eval_*`` fields; evaluations are fields of the step they follow, not rows of their own).
  A ``null`` there (non-finite, e.g. a diverged eval loss) shows as NaN, not as an earlier value.

Fields added after a run was recorded (``eval_*``, ``tflops``, ``mfu``, ``peak_memory_bytes``) are
simply absent from older runs: their cells read ``—``, and a column no run has is left out.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import statistics
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pipefisher.tracking.metrics import EVAL_FIELDS, METRICS_FILE, read_metrics

__all__ = ["Run", "Summary", "comparison_table", "load_sweep", "main", "plot_sweep", "run_label", "summarize",
           "varying_overrides"]

log = logging.getLogger(__name__)

#: Default number of final steps averaged for the final loss.
DEFAULT_LAST = 5
#: Steps left out of the medians (see [Note: summary statistics]).
_WARMUP_STEPS = 1
_MISSING = "—"
#: x-axis label of the plots over training time (``step_time_s`` does not include evaluations).
_TIME_LABEL = "training time (s, sum of step_time_s; evaluation time excluded)"


@dataclass(frozen=True)
class Run:
    """One job of a sweep.

    Attributes:
        path: the job directory.
        name: the job directory relative to the sweep directory (Hydra's job number, e.g. ``"3"``).
        config: the composed config from ``.hydra/config.yaml`` (empty when missing).
        overrides: the job's command-line overrides, key → value, from ``.hydra/overrides.yaml``.
        records: one dict per step, in order (see [Note: where the numbers come from]).
        source: where ``records`` came from: ``"metrics.jsonl"``, ``"metrics.jsonl+wandb"`` or
            ``"wandb"``.
    """

    path: Path
    name: str
    config: Mapping[str, Any]
    overrides: Mapping[str, str]
    records: Sequence[Mapping[str, Any]]
    source: str = METRICS_FILE

    def _cfg(self, group: str, key: str | None = None) -> Any:
        value = self.config.get(group)
        if key is not None:
            value = value.get(key) if isinstance(value, Mapping) else None
        return value

    @property
    def method(self) -> str | None:
        """``pipeline.method``."""
        return self._cfg("pipeline", "method")

    @property
    def optimizer(self) -> str | None:
        """``optimizer.name``."""
        return self._cfg("optimizer", "name")

    @property
    def stages(self) -> int | None:
        """``stages``."""
        return self._cfg("stages")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and values of a numeric metric; records without it (or with ``null``) are skipped."""
        steps, values = [], []
        for i, rec in enumerate(self.records):
            value = rec.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                steps.append(int(rec.get("step", i)))
                values.append(float(value))
        return steps, values


@dataclass(frozen=True)
class Summary:
    """The table's numbers for one run (see [Note: summary statistics]); ``None``: not recorded."""

    num_steps: int
    final_loss: float | None
    samples_per_s: float | None
    bubble_utilization: float | None
    simulated_bubble_utilization: float | None
    refresh_intervals: tuple[int, ...] = field(default_factory=tuple)
    eval_mlm_loss: float | None = None
    eval_mlm_accuracy: float | None = None
    eval_nsp_accuracy: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_memory_bytes: float | None = None


# --------------------------------------------------------------------------------------- loading


def _job_dirs(sweep_dir: Path) -> list[Path]:
    found = {p.parent for p in sweep_dir.rglob(METRICS_FILE)}
    found |= {p.parent.parent for p in sweep_dir.rglob("config.yaml") if p.parent.name == ".hydra"}
    # wandb keeps copies of files under <job>/wandb/...; those are not jobs.
    found = {d for d in found if "wandb" not in d.relative_to(sweep_dir).parts}
    return sorted(found, key=lambda d: _natural_key(d.relative_to(sweep_dir).as_posix()))


def _natural_key(text: str) -> list[Any]:
    """``"10"`` after ``"9"``: digit runs compare as numbers."""
    return [(0, int(tok), "") if tok.isdigit() else (1, 0, tok) for tok in re.split(r"(\d+)", text) if tok]


def _read_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as f:
        return yaml.safe_load(f)


def _parse_overrides(items: Any, path: Path) -> dict[str, str]:
    if items is None:
        return {}
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a list of 'key=value' overrides, got {type(items).__name__}")
    out = {}
    for item in items:
        key, sep, value = str(item).lstrip("+~").partition("=")
        if sep and not key.startswith("hydra."):
            out[key.strip()] = value.strip()
    return out


def _read_wandb_history(job: Path) -> list[dict[str, Any]] | None:
    """History rows of the job's offline wandb run(s), or None when there is none or it is unreadable."""
    files = sorted(job.glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        return None
    if len(files) > 1:
        log.warning("%s: %d offline wandb runs; reading the newest, %s", job, len(files), files[-1])
    try:
        from wandb.proto import wandb_internal_pb2  # optional, and slow to import: only when needed
    except ImportError as err:
        log.warning("%s: cannot read offline wandb runs without wandb (%s)", job, err)
        return None
    try:
        rows = []
        for payload in _wandb_log_records(files[-1].read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            if record.WhichOneof("record_type") == "history":
                rows.append(_history_row(record.history))
        return rows
    except Exception as err:  # a truncated or foreign file: the run is still usable without it
        log.warning("%s: unreadable offline wandb run (%s: %s)", files[-1], type(err).__name__, err)
        return None


def _wandb_log_records(data: bytes) -> list[bytes]:
    """Payloads of a ``.wandb`` file.

    The format is LevelDB's log: a 7-byte file header (``:W&B``, a 2-byte key, a version byte),
    then 32 KiB blocks of chunks ``crc32c:u32 length:u16 type:u8 data``; type 1 is a whole record,
    2/3/4 the first/middle/last piece of one that spans blocks; a block tail under 7 bytes is
    padding. (The checksum is not verified: the protobuf parse catches garbage.)
    """
    if data[:4] != b":W&B":
        raise ValueError("not a .wandb file (no ':W&B' header)")
    block, pos, pieces, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding written at the end of a block
            pos += left
            continue
        chunk = data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pieces = chunk
        elif kind == 3:
            pieces += chunk
        elif kind == 4:
            out.append(pieces + chunk)
            pieces = b""
        else:
            raise ValueError(f"unknown chunk type {kind} at byte {pos - 7 - length}")
    return out


def _history_row(history: Any) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for item in history.item:
        keys = list(item.nested_key) or [item.key]
        if keys[0].startswith("_"):  # wandb's own _step, _runtime, _timestamp
            continue
        target = row
        for k in keys[:-1]:
            target = target.setdefault(k, {})
        target[keys[-1]] = json.loads(item.value_json)
    row.setdefault("step", history.step.num)
    return row


def _merge_missing(records: list[dict[str, Any]], extra: list[dict[str, Any]]) -> bool:
    """Add keys of ``extra`` rows that ``records`` lacks at the same step; True if any was added."""
    by_step = {row.get("step"): row for row in extra}
    added = False
    for rec in records:
        row = by_step.get(rec.get("step"), {})
        for key, value in row.items():
            if key not in rec:
                rec[key] = value
                added = True
    return added


def _load_run(sweep_dir: Path, job: Path) -> Run:
    """One job; raises ValueError (naming the path) when it has no usable metrics."""
    name = job.relative_to(sweep_dir).as_posix() if job != sweep_dir else job.name
    config_path, overrides_path = job / ".hydra" / "config.yaml", job / ".hydra" / "overrides.yaml"
    config: Any = {}
    if config_path.is_file():
        config = _read_yaml(config_path) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{config_path}: expected a mapping, got {type(config).__name__}")
    else:
        log.warning("%s: no .hydra/config.yaml; method, optimizer and stages will be blank", job)
    overrides = {}
    if overrides_path.is_file():
        overrides = _parse_overrides(_read_yaml(overrides_path), overrides_path)

    metrics_path = job / METRICS_FILE
    records: list[dict[str, Any]] | None = None
    problem = ""
    if not metrics_path.is_file():
        problem = f"{metrics_path}: no such file"
    else:
        try:
            records = read_metrics(metrics_path)
        except ValueError as err:  # a malformed line; the message gives file and line
            problem = str(err)
        else:
            if not records:
                problem, records = f"{metrics_path}: no records", None
    history = _read_wandb_history(job)
    if records is None:
        if not history:
            raise ValueError(f"{problem} (and no readable offline wandb run in {job / 'wandb'})")
        log.warning("%s; using the offline wandb run's history instead", problem)
        return Run(job, name, config, overrides, tuple(history), source="wandb")
    source = METRICS_FILE + "+wandb" if history and _merge_missing(records, history) else METRICS_FILE
    return Run(job, name, config, overrides, tuple(records), source=source)


def load_sweep(sweep_dir: str | Path) -> list[Run]:
    """Every usable run under a multirun (or single-run) directory, in job order.

    A job is any folder holding ``metrics.jsonl`` or ``.hydra/config.yaml``. A job without usable
    metrics (missing file, malformed line, no records, and no offline wandb run to stand in) is
    skipped with a warning naming the file.

    Args:
        sweep_dir: Hydra's ``hydra.sweep.dir`` (or one job's directory).

    Returns:
        The runs, sorted by job directory (numbers in natural order).

    Raises:
        FileNotFoundError: ``sweep_dir`` does not exist.
        ValueError: no job found, or no job is usable (the message lists why each was skipped).
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such directory")
    jobs = _job_dirs(sweep_dir)
    if not jobs:
        raise ValueError(
            f"{sweep_dir}: no runs found (expected <job>/{METRICS_FILE} or <job>/.hydra/config.yaml "
            "below it; pass the sweep's hydra.sweep.dir, e.g. multirun/<date>/<time>)"
        )
    runs, skipped = [], []
    for job in jobs:
        try:
            runs.append(_load_run(sweep_dir, job))
        except (ValueError, OSError, yaml.YAMLError) as err:
            log.warning("skipping run %s: %s", job, err)
            skipped.append(f"  {job}: {err}")
    if not runs:
        raise ValueError(f"{sweep_dir}: none of its {len(jobs)} run(s) is usable:\n" + "\n".join(skipped))
    return runs


# --------------------------------------------------------------------------------------- table


def _median_after_warmup(run: Run, key: str, *, keep_lone_step: bool = False) -> float | None:
    """Median of ``key`` past the warm-up steps; ``keep_lone_step``: a one-step run keeps its step."""
    skip = 0 if keep_lone_step and len(run.records) == 1 else _WARMUP_STEPS
    values = [v for s, v in zip(*run.series(key)) if s >= _first_step(run) + skip]
    return statistics.median(values) if values else None


def _last_eval(run: Run) -> Mapping[str, Any]:
    """The last record carrying evaluation fields (empty when the run never evaluated)."""
    return next((rec for rec in reversed(run.records) if any(k in rec for k in EVAL_FIELDS)), {})


def _recorded(rec: Mapping[str, Any], key: str) -> float | None:
    """``rec[key]`` as a float: None when absent, NaN when written as ``null`` (non-finite)."""
    if key not in rec:
        return None
    value = rec[key]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _first_step(run: Run) -> int:
    return int(run.records[0].get("step", 0)) if run.records else 0


def summarize(run: Run, last: int = DEFAULT_LAST) -> Summary:
    """The table's numbers for ``run`` (see [Note: summary statistics]).

    Args:
        run: a loaded run.
        last: how many final steps the final loss averages (all steps when fewer); at least 1.

    Raises:
        ValueError: ``last`` < 1.
    """
    if last < 1:
        raise ValueError(f"last={last}: the final loss needs at least one step; pass --last 1 or more")
    losses = [rec.get("loss") for rec in run.records if "loss" in rec][-last:]
    final: float | None = None
    if losses:
        finite = all(isinstance(v, (int, float)) and math.isfinite(v) for v in losses)
        final = statistics.fmean(losses) if finite else math.nan
    intervals = sorted({int(r["refresh_interval"]) for r in run.records
                        if r.get("refresh_interval") is not None})
    evaluated = _last_eval(run)
    memory = run.series("peak_memory_bytes")[1]
    return Summary(
        num_steps=len(run.records),
        final_loss=final,
        samples_per_s=_median_after_warmup(run, "samples_per_s"),
        bubble_utilization=_median_after_warmup(run, "bubble_utilization"),
        simulated_bubble_utilization=_median_after_warmup(run, "simulated_bubble_utilization"),
        refresh_intervals=tuple(intervals),
        eval_mlm_loss=_recorded(evaluated, "eval_mlm_loss"),
        eval_mlm_accuracy=_recorded(evaluated, "eval_mlm_accuracy"),
        eval_nsp_accuracy=_recorded(evaluated, "eval_nsp_accuracy"),
        tflops=_median_after_warmup(run, "tflops", keep_lone_step=True),
        mfu=_median_after_warmup(run, "mfu", keep_lone_step=True),
        peak_memory_bytes=max(memory) if memory else None,
    )


def varying_overrides(runs: Sequence[Run]) -> list[str]:
    """Override keys whose value differs between runs (or that only some runs set), in first-seen order."""
    keys: dict[str, None] = {}
    for run in runs:
        keys.update(dict.fromkeys(run.overrides))
    return [k for k in keys if len({run.overrides.get(k) for run in runs}) > 1]


def _varying_text(run: Run, keys: Sequence[str]) -> str:
    return " ".join(f"{k}={run.overrides[k]}" for k in keys if k in run.overrides)


def run_label(run: Run, keys: Sequence[str]) -> str:
    """A legend label: the job name and its values of ``keys``, e.g. ``"3: pipeline=1f1b optimizer=kfac"``."""
    text = _varying_text(run, keys)
    return f"{run.name}: {text}" if text else run.name


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return _MISSING
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec)


def _optional(header: str, values: Sequence[float | None], spec: str) -> list[tuple[str, list[str]]]:
    """A column ``(header, cells)`` in a list, or no column when no run recorded the value."""
    return [(header, [_fmt(v, spec) for v in values])] if any(v is not None for v in values) else []


def comparison_table(runs: Sequence[Run], *, last: int = DEFAULT_LAST) -> str:
    """One Markdown-style row per run: varying overrides, set-up and summary numbers.

    Columns: ``job``, ``overrides`` (those that vary across ``runs``, as ``key=value``; left out
    when none varies), ``method``, ``optimizer``, ``stages``, ``steps logged`` (records read),
    ``loss (last N)``, ``eval MLM loss``, ``eval MLM acc``, ``eval NSP acc`` (last evaluation),
    ``samples/s``, ``TFLOP/s``, ``MFU``, ``bubble util``, ``sim. util``, ``peak mem (MB)`` (10^6
    bytes) and, when any run is K-FAC, ``refresh k`` (the refresh intervals it logged). The eval,
    TFLOP/s, MFU and memory columns are left out when no run recorded them. ``—`` marks a value
    the run did not record. Numbers follow [Note: summary statistics].

    Args:
        runs: from :func:`load_sweep`.
        last: steps averaged for the final loss.

    Returns:
        The table, lines joined by newlines (no trailing newline).
    """
    keys = varying_overrides(runs)
    summaries = [summarize(run, last) for run in runs]
    memory_mb = [None if s.peak_memory_bytes is None else s.peak_memory_bytes / 1e6 for s in summaries]
    columns: list[tuple[str, list[str]]] = [
        ("job", [run.name for run in runs]),
        *([("overrides", [_varying_text(run, keys) or _MISSING for run in runs])] if keys else []),
        ("method", [str(run.method or _MISSING) for run in runs]),
        ("optimizer", [str(run.optimizer or _MISSING) for run in runs]),
        ("stages", [_fmt(run.stages, "d") for run in runs]),
        ("steps logged", [str(s.num_steps) for s in summaries]),
        (f"loss (last {last})", [_fmt(s.final_loss, ".4f") for s in summaries]),
        *_optional("eval MLM loss", [s.eval_mlm_loss for s in summaries], ".4f"),
        *_optional("eval MLM acc", [s.eval_mlm_accuracy for s in summaries], ".3f"),
        *_optional("eval NSP acc", [s.eval_nsp_accuracy for s in summaries], ".3f"),
        ("samples/s", [_fmt(s.samples_per_s, ".1f") for s in summaries]),
        *_optional("TFLOP/s", [s.tflops for s in summaries], ".3g"),
        *_optional("MFU", [s.mfu for s in summaries], ".3f"),
        ("bubble util", [_fmt(s.bubble_utilization, ".3f") for s in summaries]),
        ("sim. util", [_fmt(s.simulated_bubble_utilization, ".3f") for s in summaries]),
        *_optional("peak mem (MB)", memory_mb, ".0f"),
    ]
    if any(s.refresh_intervals for s in summaries):
        columns.append(("refresh k", ["/".join(map(str, s.refresh_intervals)) or _MISSING for s in summaries]))
    header = [name for name, _ in columns]
    rows = [list(cells) for cells in zip(*(cells for _, cells in columns))]
    numeric_from = header.index("stages")  # numbers are right-aligned
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i >= numeric_from else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i >= numeric_from else "-")
                          for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


# --------------------------------------------------------------------------------------- plots


def _cumulative_time(run: Run, key: str = "loss") -> tuple[list[float], list[float]]:
    """(end time of each step in s, ``key`` at that step) for the steps that recorded ``key``.

    Time is the running sum of ``step_time_s`` over every record up to and including the step;
    ``eval_time_s`` is not added, so evaluations do not stretch the axis. Records without
    ``step_time_s`` are skipped.
    """
    times, values, now = [], [], 0.0
    for rec in run.records:
        dt = rec.get("step_time_s")
        if not isinstance(dt, (int, float)):
            continue
        now += dt
        value = rec.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            times.append(now)
            values.append(float(value))
    return times, values


def _save(fig: Figure, out_dir: Path, stem: str) -> list[Path]:
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150, bbox_inches="tight")
    return paths


def plot_sweep(runs: Sequence[Run], out_dir: str | Path) -> list[Path]:
    """Draw loss vs step, loss vs time, bubble utilization vs step and held-out MLM loss, as PNG and PDF.

    Files: ``compare_loss_vs_step``, ``compare_loss_vs_time`` (time is the running sum of
    ``step_time_s``, evaluations excluded), when any run recorded it, ``compare_utilization_vs_step``
    (measured solid, simulated dashed, one colour per run) and, when any run evaluated,
    ``compare_eval_mlm_loss_vs_step`` and ``compare_eval_mlm_loss_vs_time`` (same time axis; one
    marked line per run that evaluated).

    Args:
        runs: from :func:`load_sweep`.
        out_dir: created if missing.

    Returns:
        The written files, PNG before PDF for each plot.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = varying_overrides(runs)
    labels = [run_label(run, keys) for run in runs]
    colors = [f"C{i % 10}" for i in range(len(runs))]
    styles = ["-", "--", ":", "-."]  # a second linestyle after 10 runs keeps colours distinct
    paths: list[Path] = []

    def figure(title: str, xlabel: str, ylabel: str) -> tuple[Figure, Any]:
        fig = Figure(figsize=(8.0, 4.8))
        ax = fig.add_subplot()
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        if xlabel == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return fig, ax

    def legend(ax: Any) -> None:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)

    fig, ax = figure("Loss per step", "step", "loss (MLM + NSP)")
    for i, run in enumerate(runs):
        ax.plot(*run.series("loss"), color=colors[i], linestyle=styles[i // 10 % 4], label=labels[i])
    legend(ax)
    paths += _save(fig, out_dir, "compare_loss_vs_step")

    fig, ax = figure("Loss over training time", _TIME_LABEL, "loss (MLM + NSP)")
    for i, run in enumerate(runs):
        ax.plot(*_cumulative_time(run), color=colors[i], linestyle=styles[i // 10 % 4], label=labels[i])
    legend(ax)
    paths += _save(fig, out_dir, "compare_loss_vs_time")

    with_util = [i for i, run in enumerate(runs) if run.series("bubble_utilization")[0]
                 or run.series("simulated_bubble_utilization")[0]]
    if with_util:
        fig, ax = figure("Bubble utilization per step (solid: measured, dashed: simulated)", "step",
                         "fraction of pipeline time busy")
        for i in with_util:
            ax.plot(*runs[i].series("bubble_utilization"), color=colors[i], linestyle="-", label=labels[i])
            ax.plot(*runs[i].series("simulated_bubble_utilization"), color=colors[i], linestyle="--")
        ax.set_ylim(0.0, 1.03)  # a bubble-free schedule sits at 1.0: keep it off the frame
        legend(ax)
        paths += _save(fig, out_dir, "compare_utilization_vs_step")
    else:
        log.info("no run recorded bubble utilization (single-stage runs?); no utilization plot")

    with_eval = [i for i, run in enumerate(runs) if run.series("eval_mlm_loss")[0]]
    if with_eval:
        eval_series: list[tuple[str, str, str, Callable[[Run], tuple[list[Any], list[float]]]]] = [
            ("compare_eval_mlm_loss_vs_step", "Held-out MLM loss per step", "step",
             lambda run: run.series("eval_mlm_loss")),
            ("compare_eval_mlm_loss_vs_time", "Held-out MLM loss over training time", _TIME_LABEL,
             lambda run: _cumulative_time(run, "eval_mlm_loss")),
        ]
        for stem, title, xlabel, series in eval_series:
            fig, ax = figure(title, xlabel, "held-out MLM loss")
            for i in with_eval:  # markers: evaluations are sparse, and a lone one must still show
                ax.plot(*series(runs[i]), color=colors[i], linestyle=styles[i // 10 % 4], marker="o",
                        markersize=3, label=labels[i])
            legend(ax)
            paths += _save(fig, out_dir, stem)
    else:
        log.info("no run recorded eval_mlm_loss; no held-out loss plots")
    log.info("wrote %s", ", ".join(map(str, paths)))
    return paths


# --------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipefisher-compare" if Path(sys.argv[0]).name == "pipefisher-compare" else "python -m pipefisher.compare",
        description="Compare the runs of a Hydra sweep (metrics.jsonl + .hydra/config.yaml): "
                    "print a table and write loss, utilization and held-out loss plots. No network.",
    )
    p.add_argument("sweep_dir", type=Path, help="the sweep's hydra.sweep.dir (e.g. multirun/<date>/<time>)")
    p.add_argument("--out", type=Path, default=None, help="where plots go (default: the sweep dir)")
    p.add_argument("--last", type=int, default=DEFAULT_LAST,
                   help=f"final steps averaged for the final loss (default {DEFAULT_LAST})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; prints the table and the plot paths, returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    if args.last < 1:
        print(f"compare: error: --last {args.last}: needs at least 1", file=sys.stderr)
        return 2
    try:
        runs = load_sweep(args.sweep_dir)
        table = comparison_table(runs, last=args.last)
        paths = plot_sweep(runs, args.out if args.out is not None else args.sweep_dir)
    except (ValueError, OSError) as err:
        print(f"compare: error: {err}", file=sys.stderr)
        return 1
    print(table)
    print()
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
