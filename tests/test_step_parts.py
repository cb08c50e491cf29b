"""bench/step_parts.py: arms taking turns in two processes, and ``--predict-from``: each K-FAC arm's refresh cycle
simulated on one arm's measured unit costs, the owners arm through ``with_owners`` ([Note: pricing owners])."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

BASE = ["model=bert-tiny", "model.vocab_size=512", "pipeline=chimera", "stages=2", "num_micro_batches=4",
        "micro_batch_size=2", "data.seq_len=16", "data.max_predictions=3"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "bench/step_parts.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_predict_from_prints_every_kfac_arms_predicted_step_beside_the_measured_one():
    proc = _run("--predict-from", "pf-holder", "--rounds", "2", "--warmup", "1", "--base", *BASE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("hardware: CPU")  # every timing names its hardware
    rows = {m[1]: (float(m[2]), float(m[3])) for m in
            re.finditer(r"^\| (pf-\w+) +\| ([\d.]+) +\| ([\d.]+) +\| [\d.]+ +\|$", out, re.M)}
    assert set(rows) == {"pf-holder", "pf-replicas"}  # NVLAMB has no K-FAC cycle to predict
    assert all(p > 0 and m > 0 for p, m in rows.values())
    ratio = re.search(r"^pf-replicas / pf-holder: predicted ([\d.]+), measured ([\d.]+)$", out, re.M)
    assert ratio is not None
    # the table rounds to 3-4 figures: the ratio line is of the unrounded steps
    assert float(ratio[1]) == pytest.approx(rows["pf-replicas"][0] / rows["pf-holder"][0], rel=5e-3)


@pytest.mark.slow  # a subprocess that imports torch
def test_predict_from_an_arm_that_is_not_there_is_refused_in_one_line():
    proc = _run("--predict-from", "holder")
    assert proc.returncode != 0
    assert "--predict-from holder: not an arm (arms: nvlamb, pf-holder, pf-replicas)" in proc.stderr
