"""The config schema of ``finetune.py`` (``finetune_schema`` and the ``task`` group's ``task_schema``).

It reuses train.py's ``model`` group and its ``wandb`` settings. Every ``conf/task/*.yaml``
extends :class:`TaskConfig`, so a typo in a task file or an override fails at composition. The
training hyper-parameters a task recommends (``task.lr``, ``task.batch_size``,
``task.num_epochs``) are used unless the top-level keys ``lr``, ``batch_size``, ``num_epochs`` are
given. Cross-field checks run once in :func:`validate` (reached from
``FinetuneConfig.__post_init__`` through ``OmegaConf.to_object``), before any data is read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipefisher.config import ConfigError, ModelConfig, WandbConfig, register_configs

__all__ = [
    "FINETUNE_OPTIMIZERS",
    "TASK_KINDS",
    "TOY_GENERATORS",
    "FinetuneConfig",
    "FinetuneOptimizerConfig",
    "InitConfig",
    "TaskConfig",
    "ToyConfig",
    "register_finetune_configs",
    "to_finetune_config",
    "validate_finetune",
]

log = logging.getLogger(__name__)

TASK_KINDS = ("classification", "span")
FINETUNE_OPTIMIZERS = ("adamw", "nvlamb", "kfac")
KFAC_BASES = ("adamw", "nvlamb")
TOY_GENERATORS = ("keyword", "pair_keyword", "squad")


@dataclass
class ToyConfig:
    """A built-in task generated from a seeded rule (no download); see :mod:`pipefisher.finetune.toy`."""

    generate: Optional[str] = None  # keyword, pair_keyword or squad: write the files and vocab; None = read task.data_dir
    num_train: int = 4000  # training examples to generate
    num_dev: int = 500  # examples per dev split
    num_words: int = 40  # toy words in the generated vocabulary (besides BERT's special tokens)
    seed: int = 1234  # seed of the generated data (independent of the run's seed)


@dataclass
class TaskConfig:
    """One fine-tuning task: where its files are, how to read them, and its recommended recipe."""

    name: str = "toy"  # label used in run names and tables
    kind: str = "classification"  # classification (GLUE-style TSV) or span (SQuAD-style JSON)
    data_dir: Optional[str] = None  # directory holding train_file and dev_files (toy tasks write their own files)
    train_file: str = "train.tsv"  # training file, relative to data_dir
    dev_files: dict[str, str] = field(default_factory=dict)  # split name -> file, e.g. {dev: dev.tsv}; MNLI: {matched: ..., mismatched: ...}
    text_columns: list[str] = field(default_factory=lambda: ["sentence"])  # classification: 1 or 2 columns, header names or 0-based indices
    label_column: str = "label"  # classification: header name or 0-based index of the label
    labels: list[str] = field(default_factory=lambda: ["0", "1"])  # classification: label strings; class i is labels[i]
    has_header: bool = True  # classification: the first line names the columns (CoLA's files have none)
    max_seq_len: int = 128  # tokens per sequence, [CLS] and [SEP]s included
    max_query_len: int = 64  # span: question tokens kept
    doc_stride: int = 128  # span: tokens between the starts of consecutive windows over a long context
    max_answer_len: int = 30  # span: longest predicted answer in tokens
    n_best: int = 20  # span: start and end candidates considered per window
    version_2_with_negative: bool = False  # span: SQuAD v2.0 (questions without an answer)
    null_score_diff_threshold: float = 0.0  # span v2: predict no answer when null score - best score > this
    lr: float = 3e-5  # recommended peak learning rate (top-level `lr` overrides)
    batch_size: int = 32  # recommended sequences per step (top-level `batch_size` overrides)
    num_epochs: float = 3.0  # recommended passes over the training set (top-level `num_epochs` or `steps` override)
    toy: ToyConfig = field(default_factory=ToyConfig)  # built-in generated task


@dataclass
class InitConfig:
    """Where the encoder's weights come from."""

    checkpoint: list[str] = field(default_factory=list)  # [] = random init; a state-dict .pt (merged or HF), one file per stage, or a pretraining checkpoint's step_<n> folder / worker shards


@dataclass
class FinetuneOptimizerConfig:
    """Optimizer: AdamW with linear warm-up and decay (BERT paper) by default; nvlamb or kfac."""

    name: str = "adamw"  # adamw, nvlamb or kfac
    weight_decay: float = 0.01  # decoupled weight decay (none on bias and LayerNorm)
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    eps: float = 1e-6  # Adam epsilon (BERT's value)
    max_grad_norm: float = 1.0  # global gradient-norm clip; <= 0 disables
    warmup_proportion: float = 0.1  # fraction of the steps with linear warm-up, then linear decay to 0
    kfac_base: str = "adamw"  # kfac: optimizer applied to the preconditioned gradient (adamw or nvlamb)
    damping: float = 1e-3  # kfac: damping λ
    factor_decay: float = 0.95  # kfac: running-average decay of the factors
    curvature_interval: int = 1  # kfac: refresh factors and inverses every k steps


@dataclass
class FinetuneConfig:
    """One fine-tuning run. ``None`` for lr, batch_size or num_epochs means the task's value."""

    model: ModelConfig = field(default_factory=ModelConfig)  # encoder size (group `model`); vocab_size follows the vocab or checkpoint
    task: TaskConfig = field(default_factory=TaskConfig)  # the task (group `task`)
    init: InitConfig = field(default_factory=InitConfig)  # initial weights
    optimizer: FinetuneOptimizerConfig = field(default_factory=FinetuneOptimizerConfig)  # optimizer
    wandb: WandbConfig = field(default_factory=WandbConfig)  # wandb (offline by default)

    vocab: Optional[str] = None  # the pretraining vocab.txt; None only for toy tasks (their vocab is generated)
    lowercase: bool = True  # uncased vocabulary (lower-case and strip accents)
    lr: Optional[float] = None  # peak learning rate; None = task.lr
    batch_size: Optional[int] = None  # training sequences per step; None = task.batch_size
    num_epochs: Optional[float] = None  # passes over the training set; None = task.num_epochs
    steps: Optional[int] = None  # optimizer steps; overrides num_epochs when set
    eval_every: Optional[int] = None  # evaluate every this many steps; None = after each epoch (always after the last step)
    eval_batch_size: int = 64  # sequences per evaluation batch
    max_train_examples: Optional[int] = None  # read at most this many training examples (quick runs)
    max_eval_examples: Optional[int] = None  # read at most this many examples per dev split
    classifier_dropout: Optional[float] = None  # dropout before the classifier; None = model.hidden_dropout
    seed: int = 0  # seed of the heads' init (and the encoder's when random), dropout and data order
    precision: str = "fp32"  # fp32 or bf16 (autocast)
    recompute: bool = False  # recompute encoder-layer activations in the backward pass
    device: str = "auto"  # auto (cuda if available), cpu or cuda
    cpu_flush_denormal: bool = True  # on CPU, flush subnormal floats to zero, as train.py does (docs/measuring.md)
    log_every: int = 10  # wandb and progress-bar interval in steps (metrics.jsonl gets every step)
    progress: bool = True  # show a progress bar
    save_model: bool = True  # write the fine-tuned weights to finetuned.pt in the run directory

    def __post_init__(self) -> None:
        if self.lr is None:
            self.lr = self.task.lr
        if self.batch_size is None:
            self.batch_size = self.task.batch_size
        if self.num_epochs is None:
            self.num_epochs = self.task.num_epochs
        validate_finetune(self)


def _fail(name: str, value: object, fix: str) -> None:
    raise ConfigError(f"{name}={value!r}: {fix}")


def _choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(name, value, f"choose one of {', '.join(choices)}")


def validate_finetune(cfg: FinetuneConfig) -> None:
    """Cross-field checks of a fine-tuning run.

    Raises:
        ConfigError: naming the field, its value and the fix, for the first problem found.
    """
    t, o, m = cfg.task, cfg.optimizer, cfg.model
    _choice("task.kind", t.kind, TASK_KINDS)
    _choice("optimizer.name", o.name, FINETUNE_OPTIMIZERS)
    _choice("optimizer.kfac_base", o.kfac_base, KFAC_BASES)
    _choice("precision", cfg.precision, ("fp32", "bf16"))
    _choice("device", cfg.device, ("auto", "cpu", "cuda"))
    _choice("wandb.mode", cfg.wandb.mode, ("offline", "online", "disabled"))
    if t.toy.generate is not None:
        _choice("task.toy.generate", t.toy.generate, TOY_GENERATORS)
        wanted = "span" if t.toy.generate == "squad" else "classification"
        if t.kind != wanted:
            _fail("task.kind", t.kind, f"task.toy.generate={t.toy.generate} makes a {wanted} task; set task.kind={wanted}")
    for name in ("batch_size", "eval_batch_size", "log_every", "model.num_layers", "model.hidden_size",
                 "task.max_seq_len", "task.max_query_len", "task.doc_stride", "task.max_answer_len",
                 "task.n_best", "task.toy.num_train", "task.toy.num_dev", "task.toy.num_words"):
        obj: object = cfg
        for part in name.split("."):
            obj = getattr(obj, part)
        if obj < 1:  # type: ignore[operator]
            _fail(name, obj, "must be at least 1")
    for name in ("steps", "eval_every", "max_train_examples", "max_eval_examples"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            _fail(name, value, "must be at least 1, or null")
    if not cfg.lr or cfg.lr <= 0:
        _fail("lr", cfg.lr, "the learning rate must be positive, e.g. lr=3e-5")
    if cfg.steps is None and not (cfg.num_epochs and cfg.num_epochs > 0):
        _fail("num_epochs", cfg.num_epochs, "must be positive (or set steps=<count>)")
    if not 0.0 <= o.warmup_proportion < 1.0:
        _fail("optimizer.warmup_proportion", o.warmup_proportion, "must lie in [0, 1)")
    if cfg.classifier_dropout is not None and not 0.0 <= cfg.classifier_dropout < 1.0:
        _fail("classifier_dropout", cfg.classifier_dropout, "a dropout probability must lie in [0, 1), or null")
    if m.hidden_size % m.num_heads:
        _fail("model.num_heads", m.num_heads, f"model.hidden_size={m.hidden_size} must be divisible by it")
    if t.max_seq_len > m.max_position_embeddings:
        _fail("task.max_seq_len", t.max_seq_len,
              f"exceeds model.max_position_embeddings={m.max_position_embeddings}; use task.max_seq_len<={m.max_position_embeddings}")
    if o.name == "kfac":
        if o.damping <= 0:
            _fail("optimizer.damping", o.damping, "K-FAC damping must be positive, e.g. optimizer.damping=1e-3")
        if not 0.0 <= o.factor_decay < 1.0:
            _fail("optimizer.factor_decay", o.factor_decay, "must lie in [0, 1)")
        if o.curvature_interval < 1:
            _fail("optimizer.curvature_interval", o.curvature_interval, "must be at least 1")

    if t.kind == "classification":
        if not 1 <= len(t.text_columns) <= 2:
            _fail("task.text_columns", list(t.text_columns), "give one column (single sentence) or two (sentence pair)")
        if len(t.labels) < 2 or len(set(t.labels)) != len(t.labels):
            _fail("task.labels", list(t.labels), "give at least two distinct label strings")
        if not t.has_header:
            bad = [c for c in [*t.text_columns, t.label_column] if not str(c).isdigit()]
            if bad:
                _fail("task.text_columns" if bad[0] in t.text_columns else "task.label_column", bad[0],
                      "without a header (task.has_header=false) columns are 0-based indices, e.g. task.label_column=1")
        if t.version_2_with_negative:
            log.warning("task.version_2_with_negative has no effect on a classification task")
    else:
        capacity = t.max_seq_len - t.max_query_len - 3
        if capacity < 1:
            _fail("task.max_query_len", t.max_query_len,
                  f"leaves no room for the context in task.max_seq_len={t.max_seq_len} "
                  f"([CLS] question [SEP] context [SEP]); use task.max_query_len<={t.max_seq_len - 4}")
        if t.doc_stride > capacity:
            _fail("task.doc_stride", t.doc_stride,
                  f"exceeds the context tokens per window ({capacity} = max_seq_len - max_query_len - 3), "
                  f"so tokens would be skipped; use task.doc_stride<={capacity}")

    if not t.dev_files:
        _fail("task.dev_files", dict(t.dev_files), "name at least one dev split, e.g. task.dev_files={dev: dev.tsv}")
    if t.toy.generate is None:
        if not t.data_dir:
            _fail("task.data_dir", t.data_dir,
                  f"task={t.name} reads files: set task.data_dir=<directory with {t.train_file}>")
        for rel in [t.train_file, *t.dev_files.values()]:
            path = os.path.join(t.data_dir, rel)
            if not os.path.isfile(path):
                _fail("task.data_dir", t.data_dir, f"{path} does not exist; download the task's files or fix the path")
        if not cfg.vocab:
            _fail("vocab", cfg.vocab, "give the pretraining vocab.txt, e.g. vocab=/data/bert/vocab.txt")
    elif cfg.vocab:
        log.warning("vocab=%s is ignored: task.toy.generate=%s writes its own vocabulary", cfg.vocab, t.toy.generate)
    if cfg.vocab and t.toy.generate is None and not os.path.isfile(cfg.vocab):
        _fail("vocab", cfg.vocab, "no such file; give the vocab.txt used for pretraining")
    for path in cfg.init.checkpoint:
        if not os.path.exists(path):
            _fail("init.checkpoint", list(cfg.init.checkpoint), f"{path} does not exist")
    if o.name != "kfac" and (o.kfac_base != "adamw" or o.curvature_interval != 1):
        log.warning("optimizer.kfac_base / optimizer.curvature_interval only matter with optimizer.name=kfac")
    if cfg.device == "cuda":
        import torch  # local: the config stays importable without touching CUDA at import time

        if not torch.cuda.is_available():
            _fail("device", "cuda", "no CUDA device is visible; use device=cpu or device=auto")


def to_finetune_config(cfg: DictConfig | FinetuneConfig) -> FinetuneConfig:
    """A validated :class:`FinetuneConfig` from the composed config (``hydra`` keys dropped)."""
    if isinstance(cfg, FinetuneConfig):
        validate_finetune(cfg)
        return cfg
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, FinetuneConfig):
        raise ConfigError("the composed config is not a FinetuneConfig; compose it with config_name='finetune'")
    return obj


def register_finetune_configs() -> None:
    """Register ``finetune_schema`` and ``task/task_schema`` (and train.py's group schemas)."""
    register_configs()
    cs = ConfigStore.instance()
    cs.store(name="finetune_schema", node=FinetuneConfig)
    cs.store(group="task", name="task_schema", node=TaskConfig)
