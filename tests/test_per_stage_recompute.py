"""Per-stage recompute (issue 27): ``recompute_stages`` picks the model stages that recompute their
encoder layers' activations in the backward; the cost and memory models, the search and the strategy
file follow it stage by stage.

The distributed case runs a pipeline where only some stages recompute against single-process training
(``tests.dist_harness``, as ``test_pipeline_equivalence``): the same first-step loss and gradients, and
the same parameters after three NVLAMB steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipefisher.config import ConfigError, DataConfig, ModelConfig, TrainConfig, to_train_config
from pipefisher.model import BertConfig, build_full_model
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import Hardware, RunShape, estimate_run_costs
from pipefisher.planning.memory import estimate_memory_per_worker
from pipefisher.planning.strategy_file import apply_strategy, read_strategy, strategy_document, write_strategy
from pipefisher.planning.strategy_search import (Strategy, hybrid_costs, hybrid_memory_per_worker, recompute_order,
                                                 search_strategies)
from pipefisher.run_spec import bert_config
from pipefisher.runtime.build import build_stage_modules, schedule_for
from tests.conftest import compose_dict, compose_train
from tests.dist_harness import run_cases
from tests.reference import train_single_process
from tests.test_pipeline_equivalence import DECODER, MODEL, WORD, _by_name, assert_first_step_equals_single_process

STEPS = 3
# (id, overrides): some stages recompute, others do not.
CASES = {
    "1f1b-D2-N4-stage0": ["pipeline=1f1b", "stages=2", "num_micro_batches=4", "recompute_stages=[0]"],
    "interleaved-D2-N2-stages1,2": ["pipeline=interleaved", "stages=2", "num_micro_batches=2",
                                    "recompute_stages=[1,2]"],
}


def _cfg(case: str) -> TrainConfig:
    return compose_train([x for x in MODEL if not x.startswith("steps=")] + [f"steps={STEPS}"] + CASES[case])


# -- the config ----------------------------------------------------------------------------------


def test_recompute_stages_builds_recomputing_modules_only_for_those_stages() -> None:
    cfg = _cfg("interleaved-D2-N2-stages1,2")
    schedule = schedule_for(cfg)
    flags = {}
    for rank in range(cfg.stages):
        flags.update({stage: m.recompute for (_, stage), m in build_stage_modules(cfg, schedule, rank).items()})
    assert flags == {0: False, 1: True, 2: True, 3: False}
    assert [cfg.recomputes(s) for s in range(4)] == [False, True, True, False]
    every = compose_train(["pipeline=1f1b", "stages=2", "num_micro_batches=2", "recompute=true"])
    assert [every.recomputes(s) for s in range(2)] == [True, True]


@pytest.mark.parametrize("overrides,needle", [
    (["stages=2", "recompute_stages=[2]"], "0..1"),
    (["stages=2", "recompute_stages=[-1]"], "0..1"),
    (["stages=2", "recompute_stages=[0,0]"], "distinct"),
    (["stages=2", "recompute_stages=[]"], "distinct"),
    (["stages=2", "recompute=true", "recompute_stages=[0]"], "set recompute=false"),
    (["stages=1", "recompute_stages=[0]"], "use recompute=true"),
])
def test_bad_recompute_stages_are_refused_naming_the_field_and_the_fix(overrides, needle) -> None:
    with pytest.raises(ConfigError) as err:
        compose_train(["pipeline=1f1b", "num_micro_batches=2", *overrides])
    message = str(err.value)
    assert message.startswith("recompute_stages=") and needle in message and "\n" not in message


# -- the run equals single-process training --------------------------------------------------------


@pytest.fixture(scope="module")
def partial_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    results = run_cases([(_cfg(c), STEPS) for c in CASES], tmp_path_factory.mktemp("partial-recompute"))
    return dict(zip(CASES, results))


def _reference_params(cfg: TrainConfig) -> tuple[dict[str, torch.Tensor], float]:
    """Single-process training (no recompute) over the same global batch and steps."""
    single = dataclasses.replace(cfg, stages=1, data_parallel=1, recompute=False, recompute_stages=None,
                                 pipeline=dataclasses.replace(cfg.pipeline, method="gpipe", num_virtual=1,
                                                              layers_per_stage=None))
    model = build_full_model(bert_config(single), seed=single.seed)
    last = train_single_process(single, output_dir=None, model=model)
    return {n: p.detach() for n, p in model.named_parameters()}, last["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_partial_recompute_equals_single_process_training(case, partial_results) -> None:
    cfg, results = _cfg(case), partial_results[case]
    assert_first_step_equals_single_process(cfg, results)
    ref_params, ref_last_loss = _reference_params(cfg)
    assert sum(results[0]["losses"][-1]) == pytest.approx(ref_last_loss, rel=1e-5)
    seen = set()
    for name, value in _by_name(results, "params"):
        key = WORD if name == DECODER else name
        torch.testing.assert_close(value, ref_params[key], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        seen.add(key)
    assert seen == set(ref_params)


# -- the cost and memory models, by hand -----------------------------------------------------------

# S=16, b=2, H=32, A=2, fp32; two stages of two encoder layers; 1F1B at D=2, N=4 holds 2 micro-batches
# on worker 0 and 1 on worker 1 at its peak.
TINY_BERT = BertConfig(vocab_size=128, hidden_size=32, num_layers=4, num_heads=2, max_position_embeddings=32)
SBH = 16 * 2 * 32
LAYER = SBH * (34 + 5 * 2 * 16 / 32) * 4 / 2  # one layer's activations, fp32: 79,872 bytes
INPUT = SBH * 4  # one layer's input (and the embeddings' output in stage 0): 4,096 bytes
HEADS = 2 * 3 * TINY_BERT.vocab_size * 4  # b·P·V fp32 MLM log-probabilities (planning.memory.heads_logits_bytes)


def _run(**kwargs) -> RunShape:
    return RunShape(TINY_BERT, "1f1b", 2, 4, 2, seq_len=16, max_predictions=3, layers_per_stage=(2, 2), **kwargs)


def test_run_shape_recompute_flags_from_the_bool_or_the_stages() -> None:
    assert _run().recompute_flags == (False, False)
    assert _run(recompute=True).recompute_flags == (True, True)
    assert _run(recompute_stages=(1,)).recompute_flags == (False, True)
    for bad in ({"recompute_stages": (2,)}, {"recompute": True, "recompute_stages": (0,)}):
        with pytest.raises(ValueError, match="recompute_stages"):
            _run(**bad)


@pytest.mark.parametrize("model", ["planning.memory", "strategy_search"])
def test_activation_memory_shrinks_only_on_recomputing_stages(model) -> None:
    def activations(run: RunShape) -> list[float]:
        est = estimate_memory_per_worker(run, "nvlamb") if model == "planning.memory" else hybrid_memory_per_worker(run)
        return [est[w].activations for w in sorted(est)]

    plain = 2 * (2 * LAYER + INPUT)  # worker 0: 2 in flight x (2 layers + the embeddings' output) = 327,680
    recomputed = 2 * (2 * INPUT + LAYER + INPUT)  # 2 in flight x (2 inputs + one layer + embeddings) = 184,320
    last = 3 * HEADS  # worker 1, the last stage: one micro-batch's log-probabilities + two in its backward
    assert activations(_run()) == [plain, 2 * LAYER + last]
    assert activations(_run(recompute_stages=(0,))) == [recomputed, 2 * LAYER + last] == [184320, 168960]
    assert activations(_run(recompute_stages=(1,))) == [plain, 2 * INPUT + LAYER + last]
    assert activations(_run(recompute=True)) == [recomputed, 2 * INPUT + LAYER + last]


def test_backward_costs_three_forwards_only_on_recomputing_stages() -> None:
    hw, comm = Hardware(flops_per_s=1e9), CommCosts({}, Hardware(flops_per_s=1e9))
    for costs in (lambda run: estimate_run_costs(run, hw), lambda run: hybrid_costs(run, 1, 1, hw, comm)):
        plain, partial, every = costs(_run()), costs(_run(recompute_stages=(1,))), costs(_run(recompute=True))
        f = plain.forward_ns
        assert partial.forward_ns == f == every.forward_ns
        assert [abs(b - m * x) <= 1 for b, m, x in zip(partial.backward_ns, (2, 3), f)] == [True, True]
        assert partial.backward_ns == (plain.backward_ns[0], every.backward_ns[1])


# -- the search ------------------------------------------------------------------------------------

# Interleaved at pp=2 (4 model stages; pp=1 is refused, so every candidate is a pipeline): worker 0 holds
# stages 0 and 2 and the most in-flight micro-batches. Recomputing nothing needs 0.93 GB, stages 0 and 2
# 0.56 (worker 1 then sets the peak: stage 3's heads keep b·P·V log-probabilities), every stage 0.55.
EIGHT = dataclasses.replace(BertConfig.from_size("mini"), num_layers=8)


def _search(memory_gb: float) -> list:
    return search_strategies(EIGHT, devices=2, memory_gb=memory_gb, global_batch=64, methods=["interleaved"],
                             micro_batch_sizes=[16], optimizers=["nvlamb"], sdp_degrees=[1], tp_degrees=[1])


def test_recompute_order_puts_the_stages_of_the_most_loaded_worker_first() -> None:
    run = RunShape(EIGHT, "interleaved", 2, 4, 16, num_virtual=2)
    order = recompute_order(run, run.build_schedule(dp_width=1))
    assert set(order[:2]) == {0, 2} and sorted(order) == [0, 1, 2, 3]


def test_search_picks_partial_recompute_between_the_none_and_all_budgets() -> None:
    found = _search(0.6)
    ranked = [s for s in found if s.excluded is None]
    best = ranked[0]
    assert not best.recompute and best.recompute_stages == (0, 2), best.label
    every = next(s for s in ranked if s.recompute)
    assert best.samples_per_s > every.samples_per_s and best.memory_gb <= 0.6
    none = next(s for s in found if not s.recompute and not s.recompute_stages and s.stages == 2)
    assert none.excluded and "exceeds memory_gb" in none.excluded and none.memory_gb > 0.6
    # With room for everything no partial candidate is tried: none is faster and fits.
    roomy = [s for s in _search(2.0) if s.excluded is None]
    assert not roomy[0].recompute and not any(s.recompute_stages for s in roomy)


# -- the strategy file -----------------------------------------------------------------------------


def test_strategy_file_with_partial_recompute_round_trips_into_the_train_config(tmp_path) -> None:
    s = Strategy("interleaved", 2, 2, 1, 1, 1, 2, 4, False, "nvlamb", samples_per_s=10.0, step_time_s=0.8,
                 utilization=0.9, interval=1, memory_gb=0.2, memory_per_worker_gb=(0.2, 0.15), recompute_stages=(0, 2))
    doc = strategy_document(s, ModelConfig(), DataConfig(seq_len=32, max_predictions=5))
    assert doc["checkpoint"] is False
    assert [st["checkpoint"] for st in doc["per_stage"]] == [True, False, True, False]
    path = write_strategy(tmp_path / "strategy.json", doc)
    assert read_strategy(path)["per_stage"] == doc["per_stage"]
    dcfg = compose_dict([f"strategy={path}"])
    apply_strategy(dcfg, [f"strategy={path}"])
    cfg = to_train_config(dcfg)
    assert (cfg.recompute, cfg.recompute_stages, cfg.stages, cfg.pipeline.method) == (False, [0, 2], 2, "interleaved")
    assert [cfg.recomputes(i) for i in range(4)] == [True, False, True, False]
    every = strategy_document(dataclasses.replace(s, recompute=True, recompute_stages=()), ModelConfig(),
                              DataConfig(seq_len=32, max_predictions=5))
    path = write_strategy(tmp_path / "every.json", every)
    dcfg = compose_dict([f"strategy={path}"])
    apply_strategy(dcfg, [f"strategy={path}"])
    cfg = to_train_config(dcfg)
    assert (cfg.recompute, cfg.recompute_stages) == (True, None)
    with pytest.raises(ConfigError, match="recompute_stages=.*the file has \\[0, 2\\]"):
        other = compose_dict([f"strategy={tmp_path / 'strategy.json'}", "recompute_stages=[1]"])
        apply_strategy(other, [f"strategy={tmp_path / 'strategy.json'}", "recompute_stages=[1]"])
