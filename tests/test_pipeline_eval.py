"""Held-out evaluation through every pipeline method equals single-process evaluation of the same
weights, and leaves the run as it was (parameters, optimizer state, RNG streams, K-FAC factors).

One spawn of 4 processes runs every case: a worker trains one step, evaluates, trains a second;
a twin worker of the same config trains the two steps without evaluating. The reference
evaluation is :func:`pipefisher.evaluation.evaluate_model` on the full model holding the
weights the workers had when they evaluated (merged from their stages).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipefisher.config import TrainConfig
from pipefisher.evaluation import eval_source, evaluate_model
from pipefisher.model import build_full_model, load_hf_state_dict, merge_stage_state_dicts
from pipefisher.run_spec import bert_config
from pipefisher.runtime.evaluation import PipelineEvaluator
from pipefisher.runtime.state import optimizer_state
from pipefisher.runtime.teardown import release_process_group
from pipefisher.runtime.worker import PipelineWorker
from tests.conftest import compose_train
from tests.dist_harness import start_workers

# Dropout on: evaluation must turn it off (and draw nothing from any RNG).
MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "data.seq_len=16", "data.max_predictions=3",
         "micro_batch_size=2", "lr=0.01", "steps=2", "eval.every_steps=1", "eval.batches=5",
         "data.num_samples=64"]
# (method, D, N, W, optimizer): eval.batches=5 is no multiple of N·W, so the last pass is partial.
CASES = [("gpipe", 2, 2, 2, "nvlamb"), ("1f1b", 4, 4, 1, "nvlamb"), ("chimera", 2, 2, 2, "nvlamb"),
         ("chimera", 4, 4, 1, "kfac"), ("interleaved", 2, 2, 1, "nvlamb"), ("zb-h1", 2, 4, 2, "nvlamb"),
         ("zb-v", 2, 4, 1, "pipefisher")]
IDS = [f"{m}-D{d}-N{n}-W{w}-{o}" for m, d, n, w, o in CASES]


def _cfg(method: str, d: int, n: int, w: int, optimizer: str) -> TrainConfig:
    return compose_train(MODEL + [f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}",
                                  f"data_parallel={w}", f"optimizer={optimizer}"])


def _state(worker: PipelineWorker) -> dict:
    """What evaluation must not change: weights, optimizer state, K-FAC factors, RNG streams."""
    kfac = {}
    if worker.kfac is not None:
        for (pipe, stage), pre in worker.kfac.pre.items():
            for name in pre.layer_names:
                layer = pre.layer(name)
                for part in ("a", "b"):
                    t = getattr(layer, part)
                    if t is not None:
                        kfac[f"{pipe}/{stage}/{name}/{part}"] = t.clone()
    return {"params": {f"{p}/{s}/{n}": t.detach().clone() for (p, s), m in worker.modules.items()
                       for n, t in m.named_parameters()},
            "optimizer": optimizer_state(worker.optimizer, worker.scheduler), "kfac": kfac,
            "rng": torch.get_rng_state()}


def _worker(rank: int, cases: list[TrainConfig], out_dir: str) -> None:
    torch.set_num_threads(1)
    for i, cfg in enumerate(cases):
        if rank >= cfg.num_workers:
            continue
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg{i}", rank=rank,
                                world_size=cfg.num_workers, timeout=datetime.timedelta(seconds=120))
        try:
            out: dict = {}
            for evaluating in (True, False):
                worker = PipelineWorker(cfg, rank, cfg.num_workers, torch.device("cpu"))
                evaluator = PipelineEvaluator(cfg, worker)
                losses = [worker.train_step(0)[0]]
                if evaluating:
                    out["stages"] = {f"{p}/{s}": {n: t.clone() for n, t in m.state_dict().items()}
                                     for (p, s), m in worker.modules.items()}
                    before = _state(worker)
                    out["figures"] = evaluator.evaluate(0)
                    out["again"] = evaluator.evaluate(0)
                    after = _state(worker)
                    out["unchanged"] = _equal(before, after)
                    out["training_mode"] = all(m.training for m in worker.modules.values())
                losses.append(worker.train_step(1)[0])
                out["with_eval" if evaluating else "without_eval"] = {"losses": losses, **_state(worker)}
            out["next_step_identical"] = _equal(out.pop("with_eval"), out.pop("without_eval"))
            torch.save(out, Path(out_dir) / f"case{i}_rank{rank}.pt")
        finally:
            release_process_group()


def _equal(a, b) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict]]:
    out = tmp_path_factory.mktemp("eval")
    cases = [_cfg(*c) for c in CASES]
    start_workers(_worker, (cases, str(out)), max(c.num_workers for c in cases))
    return [{r: torch.load(out / f"case{i}_rank{r}.pt", weights_only=False) for r in range(c.num_workers)}
            for i, c in enumerate(cases)]


def _reference(cfg: TrainConfig, ranks: dict[int, dict]) -> dict[str, float]:
    """Single-process evaluation of the weights the workers held (one replica of each stage)."""
    stages: dict[int, dict] = {}
    for r in sorted(ranks):
        for key, sd in ranks[r]["stages"].items():
            stages.setdefault(int(key.split("/")[1]), sd)
    model = build_full_model(bert_config(cfg), seed=cfg.seed + 1)  # other weights, replaced below
    load_hf_state_dict(model, merge_stage_state_dicts([stages[s] for s in sorted(stages)]))
    return evaluate_model(model, cfg, eval_source(cfg), torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_pipeline_evaluation_equals_single_process_evaluation(results, index: int) -> None:
    cfg, ranks = _cfg(*CASES[index]), results[index]
    reference = _reference(cfg, ranks)
    for r, got in ranks.items():
        for name in ("eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy"):
            assert got["figures"][name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), (r, name)
            assert got["again"][name] == got["figures"][name]  # the same batches every time
        assert got["figures"]["eval_time_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_evaluation_changes_nothing_the_run_carries(results, index: int) -> None:
    for r, got in results[index].items():
        assert got["unchanged"], f"worker {r}: evaluation changed weights, optimizer state, K-FAC factors or RNG"
        assert got["training_mode"], f"worker {r}: modules left in eval mode"
        assert got["next_step_identical"], f"worker {r}: the step after an evaluation differs from a run without it"


def test_evaluation_figures_from_sums_match_a_direct_computation() -> None:
    """The held-out loss weighs every masked slot alike; accuracy counts only real slots."""
    from pipefisher.evaluation import eval_figures
    from pipefisher.model import pretraining_eval_sums

    torch.manual_seed(0)
    logits = [torch.randn(2, 3, 7), torch.randn(2, 3, 7)]
    nsp = [torch.randn(2, 2), torch.randn(2, 2)]
    batches = [{"masked_lm_ids": torch.tensor([[1, 2, 0], [3, 0, 0]]), "next_sentence_labels": torch.tensor([0, 1])},
               {"masked_lm_ids": torch.tensor([[4, 5, 6], [1, 1, 0]]), "next_sentence_labels": torch.tensor([1, 1])}]
    sums = sum(pretraining_eval_sums(m, n, b) for m, n, b in zip(logits, nsp, batches))
    got = eval_figures(sums, 0.5)
    flat_logits = torch.cat([m.reshape(-1, 7) for m in logits])
    labels = torch.cat([b["masked_lm_ids"].reshape(-1) for b in batches])
    real = labels != 0
    expected_loss = torch.nn.functional.cross_entropy(flat_logits[real], labels[real]).item()
    expected_acc = (flat_logits[real].argmax(-1) == labels[real]).float().mean().item()
    nsp_logits, nsp_labels = torch.cat(nsp), torch.cat([b["next_sentence_labels"] for b in batches])
    assert got["eval_mlm_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert got["eval_mlm_accuracy"] == pytest.approx(expected_acc)
    assert got["eval_nsp_loss"] == pytest.approx(torch.nn.functional.cross_entropy(nsp_logits, nsp_labels).item())
    assert got["eval_nsp_accuracy"] == pytest.approx((nsp_logits.argmax(-1) == nsp_labels).float().mean().item())
    assert got["eval_time_s"] == 0.5
