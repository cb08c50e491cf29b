"""The planner prices ``optimizer.kfac_owners=replicas`` as the runtime runs it (``planning.owner_costs``
[Note: pricing owners]): the same owner per layer as ``runtime.kfac_owners``, an INVERT only on its owner, a
PRECOND of the replica's own layers, and the owners' exchange before STEP."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.model import BertConfig, build_full_model
from pipefisher.optim import KFACPreconditioner
from pipefisher.optim.owners import plan_owners
from pipefisher.planning.assign import work_and_bubbles
from pipefisher.planning.costs import Hardware, RunShape, kfac_linear_dims
from pipefisher.planning.owner_costs import with_owners
from pipefisher.planning.pipefisher_plan import PlanOptions, plan_for
from pipefisher.planning.strategy_search import pipeline_costs
from pipefisher.schedules import ActionKind as K
from pipefisher.schedules.kfac import check_assignment, critical_path_assignment
from pipefisher.simulate import CostModel, simulate_phases

BERT = BertConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=2, intermediate_size=256,
                  max_position_embeddings=64)
HW = Hardware(flops_per_s=3e10, p2p_bytes_per_s=2e9, memory_bytes_per_s=1e10)


def _chimera() -> tuple[RunShape, object, CostModel]:
    run = RunShape(BERT, "chimera", 2, 4, 4, seq_len=64, max_predictions=10)
    schedule = run.build_schedule()
    return run, schedule, pipeline_costs(run, HW, schedule=schedule)


def test_the_planner_gives_each_layer_the_owner_the_runtime_gives_it() -> None:
    """The layer order and [O, I] shapes the planner derives from the config are the preconditioner's own, so
    ``plan_owners`` over them names the runtime's owners."""
    model = build_full_model(BERT)
    pre = KFACPreconditioner(model)
    shapes = [tuple(pre.layer(n).module.weight.shape) for n in pre.layer_names]
    assert shapes == [(o, i) for i, o in kfac_linear_dims(BERT, BERT.num_layers)]
    run, schedule, cost = _chimera()
    owned = with_owners(cost, schedule, run)
    first = 0
    for stage, n in enumerate(run.encoder_layers):
        per_stage, first = shapes[first:first + 6 * n], first + 6 * n
        assert list(owned.kfac_owner[stage]) == plan_owners(per_stage, 2)
        assert sorted(set(owned.kfac_owner[stage])) == [0, 1]  # Chimera's twins share the work
    assert all(x > 0 for x in owned.exchange_ns)


def test_simulated_owner_step_inverts_each_layer_once_and_waits_for_the_exchange() -> None:
    run, schedule, cost = _chimera()
    cp = critical_path_assignment(schedule, run.kfac_layers, 1)
    owned = with_owners(cost, schedule, run)
    for exchange_scale in (1, 1000):
        priced = replace(owned, exchange_ns=tuple(x * exchange_scale for x in owned.exchange_ns))
        events = simulate_phases(cp.phases, priced)
        holder = simulate_phases(cp.phases, cost)
        inverts = {}
        for e in events:
            if e.kind == K.INVERT.value:
                inverts[e.worker] = inverts.get(e.worker, 0) + e.end_ns - e.start_ns
        # every layer's INVERT once over the twins, where holder does it on both
        assert sum(inverts.values()) == sum(cost.kfac_ns(K.INVERT, s) for s in range(schedule.num_stages))
        assert sum(e.end_ns - e.start_ns for e in holder if e.kind == K.INVERT.value) == 2 * sum(inverts.values())
        precond = [e for e in events if e.kind == K.PRECOND.value]
        assert sum(e.end_ns - e.start_ns for e in precond) == pytest.approx(
            sum(cost.precond_ns), abs=len(precond))  # each layer preconditioned once (rounded per layer)
        last_precond = max(e.end_ns for e in precond)
        steps = [e for e in events if e.kind == K.STEP.value]
        assert min(e.start_ns for e in steps) >= last_precond + min(priced.exchange_ns)
        step_ns = max(e.end_ns for e in events)
        holder_ns = max(e.end_ns for e in holder)
        if exchange_scale == 1:
            assert step_ns < holder_ns  # half the INVERTs off each worker, the exchange cheap
        else:
            assert step_ns > holder_ns  # an exchange 1000x dearer costs more than it saves


def test_the_planner_counts_each_owner_layers_inversion_once() -> None:
    run, schedule, cost = _chimera()
    holder = work_and_bubbles(schedule, cost, run.kfac_layers)
    owners = work_and_bubbles(schedule, with_owners(cost, schedule, run), run.kfac_layers)
    once = sum(cost.kfac_ns(K.INVERT, s) for s in range(schedule.num_stages))
    assert owners["kfac_work_ns"] == holder["kfac_work_ns"] - once


def test_plan_for_prices_owners_from_the_run_and_refuses_without_it() -> None:
    run, schedule, cost = _chimera()
    options = PlanOptions(kfac_owners="replicas")
    with pytest.raises(ValueError, match="kfac_owners=replicas .* give the run's shape"):
        plan_for(schedule, cost, run.kfac_layers, options)
    plan = plan_for(schedule, cost, run.kfac_layers, options, run)
    check_assignment(plan.assignment)
    assert plan.options.kfac_owners == "replicas"
    with pytest.raises(ValueError, match="kfac_owners='all'"):
        PlanOptions(kfac_owners="all")


def test_a_non_owner_inverts_without_waiting_for_the_layers_factor_all_reduce() -> None:
    """[Note: a non-owner does not wait] (``runtime.kfac_work``), simulated: with factor all-reduces 1000x their
    price, each replica's INVERT of a layer it owns starts after that layer's all-reduce ends, and its no-op INVERT
    of a layer it does not own waits for nothing (the ones before its first own layer start before their
    all-reduces end)."""
    from pipefisher.schedules import Action
    from pipefisher.simulate import owner_members

    run, schedule, cost = _chimera()
    cp = critical_path_assignment(schedule, run.kfac_layers, 1)
    owned = with_owners(cost, schedule, run)
    slow_sync = tuple(tuple(x * 1000 for x in t) for t in owned.sync_factor_ns)
    events = simulate_phases(cp.phases, replace(owned, sync_factor_ns=slow_sync))
    member = owner_members(schedule.placement, owned)
    sync_end, inverts = {}, []
    for e in events:
        if e.kind not in (K.INVERT.value, K.SYNC_FACTOR.value):
            continue
        a = Action.from_str(e.name)
        if a.kind == K.SYNC_FACTOR:
            sync_end[(e.worker, a.stage, a.pipe, a.layer)] = e.end_ns
        else:
            inverts.append((e.worker, a.stage, a.pipe, a.layer, e.start_ns))
    assert len(inverts) == sum(run.kfac_layers) * 2  # both twins run every INVERT unit
    early = {w: 0 for w in schedule.actions}  # INVERTs started before their layer's all-reduce ended
    for w, stage, pipe, layer, start in inverts:
        mine = owned.kfac_owner[stage][layer] == member[(w, stage)]
        assert not mine or start >= sync_end[(w, stage, pipe, layer)]
        early[w] += start < sync_end[(w, stage, pipe, layer)]
    assert sum(early.values()) > 0, early  # the twin owning not the first layer starts without waiting for it


@pytest.mark.slow
@pytest.mark.parametrize("model, extra, d, n, ks", [
    ("bert-tiny", ("model.vocab_size=8192",), 2, 4, (7, 6)), ("bert-tiny", ("model.vocab_size=8192",), 4, 8, (6, 6)),
    ("bert-mini", (), 2, 4, (7, 7)), ("bert-mini", (), 4, 8, (5, 5)),
    ("bert-base", (), 2, 4, (8, 7)), ("bert-base", (), 4, 8, (8, 8))], ids=lambda x: str(x))
def test_train_py_plans_k_for_holder_and_replicas_from_the_built_in_estimate(model, extra, d, n, ks) -> None:
    """docs/optimizer-placement.md's figures: train.py's k for Chimera (micro-batch 8, seq 64) under holder and
    under replicas, planned from the built-in CPU estimate with the owners priced ([Note: pricing owners]; the
    exchange by the ring model at the estimate's bandwidth, as the search prices it)."""
    from pipefisher.runtime.build import kfac_assignment, schedule_for
    from tests.conftest import compose_train

    got = []
    for owners in ("holder", "replicas"):
        cfg = compose_train([f"model={model}", *extra, "data.seq_len=64", "micro_batch_size=8", "pipeline=chimera",
                             f"stages={d}", f"num_micro_batches={n}", "optimizer=pipefisher",
                             f"optimizer.kfac_owners={owners}"], tiny=False)
        got.append(kfac_assignment(cfg, schedule_for(cfg)).interval)
    assert tuple(got) == ks
