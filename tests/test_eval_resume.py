"""A resumed run evaluates at the same steps with the same held-out figures as an uninterrupted one.

The runs go through ``train_worker`` (what each launched worker runs), two workers in one spawn:
``straight`` trains 6 steps evaluating after every step; ``resumed`` saves every 2 steps, fails at
the start of step 4 and is resumed with ``resume=auto`` in the same folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pipefisher.config import TrainConfig
from pipefisher.evaluation import EVAL_FIELDS
from pipefisher.tracking import read_metrics
from tests.conftest import compose_train
from tests.dist_harness import start_workers, train_jobs

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=6",
         "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "cluster.worker_timeout_s=60",
         "eval.every_steps=1", "eval.batches=3", "data.num_samples=64"]
CASES = {"1f1b-D2": ["pipeline=1f1b", "stages=2", "num_micro_batches=2"],
         "kfac-chimera-D2": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "optimizer=kfac"]}
INTERRUPT_AT = 4


def _cfg(case: str, *extra: str) -> TrainConfig:
    return compose_train(MODEL + CASES[case] + list(extra))


def _interrupted(cfg: TrainConfig) -> list[TrainConfig]:
    """One config per rank, each raising the injected fault at step ``INTERRUPT_AT``."""
    return [dataclasses.replace(cfg, fault=dataclasses.replace(cfg.fault, mode="raise", rank=r, step=INTERRUPT_AT))
            for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("eval_resume")
    jobs = []
    for case in CASES:
        straight, resume = _cfg(case), _cfg(case, "checkpoint.every_steps=2", "resume=auto")
        jobs.append(([straight, straight], str(tmp / case / "straight"), False, None))
        jobs.append((_interrupted(_cfg(case, "checkpoint.every_steps=2")), str(tmp / case / "resumed"), True, None))
        jobs.append(([resume, resume], str(tmp / case / "resumed"), False, None))
    (tmp / "pg").mkdir()
    start_workers(train_jobs, (jobs, str(tmp / "pg")), 2)
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_evaluates_at_the_same_steps_with_the_same_figures(runs: Path, case: str) -> None:
    straight = read_metrics(runs / case / "straight" / "metrics.jsonl")
    resumed = read_metrics(runs / case / "resumed" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in straight] == list(range(6))
    for a, b in zip(straight, resumed):
        assert set(EVAL_FIELDS) <= a.keys() and set(EVAL_FIELDS) <= b.keys(), a["step"]
        for name in EVAL_FIELDS[:-1]:  # all but the evaluation's time
            assert b[name] == pytest.approx(a[name], rel=1e-6, abs=0.0), (a["step"], name)
    # The figures move with training: the test could fail if they did not depend on the weights.
    assert straight[0]["eval_mlm_loss"] != straight[-1]["eval_mlm_loss"]
