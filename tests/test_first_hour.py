"""What a new user meets first (issue 16): errors as one message, the help page, refused shapes,
prepare's input checks, progress of the what-if search, ignored run folders, checkpoint names.

The entry scripts run as users run them: from the repository root, as subprocesses.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException

from pipefisher.cli import user_message
from pipefisher.run_folder import _hydra_only
from pipefisher.config import ConfigError, check_override_keys
from pipefisher.data.prepare import main as prepare_main
from pipefisher.model.config import BertConfig
from pipefisher.planning.config import ScheduleConfig
from pipefisher.planning.whatif import what_if
from pipefisher.runtime.checkpoint import CheckpointPolicy, save_checkpoint
from pipefisher.runtime.teardown import release_process_group
from tests.conftest import REPO, TINY, compose_train


def _script(args: list[str], *, full_error: bool = False, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    if full_error:
        env["HYDRA_FULL_ERROR"] = "1"
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _assert_one_message(proc: subprocess.CompletedProcess, *expected: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    for text in expected:
        assert text in proc.stderr, proc.stderr


# --- item 2: errors without tracebacks --------------------------------------------------------------


def test_config_error_prints_one_message_exits_nonzero_and_leaves_no_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _script(["train.py", "stages=50", f"hydra.run.dir={run_dir}", *TINY])
    _assert_one_message(proc, "train.py: stages=50: exceeds model.num_layers=2", "a deeper model")
    assert not run_dir.exists()
    assert tmp_path.exists()  # a folder the user named is never removed


@pytest.mark.parametrize("args, expected", [
    (["train.py", "model=model_schema", *TINY[1:]],
     "model=model_schema: that is the schema the model options extend, not one of them; choose one of bert-base"),
    (["train.py", "optimizer=pipefisher", "optimizer.schedule=/etc/passwd", *TINY],
     "train.py: optimizer.schedule=/etc/passwd: not a JSON file"),
    (["schedule.py", "from=/etc/passwd"], "schedule.py: /etc/passwd: not an SQLite database"),
    (["finetune.py", "task=mnli"], "finetune.py: task.data_dir=None: task=mnli reads files"),
], ids=["schema-as-model", "schedule-not-json", "profile-not-sqlite", "finetune-without-data"])
@pytest.mark.slow
def test_bad_input_of_each_program_prints_one_message_and_leaves_no_folder(args, expected, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _script([*args, f"hydra.run.dir={run_dir}"])
    _assert_one_message(proc, expected)
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


def test_hydra_full_error_keeps_the_traceback(tmp_path: Path) -> None:
    proc = _script(["train.py", "stages=50", f"hydra.run.dir={tmp_path / 'run'}", *TINY], full_error=True)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "pipefisher.config.ConfigError: stages=50" in proc.stderr


def test_failed_run_that_left_files_gets_the_error_in_its_log(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("the user's\n")
    proc = _script(["train.py", "stages=50", f"hydra.run.dir={tmp_path}", *TINY])
    _assert_one_message(proc, "stages=50")
    assert (tmp_path / "notes.txt").exists()
    assert "run failed: stages=50: exceeds model.num_layers=2" in (tmp_path / "train.log").read_text()


def test_only_a_run_folder_that_is_provably_this_run_s_and_empty_is_removed(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- stages=50\n")
    (tmp_path / "train.log").write_text("")
    assert _hydra_only(tmp_path, "train", ["stages=50"])
    # Another run started in the same second wrote its overrides into the shared folder: keep it.
    assert not _hydra_only(tmp_path, "train", ["stages=60"])
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert not _hydra_only(tmp_path, "train", ["stages=50"])


@pytest.mark.slow
def test_unreadable_shard_is_named_before_wandb_and_workers_start(tmp_path: Path) -> None:
    data = tmp_path / "shards"
    data.mkdir()
    (data / "part_0.hdf5").write_bytes(b"not an hdf5 file\n" * 10)
    run_dir = tmp_path / "run"
    proc = _script(["train.py", "data=hdf5", f"data.path={data}", "stages=2", "num_micro_batches=2",
                    "wandb.mode=offline", f"hydra.run.dir={run_dir}", *TINY])
    _assert_one_message(proc, f"{data / 'part_0.hdf5'}: not a readable HDF5 file", "pipefisher-prepare")
    assert "starting 2 workers" not in proc.stdout + proc.stderr
    assert not run_dir.exists()  # nothing was written: no wandb folder, no metrics


def test_missing_data_path_is_a_config_error_without_traceback(tmp_path: Path) -> None:
    proc = _script(["train.py", "data=hdf5", f"data.path={tmp_path / 'nowhere'}",
                    f"hydra.run.dir={tmp_path / 'run'}", *TINY])
    _assert_one_message(proc, "data.path=", "no such file or directory")


@pytest.mark.slow
def test_checkpoint_error_prints_one_message(tmp_path: Path) -> None:
    empty = tmp_path / "no_checkpoints"
    empty.mkdir()
    proc = _script(["train.py", f"resume={empty}", "steps=2", f"hydra.run.dir={tmp_path / 'run'}", *TINY])
    _assert_one_message(proc, f"resume={empty}: no valid checkpoint")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("script", ["train.py", "profile.py", "schedule.py"])
@pytest.mark.slow
def test_typo_in_a_key_names_the_closest_key_not_a_plus_override(script: str, tmp_path: Path) -> None:
    proc = _script([script, "stagez=2", f"hydra.run.dir={tmp_path / 'run'}"])
    _assert_one_message(proc, "unknown key 'stagez'; did you mean stages=2?")
    assert "+stagez" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()


def test_override_key_check_handles_nested_keys_groups_and_hydra_keys() -> None:
    check_override_keys(["model=bert-mini", "stages=2", "hydra.run.dir=x", "hydra/launcher=basic", "+extra=1",
                         "pipeline.layers_per_stage=[1,1]", "-m", "--help", "optimizer.damping=1e-3"])
    with pytest.raises(ConfigError, match=r"did you mean optimizer\.damping=1e-2\?"):
        check_override_keys(["optimizer.dampin=1e-2"])
    with pytest.raises(ConfigError, match=r"did you mean optimizer\.damping=1e-2\?"):
        check_override_keys(["damping=1e-2"])  # a nested key typed at the top level
    with pytest.raises(ConfigError, match="unknown key 'zzzz'"):
        check_override_keys(["zzzz=1"])
    # schedule.py's schema, whose field from_ is the key `from` (for its entry point to use).
    check_override_keys(["from=profile.sqlite", "whatif=true", "search.top=5"], ScheduleConfig, rename={"from_": "from"})
    with pytest.raises(ConfigError, match="did you mean from=p.sqlite"):
        check_override_keys(["frm=p.sqlite"], ScheduleConfig, rename={"from_": "from"})


def test_a_worker_s_user_error_is_reported_without_its_traceback() -> None:
    trace = ('Traceback (most recent call last):\n  File "worker.py", line 1, in run\n'
             "pipefisher.data.batches.DataError: shard.hdf5: token id 600 is not below vocab_size=512; "
             "set model.vocab_size")
    err = ProcessRaisedException(f"\n\n-- Process 1 terminated with the following error:\n{trace}", 1, 1234)
    assert user_message(err) == "worker 1: shard.hdf5: token id 600 is not below vocab_size=512; set model.vocab_size"
    bug = ProcessRaisedException("\n\n-- Process 0 terminated:\nTraceback...\nKeyError: 'x'", 0, 1)
    assert user_message(bug) is None  # a bug keeps its traceback
    assert user_message(KeyError("x")) is None
    assert user_message(ConfigError("stages=3: odd")) == "stages=3: odd"
    ckpt = ProcessRaisedException("\n\n-- Process 0 terminated:\nTraceback...\n"  # named by the class's home module
                                  "pipefisher.runtime.checkpoint_io.CheckpointError: step_3: no manifest.json", 0, 1)
    assert user_message(ckpt) == "worker 0: step_3: no manifest.json"


# --- item 4: train.py --help --------------------------------------------------------------------------


def test_help_lists_the_training_groups_without_task_or_schemas() -> None:
    proc = _script(["train.py", "--help"])
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    assert "_schema" not in proc.stdout
    assert "task:" not in groups and "toy" not in groups
    for line in ("model: bert-base, bert-large, bert-medium, bert-mini, bert-small, bert-tiny",
                 "pipeline: 1f1b, chimera, csv, dualpipev, gpipe, interleaved, v-half, v-min, zb-h1, zb-v", "optimizer: adamw, ekfac, kfac, muon, nvlamb, pipefisher",
                 "data: hdf5, synthetic", "cluster: local, slurm"):
        assert line in groups
    assert "stages: 1" in proc.stdout  # the config is still shown


# --- item 6: interleaved with one stage -------------------------------------------------------------


@pytest.mark.parametrize("extra", [["data_parallel=2"], []])
def test_interleaved_with_one_stage_and_virtual_stages_is_refused_before_spawning(extra: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"pipeline\.num_virtual=2: pipeline=interleaved with stages=1 .*"
                                          r"use stages>=2 .* or pipeline\.num_virtual=1 \(or pipeline=1f1b\)"):
        compose_train(["pipeline=interleaved", "stages=1", "pipeline.num_virtual=2", *extra])
    compose_train(["pipeline=interleaved", "stages=2", "pipeline.num_virtual=1", "num_micro_batches=2", *extra])


def test_whatif_excludes_interleaved_with_one_stage() -> None:
    bert = BertConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=2, intermediate_size=256)
    found = what_if(bert, devices=2, memory_gb=100, global_batch=8, methods=["interleaved"],
                    micro_batch_sizes=[4], optimizers=["nvlamb"], recompute=[False])
    one_stage = [c for c in found if c.stages == 1]
    assert one_stage and all(c.excluded and "interleaved needs stages>=2" in c.excluded for c in one_stage)


# --- item 7: prepare's input checks and help ----------------------------------------------------------


def test_prepare_names_a_binary_input_and_writes_nothing(tmp_path: Path, capsys) -> None:
    binary = tmp_path / "shard.hdf5"
    binary.write_bytes(b"\x89HDF\r\n\x1a\n\x00\x00\x00" + bytes(range(256)))
    assert prepare_main(["--input", str(binary), "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{binary}: a binary file" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait .\n".encode("latin-1"))
    assert prepare_main(["--input", str(latin1), "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"{latin1}: not UTF-8 text" in capsys.readouterr().err


def test_prepare_of_empty_input_leaves_no_vocab_behind(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    out = tmp_path / "out"
    assert prepare_main(["--input", str(empty), "--output-dir", str(out), "--no-progress"]) == 2
    assert "no sentences found" in capsys.readouterr().err
    assert not (out / "vocab.txt").exists() and not out.exists()


def test_prepare_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        prepare_main(["--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    for default in ("(default: 128)", "(default: 20)", "(default: 5)", "(default: 0.15)", "(default: 12345)",
                    "(default: 30522)", "(default: auto)", "(default: gzip)"):
        assert default in text
    assert "(default: None)" not in text and "(default: False)" not in text


# --- item 8: progress of the what-if search ------------------------------------------------------------


def test_whatif_logs_progress_per_group(caplog) -> None:
    bert = BertConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=2, intermediate_size=256)
    with caplog.at_level(logging.INFO, logger="pipefisher.planning.whatif"):
        what_if(bert, devices=2, memory_gb=100, global_batch=8, methods=["gpipe", "1f1b"],
                micro_batch_sizes=[4], optimizers=["nvlamb"], recompute=[False])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("whatif:")]
    assert lines[0].startswith("whatif: [1/4] gpipe D=1 W=2 (0 s elapsed")
    assert lines[3].startswith("whatif: [4/4] 1f1b D=2 W=1") and "s left" in lines[3]
    assert lines[-1].startswith("whatif: searched 4 groups in")


# --- item 9: small things ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["runs/bert/checkpoints/step_1/manifest.json", "data/wikitext-2/train.txt"])
def test_runs_and_data_folders_are_ignored_by_git(path: str) -> None:
    proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
    assert proc.returncode == 0


def test_checkpoint_folders_count_steps_from_zero_and_the_log_says_how_many_steps(tmp_path: Path, caplog) -> None:
    policy = CheckpointPolicy(every_steps=2, every_minutes=0, last_step=5)
    assert [s for s in range(6) if policy.due_by_steps(s)] == [1, 3, 5]  # after 2, 4 and 6 steps
    cfg = compose_train(["checkpoint.every_steps=2", "steps=6"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.INFO, logger="pipefisher.runtime.checkpoint"):
            folder = save_checkpoint(tmp_path / "ckpt", 1, 0, 1, {"step": 1}, cfg, None)
    finally:
        release_process_group()
    assert folder.name == "step_1"
    assert any("the state after 2 steps (step_1 counts from step_0" in r.getMessage() for r in caplog.records)


def test_run_folders_of_the_same_second_differ() -> None:
    """Hydra's run and sweep folders carry microseconds: two runs started in the same second (a
    failed config and the next run, two scripted runs) never share a folder."""
    for name in ("config", "schedule", "finetune"):
        text = (REPO / "pipefisher" / "conf" / f"{name}.yaml").read_text()
        dirs = [line for line in text.splitlines() if line.strip().startswith("dir:")]
        assert len(dirs) == 2 and all("%H-%M-%S-%f" in line for line in dirs), (name, dirs)
