"""Sweep comparison (``python -m pipefisher.compare``): on a real tiny sweep, and on hand-written runs.

The real sweep (4 jobs, ~35 s on 2 cores) runs once per module through ``train.py -m`` in a
subprocess, exactly as a user would; the hand-written runs pin the table's numbers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipefisher.compare import comparison_table, load_sweep, main, plot_sweep, summarize
from pipefisher.compare import _cumulative_time, _wandb_log_records  # helpers, tested on their own

REPO = Path(__file__).resolve().parents[1]

TINY_SWEEP = [
    "pipeline=gpipe,1f1b", "optimizer=nvlamb,kfac", "stages=2", "num_micro_batches=2", "steps=3",
    "model=bert-tiny", "model.vocab_size=512", "data.seq_len=32", "data.max_predictions=5",
    "micro_batch_size=2", "progress=false",
]
#: Columns and plots shown only when some run recorded their fields (evaluation, FLOPs, memory).
OPTIONAL_COLUMNS = {"eval MLM loss", "eval MLM acc", "eval NSP acc", "TFLOP/s", "MFU", "peak mem (MB)"}
EVAL_STEMS = ["compare_eval_mlm_loss_vs_step", "compare_eval_mlm_loss_vs_time"]


def _train_sweep(sweep_dir: Path, overrides: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "train.py", "-m", *overrides, "wandb.mode=disabled", f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sweep_dir = tmp_path_factory.mktemp("sweep")
    _train_sweep(sweep_dir, TINY_SWEEP)
    return sweep_dir


def _parse_table(table: str) -> tuple[list[str], list[dict[str, str]]]:
    lines = table.splitlines()
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    header = cells[0]
    assert set(lines[1]) <= set("|-:"), f"second line is not a rule: {lines[1]!r}"
    return header, [dict(zip(header, row, strict=True)) for row in cells[2:]]


# --------------------------------------------------------------------------------- a real sweep


@pytest.mark.slow
def test_sweep_table_has_a_row_per_job_with_its_varying_overrides(tiny_sweep: Path) -> None:
    runs = load_sweep(tiny_sweep)
    assert [r.name for r in runs] == ["0", "1", "2", "3"]
    header, rows = _parse_table(comparison_table(runs))
    assert [h for h in header if h not in OPTIONAL_COLUMNS] == [
        "job", "overrides", "method", "optimizer", "stages", "steps logged", "loss (last 5)",
        "samples/s", "bubble util", "sim. util", "refresh k"]
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    seen = set()
    for row in rows:
        # Only the swept keys vary: the fixed overrides (stages=2, steps=3, ...) stay out.
        assert row["overrides"] == f"pipeline={row['method']} optimizer={row['optimizer']}"
        seen.add((row["method"], row["optimizer"]))
        assert row["stages"] == "2" and row["steps logged"] == "3"
        assert math.isfinite(float(row["loss (last 5)"]))
        assert float(row["samples/s"]) > 0
        assert 0 < float(row["bubble util"]) <= 1 and 0 < float(row["sim. util"]) <= 1
        assert row["refresh k"] == ("1" if row["optimizer"] == "kfac" else "—")
    assert seen == {(p, o) for p in ("gpipe", "1f1b") for o in ("nvlamb", "kfac")}


@pytest.mark.slow
def test_sweep_plots_are_written_as_non_empty_png_and_pdf(tiny_sweep: Path, tmp_path: Path) -> None:
    runs = load_sweep(tiny_sweep)
    paths = plot_sweep(runs, tmp_path / "plots")
    stems = ["compare_loss_vs_step", "compare_loss_vs_time", "compare_utilization_vs_step"]
    stems += EVAL_STEMS if any(run.series("eval_mlm_loss")[0] for run in runs) else []
    assert paths == [tmp_path / "plots" / f"{s}.{ext}" for s in stems for ext in ("png", "pdf")]
    for path in paths:
        head = path.read_bytes()[:8]
        assert head.startswith(b"\x89PNG" if path.suffix == ".png" else b"%PDF"), path
        assert path.stat().st_size > 5000, f"{path} is suspiciously small"


@pytest.mark.slow
def test_main_prints_the_table_and_plot_paths_defaulting_to_the_sweep_dir(
        tiny_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sweep = tmp_path / "copy"
    shutil.copytree(tiny_sweep, sweep)
    assert main([str(sweep), "--last", "2"]) == 0
    out = capsys.readouterr().out
    table, _, listing = out.partition("\n\n")
    _header, rows = _parse_table(table)
    assert len(rows) == 4 and "loss (last 2)" in _header
    listed = [Path(p) for p in listing.split()]
    evaluated = any(run.series("eval_mlm_loss")[0] for run in load_sweep(sweep))
    assert len(listed) == (10 if evaluated else 6) and all(p.parent == sweep and p.stat().st_size > 0 for p in listed)


def test_offline_wandb_history_fills_gaps_and_stands_in_for_a_missing_metrics_file(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    from pipefisher.tracking import WandbLogger

    job = tmp_path / "sweep" / "0"
    records = _records([3.0, 2.5, 2.0], [10.0, 20.0, 30.0], util=[0.5, 0.6, 0.7], lr=1e-3,
                       kfac_work={"CURV_A": 4, "INVERT": 2}, refresh_interval=2)
    # The logger train.py uses, offline, into <job>/wandb/offline-run-*/run-*.wandb.
    with WandbLogger({"stages": 2}, mode="offline", dir=job, rank=0) as wb:
        for rec in records:
            wb.log(rec, step=rec["step"])
    assert list(job.glob("wandb/offline-run-*/run-*.wandb")), "wandb wrote no offline run"
    _write_job(job, {}, [{k: v for k, v in rec.items() if k != "lr"} for rec in records])

    (run,) = load_sweep(job.parent)
    assert run.source == "metrics.jsonl+wandb"
    assert run.series("lr") == ([0, 1, 2], [1e-3] * 3)  # only in wandb's history

    (job / "metrics.jsonl").unlink()
    (run,) = load_sweep(job.parent)
    assert run.source == "wandb"
    assert [dict(r) for r in run.records] == records  # nested kfac_work included


# --------------------------------------------------------------------------------- hand-written runs


def _write_job(job: Path, overrides: dict[str, Any], records: list[dict[str, Any]] | str | None,
               *, method: str = "gpipe", optimizer: str = "nvlamb", stages: int = 2) -> Path:
    (job / ".hydra").mkdir(parents=True)
    config = {"pipeline": {"method": method}, "optimizer": {"name": optimizer}, "stages": stages}
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"{k}={v}" for k, v in overrides.items()]))
    if isinstance(records, str):
        (job / "metrics.jsonl").write_text(records)
    elif records is not None:
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return job


def _records(losses: list[float | None], samples: list[float], util: list[float] | None = None,
             **extra: Any) -> list[dict[str, Any]]:
    out = []
    for step, (loss, sps) in enumerate(zip(losses, samples, strict=True)):
        rec = {"step": step, "loss": loss, "step_time_s": 8.0 / sps, "samples_per_s": sps, **extra}
        if util is not None:
            rec["bubble_utilization"] = util[step]
            rec["simulated_bubble_utilization"] = util[step] / 2
        out.append(rec)
    return out


def test_final_loss_averages_the_last_steps_and_medians_leave_out_the_warmup_step(tmp_path: Path) -> None:
    _write_job(tmp_path / "0", {"lr": 1}, _records([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0],
                                                  [1.0, 10.0, 30.0, 20.0, 40.0, 50.0, 60.0],
                                                  util=[0.1, 0.5, 0.7, 0.6, 0.9, 0.8, 0.4]))
    (run,) = load_sweep(tmp_path)
    s = summarize(run)
    assert s.num_steps == 7
    assert s.final_loss == pytest.approx((7 + 6 + 5 + 4 + 3) / 5)
    assert s.samples_per_s == pytest.approx(35.0)  # median of 10..60, the 1.0 warm-up left out
    assert s.bubble_utilization == pytest.approx(0.65)
    assert s.simulated_bubble_utilization == pytest.approx(0.325)
    assert s.refresh_intervals == ()
    assert summarize(run, last=2).final_loss == pytest.approx(3.5)
    assert summarize(run, last=100).final_loss == pytest.approx(6.0)  # fewer steps than N: all of them
    with pytest.raises(ValueError, match="last=0"):
        summarize(run, last=0)


def test_a_nonfinite_loss_among_the_last_steps_makes_the_final_loss_nan(tmp_path: Path) -> None:
    _write_job(tmp_path / "0", {}, _records([5.0, 4.0, None, 3.0], [1.0, 2.0, 3.0, 4.0]))
    (run,) = load_sweep(tmp_path)
    assert math.isnan(summarize(run).final_loss)
    assert summarize(run, last=1).final_loss == 3.0
    _header, rows = _parse_table(comparison_table([run]))
    assert rows[0]["loss (last 5)"] == "nan"


def test_table_shows_only_varying_overrides_and_marks_missing_values(tmp_path: Path) -> None:
    base = {"steps": 4}
    _write_job(tmp_path / "10", {**base, "lr": "1e-3"},
               _records([4.0, 3.0], [5.0, 6.0], util=[0.5, 0.6], refresh_interval=2), optimizer="pipefisher")
    _write_job(tmp_path / "9", {**base, "lr": "2e-3"}, _records([4.0, 2.0], [5.0, 7.0]), stages=1)
    _write_job(tmp_path / "8", {**base}, _records([4.0], [5.0]))
    runs = load_sweep(tmp_path)
    assert [r.name for r in runs] == ["8", "9", "10"]  # numbers in natural order
    header, rows = _parse_table(comparison_table(runs, last=1))
    assert header[:4] == ["job", "overrides", "method", "optimizer"] and header[-1] == "refresh k"
    assert [r["overrides"] for r in rows] == ["—", "lr=2e-3", "lr=1e-3"]
    assert [r["optimizer"] for r in rows] == ["nvlamb", "nvlamb", "pipefisher"]
    assert [r["stages"] for r in rows] == ["2", "1", "2"]
    assert [r["loss (last 1)"] for r in rows] == ["4.0000", "2.0000", "3.0000"]
    assert [r["samples/s"] for r in rows] == ["—", "7.0", "6.0"]  # one step: nothing after warm-up
    assert [r["bubble util"] for r in rows] == ["—", "—", "0.600"]
    assert [r["sim. util"] for r in rows] == ["—", "—", "0.300"]
    assert [r["refresh k"] for r in rows] == ["—", "—", "2"]
    # No K-FAC run, no refresh column; one run, no overrides column.
    header, _ = _parse_table(comparison_table(runs[:1]))
    assert "refresh k" not in header and "overrides" not in header
    # Without utilization, no utilization plot.
    paths = plot_sweep(runs[:2], tmp_path / "plots")
    assert [p.name for p in paths] == ["compare_loss_vs_step.png", "compare_loss_vs_step.pdf",
                                       "compare_loss_vs_time.png", "compare_loss_vs_time.pdf"]


def _eval_records(step_times: list[float], evals: dict[int, tuple[float | None, float, float]],
                  tflops: list[float], peak_mb: list[float]) -> list[dict[str, Any]]:
    """Steps with throughput and memory; ``evals``: step → (MLM loss, MLM accuracy, NSP accuracy)."""
    out = []
    for step, (dt, tf, mb) in enumerate(zip(step_times, tflops, peak_mb, strict=True)):
        rec = {"step": step, "loss": 5.0 - step, "step_time_s": dt, "samples_per_s": 8.0 / dt,
               "tflops": tf, "mfu": tf / 100, "peak_memory_bytes": int(mb * 1e6)}
        if step in evals:
            mlm_loss, mlm_acc, nsp_acc = evals[step]
            rec.update(eval_mlm_loss=mlm_loss, eval_mlm_accuracy=mlm_acc, eval_nsp_loss=0.69,
                       eval_nsp_accuracy=nsp_acc, eval_time_s=100.0)  # much longer than any step
        out.append(rec)
    return out


@pytest.fixture
def eval_sweep(tmp_path: Path) -> Path:
    """Two runs that evaluated (every 2 steps and after the last) and one older run without the new fields."""
    sweep = tmp_path / "sweep"
    _write_job(sweep / "0", {"lr": "1e-3"},
               _eval_records([4.0, 1.0, 2.0, 1.0, 3.0], {1: (6.0, 0.1, 0.5), 3: (5.0, 0.2, 0.6), 4: (4.5, 0.25, 0.7)},
                             tflops=[1.0, 10.0, 30.0, 20.0, 40.0], peak_mb=[900.0, 1500.0, 2500.0, 2000.0, 1000.0]))
    _write_job(sweep / "1", {"lr": "1e-2"},  # diverged: the last evaluation's loss was written as null
               _eval_records([2.0, 2.0, 2.0], {1: (7.0, 0.05, 0.5), 2: (None, 0.0, 0.5)},
                             tflops=[3.0, 5.0, 7.0], peak_mb=[700.0, 800.0, 750.0]))
    _write_job(sweep / "2", {"lr": "1e-4"}, _records([4.0, 3.0], [5.0, 6.0]))
    return sweep


def test_table_shows_the_last_evaluation_throughput_medians_and_peak_memory(eval_sweep: Path) -> None:
    runs = load_sweep(eval_sweep)
    s = summarize(runs[0])
    assert (s.eval_mlm_loss, s.eval_mlm_accuracy, s.eval_nsp_accuracy) == (4.5, 0.25, 0.7)  # step 4's
    assert s.tflops == pytest.approx(25.0) and s.mfu == pytest.approx(0.25)  # median of steps 1-4
    assert s.peak_memory_bytes == 2_500_000_000
    header, rows = _parse_table(comparison_table(runs))
    assert header == ["job", "overrides", "method", "optimizer", "stages", "steps logged", "loss (last 5)",
                      "eval MLM loss", "eval MLM acc", "eval NSP acc", "samples/s", "TFLOP/s", "MFU",
                      "bubble util", "sim. util", "peak mem (MB)"]
    assert [r["eval MLM loss"] for r in rows] == ["4.5000", "nan", "—"]  # a null is not replaced by 7.0
    assert [r["eval MLM acc"] for r in rows] == ["0.250", "0.000", "—"]
    assert [r["eval NSP acc"] for r in rows] == ["0.700", "0.500", "—"]
    assert [r["TFLOP/s"] for r in rows] == ["25", "6", "—"]
    assert [r["MFU"] for r in rows] == ["0.250", "0.060", "—"]
    assert [r["peak mem (MB)"] for r in rows] == ["2500", "800", "—"]
    # An old sweep: none of the new columns.
    header, _ = _parse_table(comparison_table(runs[2:]))
    assert not OPTIONAL_COLUMNS & set(header)


def test_a_one_step_run_keeps_its_step_for_tflops_and_mfu(tmp_path: Path) -> None:
    _write_job(tmp_path / "0", {}, _eval_records([2.0], {0: (6.0, 0.1, 0.5)}, tflops=[3.0], peak_mb=[10.0]))
    s = summarize(load_sweep(tmp_path)[0])
    assert (s.tflops, s.mfu, s.samples_per_s) == (3.0, 0.03, None)  # samples/s keeps its warm-up rule
    assert s.eval_mlm_loss == 6.0


def test_eval_plots_are_written_when_some_run_evaluated(eval_sweep: Path, tmp_path: Path) -> None:
    paths = plot_sweep(load_sweep(eval_sweep), tmp_path / "plots")
    stems = ["compare_loss_vs_step", "compare_loss_vs_time", *EVAL_STEMS]  # no utilization recorded
    assert paths == [tmp_path / "plots" / f"{s}.{ext}" for s in stems for ext in ("png", "pdf")]
    for path in paths:
        assert path.read_bytes()[:8].startswith(b"\x89PNG" if path.suffix == ".png" else b"%PDF"), path


def test_eval_loss_over_time_sums_step_times_and_leaves_out_eval_time(eval_sweep: Path) -> None:
    run, diverged, old = load_sweep(eval_sweep)
    assert run.series("eval_mlm_loss") == ([1, 3, 4], [6.0, 5.0, 4.5])
    # Step times 4, 1, 2, 1, 3: steps 1, 3 and 4 end at 5, 8 and 11 s; the 100 s evaluations add nothing.
    assert _cumulative_time(run, "eval_mlm_loss") == ([5.0, 8.0, 11.0], [6.0, 5.0, 4.5])
    assert _cumulative_time(run) == ([4.0, 5.0, 7.0, 8.0, 11.0], [5.0, 4.0, 3.0, 2.0, 1.0])  # training loss
    assert _cumulative_time(diverged, "eval_mlm_loss") == ([4.0], [7.0])  # the null evaluation is no point
    assert _cumulative_time(old, "eval_mlm_loss") == ([], [])


def test_broken_runs_are_skipped_with_a_warning_naming_the_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = _write_job(tmp_path / "0", {"seed": 0}, _records([2.0, 1.0], [3.0, 4.0]))
    broken = _write_job(tmp_path / "1", {"seed": 1},
                        '{"step": 0, "loss": 1.0}\n{"step": 1, "loss"\n{"step": 2}\n')
    missing = _write_job(tmp_path / "2", {"seed": 2}, None)
    empty = _write_job(tmp_path / "3", {"seed": 3}, "")
    with caplog.at_level(logging.WARNING, logger="pipefisher.compare"):
        runs = load_sweep(tmp_path)
    assert [r.path for r in runs] == [good]
    warnings = "\n".join(r.getMessage() for r in caplog.records)
    assert f"{broken / 'metrics.jsonl'}:2" in warnings  # file and line of the malformed record
    assert f"{missing / 'metrics.jsonl'}: no such file" in warnings
    assert f"{empty / 'metrics.jsonl'}: no records" in warnings


def test_a_truncated_last_line_keeps_the_run(tmp_path: Path) -> None:
    _write_job(tmp_path / "0", {}, '{"step": 0, "loss": 2.0}\n{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    (run,) = load_sweep(tmp_path)
    assert run.series("loss") == ([0, 1], [2.0, 1.0])


def test_no_usable_run_is_an_error_naming_the_paths(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=f"{tmp_path}: no runs found"):
        load_sweep(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_sweep(tmp_path / "absent")
    bad = _write_job(tmp_path / "0", {}, "not json\n{}\n")
    with pytest.raises(ValueError, match="none of its 1 run") as err:
        load_sweep(tmp_path)
    assert f"{bad / 'metrics.jsonl'}:1" in str(err.value)
    assert main([str(tmp_path)]) == 1
    assert f"{bad / 'metrics.jsonl'}:1" in capsys.readouterr().err


def test_wandb_log_framing_reassembles_records_that_span_blocks() -> None:
    # LevelDB log framing: 7-byte file header, 32 KiB blocks, chunks of crc/len/type + data.
    big, small = bytes(range(256)) * 200, b"tail"  # 51,200 bytes: FIRST, MIDDLE..., LAST
    data, block = bytearray(b":W&B\xe1\xbe\x00"), 32768

    def put(payload: bytes) -> None:
        first = True
        while True:
            left = block - len(data) % block
            if left < 7:
                data.extend(b"\0" * left)
                continue
            chunk, rest = payload[: left - 7], payload[left - 7:]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            data.extend(struct.pack("<IHB", 0, len(chunk), kind) + chunk)
            payload, first = rest, False
            if not rest:
                return

    put(small), put(big), put(small)
    assert _wandb_log_records(bytes(data)) == [small, big, small]
    with pytest.raises(ValueError, match="not a .wandb file"):
        _wandb_log_records(b"garbage")
