"""The tests' oracle: single-process training in a plain loop, independent of the runtime.

Every run trains through the worker (``pipefisher.runtime.worker``, in this process when it has one
worker); the equivalence tests compare those runs with :func:`train_single_process`, which shares
nothing with them beyond the model, the data and the optimizer factory: no schedule, executor,
process group, metrics, evaluation or checkpoint.

[Note: loss and gradient scale]
The loss of a step is the mean over its micro-batches (and data-parallel replicas) of each
micro-batch's MLM + NSP loss; gradients are those of that mean. Every method (one process,
GPipe, 1F1B, Chimera, data parallel) uses this scale, so their losses and gradients are equal.

[Note: dropout masks]
Micro-batch j of step t runs under ``dropout_key(t, j)``, the key the pipeline executor gives the
same samples (``pipefisher.model.rng``): with dropout on, this loop is still the reference.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import BertStage, build_full_model
from pipefisher.model.rng import dropout_key
from pipefisher.optim.factory import make_optimizer
from pipefisher.run_spec import bert_config, data_plan, data_source
from pipefisher.tracking import MetricsWriter

__all__ = ["train_single_process", "one_thread"]


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the reference on one intra-op thread, as ``tests/dist_harness.py``'s workers run (a sum
    split over threads may round otherwise: Muon is compared exactly); the count is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_single_process(cfg: TrainConfig, output_dir: str | os.PathLike | None = None,
                         model: BertStage | None = None) -> dict[str, Any]:
    """Train ``cfg.steps`` steps in this process with gradient accumulation over ``num_micro_batches``.

    Args:
        cfg: a validated run config with ``stages == data_parallel == 1``. It runs on the caller's
            intra-op threads (:func:`one_thread` to match the harness's workers).
        output_dir: where ``metrics.jsonl`` goes (step, loss, mlm_loss, nsp_loss, lr per step; None: nowhere).
        model: a prebuilt full model (trained in place); None builds it from ``cfg``.

    Returns:
        The last step's row.
    """
    if cfg.stages != 1 or cfg.data_parallel != 1:
        raise ValueError("train_single_process runs stages=1, data_parallel=1 only")
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    torch.manual_seed(cfg.seed)
    if model is None:
        model = build_full_model(bert_config(cfg), seed=cfg.seed, recompute=cfg.recompute)
    model.to(device).train()
    optimizer, scheduler = make_optimizer(cfg, list(model.named_parameters()), device)
    source, plan = data_source(cfg), data_plan(cfg)
    writer = MetricsWriter(Path(output_dir) / "metrics.jsonl") if output_dir is not None else None
    last: dict[str, Any] = {}
    try:
        for step in range(cfg.steps):
            lr = optimizer.param_groups[0]["lr"]
            totals = torch.zeros(2, device=device)
            for j in range(cfg.num_micro_batches):
                batch = {k: v.to(device) for k, v in get_micro_batch(source, step, j, 0, **plan).items()}
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"), \
                        dropout_key(step, j):
                    losses = model(None, batch).float()  # [mlm, nsp]
                (losses.sum() / cfg.num_micro_batches).backward()
                totals += losses.detach()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            mlm, nsp = (totals / cfg.num_micro_batches).tolist()
            last = {"step": step, "loss": mlm + nsp, "mlm_loss": mlm, "nsp_loss": nsp, "lr": lr}
            if not math.isfinite(last["loss"]):
                raise FloatingPointError(f"step {step}: loss is {last['loss']}")
            if writer is not None:
                writer.write(last)
    finally:
        if writer is not None:
            writer.close()
    return last
