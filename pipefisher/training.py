"""Training in this process with ``stages=1`` and ``data_parallel=1`` (:func:`train_single_process`),
what ``pipefisher.launch.run_training`` runs for a plain one-process NVLAMB run.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.evaluation import eval_due, eval_source, evaluate_model
from pipefisher.measure import current_bytes
from pipefisher.model import BertStage, build_full_model
from pipefisher.model.rng import dropout_key
from pipefisher.optim.factory import make_optimizer
from pipefisher.run_spec import bert_config, data_plan, data_source
from pipefisher.runtime.device import autocast_context, resolve_device, set_cpu_threads
from pipefisher.runtime.final_weights import write_final_weights
from pipefisher.runtime.progress import progress_range
from pipefisher.runtime.reporting import StepMeter, summary_fields, summary_line
from pipefisher.runtime.step_timer import StepTimer
from pipefisher.tracking import MetricsWriter, WandbLogger

__all__ = ["train_single_process"]

log = logging.getLogger(__name__)


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
            write_final_weights(cfg, [model.state_dict()], output_dir, last["step"])
    return last
