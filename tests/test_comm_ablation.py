"""comm_ablation=true: 1-byte messages instead of activations, gradients and all-reduces (issue 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipefisher.launch import launch_workers
from tests.conftest import compose_train


@pytest.mark.slow
def test_comm_ablation_runs_every_method_and_marks_its_metrics(tmp_path: Path) -> None:
    from pipefisher.tracking import read_metrics

    for method in ("1f1b", "chimera"):
        out = tmp_path / method
        cfg = compose_train(["stages=2", "num_micro_batches=2", "steps=2", "data.seq_len=16", "comm_ablation=true",
                             f"pipeline={method}", "data_parallel=2" if method == "1f1b" else "data_parallel=1"])
        launch_workers(cfg, out)
        rows = read_metrics(out / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1] and all(r["comm_ablation"] for r in rows)
