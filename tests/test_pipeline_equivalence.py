"""Every pipeline method gives the loss and gradients of single-process training (CPU, gloo),
the zero-bubble ones (split backward: I now, W deferred) included.

The reference is an independent plain loop: the full model, the same micro-batches, loss scaled by
1/(N·W) per micro-batch, one backward each. For 5 NVLAMB steps the reference is
``train_single_process`` with N·W micro-batches (the same samples, see ``data.micro_batch_indices``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.model.rng import dropout_key
from pipefisher.run_spec import bert_config, data_plan, data_source
from tests.conftest import compose_train
from tests.dist_harness import run_cases
from tests.reference import train_single_process

MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=5"]
# Parameters after several steps are compared at atol 1e-5 = 1e-3 x lr, gradients at 1e-6. NVLAMB, AdamW and Muon's
# AdamW half normalize each element's update (m / sqrt(v)), so the rounding of a gradient element whose terms nearly
# cancel (another summation order: micro-batches, shards, another CPU's kernels) can move that element's update by a
# good part of lr: seen on a 2-core Xeon with AMX after 5 steps at lr 0.01, one element off by 2.6e-6 (a LayerNorm
# bias, NVLAMB on v-min; once in two runs) and one by 4.7e-6 (a position embedding, Muon tp=2; every run), where the
# other CPUs stayed within 1e-6. A real mismatch (a micro-batch lost, an
# all-reduce missing, another optimizer) moves parameters by O(lr) = 1e-2, three orders above this tolerance.
PARAM_ATOL = 1e-5
WORD = "bert.embeddings.word_embeddings.weight"
DECODER = "cls.predictions.decoder.weight"


def _grid() -> list[tuple[str, int, int, int]]:
    """Each method at D=2 and D=4 with both N, data parallel (W=2) at D=2. D=4 with W=2 (8 workers on
    2 cores) is left out: its gradient sync is D=2 W=2's (one all-reduce per stage replica over its
    data-parallel group, whatever D), and its schedule, per pipeline, D=4 W=1's."""
    cases = []
    for method in ("gpipe", "1f1b", "chimera", "interleaved", "zb-h1", "zb-v"):
        for d in (2, 4):
            # zb-v needs N >= 2D: its N are 2D and 3D.
            for n in ((2 * d, 3 * d) if method == "zb-v" else (d, 2 * d)):
                for w in (1, 2):
                    if d * w > 4 or (method == "interleaved" and d == 4):  # 4 workers x 2 chunks > 4 layers
                        continue
                    cases.append((method, d, n, w))
    return cases


# The other V schedules (issue 26): DualPipeV's fixed order, and V-Half / V-Min, which equal zb-v's
# order at D <= 2 and hold less memory from D=3 on.
V_GRID = [("dualpipev", 2, 4, 1), ("dualpipev", 2, 5, 2), ("dualpipev", 4, 8, 1), ("v-half", 4, 8, 1),
          ("v-min", 3, 7, 1), ("v-min", 4, 8, 1)]
GRID = _grid() + V_GRID
LONG = [("gpipe", 4, 8, 1), ("1f1b", 2, 4, 2), ("chimera", 4, 8, 1), ("chimera", 2, 4, 2), ("interleaved", 2, 4, 1),
        ("zb-h1", 2, 4, 2), ("zb-v", 2, 4, 1), ("dualpipev", 2, 4, 2), ("v-min", 3, 6, 1)]


def _cfg(method: str, d: int, n: int, w: int) -> TrainConfig:
    model = MODEL
    if method in ("zb-v", "dualpipev", "v-half", "v-min") and d == 4:  # 8 stages: 6 encoder layers, plus a stage each for the embeddings and heads
        model = [x if not x.startswith("model.num_layers=") else "model.num_layers=6" for x in MODEL]
    return compose_train(model + [f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}", f"data_parallel={w}"])


def _reference_grads(cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    source, plan = data_source(cfg), data_plan(cfg)
    total = torch.zeros(2)
    scale = 1.0 / (cfg.num_micro_batches * cfg.data_replicas)
    for dp in range(cfg.data_replicas):
        for j in range(cfg.num_micro_batches):
            with dropout_key(0, dp * cfg.num_micro_batches + j):  # the executor's key: its [Note: dropout]
                losses = model(None, get_micro_batch(source, 0, j, dp, **plan))
            (losses.sum() * scale).backward()
            total += losses.detach() * scale
    return total.tolist(), {n: p.grad for n, p in model.named_parameters()}


def single_process_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` as one process: the same global batch (N x data replicas micro-batches) and steps."""
    return dataclasses.replace(cfg, stages=1, data_parallel=1, sdp=1, sdp_reshard_after_forward=False, tp=1, recompute=False,
                               num_micro_batches=cfg.num_micro_batches * cfg.data_replicas,
                               pipeline=dataclasses.replace(cfg.pipeline, method="gpipe", num_virtual=1, layers_per_stage=None,
                                                            chimera_stacking="direct"))


def _reference_params(cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], float]:
    """Single-process training over the same global batch (N x data replicas micro-batches) and steps."""
    single = single_process_config(cfg)
    model = build_full_model(bert_config(single), seed=single.seed)
    last = train_single_process(single, output_dir=None, model=model)
    return {n: p.detach() for n, p in model.named_parameters()}, last["loss"]


def _by_name(results: dict[int, dict], key: str) -> list[tuple[str, torch.Tensor]]:
    return [(k.split("/", 2)[2], t) for r in sorted(results) for k, t in results[r][key].items()]


def assert_first_step_equals_single_process(cfg: TrainConfig, results: dict[int, dict]) -> dict[str, torch.Tensor]:
    """Every rank's first-step loss and every parameter's gradient (the tied weight: the sum of both
    uses) equal single-process training's; returns the reference gradients."""
    ref_loss, ref_grads = _reference_grads(cfg)
    for res in results.values():  # every rank reports the step's global loss
        torch.testing.assert_close(torch.tensor(res["losses"][0]), torch.tensor(ref_loss), rtol=1e-5, atol=1e-6)
    seen = set()
    for name, grad in _by_name(results, "grads"):
        expected = ref_grads[WORD if name == DECODER else name]
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        seen.add(WORD if name == DECODER else name)
    assert seen == set(ref_grads), f"parameters missing from the pipeline: {set(ref_grads) - seen}"
    return ref_grads


def assert_params_equal_single_process(cfg: TrainConfig, results: dict[int, dict]) -> None:
    """The last step's loss and every parameter after the run equal single-process training's."""
    ref_params, ref_last_loss = _reference_params(cfg)
    assert sum(results[0]["losses"][-1]) == pytest.approx(ref_last_loss, rel=1e-5)
    for name, value in _by_name(results, "params"):
        torch.testing.assert_close(value, ref_params[WORD if name == DECODER else name], rtol=1e-5, atol=PARAM_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def grid_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict[int, dict]]:
    keys = [(c, 1) for c in GRID] + [(c, 5) for c in LONG]
    results = run_cases([(_cfg(*c), steps) for c, steps in keys], tmp_path_factory.mktemp("pipeline"))
    return dict(zip(keys, results))


@pytest.mark.slow
@pytest.mark.parametrize("case", GRID, ids=[f"{m}-D{d}-N{n}-W{w}" for m, d, n, w in GRID])
def test_first_step_loss_and_every_gradient_equal_single_process(case, grid_results) -> None:
    assert_first_step_equals_single_process(_cfg(*case), grid_results[(case, 1)])


@pytest.mark.slow
@pytest.mark.parametrize("case", LONG, ids=[f"{m}-D{d}-N{n}-W{w}" for m, d, n, w in LONG])
def test_parameters_after_five_nvlamb_steps_equal_single_process(case, grid_results) -> None:
    assert_params_equal_single_process(_cfg(*case), grid_results[(case, 5)])


@pytest.mark.slow
def test_chimera_replicas_start_from_identical_weights(grid_results) -> None:
    # After 5 steps the twins (pipe 0 and pipe 1 copies of one stage) must still be identical.
    results = grid_results[(("chimera", 4, 8, 1), 5)]
    params = {k: t for r in results for k, t in results[r]["params"].items()}
    for key, value in params.items():
        pipe, stage, name = key.split("/", 2)
        if pipe == "0":
            torch.testing.assert_close(params[f"1/{stage}/{name}"], value, rtol=0, atol=0)


# -- Chimera with forward doubling (issue 26, item 1) -------------------------------------------

DOUBLING = [(4, 8, 1), (2, 4, 2), (2, 8, 1)]  # (D, N, W): one doubled unit, data parallel, two units
DOUBLING_LONG = [(4, 8, 1), (2, 4, 2)]


def _doubling_cfg(d: int, n: int, w: int) -> TrainConfig:
    return compose_train(MODEL + ["pipeline=chimera", "pipeline.chimera_stacking=doubling", f"stages={d}",
                                  f"num_micro_batches={n}", f"data_parallel={w}"])


@pytest.fixture(scope="module")
def doubling_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict[int, dict]]:
    keys = [(c, 1) for c in DOUBLING] + [(c, 5) for c in DOUBLING_LONG]
    results = run_cases([(_doubling_cfg(*c), steps) for c, steps in keys], tmp_path_factory.mktemp("doubling"))
    return dict(zip(keys, results))


def test_chimera_doubling_config_runs_the_doubling_schedule() -> None:
    from pipefisher.runtime.build import schedule_for

    assert schedule_for(_doubling_cfg(4, 8, 1)).method == "chimera-doubling"
    assert schedule_for(_cfg("chimera", 4, 8, 1)).method == "chimera"


@pytest.mark.slow
@pytest.mark.parametrize("case", DOUBLING, ids=[f"doubling-D{d}-N{n}-W{w}" for d, n, w in DOUBLING])
def test_chimera_doubling_first_step_loss_and_every_gradient_equal_single_process(case, doubling_results) -> None:
    assert_first_step_equals_single_process(_doubling_cfg(*case), doubling_results[(case, 1)])


@pytest.mark.slow
@pytest.mark.parametrize("case", DOUBLING_LONG, ids=[f"doubling-D{d}-N{n}-W{w}" for d, n, w in DOUBLING_LONG])
def test_chimera_doubling_parameters_after_five_nvlamb_steps_equal_single_process(case, doubling_results) -> None:
    assert_params_equal_single_process(_doubling_cfg(*case), doubling_results[(case, 5)])
