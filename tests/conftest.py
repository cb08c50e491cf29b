"""Shared test fixtures: compose the real Hydra config, shrunk to tiny CPU runs."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from pipefisher.config import TrainConfig, register_configs, to_train_config

# Tiny models on a shared 2-core machine: one intra-op thread. Two OpenMP threads contending with
# other processes make a tiny backward ~100x slower.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "pipefisher" / "conf"

# (method, D, N, W) pipeline shapes the K-FAC schedule and planner tests run on: D 2/4, N = D/2,
# D, 2D, W 1/2, where the method allows it.
PIPELINE_GRID = [(m, d, n, w) for m in ("gpipe", "1f1b", "chimera", "interleaved") for d in (2, 4)
                 for n in (d // 2, d, 2 * d) for w in (1, 2)
                 if n >= 1 and not (m in ("chimera", "interleaved") and n % d)]
PIPELINE_GRID_IDS = [f"{m}-D{d}-N{n}-W{w}" for m, d, n, w in PIPELINE_GRID]

# Tiny runs: no dropout, the simplest comparison (tests/test_dropout_rng.py compares with dropout on).
TINY = [
    "model=bert-tiny",
    "model.vocab_size=512",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "data.seq_len=32",
    "data.max_predictions=5",
    "micro_batch_size=2",
    "progress=false",
    "wandb.mode=disabled",
    "device=cpu",
]


@pytest.fixture(autouse=True)
def _offline_wandb(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb_dir = tmp_path_factory.mktemp("wandb")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(wandb_dir))
    monkeypatch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "offline"))


def compose_dict(overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """The composed (unvalidated) Hydra config of train.py with ``overrides``."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=with_hydra)


def compose_train(overrides: list[str], tiny: bool = True) -> TrainConfig:
    """The validated :class:`TrainConfig` of train.py with ``overrides`` (after the tiny defaults)."""
    return to_train_config(compose_dict((TINY if tiny else []) + overrides))


@pytest.fixture
def make_cfg() -> Callable[..., TrainConfig]:
    return lambda *overrides, tiny=True: compose_train(list(overrides), tiny=tiny)


def load_bench(name: str, as_name: str | None = None):
    """``bench/<name>.py`` as a module (registered as ``as_name``, default ``name``); it imports
    ``bench/_harness.py`` by name, as when run as a script, so ``bench/`` is on the path while it loads."""
    bench = REPO / "bench"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location(as_name or name, bench / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module


def calibration_doc(**changes) -> dict:
    """A hand-made calibration document (``planning.calibration``): bert-mini at batch 16, NVLAMB's steps 500 at
    held-out loss 6.0 and 2,000 at 5.0, Muon 3x fewer steps at 6.0 [2.5, 3.5] and level at 5.0 [0.8, 1.25];
    ``changes`` replace its fields as the file holds them."""
    from pipefisher.planning.calibration import calibration_document

    doc = calibration_document(
        method="budget", model={"name": "bert-mini", "num_layers": 4, "hidden_size": 256, "num_heads": 4,
                                "vocab_size": 30522},
        batch={"global_batch": 16, "seq_len": 64, "max_predictions": 10}, data={"train": "t", "heldout": "h"},
        seeds=[0, 1], hardware="test", reference="nvlamb", budgets=[500, 1000, 2000],
        reference_steps=[(6.0, 500.0), (5.0, 2000.0)],
        optimizers=[{"optimizer": "muon", "speedup": [{"loss": 6.0, "value": 3.0, "low": 2.5, "high": 3.5},
                                                      {"loss": 5.0, "value": 1.0, "low": 0.8, "high": 1.25}]}],
        provenance="hand-made", limits="a test")
    doc.update(changes)
    return doc


@pytest.fixture(scope="module")
def ca():
    """``bench/convergence_analysis.py`` as a module (the convergence and calibration tests)."""
    return load_bench("convergence_analysis")


@pytest.fixture(scope="module")
def cv():
    """``bench/convergence.py`` as a module (it imports ``convergence_analysis`` by name)."""
    load_bench("convergence_analysis")
    return load_bench("convergence")
