"""Run tracking: ``metrics.jsonl`` beside Hydra's output, and wandb (offline by default).

Entry points: :class:`MetricsWriter` / :func:`read_metrics` and :class:`WandbLogger` with
:func:`run_name_from_overrides`.
"""

from pipefisher.tracking.metrics import EVAL_FIELDS, METRICS_FILE, MetricsWriter, read_metrics, to_python
from pipefisher.tracking.wandb_logger import (
    WANDB_MODES,
    WandbLogger,
    resolve_mode,
    run_name_from_overrides,
)

__all__ = [
    "EVAL_FIELDS",
    "METRICS_FILE",
    "MetricsWriter",
    "WANDB_MODES",
    "WandbLogger",
    "read_metrics",
    "resolve_mode",
    "run_name_from_overrides",
    "to_python",
]
