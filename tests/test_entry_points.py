"""The scripts users call, run as users run them: from the repository root, as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pipefisher.profiling import read_profile
from pipefisher.tracking import read_metrics
from tests.conftest import REPO, TINY

SMALL = [o for o in TINY if not o.startswith("model=")] + ["data.seq_len=32"]


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


@pytest.mark.slow
def test_profile_py_does_not_break_cprofile_or_torch_dynamo() -> None:
    # Run from the root, `import profile` finds our profile.py; cProfile and torch._dynamo need the
    # standard library's module (DESIGN.md, the shadowing trap).
    # The test must see the trap: `import profile` finds our file, which stands in for the standard
    # library's (its Profile and run come from the standard library's profile.py).
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "profile.py")
    _run(["-c", "import os, sys, profile, cProfile, torch._dynamo; "
                "ours, stdlib = sys.argv[1:]; "
                "assert os.path.samefile(profile.__file__, ours), profile.__file__; "
                "assert os.path.samefile(profile.run.__code__.co_filename, stdlib), profile.run.__code__; "
                "assert os.path.samefile(profile.Profile.runcall.__code__.co_filename, stdlib); "
                "assert cProfile.Profile().runcall(sum, [1, 2]) == 3",
          str(REPO / "profile.py"), stdlib])


@pytest.mark.slow
def test_train_py_default_model_writes_metrics(tmp_path: Path) -> None:
    _run(["train.py", "model=bert-tiny", "steps=3", f"hydra.run.dir={tmp_path}", *SMALL])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("loss", "mlm_loss", "nsp_loss", "lr", "step_time_s", "samples_per_s"):
        assert all(isinstance(r[key], float) for r in rows), key
    assert (tmp_path / ".hydra" / "config.yaml").exists()


@pytest.mark.slow
def test_two_job_sweep_writes_two_metrics_files(tmp_path: Path) -> None:
    _run(["train.py", "-m", "model=bert-tiny,bert-mini", "steps=3", f"hydra.sweep.dir={tmp_path}", *SMALL])
    files = sorted(tmp_path.glob("*/metrics.jsonl"))
    assert len(files) == 2
    for f in files:
        assert len(read_metrics(f)) == 3


@pytest.mark.slow
def test_train_py_pipeline_logs_measured_and_simulated_utilization(tmp_path: Path) -> None:
    _run(["train.py", "pipeline=1f1b", "stages=2", "num_micro_batches=4", "steps=3", f"hydra.run.dir={tmp_path}",
          *SMALL])
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 3
    for r in rows:
        assert 0 < r["bubble_utilization"] <= 1
    # The simulation runs on logged steps (every log_every=10, and the last one) only.
    assert [r["step"] for r in rows if "simulated_bubble_utilization" in r] == [0, 2]
    assert all(0 < r["simulated_bubble_utilization"] <= 1 for r in rows if "simulated_bubble_utilization" in r)


@pytest.mark.slow
def test_profile_py_writes_sqlite_and_pictures(tmp_path: Path) -> None:
    proc = _run(["profile.py", "pipeline=gpipe", "stages=2", "num_micro_batches=2", "steps=3",
                 f"hydra.run.dir={tmp_path}", *SMALL])
    assert "overall bubble utilization" in proc.stderr + proc.stdout
    profile = read_profile(tmp_path / "profile.sqlite")
    assert profile.num_workers == 2
    assert {e.step for e in profile.events} == {1, 2}  # profile.warmup_steps=1 leaves step 0 out
    assert {e.kind for e in profile.events} >= {"F", "B", "STEP"}
    assert json.loads(json.dumps(profile.metadata))["method"] == "gpipe"
    for suffix in (".pdf", ".png"):
        assert (tmp_path / f"timeline{suffix}").stat().st_size > 1000
