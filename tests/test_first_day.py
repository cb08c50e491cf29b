"""A researcher's first day (issue 40, item 5): the smaller things, each as behaviour.

``--steps 30`` gets the ``steps=30`` hint; an unknown group option lists the real options (no
``*_schema``); a resumed run logs into the same wandb run; old checkpoints are deleted after a new
one is complete (``checkpoint.keep_last``); ``pipefisher-compare`` is a console script; a log that
is no terminal gets a progress line every N steps, not one per step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipefisher.config import ConfigError, check_override_keys
from pipefisher.planning.config import ScheduleConfig
from pipefisher.tracking import WandbLogger
from pipefisher.tracking.wandb_logger import RUN_ID_FILE
from tests.conftest import REPO


# --- command line: --key value, and options of a group ------------------------------------------------


@pytest.mark.parametrize("args, says", [
    (["--steps", "30"], "--steps 30: options are key=value without dashes: write steps=30"),
    (["--steps=30"], "--steps=30: options are key=value without dashes: write steps=30"),
    (["model=bert-tiny", "--micro-batch-size", "4"], "write micro_batch_size=4"),
    (["--optimizer.lr", "1e-3"], None),  # no such key: argparse's message stays (no wrong hint)
    (["--lr", "-1"], "--lr: options are key=value without dashes: write lr=<value>"),
])
def test_a_dashed_key_gets_the_key_value_hint(args: list[str], says: str | None) -> None:
    if says is None:
        check_override_keys(args)
        return
    with pytest.raises(ConfigError) as err:
        check_override_keys(args)
    assert str(err.value) == says or says in str(err.value)


def test_hydras_own_flags_are_left_to_hydra() -> None:
    check_override_keys(["--help", "--cfg", "job", "-m", "--multirun", "--info", "--config-name", "x"])


@pytest.mark.parametrize("arg, says", [
    ("optimizer=kfca", "optimizer=kfca: no optimizer 'kfca'; did you mean optimizer=kfac? "
                       "choose one of adamw, ekfac, kfac, muon, nvlamb, pipefisher"),
    ("pipeline=1f1b,chimerra", "no pipeline 'chimerra'; did you mean pipeline=chimera?"),
    ("model=bert-huge", "choose one of bert-base, bert-large, bert-medium, bert-mini, bert-small, bert-tiny"),
])
def test_an_unknown_group_option_names_the_options_without_schemas(arg: str, says: str) -> None:
    with pytest.raises(ConfigError, match="choose one of") as err:
        check_override_keys([arg])
    assert says in str(err.value) and "_schema" not in str(err.value)


def test_known_options_sweeps_and_schedule_groups_pass() -> None:
    check_override_keys(["optimizer=kfac", "pipeline=1f1b,chimera", "model=glob(bert-*)", "data=synthetic"])
    with pytest.raises(ConfigError, match="no ranges 'megatron'; did you mean ranges=megatron_zb"):
        check_override_keys(["ranges=megatron"], ScheduleConfig, rename={"from_": "from"})


def test_train_py_prints_the_hint_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--steps", "30"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "train.py: --steps 30: options are key=value without dashes: write steps=30"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "optimizer=kfca"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 1 and "_schema" not in proc.stderr and "choose one of adamw" in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before Hydra made a run folder


# --- wandb: a resumed run is the same wandb run -------------------------------------------------------


@pytest.fixture
def _wandb_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def _attempt(folder: Path, continuing: bool, steps: range) -> str:
    with WandbLogger({"steps": 9}, project="pipefisher-test", name="steps=9", mode="offline", dir=folder,
                     run_id_file=folder / RUN_ID_FILE, continuing=continuing) as wb:
        for step in steps:
            wb.log({"loss": 1.0 / (step + 1)}, step=step)
        return wb._run.id


@pytest.mark.usefixtures("_wandb_sandbox")
def test_an_attempt_that_continues_from_a_checkpoint_logs_into_the_same_wandb_run(tmp_path: Path) -> None:
    first = _attempt(tmp_path, continuing=False, steps=range(0, 3))
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == first
    again = _attempt(tmp_path, continuing=True, steps=range(3, 6))
    assert again == first
    folders = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(name.endswith(f"-{first}") for name in folders)  # `wandb sync` joins them
    fresh = _attempt(tmp_path, continuing=False, steps=range(0, 2))  # a new start: a new run
    assert fresh != first and (tmp_path / RUN_ID_FILE).read_text().strip() == fresh
