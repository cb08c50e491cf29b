"""Utilization and time figures mean what they say (issue 13): a wait for an all-reduce is never
busy time nor a unit's cost, a step's time holds the bookkeeping the workers wait for, and
schedule.py prints its predicted "before" beside the profile's measured utilization."""

from __future__ import annotations

import datetime
import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from pipefisher.config import TrainConfig
from pipefisher.planning.cli import plan_run
from pipefisher.planning.config import register_schedule_configs, to_schedule_config
from pipefisher.planning.costs import costs_from_profile
from pipefisher.planning.predict import predict_schedule
from pipefisher.planning.step_placement import global_step_costs
from pipefisher.profiling import read_profile, write_profile
from pipefisher.runtime import step_metrics
from pipefisher.runtime.executor import WorkerExecutor
from pipefisher.runtime.kfac_work import KfacWork
from pipefisher.runtime.step_metrics import measured_costs as _measured_costs
from pipefisher.runtime.teardown import release_process_group
from pipefisher.runtime.worker import PipelineWorker, train_worker
from pipefisher.schedules import build_schedule
from pipefisher.schedules.kfac import critical_path_assignment
from pipefisher.schedules.passes import per_stage_steps
from pipefisher.simulate import CostModel, simulate
from pipefisher.timeline import COMPUTE_KINDS, Event, busy_ns, is_wait
from pipefisher.tracking import read_metrics
from tests.conftest import CONF_DIR, compose_train
from tests.dist_harness import start_workers

DELAY_S = 1.0  # long beside a step's noise under load: a wait counted as compute would add all of it
# Steps of the K-FAC run at which worker 1's wait for an all-reduce is delayed (steps 0–2 warm up;
# the others measure worker 1's undelayed busy time).
DELAYED = {4: "precond", 6: "invert"}
KFAC_STEPS = 8
BOOKKEEPING_S = 0.2  # extra time rank 0's per-step simulation takes in the step-time run
MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01",
         "optimizer.damping=0.01", "pipeline=chimera", "stages=2", "num_micro_batches=4"]


# -- the spawned workers ------------------------------------------------------------------------

_now: dict[str, int] = {"step": -1}


def _delay_waits(rank: int) -> None:
    """On worker 1, make one all-reduce wait DELAY_S slower at the DELAYED steps."""
    finish_grad_sync, wait_for_syncs = WorkerExecutor._finish_grad_sync, KfacWork.wait_for_syncs

    def slow_grad_sync(self, syncs, key=None):
        if rank == 1 and key is not None and key in syncs and DELAYED.get(_now["step"]) == "precond":
            _now["step"] = -1  # once
            time.sleep(DELAY_S)
        return finish_grad_sync(self, syncs, key)

    def slow_factor_sync(self, a):
        if rank == 1 and self._pending_syncs(a) and DELAYED.get(_now["step"]) == "invert":
            _now["step"] = -1
            time.sleep(DELAY_S)
        return wait_for_syncs(self, a)

    WorkerExecutor._finish_grad_sync = slow_grad_sync
    KfacWork.wait_for_syncs = slow_factor_sync


def _kfac_run(rank: int, cfg: TrainConfig, out: Path) -> None:
    worker = PipelineWorker(cfg, rank, cfg.num_workers, torch.device("cpu"))
    steps = []
    for step in range(KFAC_STEPS):
        _now["step"] = step
        _, result = worker.train_step(step)
        steps.append([asdict(e) for e in result.events])
    (out / f"kfac_rank{rank}.json").write_text(json.dumps(steps))


def _timed_run(rank: int, cfg: TrainConfig, out: Path) -> None:
    """train_worker, with a slow simulation on rank 0 and the start of every step recorded."""
    starts: list[float] = []
    train_step, simulate_step = PipelineWorker.train_step, step_metrics.simulate

    def timed_train_step(self, step):
        starts.append(time.perf_counter())
        return train_step(self, step)

    def slow_simulate(*args, **kwargs):
        time.sleep(BOOKKEEPING_S)
        return simulate_step(*args, **kwargs)

    PipelineWorker.train_step = timed_train_step
    step_metrics.simulate = slow_simulate
    train_worker(cfg, rank, cfg.num_workers, torch.device("cpu"), out / "run")
    (out / f"starts_rank{rank}.json").write_text(json.dumps(starts))


def _worker(rank: int, kfac_cfg: TrainConfig, timed_cfg: TrainConfig, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    for i, run in enumerate((lambda: _kfac_run(rank, kfac_cfg, out), lambda: _timed_run(rank, timed_cfg, out))):
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg{i}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        try:
            if i == 0:
                _delay_waits(rank)
            run()
        finally:
            release_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawn of two workers: a K-FAC chimera D=2 run with delayed waits, then train_worker."""
    out = tmp_path_factory.mktemp("honest")
    kfac_cfg = compose_train(MODEL + ["optimizer=kfac", f"steps={KFAC_STEPS}"])
    timed_cfg = compose_train(MODEL + ["steps=5", "log_every=2"])
    start_workers(_worker, (kfac_cfg, timed_cfg, str(out)), 2)
    return out


def _kfac_events(out: Path) -> list[list[Event]]:
    """Per step, the events of both workers."""
    per_rank = [json.loads((out / f"kfac_rank{r}.json").read_text()) for r in range(2)]
    return [[Event(**e) for rank in per_rank for e in rank[step]] for step in range(KFAC_STEPS)]


# -- waits are not compute ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_delayed_all_reduce_leaves_busy_time_unchanged_and_its_wait_absorbs_it(runs: Path):
    """The check of "waits are not compute" (DESIGN.md, Bubble utilization): worker 1 waits DELAY_S
    longer for one all-reduce (its gradient all-reduce before a PRECOND at one step, a factor
    all-reduce before an INVERT at another); its busy time (its part of the numerator of
    bubble_utilization) must not grow by it, and its wait event of that kind must hold it."""
    steps = _kfac_events(runs)
    busy = [busy_ns(events)[1] / 1e9 for events in steps]
    baseline = statistics.median(busy[s] for s in range(3, KFAC_STEPS) if s not in DELAYED)
    for step, unit in DELAYED.items():
        assert busy[step] - baseline < DELAY_S / 2, (step, busy)
        kind = "SYNC_GRAD" if unit == "precond" else "SYNC_FACTOR"
        waited = [e for e in steps[step] if e.worker == 1 and is_wait(e) and e.kind == kind
                  and unit.upper() in e.name]
        assert max(e.duration_ns for e in waited) / 1e9 >= DELAY_S, (step, waited)


@pytest.mark.slow
def test_precond_and_invert_events_never_contain_a_wait(runs: Path):
    for events in _kfac_events(runs):
        for w in (0, 1):
            mine = [e for e in events if e.worker == w]  # in the order the worker recorded them
            units = [(i, e) for i, e in enumerate(mine) if e.kind in ("PRECOND", "INVERT")]
            assert {e.kind for _, e in units} == {"PRECOND", "INVERT"}
            for i, e in units:  # in chimera every stage has a twin: each unit had an all-reduce to wait for
                wait = mine[i - 1]
                assert wait.name == e.name and is_wait(wait) and wait.kind not in COMPUTE_KINDS, (wait, e)
                assert wait.kind == ("SYNC_GRAD" if e.kind == "PRECOND" else "SYNC_FACTOR")
                assert wait.end_ns <= e.start_ns
            step = next(e for e in mine if e.kind == "STEP")
            assert any(is_wait(e) and e.name == "STEP" and e.end_ns <= step.start_ns for e in mine)


def test_cost_readers_charge_no_unit_for_its_wait(tmp_path: Path, make_cfg):
    base = build_schedule("chimera", 2, 4)
    phase = critical_path_assignment(base, [2, 2], 1).phases[0]
    cost = CostModel(forward_ns=[1000, 1200], backward_ns=[2000, 2500], p2p_ns=70, step_ns=50,
                     curv_a_ns=[[300, 310], [320, 330]], curv_b_ns=[[400, 410], [420, 430]],
                     sync_factor_ns=[[50, 60], [70, 80]], invert_ns=[[900, 910], [920, 930]],
                     precond_ns=[150, 160])
    events = simulate(phase, cost)
    waits = [Event(e.worker, e.name, {"PRECOND": "SYNC_GRAD", "INVERT": "SYNC_FACTOR", "STEP": "SYNC_GRAD"}[e.kind],
                   e.start_ns - 10_000, e.start_ns) for e in events if e.kind in ("PRECOND", "INVERT", "STEP")]
    assert all(is_wait(e) for e in waits)
    assert _measured_costs(events + waits, base, [2, 2]) == _measured_costs(events, base, [2, 2])
    cfg = make_cfg("pipeline=chimera", "stages=2", "num_micro_batches=4")
    plain, waited = tmp_path / "plain.sqlite", tmp_path / "waited.sqlite"
    meta = {"config": asdict(cfg), "method": "chimera", "num_stages": 2, "num_micro_batches": 4}
    write_profile(plain, events, metadata=meta)
    write_profile(waited, events + waits, metadata=meta)
    assert costs_from_profile(read_profile(waited)) == costs_from_profile(read_profile(plain))


# -- step time ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_step_time_includes_the_bookkeeping_the_workers_wait_for(runs: Path):
    """Rank 0's per-step simulation is made BOOKKEEPING_S slower; the steps' times must still add
    up to the time from the first step's start to the last one's (measured apart from the
    metrics), and the bookkeeping is reported on its own."""
    rows = read_metrics(runs / "run" / "metrics.jsonl")
    starts = json.loads((runs / "starts_rank0.json").read_text())
    assert [r["step"] for r in rows] == list(range(5)) and len(starts) == 5
    assert sum(r["step_time_s"] for r in rows[:-1]) >= 0.9 * (starts[-1] - starts[0])
    # log_every=2: the simulated figure (and its cost) only on logged steps and the last one.
    assert [("simulated_bubble_utilization" in r) for r in rows] == [True, False, True, False, True]
    for r in rows:
        assert 0 <= r["bookkeeping_s"] <= r["step_time_s"]
        assert r["samples_per_s"] == pytest.approx(4 * 2 / r["step_time_s"])
        if "simulated_bubble_utilization" in r:
            assert r["bookkeeping_s"] >= BOOKKEEPING_S


# -- schedule.py: predicted "before" beside the measured figure -----------------------------------

def _plan(tmp_path: Path, events: list[Event], cfg: TrainConfig, name: str):
    path = tmp_path / f"{name}.sqlite"
    write_profile(path, events, metadata={"config": asdict(cfg), "method": "chimera", "num_stages": 2,
                                          "num_micro_batches": 4, "device": "cpu", "oversubscribed": False})
    register_schedule_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        scfg = to_schedule_config(compose(config_name="schedule", overrides=[f"from={path}", "plot=false"]))
    return plan_run(scfg, tmp_path / name, requested={"from", "plot"})


def test_schedule_py_prices_the_stage_steps_of_a_per_stage_profile(tmp_path: Path, make_cfg):
    """A profile of ``optimizer_placement=per_stage`` has stage STEPs; the plan is made on the global step's
    schedule, which has none: their work goes into each worker's STEP, not away (it did, before)."""
    cfg = make_cfg("pipeline=chimera", "stages=2", "num_micro_batches=4", "optimizer_placement=per_stage")
    base = build_schedule("chimera", 2, 4)
    cost = replace(CostModel.uniform(2, 1000, 2000, p2p_ns=70, sync_ns=0, step_ns=50), stage_step_ns=(300, 400))
    plan = _plan(tmp_path, simulate(per_stage_steps(base), cost, steps=2), cfg, "per_stage")
    # measured against predicted: the schedule the run ran, so busy time agrees, stage STEPs included
    assert plan.predicted.busy_ns == pytest.approx(plan.measured.busy_ns, rel=1e-3)
    # the plan: each Chimera worker holds both stages, so its STEP is its final STEP and both stage STEPs
    folded = global_step_costs(cost, base)
    assert folded.worker_step_ns == (750, 750) and not any(folded.stage_step_ns)
    assert plan.comparison.nvlamb.step_time_s == pytest.approx(predict_schedule(base, folded)[0].step_time_s)
    assert plan.comparison.nvlamb.step_time_s > predict_schedule(base, replace(cost, stage_step_ns=()))[0].step_time_s
    assert "stepped each stage apart" in plan.summary


def test_schedule_py_reports_the_measured_utilization_beside_the_predicted_before(tmp_path: Path, make_cfg):
    cfg = make_cfg("pipeline=chimera", "stages=2", "num_micro_batches=4")
    cost = CostModel.uniform(2, 1000, 2000, p2p_ns=70, sync_ns=0, step_ns=50)
    events = simulate(build_schedule("chimera", 2, 4), cost, steps=2)
    same = _plan(tmp_path, events, cfg, "same")
    # A profile that is a simulation of its own costs measures what is predicted, under one definition.
    assert same.predicted.utilization == pytest.approx(same.comparison.nvlamb.utilization)
    assert same.measured.utilization == pytest.approx(same.predicted.utilization, abs=0.02)
    assert f"{same.comparison.nvlamb.utilization:.1%} before" in same.summary
    assert f"measured in the profile: {same.measured.utilization:.1%} over 2 step(s)" in same.summary
    assert "the gap is mostly" not in same.summary

    # Each worker then waits 5 µs for its all-reduces before each STEP: the costs (and so the
    # prediction) do not change, the measurement drops, and the summary says where it went.
    late = []
    for e in events:
        if e.kind == "STEP":
            late.append(Event(e.worker, "STEP", "SYNC_GRAD", e.start_ns, e.start_ns + 5000, e.step))
            e = replace(e, start_ns=e.start_ns + 5000, end_ns=e.end_ns + 5000)
        late.append(e)
    waited = _plan(tmp_path, late, cfg, "waited")
    assert waited.predicted == same.predicted
    assert waited.measured.utilization < same.measured.utilization - 0.05
    assert waited.measured.allreduce_ns >= same.measured.allreduce_ns + 5000
    assert "the gap is mostly all-reduces" in waited.summary
