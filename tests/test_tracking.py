"""metrics.jsonl round trip and wandb in offline / disabled mode (never online)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import pipefisher
from pipefisher.tracking import (
    MetricsWriter,
    WandbLogger,
    read_metrics,
    resolve_mode,
    run_name_from_overrides,
)


@pytest.fixture(autouse=True)
def _wandb_sandbox(tmp_path, monkeypatch):
    """Keep every wandb file in tmp_path and never reach the network."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DISABLED", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")


# --------------------------------------------------------------------------------------------
# metrics.jsonl
# --------------------------------------------------------------------------------------------


def test_metrics_round_trip_converts_tensors_and_numpy(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write({"step": 0, "loss": torch.tensor(2.5), "lr": np.float32(0.25)})
        writer.write(
            {
                "step": np.int64(1),
                "loss": torch.tensor(1.5, dtype=torch.float64),
                "stage_times_s": torch.tensor([0.5, 0.25]),
                "ok": np.bool_(True),
                "method": "chimera",
            }
        )
    assert (tmp_path / "metrics.jsonl").is_file()
    records = read_metrics(tmp_path)
    assert records == [
        {"step": 0, "loss": 2.5, "lr": 0.25},
        {"step": 1, "loss": 1.5, "stage_times_s": [0.5, 0.25], "ok": True, "method": "chimera"},
    ]
    assert type(records[1]["step"]) is int


def test_metrics_writes_non_finite_values_as_null(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as writer:
        written = writer.write(
            {"loss": float("nan"), "grad_norm": torch.tensor(float("inf")), "xs": [1.0, -math.inf]}
        )
    assert written == {"loss": None, "grad_norm": None, "xs": [1.0, None]}
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert read_metrics(path) == [written]


def test_metrics_appends_and_flushes_each_line(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write({"step": 0})
    assert read_metrics(tmp_path) == [{"step": 0}]  # visible before close
    writer.close()
    with MetricsWriter(tmp_path) as again:  # a resumed run appends
        again.write({"step": 1})
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    with pytest.raises(ValueError, match="closed"):
        writer.write({"step": 2})


def test_metrics_rejects_unconvertible_value_naming_the_key(tmp_path):
    with MetricsWriter(tmp_path) as writer, pytest.raises(TypeError, match="'model'"):
        writer.write({"model": object()})


def test_read_metrics_skips_truncated_last_line_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "lo')
    assert read_metrics(path) == [{"step": 0}, {"step": 1}]
    path.write_text('{"step": 0}\n{"ste\n{"step": 2}\n')
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


# --------------------------------------------------------------------------------------------
# run names and mode resolution
# --------------------------------------------------------------------------------------------


def test_run_name_from_overrides_sorted_and_without_hydra_keys():
    assert run_name_from_overrides(["stages=4", "pipeline=chimera"]) == "pipeline=chimera,stages=4"
    assert (
        run_name_from_overrides(["+model=tiny", "hydra.run.dir=x", "seed=1", "~data.path"], exclude=["seed"])
        == "data.path,model=tiny"
    )
    assert run_name_from_overrides([]) == "default"


def test_run_name_keeps_what_a_run_trains_and_only_a_path_s_last_part():
    overrides = ["data.path=/scratch/alice/bert/wiki_shards/", "progress=false", "wandb.mode=offline",
                 "log_every=1", "resume=auto", "optimizer.schedule=/home/alice/out/assignment.json", "stages=2"]
    assert run_name_from_overrides(overrides) == "data.path=wiki_shards,optimizer.schedule=assignment.json,stages=2"
    long = run_name_from_overrides([f"model.k{i:03d}=1" for i in range(40)])
    assert len(long) == 128 and long.endswith("…") and long.startswith("model.k000=1,model.k001=1")


def test_run_name_shortens_each_path_of_a_list_value_and_keeps_its_brackets():
    # issue 40: init.checkpoint='[runs/wt2]' was named "init.checkpoint=wt2]"
    assert run_name_from_overrides(["init.checkpoint=[runs/wt2]"]) == "init.checkpoint=[wt2]"
    assert run_name_from_overrides(["init.checkpoint=[ckpt/stage0.pt, /abs/ckpt/stage1.pt]", "task=mnli"]) == (
        "init.checkpoint=[stage0.pt,stage1.pt],task=mnli")
    assert run_name_from_overrides(["init.checkpoint=['runs/wt2/']"]) == "init.checkpoint=[wt2]"
    assert run_name_from_overrides(["init.checkpoint=[]"]) == "init.checkpoint=[]"
    assert run_name_from_overrides(["task.dev_files={dev: glue/SST-2/dev.tsv}"]) == "task.dev_files={dev: dev.tsv}"


def test_resolve_mode_env_overrides_config_but_cannot_enable_a_disabled_run(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    assert resolve_mode("offline") == "online"
    assert resolve_mode("disabled") == "disabled"
    assert resolve_mode("offline", enabled=False) == "disabled"
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert resolve_mode("online") == "offline"
    monkeypatch.delenv("WANDB_MODE")
    assert resolve_mode("offline") == "offline"
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ValueError, match="WANDB_MODE"):
        resolve_mode("offline")
    with pytest.raises(ValueError, match="wandb.mode"):
        resolve_mode("sometimes")


# --------------------------------------------------------------------------------------------
# WandbLogger
# --------------------------------------------------------------------------------------------


def _png(path):
    from PIL import Image

    Image.new("RGB", (4, 4), (255, 0, 0)).save(path)
    return path


def test_wandb_logger_offline_writes_an_offline_run_dir(tmp_path):
    out = tmp_path / "hydra_out"
    name = run_name_from_overrides(["pipeline=chimera", "stages=4"])
    with WandbLogger(
        {"pipeline": "chimera", "stages": 4}, project="pipefisher-test", group="sweep-1",
        name=name, mode="offline", dir=out, enabled=True,
    ) as wb:
        assert wb.active and wb.mode == "offline"
        for step in range(3):
            wb.log({"loss": torch.tensor(3.0 - step), "lr": np.float64(0.1)}, step=step)
        wb.log_image("timeline", _png(tmp_path / "t.png"), step=2)
    assert not wb.active
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    assert list(runs[0].glob("run-*.wandb")), "no offline run file"


def test_an_offline_run_prints_two_lines_of_ours_and_none_of_wandb(tmp_path, capfd, caplog):
    caplog.set_level("INFO", logger="pipefisher.tracking.wandb_logger")
    with WandbLogger({"stages": 1}, project="pipefisher-test", name="steps=2", mode="offline", dir=tmp_path) as wb:
        wb.log({"loss": 1.0}, step=0)
    printed = capfd.readouterr()
    assert "wandb:" not in printed.out + printed.err, printed.out + printed.err  # was ~30 lines per run
    ours = [r.getMessage() for r in caplog.records if r.name == "pipefisher.tracking.wandb_logger"]
    assert len(ours) == 2 and ours[0].startswith("wandb: offline run 'steps=2' in ")
    assert ours[1].startswith("wandb: upload this run with `wandb sync ") and str(tmp_path) in ours[1]


def test_wandb_logger_disabled_creates_nothing_and_never_imports_wandb(tmp_path):
    # A fresh interpreter, so an earlier test's `import wandb` cannot hide an import here.
    code = textwrap.dedent(
        f"""
        import sys
        from pipefisher.tracking import WandbLogger
        wb = WandbLogger({{"a": 1}}, project="p", group="g", name="n", mode="disabled",
                         dir={str(tmp_path / "out")!r}, enabled=True)
        wb.log({{"loss": 1.0}}, step=0)
        wb.finish()
        assert not wb.active and wb.run_dir is None
        assert "wandb" not in sys.modules, "disabled mode imported wandb"
        """
    )
    repo_root = str(Path(pipefisher.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env, timeout=120)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_wandb_logger_enabled_false_and_nonzero_rank_are_noops(tmp_path):
    off = WandbLogger({}, project="p", group="g", name="n", mode="offline", dir=tmp_path / "a", enabled=False)
    rank1 = WandbLogger({}, project="p", group="g", name="n", mode="offline", dir=tmp_path / "b", rank=1)
    for wb in (off, rank1):
        assert not wb.active
        wb.log({"loss": 1.0}, step=0)
        wb.finish()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(FileNotFoundError):
        off.log_image("plot", tmp_path / "missing.png")
