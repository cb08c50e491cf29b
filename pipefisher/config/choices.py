"""What each choice-valued field accepts (the name lists), :class:`ConfigError`, and the two helpers every
check fails through (``_fail``, ``_check_choice``): the bottom of ``pipefisher.config``, imported by all its modules."""

from __future__ import annotations

from typing import Any

PIPELINE_METHODS = ("gpipe", "1f1b", "chimera", "interleaved", "zb-h1", "zb-v", "dualpipev", "v-half", "v-min",
                    "csv")  # csv: pipeline.csv, a torch schedule file
V_METHODS = ("zb-v", "dualpipev", "v-half", "v-min")  # two chunks per worker in a V (pipefisher.schedules.v_schedules)
CHIMERA_STACKINGS = ("direct", "doubling")  # pipeline.chimera_stacking (Chimera paper, Sec. 3.5)
FACTOR_DECAY_UNITS = ("step", "refresh")  # optimizer.factor_decay_per
PROMOTE_INVERSES = ("at_cycle_end", "when_ready")  # optimizer.promote_inverses (as pipefisher.schedules.kfac's)
OPTIMIZERS = ("nvlamb", "kfac", "pipefisher", "adamw", "muon")
KFAC_OPTIMIZERS = ("kfac", "pipefisher")  # the optimizers that run K-FAC work (preconditioners, a refresh plan)
PRECONDITIONERS = ("kfac", "ekfac")  # optimizer.preconditioner (as pipefisher.optim.PRECONDITIONERS)
DATA_KINDS = ("synthetic", "hdf5")
PRECISIONS = ("fp32", "bf16")
WANDB_MODES = ("offline", "online", "disabled")
FAULT_MODES = ("none", "raise", "kill", "stall", "nan", "nan_grad")
OPTIMIZER_PLACEMENTS = ("global", "per_stage")
NONFINITE_MODES = ("stop", "skip")
INVERSE_DTYPES = ("auto", "float32", "float64")
NS_DTYPES = ("auto", "bf16", "fp32")  # optimizer.ns_dtype (pipefisher.optim.muon.NS_DTYPES)
NS_OWNERS = ("holder", "pipeline")  # optimizer.ns_owners (pipefisher.runtime.ns_spread)
KFAC_OWNERS = ("holder", "replicas")  # optimizer.kfac_owners (pipefisher.runtime.kfac_owners)
ADAMW_KERNELS = ("auto", "foreach", "fused")  # optimizer.adamw_kernel (pipefisher.optim.baselines.ADAMW_KERNELS)
KFAC_UPDATES = ("lamb", "momentum")
RESUME_MODES = ("none", "auto")  # or a path to a checkpoint (step_<n>) or a checkpoint directory
SDP_OPTIMIZERS = ("nvlamb", "adamw", "muon")  # the optimizers built for sharded (DTensor) weights
TP_OPTIMIZERS = ("nvlamb", "adamw", "muon")  # the optimizers built for tensor-parallel (DTensor) weights


class ConfigError(ValueError):
    """A configuration value or combination that cannot run; the message names the fix."""

    # Its home as users and worker tracebacks name it (pipefisher.cli._USER_ERRORS matches
    # "pipefisher.config.ConfigError: ..."); pickling finds it there too (pipefisher.config re-exports it).
    __module__ = "pipefisher.config"


def _fail(field_name: str, value: Any, fix: str) -> None:
    raise ConfigError(f"{field_name}={value!r}: {fix}")


def _check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field_name, value, f"choose one of {', '.join(choices)}")
