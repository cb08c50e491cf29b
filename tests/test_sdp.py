"""Sharded data parallel inside the pipeline (``sdp``, FSDP2; issue 27) gives single-process training.

Like ``test_pipeline_equivalence``: the reference is an independent plain loop over the same
micro-batches with the loss scaled by 1/(N·data_parallel·sdp) (first-step loss and every gradient),
and ``train_single_process`` with N·data_parallel·sdp micro-batches for the parameters after 5 NVLAMB
steps. The clip threshold is set below the first gradient norm so that the global norm over sharded
gradients decides the update. Each case also covers one of issue 27's traps: split backward (zb-h1:
the reduce after the last W), Chimera's two replicas per worker, data_parallel beside sdp (the
all-reduce of local shards), the tied weight across stages, reshard_after_forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.run_spec import bert_config
from pipefisher.runtime.teardown import release_process_group
from tests import test_pipeline_equivalence as equiv
from tests.conftest import compose_train
from tests.dist_harness import run_cases

MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=5",
         "optimizer.max_grad_norm=0.05"]
STEPS = 5

# (method, stages, micro-batches, data_parallel, sdp, reshard_after_forward, recompute): <= 4 processes.
CASES = [
    ("gpipe", 1, 2, 1, 2, False, False),  # python train.py stages=1 sdp=2
    ("1f1b", 2, 4, 1, 2, False, False),  # tied weight across stages, sharded alike
    ("zb-h1", 2, 4, 1, 2, False, False),  # split backward: reduce after the last W, not the last I
    ("chimera", 2, 4, 1, 2, False, False),  # two stage replicas per worker, each with its own sdp group
    ("gpipe", 1, 2, 2, 2, False, True),  # data_parallel beside sdp: local shards all-reduced; recompute
    ("1f1b", 2, 4, 1, 2, True, False),  # reshard after every forward, gathered again for its backward
]
IDS = [f"{m}-D{d}-N{n}-W{w}-sdp{k}" + ("-reshard" if r else "") + ("-recompute" if c else "")
       for m, d, n, w, k, r, c in CASES]


def _cfg(method: str, d: int, n: int, w: int, k: int, reshard: bool, recompute: bool) -> TrainConfig:
    return compose_train(MODEL + [f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}",
                                  f"data_parallel={w}", f"sdp={k}", f"sdp_reshard_after_forward={str(reshard).lower()}",
                                  f"recompute={str(recompute).lower()}"])


@pytest.fixture(scope="module")
def sdp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict[int, dict]]:
    results = run_cases([(_cfg(*c), STEPS) for c in CASES], tmp_path_factory.mktemp("sdp"))
    return dict(zip(CASES, results))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sdp_first_step_loss_and_every_gradient_equal_single_process(case, sdp_results) -> None:
    cfg = _cfg(*case)
    results = sdp_results[case]
    assert len(results) == cfg.stages * cfg.data_parallel * cfg.sdp
    ref_grads = equiv.assert_first_step_equals_single_process(cfg, results)  # gradients gathered whole from the shards
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    assert norm > cfg.optimizer.max_grad_norm, "the clip must be active for the global norm to matter"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sdp_parameters_after_five_nvlamb_steps_equal_single_process(case, sdp_results) -> None:
    equiv.assert_params_equal_single_process(_cfg(*case), sdp_results[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_sdp_all_gathers_are_recorded_as_waits_not_compute(case, sdp_results) -> None:
    events = sdp_results[case][0]["events"]
    name, kind, wait = events[0]  # the step's gather of every stage replica comes first
    assert kind == "SYNC_GRAD" and wait, events[:3]
    if case[5]:  # reshard after forward: every F and B is preceded by its own gather
        computes = [e for e in events if e[1] in ("F", "B")]
        gathers = [e for e in events if e[2] and e[0] in {c[0] for c in computes}]
        assert len(gathers) == len(computes), events


def test_sdp_counts_in_the_batch_and_the_world() -> None:
    cfg = compose_train(MODEL[:-3] + ["pipeline=1f1b", "stages=2", "sdp=2", "global_batch_size=16", "num_micro_batches=2",
                                         "micro_batch_size=auto"])
    assert (cfg.num_workers, cfg.data_replicas, cfg.micro_batch_size) == (4, 2, 4)  # 16 = 4 x 2 x (1 x 2)
    cfg = compose_train(MODEL[:-3] + ["stages=1", "data_parallel=2", "sdp=2", "micro_batch_size=2", "num_micro_batches=1"])
    assert (cfg.num_workers, cfg.global_batch_size) == (4, 8)
    with pytest.raises(ConfigError, match=r"^global_batch_size=10: .*data_parallel x sdp = 2 x \(1 x 2\) = 4"):
        compose_train(MODEL[:-3] + ["sdp=2", "global_batch_size=10", "num_micro_batches=2", "micro_batch_size=auto"])


@pytest.mark.parametrize("overrides, message", [
    (["sdp=0"], r"^sdp=0: must be at least 1"),
    (["sdp=2", "optimizer=kfac"], r"^sdp=2: optimizer=kfac needs whole weights: .*factors and preconditioning sharded"),
    (["sdp=2", "optimizer=pipefisher"], r"^sdp=2: optimizer=pipefisher needs whole weights"),
    (["sdp=2", "stages=2", "pipeline=zb-h1", "sdp_reshard_after_forward=true"],
     r"^sdp_reshard_after_forward=True: pipeline=zb-h1's deferred weight gradients"),
    (["sdp=2", "comm_ablation=true"], r"^comm_ablation=True: FSDP's all-gathers"),
    (["sdp=2", "eval.every_steps=5"], r"^eval.every_steps=5: held-out evaluation .*not built for sdp=2"),
])
def test_sdp_refusals_name_the_field_and_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        compose_train(MODEL[:-3] + overrides)
    assert "\n" not in str(err.value)


def test_every_fsdp_module_sums_without_premul_and_divides_by_one() -> None:
    """gloo has no PREMUL_SUM, and neither setting recurses: set on the root only, the gradients are
    silently wrong (issue 27); every FSDP module of a stage carries both."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from pipefisher.model import BertStage
    from pipefisher.runtime.sharding import shard_stages

    cfg = compose_train(MODEL[:-3])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stage = BertStage(bert_config(cfg), 0, cfg.model.num_layers + 1, seed=0)
        fully_shard(stage.bert.encoder.layer["0"])  # a nested unit, as per-layer sharding would make
        shard_stages({(0, 0): stage}, {(0, 0): dist.group.WORLD}, reshard_after_forward=False, device_type="cpu")
        units = [m for m in stage.modules() if isinstance(m, FSDPModule)]
        assert len(units) == 2
        for unit in units:
            for group in fully_shard.state(unit)._fsdp_param_groups:
                assert group.gradient_divide_factor == 1.0 and group.force_sum_reduction_for_comms
    finally:
        release_process_group()


@pytest.mark.slow
def test_sdp_run_checkpoints_on_a_signal_as_unsharded_runs_do(tmp_path: Path) -> None:
    # SIGTERM to `train.py stages=1 sdp=2` with no periodic checkpoints (checkpoint.on_stop_after_s=0: the
    # save on the way out, as tests/test_signals.py's unsharded run does): exit 143 naming the step and
    # its checkpoint, each shard in torch.distributed.checkpoint's folder. The stop saves through the
    # same save_checkpoint as a periodic checkpoint: resume=auto from sharded checkpoints is held
    # bit for bit in tests/test_sharded_checkpoint.py and test_hybrid_optimizers.py (stages=1 sdp=2),
    # and after a signal's save, end to end, in tests/test_signals.py.
    # (Ctrl-C of the same run: tests/test_sharded_checkpoint.py.)
    import os
    import signal

    from pipefisher.runtime.checkpoint import MANIFEST, find_latest, step_dir
    from pipefisher.runtime.sharded_checkpoint import dcp_folder
    from tests.conftest import TINY
    from tests.test_signals import _interrupt_checkpoint, _start, _stop, _wait_for_step

    run = ["pipeline=gpipe", "stages=1", "sdp=2", "num_micro_batches=1", "cluster.worker_timeout_s=120", *TINY]
    cfg = compose_train(run + ["checkpoint.on_stop_after_s=0"])
    assert not cfg.checkpoint.enabled and cfg.sdp == 2  # only the signal makes it save
    run_dir = tmp_path / "run"
    proc, log = _start(run_dir, "checkpoint.on_stop_after_s=0", run=run)
    _wait_for_step(proc, run_dir, log, step=1)
    code, out, _ = _stop(proc, log, lambda: os.kill(proc.pid, signal.SIGTERM))
    assert code == 143, out[-3000:]
    step, folder = _interrupt_checkpoint(out)
    assert step >= 1 and find_latest(run_dir / "checkpoints") == folder == step_dir(run_dir / "checkpoints", step)
    assert (folder / MANIFEST).is_file() and (folder / dcp_folder((0, 0)) / ".metadata").is_file()
    assert len(list((folder / dcp_folder((0, 0))).glob("*.distcp"))) == 2  # one shard file per sdp rank


@pytest.mark.slow
def test_train_py_stages1_sdp2_gives_the_single_process_losses(tmp_path: Path) -> None:
    from pipefisher.launch.local import run_training  # what train.py calls

    common = MODEL[:-3] + ["steps=3", "save_final=true", "wandb.mode=disabled", "progress=false"]
    sharded = run_training(compose_train(common + ["sdp=2", "num_micro_batches=1"]), tmp_path / "sdp")
    single = run_training(compose_train(common + ["num_micro_batches=2"]), tmp_path / "single")
    assert sharded["loss"] == pytest.approx(single["loss"], rel=1e-5)
    from safetensors.torch import load_file

    got, want = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("sdp", "single"))
    assert set(got) == set(want)  # final/ holds whole tensors, gathered from the shards
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
