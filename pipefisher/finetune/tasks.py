"""A task's data, ready for the loop: training tensors, dev splits, and how to score a split.

:func:`build_task` reads the files a :class:`~pipefisher.finetune.config.TaskConfig` names (after
generating them for a toy task) and returns a :class:`ClassificationTask` or :class:`SpanTask`.
Both expose ``train`` (a dict of [N,...] tensors), ``splits`` (names of the dev splits) and
``evaluate(split, predict)``, where ``predict(tensors) -> logits`` runs the model over a split's
tensors in batches; the loop owns the model, the device and the batching.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import BertWordPieceTokenizer
from torch import Tensor

from pipefisher.data.prepare import load_tokenizer
from pipefisher.finetune.config import FinetuneConfig
from pipefisher.finetune.encoding import SpanFeatures, decode_spans, encode_classification, encode_spans
from pipefisher.finetune.heads import FinetuneModel
from pipefisher.finetune.metrics import accuracy, squad_scores
from pipefisher.finetune.readers import (
    ClassificationExample,
    SpanExample,
    read_glue_tsv,
    read_squad_json,
)
from pipefisher.finetune.toy import write_toy_task

__all__ = ["ClassificationTask", "SpanTask", "Task", "build_task", "resolve_task_files"]

log = logging.getLogger(__name__)

Predict = Callable[[dict[str, Tensor]], Tensor]  # split tensors -> logits [N,C] or [N,S,2]


@dataclass
class ClassificationTask:
    """Sentence (pair) classification; the metric is accuracy per dev split."""

    num_labels: int
    train: dict[str, Tensor]
    dev: dict[str, tuple[list[ClassificationExample], dict[str, Tensor]]]
    kind: str = "classification"
    train_examples: int = 0

    @property
    def splits(self) -> list[str]:
        return list(self.dev)

    def evaluate(self, split: str, predict: Predict, model: FinetuneModel) -> dict[str, Any]:
        """``accuracy``, ``loss``, ``num_examples``, ``num_sequences`` of one dev split."""
        _, tensors = self.dev[split]
        logits = predict(tensors).float()  # [N,C]
        loss = float(model.loss(logits, {"labels": tensors["labels"]}))
        predictions = logits.argmax(dim=1).tolist()
        n = len(predictions)
        return {"accuracy": accuracy(predictions, tensors["labels"].tolist()), "loss": loss,
                "num_examples": n, "num_sequences": n}


@dataclass
class SpanTask:
    """Span extraction; the metrics are SQuAD exact match and F1 (percent) per dev split."""

    train: dict[str, Tensor]
    dev: dict[str, tuple[list[SpanExample], SpanFeatures]]
    n_best: int = 20
    max_answer_len: int = 30
    version_2_with_negative: bool = False
    null_score_diff_threshold: float = 0.0
    kind: str = "span"
    train_examples: int = 0
    predictions: dict[str, dict[str, str]] = field(default_factory=dict)  # last predictions per split

    @property
    def splits(self) -> list[str]:
        return list(self.dev)

    def evaluate(self, split: str, predict: Predict, model: FinetuneModel) -> dict[str, Any]:
        """``exact_match``, ``f1`` (percent), ``num_examples`` (questions), ``num_sequences`` (windows)."""
        examples, features = self.dev[split]
        logits = predict(features.tensors).float()  # [N,S,2]
        start, end = FinetuneModel.span_logits(logits, features.tensors["input_mask"][:, : logits.size(1)])
        predictions = decode_spans(
            examples, features, start, end, n_best=self.n_best, max_answer_len=self.max_answer_len,
            version_2_with_negative=self.version_2_with_negative,
            null_score_diff_threshold=self.null_score_diff_threshold,
        )
        self.predictions[split] = predictions
        scores = squad_scores(predictions, {e.qid: e.answers for e in examples})
        return {"exact_match": scores["exact_match"], "f1": scores["f1"],
                "num_examples": len(examples), "num_sequences": len(features)}


Task = ClassificationTask | SpanTask


@dataclass(frozen=True)
class TaskFiles:
    """Resolved paths of a task's files and its vocabulary."""

    train: Path
    dev: dict[str, Path]
    vocab: Path


def resolve_task_files(cfg: FinetuneConfig, output_dir: str | Path) -> TaskFiles:
    """The task's file paths; a toy task's files (and vocab) are generated under ``output_dir/toy_data``."""
    t = cfg.task
    if t.toy.generate is not None:
        files = write_toy_task(t.toy.generate, Path(output_dir) / "toy_data", num_train=t.toy.num_train,
                               num_dev=t.toy.num_dev, num_words=t.toy.num_words, seed=t.toy.seed)
        return TaskFiles(files.data_dir / files.train_file,
                         {name: files.data_dir / rel for name, rel in files.dev_files.items()}, files.vocab)
    assert t.data_dir is not None and cfg.vocab is not None  # validate_finetune checked both
    root = Path(t.data_dir)
    return TaskFiles(root / t.train_file, {name: root / rel for name, rel in t.dev_files.items()}, Path(cfg.vocab))


def build_task(cfg: FinetuneConfig, output_dir: str | Path) -> tuple[Task, BertWordPieceTokenizer]:
    """Read (or generate) a task's files and tokenize them.

    Returns:
        The task and the tokenizer (its vocabulary size sizes a randomly initialized model).

    Raises:
        FinetuneDataError: a file is missing or malformed (file, line and field named).
        DataError: the vocab file is missing or lacks BERT's special tokens.
    """
    t = cfg.task
    files = resolve_task_files(cfg, output_dir)
    tokenizer = load_tokenizer(files.vocab, lowercase=cfg.lowercase)
    if t.kind == "classification":
        def read(path: Path, limit: int | None) -> list[ClassificationExample]:
            return read_glue_tsv(path, t.text_columns, t.label_column, t.labels, has_header=t.has_header,
                                 max_examples=limit)

        train_examples = read(files.train, cfg.max_train_examples)
        train = encode_classification(train_examples, tokenizer, t.max_seq_len)
        dev = {}
        for name, path in files.dev.items():
            examples = read(path, cfg.max_eval_examples)
            dev[name] = (examples, encode_classification(examples, tokenizer, t.max_seq_len))
        task: Task = ClassificationTask(num_labels=len(t.labels), train=train, dev=dev,
                                        train_examples=len(train_examples))
    else:
        windows = {"max_seq_len": t.max_seq_len, "max_query_len": t.max_query_len, "doc_stride": t.doc_stride}
        train_questions = read_squad_json(files.train, version_2_with_negative=t.version_2_with_negative,
                                          training=True, max_examples=cfg.max_train_examples)
        train_features = encode_spans(train_questions, tokenizer, training=True, **windows)
        dev_span = {}
        for name, path in files.dev.items():
            questions = read_squad_json(path, version_2_with_negative=t.version_2_with_negative,
                                        max_examples=cfg.max_eval_examples)
            dev_span[name] = (questions, encode_spans(questions, tokenizer, training=False, **windows))
        task = SpanTask(train=train_features.tensors, dev=dev_span, n_best=t.n_best,
                        max_answer_len=t.max_answer_len, version_2_with_negative=t.version_2_with_negative,
                        null_score_diff_threshold=t.null_score_diff_threshold,
                        train_examples=len(train_questions))
    num_train = len(task.train["input_ids"])
    log.info("task %s: %d training sequences from %d examples; dev splits %s", t.name, num_train,
             task.train_examples, {n: len(v[0]) for n, v in task.dev.items()})
    truncated = int((task.train["input_mask"][:, -1] == 1).sum())
    if truncated and t.kind == "classification":
        log.info("%d training sequences fill task.max_seq_len=%d (some may be truncated)", truncated, t.max_seq_len)
    return task, tokenizer
