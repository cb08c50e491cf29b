"""Hydra entry point behind ``finetune.py``: compose, validate, fine-tune, print the scores."""

from __future__ import annotations

import logging

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from pipefisher.data.batches import DataError
from pipefisher.finetune.config import register_finetune_configs, to_finetune_config
from pipefisher.finetune.loop import run_finetune
from pipefisher.run_folder import clean_up_failed_run

__all__ = ["finetune_main"]

log = logging.getLogger(__name__)
register_finetune_configs()


@hydra.main(config_path="../conf", config_name="finetune", version_base="1.3")
def finetune_main(dcfg: DictConfig) -> float:
    """Fine-tune and evaluate; returns the first dev split's accuracy (or F1) for Hydra sweepers.

    Bad settings or data files (ConfigError, DataError) end the program with their message.
    """
    hc = HydraConfig.get()
    try:
        cfg = to_finetune_config(dcfg)
        result = run_finetune(cfg, hc.runtime.output_dir, overrides=list(hc.overrides.task),
                              sweep_dir=hc.sweep.dir if hc.mode.name == "MULTIRUN" else None)
    except (DataError, ValueError) as exc:  # ConfigError and FinetuneDataError are ValueErrors
        clean_up_failed_run(str(exc))  # a refused command leaves no folder behind
        raise SystemExit(f"finetune.py: {exc}") from None
    for split, record in result.final.items():
        scores = {k: round(record[k], 4) for k in ("accuracy", "exact_match", "f1") if k in record}
        print(f"{cfg.task.name} {split}: {scores} ({record['sequences_per_s']:.0f} sequences/s eval)")
    print(f"train: {result.steps} steps, last loss {result.train['loss']:.4f}, "
          f"{result.train['samples_per_s']:.0f} samples/s, {result.train['sequences_per_s']:.0f} sequences/s; "
          f"metrics in {hc.runtime.output_dir}/metrics.jsonl")
    return result.main_metric
