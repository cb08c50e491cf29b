"""Tensor parallel inside the pipeline (``tp``, DTensor; issue 27) gives single-process training.

Like ``test_sdp``: the reference is an independent plain loop over the same micro-batches with the
loss scaled by 1/(N·data_parallel) (first-step loss and every gradient), and
``train_single_process`` with N·data_parallel micro-batches for the parameters after 5 NVLAMB steps;
dropout is on (p=0.1 everywhere) and the clip threshold lies below the first gradient norm, so the
global norm over split gradients decides every update. Each trap of issue 27 has its own test below:
the global norm (split gradients counted once per part, whole ones once), NVLAMB on mixed
Tensor/DTensor parameters, the attention dropout's slice of the full mask, the loss counted once
over tp ranks, the tied embedding/decoder weight across stages.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.model.rng import KeyedDropout, dropout_key
from pipefisher.run_spec import bert_config, data_plan, data_source
from pipefisher.runtime.teardown import release_process_group
from pipefisher.runtime.tensor_parallel import process_rank, schedule_worker, tp_index
from tests import test_pipeline_equivalence as equiv
from tests.conftest import compose_train
from tests.dist_harness import run_cases, start_workers

DROPOUT_ON = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=5",
         "optimizer.max_grad_norm=0.05"] + DROPOUT_ON
STEPS = 5

# (method, stages, micro-batches, data_parallel, sdp, tp, recompute): <= 4 processes.
CASES = [
    ("1f1b", 2, 4, 1, 1, 2, False),  # python train.py stages=2 tp=2: activations tp index to tp index, tied weight
    ("gpipe", 1, 2, 1, 1, 2, False),  # python train.py tp=2
    ("gpipe", 1, 2, 2, 1, 2, True),  # data_parallel beside tp: gradient groups per tp index; recompute
    ("chimera", 2, 4, 1, 1, 2, False),  # two stage replicas per worker, each split over the same tp group
    ("gpipe", 1, 2, 1, 2, 2, False),  # sdp beside tp: FSDP2 over a 2-D (sdp, tp) mesh
    ("zb-h1", 2, 4, 1, 1, 2, False),  # split backward: deferred weight gradients of DTensor weights
    ("zb-v", 2, 4, 1, 1, 2, False),  # two chunks per worker in a V, each split over the same tp group
]
IDS = [f"{m}-D{d}-N{n}-W{w}" + (f"-sdp{k}" if k > 1 else "") + f"-tp{t}" + ("-recompute" if c else "")
       for m, d, n, w, k, t, c in CASES]


def _cfg(method: str, d: int, n: int, w: int, k: int, t: int, recompute: bool) -> TrainConfig:
    return compose_train(MODEL + [f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}", f"data_parallel={w}",
                                  f"sdp={k}", f"tp={t}", f"recompute={str(recompute).lower()}"])


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict[int, dict]]:
    results = run_cases([(_cfg(*c), STEPS) for c in CASES], tmp_path_factory.mktemp("tp"))
    return dict(zip(CASES, results))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tp_first_step_loss_and_every_gradient_equal_single_process(case, tp_results) -> None:
    cfg = _cfg(*case)
    results = tp_results[case]
    assert len(results) == cfg.stages * cfg.data_parallel * cfg.sdp * cfg.tp
    # Every process's loss (the loss counted once over tp ranks), every gradient gathered whole from
    # its parts on every tp rank, the decoder's gradient equal to the tied sum.
    ref_grads = equiv.assert_first_step_equals_single_process(cfg, results)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    assert norm > cfg.optimizer.max_grad_norm, "the clip must be active for the global norm to matter"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_tp_parameters_after_five_nvlamb_steps_equal_single_process(case, tp_results) -> None:
    equiv.assert_params_equal_single_process(_cfg(*case), tp_results[case])


# -- the traps, each on its own --------------------------------------------------------------


def test_attention_dropout_under_tp_draws_its_slice_of_the_full_mask() -> None:
    """A rank holding heads [i·A/tp, (i+1)·A/tp) drops exactly what the whole tensor's dropout drops there."""
    full = KeyedDropout(0.5)
    full.site = 1234
    x = torch.randn(2, 4, 5, 5)  # [B, A, S, S]
    with dropout_key(3, 7):
        want = full(x)
    parts = []
    for i in range(2):
        part = KeyedDropout(0.5)
        part.site, part.shard = 1234, (1, i, 2)
        with dropout_key(3, 7):
            parts.append(part(x[:, 2 * i:2 * i + 2]))
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=0, atol=0)
    plain = KeyedDropout(0.5)
    plain.site = 1234
    with dropout_key(3, 7):  # without the shard the slice draws a mask of its own shape: other masks
        assert not torch.equal(plain(x[:, 2:]), want[:, 2:])


def _trap_worker(rank: int, cfg: TrainConfig, out: str) -> None:
    """One tp=2 stage of the whole model: its global gradient norm, and one NVLAMB step from it."""
    from pipefisher.runtime.pipeline_worker import PipelineWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        worker = PipelineWorker(cfg, rank, 2, torch.device("cpu"))
        seen: dict[str, object] = {}

        def capture() -> None:
            seen["norm"] = float(worker.global_grad_norm())
            seen["kinds"] = sorted({type(p).__name__ for p in worker.optimizer.param_groups[0]["params"]})

        worker.before_optimizer_step.append(capture)
        worker.train_step(0)
        (stage,) = worker.modules.values()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in stage.named_parameters()}
        torch.save({"seen": seen, "params": params}, f"{out}/trap{rank}.pt")
    finally:
        release_process_group()


@pytest.fixture(scope="module")
def trap_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, list[dict]]:
    out = tmp_path_factory.mktemp("tp_traps")
    cfg = _cfg("gpipe", 1, 2, 1, 1, 2, False)
    start_workers(_trap_worker, (cfg, str(out)), 2)
    return cfg, [torch.load(out / f"trap{r}.pt", weights_only=True) for r in range(2)]


def _reference_step(cfg: TrainConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """The first step in one process: its gradient norm and the parameters after one NVLAMB step."""
    from pipefisher.optim.factory import make_optimizer

    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    source, plan = data_source(cfg), data_plan(cfg)
    for j in range(cfg.num_micro_batches):
        with dropout_key(0, j):
            (model(None, get_micro_batch(source, 0, j, 0, **plan)).sum() / cfg.num_micro_batches).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    optimizer, _ = make_optimizer(cfg, list(model.named_parameters()), torch.device("cpu"))
    optimizer.step(grad_norm=norm)
    return float(norm), {n: p.detach() for n, p in model.named_parameters()}


def test_global_grad_norm_counts_split_and_whole_gradients_once(trap_results) -> None:
    """Split weights' parts on every tp rank, whole ones (embeddings, LayerNorms, heads, row-parallel
    biases) on tp index 0 only: the norm of the single-process gradient, the same on both ranks."""
    cfg, results = trap_results
    want, _ = _reference_step(cfg)
    for r in results:
        assert r["seen"]["norm"] == pytest.approx(want, rel=1e-5)
    assert want > cfg.optimizer.max_grad_norm  # the clip is active: the norm decides the update


def test_nvlamb_steps_mixed_tensor_and_dtensor_parameters_as_one_process(trap_results) -> None:
    """NVLAMB's buckets hold plain tensors, Shard and Replicate DTensors apart; each trust ratio is
    the whole tensor's: one step equals single-process NVLAMB on every parameter."""
    cfg, results = trap_results
    _, want = _reference_step(cfg)
    assert results[0]["seen"]["kinds"] == ["DTensor", "Parameter"]  # both kinds in one parameter group
    for r in results:
        for name, value in r["params"].items():
            torch.testing.assert_close(value, want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


EVAL = ["eval.every_steps=1", "eval.batches=5", "data.num_samples=64"]  # 5: the last pass is partial


def _eval_worker(rank: int, cfg: TrainConfig, out: str) -> None:
    """One step of stages=2 tp=2, then held-out evaluation through the pipeline (twice)."""
    from pipefisher.runtime.evaluation import PipelineEvaluator
    from pipefisher.runtime.pipeline_worker import PipelineWorker
    from pipefisher.runtime.sharding import full_state_dict

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=cfg.num_workers,
                            timeout=datetime.timedelta(seconds=120))
    try:
        worker = PipelineWorker(cfg, rank, cfg.num_workers, torch.device("cpu"))
        evaluator = PipelineEvaluator(cfg, worker)
        worker.train_step(0)
        stages = {stage: full_state_dict(m) for (_, stage), m in worker.modules.items()}  # a collective over tp
        figures = [evaluator.evaluate(0), evaluator.evaluate(0)]
        torch.save({"figures": figures, "stages": stages}, f"{out}/eval{rank}.pt")
    finally:
        release_process_group()


@pytest.mark.slow
def test_tp_held_out_evaluation_equals_single_process_evaluation(tmp_path: Path) -> None:
    from pipefisher.evaluation import eval_source, evaluate_model
    from pipefisher.model import load_hf_state_dict, merge_stage_state_dicts

    cfg = compose_train(MODEL + EVAL + ["pipeline=1f1b", "stages=2", "tp=2", "num_micro_batches=2"])
    start_workers(_eval_worker, (cfg, str(tmp_path)), 4)
    ranks = [torch.load(tmp_path / f"eval{r}.pt", weights_only=True) for r in range(4)]
    stages = {s: sd for r in ranks for s, sd in r["stages"].items()}
    model = build_full_model(bert_config(cfg), seed=cfg.seed + 1)  # other weights, replaced by the workers'
    load_hf_state_dict(model, merge_stage_state_dicts([stages[s] for s in sorted(stages)]))
    want = evaluate_model(model, cfg, eval_source(cfg), torch.device("cpu"))
    for r, got in enumerate(ranks):
        for figures in got["figures"]:
            for name in ("eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy"):
                assert figures[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), (r, name)


def test_tp_ranks_are_adjacent_within_a_worker() -> None:
    assert [(schedule_worker(r, 2), tp_index(r, 2)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [process_rank(w, i, 2) for w in range(2) for i in range(2)] == [0, 1, 2, 3]


def test_tp_counts_in_the_world_not_the_batch() -> None:
    cfg = compose_train(MODEL[:-3] + ["pipeline=1f1b", "stages=2", "tp=2", "num_micro_batches=2"])
    assert (cfg.num_workers, cfg.data_replicas, cfg.global_batch_size) == (4, 1, 4)


@pytest.mark.parametrize("overrides, message", [
    (["tp=0"], r"^tp=0: must be at least 1"),
    (["tp=4"], r"^tp=4: must divide model.num_heads=2 and the FFN width model.intermediate_size=128 .*use tp in \[2\]"),
    (["tp=2", "model.intermediate_size=65"], r"^tp=2: must divide .*intermediate_size=65.*use tp in \[1\]"),
    (["tp=2", "optimizer=kfac"], r"^tp=2: optimizer=kfac needs whole weights: .*factors sharded"),
    (["tp=2", "optimizer=pipefisher"], r"^tp=2: optimizer=pipefisher needs whole weights"),
    (["tp=2", "precision=bf16"], r"^precision='bf16': tp=2 runs in fp32 only"),
    (["tp=2", "profile.enabled=true"], r"^profile.enabled=True: profiles map one process"),
    (["tp=2", "comm_ablation=true"], r"^comm_ablation=True: the tensor-parallel all-reduces"),
])
def test_tp_refusals_name_the_field_and_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        compose_train(MODEL[:-3] + overrides)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_train_py_stages2_tp2_gives_the_single_process_losses(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from pipefisher.launch.local import run_training  # what train.py calls

    common = MODEL[:-3] + DROPOUT_ON + ["steps=3", "save_final=true", "wandb.mode=disabled", "progress=false"]
    split = run_training(compose_train(common + ["stages=2", "tp=2", "pipeline=1f1b", "num_micro_batches=2"]),
                         tmp_path / "tp")
    single = run_training(compose_train(common + ["num_micro_batches=2"]), tmp_path / "single")
    assert split["loss"] == pytest.approx(single["loss"], rel=1e-5)
    got, want = (load_file(tmp_path / run / "final" / "model.safetensors") for run in ("tp", "single"))
    assert set(got) == set(want)  # final/ holds whole tensors, gathered from the tp parts
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
