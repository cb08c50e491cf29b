"""Dropout independent of placement (issue 16, item 5): with dropout on, every pipeline method gives
single-process training's losses and gradients.

Masks are keyed by (seed, pipeline layer, dropout site, step, micro-batch index in the global batch)
(``pipefisher.model.rng``). The in-process tests check the key's contract on the model; the
distributed ones run each method for two steps (one spawn of four processes walks every case,
``tests.dist_harness``) against ``train_single_process`` with N·W micro-batches, dropout 0.1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import (
    DECODER_WEIGHT_NAME,
    WORD_EMBEDDINGS_NAME,
    BertConfig,
    BertStage,
    build_full_model,
    partition_layers,
)
from pipefisher.model.rng import KeyedDropout, dropout_key
from pipefisher.run_spec import bert_config, data_plan, data_source
from tests.conftest import compose_train
from tests.dist_harness import run_cases
from tests.reference import train_single_process

DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]  # the defaults; TINY sets 0
MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=2", *DROPOUT]
STEPS = 2
# (id, overrides): every method, data parallelism (with a pipeline and with Chimera's twins) and recompute.
CASES = {
    "gpipe-D2-N2": ["pipeline=gpipe", "stages=2", "num_micro_batches=2"],
    "1f1b-D2-N4": ["pipeline=1f1b", "stages=2", "num_micro_batches=4"],
    "chimera-D2-N2": ["pipeline=chimera", "stages=2", "num_micro_batches=2"],
    "interleaved-D2-N2": ["pipeline=interleaved", "stages=2", "num_micro_batches=2"],
    "1f1b-D2-N2-W2": ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "data_parallel=2"],
    "chimera-D2-N2-W2": ["pipeline=chimera", "stages=2", "num_micro_batches=2", "data_parallel=2"],
    "gpipe-D2-N2-recompute": ["pipeline=gpipe", "stages=2", "num_micro_batches=2", "recompute=true"],
    "zb-h1-D2-N2": ["pipeline=zb-h1", "stages=2", "num_micro_batches=2"],
    "zb-v-D2-N4-recompute": ["pipeline=zb-v", "stages=2", "num_micro_batches=4", "recompute=true"],
}


def _cfg(case: str) -> TrainConfig:
    return compose_train(MODEL + CASES[case])


def _single(cfg: TrainConfig) -> TrainConfig:
    """The single-process run over the same global batch (N·W micro-batches, the same samples)."""
    return dataclasses.replace(cfg, stages=1, data_parallel=1, recompute=False,
                               num_micro_batches=cfg.num_micro_batches * cfg.data_parallel,
                               pipeline=dataclasses.replace(cfg.pipeline, method="gpipe", num_virtual=1,
                                                            layers_per_stage=None))


@functools.lru_cache(maxsize=None)
def _reference(num_micro_batches: int, tmp: Path) -> dict:
    """``train_single_process`` for STEPS steps over ``num_micro_batches`` micro-batches: per-step
    losses, parameters after the last step; and the first step's gradients from a plain loop under
    the same keys."""
    cfg = _single(_cfg("gpipe-D2-N2"))
    cfg = dataclasses.replace(cfg, num_micro_batches=num_micro_batches, global_batch_size="auto")
    model = build_full_model(bert_config(cfg), seed=cfg.seed).train()
    source, plan = data_source(cfg), data_plan(cfg)
    for j in range(num_micro_batches):
        with dropout_key(0, j):
            losses = model(None, get_micro_batch(source, 0, j, 0, **plan))
        (losses.sum() / num_micro_batches).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    out = tmp / f"single-N{num_micro_batches}"
    out.mkdir()
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    train_single_process(cfg, output_dir=out, model=model)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "grads": grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    results = run_cases([(_cfg(c), STEPS) for c in CASES], tmp_path_factory.mktemp("dropout"))
    return dict(zip(CASES, results))


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("single")


def _by_name(results: dict[int, dict], key: str) -> list[tuple[str, torch.Tensor]]:
    return [(k.split("/", 2)[2], t) for r in sorted(results) for k, t in results[r][key].items()]


def _hf(name: str) -> str:
    return WORD_EMBEDDINGS_NAME if name == DECODER_WEIGHT_NAME else name  # the tied weight


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_losses_and_gradients_equal_single_process_with_dropout_on(case, pipeline_results,
                                                                            reference_dir) -> None:
    cfg = _cfg(case)
    assert cfg.model.hidden_dropout == cfg.model.attention_dropout == 0.1
    ref = _reference(cfg.num_micro_batches * cfg.data_parallel, reference_dir)
    results = pipeline_results[case]
    for r, res in results.items():  # every rank reports the global loss of every step
        torch.testing.assert_close(torch.tensor([sum(l) for l in res["losses"]]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, r=r: f"rank {r} losses: {m}")
    seen = set()
    for name, grad in _by_name(results, "grads"):  # the first step's synchronized gradients
        torch.testing.assert_close(grad, ref["grads"][_hf(name)], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
        seen.add(_hf(name))
    assert seen == set(ref["grads"])
    for name, value in _by_name(results, "params"):  # after the second step
        torch.testing.assert_close(value, ref["params"][_hf(name)], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_dropout_is_live_in_the_equivalence_cases(reference_dir) -> None:
    # Not vacuous: without dropout the single-process losses differ.
    ref = _reference(2, reference_dir)
    cfg = dataclasses.replace(_single(_cfg("gpipe-D2-N2")), model=dataclasses.replace(
        _cfg("gpipe-D2-N2").model, hidden_dropout=0.0, attention_dropout=0.0))
    off = train_single_process(cfg, output_dir=None)
    assert abs(off["loss"] - ref["losses"][-1]) > 1e-3


# -- the key's contract on the model (in process) --------------------------------------------------

VOCAB, SEQ, PRED = 100, 12, 3


def _config(num_layers: int = 4) -> BertConfig:
    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_layers=num_layers, num_heads=4,
                      max_position_embeddings=32, hidden_dropout=0.1, attention_dropout=0.1)


def _batch(batch_size: int = 2, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(5, VOCAB, (batch_size, SEQ), generator=g),
        "segment_ids": torch.zeros(batch_size, SEQ, dtype=torch.long),
        "input_mask": torch.ones(batch_size, SEQ, dtype=torch.long),
        "masked_lm_positions": torch.randint(1, SEQ, (batch_size, PRED), generator=g),
        "masked_lm_ids": torch.randint(5, VOCAB, (batch_size, PRED), generator=g),
        "next_sentence_labels": torch.randint(0, 2, (batch_size,), generator=g),
    }


def _loss_and_grads(model: torch.nn.Module, key: tuple[int, int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with dropout_key(*key):
        loss = model(None, _batch())
    loss.sum().backward()  # outside the key, as the executor's BACKWARD is
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_stages_draw_the_full_models_masks_whatever_the_global_rng() -> None:
    config = _config()
    full = build_full_model(config, seed=3).train()
    stages = [BertStage(config, first, last, seed=3).train()
              for first, last in partition_layers(config, 3, layers_per_stage=[1, 2, 1])]
    with dropout_key(5, 7):
        torch.manual_seed(1)
        expected = full(None, _batch())
        hidden = None
        for k, stage in enumerate(stages):
            torch.manual_seed(100 + k)  # each "worker" has its own RNG state
            hidden = stage(hidden, _batch())
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_masks_depend_on_step_micro_batch_and_seed_only() -> None:
    config = _config(num_layers=2)
    model = build_full_model(config, seed=0).train()
    loss, grads = _loss_and_grads(model, (0, 0))
    torch.manual_seed(123)  # the global RNG does not enter
    again, grads_again = _loss_and_grads(model, (0, 0))
    torch.testing.assert_close(again, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads_again[name], grads[name], rtol=0, atol=0)
    others = [_loss_and_grads(model, key)[0] for key in ((1, 0), (0, 1))]
    others.append(_loss_and_grads(build_full_model(config, seed=1).train(), (0, 0))[0])
    for other in others:
        assert not torch.equal(other, loss)
    sites = [m.site for m in model.modules() if isinstance(m, KeyedDropout)]
    assert len(sites) == 1 + 3 * config.num_layers and len(set(sites)) == len(sites)


def test_recompute_replays_the_keyed_masks() -> None:
    config = _config(num_layers=2)
    loss, grads = _loss_and_grads(build_full_model(config, seed=2).train(), (4, 1))
    replayed, replayed_grads = _loss_and_grads(build_full_model(config, seed=2, recompute=True).train(), (4, 1))
    torch.testing.assert_close(replayed, loss, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(replayed_grads[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_keyed_dropout_drops_p_and_scales_the_rest() -> None:
    dropout = KeyedDropout(0.25)
    dropout.site = 1
    x = torch.ones(200_000, requires_grad=True)
    with dropout_key(0, 0):
        y = dropout(x)
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - 0.25) < 0.01
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach())  # d(x * mask / (1 - p)) / dx = mask / (1 - p)
    assert torch.equal(dropout.eval()(x), x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_keyed_dropout_on_cuda_draws_on_the_device_and_recompute_replays_it() -> None:
    config = _config(num_layers=2)
    batch = {k: v.cuda() for k, v in _batch().items()}
    results = []
    for recompute in (False, True):
        model = build_full_model(config, seed=0, recompute=recompute).train().cuda()
        with dropout_key(0, 3):
            loss = model(None, batch)
        loss.sum().backward()  # recompute's replay runs on autograd's device thread
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
