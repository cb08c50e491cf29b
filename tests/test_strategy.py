"""The hybrid strategy search (planning.strategy_search) and its strategy file (planning.strategy_file):
memory terms against planning.memory and hand formulas, time terms against hand sums of the
collectives, the file's checks, and the round trip schedule.py whatif=true -> train.py strategy=<file>."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipefisher.config import ConfigError, DataConfig, ModelConfig
from pipefisher.model.config import BertConfig
from pipefisher.planning.comm_costs import CommCosts, LinkFit
from pipefisher.planning.config import register_schedule_configs, to_schedule_config
from pipefisher.planning.costs import Hardware, RunShape, stage_parameters
from pipefisher.planning.memory import estimate_memory_per_worker
from pipefisher.planning.strategy_file import apply_strategy, read_strategy, strategy_document, strategy_overrides
from pipefisher.planning.strategy_search import (Strategy, hybrid_costs, hybrid_memory_per_worker, search_strategies,
                                                 tp_sharded_parameters)
from tests.conftest import CONF_DIR, REPO, compose_dict

# A model small enough to count by hand: V=100, H=8, L=2, A=2, FFN 32, 16 positions.
SMALL = BertConfig(vocab_size=100, hidden_size=8, num_layers=2, num_heads=2, max_position_embeddings=16)
EMBEDDINGS = (100 + 16 + 2) * 8 + 2 * 8  # word, position, type tables + LayerNorm = 960
ENCODER = 4 * (8 * 8 + 8) + (8 * 32 + 32) + (32 * 8 + 8) + 4 * 8  # q k v out, FFN in/out, 2 LayerNorms = 872
HEADS = (8 * 8 + 8 + 2 * 8 + 100) + 100 * 8 + (8 * 8 + 8) + (2 * 8 + 2)  # MLM transform+bias, decoder, pooler, NSP = 1078


@pytest.mark.parametrize("method,stages,dp,recompute", [("1f1b", 2, 2, False), ("gpipe", 1, 2, True),
                                                        ("chimera", 2, 1, False), ("zb-v", 2, 1, False),
                                                        ("interleaved", 2, 1, True)])
def test_memory_terms_at_sdp1_tp1_equal_planning_memory(method, stages, dp, recompute):
    bert = BertConfig.from_size("mini")
    v = 2 if method in ("zb-v", "interleaved") else 1
    run = RunShape(bert, method, stages, 4, 8, dp, v, 64, 10, recompute=recompute)
    schedule = run.build_schedule(dp_width=1)
    ours = hybrid_memory_per_worker(run, 1, 1, schedule)
    theirs = estimate_memory_per_worker(run, "nvlamb", schedule)
    assert set(ours) == set(theirs)
    for w in ours:
        for name in ("weights", "gradients", "optimizer", "activations"):
            assert getattr(ours[w], name) == pytest.approx(getattr(theirs[w], name)), (w, name)


def test_stage_parameters_match_the_hand_count_the_hybrid_terms_use():
    run = RunShape(SMALL, "gpipe", 1, 2, 2, seq_len=16, max_predictions=4)
    # one stage: the word embedding is the decoder, one tensor (V·H = 800 counted once)
    assert stage_parameters(SMALL, run.partition) == [EMBEDDINGS + 2 * ENCODER + HEADS - 800] == [3782 - 800]
    two = RunShape(SMALL, "gpipe", 2, 2, 2, seq_len=16, max_predictions=4)
    assert sum(stage_parameters(SMALL, two.partition)) == 3782  # two stages: each end holds its copy
    assert tp_sharded_parameters(SMALL) == 4 * 64 + 2 * 8 * 32 + 3 * 8 + 32  # split weights and column biases


def test_sdp_memory_is_the_shards_plus_one_gathered_copy_and_unsharded_gradients():
    run = RunShape(SMALL, "gpipe", 1, 2, 2, dp_width=2, seq_len=16, max_predictions=4)
    p = 3782 - 800  # one stage: the word embedding and the decoder are one tensor
    m = hybrid_memory_per_worker(run, sdp=2)[0]
    assert m.weights == pytest.approx(4 * p / 2 + 4 * p)  # shard + gathered for the step
    assert m.gradients == pytest.approx(4 * p)  # accumulated unsharded (the reduce-scattered shard replaces them)
    assert m.optimizer == pytest.approx(12 * p / 2)  # 2 moments + the step's temporary, sharded
    assert m.comm_buffers == pytest.approx(4 * p)  # FSDP's reduce-scatter input
    dp = hybrid_memory_per_worker(run, sdp=1)[0]
    untied = p - 100 * 8  # the tied word embedding is synced apart, at STEP
    assert (dp.weights, dp.gradients, dp.optimizer, dp.comm_buffers) == pytest.approx((4 * p, 4 * p, 12 * p, 4 * untied))
    # sdp=4: the sharded parts shrink, the step's gathered copy does not
    m4 = hybrid_memory_per_worker(RunShape(SMALL, "gpipe", 1, 2, 2, dp_width=4, seq_len=16, max_predictions=4), sdp=4)[0]
    assert m4.weights + m4.gradients + m4.optimizer == pytest.approx(4 * p / 4 + 4 * p + 4 * p + 12 * p / 4)


def test_tp_memory_splits_the_encoder_weights_and_korthikanti_activations():
    s, b, h, a = 16, 2, 8, 2
    run = RunShape(SMALL, "gpipe", 1, 1, b, seq_len=s, max_predictions=4)
    m = hybrid_memory_per_worker(run, tp=2)[0]
    local = 3782 - 800 - 2 * tp_sharded_parameters(SMALL) / 2
    assert m.weights == pytest.approx(4 * local) and m.optimizer == pytest.approx(12 * local)
    # fp32: twice the 16-bit bytes S*b*H*(10 + 24/t + 5*a*S/(H*t)) per layer, 2 layers, + the embedding output
    per_layer = s * b * h * (10 + 24 / 2 + 5 * a * s / (h * 2)) * 2
    heads = 3 * b * 4 * 100 * 4  # b·P·V fp32 log-probabilities in flight, two more in the heads' backward
    assert m.activations == pytest.approx(2 * per_layer + s * b * h * 4 + heads)


def _comm() -> CommCosts:
    fit = {2: LinkFit(1e-4, 1e9)}
    return CommCosts({"all_reduce": fit, "all_gather": {2: LinkFit(2e-4, 2e9)}, "reduce_scatter": {2: LinkFit(3e-4, 5e8)},
                      "p2p": {2: LinkFit(5e-5, 4e9)}})


def test_time_terms_charge_tp_all_reduces_and_sdp_gather_and_reduce_scatter_by_hand():
    hw = Hardware(flops_per_s=1e9, memory_bytes_per_s=1e9)
    comm = _comm()
    run = RunShape(SMALL, "gpipe", 1, 2, 2, seq_len=16, max_predictions=4)
    plain = hybrid_costs(run, 1, 1, hw, comm)
    tp = hybrid_costs(run, 1, 2, hw, comm)
    activation = 2 * 16 * 8 * 4  # b*S*H fp32
    ar = 1e-4 + activation / 1e9
    encoder_s = 2 * 2 * (8 * 16 * 64 + 4 * 16 * 8 * 32 + 4 * 16 * 16 * 8) / 1e9  # 2 layers x b x FLOPs per sequence
    assert (plain.forward_ns[0] - tp.forward_ns[0]) * 1e-9 == pytest.approx(encoder_s / 2 - 2 * 2 * ar, abs=2e-9)
    assert (plain.backward_ns[0] - tp.backward_ns[0]) * 1e-9 == pytest.approx(encoder_s - 2 * 2 * ar, abs=2e-9)
    # sdp=2 at D=1 (one replica block): reduce-scatter of 4p at SYNC_GRAD; at STEP the all-gather of 4p,
    # the tied weight's all-reduce over its one holder per sdp index (none) and half the optimizer step.
    sdp_run = RunShape(SMALL, "gpipe", 1, 2, 2, dp_width=2, seq_len=16, max_predictions=4)
    sdp = hybrid_costs(sdp_run, 2, 1, hw, comm)
    p = 3782 - 800  # the tied weight once
    assert sdp.sync_ns[0] * 1e-9 == pytest.approx(3e-4 + 4 * p / 5e8, abs=2e-9)
    norm = 1e-4 + 8 / 1e9  # the global norm's all-reduce over both workers
    assert sdp.step_ns * 1e-9 == pytest.approx(p / 2 * 28 / 1e9 + 2e-4 + 4 * p / 2e9 + norm, abs=2e-9)
    # dp=2: the untied gradients' all-reduce at SYNC_GRAD, the tied weight's at STEP
    dp = hybrid_costs(sdp_run, 1, 1, hw, comm)
    assert dp.sync_ns[0] * 1e-9 == pytest.approx(1e-4 + 4 * (p - 800) / 1e9, abs=2e-9)
    assert dp.step_ns * 1e-9 == pytest.approx(p * 28 / 1e9 + 1e-4 + 4 * 800 / 1e9 + norm, abs=2e-9)


def test_search_excludes_what_cannot_run_and_ranks_the_rest_under_the_budget():
    found = search_strategies(BertConfig.from_size("mini"), devices=4, memory_gb=100, global_batch=16,
                              hardware=Hardware(flops_per_s=1e10), comm=_comm(), methods=["1f1b"],
                              micro_batch_sizes=[4], optimizers=["nvlamb", "kfac"], recompute=[False],
                              sdp_degrees=[1, 2, 4], tp_degrees=[1, 2, 8], seq_len=32, max_predictions=5)
    ranked = [c for c in found if c.excluded is None]
    assert ranked and all(a.samples_per_s >= b.samples_per_s for a, b in zip(ranked, ranked[1:]))
    assert all(c.devices == 4 and c.global_batch == 16 for c in found if c.num_micro_batches)
    reasons = {(c.stages, c.dp, c.sdp, c.tp, c.optimizer): c.excluded for c in found}
    assert "needs sharded factors" in reasons[(1, 2, 2, 1, "kfac")]
    assert reasons[(1, 2, 2, 1, "nvlamb")] is None and reasons[(2, 1, 1, 2, "nvlamb")] is None
    assert not any(c.tp == 8 for c in found)  # a mesh of 4 devices has no tp=8
    # sdp=4 holds a quarter of the state beside one gathered copy: below dp=4's peak
    sharded = next(c for c in ranked if (c.stages, c.dp, c.sdp, c.tp) == (1, 1, 4, 1))
    plain = next(c for c in ranked if (c.stages, c.dp, c.sdp, c.tp) == (1, 4, 1, 1))
    assert sharded.memory_gb < plain.memory_gb
    tight = search_strategies(BertConfig.from_size("mini"), devices=4, memory_gb=sharded.memory_gb * 1.0001,
                              global_batch=16, comm=_comm(), methods=["1f1b"], micro_batch_sizes=[4],
                              optimizers=["nvlamb"], recompute=[False], sdp_degrees=[1, 4], tp_degrees=[1],
                              seq_len=32, max_predictions=5)
    over = {(c.stages, c.dp, c.sdp): c.excluded for c in tight if c.excluded}
    assert "exceeds memory_gb" in over[(1, 4, 1)] and (1, 1, 4) not in over
    refused = search_strategies(BertConfig.from_size("mini"), devices=2, memory_gb=100, global_batch=8, comm=_comm(),
                                methods=["1f1b"], micro_batch_sizes=[4], optimizers=["nvlamb"], recompute=[False],
                                sdp_degrees=[1], tp_degrees=[1, 3], seq_len=32, max_predictions=5,
                                refusal=lambda s: "no" if s.stages == 2 else None)
    assert {c.stages: c.excluded for c in refused if c.tp == 1} == {1: None, 2: "no"}


# -- the strategy file ---------------------------------------------------------------------------


def _doc(**changes) -> dict:
    s = Strategy("1f1b", 2, 1, 1, 1, 1, 2, 4, False, "nvlamb", samples_per_s=10.0, step_time_s=0.8, utilization=0.9,
                 interval=1, memory_gb=0.2, memory_per_worker_gb=(0.2, 0.15))
    doc = strategy_document(s, ModelConfig(), DataConfig(seq_len=32, max_predictions=5))
    doc.update(changes)
    return doc


def _write(tmp_path: Path, doc: dict, name: str = "s.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_strategy_file_sets_train_keys_galvatron_names_map_to():
    doc = read_strategy_doc = _doc()
    keys = strategy_overrides(read_strategy_doc)
    assert (keys["stages"], keys["data_parallel"], keys["sdp"], keys["micro_batch_size"], keys["num_micro_batches"],
            keys["global_batch_size"], keys["recompute"], keys["pipeline.method"]) == (2, 1, 1, 2, 4, 8, False, "1f1b")
    assert keys["model.hidden_size"] == 128 and keys["data.seq_len"] == 32
    assert doc["predicted"]["peak_memory_per_worker_bytes"] == [200_000_000, 150_000_000]


@pytest.mark.parametrize("change,field", [
    ({"format": "galvatron"}, "field format"),
    ({"global_bsz": 9}, "field global_bsz is 9, but micro_batch_size x chunks x dp_deg x sdp_deg = 8"),
    ({"pp_deg": 0}, "field pp_deg is 0"),
    ({"checkpoint": "yes"}, "field checkpoint"),
    ({"pipeline": {"method": "pipedream", "num_virtual": 1}}, "field pipeline.method is 'pipedream'"),
    ({"checkpoint": True, "per_stage": [{"dp_type": "dp", "tp": 1, "checkpoint": False},
                                        {"dp_type": "dp", "tp": 1, "checkpoint": True}]},
     "field per_stage[0].checkpoint is False, but checkpoint=True"),
    ({"per_stage": [{"dp_type": "dp", "tp": 1, "checkpoint": "yes"}] * 2}, "field per_stage[0].checkpoint is 'yes'"),
    ({"per_stage": [{"dp_type": "dp", "tp": 1, "checkpoint": False}] * 3}, "field per_stage has 3 entries for 2"),
    ({"per_stage": [{"dp_type": "sdp", "tp": 1, "checkpoint": False}] * 2}, "field per_stage[0].dp_type is 'sdp'"),
])
def test_bad_strategy_files_are_refused_naming_the_field(tmp_path: Path, change, field):
    path = _write(tmp_path, _doc(**change))
    with pytest.raises(ConfigError, match=f"strategy={path}: {field}".replace("[", r"\[").replace("]", r"\]")):
        read_strategy(path)
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        read_strategy(not_json)


def test_apply_strategy_sets_keys_and_refuses_explicit_keys_that_disagree(tmp_path: Path):
    path = _write(tmp_path, _doc())
    dcfg = compose_dict([f"strategy={path}"])
    apply_strategy(dcfg, [f"strategy={path}"])
    assert (dcfg.stages, dcfg.num_micro_batches, dcfg.pipeline.method, dcfg.data.seq_len) == (2, 4, "1f1b", 32)
    same = compose_dict([f"strategy={path}", "stages=2", "model=bert-tiny"])
    apply_strategy(same, [f"strategy={path}", "stages=2", "model=bert-tiny"])  # agreeing keys are fine
    other = compose_dict([f"strategy={path}", "stages=4", "model=bert-mini"])
    with pytest.raises(ConfigError, match=r"the command line disagrees with the file: stages=4 \(the file has 2\); "
                                          r"model.name=bert-mini \(the file has 'bert-tiny'\); model.num_layers=4 "):
        apply_strategy(other, [f"strategy={path}", "stages=4", "model=bert-mini"])


@pytest.mark.parametrize("key", ["pipeline.layers_per_stage=[1,3]", "pipeline.order_costs=[1,2,1]",
                                 "model.intermediate_size=64", "+model.dropout=0.0"])
def test_apply_strategy_refuses_pipeline_and_model_keys_the_file_does_not_set(tmp_path: Path, key: str):
    # Such a key changes what runs (pipeline.layers_per_stage: other stages than the search priced), and
    # apply_strategy used to let it through without a word (issue 38).
    doc = _doc()
    doc["model"].pop("intermediate_size", None)
    path = _write(tmp_path, doc)
    name = key.lstrip("+").split("=")[0]
    assert name not in strategy_overrides(read_strategy(path))
    dcfg = compose_dict([f"strategy={path}"])
    with pytest.raises(ConfigError) as exc:
        apply_strategy(dcfg, [f"strategy={path}", key])
    text = str(exc.value)
    assert "\n" not in text and text.startswith(f"strategy={path}: {name} is not set by the file but changes what runs")
    assert "pipeline.method, pipeline.num_virtual" in text and "keys outside pipeline.* and model.*" in text
    apply_strategy(compose_dict([f"strategy={path}"]), [f"strategy={path}", "steps=3", "lr=0.001", "seed=2"])


# -- round trip ----------------------------------------------------------------------------------


def _schedule_cfg(overrides: list[str]):
    register_schedule_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_schedule_config(compose(config_name="schedule", overrides=overrides))


@pytest.mark.slow
def test_strategy_written_by_the_search_runs_in_train_py_and_reports_prediction_beside_measurement(tmp_path: Path):
    from pipefisher.planning.cli import run_whatif

    cfg = _schedule_cfg(["whatif=true", "model=bert-tiny", "devices=2", "global_batch=8", "memory_gb=4",
                         "search.methods=[1f1b]", "search.micro_batch_sizes=[2]", "search.recompute=[false]",
                         "search.optimizers=[nvlamb]", "search.sdp=[1]", "search.tp=[1]", "data.seq_len=32",
                         "data.max_predictions=5", "flops_per_s=1e12", "p2p_bytes_per_s=1e11"])
    text = run_whatif(cfg, tmp_path / "plan")
    path = tmp_path / "plan" / "strategy.json"
    doc = read_strategy(path)
    rows = json.loads((tmp_path / "plan" / "whatif.json").read_text())
    best = next(r for r in rows if r["excluded"] is None)
    assert f"python train.py strategy={path}" in text
    assert (doc["pp_deg"], doc["dp_deg"], doc["sdp_deg"], doc["tp_deg"]) == (best["stages"], best["dp"], 1, 1)
    assert doc["predicted"]["step_time_s"] == best["step_time_s"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", f"strategy={path}", "steps=2", "progress=false",
                           "save_final=false", f"hydra.run.dir={run}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and len(metrics[-1]["peak_memory_per_worker_bytes"]) == 2  # world 2
    report = json.loads((run / "strategy_report.json").read_text())
    assert report["predicted_step_time_s"] == doc["predicted"]["step_time_s"]
    assert report["measured_step_time_s"] == metrics[-1]["step_time_s"]  # the median of the steps after the first
    assert report["predicted_peak_memory_bytes"] == doc["predicted"]["peak_memory_bytes"]
    out = proc.stdout + proc.stderr
    assert "s predicted" in out and "wrote strategy_report.json" in out
    bad = subprocess.run([sys.executable, "train.py", f"strategy={path}", "stages=3", f"hydra.run.dir={tmp_path / 'bad'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "the command line disagrees with the file: stages=3" in bad.stdout + bad.stderr
    assert not (tmp_path / "bad").exists()
