"""Hydra entry points behind ``train.py`` (and the ``pipefisher-train`` console script).

The scripts at the repository root only call these functions, so the config directory is the
package's ``pipefisher/conf`` (``conf/`` at the root is a link to it) wherever the package lives.
"""

from __future__ import annotations

import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipefisher.config import register_configs, to_train_config

__all__ = ["train_main", "profile_main"]

log = logging.getLogger(__name__)
register_configs()


def _run(dcfg: DictConfig) -> float:
    cfg = to_train_config(dcfg)
    from pipefisher.launch import run_training  # imports torch: only after the config is valid

    hc = HydraConfig.get()
    result = run_training(
        cfg,
        output_dir=hc.runtime.output_dir,
        overrides=list(hc.overrides.task),
        sweep_dir=hc.sweep.dir if hc.mode.name == "MULTIRUN" else None,
    )
    return float(result.get("loss", float("nan")))


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def train_main(dcfg: DictConfig) -> float:
    """Compose, validate, train; returns the last step's loss (Hydra sweepers may use it)."""
    return _run(dcfg)


@hydra.main(config_path="conf", config_name="profile", version_base="1.3")
def profile_main(dcfg: DictConfig) -> float:
    """Train a few steps recording the timeline; writes profile.sqlite and timeline.pdf/png."""
    return _run(dcfg)
