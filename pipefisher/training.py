"""Run a pretraining job: build what a run needs from its config and train, in one process or many.

:func:`train_single_process` trains with ``stages=1`` and ``data_parallel=1`` (and is the reference
the pipeline tests compare with); the helpers here are shared with the pipeline workers
(``pipefisher.runtime.worker``). ``pipefisher.launch.run_training`` chooses between the two.

[Note: loss and gradient scale]
The loss of a step is the mean over its micro-batches (and data-parallel replicas) of each
micro-batch's MLM + NSP loss; gradients are those of that mean. Every method (one process,
GPipe, 1F1B, Chimera, data parallel) uses this scale, so their losses and gradients are equal.

[Note: dropout masks]
Micro-batch j of step t runs under ``dropout_key(t, j)``, the key the pipeline executor gives the
same samples (``pipefisher.model.rng``): with dropout on, this loop is still the reference.
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from pipefisher.config import FACTOR_DECAY_UNITS, KFAC_OPTIMIZERS, ConfigError, TrainConfig
from pipefisher.data import build_source, get_micro_batch
from pipefisher.data.hdf5 import vocab_file_near
from pipefisher.model import BertConfig, BertStage, build_full_model, merge_stage_state_dicts
from pipefisher.model.hf_format import write_model_folder
from pipefisher.model.rng import dropout_key
from pipefisher.optim import (
    BASELINE_OPTIMIZERS,
    ENCODER_LINEAR_PATTERN,
    build_baseline_optimizer,
    build_optimizer,
    make_lr_scheduler,
    resolve_ns_dtype,
)
from pipefisher.tracking import MetricsWriter, WandbLogger

__all__ = [
    "train_single_process",
    "bert_config",
    "data_source",
    "data_plan",
    "resolve_device",
    "check_local_gpus",
    "set_cpu_threads",
    "make_optimizer",
    "is_kfac_parameter",
    "StepTimer",
    "autocast_context",
    "progress_range",
    "LineProgress",
    "save_final_weights",
    "FINAL_DIR",
]

log = logging.getLogger(__name__)

FINAL_DIR = "final"  # <run>/final/: the weights after the last step (save_final_weights)


def bert_config(cfg: TrainConfig) -> BertConfig:
    """The model's :class:`BertConfig` from the run config."""
    m = cfg.model
    return BertConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        intermediate_size=m.intermediate_size or 4 * m.hidden_size,
        max_position_embeddings=m.max_position_embeddings,
        type_vocab_size=m.type_vocab_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
    )


def save_final_weights(cfg: TrainConfig, state_dicts: list[dict[str, torch.Tensor]], output_dir: str | os.PathLike,
                       step: int) -> Path:
    """Write the trained model to ``<output_dir>/final/`` in Hugging Face's layout
    (``pipefisher.model.hf_format``): the stages' state dicts merged, the architecture, and the
    ``vocab.txt`` beside the run's hdf5 shards when there is one.

    Args:
        state_dicts: one state dict per stage (any order), or the full model's.
        step: the last step trained (0-based, as metrics.jsonl counts).

    Returns:
        The folder.
    """
    vocab = vocab_file_near(cfg.data.path) if cfg.data.kind == "hdf5" and cfg.data.path else None
    meta = {"trained_steps": step + 1, "seq_len": cfg.data.seq_len, "max_predictions": cfg.data.max_predictions}
    folder = write_model_folder(Path(output_dir) / FINAL_DIR, merge_stage_state_dicts(state_dicts), bert_config(cfg),
                                vocab=vocab, meta=meta)
    log.info("final weights (after %d steps) in %s: config.json, model.safetensors%s; export or fine-tune from "
             "this run folder", step + 1, folder, ", vocab.txt" if vocab else "")
    return folder


def data_source(cfg: TrainConfig):
    """The run's pretraining data source (identical on every worker: a function of the seed)."""
    return build_source(
        cfg.data.kind,
        path=cfg.data.path,
        seq_len=cfg.data.seq_len,
        max_predictions=cfg.data.max_predictions,
        vocab_size=cfg.model.vocab_size,
        seed=cfg.seed,
        num_samples=cfg.data.num_samples,
    )


def data_plan(cfg: TrainConfig) -> dict[str, int]:
    """Keyword arguments of :func:`pipefisher.data.get_micro_batch` for this run."""
    return {
        "micro_batch_size": cfg.micro_batch_size,
        "num_micro_batches": cfg.num_micro_batches,
        "dp_width": cfg.data_replicas,  # sdp replicas see different data too
    }


def device_type(name: str) -> str:
    """``"cuda"`` or ``"cpu"``: the kind of device :func:`resolve_device` gives for ``name``, without
    choosing a GPU (``resolve_device`` calls ``torch.cuda.set_device``; a worker calls it once, with its
    local rank)."""
    return "cpu" if name == "cpu" or (name == "auto" and not torch.cuda.is_available()) else "cuda"


def check_local_gpus(name: str, local_workers: int) -> None:
    """Refuse more workers on this machine than GPUs it shows: each worker needs a GPU of its own.

    Raises:
        ConfigError: naming the counts and the fix (no-op for a CPU run).
    """
    count = torch.cuda.device_count() if device_type(name) == "cuda" else local_workers
    if local_workers > count:
        raise ConfigError(f"device={name}: {local_workers} workers on this node but {count} GPU(s) visible; each "
                          "worker needs its own GPU: run at most that many workers per node (stages*data_parallel, "
                          "or more cluster.nodes), or device=cpu")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` → the local CUDA device when one is visible, else CPU; a worker's GPU is
    ``cuda:<local_rank>`` (set as the current device).

    Raises:
        ConfigError: ``local_rank`` has no GPU of its own (two ranks would share one).
    """
    if device_type(name) == "cpu":
        return torch.device("cpu")
    check_local_gpus(name, local_rank + 1)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def refresh_decay(factor_decay: float, per: str, interval: int) -> float:
    """The running-average decay applied at each K-FAC refresh: ``factor_decay ** interval`` when
    ``factor_decay_per`` is ``"step"`` (a refresh every k steps then forgets as fast per step as a
    refresh every step; bench/README.md §10 measured that 0.95 per refresh at k=2 loses K-FAC's gain
    and 0.95² keeps it), ``factor_decay`` when it is ``"refresh"`` (ASDL's and kfac-pytorch's rule)."""
    if per not in FACTOR_DECAY_UNITS:
        raise ValueError(f"optimizer.factor_decay_per={per!r}: choose one of {', '.join(FACTOR_DECAY_UNITS)}")
    return factor_decay ** interval if per == "step" else factor_decay


def set_cpu_threads(num_processes: int) -> int:
    """Give this process ``cores // processes`` intra-op threads (at least 1); returns the count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, num_processes))
    torch.set_num_threads(threads)
    return threads


def is_kfac_parameter(name: str) -> bool:
    """Whether the parameter called ``name`` belongs to a K-FAC layer (an encoder Linear layer,
    :data:`~pipefisher.optim.ENCODER_LINEAR_PATTERN`); prefixes such as ``"0.1."`` are allowed."""
    module, _, leaf = name.rpartition(".")
    return leaf in ("weight", "bias") and re.search(ENCODER_LINEAR_PATTERN, module) is not None


def make_optimizer(cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]], device: torch.device,
                   log_here: bool = True) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Optimizer and LR scheduler for the parameters one worker updates.

    ``optimizer=adamw`` / ``muon``: torch's AdamW, or torch's Muon on the encoder's Linear weights
    with AdamW for the rest (``pipefisher.optim.baselines``), clipped by the global norm like NVLAMB.
    With K-FAC and ``optimizer.kfac_update=momentum`` the K-FAC layers' parameters are updated by
    the momentum rule (``pipefisher.optim.nvlamb`` [Note: the momentum rule]) at ``optimizer.kfac_lr``
    under the same warm-up and decay; the rest by NVLAMB. Every group follows the same schedule.
    Muon's Newton–Schulz precision follows ``optimizer.ns_dtype`` and the device
    (:func:`~pipefisher.optim.muon.resolve_ns_dtype`), logged in one line when ``log_here``.
    """
    o = cfg.optimizer
    if o.name in BASELINE_OPTIMIZERS:
        ns_dtype, line = resolve_ns_dtype(o.ns_dtype, device)
        if o.name == "muon" and log_here:
            log.info("%s", line)
        opt = build_baseline_optimizer(o.name, named_params, lr=cfg.lr, weight_decay=o.weight_decay,
                                       max_grad_norm=o.max_grad_norm, betas=(o.beta1, o.beta2), eps=o.eps,
                                       muon_momentum=o.muon_momentum, ns_dtype=ns_dtype)
    else:
        opt = _nvlamb(cfg, named_params, device)
    sched = make_lr_scheduler(
        opt,
        warmup_steps=int(o.warmup_proportion * cfg.steps),
        total_steps=cfg.steps,
        power=o.poly_power,
    )
    return opt, sched


def _nvlamb(cfg: TrainConfig, named_params: list[tuple[str, torch.nn.Parameter]],
            device: torch.device) -> torch.optim.Optimizer:
    """NVLAMB (optimizer=nvlamb, and the base of kfac / pipefisher), with the momentum rule's groups."""
    o = cfg.optimizer
    momentum = o.name in KFAC_OPTIMIZERS and o.kfac_update == "momentum"
    return build_optimizer(
        "nvlamb",
        named_params,
        lr=cfg.lr,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        device=device,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        momentum=is_kfac_parameter if momentum else None,
        momentum_options={"lr": o.kfac_lr if o.kfac_lr is not None else cfg.lr,
                          "max_grad_norm": o.kfac_max_grad_norm} if momentum else None,
    )


@dataclass
class StepTimer:
    """Wall time of a step, synchronizing CUDA so queued kernels are counted."""

    device: torch.device
    _start: float = 0.0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._start


def autocast_context(cfg: TrainConfig, device: torch.device):
    """bf16 autocast when ``precision=bf16``, else a no-op context."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def progress_range(cfg: TrainConfig, enabled: bool, first: int = 0, stream: IO[str] | None = None) -> Iterator[int] | Any:
    """``range(first, cfg.steps)``, wrapped in a tqdm bar when ``enabled`` and ``cfg.progress``.

    A bar is for a terminal: where ``stream`` (stderr) is none (a log file, a job's output), a
    redrawn bar becomes a line per step, so the steps go in a :class:`LineProgress` instead (issue
    40, item 5).
    """
    steps = range(first, cfg.steps)
    if not (enabled and cfg.progress):
        return steps
    stream = stream if stream is not None else sys.stderr
    if not _is_terminal(stream):
        return LineProgress(steps, cfg.steps, every=cfg.log_every, stream=stream)
    from tqdm import tqdm

    return tqdm(steps, initial=first, total=cfg.steps, desc="train", unit="step", dynamic_ncols=True, file=stream)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class LineProgress:
    """The progress of a run whose output is no terminal: one line, as tqdm formats its bar, after
    the first step, every ``every`` steps (the steps whose loss the bar shows: ``log_every``) and
    the last, instead of a bar redrawn every step. Iterates the steps; ``set_postfix`` and
    ``close`` as tqdm's."""

    def __init__(self, steps: range, total: int, every: int, stream: IO[str], desc: str = "train") -> None:
        self.steps, self.total, self.every, self.stream, self.desc = steps, total, max(1, every), stream, desc
        self.postfix = ""
        self._start = time.monotonic()

    def __iter__(self) -> Iterator[int]:
        for step in self.steps:
            yield step  # the caller's step runs (and sets the postfix) before the line
            if step % self.every == 0 or step == self.total - 1:
                self._line(step + 1)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def close(self) -> None:
        self.stream.flush()

    def _line(self, done: int) -> None:
        from tqdm import tqdm

        line = tqdm.format_meter(done, self.total, time.monotonic() - self._start, prefix=self.desc, unit="step",
                                 postfix=self.postfix or None, initial=self.steps.start)
        self.stream.write(line + "\n")
        self.stream.flush()


def train_single_process(
    cfg: TrainConfig,
    output_dir: str | os.PathLike | None = None,
    wandb_logger: WandbLogger | None = None,
    model: BertStage | None = None,
) -> dict[str, Any]:
    """Train in this process with gradient accumulation over ``num_micro_batches``.

    Args:
        cfg: a validated run config with ``stages == data_parallel == 1``.
        output_dir: where ``metrics.jsonl`` goes (None: nowhere).
        wandb_logger: receives the same per-step metrics (None: no wandb).
        model: a prebuilt full model (tests); None builds it from ``cfg``.

    Returns:
        The last step's metrics.
    """
    if cfg.stages != 1 or cfg.data_parallel != 1:
        raise ValueError("train_single_process runs stages=1, data_parallel=1 only")
    from pipefisher.evaluation import eval_due, eval_source, evaluate_model  # they import this module
    from pipefisher.runtime.reporting import StepMeter, summary_fields, summary_line

    from pipefisher.measure import current_bytes

    device = resolve_device(cfg.device)
    if device.type == "cpu":
        set_cpu_threads(1)
    baseline = current_bytes(device)
    torch.manual_seed(cfg.seed)
    if model is None:
        model = build_full_model(bert_config(cfg), seed=cfg.seed, recompute=cfg.recompute)
    model.to(device).train()
    optimizer, scheduler = make_optimizer(cfg, list(model.named_parameters()), device)
    source = data_source(cfg)
    heldout = eval_source(cfg) if cfg.eval.every_steps > 0 else None
    plan = data_plan(cfg)
    timer = StepTimer(device)
    meter = StepMeter(cfg, device=device, reports=output_dir is not None, baseline_bytes=baseline)
    writer = MetricsWriter(Path(output_dir) / "metrics.jsonl") if output_dir is not None else None
    last: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    bar = progress_range(cfg, enabled=True)
    try:
        for step in bar:
            timer.start()
            meter.begin_step()
            lr = optimizer.param_groups[0]["lr"]
            totals = torch.zeros(2, device=device)
            for j in range(cfg.num_micro_batches):
                batch = {k: v.to(device, non_blocking=True) for k, v in get_micro_batch(source, step, j, 0, **plan).items()}
                with autocast_context(cfg, device), dropout_key(step, j):
                    losses = model(None, batch).float()  # [mlm, nsp]
                (losses.sum() / cfg.num_micro_batches).backward()
                totals += losses.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            totals = (totals / cfg.num_micro_batches).tolist()
            step_time = timer.stop()
            peak, _ = meter.end_step()
            last = {
                "step": step,
                "loss": totals[0] + totals[1],
                "mlm_loss": totals[0],
                "nsp_loss": totals[1],
                "lr": lr,
                "step_time_s": step_time,
                "samples_per_s": cfg.global_batch_size / step_time,
                **meter.rates(step_time),
                "peak_memory_bytes": peak,
                "peak_memory_per_worker_bytes": [peak],
                "memory_baseline_per_worker_bytes": [baseline],
            }
            if not math.isfinite(last["loss"]):
                raise FloatingPointError(f"step {step}: loss is {last['loss']}; lower lr or check the data")
            if heldout is not None and eval_due(cfg, step):
                last.update(evaluate_model(model, cfg, heldout, device, lambda: autocast_context(cfg, device)))
            rows.append(summary_fields(last))
            if writer is not None:
                writer.write(last)
            if wandb_logger is not None and (step % cfg.log_every == 0 or step == cfg.steps - 1 or "eval_mlm_loss" in last):
                wandb_logger.log(last, step=step)
            if hasattr(bar, "set_postfix") and step % cfg.log_every == 0:
                bar.set_postfix(loss=f"{last['loss']:.3f}", samples_per_s=f"{last['samples_per_s']:.0f}")
    finally:
        if writer is not None:
            writer.close()
        if hasattr(bar, "close"):
            bar.close()
    if output_dir is not None:
        log.info("%s", summary_line(rows, meter))
        if cfg.save_final and last:
            save_final_weights(cfg, [model.state_dict()], output_dir, last["step"])
    return last
