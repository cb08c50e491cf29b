"""What a run reports: the step's FLOP rate, MFU and peak memory (:class:`StepMeter`, every
worker), and rank 0's outputs (:class:`StepReporter`: ``metrics.jsonl``, wandb, the progress bar,
the end-of-run summary).

[Note: FLOPs, MFU and memory]
``tflops`` is the model's FLOPs of a step (``pipefisher.measure.flops``: 2 per multiply-add of the
matrix products, forward × 3, recomputation not counted: PaLM's definition) over ``step_time_s``,
summed over all workers; ``mfu`` divides it by the peak of all the run's devices
(``pipefisher.measure.peak``: a table on GPUs, a matrix-multiply measurement of the run's own
threads on CPU; the summary names the source). ``peak_memory_bytes`` is the largest, over the
workers, of the step's peak (CUDA: ``max_memory_allocated``; CPU: peak resident set size, reset
before each step); ``peak_memory_per_worker_bytes`` lists every worker's. The summary sets the
largest per worker beside the planner's prediction for that worker (``planning.memory``).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pipefisher.config import TrainConfig
from pipefisher.measure import Peak, PeakMemory, mfu, predicted_peak_bytes, resolve_peak, run_peak, tflops, train_step_flops
from pipefisher.run_spec import bert_config
from pipefisher.runtime.build import run_shape
from pipefisher.runtime.progress import progress_range
from pipefisher.runtime.step_metrics import timeline_fields
from pipefisher.timeline import Event
from pipefisher.tracking import METRICS_FILE, MetricsWriter, WandbLogger
from pipefisher.tracking.wandb_logger import RUN_ID_FILE

__all__ = ["StepMeter", "StepReporter", "prediction_inputs", "summary_fields", "summary_line"]

log = logging.getLogger(__name__)


def _threads_total(cfg: TrainConfig, device: torch.device) -> int | None:
    """The compute threads of all the run's processes on CPU (each gets cores // processes)."""
    if device.type != "cpu":
        return None
    return torch.get_num_threads() * cfg.num_workers


class StepMeter:
    """The model FLOPs of a step, the peak it is measured against, and this process's peak memory.

    Args:
        cfg: the run.
        worker: anything with ``device`` and, for the prediction, ``schedule`` and ``assignment``
            (a :class:`~pipefisher.runtime.pipeline_worker.PipelineWorker`); None in one process.
        device: the device (when ``worker`` is None).
        reports: this meter's owner writes the summary (rank 0; one process with an output folder):
            it resolves the peak (on CPU a measurement, about 0.5 s) and the planner's prediction.
            Default: rank 0.
        baseline_bytes: :func:`~pipefisher.measure.current_bytes` before the model was built.
    """

    def __init__(self, cfg: TrainConfig, worker: Any = None, device: torch.device | None = None,
                 reports: bool | None = None, baseline_bytes: int = 0) -> None:
        self.device = worker.device if worker is not None else device
        self.baseline_bytes = baseline_bytes  # this process's memory before it built its model
        if reports is None:
            reports = worker is None or worker.rank == 0
        self.flops_per_step = train_step_flops(bert_config(cfg), cfg.global_batch_size, cfg.data.seq_len,
                                               cfg.data.max_predictions)
        self.peak: Peak | None = None  # of all the run's devices
        self.predicted: dict[int, float] = {}  # the planner's bytes per worker
        if reports:
            try:
                one = resolve_peak(self.device, cfg.precision, cfg.hardware.peak_tflops,
                                   _threads_total(cfg, self.device))
            except ValueError as err:  # a GPU the table lacks: no MFU, the rest is reported
                log.warning("no MFU: %s", err)
            else:
                self.peak = run_peak(one, self.device.type, cfg.num_workers)
            if cfg.tp == 1:  # the planner does not model tensor parallelism (yet): no prediction
                self.predicted = predicted_peak_bytes(*prediction_inputs(cfg, worker),
                                                      "cpu" if self.device.type == "cpu" else "cuda")
        self.memory = PeakMemory(self.device)

    def begin_step(self) -> None:
        """Restart the peak-memory watermark."""
        self.memory.reset()

    def end_step(self) -> tuple[int, int]:
        """This process's peak memory since :meth:`begin_step` and its baseline, in bytes."""
        return self.memory.read(), self.baseline_bytes

    def rates(self, step_time_s: float) -> dict[str, float]:
        """``tflops`` and ``mfu`` of a step that took ``step_time_s`` ([Note: FLOPs, MFU and memory])."""
        out = {"tflops": tflops(self.flops_per_step, step_time_s)}
        if self.peak is not None:
            out["mfu"] = mfu(self.flops_per_step, step_time_s, self.peak)
        return out


def prediction_inputs(cfg: TrainConfig, worker: Any = None) -> tuple[Any, str, Any, Any]:
    """``(run, optimizer, schedule, assignment)`` the planner predicts ``cfg``'s peak memory from: the
    worker's own schedule; without a worker, the schedule the run's shape builds (every run, one process
    included, trains through the worker: a one-stage GPipe holds all N micro-batches between F and B)."""
    if worker is not None:
        return run_shape(cfg), cfg.optimizer.name, worker.schedule, worker.assignment
    return run_shape(cfg), cfg.optimizer.name, None, None


_SUMMARY_KEYS = ("step", "step_time_s", "samples_per_s", "tflops", "mfu", "peak_memory_per_worker_bytes",
                 "memory_baseline_per_worker_bytes", "eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_accuracy")


def summary_fields(row: dict[str, Any]) -> dict[str, Any]:
    """What :func:`summary_line` reads of a row (a run keeps this much of every step, not the whole row)."""
    return {k: row[k] for k in _SUMMARY_KEYS if k in row}


def summary_line(rows: Sequence[dict[str, Any]], meter: StepMeter) -> str:
    """The end-of-run summary: step time, throughput, TFLOP/s, MFU, peak memory (measured and
    predicted per worker) and the last held-out figures. The first step (warm-up) is left out of
    the medians when there are more."""
    steady = rows[1:] if len(rows) > 1 else rows
    if not steady:
        return "summary: no step trained"
    med = statistics.median
    parts = [f"{len(rows)} step(s)", f"median step {med(r['step_time_s'] for r in steady):.3f} s",
             f"{med(r['samples_per_s'] for r in steady):.1f} samples/s",
             f"{med(r['tflops'] for r in steady) * 1e3:.2f} GFLOP/s model FLOPs ({meter.flops_per_step / 1e9:.2f} "
             f"GFLOP per step)"]
    if meter.peak is not None and "mfu" in steady[0]:
        parts.append(f"MFU {med(r['mfu'] for r in steady):.1%} of {meter.peak.flops_per_s / 1e9:.0f} GFLOP/s "
                     f"({meter.peak.source})")
    per_worker = [r.get("peak_memory_per_worker_bytes") for r in rows if r.get("peak_memory_per_worker_bytes")]
    if per_worker:
        peaks = [max(col) for col in zip(*per_worker)]
        base = rows[-1].get("memory_baseline_per_worker_bytes") or [0] * len(peaks)
        shown = ", ".join(
            f"w{w} {p / 1e6:.0f} MB" + (f" = {b / 1e6:.0f} before the model + {(p - b) / 1e6:.0f}" if b else "")
            + (f" (predicted {meter.predicted[w] / 1e6:.0f})" if w in meter.predicted else "")
            for w, (p, b) in enumerate(zip(peaks, base)))
        parts.append(f"peak memory ({meter.memory.kind}): {shown}")
    evals = [r for r in rows if "eval_mlm_loss" in r]
    if evals:
        e = evals[-1]
        parts.append(f"held-out at step {e['step']}: MLM loss {e['eval_mlm_loss']:.4f}, MLM accuracy "
                     f"{e['eval_mlm_accuracy']:.3f}, NSP accuracy {e['eval_nsp_accuracy']:.3f}")
    return "summary: " + "; ".join(parts)


class StepReporter:
    """Rank 0's outputs of a run: one ``metrics.jsonl`` row per step, wandb and the progress bar on
    logged steps (every ``log_every`` and the last), rows with evaluation figures always, and the
    summary at the end.

    Args:
        worker: the rank-0 :class:`~pipefisher.runtime.pipeline_worker.PipelineWorker`.
        first: the first step this attempt trains (after a resume: the step after the checkpoint).
    """

    def __init__(self, cfg: TrainConfig, worker: Any, output_dir: Path, first: int, *, run_name: str | None,
                 group: str | None, meter: StepMeter) -> None:
        self.cfg, self.worker, self.first, self.meter = cfg, worker, first, meter
        self.writer = MetricsWriter(output_dir / METRICS_FILE)
        # An attempt that continues from a checkpoint logs into the run's wandb run (RUN_ID_FILE).
        self.logger = WandbLogger(asdict(cfg), project=cfg.wandb.project, group=group, name=run_name,
                                  mode=cfg.wandb.mode, dir=str(output_dir), enabled=True,
                                  run_id_file=output_dir / RUN_ID_FILE, continuing=first > 0)
        self.bar: Any = None
        self.rows: list[dict[str, Any]] = []

    def steps(self) -> Iterable[int]:
        """The steps to train, in a progress bar when ``progress`` is on."""
        self.bar = progress_range(self.cfg, enabled=True, first=self.first)
        return self.bar

    def logged(self, step: int) -> bool:
        """Whether ``step`` goes to wandb and gets the simulated figure (every ``log_every``, the last)."""
        return step % self.cfg.log_every == 0 or step == self.cfg.steps - 1

    def step_fields(self, step: int, lr: float, events: list[Event],
                    memory: Sequence[tuple[int, int]]) -> dict[str, Any]:
        """The row fields rank 0 computes from the gathered timelines and (peak, baseline) memories."""
        peaks = [peak for peak, _ in memory]
        w = self.worker
        row: dict[str, Any] = {"lr": lr, "step_time_s": None, "samples_per_s": None, "bookkeeping_s": None}
        row.update(timeline_fields(events, w.schedule, w.world_size, step, simulated=self.logged(step),
                                   assignment=w.assignment, curvature_age=w.curvature_age))
        row.update(peak_memory_bytes=max(peaks), peak_memory_per_worker_bytes=peaks,
                   memory_baseline_per_worker_bytes=[base for _, base in memory])
        return row

    def write(self, step: int, row: dict[str, Any]) -> None:
        """Append the step's row; wandb and the progress bar on logged steps and evaluations."""
        self.rows.append(summary_fields(self.writer.write(row)))
        has_eval = "eval_mlm_loss" in row
        if self.logged(step) or has_eval:
            self.logger.log(row, step=step)
        if self.logged(step) and hasattr(self.bar, "set_postfix"):
            shown = {"loss": f"{row['loss']:.3f}"}
            if "bubble_utilization" in row:
                shown["bubble_util"] = f"{row['bubble_utilization']:.2f}"
            if "eval_mlm_loss" in row:
                shown["eval_mlm"] = f"{row['eval_mlm_loss']:.3f}"
            self.bar.set_postfix(shown)

    def log_pictures(self, pictures: Iterable[Path]) -> None:
        """Send the profile's timeline picture to wandb."""
        for picture in pictures:
            if picture.suffix == ".png":
                self.logger.log_image("timeline", str(picture))

    def summarize(self) -> None:
        """Log the end-of-run summary of the steps this attempt trained."""
        if self.first >= self.cfg.steps:
            log.info("nothing to train: the checkpoint is at the last step (steps=%d)", self.cfg.steps)
            return
        log.info("%s", summary_line(self.rows, self.meter))

    def close(self) -> None:
        """Close metrics.jsonl, wandb and the progress bar."""
        self.writer.close()
        self.logger.finish()
        if hasattr(self.bar, "close"):
            self.bar.close()

