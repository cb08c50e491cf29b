"""One tied word-embedding / decoder Parameter per worker ([Note: one tied weight per worker] in
``runtime.build``): a worker holding the first and the last stage (V schedules, Chimera) ties its
copies; workers holding one end, and sharded or tensor-parallel runs, keep a copy per stage. That
the tied run trains as one process does is tested with every method in ``test_pipeline_equivalence``."""

from __future__ import annotations

import pytest

from pipefisher.model.bert import DECODER_WEIGHT_NAME, WORD_EMBEDDINGS_NAME
from pipefisher.runtime.build import build_stage_modules, schedule_for, tied_params
from tests.conftest import compose_train

TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=64", "data.seq_len=8",
        "data.max_predictions=2", "num_micro_batches=4"]


def _modules(method: str, worker: int, *extra: str):
    cfg = compose_train(TINY + [f"pipeline={method}", "stages=2", *extra])
    schedule = schedule_for(cfg)
    return build_stage_modules(cfg, schedule, worker), schedule.num_stages


@pytest.mark.parametrize("method", ["zb-v", "dualpipev", "v-half", "chimera"])
def test_a_worker_holding_both_ends_holds_one_tied_parameter(method: str) -> None:
    modules, d = _modules(method, 0)
    first = next(m for (_, s), m in modules.items() if s == 0)
    last = next(m for (_, s), m in modules.items() if s == d - 1)
    assert first is not last
    assert last.get_parameter(DECODER_WEIGHT_NAME) is first.get_parameter(WORD_EMBEDDINGS_NAME)
    assert len(tied_params(modules, d)) == 1


@pytest.mark.parametrize("method, worker", [("1f1b", 0), ("1f1b", 1), ("zb-h1", 1)])
def test_a_worker_holding_one_end_keeps_its_copy(method: str, worker: int) -> None:
    modules, d = _modules(method, worker)
    assert len(tied_params(modules, d)) == 1
    assert len({id(p) for m in modules.values() for p in m.parameters()}) == \
        sum(1 for m in modules.values() for _ in m.parameters())


def test_sharded_runs_keep_a_copy_per_stage() -> None:
    modules, d = _modules("zb-v", 0, "sdp=2")
    assert len(tied_params(modules, d)) == 2
