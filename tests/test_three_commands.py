"""The three commands the project is known by run verbatim, in order (issue 16, item 1):

    python profile.py pipeline=chimera stages=8
    python schedule.py from=profile.sqlite
    python train.py model=bert-base optimizer=kfac -m      # Ctrl-C, then the printed command resumes

Here with small shapes: ``num_micro_batches=auto`` per method, profile.py deepening its default
model for more stages than it has layers, schedule.py taking a bare ``from=profile.sqlite`` from
the latest profile run, and a run without checkpoint keys that a Ctrl-C stops with a checkpoint
the printed command continues from.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipefisher.config import ConfigError, PipelineConfig, TrainConfig, num_micro_batches_for
from pipefisher.tracking import read_metrics
from tests.conftest import REPO, TINY, compose_dict, compose_train

# TINY without the model choice: profile.py picks the depth only when the user chose none.
SMALL = [o for o in TINY if not o.startswith("model=")]
START_TIMEOUT_S = 300  # interpreter and torch start-up on a busy machine


def _env() -> dict[str, str]:
    return {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def _run(args: list[str], cwd: Path = REPO, ok: bool = True,
         timeout: int = START_TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if ok:
        assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


# --- num_micro_batches=auto ------------------------------------------------------------------------


@pytest.mark.parametrize("method, stages, data_parallel, expected", [
    ("gpipe", 1, 1, 1), ("gpipe", 4, 1, 4), ("1f1b", 2, 2, 2), ("1f1b", 1, 2, 1),
    ("chimera", 4, 1, 4), ("chimera", 8, 1, 8), ("interleaved", 2, 1, 2),
])
def test_num_micro_batches_auto_follows_method_and_stages(method, stages, data_parallel, expected) -> None:
    layers = 2 * stages if method == "interleaved" else stages
    cfg = compose_train([f"pipeline={method}", f"stages={stages}", f"data_parallel={data_parallel}",
                         f"model.num_layers={max(2, layers)}"])
    assert cfg.num_micro_batches == expected == num_micro_batches_for(method, stages)


def test_num_micro_batches_is_auto_by_default_and_a_given_number_wins() -> None:
    assert compose_dict([]).num_micro_batches == "auto"
    assert TrainConfig().num_micro_batches == 1  # the dataclass default resolves too
    assert compose_train(["pipeline=chimera", "stages=2", "num_micro_batches=6"]).num_micro_batches == 6
    cfg = TrainConfig(stages=2, pipeline=PipelineConfig(method="chimera"))
    assert cfg.num_micro_batches == 2


@pytest.mark.parametrize("value", ["many", 2.5, True])
def test_num_micro_batches_other_than_a_number_or_auto_is_refused(value) -> None:
    with pytest.raises(ConfigError, match=r"num_micro_batches=.*num_micro_batches=auto"):
        TrainConfig(num_micro_batches=value)


# --- global_batch_size: equal batches across methods (issue 24) --------------------------------------

METHOD_SHAPES = [("gpipe", 1, 1), ("1f1b", 2, 1), ("zb-h1", 2, 1), ("zb-v", 2, 1), ("chimera", 4, 1),
                 ("interleaved", 2, 1), ("1f1b", 2, 2), ("chimera", 2, 2)]


def _shape(method: str, stages: int, data_parallel: int, *extra: str) -> TrainConfig:
    virtual = 2 if method in ("interleaved", "zb-v") else 1
    return compose_train([f"pipeline={method}", f"stages={stages}", f"data_parallel={data_parallel}",
                          f"model.num_layers={max(2, virtual * stages)}", *extra], tiny=False)


@pytest.mark.parametrize("method, stages, data_parallel", METHOD_SHAPES)
def test_default_batch_is_16_sequences_for_every_method(method, stages, data_parallel) -> None:
    cfg = _shape(method, stages, data_parallel)
    assert cfg.global_batch_size == 16
    assert cfg.micro_batch_size * cfg.num_micro_batches * data_parallel == 16
    assert cfg.num_micro_batches == num_micro_batches_for(method, stages)  # the method's smallest N


@pytest.mark.parametrize("method, stages, data_parallel", METHOD_SHAPES)
def test_a_given_global_batch_is_the_same_for_every_method(method, stages, data_parallel) -> None:
    cfg = _shape(method, stages, data_parallel, "global_batch_size=64")
    assert (cfg.global_batch_size, cfg.micro_batch_size * cfg.num_micro_batches * data_parallel) == (64, 64)


def test_global_batch_and_micro_batch_give_the_micro_batch_count() -> None:
    cfg = _shape("1f1b", 2, 1, "global_batch_size=64", "micro_batch_size=8")
    assert (cfg.micro_batch_size, cfg.num_micro_batches) == (8, 8)
    cfg = _shape("gpipe", 1, 1, "micro_batch_size=32")  # global_batch_size=auto follows a given micro-batch
    assert (cfg.global_batch_size, cfg.num_micro_batches) == (32, 1)


@pytest.mark.parametrize("overrides, message", [
    (["pipeline=chimera", "stages=4", "global_batch_size=48", "micro_batch_size=16"],
     r"global_batch_size=48: gives num_micro_batches=3 .* chimera needs a multiple of stages=4; use global_batch_size=64"),
    (["num_micro_batches=3"], r"global_batch_size='auto \(16\)': must be a multiple of .* = 3 .*use global_batch_size=18"),
    (["global_batch_size=32", "micro_batch_size=4", "num_micro_batches=4"],
     r"global_batch_size=32: disagrees with micro_batch_size x num_micro_batches x data_parallel = 4 x 4 x 1 = 16"),
    (["global_batch_size=40", "micro_batch_size=16"], r"global_batch_size=40: must be a multiple of .* = 16; use global_batch_size=32"),
    (["global_batch_size=0"], r"global_batch_size=0: must be at least 1"),
    (["global_batch_size=many"], r"global_batch_size='many': give a whole number"),
])
def test_batch_sizes_that_cannot_agree_are_refused_naming_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        compose_train(["model.num_layers=4", *overrides], tiny=False)


def test_chimera_refusal_offers_auto() -> None:
    with pytest.raises(ConfigError, match=r"chimera needs a multiple of stages=4; use num_micro_batches=4 \(or auto\)"):
        compose_train(["pipeline=chimera", "stages=4", "model.num_layers=4", "num_micro_batches=2"])


# --- profile.py, then schedule.py from=profile.sqlite ----------------------------------------------


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``profile.py pipeline=chimera stages=4`` (bert-tiny has 2 layers) run in an empty working
    directory, as a user runs it from theirs: the run folder lands below ``outputs/``."""
    where = tmp_path_factory.mktemp("user")
    proc = _run([str(REPO / "profile.py"), "pipeline=chimera", "stages=4", "steps=2", *SMALL], cwd=where)
    return where, proc


@pytest.mark.slow
def test_profile_py_gives_the_default_model_a_layer_per_stage(profiled) -> None:
    where, proc = profiled
    out = proc.stdout + proc.stderr
    assert "profiling bert-tiny with model.num_layers=4 instead of 2" in out, out[-3000:]
    assert "num_micro_batches=auto: 4 for pipeline=chimera with stages=4" in out, out[-3000:]
    found = list((where / "outputs").glob("*/*/profile.sqlite"))
    assert len(found) == 1, found


def test_a_chosen_depth_is_not_changed_and_fails_with_the_config_message(tmp_path: Path) -> None:
    proc = _run([str(REPO / "profile.py"), "pipeline=chimera", "stages=6", "model=bert-tiny", *SMALL],
                cwd=tmp_path, ok=False)
    assert proc.returncode == 1
    assert "stages=6: exceeds model.num_layers=2 + 2" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_schedule_py_takes_a_bare_profile_name_from_the_latest_profile_run(profiled) -> None:
    where, _ = profiled
    latest = next((where / "outputs").glob("*/*/profile.sqlite"))
    older = where / "outputs" / "2000-01-01" / "00-00-00-000000" / "profile.sqlite"
    older.parent.mkdir(parents=True, exist_ok=True)
    older.write_bytes(latest.read_bytes())
    os.utime(older, (1e9, 1e9))
    proc = _run([str(REPO / "schedule.py"), "from=profile.sqlite", "plot=false"], cwd=where)
    rel = latest.relative_to(where)
    assert f"from=profile.sqlite: using the latest profile run's file, {rel}" in proc.stdout, proc.stdout[-3000:]
    assert "PipeFisher plan for bert-tiny (L=4, H=128): chimera D=4 N=4" in proc.stdout, proc.stdout[-3000:]
    assert "model=bert-tiny model.num_layers=4 model.vocab_size=512 pipeline=chimera" in proc.stdout  # "use it:"
    overrides = next((where / "outputs" / "schedule").glob("*/*/.hydra/overrides.yaml")).read_text()
    assert str(rel) in overrides  # the run's record names the file taken


@pytest.mark.slow
def test_schedule_py_without_any_profile_names_where_it_looked(tmp_path: Path) -> None:
    proc = _run([str(REPO / "schedule.py"), "from=profile.sqlite"], cwd=tmp_path, ok=False)
    assert proc.returncode == 1
    assert (f"from=profile.sqlite: no such file in {tmp_path}, nor below it in outputs/**/profile.sqlite "
            f"and multirun/**/profile.sqlite") in proc.stderr, proc.stderr
    assert "python profile.py pipeline=chimera stages=8" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made a run folder


# --- train.py: Ctrl-C saves, the printed command resumes -------------------------------------------


def test_resume_command_is_the_user_s_in_the_same_folder_with_flags_last() -> None:
    from pipefisher.cli import _resume_command

    sweep = _resume_command(["train.py", "model=bert-base", "optimizer=kfac", "-m"], "multirun/d/t", "multirun/d/t/0")
    assert sweep == "python train.py model=bert-base optimizer=kfac hydra.sweep.dir=multirun/d/t resume=auto -m"
    run = _resume_command(["train.py", "resume=none", "hydra.run.dir=a b", "lr=1e-3"], None, "/tmp/x y")
    assert run == "python train.py lr=1e-3 'hydra.run.dir=/tmp/x y' resume=auto"


def test_workers_outnumbering_the_cores_get_a_warning(monkeypatch, caplog) -> None:
    from pipefisher.launch import local

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level(logging.WARNING, logger="pipefisher.launch.local"):
        local._warn_if_oversubscribed(compose_train(["stages=2", "model.num_layers=2"]))
        assert not caplog.records
        local._warn_if_oversubscribed(compose_train(["stages=4", "model.num_layers=4"]))
    assert "4 workers on 2 CPU cores" in caplog.text


def test_a_run_without_checkpoint_keys_saves_on_a_stop_once_it_trained_60_s(tmp_path: Path) -> None:
    # The third command names no checkpoint.* key: no periodic checkpoints, and a stop saves once the
    # run trained checkpoint.on_stop_after_s = 60 s (rank 0's clock). The end-to-end Ctrl-C below runs
    # the same rule with a 1 s threshold (the default would cost a minute of training).
    import torch.distributed as dist

    from pipefisher.runtime.stopping import StopPolicy
    from pipefisher.runtime.teardown import release_process_group

    cfg = compose_train(["optimizer=kfac", "steps=100000"])
    assert cfg.checkpoint.on_stop_after_s == 60 and not cfg.checkpoint.enabled

    class Worker:  # what StopPolicy asks of a PipelineWorker: a stop all workers agreed on
        rank, device, stop_agreed, watch_preemption = 0, torch.device("cpu"), True, False

        def __init__(self) -> None:
            self.saved: list[int] = []

        def save_checkpoint(self, root: Path, step: int) -> Path:
            self.saved.append(step)
            return root / f"step_{step}"

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for trained_s, saves in [(0.0, False), (59.0, False), (61.0, True)]:
            worker = Worker()
            policy = StopPolicy(cfg, worker, tmp_path)
            policy.started -= trained_s  # as if this attempt began trained_s ago
            row: dict = {}
            assert policy.after_step(7, row) and row["preempted"]
            assert policy.preempted == (7, tmp_path / "step_7" if saves else None), trained_s
            assert worker.saved == ([7] if saves else []), trained_s
    finally:
        release_process_group()


@pytest.mark.slow
def test_ctrl_c_saves_a_run_past_on_stop_after_s_and_the_printed_command_resumes_it(tmp_path: Path) -> None:
    # The third command's shape (optimizer=kfac, one worker, -m) on bert-tiny; no checkpoint.* key but
    # the stop threshold, 1 s instead of its 60 s default (held by the test above).
    sweep = tmp_path / "sweep"
    args = ["train.py", "optimizer=kfac", "steps=100000", *TINY, "checkpoint.on_stop_after_s=1",
            f"hydra.sweep.dir={sweep}", "-m"]
    log = tmp_path / "train.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    metrics = sweep / "0" / "metrics.jsonl"
    deadline = time.monotonic() + START_TIMEOUT_S
    # Past checkpoint.on_stop_after_s (1 s) of training: a stop now saves.
    while not (metrics.is_file() and sum(r["step_time_s"] for r in read_metrics(metrics)) > 1.5):
        assert proc.poll() is None, log.read_text()[-3000:]
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(log.read_text()[-3000:])
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(log.read_text()[-3000:])
    text = log.read_text()
    assert code == 130, text[-3000:]
    found = re.search(r"interrupted at step (\d+); last checkpoint: (\S+)", text)
    assert found, text[-3000:]
    step = int(found.group(1))
    assert Path(found.group(2)) == sweep / "0" / "checkpoints" / f"step_{step}"
    command = re.search(r"to continue from it: (.+)", text).group(1).strip()
    assert command.endswith(f"hydra.sweep.dir={sweep} resume=auto -m"), command

    words = shlex.split(command)
    assert words[:2] == ["python", "train.py"]
    words = [f"steps={step + 3}" if w == "steps=100000" else w for w in words[1:]]
    again = _run(words)
    assert f"continuing at step {step + 1}" in again.stdout + again.stderr
    assert [r["step"] for r in read_metrics(metrics)][-3:] == [step, step + 1, step + 2]
