"""Fine-tuning and evaluation on GLUE-style classification and SQuAD-style span tasks.

Entry points: ``finetune.py`` (:func:`~pipefisher.finetune.cli.finetune_main`), :func:`finetune`
(the loop, from a :class:`FinetuneConfig`), :func:`build_task` (files -> tensors and scoring),
the readers :func:`read_glue_tsv` / :func:`read_squad_json`, the metrics (:func:`squad_scores`,
:func:`exact_match_score`, :func:`f1_score`, :func:`accuracy`) and :class:`FinetuneModel` (task
heads on ``pipefisher.model``'s encoder). The encoder is never re-implemented here.
"""

from pipefisher.finetune.checkpoint import checkpoint_layers, load_checkpoint, load_encoder_weights
from pipefisher.finetune.config import (
    FinetuneConfig,
    FinetuneOptimizerConfig,
    InitConfig,
    TaskConfig,
    ToyConfig,
    register_finetune_configs,
    to_finetune_config,
)
from pipefisher.finetune.encoding import decode_spans, encode_classification, encode_spans
from pipefisher.finetune.heads import FinetuneModel
from pipefisher.finetune.loop import FinetuneResult, build_model, finetune, linear_warmup_decay, run_finetune
from pipefisher.finetune.metrics import accuracy, exact_match_score, f1_score, normalize_answer, squad_scores
from pipefisher.finetune.readers import (
    ClassificationExample,
    FinetuneDataError,
    SpanExample,
    read_glue_tsv,
    read_squad_json,
)
from pipefisher.finetune.tasks import ClassificationTask, SpanTask, build_task
from pipefisher.finetune.toy import write_toy_task

__all__ = [
    "ClassificationExample",
    "ClassificationTask",
    "FinetuneConfig",
    "FinetuneDataError",
    "FinetuneModel",
    "FinetuneOptimizerConfig",
    "FinetuneResult",
    "InitConfig",
    "SpanExample",
    "SpanTask",
    "TaskConfig",
    "ToyConfig",
    "accuracy",
    "build_model",
    "build_task",
    "checkpoint_layers",
    "decode_spans",
    "encode_classification",
    "encode_spans",
    "exact_match_score",
    "f1_score",
    "finetune",
    "linear_warmup_decay",
    "load_checkpoint",
    "load_encoder_weights",
    "normalize_answer",
    "read_glue_tsv",
    "read_squad_json",
    "register_finetune_configs",
    "run_finetune",
    "squad_scores",
    "to_finetune_config",
    "write_toy_task",
]
