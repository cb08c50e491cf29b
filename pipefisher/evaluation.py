"""Held-out evaluation: when it runs, its batches, its figures, and the single-process evaluator.

[Note: held-out evaluation]
``eval.every_steps=n`` evaluates after every n-th step (steps n−1, 2n−1, … counted from 0, as
checkpoints are) and after the last step, on the same ``eval.batches`` held-out micro-batches each
time: micro-batch i holds held-out samples i·B … i·B+B−1 in storage order
(``pipefisher.data.heldout``), whatever the training order, the seed or the pipeline. Dropout is
off and nothing is trained: parameters, optimizer state, RNG streams and K-FAC factors are left as
they were, so the run's trajectory is the one without evaluation. The figures are added to the row
of the step they follow in ``metrics.jsonl``:

    eval_mlm_loss      summed MLM cross-entropy over all real masked slots ÷ their count
    eval_mlm_accuracy  masked slots whose argmax is the label ÷ their count
    eval_nsp_loss      NSP cross-entropy, mean over the sequences
    eval_nsp_accuracy  right NSP predictions ÷ sequences
    eval_time_s        the evaluation's wall time (not part of step_time_s)

(the training ``mlm_loss`` is a mean of micro-batch means; the held-out one weighs every masked
slot alike). Pipelines evaluate through their own placement with a forward-only schedule
(``pipefisher.runtime.evaluation``); :func:`evaluate_model` is the single-process evaluation,
the reference the pipeline tests compare with.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from pipefisher.config import TrainConfig
from pipefisher.data.heldout import HeldoutSource, build_eval_source, check_eval_batches, eval_micro_batch
from pipefisher.model import EVAL_SUMS, BertStage
from pipefisher.tracking.metrics import EVAL_FIELDS

__all__ = ["EVAL_FIELDS", "eval_due", "eval_source", "eval_batch", "eval_figures", "evaluate_folder", "evaluate_model"]



def eval_due(cfg: TrainConfig, step: int) -> bool:
    """Whether the run evaluates after ``step`` ([Note: held-out evaluation])."""
    n = cfg.eval.every_steps
    return n > 0 and ((step + 1) % n == 0 or step == cfg.steps - 1)


def eval_source(cfg: TrainConfig) -> HeldoutSource:
    """The run's held-out source, checked to hold ``eval.batches`` micro-batches.

    Raises:
        DataError: no held-out data, or too little of it (the message names the field and the fix).
    """
    source = build_eval_source(cfg.data.kind, path=cfg.data.path, eval_path=cfg.data.eval_path,
                               seq_len=cfg.data.seq_len, max_predictions=cfg.data.max_predictions,
                               vocab_size=cfg.model.vocab_size, seed=cfg.seed, num_samples=cfg.data.num_samples)
    check_eval_batches(source, cfg.eval.batches, cfg.micro_batch_size)
    return source


def eval_batch(source: HeldoutSource, cfg: TrainConfig, index: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Held-out micro-batch ``index`` on ``device``."""
    batch = eval_micro_batch(source, index, cfg.micro_batch_size)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def eval_figures(sums: torch.Tensor, seconds: float) -> dict[str, float]:
    """The row fields of an evaluation from its summed :data:`~pipefisher.model.EVAL_SUMS`."""
    s = dict(zip(EVAL_SUMS, sums.double().cpu().tolist()))
    slots, seqs = max(s["mlm_count"], 1.0), max(s["nsp_count"], 1.0)
    return {"eval_mlm_loss": s["mlm_loss_sum"] / slots, "eval_mlm_accuracy": s["mlm_correct"] / slots,
            "eval_nsp_loss": s["nsp_loss_sum"] / seqs, "eval_nsp_accuracy": s["nsp_correct"] / seqs,
            "eval_time_s": seconds}


def evaluate_model(model: BertStage, cfg: TrainConfig, source: HeldoutSource, device: torch.device,
                   autocast: Any = None) -> dict[str, float]:
    """Evaluate a whole model in this process on the run's held-out micro-batches.

    Args:
        model: the full model (all pipeline layers); its train/eval mode is restored afterwards.
        autocast: a context factory around each forward (None: none).

    Returns:
        The figures of :func:`eval_figures`.
    """
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    sums = torch.zeros(len(EVAL_SUMS), dtype=torch.float64, device=device)
    try:
        with torch.no_grad():
            for i in range(cfg.eval.batches):
                batch = eval_batch(source, cfg, i, device)
                with autocast() if autocast is not None else contextlib.nullcontext():
                    sums += model.evaluate(None, batch)
    finally:
        model.train(was_training)
    return eval_figures(sums, time.perf_counter() - start)


def evaluate_folder(folder: str | os.PathLike, shards: str | os.PathLike, *, batches: int, micro_batch_size: int,
                    seq_len: int, max_predictions: int) -> dict[str, float]:
    """Evaluate a model folder (a run's ``final/``, `pipefisher.model.hf_format`) on held-out shards the
    way a run evaluates ([Note: held-out evaluation]): micro-batches ``0 .. batches-1`` of
    ``micro_batch_size`` in storage order, dropout off, on the CPU in this process. A run that
    evaluated on ``shards`` after its last step reports the same figures (its weights are these).

    Args:
        folder: the model folder.
        shards: held-out hdf5 shards (a file or a folder), with the model's vocabulary.
        batches, micro_batch_size: the held-out set: ``batches × micro_batch_size`` sequences.
        seq_len, max_predictions: the shards' widths (checked).

    Returns:
        The figures of :func:`eval_figures`.

    Raises:
        ValueError: not a model folder. DataError: shards of other widths or too few sequences.
    """
    from pipefisher.data.hdf5 import Hdf5Source, check_widths
    from pipefisher.model import build_full_model, load_hf_state_dict
    from pipefisher.model.hf_format import read_model_folder

    saved = read_model_folder(folder)
    model = build_full_model(saved.config)
    load_hf_state_dict(model, saved.state_dict)
    source = Hdf5Source(shards, 0, vocab_size=saved.config.vocab_size)
    check_widths(source, seq_len, max_predictions)
    check_eval_batches(source, batches, micro_batch_size)
    start = time.perf_counter()
    model.eval()
    sums = torch.zeros(len(EVAL_SUMS), dtype=torch.float64)
    with torch.no_grad():
        for i in range(batches):
            sums += model.evaluate(None, eval_micro_batch(source, i, micro_batch_size))
    return eval_figures(sums, time.perf_counter() - start)
