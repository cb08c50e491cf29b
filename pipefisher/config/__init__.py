"""Structured config schemas (registered in Hydra's ConfigStore) and cross-field validation.

Every YAML file under ``conf/`` extends one of these schemas through its defaults list, so a typo
or a wrong type fails at composition with Hydra's message. Checks that involve several fields
run once in :func:`validate` (reached from ``TrainConfig.__post_init__`` through
``OmegaConf.to_object``), before any worker process starts; each message names the field, the
value and the fix.

Import from here (``from pipefisher.config import TrainConfig``); the modules, lowest first:

- :mod:`~pipefisher.config.choices`: the name lists of choice-valued fields, :class:`ConfigError`, ``_fail``;
- :mod:`~pipefisher.config.batch`: global batch, micro-batch size and micro-batch count, and their ``auto``;
- :mod:`~pipefisher.config.checks`: checks of one group each (cluster, csv, eval, sdp, tp, checkpoint);
- :mod:`~pipefisher.config.validation`: :func:`validate`, the cross-field checks in their order;
- :mod:`~pipefisher.config.schema`: the dataclasses, :func:`register_configs`, :func:`to_train_config`;
- :mod:`~pipefisher.config.overrides`: command-line key checks before Hydra composes.
"""

from __future__ import annotations

from pipefisher.config.batch import (DEFAULT_GLOBAL_BATCH, micro_batch_rule, num_micro_batches_for, resolve_batch,
                                     schedule_method)
from pipefisher.config.choices import (CHIMERA_STACKINGS, DATA_KINDS, FACTOR_DECAY_UNITS, FAULT_MODES, INVERSE_DTYPES,
                                       KFAC_OPTIMIZERS, KFAC_UPDATES, NONFINITE_MODES, NS_DTYPES, OPTIMIZER_PLACEMENTS,
                                       OPTIMIZERS, PIPELINE_METHODS, PRECISIONS, PRECONDITIONERS, PROMOTE_INVERSES,
                                       RESUME_MODES, SDP_OPTIMIZERS, TP_OPTIMIZERS, V_METHODS, WANDB_MODES,
                                       ConfigError, _check_choice, _fail)
from pipefisher.config.overrides import check_override_keys, refuse_unknown_keys
from pipefisher.config.schema import (CheckpointConfig, ClusterConfig, DataConfig, EvalConfig, FaultConfig,
                                      HardwareConfig, ModelConfig, OptimizerConfig, PipelineConfig, ProfileConfig,
                                      TrainConfig, WandbConfig, register_configs, to_train_config)
from pipefisher.config.validation import validate

__all__ = [
    "ConfigError",
    "ModelConfig",
    "PipelineConfig",
    "OptimizerConfig",
    "DataConfig",
    "ClusterConfig",
    "WandbConfig",
    "ProfileConfig",
    "FaultConfig",
    "CheckpointConfig",
    "EvalConfig",
    "HardwareConfig",
    "TrainConfig",
    "check_override_keys",
    "refuse_unknown_keys",
    "micro_batch_rule",
    "num_micro_batches_for",
    "schedule_method",
    "register_configs",
    "resolve_batch",
    "to_train_config",
    "validate",
]
