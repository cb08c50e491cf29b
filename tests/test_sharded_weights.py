"""The weights of a sharded run's checkpoint (``sdp``/``tp`` > 1) leave the run (issue 38, defect 1):
``export.py``, ``train.py init_from=`` and ``finetune.py init.checkpoint=`` read them whole from the
DCP folders beside the worker shards, which hold only placeholders ([Note: sharded checkpoint layout]).

The references: the run's own ``final/`` (gathered in the run by ``full_tensor``, not through DCP)
and single-process training over the same global batch (``test_pipeline_equivalence``). The runs go
through ``train_worker`` in one spawn of 4 processes walking all jobs, as ``test_sharded_checkpoint``.
The fast tests build a sharded checkpoint in this process (DCP written without a process group).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.export import export_weights
from pipefisher.finetune import finetune
from pipefisher.finetune.checkpoint import load_checkpoint
from pipefisher.model import build_full_model, load_hf_state_dict
from pipefisher.model.hf_format import read_model_folder
from pipefisher.run_spec import bert_config
from pipefisher.runtime.build import build_stage_modules, schedule_for
from pipefisher.runtime.checkpoint import CheckpointError, step_dir, write_manifest, write_shard
from pipefisher.runtime.init_weights import load_initial_weights
from pipefisher.runtime.saved_weights import read_saved_weights
from pipefisher.runtime.sharded_checkpoint import IN_DCP, dcp_folder
from pipefisher.runtime.teardown import release_process_group
from pipefisher.runtime.worker import train_worker
from tests import test_pipeline_equivalence as equiv
from tests.conftest import REPO, compose_train
from tests.reference import train_single_process
from tests.test_finetune import compose_finetune
from tests.dist_harness import start_workers

RUN = ["steps=2", "checkpoint.every_steps=2", "lr=1e-2", "cluster.worker_timeout_s=120"]
CASES = {  # bert-tiny, vocab 512, seq 32 (conftest.TINY); the DCP layout each writes
    "sdp2": ["pipeline=gpipe", "stages=1", "num_micro_batches=1", "sdp=2"],  # the run: FSDP2 shards
    "tp2-1f1b-D2": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "tp=2"],  # tp parts, two stages, tied weight
    "sdp2-tp2": ["pipeline=gpipe", "stages=1", "num_micro_batches=1", "sdp=2", "tp=2"],  # a 2-D (sdp, tp) mesh
}
LAST = 1  # the checkpoint after the last of 2 steps: step_1
# A sharded run of another layout that starts from the tp2-1f1b-D2 checkpoint and trains two steps
# (the first at warm-up's learning rate 0).
INIT_FROM = ("tp2-1f1b-D2", ["pipeline=gpipe", "stages=1", "num_micro_batches=1", "sdp=2", *RUN])
WORLD = 4

Job = tuple[TrainConfig, str, str | None]  # config, run folder, init_from set when the job starts


def _cfg(case: str) -> TrainConfig:
    return compose_train(CASES[case] + RUN)


def _worker(rank: int, jobs: list[Job], rendezvous: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[worker {rank}] %(levelname)s %(name)s: %(message)s")
    for i, (cfg, out_dir, init_from) in enumerate(jobs):
        if init_from is not None:  # checked to exist when set: the folder appears when the job before it ran
            cfg = dataclasses.replace(cfg, init_from=init_from)
        world = cfg.num_workers
        if rank >= world:
            continue
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/pg{i}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        try:
            train_worker(cfg, rank, world, torch.device("cpu"), out_dir)
        except Exception as err:  # noqa: BLE001 - an init_from failure fails its own test, not the fixture
            if init_from is None:
                raise
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            (Path(out_dir) / f"error_{rank}.txt").write_text(f"{type(err).__name__}: {err}")
        finally:
            release_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``<case>/``: 2 steps, a checkpoint after the last and ``final/``; ``init_from/``: see INIT_FROM."""
    tmp = tmp_path_factory.mktemp("sharded_weights")
    jobs: list[Job] = [(_cfg(case), str(tmp / case), None) for case in CASES]
    source, overrides = INIT_FROM
    jobs.append((compose_train(overrides), str(tmp / "init_from"), str(step_dir(tmp / source / "checkpoints", LAST))))
    (tmp / "pg").mkdir()
    start_workers(_worker, (jobs, str(tmp / "pg")), WORLD)
    return tmp


def _preempted(runs: Path, case: str, tmp_path: Path) -> Path:
    """A copy of the run folder without ``final/``, as a preempted or killed run leaves it."""
    run = tmp_path / f"{case}-preempted"
    shutil.copytree(runs / case / "checkpoints", run / "checkpoints")
    return run


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, exact: bool = True) -> None:
    assert set(want) <= set(got), f"{what}: missing {sorted(set(want) - set(got))[:5]}"
    for name, tensor in want.items():
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 5e-6}
        torch.testing.assert_close(got[name], tensor, **tol, msg=lambda m, n=name: f"{what}: {n}: {m}")


def _trained_single_process(cfg: TrainConfig, start: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Parameters after ``cfg.steps`` steps of single-process training over the same global batch,
    from ``cfg.seed``'s initialization or from the HF-named weights ``start`` (a new optimizer)."""
    single = equiv.single_process_config(dataclasses.replace(cfg, init_from=None))
    model = build_full_model(bert_config(single), seed=single.seed)
    if start is not None:
        load_hf_state_dict(model, start)
    train_single_process(single, output_dir=None, model=model)
    return {n: p.detach() for n, p in model.named_parameters()}


# -- slow: real sharded runs -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_checkpoint_reads_as_the_runs_final_weights_and_single_process_training(case: str, runs: Path) -> None:
    cfg = _cfg(case)
    folder = step_dir(runs / case / "checkpoints", LAST)
    assert (folder / dcp_folder((0, 0)) / ".metadata").is_file()  # a sharded layout indeed
    saved = read_saved_weights(folder)
    assert saved.trained_steps == 2 and saved.config == bert_config(cfg) and saved.source == folder
    assert all(isinstance(t, torch.Tensor) for t in saved.state_dict.values())
    final = read_model_folder(runs / case / "final").state_dict  # gathered by full_tensor inside the run
    assert set(saved.state_dict) == set(final) | {"cls.predictions.decoder.weight"}
    _assert_same(saved.state_dict, final, f"{case} vs its final/")
    reference = _trained_single_process(cfg)
    init = build_full_model(bert_config(cfg), seed=cfg.seed).state_dict()
    assert max((reference[k] - init[k]).abs().max() for k in reference) > 1e-3  # the steps moved the weights
    _assert_same(saved.state_dict, reference, f"{case} vs single process", exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_export_of_a_preempted_sharded_run_holds_its_weights(case: str, runs: Path, tmp_path: Path) -> None:
    run = _preempted(runs, case, tmp_path)  # no final/: export falls back to the newest checkpoint
    folder = export_weights(run, tmp_path / "hf")
    exported = read_model_folder(folder)
    assert exported.meta["trained_steps"] == 2 and exported.config == bert_config(_cfg(case))
    _assert_same(exported.state_dict, read_model_folder(runs / case / "final").state_dict, case)


@pytest.mark.slow
def test_export_py_from_a_preempted_sdp_run_writes_the_model(runs: Path, tmp_path: Path) -> None:
    run = _preempted(runs, "sdp2", tmp_path)
    out = tmp_path / "hf_sdp"
    done = subprocess.run([sys.executable, str(REPO / "export.py"), f"from={run}", f"out={out}"], cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
    _assert_same(read_model_folder(out).state_dict, read_model_folder(runs / "sdp2" / "final").state_dict, "export.py")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_init_from_a_sharded_run_loads_every_weight_into_each_stage(case: str, runs: Path, tmp_path: Path) -> None:
    run = _preempted(runs, case, tmp_path)
    final = read_model_folder(runs / case / "final").state_dict
    cfg = compose_train([f"init_from={run}", "pipeline=1f1b", "stages=2", "num_micro_batches=2"])
    for rank in range(2):
        modules = build_stage_modules(cfg, schedule_for(cfg), rank)
        load_initial_weights(cfg, modules, log_here=False)
        for stage in modules.values():
            _assert_same(final, stage.state_dict(), f"init_from={case}, stage of worker {rank}")


@pytest.mark.slow
def test_sharded_run_from_another_layouts_checkpoint_trains_as_single_process_from_those_weights(runs: Path) -> None:
    source, overrides = INIT_FROM
    start = read_model_folder(runs / source / "final").state_dict
    errors = [p.read_text() for p in sorted((runs / "init_from").glob("error_*.txt"))]
    assert not errors, errors
    reference = _trained_single_process(compose_train(overrides), start=start)
    final = read_model_folder(runs / "init_from" / "final")
    assert final.meta["trained_steps"] == 2
    assert max((final.state_dict[k] - start[k]).abs().max() for k in reference) > 1e-3  # it trained
    _assert_same(final.state_dict, reference, f"sdp2 run from the {source} checkpoint", exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_finetuning_from_a_sharded_checkpoint_takes_every_encoder_weight(case: str, runs: Path, tmp_path: Path) -> None:
    folder = step_dir(runs / case / "checkpoints", LAST)
    cfg = compose_finetune(["task=toy", "steps=1", "eval_every=1", "task.toy.num_train=8", "task.toy.num_dev=8",
                            f"init.checkpoint=[{folder}]"])
    result = finetune(cfg, tmp_path)
    final = read_model_folder(runs / case / "final").state_dict
    assert result.random_init == []
    assert set(result.init_encoder) == {k for k in final if k.startswith("bert.")}
    _assert_same(final, result.init_encoder, f"fine-tune from {case}")


# -- fast: a sharded checkpoint written in this process -------------------------------------------


def _sharded_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A one-stage checkpoint whose shard holds IN_DCP and whose weights are in ``sharded_0.0/``."""
    cfg = compose_train(["sdp=2", "num_micro_batches=1", "steps=2"])
    state = build_full_model(bert_config(cfg), seed=7).state_dict()
    folder = step_dir(tmp_path / "checkpoints", 1)
    folder.mkdir(parents=True)
    dcp.save({f"model.{n}": t for n, t in state.items()}, storage_writer=dcp.FileSystemWriter(folder / "sharded_0.0"),
             no_dist=True)
    placeholders = {"modules": {"0.0": {n: IN_DCP for n in state}}}
    write_manifest(folder, 1, cfg, 2, [write_shard(folder, r, placeholders) for r in range(2)])
    return folder, state


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save in this process
def test_sharded_checkpoint_weights_are_read_from_its_dcp_folder(tmp_path: Path) -> None:
    folder, state = _sharded_checkpoint(tmp_path)
    saved = read_saved_weights(tmp_path)
    assert saved.source == folder
    _assert_same(saved.state_dict, state, "merged")
    merged = load_checkpoint([folder])  # finetune.py init.checkpoint=[step folder]
    _assert_same(merged, {n: t for n, t in state.items() if n.startswith("bert.")}, "fine-tune")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_sharded_checkpoint_without_its_dcp_folder_or_a_worker_shard_alone_is_refused_in_one_line(
        tmp_path: Path) -> None:
    folder, _ = _sharded_checkpoint(tmp_path)
    with pytest.raises(ConfigError) as err:  # the shard holds no weights: point at the folder
        load_checkpoint([folder / "worker_0.pt"])
    assert str(err.value) == (f"init.checkpoint: {folder / 'worker_0.pt'} is a worker shard of a sharded (sdp/tp) "
                              f"run, whose weights are in the DCP folders beside it; give its folder alone: "
                              f"init.checkpoint=[{folder}]")
    shutil.rmtree(folder / "sharded_0.0")
    with pytest.raises(CheckpointError) as err:
        read_saved_weights(folder)
    assert "\n" not in str(err.value)
    assert str(err.value) == (f"checkpoint {folder}: stage replica 0.0 was sharded (sdp/tp) and its weights are in "
                              "sharded_0.0/, which is missing")
