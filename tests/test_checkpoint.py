"""Checkpoints and exact resume: an interrupted run resumed with ``resume=auto`` logs the losses
and ends with the state (parameters, optimizer, K-FAC, generators) of an uninterrupted run, for
every pipeline method, data parallelism, K-FAC and PipeFisher, with dropout on; corrupt or
partial checkpoints are skipped with a warning; a killed worker leaves the last checkpoint valid.

The runs go through ``train_worker`` (the function each launched worker runs), in one spawn of
two processes that walks all cases (spawning costs seconds on 2 cores). A run is interrupted by
``fault.mode=raise`` at step 3 on *both* workers (each process gets its own config, differing only
in ``fault.rank``), so that neither waits for the other; the real launcher's kill path is tested
separately.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.launch import launch_workers
from pipefisher.runtime.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointPolicy,
    check_compatible,
    find_latest,
    list_checkpoints,
    load_shard,
    prune_checkpoints,
    shard_name,
    step_dir,
    trim_metrics,
    verify_checkpoint,
    write_manifest,
    write_shard,
)
from pipefisher.tracking import read_metrics
from tests.conftest import compose_train
from tests.dist_harness import Job, start_workers, train_jobs

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=6",
         # dropout on (TINY turns it off): resumed runs must draw the same (keyed) masks
         "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "cluster.worker_timeout_s=60"]
# 1f1b without K-FAC saves and restores what gpipe-D2 does (one stage per worker, NVLAMB); 1f1b's own
# resumes are the K-FAC cases below and test_baseline_optimizers' AdamW and Muon runs (bit for bit).
CASES = {
    "gpipe-D2": ["pipeline=gpipe", "stages=2", "num_micro_batches=2"],
    "chimera-D2": ["pipeline=chimera", "stages=2", "num_micro_batches=2"],
    "gpipe-D1-W2": ["pipeline=gpipe", "stages=1", "data_parallel=2", "num_micro_batches=2"],
    "kfac-chimera-D2-k2": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "optimizer=kfac",
                           "optimizer.curvature_interval=2", "optimizer.inverse_interval=2", "optimizer.damping=0.01"],
    # Factors every step, inverses every 4 (issue 28): the checkpoint after step 3 holds factors folded
    # since the last inversion, which the resumed run's inversion at step 4 uses.
    "kfac-1f1b-D2-f1-i4": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "optimizer=kfac",
                           "optimizer.curvature_interval=1", "optimizer.inverse_interval=4", "optimizer.damping=0.01"],
    # Deferred inverses promoted when ready: step 3 inverts (every 3), the checkpoint after it holds them
    # pending, and the resumed run, in the middle of a cycle, uses them from step 4.
    "kfac-1f1b-D2-f1-i3-when-ready": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "optimizer=kfac",
                                      "optimizer.curvature_interval=1", "optimizer.inverse_interval=3",
                                      "optimizer.deferred_inverse=true", "optimizer.promote_inverses=when_ready",
                                      "optimizer.damping=0.01"],
    # With a plan of refresh interval 2 (optimizer.schedule, see _pipefisher_plan): the planner's
    # own choice for this shape is longer than the run.
    "pipefisher-chimera-D2-k2": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "optimizer=pipefisher",
                                 "optimizer.promote_inverses=at_cycle_end", "optimizer.damping=0.01"],
    # Features that hand work between workers (issue 36): each replica inverts and preconditions the layers it
    # owns; a Muon matrix orthogonalized by another worker; each stage stepped apart, clipping off.
    "pipefisher-chimera-D2-k2-owners": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "optimizer=pipefisher",
                                        "optimizer.promote_inverses=at_cycle_end", "optimizer.damping=0.01",
                                        "optimizer.kfac_owners=replicas"],
    "muon-1f1b-D2-ns-pipeline": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "optimizer=muon",
                                 "optimizer.ns_owners=pipeline"],
    "kfac-chimera-D2-per-stage": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "optimizer=kfac",
                                  "optimizer.damping=0.01", "optimizer_placement=per_stage",
                                  "optimizer.max_grad_norm=0"],
}
PIPEFISHER = "pipefisher-chimera-D2-k2"
PLANNED = (PIPEFISHER, "pipefisher-chimera-D2-k2-owners")  # run the k=2 plan of _pipefisher_plan
# The interrupted run saves after steps 1 and 3 (every_steps=2) and fails at the start of step 4;
# with a 2-step refresh cycle the checkpoint after step 3 holds PipeFisher's deferred inverses,
# which the resumed run puts in use at step 4.
INTERRUPT_AT = 4


def _cfg(case: str, *extra: str) -> TrainConfig:
    return compose_train(MODEL + CASES[case] + list(extra))


def _pipefisher_plan(path: Path) -> str:
    """A PipeFisher work assignment with refresh interval 2 for the PipeFisher case, as JSON."""
    from pipefisher.planning.assign import plan_interval
    from pipefisher.planning.costs import estimate_run_costs
    from pipefisher.runtime.worker import CPU_HARDWARE, encoder_layers_per_stage, run_shape, schedule_for
    from pipefisher.schedules.kfac import assignment_to_json, kfac_layer_counts

    cfg = _cfg(PIPEFISHER)
    schedule = schedule_for(cfg)
    layers = kfac_layer_counts(schedule, encoder_layers_per_stage(cfg, schedule.num_stages))
    assignment, _ = plan_interval(schedule, estimate_run_costs(run_shape(cfg), CPU_HARDWARE), layers, 2)
    assignment_to_json(assignment, path)
    return f"optimizer.schedule={path}"


def _corrupt_latest_two(out_dir: str) -> None:
    """Before the resume of the 'corrupt' case: truncate a shard of step_3, delete step_2's manifest."""
    root = Path(out_dir) / "checkpoints"
    shard = step_dir(root, 3) / shard_name(1)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (step_dir(root, 2) / MANIFEST).unlink()


# One job: per-rank configs, the run directory, whether it is expected to stop with the injected
# fault, and an optional function of rank 0 run before it.


def _interrupted(cfg: TrainConfig) -> list[TrainConfig]:
    return [dataclasses.replace(cfg, fault=dataclasses.replace(cfg.fault, mode="raise", rank=r, step=INTERRUPT_AT))
            for r in range(2)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """For each case: ``<case>/straight`` (6 steps, saves only after the last) and ``<case>/resumed``
    (saves every 2 steps, stopped at step 4, resumed with resume=auto); plus ``corrupt``: gpipe
    saving every step, stopped at step 4, its step_3 shard truncated and step_2 manifest deleted."""
    tmp = tmp_path_factory.mktemp("ckpt")
    plan = _pipefisher_plan(tmp / "pipefisher_k2.json")
    jobs: list[Job] = []
    for case in CASES:
        extra = [plan] if case in PLANNED else []
        straight = _cfg(case, "checkpoint.every_steps=6", *extra)
        jobs.append(([straight, straight], str(tmp / case / "straight"), False, None))
        saving = _cfg(case, "checkpoint.every_steps=2", *extra)
        jobs.append((_interrupted(saving), str(tmp / case / "resumed"), True, None))
        resume = _cfg(case, "checkpoint.every_steps=2", "resume=auto", *extra)
        jobs.append(([resume, resume], str(tmp / case / "resumed"), False, None))
    every = _cfg("gpipe-D2", "checkpoint.every_steps=1", "checkpoint.keep_last=3")
    jobs.append((_interrupted(every), str(tmp / "corrupt"), True, None))
    resume = _cfg("gpipe-D2", "checkpoint.every_steps=1", "checkpoint.keep_last=3", "resume=auto")
    jobs.append(([resume, resume], str(tmp / "corrupt"), False, _corrupt_latest_two))
    (tmp / "pg").mkdir()
    start = time.monotonic()
    start_workers(train_jobs, (jobs, str(tmp / "pg")), 2)
    return tmp, {"seconds": time.monotonic() - start}


def _losses(run_dir: Path) -> tuple[list[int], list[float]]:
    rows = read_metrics(run_dir / "metrics.jsonl")
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def _assert_same_state(a: Any, b: Any, where: str, *, exact: bool = False) -> None:
    """Two shards (nests of tensors and primitives) are equal, tensors to rtol 1e-6 or, with ``exact``,
    bit for bit (``torch.equal``); ``where`` names the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        if exact:
            assert torch.equal(a, b), where
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}/{k}", exact=exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_state(x, y, f"{where}[{i}]", exact=exact)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_run_equals_uninterrupted_run(case: str, runs) -> None:
    tmp, _ = runs
    steps, straight = _losses(tmp / case / "straight")
    resumed_steps, resumed = _losses(tmp / case / "resumed")
    assert steps == resumed_steps == list(range(6))
    torch.testing.assert_close(resumed, straight, rtol=1e-6, atol=0.0)
    # Final state: parameters, optimizer moments, scheduler, K-FAC factors/inverses, generators.
    for rank in range(2):
        a = load_shard(step_dir(tmp / case / "straight" / "checkpoints", 5), rank)
        b = load_shard(step_dir(tmp / case / "resumed" / "checkpoints", 5), rank)
        _assert_same_state(a, b, f"{case} worker {rank}")
    # keep_last=2: the resumed run's folder holds the checkpoint it resumed from and the final one.
    assert [s for s, _ in list_checkpoints(tmp / case / "resumed" / "checkpoints")] == [INTERRUPT_AT - 1, 5]


@pytest.mark.slow
def test_resumed_pipefisher_run_used_the_checkpointed_deferred_inverses(runs) -> None:
    # The PipeFisher case tests the refresh cycle's state only if the checkpoint holds deferred
    # inverses that the resumed run then promotes (a cycle starts at the resumed step).
    tmp, _ = runs
    rows = read_metrics(tmp / PIPEFISHER / "straight" / "metrics.jsonl")
    k = rows[0]["refresh_interval"]
    assert INTERRUPT_AT % k == 0 and INTERRUPT_AT // k >= 2, f"interval {k}: pick INTERRUPT_AT at a later cycle start"
    shard = load_shard(step_dir(tmp / PIPEFISHER / "resumed" / "checkpoints", INTERRUPT_AT - 1), 0)
    pending = [layer["has_pending"] for pre in shard["kfac"].values() for layer in pre["extra"].values()]
    assert pending and all(pending)
    kfac = read_metrics(tmp / "kfac-chimera-D2-k2" / "straight" / "metrics.jsonl")
    assert [r["kfac_phase"] for r in kfac] == [0, 1, 0, 1, 0, 1]


@pytest.mark.slow
def test_resumed_when_ready_run_used_the_checkpointed_inverses_mid_cycle(runs) -> None:
    tmp, _ = runs
    case = "kfac-1f1b-D2-f1-i3-when-ready"
    shard = load_shard(step_dir(tmp / case / "resumed" / "checkpoints", INTERRUPT_AT - 1), 0)
    pending = [layer["has_pending"] for pre in shard["kfac"].values() for layer in pre["extra"].values()]
    assert pending and all(pending)
    rows = read_metrics(tmp / case / "resumed" / "metrics.jsonl")
    assert [r["kfac_phase"] for r in rows] == [0, 1, 2, 0, 1, 2]
    # from the step after each INVERT (steps 0, 3): ages 1, 2, 3 after step 0's, then 1 at step 4
    assert [r["curvature_age"] for r in rows] == [None, 1, 2, 3, 1, 2]


@pytest.mark.slow
def test_corrupt_and_partial_checkpoints_are_skipped_for_the_previous_complete_one(runs) -> None:
    tmp, _ = runs
    _, straight = _losses(tmp / "gpipe-D2" / "straight")
    steps, resumed = _losses(tmp / "corrupt")
    assert steps == list(range(6))  # the interrupted run's records of steps 2, 3 were dropped and redone
    torch.testing.assert_close(resumed, straight, rtol=1e-6, atol=0.0)
    for rank in range(2):
        _assert_same_state(load_shard(step_dir(tmp / "gpipe-D2" / "straight" / "checkpoints", 5), rank),
                           load_shard(step_dir(tmp / "corrupt" / "checkpoints", 5), rank), f"worker {rank}")


@pytest.mark.slow
def test_killed_worker_leaves_the_last_checkpoint_valid_and_resume_continues(tmp_path: Path, runs) -> None:
    tmp, _ = runs
    base = MODEL + CASES["gpipe-D2"] + ["checkpoint.every_steps=2"]
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        launch_workers(compose_train(base + ["fault.mode=kill", "fault.rank=1", "fault.step=5"]), tmp_path)
    # Saved after steps 1 and 3; step 4 ran and was logged, but never saved.
    assert find_latest(tmp_path / "checkpoints") == step_dir(tmp_path / "checkpoints", 3)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    launch_workers(compose_train(base + ["resume=auto"]), tmp_path)
    steps, losses = _losses(tmp_path)
    assert steps == list(range(6))
    _, straight = _losses(tmp / "gpipe-D2" / "straight")
    torch.testing.assert_close(losses, straight, rtol=1e-6, atol=0.0)


# -- single-process tests of the checkpoint files --------------------------------------------------


def _fake_checkpoint(root: Path, step: int, cfg: TrainConfig, world: int = 2) -> Path:
    folder = step_dir(root, step)
    folder.mkdir(parents=True)
    shards = [write_shard(folder, r, {"step": step, "w": torch.full((4,), float(step + r))}) for r in range(world)]
    write_manifest(folder, step, cfg, world, shards, kfac_interval=None)
    return folder


def test_find_latest_skips_truncated_and_unfinished_checkpoints_with_a_warning(tmp_path: Path, caplog) -> None:
    cfg = compose_train(["stages=2", "num_micro_batches=2"])
    for step in (1, 3, 5, 7):
        _fake_checkpoint(tmp_path, step, cfg)
    shard = step_dir(tmp_path, 7) / shard_name(0)
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    (step_dir(tmp_path, 5) / MANIFEST).unlink()  # partial: killed before the manifest
    bad = step_dir(tmp_path, 3) / shard_name(1)  # same size, other bytes
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    step_dir(tmp_path, 9).mkdir()  # an empty folder of a run that died at once
    with caplog.at_level(logging.WARNING, logger="pipefisher.runtime.checkpoint"):
        assert find_latest(tmp_path) == step_dir(tmp_path, 1)
    text = caplog.text
    assert "step_9: no manifest.json" in text and "step_5: no manifest.json" in text
    assert f"step_7: shard {shard_name(0)} has" in text and "truncated" in text
    assert f"step_3: shard {shard_name(1)} does not match its sha256" in text
    assert load_shard(step_dir(tmp_path, 1), 1)["w"].tolist() == [2.0] * 4
    with pytest.raises(CheckpointError, match="sha256"):
        load_shard(step_dir(tmp_path, 3), 1)  # never loaded, not even half
    assert find_latest(tmp_path / "nothing-here") is None


def test_shards_load_with_weights_only_and_hold_no_temporary_files(tmp_path: Path) -> None:
    cfg = compose_train([])
    folder = _fake_checkpoint(tmp_path, 0, cfg, world=1)
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, shard_name(0)]
    manifest = verify_checkpoint(folder)
    assert manifest["step"] == 0 and manifest["world_size"] == 1 and len(manifest["shards"][0]["sha256"]) == 64
    assert "model.hidden_size" in manifest["config_fields"] and "optimizer.name" in manifest["config_fields"]
    assert "lr" not in manifest["config_fields"]
    torch.load(folder / shard_name(0), weights_only=True)


def test_config_mismatch_names_the_fields_and_the_fix(tmp_path: Path, caplog) -> None:
    saved = compose_train(["stages=2", "num_micro_batches=2", "seed=1", "lr=0.001"])
    folder = _fake_checkpoint(tmp_path, 4, saved)
    manifest = json.loads((folder / MANIFEST).read_text())
    other = compose_train(["stages=2", "num_micro_batches=4", "seed=1", "model.hidden_size=64"])
    with pytest.raises(ConfigError) as err:
        check_compatible(manifest, other, 2, None, folder)
    message = str(err.value)
    assert "num_micro_batches: checkpoint 2, this run 4" in message
    assert "model.hidden_size: checkpoint 128, this run 64" in message
    assert "num_micro_batches=2" in message and "resume=none" in message
    with pytest.raises(ConfigError, match="K-FAC refresh interval: checkpoint None, this run 2"):
        check_compatible(manifest, saved, 2, 2, folder)
    # Other fields may change (with a warning): here the learning rate.
    with caplog.at_level(logging.WARNING, logger="pipefisher.runtime.checkpoint"):
        check_compatible(manifest, dataclasses.replace(saved, lr=0.5), 2, None, folder)
    assert "lr: 0.001 -> 0.5" in caplog.text


def test_keep_last_prunes_older_complete_checkpoints_only(tmp_path: Path) -> None:
    cfg = compose_train([])
    for step in (0, 2, 4, 6):
        _fake_checkpoint(tmp_path, step, cfg, world=1)
    step_dir(tmp_path, 5).mkdir()  # incomplete, older than the current one
    step_dir(tmp_path, 9).mkdir()  # later step (another timeline): kept
    removed = prune_checkpoints(tmp_path, keep_last=2, current=6)
    assert sorted(p.name for p in removed) == ["step_0", "step_2", "step_5"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 6, 9]
    assert prune_checkpoints(tmp_path, keep_last=0, current=6) == []


def test_checkpoint_policy_steps_last_step_and_minutes() -> None:
    p = CheckpointPolicy(every_steps=2, every_minutes=0, last_step=6)
    assert [s for s in range(7) if p.due_by_steps(s)] == [1, 3, 5, 6]
    off = CheckpointPolicy(every_steps=0, every_minutes=0, last_step=6)
    assert not any(off.due_by_steps(s) for s in range(7))
    timed = CheckpointPolicy(every_steps=0, every_minutes=1.0, last_step=6, _since=100.0)
    assert not timed.due_by_time(159.0) and timed.due_by_time(160.0)
    timed.saved(160.0)
    assert not timed.due_by_time(200.0) and timed.due_by_steps(6)


def test_trim_metrics_drops_steps_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(5)) + '{"step": 5, "lo')
    assert trim_metrics(path, 2) == 3
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    assert trim_metrics(tmp_path / "absent.jsonl", 2) == 0
    assert trim_metrics(path, -1) == 3 and read_metrics(path) == []  # resume=auto starting over


@pytest.mark.parametrize("overrides,field,fix", [
    (["checkpoint.every_steps=-1"], "checkpoint.every_steps", ">= 0"),
    (["checkpoint.every_minutes=-0.5"], "checkpoint.every_minutes", ">= 0"),
    (["checkpoint.keep_last=-2"], "checkpoint.keep_last", "keeps every checkpoint"),
    (["resume=/nonexistent/run/checkpoints/step_3"], "resume", "resume=auto"),
])
def test_checkpoint_config_errors_name_the_field_and_the_fix(overrides: list[str], field: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_train(overrides)
    assert field in str(err.value) and fix in str(err.value)


def test_checkpoint_that_does_not_fit_is_refused_before_any_worker_starts(tmp_path: Path, monkeypatch) -> None:
    from pipefisher.launch import local

    saved = compose_train(["stages=2", "num_micro_batches=2"])
    _fake_checkpoint(tmp_path / "checkpoints", 3, saved)
    started = []
    monkeypatch.setattr(local.mp, "start_processes", lambda *a, **k: started.append(a))
    other = compose_train(["stages=2", "num_micro_batches=2", "model.num_layers=4", "resume=auto"])
    with pytest.raises(ConfigError, match="model.num_layers: checkpoint 2, this run 4"):
        local.launch_workers(other, tmp_path)
    wrong_width = compose_train(["stages=2", "num_micro_batches=2", "data_parallel=2", "resume=auto"])
    with pytest.raises(ConfigError, match="data_parallel: checkpoint 1, this run 2"):
        local.launch_workers(wrong_width, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        local.launch_workers(dataclasses.replace(saved, resume=str(tmp_path / "empty")), tmp_path)
    assert not started


def test_resume_of_an_explicit_path_without_a_checkpoint_fails(tmp_path: Path) -> None:
    from pipefisher.runtime.checkpoint import resolve_resume

    cfg = compose_train([f"resume={tmp_path}"])
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        resolve_resume(cfg, tmp_path / "unused")
    os.makedirs(step_dir(tmp_path, 2))
    with pytest.raises(CheckpointError, match="no manifest.json"):
        resolve_resume(dataclasses.replace(cfg, resume=str(step_dir(tmp_path, 2))), tmp_path)


def test_kfac_state_round_trips_deferred_inverses_and_a_refresh_in_flight() -> None:
    from pipefisher.optim import KFACPreconditioner
    from pipefisher.runtime.state import kfac_state, load_kfac_state

    def model_and_pre() -> tuple[torch.nn.Module, KFACPreconditioner]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        return model, KFACPreconditioner(model, include=None, damping=0.1, factor_decay=0.5)

    def refresh(model: torch.nn.Module, pre: KFACPreconditioner, seed: int) -> None:
        pre.set_capture(True)
        with pre.micro_batch(0):
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))).pow(2).sum().backward()
        for name in pre.layer_names:
            pre.curvature_a(name, 0)
            pre.curvature_b(name, 0)
        pre.step_curvature_done()

    model, pre = model_and_pre()
    refresh(model, pre, 1)
    for name in pre.layer_names:
        pre.update_factors(name)
        pre.invert(name, deferred=True)  # waiting for the next cycle
    refresh(model, pre, 2)  # the next refresh's sums, handed out for the factor all-reduce
    for name in pre.layer_names:
        pre.factor_tensors(name)
    saved = kfac_state(pre)
    buffer = __import__("io").BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    model2, pre2 = model_and_pre()
    load_kfac_state(pre2, torch.load(buffer, weights_only=True))
    for p in (pre, pre2):  # finish the refresh and the cycle the same way on both
        for name in p.layer_names:
            p.update_factors(name)
        assert p.promote_inverses() == 2
        for name in p.layer_names:
            p.invert(name)
    for name in pre.layer_names:
        a, b = pre.layer(name), pre2.layer(name)
        for attr in ("a", "b", "a_inv", "b_inv"):
            torch.testing.assert_close(getattr(a, attr), getattr(b, attr), rtol=0, atol=0)
        assert a.damping == b.damping and a.num_updates == b.num_updates == 2


@pytest.mark.slow
def test_single_process_runs_with_checkpoints_go_through_the_worker(tmp_path: Path) -> None:
    from pipefisher.launch import run_training

    base = ["steps=3", "data.seq_len=16", "checkpoint.every_steps=1"]
    run_training(compose_train(base), tmp_path)
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [1, 2]  # keep_last=2
    assert verify_checkpoint(step_dir(tmp_path / "checkpoints", 2))["world_size"] == 1
    # Resuming a finished run trains nothing and keeps its metrics.
    run_training(compose_train(base + ["resume=auto"]), tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
