"""K-FAC across pipeline stages and replicas equals single-process K-FAC; PipeFisher (work in the
bubbles) equals K-FAC on the critical path with the same refresh interval and staleness (the
plan's own units moved after the flush: ``optimizer=kfac optimizer.schedule=<plan>``)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.optim import KFACPreconditioner, global_grad_norm
from pipefisher.optim.factory import make_optimizer
from pipefisher.run_spec import bert_config, data_plan, data_source
from pipefisher.runtime.build import kfac_assignment
from pipefisher.runtime.worker import schedule_for
from pipefisher.schedules.kfac import Assignment, assignment_to_json
from tests.conftest import compose_train
from tests.dist_harness import run_cases

MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01", "steps=4",
         "optimizer.damping=0.01"]
WORD = "bert.embeddings.word_embeddings.weight"
DECODER = "cls.predictions.decoder.weight"
CASES = [("chimera", 2, 4, 1), ("1f1b", 2, 2, 2), ("gpipe", 4, 4, 1), ("zb-h1", 2, 4, 1), ("zb-v", 2, 4, 1),
         ("1f1b", 2, 4, 2, "optimizer.curvature_micro_batches=1", "optimizer.clip_before_precondition=false"),
         ("chimera", 2, 4, 1, "pipeline.chimera_stacking=doubling"),  # forward doubling (issue 26)
         ("dualpipev", 2, 4, 1), ("v-min", 3, 6, 1)]  # the other V schedules (issue 26): v-min holds 4 of 6 chunks


def _cfg(method: str, d: int, n: int, w: int, *extra: str) -> TrainConfig:
    return compose_train(MODEL + [f"pipeline={method}", f"stages={d}", f"num_micro_batches={n}",
                                  f"data_parallel={w}", "optimizer=kfac", *extra])


def _single_process_kfac(cfg: TrainConfig, steps: int):
    """Independent reference: one process, every micro-batch of every replica (or the first
    ``optimizer.curvature_micro_batches`` of each replica's, for the curvature), K-FAC refresh and
    preconditioning each step (interval 1, inverses used at once), then NVLAMB clipped by the norm
    of the preconditioned gradient, or of the gradient before preconditioning
    (``optimizer.clip_before_precondition``)."""
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    source, plan = data_source(cfg), data_plan(cfg)
    n_total = cfg.num_micro_batches * cfg.data_parallel
    subset = cfg.optimizer.curvature_micro_batches
    pre = KFACPreconditioner(model, damping=cfg.optimizer.damping, factor_decay=cfg.optimizer.factor_decay,
                             loss_scale=1.0 / n_total)
    optimizer, scheduler = make_optimizer(cfg, list(model.named_parameters()), torch.device("cpu"))
    first = {}
    for step in range(steps):
        pre.on_step_start(step)
        for dp in range(cfg.data_parallel):
            for j in range(cfg.num_micro_batches):
                captured = subset == 0 or j < subset
                with pre.micro_batch(dp * cfg.num_micro_batches + j) if captured else contextlib.nullcontext():
                    losses = model(None, get_micro_batch(source, step, j, dp, **plan))
                (losses.sum() / n_total).backward()
        raw_norm = global_grad_norm(model.parameters())
        pre.refresh_and_precondition(step)
        if step == 0:
            first["factors"] = {n: (pre.layer(n).a.clone(), pre.layer(n).b.clone()) for n in pre.layer_names}
            first["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step(grad_norm=raw_norm if cfg.optimizer.clip_before_precondition else None)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return first, {n: p.detach() for n, p in model.named_parameters()}


def _planned(cfg: TrainConfig, path: Path) -> Assignment:
    """PipeFisher's plan for an ``optimizer=pipefisher`` config (the runtime's planner on the CPU cost
    estimate, under its ``max_interval``, ``max_staleness`` and ``promote_inverses``), written to ``path``
    for ``optimizer.schedule``."""
    assert cfg.optimizer.name == "pipefisher" and not cfg.optimizer.schedule, cfg.optimizer
    assignment = kfac_assignment(cfg, schedule_for(cfg))
    assignment_to_json(assignment, path)
    return assignment


PROMOTE = ("at_cycle_end", "when_ready")  # optimizer.promote_inverses; when_ready is optimizer=pipefisher's default


@pytest.fixture(scope="module")
def kfac_results(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("kfac")
    cases = [(_cfg(*c), 4) for c in CASES]
    # PipeFisher with the interval its planner picks under each promotion rule, and K-FAC running the same
    # plan's units after the flush with the same rule.
    intervals = {}
    for promote in PROMOTE:
        rule = f"optimizer.promote_inverses={promote}"
        path = tmp / f"assignment-{promote}.json"
        k = intervals[promote] = _planned(_cfg("chimera", 2, 4, 1, "optimizer=pipefisher", rule), path).interval
        steps = 2 * k + 1
        for optimizer in ("optimizer=pipefisher", "optimizer=kfac"):
            cfg = _cfg("chimera", 2, 4, 1, optimizer, rule, f"optimizer.schedule={path}")
            cases.append((dataclasses.replace(cfg, steps=steps), steps))
    return run_cases(cases, tmp), intervals


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join([f"{c[0]}-D{c[1]}-N{c[2]}-W{c[3]}", *c[4:]])
                                                           for c in CASES])
def test_factors_preconditioned_gradients_and_parameters_equal_single_process(index: int, kfac_results) -> None:
    results = kfac_results[0][index]
    cfg = _cfg(*CASES[index])
    first, ref_params = _single_process_kfac(cfg, steps=4)
    seen = set()
    for r in results.values():
        for key, factor in r["factors"].items():
            _, _, name, which = key.split("/")
            torch.testing.assert_close(factor, first["factors"][name][which == "B"], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key: f"{k}: {m}")
            seen.add(name)
        for key, grad in r["grads"].items():
            name = key.split("/", 2)[2]
            torch.testing.assert_close(grad, first["grads"][WORD if name == DECODER else name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key: f"{k}: {m}")
        for key, value in r["params"].items():
            name = key.split("/", 2)[2]
            torch.testing.assert_close(value, ref_params[WORD if name == DECODER else name], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, k=key: f"{k}: {m}")
    assert seen == set(first["factors"]), "every encoder Linear layer has factors on some stage"


@pytest.mark.slow
@pytest.mark.parametrize("promote", PROMOTE)
def test_pipefisher_equals_kfac_with_the_same_interval_and_staleness(promote: str, kfac_results) -> None:
    results, intervals = kfac_results
    first = len(CASES) + 2 * PROMOTE.index(promote)
    pipefisher, kfac = results[first], results[first + 1]
    assert intervals[promote] >= 1
    for rank in pipefisher:
        for key, value in pipefisher[rank]["params"].items():
            torch.testing.assert_close(value, kfac[rank]["params"][key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, kk=key: f"{kk}: {m}")
    before = [sum(v) for v in pipefisher[0]["losses"]]
    assert before == pytest.approx([sum(v) for v in kfac[0]["losses"]], rel=1e-5)
