"""The fine-tuning loop: build the model and optimizer, train, evaluate every dev split, log.

One process (no data parallelism). Each step takes ``batch_size`` training sequences in a seeded
order (a fresh permutation per epoch), trimmed to the batch's longest row. Every step writes a
``{"kind": "train", ...}`` record to ``metrics.jsonl`` in the run directory; every evaluation
writes one ``{"kind": "eval", "split": ..., ...}`` record per dev split (accuracy, or SQuAD exact
match and F1 in percent); wandb gets the same under ``train/*`` and ``eval/<split>/*``.
``samples_per_s`` counts examples (questions for spans), ``sequences_per_s`` the model's input
rows (a long SQuAD context gives several windows; for classification both are equal).

[Note: learning-rate schedule] (BERT paper, appendix A.2) linear warm-up over the first
``warmup_proportion`` of the steps, then linear decay to 0 at the last step. Step k (0-based)
uses ``lr · (k + 1) / W`` while k < W, then ``lr · (T − k) / (T − W)`` (W = warm-up steps, T = total
steps): step 0 already has a positive rate, the peak is reached at the end of warm-up, and the
rate would reach 0 one step after the last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from pipefisher.config import ConfigError
from pipefisher.finetune.checkpoint import load_checkpoint, load_encoder_weights, warn_if_collapsed
from pipefisher.finetune.config import FinetuneConfig
from pipefisher.finetune.encoding import trim
from pipefisher.finetune.heads import FinetuneModel
from pipefisher.finetune.pretraining_check import mlm_information, warn_if_frequency_only
from pipefisher.finetune.tasks import SpanTask, Task, build_task
from pipefisher.model import WORD_EMBEDDINGS_NAME, BertConfig
from pipefisher.optim import KFAC, build_optimizer, param_groups
from pipefisher.runtime.device import resolve_device, set_flush_denormal
from pipefisher.runtime.step_timer import StepTimer
from pipefisher.tracking import MetricsWriter, WandbLogger, run_name_from_overrides

__all__ = ["ClippedAdamW", "FinetuneResult", "build_model", "finetune", "linear_warmup_decay", "run_finetune"]

log = logging.getLogger(__name__)

_MODEL_INPUTS = ("input_ids", "segment_ids", "input_mask")


@dataclass
class FinetuneResult:
    """What a run produced. ``evals`` holds every evaluation record, ``final`` the last per split."""

    model: FinetuneModel
    steps: int
    train: dict[str, Any]
    evals: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, dict[str, Any]] = field(default_factory=dict)
    init_encoder: dict[str, Tensor] = field(default_factory=dict)  # encoder weights right after loading
    random_init: list[str] = field(default_factory=list)  # encoder names not taken from the checkpoint

    @property
    def main_metric(self) -> float:
        """Accuracy (classification) or F1 (spans) of the first dev split at the last evaluation."""
        first = next(iter(self.final.values()))
        return float(first.get("accuracy", first.get("f1", math.nan)))


# --------------------------------------------------------------------------------------------
# Model and optimizer
# --------------------------------------------------------------------------------------------


def build_model(cfg: FinetuneConfig, vocab_size: int, num_labels: int,
                state: Mapping[str, Tensor] | None = None) -> tuple[FinetuneModel, list[str]]:
    """The model, with the encoder from ``init.checkpoint`` when given.

    Args:
        cfg: the run's config (``model`` sizes; ``init.checkpoint``).
        vocab_size: the tokenizer's vocabulary size: the embedding rows of a random-init model;
            with a checkpoint, its rows must be at least this.
        num_labels: classes of a classification task.
        state: the checkpoint when the caller has read it already (None: read ``init.checkpoint``).

    Returns:
        The model and the encoder names left at random init (see :func:`load_encoder_weights`).

    Raises:
        ConfigError: the checkpoint does not fit ``model`` or the vocabulary.
    """
    m = cfg.model
    sizes: dict[str, int] = {"vocab_size": vocab_size, "max_position_embeddings": m.max_position_embeddings,
                             "type_vocab_size": m.type_vocab_size}
    if state is None and cfg.init.checkpoint:
        state = load_checkpoint(cfg.init.checkpoint)
    if state is not None:
        rows = int(state[WORD_EMBEDDINGS_NAME].shape[0])
        if rows < vocab_size:
            raise ConfigError(f"vocab={cfg.vocab}: {vocab_size} tokens, but the checkpoint's embeddings have {rows} rows; "
                              "give the vocab.txt the checkpoint was pretrained with")
        sizes["vocab_size"] = rows
        for key, name in (("max_position_embeddings", "position_embeddings"), ("type_vocab_size", "token_type_embeddings")):
            tensor = state.get(f"bert.embeddings.{name}.weight")
            if tensor is not None:
                sizes[key] = int(tensor.shape[0])
        if cfg.task.max_seq_len > sizes["max_position_embeddings"]:
            raise ConfigError(f"task.max_seq_len={cfg.task.max_seq_len}: the checkpoint has only "
                              f"{sizes['max_position_embeddings']} positions; lower task.max_seq_len")
    elif m.vocab_size != vocab_size:
        log.info("model.vocab_size=%d replaced by the vocabulary's %d tokens (random init)", m.vocab_size, vocab_size)
    config = BertConfig(hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                        intermediate_size=m.intermediate_size, hidden_dropout=m.hidden_dropout,
                        attention_dropout=m.attention_dropout, **sizes)
    model = FinetuneModel(config, cfg.task.kind, num_labels=num_labels, seed=cfg.seed, recompute=cfg.recompute,
                          classifier_dropout=cfg.classifier_dropout)
    random_init = load_encoder_weights(model, state) if state is not None else []
    return model, random_init


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that first clips all gradients by one global norm, taking ``step(grad_norm=...)``
    like the project's other optimizers (so it can be K-FAC's base optimizer)."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float], eps: float, max_grad_norm: float) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps)
        self.max_grad_norm = float(max_grad_norm)

    def step(self, closure: Any = None, *, grad_norm: Tensor | float | None = None) -> Any:  # type: ignore[override]
        if self.max_grad_norm > 0:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grad_norm is None:
                torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
            else:
                coefficient = min(1.0, self.max_grad_norm / (float(grad_norm) + 1e-6))
                torch._foreach_mul_([p.grad for p in params], coefficient)
        return super().step(closure)


def linear_warmup_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak lr at 0-based ``step`` (see [Note: learning-rate schedule])."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


@dataclass(frozen=True)
class _LinearFactor:
    """Picklable ``LambdaLR`` multiplier."""

    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        return linear_warmup_decay(step, self.warmup_steps, self.total_steps)


class _Updater:
    """One interface over a plain optimizer and K-FAC in front of one."""

    def __init__(self, cfg: FinetuneConfig, model: nn.Module, device: torch.device, total_steps: int) -> None:
        o = cfg.optimizer
        assert cfg.lr is not None
        base = o.kfac_base if o.name == "kfac" else o.name
        named = list(model.named_parameters())
        if base == "adamw":
            optimizer: torch.optim.Optimizer = ClippedAdamW(param_groups(named, o.weight_decay), lr=cfg.lr,
                                                            betas=(o.beta1, o.beta2), eps=o.eps,
                                                            max_grad_norm=o.max_grad_norm)
        else:
            optimizer = build_optimizer("nvlamb", named, cfg.lr, o.weight_decay, o.max_grad_norm, device,
                                        betas=(o.beta1, o.beta2), eps=o.eps)
        self.optimizer = optimizer
        self.kfac = None
        if o.name == "kfac":
            # Only the encoder's Linear layers are preconditioned (the reference work's choice).
            self.kfac = KFAC(model, cfg.lr, optimizer=optimizer, damping=o.damping, factor_decay=o.factor_decay,
                             curvature_interval=o.curvature_interval, inverse_interval=o.curvature_interval)
        warmup = int(o.warmup_proportion * total_steps)
        self.scheduler = LambdaLR(optimizer, _LinearFactor(warmup, total_steps))

    def forward_context(self, step: int) -> contextlib.AbstractContextManager[None]:
        if self.kfac is None:
            return contextlib.nullcontext()
        self.kfac.on_step_start(step)
        return self.kfac.micro_batch(0)

    def step(self, step: int) -> None:
        if self.kfac is not None:
            self.kfac.step(step)
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------
# Loop
# --------------------------------------------------------------------------------------------


def _batches(n: int, batch_size: int, seed: int) -> Iterator[tuple[int, Tensor]]:
    """(epoch, row indices) forever: a seeded permutation per epoch, cut into batches."""
    epoch = 0
    while True:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for start in range(0, n, batch_size):
            yield epoch, order[start:start + batch_size]
        epoch += 1


def _autocast(cfg: FinetuneConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def _predictor(cfg: FinetuneConfig, model: FinetuneModel, device: torch.device):
    """``predict(tensors) -> logits`` over a split in eval mode, fp32 on CPU, padded to the split's S."""

    def predict(tensors: dict[str, Tensor]) -> Tensor:
        was_training = model.training
        model.eval()
        outputs = []
        n, seq_len = tensors["input_ids"].shape
        try:
            with torch.no_grad(), _autocast(cfg, device):
                for start in range(0, n, cfg.eval_batch_size):
                    batch = trim({k: tensors[k][start:start + cfg.eval_batch_size] for k in _MODEL_INPUTS})
                    logits = model({k: v.to(device).long() for k, v in batch.items()}).float().cpu()
                    if logits.dim() == 3:  # spans [B,S',2] -> [B,S,2]
                        logits = F.pad(logits, (0, 0, 0, seq_len - logits.size(1)))
                    outputs.append(logits)
        finally:
            model.train(was_training)
        return torch.cat(outputs)

    return predict


def _evaluate(cfg: FinetuneConfig, task: Task, model: FinetuneModel, device: torch.device, step: int) -> list[dict[str, Any]]:
    records = []
    predict = _predictor(cfg, model, device)
    for split in task.splits:
        timer = StepTimer(device)
        timer.start()
        metrics = task.evaluate(split, predict, model)
        seconds = max(timer.stop(), 1e-9)
        records.append({"kind": "eval", "step": step, "split": split, **metrics, "eval_time_s": seconds,
                        "samples_per_s": metrics["num_examples"] / seconds,
                        "sequences_per_s": metrics["num_sequences"] / seconds})
    return records


def _wandb_eval(record: dict[str, Any]) -> dict[str, Any]:
    skip = ("kind", "step", "split")
    return {f"eval/{record['split']}/{k}": v for k, v in record.items() if k not in skip}


def finetune(cfg: FinetuneConfig, output_dir: str | Path, wandb_logger: WandbLogger | None = None) -> FinetuneResult:
    """Fine-tune and evaluate as ``cfg`` says; writes ``metrics.jsonl`` (and the model) to ``output_dir``.

    Args:
        cfg: a validated config.
        output_dir: the run directory (Hydra's output directory from the command line).
        wandb_logger: receives the same metrics (None: no wandb).

    Returns:
        The model, the last training record and every evaluation.

    Raises:
        ConfigError, DataError: bad settings or files, before the first step.
        FloatingPointError: the training loss became NaN or infinite.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    set_flush_denormal(cfg.cpu_flush_denormal, device)  # runtime.device [Note: subnormals on CPU]
    torch.manual_seed(cfg.seed)
    task, tokenizer = build_task(cfg, out)
    num_labels = getattr(task, "num_labels", 2)
    state = load_checkpoint(cfg.init.checkpoint) if cfg.init.checkpoint else None
    model, random_init = build_model(cfg, tokenizer.get_vocab_size(), num_labels, state)
    if state is not None:  # a pretrained encoder that ignores its input: say so in one line (issues 24, 40)
        sample = trim({k: task.train[k][:32].long() for k in _MODEL_INPUTS})
        specials = tuple(i for t in ("[CLS]", "[SEP]", "[PAD]") if (i := tokenizer.token_to_id(t)) is not None)
        info = mlm_information(model, state, sample, tokenizer.token_to_id("[MASK]"), specials)
        if info is not None:
            log.info("init.checkpoint: MLM predictions carry %.2f nats of token frequency and %.4f of context "
                     "(%d masked positions)", info.frequency_nats, info.context_nats, info.positions)
        if not warn_if_frequency_only(info):
            warn_if_collapsed(model, sample)
        del state
    init_encoder = {k: v.detach().clone() for k, v in model.encoder_state_dict().items()}
    model.to(device).train()

    assert cfg.batch_size is not None and cfg.num_epochs is not None
    n_train = len(task.train["input_ids"])
    per_epoch = math.ceil(n_train / cfg.batch_size)
    total = cfg.steps or max(1, math.ceil(cfg.num_epochs * per_epoch))
    updater = _Updater(cfg, model, device, total)
    log.info("fine-tuning %s: %d steps (%.2f epochs of %d batches), optimizer %s, device %s", cfg.task.name, total,
             total / per_epoch, per_epoch, cfg.optimizer.name, device)

    timer = StepTimer(device)
    has_examples = "example_index" in task.train
    last_train: dict[str, Any] = {}
    evals: list[dict[str, Any]] = []
    batches = _batches(n_train, cfg.batch_size, cfg.seed)
    bar: Any = range(total)
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"finetune {cfg.task.name}", unit="step", dynamic_ncols=True)
    with MetricsWriter(out / "metrics.jsonl") as writer:
        for step in bar:
            _, rows = next(batches)
            batch = trim({k: v[rows] for k, v in task.train.items()})
            timer.start()
            lr = updater.optimizer.param_groups[0]["lr"]
            device_batch = {k: v.to(device, non_blocking=True).long() for k, v in batch.items()}
            with updater.forward_context(step), _autocast(cfg, device):
                logits = model(device_batch)
            loss = model.loss(logits, device_batch)
            loss.backward()
            updater.step(step)
            loss_value = float(loss.detach())
            seconds = max(timer.stop(), 1e-9)
            if not math.isfinite(loss_value):
                raise FloatingPointError(f"step {step}: training loss is {loss_value}; lower lr (now {cfg.lr})")
            samples = len(torch.unique(batch["example_index"])) if has_examples else len(rows)
            last_train = {"kind": "train", "step": step, "epoch": step / per_epoch, "loss": loss_value, "lr": lr,
                          "step_time_s": seconds, "samples_per_s": samples / seconds,
                          "sequences_per_s": len(rows) / seconds}
            writer.write(last_train)
            if wandb_logger is not None and (step % cfg.log_every == 0 or step == total - 1):
                wandb_logger.log({f"train/{k}": v for k, v in last_train.items() if k not in ("kind", "step")}, step=step)
            if hasattr(bar, "set_postfix") and step % cfg.log_every == 0:
                bar.set_postfix(loss=f"{loss_value:.3f}")
            done = step + 1
            due = done % cfg.eval_every == 0 if cfg.eval_every else done % per_epoch == 0
            if due or done == total:
                records = _evaluate(cfg, task, model, device, step)
                for record in records:
                    writer.write(record)
                    if wandb_logger is not None:
                        wandb_logger.log(_wandb_eval(record), step=step)
                    log.info("step %d %s: %s", step, record["split"],
                             {k: round(v, 4) for k, v in record.items() if k in ("accuracy", "exact_match", "f1", "loss")})
                evals.extend(records)
    if hasattr(bar, "close"):
        bar.close()
    if cfg.save_model:
        torch.save(model.state_dict(), out / "finetuned.pt")
    if isinstance(task, SpanTask):
        for split, predictions in task.predictions.items():
            (out / f"predictions_{split}.json").write_text(json.dumps(predictions, indent=1), encoding="utf-8")
    final = {r["split"]: r for r in evals if r["step"] == evals[-1]["step"]}
    return FinetuneResult(model=model, steps=total, train=last_train, evals=evals, final=final,
                          init_encoder=init_encoder, random_init=random_init)


def run_finetune(cfg: FinetuneConfig, output_dir: str | Path, overrides: list[str] | None = None,
                 sweep_dir: str | None = None) -> FinetuneResult:
    """:func:`finetune` with a wandb run (offline by default) named after the overrides."""
    group = cfg.wandb.group or (Path(sweep_dir).name if sweep_dir else None)
    logger = WandbLogger(asdict(cfg), project=cfg.wandb.project, group=group,
                         name=run_name_from_overrides(overrides or []), mode=cfg.wandb.mode, dir=str(output_dir),
                         tags=["finetune", cfg.task.name])
    try:
        return finetune(cfg, output_dir, logger)
    finally:
        logger.finish()
