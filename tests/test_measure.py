"""Measuring a run: model FLOPs against torch's FLOP counter, peak FLOP/s, peak memory per step."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipefisher.measure import (
    Peak,
    PeakMemory,
    forward_flops,
    measure_cpu_peak,
    mfu,
    predicted_peak_bytes,
    resolve_peak,
    tflops,
    train_step_flops,
)
from pipefisher.measure import peak as peak_module
from pipefisher.model import BERT_SIZES, BertConfig, build_full_model
from pipefisher.planning.costs import RunShape
from pipefisher.planning.memory import estimate_memory, estimate_memory_per_worker
from pipefisher.schedules import critical_path_assignment

B, S, P = 2, 32, 5


def _batch(device: str = "meta") -> dict[str, torch.Tensor]:
    """A valid micro-batch [B,S] / [B,P] / [B] of longs (values do not matter on meta)."""
    def full(*shape: int, value: int = 1) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.long, device=device)

    return {"input_ids": full(B, S), "segment_ids": full(B, S, value=0), "input_mask": full(B, S),
            "masked_lm_positions": full(B, P), "masked_lm_ids": full(B, P), "next_sentence_labels": full(B, value=0)}


def _meta_model(size: str, recompute: bool = False) -> torch.nn.Module:
    # Meta tensors: shapes only, so bert-large's 340M parameters cost nothing. No dropout: the
    # keyed dropout masks need real tensors, and dropout does no matrix products anyway.
    with torch.device("meta"):
        return build_full_model(BertConfig.from_size(size, hidden_dropout=0.0, attention_dropout=0.0),
                                recompute=recompute)


# -- model FLOPs -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", list(BERT_SIZES))
def test_forward_flops_equal_torch_flop_counter_on_the_real_model(size: str):
    model = _meta_model(size).eval()
    with FlopCounterMode(display=False) as counter:
        model(None, _batch())  # embeddings, encoder, heads (MLM at the P slots), losses
    assert counter.get_total_flops() == forward_flops(model.config, B, S, P)
    # Only matrix products are counted: Linear layers (addmm; mm for the bias-free decoder) and
    # the attention's two batched products (bmm).
    ops = {str(op).split(".")[1] for op in counter.get_flop_counts()["Global"]}
    assert ops == {"addmm", "mm", "bmm"}


def test_backward_counts_twice_the_forward_so_a_step_is_three_forwards():
    model = _meta_model("mini").train()
    with FlopCounterMode(display=False) as counter:
        loss = model(None, _batch()).sum()
        forward = counter.get_total_flops()
        loss.backward()
    assert counter.get_total_flops() == 3 * forward == train_step_flops(model.config, B, S, P)


def test_recomputation_adds_hardware_flops_but_no_model_flops():
    model = _meta_model("mini", recompute=True).train()
    with FlopCounterMode(display=False) as counter:
        model(None, _batch()).sum().backward()
    bert = model.config
    one_layer = (forward_flops(replace(bert, num_layers=2), B, S, P)
                 - forward_flops(replace(bert, num_layers=1), B, S, P))
    # The counter sees every encoder layer's forward run again in the backward.
    assert counter.get_total_flops() == train_step_flops(bert, B, S, P) + bert.num_layers * one_layer


def test_flops_refuse_empty_shapes():
    with pytest.raises(ValueError, match="batch=0"):
        forward_flops(BertConfig.from_size("tiny"), 0, 128, 20)


# -- peak FLOP/s -------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEFISHER_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_cpu_peak_keeps_the_best_measurement_seen_on_this_machine(cache, monkeypatch):
    first = measure_cpu_peak(torch.float32, threads=1, seconds=0.1, size=512)
    assert first > 1e9  # any CPU torch runs on does a GFLOP/s
    entries = json.loads((cache / "cpu_peak.json").read_text())
    (key,) = entries
    assert "threads=1" in key and "torch.float32" in key and torch.__version__ in key

    # A busy machine measures low: the cached best stands; a higher measurement replaces it.
    monkeypatch.setattr(peak_module, "_time_matmul", lambda dtype, size, seconds: first / 3)
    assert measure_cpu_peak(torch.float32, threads=1) == first
    monkeypatch.setattr(peak_module, "_time_matmul", lambda dtype, size, seconds: first * 2)
    assert measure_cpu_peak(torch.float32, threads=1) == first * 2
    assert json.loads((cache / "cpu_peak.json").read_text())[key] == first * 2
    assert not [p for p in cache.iterdir() if p.suffix == ".tmp"]  # atomic write left no temp file


def test_cpu_peak_restores_the_thread_count(cache, monkeypatch):
    monkeypatch.setattr(peak_module, "_time_matmul", lambda dtype, size, seconds: 1e9 * torch.get_num_threads())
    before = torch.get_num_threads()
    assert measure_cpu_peak(torch.float32, threads=2) == 2e9
    assert torch.get_num_threads() == before


def test_cpu_peak_is_measured_for_the_runs_threads_capped_at_the_cores(cache, monkeypatch):
    monkeypatch.setattr(peak_module, "_time_matmul", lambda dtype, size, seconds: 1e9 * torch.get_num_threads())
    cores = os.cpu_count() or 1
    peak = resolve_peak(torch.device("cpu"), "fp32", None, threads_total=1000)
    assert peak == Peak(cores * 1e9, f"measured: {cores} threads fp32 matmul")
    assert resolve_peak(torch.device("cpu"), "bf16", None, threads_total=1).source == "measured: 1 threads bf16 matmul"


def test_user_peak_wins_and_bad_precision_is_refused():
    assert resolve_peak(torch.device("cpu"), "bf16", 2.5, None) == Peak(2.5e12, "hardware.peak_tflops")
    with pytest.raises(ValueError, match="precision='fp16'"):
        resolve_peak(torch.device("cpu"), "fp16", None, None)


@pytest.fixture
def tf32_flags():
    """Restore torch's TF32 flags, legacy first: setting it also sets the new one."""
    matmul = torch.backends.cuda.matmul
    legacy, new = matmul.allow_tf32, getattr(matmul, "fp32_precision", None)
    yield
    matmul.allow_tf32 = legacy
    if new is not None:
        matmul.fp32_precision = new


@pytest.mark.parametrize(("name", "precision", "tf32", "tflops_", "column"), [
    ("NVIDIA H100 80GB HBM3", "bf16", True, 989.4, "bf16"),
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.7, "tf32"),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0, "fp32"),
    ("NVIDIA H100 PCIe", "bf16", False, 756.5, "bf16"),
    ("NVIDIA H200", "bf16", False, 989.4, "bf16"),
    ("NVIDIA A100-SXM4-40GB", "fp32", True, 156.0, "tf32"),
    ("NVIDIA A100-SXM4-40GB", "bf16", True, 312.0, "bf16"),
    ("Tesla V100-SXM2-16GB", "fp32", True, 15.7, "fp32"),  # no tf32 on V100
    ("Tesla V100-SXM2-16GB", "bf16", True, 125.0, "bf16"),
])
def test_gpu_peak_comes_from_the_dense_table(monkeypatch, tf32_flags, name, precision, tf32, tflops_, column):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    peak = resolve_peak(torch.device("cuda", 0), precision, None, None)
    assert peak.flops_per_s == pytest.approx(tflops_ * 1e12)
    assert peak.source == f"table: {name} ({column})"


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9")
def test_tf32_set_through_the_new_api_is_seen_although_the_legacy_flag_then_raises(monkeypatch, tf32_flags):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert resolve_peak(torch.device("cuda", 0), "fp32", None, None).source.endswith("(tf32)")


def test_unknown_gpu_asks_for_peak_tflops(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080")
    with pytest.raises(ValueError, match="set hardware.peak_tflops"):
        resolve_peak(torch.device("cuda", 0), "fp32", None, None)


def test_mfu_is_achieved_model_flops_over_the_peak():
    assert tflops(6e12, 2.0) == pytest.approx(3.0)
    assert mfu(6e12, 2.0, Peak(10e12, "hardware.peak_tflops")) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="step_time_s=0"):
        tflops(1.0, 0)


# -- peak memory -------------------------------------------------------------------------------


def test_cpu_peak_memory_sees_a_freed_allocation_and_resets_per_step():
    meter = PeakMemory("cpu")
    meter.reset()
    base = meter.read()
    big = torch.ones(50_000_000)  # 200 MB, every page touched
    del big
    peak = meter.read()
    assert peak >= 200e6 and peak - base >= 0.95 * 200e6
    meter.reset()
    if meter.kind != "cpu peak RSS (per step)":
        pytest.skip(f"/proc/self/clear_refs refused here: {meter.kind}")
    small = torch.ones(5_000_000)  # 20 MB
    del small
    assert meter.read() < peak - 100e6


@pytest.mark.parametrize(("method", "optimizer"), [("1f1b", "nvlamb"), ("1f1b", "kfac"), ("chimera", "pipefisher")])
def test_predicted_peak_has_every_worker_and_its_max_is_the_planners_estimate(method, optimizer):
    run = RunShape(BertConfig.from_size("mini"), method, 4, 4, 8, seq_len=64, max_predictions=10)
    schedule = run.build_schedule()
    assignment = None if optimizer == "nvlamb" else critical_path_assignment(schedule, run.kfac_layers, 1)
    predicted = predicted_peak_bytes(run, optimizer, schedule, assignment)
    assert sorted(predicted) == sorted(schedule.actions) == list(range(4))
    most = estimate_memory(run, optimizer, schedule, assignment)
    assert max(predicted.values()) == most.total == predicted[most.worker]
    assert estimate_memory_per_worker(run, optimizer, schedule, assignment)[most.worker] == most


def test_cpu_peak_measurement_draws_nothing_from_the_global_rng(cache):
    """Rank 0 measures after a resume restored the RNG streams: the measurement must not move them."""
    before = torch.get_rng_state()
    measure_cpu_peak(torch.float32, threads=1, seconds=0.05, size=128)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_gpu_runs_peak_counts_one_device_per_worker_a_cpus_is_already_the_runs():
    from pipefisher.measure import run_peak

    one = Peak(989.4e12, "table: NVIDIA H100 80GB HBM3 (bf16)")
    assert run_peak(one, "cuda", 4) == Peak(4 * 989.4e12, "table: NVIDIA H100 80GB HBM3 (bf16) x 4 devices")
    assert run_peak(one, "cuda", 1) == one
    cpu = Peak(2e11, "measured: 2 threads fp32 matmul")
    assert run_peak(cpu, "cpu", 2) == cpu


def test_a_run_reports_tflops_mfu_memory_and_a_summary(tmp_path, caplog, cache):
    """Every row carries tflops, mfu and peak memory; the summary names the peak's source, the
    planner's prediction and the last held-out figures."""
    import logging

    from pipefisher.launch import run_training
    from pipefisher.tracking import read_metrics
    from tests.conftest import compose_train

    cfg = compose_train(["steps=2", "model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
                         "model.vocab_size=128", "data.seq_len=16", "data.max_predictions=3", "data.num_samples=64",
                         "eval.every_steps=2", "eval.batches=1", "hardware.peak_tflops=0.001"])
    with caplog.at_level(logging.INFO, logger="pipefisher.runtime.reporting"):
        run_training(cfg, tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    flops = train_step_flops(BertConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=2,
                                        intermediate_size=128), cfg.global_batch_size, 16, 3)
    for r in rows:
        assert r["tflops"] == pytest.approx(flops / r["step_time_s"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / 0.001)
        assert r["peak_memory_bytes"] == r["peak_memory_per_worker_bytes"][0] > 0
    assert "eval_mlm_loss" in rows[1] and "eval_mlm_loss" not in rows[0]
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("summary:")]
    assert "(hardware.peak_tflops)" in line and "predicted" in line and "held-out at step 1" in line
