"""One PipeFisher planning path (issue 37, item 3): the search, whatif and train.py plan PipeFisher with
train.py's ``optimizer=pipefisher`` defaults and the same cost model, and a strategy file carries the plan that
``train.py strategy=<file>`` runs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipefisher.config import ConfigError, to_train_config
from pipefisher.model.config import BertConfig
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.config import register_schedule_configs, to_schedule_config
from pipefisher.planning.costs import RunShape
from pipefisher.planning.owner_costs import with_owners
from pipefisher.planning.pipefisher_plan import PlanOptions, pipefisher_defaults, plan_for
from pipefisher.planning.predict import predict_assignment
from pipefisher.planning.strategy_file import apply_strategy, read_strategy, strategy_document, write_strategy
from pipefisher.planning.strategy_search import pipeline_costs, search_strategies, strategy_plan
from pipefisher.runtime.build import CPU_HARDWARE, kfac_assignment, run_shape, schedule_for
from pipefisher.schedules.kfac import assignment_to_dict, curvature_age_bound
from tests.conftest import CONF_DIR, REPO, compose_dict, compose_train

# bert-mini chimera pp=4, micro-batch 8, N=4 at train.py's CPU estimate: the planner's old defaults (inverses at
# cycle end, no staleness bound) give k=7 and curvature 13 steps old; optimizer=pipefisher's give k=6, age 8.
RING = CommCosts({}, CPU_HARDWARE)  # the search's collective model on the built-in estimate, as train.py plans with it
SHAPE = ["model=bert-mini", "pipeline=chimera", "stages=4", "num_micro_batches=4", "micro_batch_size=8",
         "data.seq_len=128", "data.max_predictions=20", "optimizer=pipefisher"]


def test_plan_options_default_to_what_train_py_composes_for_optimizer_pipefisher():
    composed = PlanOptions.from_optimizer(compose_train(["optimizer=pipefisher"]).optimizer)
    assert PlanOptions() == pipefisher_defaults() == composed
    assert (composed.promote_inverses, composed.max_staleness) == ("when_ready", 8)
    assert PlanOptions().overrides()["optimizer.promote_inverses"] == "when_ready"
    with pytest.raises(ValueError, match="promote_inverses='soon'"):
        PlanOptions(promote_inverses="soon")
    with pytest.raises(ValueError, match=r"unknown planner option\(s\) \['k'\]"):
        PlanOptions.from_dict({"k": 3})


def test_search_and_train_py_plan_pipefisher_identically():
    """The search's PipeFisher candidate (k, curvature age) and its plan equal what train.py runs for the same
    shape on the same (CPU) estimate; the planner's old defaults would not."""
    cfg = compose_train(SHAPE, tiny=False)
    schedule = schedule_for(cfg)
    trained = kfac_assignment(cfg, schedule)
    found = search_strategies(BertConfig.from_size("mini"), devices=4, memory_gb=100, global_batch=32,
                              hardware=CPU_HARDWARE, methods=["chimera"], micro_batch_sizes=[8],
                              optimizers=["pipefisher"], recompute=[False], sdp_degrees=[1], tp_degrees=[1])
    best = next(c for c in found if c.excluded is None and c.stages == 4)
    assert (best.interval, best.curvature_age) == (trained.interval, curvature_age_bound(trained, "when_ready"))
    assert (best.interval, best.curvature_age) == (6, 8)
    plan = strategy_plan(best, BertConfig.from_size("mini"), hardware=CPU_HARDWARE, dp_width=None)
    assert assignment_to_dict(plan.assignment) == assignment_to_dict(trained)
    assert plan.ages == (8, 7, 7, 8) and plan.age_bound == max(plan.ages) == 8
    # What the search ran before issue 37: the planner's own defaults, another k and twice the staleness.
    run = RunShape(BertConfig.from_size("mini"), "chimera", 4, 4, 8)
    cost = pipeline_costs(run, CPU_HARDWARE, schedule=schedule)
    old = plan_for(schedule, cost, run.kfac_layers, PlanOptions(max_staleness=None, promote_inverses="at_cycle_end"))
    assert (old.k, old.age_bound) == (7, 13)


def _schedule_cfg(overrides: list[str]):
    register_schedule_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_schedule_config(compose(config_name="schedule", overrides=overrides))


@pytest.fixture(scope="module")
def pipefisher_strategy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A strategy file of the search whose best is PipeFisher (bert-tiny chimera, 2 devices)."""
    from pipefisher.planning.cli import run_whatif

    out = tmp_path_factory.mktemp("plan")
    cfg = _schedule_cfg(["whatif=true", "model=bert-tiny", "devices=2", "global_batch=8", "memory_gb=4",
                         "search.methods=[chimera]", "search.micro_batch_sizes=[2]", "search.recompute=[false]",
                         "search.optimizers=[pipefisher]", "search.sdp=[1]", "search.tp=[1]", "data.seq_len=32",
                         "data.max_predictions=5", "flops_per_s=3e10", "p2p_bytes_per_s=2e9",
                         "memory_bytes_per_s=1e10"])
    run_whatif(cfg, out)
    return out / "strategy.json"


def test_strategy_file_round_trips_optimizer_and_plan(pipefisher_strategy: Path, caplog):
    doc = read_strategy(pipefisher_strategy)
    block = doc["pipefisher"]
    assert doc["optimizer"] == "pipefisher"
    assert PlanOptions.from_dict(block["options"]) == pipefisher_defaults()
    dcfg = compose_dict([f"strategy={pipefisher_strategy}"])
    with caplog.at_level(logging.INFO, logger="pipefisher.planning.strategy_file"):
        apply_strategy(dcfg, [f"strategy={pipefisher_strategy}"])
    assert f"PipeFisher runs the searched plan, k={block['k']}" in caplog.text
    cfg = to_train_config(dcfg)
    assert (cfg.optimizer.name, cfg.optimizer.promote_inverses, cfg.optimizer.max_staleness) == \
        ("pipefisher", "when_ready", 8)
    assert cfg.optimizer.schedule == str(pipefisher_strategy)
    ran = kfac_assignment(cfg, schedule_for(cfg))
    assert assignment_to_dict(ran) == block["assignment"]
    assert (ran.interval, curvature_age_bound(ran, "when_ready")) == (block["k"], block["curvature_age_bound"])
    # optimizer=pipefisher on the command line agrees with the file (same defaults): no conflict.
    again = compose_dict([f"strategy={pipefisher_strategy}", "optimizer=pipefisher"])
    apply_strategy(again, [f"strategy={pipefisher_strategy}", "optimizer=pipefisher"])
    other = compose_dict([f"strategy={pipefisher_strategy}", "optimizer.max_staleness=3"])
    with pytest.raises(ConfigError, match=r"optimizer.max_staleness=3 \(the file has 8\)"):
        apply_strategy(other, [f"strategy={pipefisher_strategy}", "optimizer.max_staleness=3"])


@pytest.mark.parametrize("change,message", [
    (lambda d: d["pipefisher"].update(k=d["pipefisher"]["k"] + 1), "field pipefisher.k is"),
    (lambda d: d["pipefisher"].update(curvature_age_bound=99), "field pipefisher.curvature_age_bound is 99"),
    (lambda d: d["pipefisher"]["options"].update(promote_inverses="soon"), "field pipefisher.options"),
    (lambda d: d["pipefisher"].update(assignment={"format": "x"}), "field pipefisher.assignment is not a plan"),
    (lambda d: d.pop("pipefisher"), "field pipefisher is missing"),
    (lambda d: d.update(optimizer="nvlamb"), "field pipefisher is set, but optimizer is 'nvlamb'"),
    (lambda d: d.update(chunks=8, global_bsz=16), r"field pipefisher.assignment is planned for"),
])
def test_bad_pipefisher_blocks_are_refused_naming_the_field(pipefisher_strategy: Path, tmp_path: Path, change,
                                                            message):
    doc = json.loads(pipefisher_strategy.read_text())
    change(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=f"strategy={path}: {message}"):
        read_strategy(path)


@pytest.mark.slow
def test_train_py_runs_the_strategy_files_plan_and_logs_it(pipefisher_strategy: Path, tmp_path: Path):
    doc = read_strategy(pipefisher_strategy)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", f"strategy={pipefisher_strategy}", "steps=2", "progress=false",
                           "save_final=false", f"hydra.run.dir={run}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"PipeFisher runs the searched plan, k={doc['pipefisher']['k']}" in out
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {m["refresh_interval"] for m in metrics} == {doc["pipefisher"]["k"]}
    assert {m["kfac_plan"] for m in metrics} == {"pipefisher"}


def test_the_search_ranks_kfac_owners_beside_holder_and_a_strategy_file_carries_it(tmp_path: Path):
    """``search.kfac_owners=[holder, replicas]``: on Chimera (twins in the simulated pipeline) a second PipeFisher
    candidate priced with owners ([Note: pricing owners]), whose step is its own plan's under the owner-priced
    costs; 1F1B (one replica per stage) ranks holder only; the strategy file of the owners candidate makes train.py
    run ``optimizer.kfac_owners=replicas`` and the plan the search made (train.py's own planning of that config)."""
    bert = BertConfig.from_size("mini")
    found = search_strategies(bert, devices=4, memory_gb=100, global_batch=32, hardware=CPU_HARDWARE,
                              methods=["chimera", "1f1b"], micro_batch_sizes=[8], optimizers=["pipefisher"],
                              recompute=[False], sdp_degrees=[1], tp_degrees=[1], kfac_owners=["holder", "replicas"])
    ranked = [c for c in found if c.excluded is None and c.stages == 4]
    by = {(c.method, c.kfac_owners): c for c in ranked}
    assert set(by) == {("chimera", "holder"), ("chimera", "replicas"), ("1f1b", "holder")}
    holder, owners = by[("chimera", "holder")], by[("chimera", "replicas")]
    assert "owners=replicas" in owners.label and "owners" not in holder.label
    run = RunShape(bert, "chimera", 4, 4, 8)
    schedule = run.build_schedule(dp_width=1)
    cost = pipeline_costs(run, CPU_HARDWARE, schedule=schedule)
    for c in (holder, owners):  # each candidate's step is its plan under its pricing
        plan = plan_for(schedule, cost, run.kfac_layers, PlanOptions(kfac_owners=c.kfac_owners), run, RING)
        priced = with_owners(cost, schedule, run, RING) if c.kfac_owners == "replicas" else cost
        assert c.step_time_s == pytest.approx(predict_assignment(plan.assignment, priced)[0].step_time_s, rel=0.05)
        assert c.interval == plan.k
    assert owners.step_time_s != holder.step_time_s
    plan = strategy_plan(owners, bert, hardware=CPU_HARDWARE, dp_width=None)
    assert plan.options.kfac_owners == "replicas" and plan.describe().endswith(", kfac_owners=replicas")
    shape = compose_train(SHAPE, tiny=False)
    doc = strategy_document(owners, shape.model, shape.data, plan=plan)
    path = write_strategy(tmp_path / "strategy.json", doc)
    dcfg = compose_dict([f"strategy={path}"])
    apply_strategy(dcfg, [f"strategy={path}"])
    cfg = to_train_config(dcfg)
    assert cfg.optimizer.kfac_owners == "replicas"
    ran = kfac_assignment(cfg, schedule_for(cfg))
    assert assignment_to_dict(ran) == read_strategy(path)["pipefisher"]["assignment"]
    assert assignment_to_dict(plan_for(schedule_for(cfg), pipeline_costs(run_shape(cfg), CPU_HARDWARE,
                                                                         schedule=schedule_for(cfg)),
                                       run.kfac_layers, PlanOptions(kfac_owners="replicas"),
                                       run_shape(cfg), RING).assignment) == assignment_to_dict(ran)
    with pytest.raises(ValueError, match=r"search.kfac_owners=\['all'\]: choose from holder, replicas"):
        search_strategies(bert, devices=4, memory_gb=100, global_batch=32, kfac_owners=["all"])


def test_the_search_plans_kfac_owners_over_every_data_parallel_copy_as_train_py_does():
    """At dp=2 a stage's replicas are every copy's workers ([Note: owners across data-parallel copies]): the search
    ranks ``replicas`` on 1F1B too (one worker per stage and copy), plans and prices it on the schedule of every
    copy (Chimera: four members, not its twins alone), and that plan is the one train.py runs for the config."""
    bert = BertConfig.from_size("mini")
    found = search_strategies(bert, devices=4, memory_gb=100, global_batch=64, hardware=CPU_HARDWARE,
                              methods=["chimera", "1f1b"], micro_batch_sizes=[8], optimizers=["pipefisher"],
                              recompute=[False], sdp_degrees=[1], tp_degrees=[1], kfac_owners=["holder", "replicas"])
    by = {(c.method, c.kfac_owners): c for c in found if c.excluded is None and (c.stages, c.dp) == (2, 2)}
    assert set(by) == {(m, o) for m in ("chimera", "1f1b") for o in ("holder", "replicas")}
    for method in ("chimera", "1f1b"):
        run = RunShape(bert, method, 2, 4, 8, dp_width=2)
        one, every = run.build_schedule(dp_width=1), run.build_schedule(dp_width=None)
        cost = pipeline_costs(run, CPU_HARDWARE, schedule=one)
        owners = by[(method, "replicas")]
        plan = plan_for(every, cost, run.kfac_layers, PlanOptions(kfac_owners="replicas"), run, RING)
        step = predict_assignment(plan.assignment, with_owners(cost, every, run, RING))[0].step_time_s
        assert owners.interval == plan.k and owners.step_time_s == pytest.approx(step, rel=0.05)
        assert owners.step_time_s < by[(method, "holder")].step_time_s
        held = [plan_for(x, cost, run.kfac_layers, PlanOptions(), run) for x in (one, every)]  # holder: one copy
        assert held[0].k == held[1].k and predict_assignment(held[0].assignment, cost)[0].step_time_s == \
            pytest.approx(predict_assignment(held[1].assignment, cost)[0].step_time_s, rel=1e-9)
        if method == "chimera":  # priced on one copy, the twins alone would share each layer
            twins = plan_for(one, cost, run.kfac_layers, PlanOptions(kfac_owners="replicas"), run, RING)
            alone = predict_assignment(twins.assignment, with_owners(cost, one, run, RING))[0].step_time_s
            assert step < alone * 0.99
        written = strategy_plan(owners, bert, hardware=CPU_HARDWARE)  # dp_width=1 asked: owners plan every copy
        assert assignment_to_dict(written.assignment) == assignment_to_dict(plan.assignment)
        cfg = compose_train([*SHAPE, f"pipeline={method}", "stages=2", "data_parallel=2",
                             "optimizer.kfac_owners=replicas"], tiny=False)
        assert assignment_to_dict(kfac_assignment(cfg, schedule_for(cfg))) == assignment_to_dict(plan.assignment)
