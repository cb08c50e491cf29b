"""Checkpoints of sharded runs (``sdp`` > 1, ``tp`` > 1; issue 27) through torch.distributed.checkpoint:
a run stopped after step 2 and resumed with ``resume=auto`` logs bit-identical losses and ends with
bit-identical parameters, optimizer moments and shards to an uninterrupted run; a checkpoint of
another sdp/tp is refused naming the field; DCP's metadata is read without unsafe unpickling.

As ``test_checkpoint``: the runs go through ``train_worker`` in one spawn of 4 processes walking
all jobs; a run is interrupted by ``fault.mode=raise`` at step 2 on every worker. Four steps: the checkpoint
after step 1 holds every state a later one does (moments and step counts after two updates, the
scheduler, the generators), and the resumed run updates from it twice.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.runtime.checkpoint import (MANIFEST, check_compatible, find_latest, list_checkpoints, load_shard,
                                           step_dir, write_manifest, write_shard)
from pipefisher.runtime.sharded_checkpoint import IN_DCP, _SafeUnpickler, dcp_folder
from tests.conftest import compose_train
from tests.test_checkpoint import _assert_same_state, _losses
from tests.dist_harness import Job, start_workers, train_jobs

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64",
         "model.vocab_size=128", "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01",
         "steps=4", "optimizer.max_grad_norm=0.05", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
         "cluster.worker_timeout_s=120", "wandb.mode=disabled", "progress=false"]
# Each case: 4 processes.
CASES = {
    "sdp2-1f1b-D2": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "sdp=2"],
    "tp2-1f1b-D2": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "tp=2"],
    # FSDP2 over tensor-parallel layers: a 2-D (sdp, tp) mesh, DCP over all 4 processes
    "sdp2-tp2-D1": ["pipeline=gpipe", "stages=1", "num_micro_batches=2", "sdp=2", "tp=2"],
    # data_parallel beside sdp: block 0 writes, block 1 reads block 0's folder over its own group
    "sdp2-W2-D1": ["pipeline=gpipe", "stages=1", "num_micro_batches=2", "sdp=2", "data_parallel=2"],
    # two stage replicas per worker, each written over its own sdp group (in one sorted order)
    "sdp2-chimera-D2": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "sdp=2"],
}
INTERRUPT_AT = 2  # saves after step 1 (every_steps=2), fails at the start of step 2
LAST = 3  # the last step (steps=4)
WORLD = 4


def _cfg(case: str, *extra: str) -> TrainConfig:
    return compose_train(MODEL + CASES[case] + list(extra))


def _interrupted(cfg: TrainConfig, step: int = INTERRUPT_AT) -> list[TrainConfig]:
    """One config per rank, each failing at the start of ``step`` on its own rank."""
    return [dataclasses.replace(cfg, fault=dataclasses.replace(cfg.fault, mode="raise", rank=r, step=step))
            for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Per case ``<case>/straight`` (4 steps, one checkpoint after the last) and ``<case>/resumed``
    (checkpoints every 2 steps, stopped at step 2, resumed with resume=auto)."""
    tmp = tmp_path_factory.mktemp("sharded_ckpt")
    jobs: list[Job] = []
    for case in CASES:
        straight = _cfg(case, "checkpoint.every_steps=4")
        jobs.append(([straight] * WORLD, str(tmp / case / "straight"), False, None))
        jobs.append((_interrupted(_cfg(case, "checkpoint.every_steps=2")), str(tmp / case / "resumed"), True, None))
        # A fault at step 1 that only a run starting over would reach: the resume must continue at step 2.
        resume = _cfg(case, "checkpoint.every_steps=2", "resume=auto")
        jobs.append((_interrupted(resume, step=1), str(tmp / case / "resumed"), False, None))
    (tmp / "pg").mkdir()
    start_workers(train_jobs, (jobs, str(tmp / "pg")), WORLD)
    return tmp


def _dcp_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every DCP folder of a checkpoint, read whole in this process: ``<folder>/<key>`` -> tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = {}
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        dcp_to_torch_save(sub, folder.parent / f"{sub.name}.whole.pt")
        whole = torch.load(folder.parent / f"{sub.name}.whole.pt", weights_only=True)
        out.update({f"{sub.name}/{k}": v for k, v in whole.items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_resumed_sharded_run_equals_uninterrupted_run_bit_for_bit(case: str, runs: Path) -> None:
    steps, straight = _losses(runs / case / "straight")
    resumed_steps, resumed = _losses(runs / case / "resumed")
    assert steps == resumed_steps == list(range(LAST + 1))
    assert resumed == straight  # exact: the same reductions in the same order (fixed groups and sizes)
    a_dir, b_dir = (step_dir(runs / case / run / "checkpoints", LAST) for run in ("straight", "resumed"))
    for rank in range(WORLD):  # step, scheduler, generators, NVLAMB's step counts
        _assert_same_state(load_shard(a_dir, rank), load_shard(b_dir, rank), f"{case} worker {rank}", exact=True)
    a, b = _dcp_tensors(a_dir), _dcp_tensors(b_dir)
    pipes = 2 if "chimera" in case else 1
    assert {k.split("/")[0] for k in a} == {dcp_folder((p, s)) for p in range(pipes) for s in range(_cfg(case).stages)}
    assert any(".exp_avg_sq" in k for k in a) and any("/model." in k for k in a)
    _assert_same_state(a, b, case, exact=True)  # parameters and moments, gathered whole
    assert [s for s, _ in list_checkpoints(runs / case / "resumed" / "checkpoints")] == [INTERRUPT_AT - 1, LAST]


@pytest.mark.slow
def test_sharded_checkpoint_holds_no_tensor_twice_and_lists_its_dcp_files(runs: Path) -> None:
    folder = step_dir(runs / "sdp2-1f1b-D2" / "resumed" / "checkpoints", INTERRUPT_AT - 1)
    manifest = json.loads((folder / MANIFEST).read_text())
    files = {f["file"] for f in manifest["files"]}
    assert {f.split("/")[0] for f in files} == {dcp_folder((0, 0)), dcp_folder((0, 1))}
    assert all(f.split("/")[1] == ".metadata" or f.endswith(".distcp") for f in files)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    shard = load_shard(folder, 0)
    assert set(shard["modules"]["0.0"].values()) == {IN_DCP}
    assert {v for s in shard["optimizer"]["state"].values() for k, v in s.items() if k != "step"} == {IN_DCP}
    # A damaged DCP file fails the manifest's hash: resume=auto takes the previous checkpoint.
    distcp = folder / sorted(f for f in files if f.endswith(".distcp"))[0]
    data = bytearray(distcp.read_bytes())
    data[-1] ^= 0xFF
    distcp.write_bytes(bytes(data))
    assert find_latest(folder.parent) == step_dir(folder.parent, LAST)
    (step_dir(folder.parent, LAST) / MANIFEST).unlink()  # and a checkpoint whose manifest was never written
    assert find_latest(folder.parent) is None


@pytest.mark.slow
def test_checkpoint_of_sdp2_refuses_a_tp2_resume_naming_both_fields(runs: Path) -> None:
    folder = step_dir(runs / "sdp2-1f1b-D2" / "straight" / "checkpoints", LAST)
    manifest = json.loads((folder / MANIFEST).read_text())
    with pytest.raises(ConfigError) as err:
        check_compatible(manifest, _cfg("tp2-1f1b-D2"), WORLD, None, folder)
    assert "sdp: checkpoint 2, this run 1" in str(err.value) and "tp: checkpoint 1, this run 2" in str(err.value)
    assert "(sdp=2 tp=1)" in str(err.value)


# -- fast: no processes --------------------------------------------------------------------------


def test_config_accepts_checkpoints_resume_and_ctrl_c_saves_for_sdp_and_tp() -> None:
    for case in CASES:
        cfg = _cfg(case, "checkpoint.every_steps=2", "resume=auto")
        assert cfg.checkpoint.enabled and cfg.resume == "auto"
        assert _cfg(case).checkpoint.on_stop_after_s >= 0  # Ctrl-C/SIGTERM save as for unsharded runs


def test_checkpoint_of_another_sdp_or_tp_is_refused_naming_the_field(tmp_path: Path) -> None:
    saved = _cfg("sdp2-1f1b-D2")
    folder = step_dir(tmp_path, 3)
    folder.mkdir(parents=True)
    write_manifest(folder, 3, saved, WORLD, [write_shard(folder, r, {"step": 3}) for r in range(WORLD)])
    manifest = json.loads((folder / MANIFEST).read_text())
    check_compatible(manifest, saved, WORLD, None, folder)
    with pytest.raises(ConfigError, match=r"sdp: checkpoint 2, this run 1(.|\n)*tp: checkpoint 1, this run 2"):
        check_compatible(manifest, _cfg("tp2-1f1b-D2"), WORLD, None, folder)
    fewer = compose_train(MODEL + ["pipeline=1f1b", "stages=2", "num_micro_batches=2"])
    with pytest.raises(ConfigError, match=r"sdp: checkpoint 2, this run 1(.|\n)*Fix: .*\(sdp=2\)"):
        check_compatible(manifest, fewer, 2, None, folder)


def test_unsharded_checkpoints_keep_their_hash_without_sdp_and_tp_fields() -> None:
    from pipefisher.runtime.checkpoint import config_fields

    fields = config_fields(compose_train(MODEL + ["stages=2", "num_micro_batches=2"]))
    assert "sdp" not in fields and "tp" not in fields  # as before issue 27: old checkpoints still fit
    assert config_fields(_cfg("sdp2-1f1b-D2"))["sdp"] == 2


def test_dcp_metadata_is_read_without_unsafe_unpickling() -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(pickle.UnpicklingError, match="builtins.print is not part of DCP's metadata"):
        import io
        _SafeUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


# -- Ctrl-C: the same save, through train.py ----------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_of_an_sdp_run_checkpoints_and_resume_auto_continues(tmp_path: Path) -> None:
    import os
    import signal

    from tests.conftest import TINY
    from tests.test_signals import _assert_resume_continues, _interrupt_checkpoint, _start, _stop, _wait_for_step

    run = ["pipeline=gpipe", "stages=1", "sdp=2", "num_micro_batches=1", "cluster.worker_timeout_s=120", *TINY]
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "checkpoint.every_steps=100000", run=run)
    _wait_for_step(proc, run_dir, log)
    code, out, _ = _stop(proc, log, lambda: os.kill(proc.pid, signal.SIGINT))
    assert code == 130, out[-3000:]
    step, folder = _interrupt_checkpoint(out)
    assert find_latest(run_dir / "checkpoints") == folder == step_dir(run_dir / "checkpoints", step)
    assert (folder / dcp_folder((0, 0)) / ".metadata").is_file()
    _assert_resume_continues(run_dir, run, step)
