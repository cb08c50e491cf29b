"""A researcher's first day (issue 40, item 5): the smaller things, each as behaviour.

``--steps 30`` gets the ``steps=30`` hint; an unknown group option lists the real options (no
``*_schema``); a resumed run logs into the same wandb run; old checkpoints are deleted after a new
one is complete (``checkpoint.keep_last``); ``pipefisher-compare`` is a console script; a log that
is no terminal gets a progress line every N steps, not one per step.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipefisher.config import ConfigError, check_override_keys
from pipefisher.planning.config import ScheduleConfig
from pipefisher.runtime.progress import LineProgress, progress_range
from pipefisher.tracking import WandbLogger
from pipefisher.tracking.wandb_logger import RUN_ID_FILE
from tests.conftest import REPO, TINY, compose_train


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
@pytest.mark.slow
def test_an_attempt_that_continues_from_a_checkpoint_logs_into_the_same_wandb_run(tmp_path: Path) -> None:
    first = _attempt(tmp_path, continuing=False, steps=range(0, 3))
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == first
    again = _attempt(tmp_path, continuing=True, steps=range(3, 6))
    assert again == first
    folders = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # wandb names a folder offline-run-<time>-<id>, adding -1, -2 ... when two attempts start in the same second
    assert len(folders) == 2 and all(re.search(rf"-{first}(-\d+)?$", name) for name in folders), folders
    fresh = _attempt(tmp_path, continuing=False, steps=range(0, 2))  # a new start: a new run
    assert fresh != first and (tmp_path / RUN_ID_FILE).read_text().strip() == fresh


# --- console scripts ---------------------------------------------------------------------------------


def test_every_console_script_names_a_function_and_compare_has_one() -> None:
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pipefisher-compare"] == "pipefisher.compare:main"
    for name, target in scripts.items():
        module, _, func = target.partition(":")
        assert callable(getattr(importlib.import_module(module), func)), name


def test_pipefisher_compare_runs_as_its_console_script_does(tmp_path: Path) -> None:
    # What pip's wrapper does: sys.exit(main()) with the script's name in argv[0].
    wrapper = "import sys; from pipefisher.compare import main; sys.argv[0] = 'pipefisher-compare'; sys.exit(main())"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    helped = subprocess.run([sys.executable, "-c", wrapper, "--help"], capture_output=True, text=True, env=env,
                            timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: pipefisher-compare "), helped.stdout
    missing = subprocess.run([sys.executable, "-c", wrapper, str(tmp_path / "nope")], capture_output=True, text=True,
                             env=env, timeout=120)
    assert missing.returncode == 1 and missing.stderr.startswith("compare: error: "), missing.stderr


# --- progress in a log that is no terminal -----------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress(first: int, stream: io.StringIO) -> object:
    cfg = compose_train(["steps=25", "log_every=10", "progress=true"])
    bar = progress_range(cfg, enabled=True, first=first, stream=stream)
    for step in bar:
        if step % cfg.log_every == 0 or step == cfg.steps - 1:  # what StepReporter shows on logged steps
            bar.set_postfix(loss=f"{10 - step / 10:.2f}")
    bar.close()
    return bar


def test_a_log_that_is_no_terminal_gets_a_progress_line_every_log_every_steps() -> None:
    log = io.StringIO()
    assert isinstance(_progress(0, log), LineProgress)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) == 4, lines  # after steps 0, 10, 20 and the last (24)
    assert [line.split("|")[2].split()[0] for line in lines] == ["1/25", "11/25", "21/25", "25/25"]
    assert lines[0].startswith("train:") and "loss=10.00" in lines[0] and "loss=7.60" in lines[-1]
    resumed = io.StringIO()
    _progress(12, resumed)  # a resumed run: the first line at the next logged step
    assert [line.split("|")[2].split()[0] for line in resumed.getvalue().splitlines()] == ["21/25", "25/25"]


def test_a_terminal_gets_tqdms_bar() -> None:
    from tqdm import tqdm

    assert isinstance(_progress(0, _Terminal()), tqdm)


@pytest.mark.slow
def test_train_py_resumed_from_a_checkpoint_logs_into_the_same_wandb_run(tmp_path: Path) -> None:
    # One worker, run in train.py's process: rank 0's reporting (runtime/reporting.py) keeps the run id
    # whichever process rank 0 is; offline wandb in a spawned worker of a 2-stage run: test_signals.py.
    run_dir = tmp_path / "run"
    run = [sys.executable, str(REPO / "train.py"), "stages=1",
           "checkpoint.every_steps=1", "wandb.mode=offline", *[t for t in TINY if not t.startswith("wandb.")],
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    first = subprocess.run([*run, "steps=2"], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run([*run, "steps=4", "resume=auto"], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert f"continuing wandb run {run_id}" in again.stdout + again.stderr
    attempts = sorted(p.name for p in (run_dir / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(a.endswith(f"-{run_id}") for a in attempts), attempts
