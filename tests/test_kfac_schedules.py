"""K-FAC work in the schedule IR: assignments, their checks, JSON, and the simulator's K-FAC rules."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipefisher.schedules import (
    Action,
    ActionKind,
    Assignment,
    Placement,
    Schedule,
    ScheduleError,
    assignment_from_json,
    assignment_to_json,
    build_schedule,
    check_assignment,
    check_schedule,
    critical_path_assignment,
    kfac_layer_counts,
    strip_kfac,
)
from pipefisher.schedules.checks import stuck_positions
from pipefisher.schedules.kfac import assignment_from_dict, assignment_to_dict, curvature_age_bound, with_preconditioning
from pipefisher.simulate import CostModel, simulate, simulate_phases
from tests.conftest import PIPELINE_GRID, PIPELINE_GRID_IDS

K = ActionKind


def _acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.from_str(t) for t in text.split())


def _edit(a: Assignment, phase: int, worker: int, fn) -> Assignment:
    """A copy of ``a`` with one worker's list of one phase rewritten by ``fn(list) -> list``."""
    ph = a.phases[phase]
    actions = dict(ph.actions)
    actions[worker] = tuple(fn(list(actions[worker])))
    phases = list(a.phases)
    phases[phase] = replace(ph, actions=actions)
    return replace(a, phases=tuple(phases))


def _small(interval: int = 1, deferred: bool = False) -> Assignment:
    return critical_path_assignment(build_schedule("1f1b", 2, 2), [2, 2], interval, deferred=deferred)


# -- layer counts, critical path ---------------------------------------------------------------


def test_kfac_layer_counts_are_six_linear_layers_per_encoder_layer():
    s = build_schedule("interleaved", 2, 4, num_virtual=2)
    assert kfac_layer_counts(s, [1, 2, 1, 2]) == [6, 12, 6, 12]
    with pytest.raises(ValueError, match="need 4"):
        kfac_layer_counts(s, [3, 3])


@pytest.mark.parametrize("method, d, n, w", PIPELINE_GRID, ids=PIPELINE_GRID_IDS)
def test_critical_path_assignment_passes_the_checks(method, d, n, w):
    s = build_schedule(method, d, n, w)
    a = critical_path_assignment(s, [3] * s.num_stages, 2)
    check_assignment(a)
    assert not a.deferred and a.interval == 2
    assert strip_kfac(a.phases[1]).actions == s.actions and a.schedule.actions == s.actions
    for worker, acts in a.phases[0].actions.items():
        last_b = max(i for i, x in enumerate(acts) if x.kind in (K.BACKWARD, K.SYNC_GRAD))
        assert all(i > last_b for i, x in enumerate(acts) if x.kind.is_kfac)  # after the flush
        assert acts[-1] == Action(K.STEP)
        replicas = len(s.placement.stages_of(worker))
        assert sum(x.kind == K.PRECOND for x in a.phases[1].actions[worker]) == replicas
        assert not any(x.kind.is_kfac and x.kind != K.PRECOND for x in a.phases[1].actions[worker])


def test_critical_path_on_chimera_covers_each_pipe_with_its_own_micro_batches():
    a = critical_path_assignment(build_schedule("chimera", 4, 4), [1] * 4, 1)
    acts = a.phases[0].actions[0]  # worker 0: stage 0 down (micro-batches 0, 1), stage 3 up (2, 3)
    assert {(x.stage, x.micro_batch, x.pipe) for x in acts if x.kind == K.CURV_A} == {
        (0, 0, 0), (0, 1, 0), (3, 2, 1), (3, 3, 1)}
    assert a.capture_layers(0, 0) == {(0, 0): (0,), (3, 1): (0,)}


def test_critical_path_refuses_a_schedule_with_kfac_units_or_bad_counts():
    s = build_schedule("gpipe", 2, 2)
    a = critical_path_assignment(s, [1, 1], 1)
    with pytest.raises(ValueError, match="already has K-FAC units"):
        critical_path_assignment(a.phases[0], [1, 1], 1)
    with pytest.raises(ValueError, match="need 2 non-negative"):
        critical_path_assignment(s, [1], 1)
    with pytest.raises(ValueError, match="interval=0"):
        critical_path_assignment(s, [1, 1], 0)


# -- hand-broken assignments -------------------------------------------------------------------


def _move_before(acts: list[Action], name: str, anchor: str) -> list[Action]:
    x = Action.from_str(name)
    acts.remove(x)
    acts.insert(acts.index(Action.from_str(anchor)), x)
    return acts


def _drop(acts: list[Action], name: str) -> list[Action]:
    acts.remove(Action.from_str(name))
    return acts


def _split_curvature(a: Assignment) -> Assignment:
    """Move worker 1's CURV_A of micro-batch 1, layer 0 from phase 0 to phase 1 (after its F)."""
    x = Action.from_str("1CURV_A1#0")
    a = _edit(a, 0, 1, lambda acts: _drop(acts, "1CURV_A1#0"))
    return _edit(a, 1, 1, lambda acts: acts[:acts.index(Action.from_str("1F1")) + 1] + [x]
                 + acts[acts.index(Action.from_str("1F1")) + 1:])


_BROKEN = [
    ("curv-b-before-its-b", lambda a: _edit(a, 0, 1, lambda x: _move_before(x, "1CURV_B1#0", "1B1")),
     "1CURV_B1#0 on worker 1 runs before 1B1"),
    ("invert-before-sync", lambda a: _edit(a, 0, 0, lambda x: _move_before(x, "0INVERT#1", "0SYNC_FACTOR#1")),
     "0INVERT#1 on worker 0 comes before 0SYNC_FACTOR#1"),
    ("missing-precond", lambda a: _edit(a, 1, 1, lambda x: _drop(x, "1PRECOND")),
     "worker 1 runs PRECOND of stage 1 .pipe 0. 0 times"),
    ("precond-before-sync-grad", lambda a: _edit(a, 1, 0, lambda x: _move_before(x, "0PRECOND", "0SYNC_GRAD")),
     "must come after 0SYNC_GRAD"),
    ("curvature-split-over-two-phases", _split_curvature, "split over phases \\[0, 1\\]"),
    ("missing-curvature", lambda a: _edit(a, 0, 0, lambda x: _drop(x, "0CURV_B0#1")),
     "never gets CURV_B of micro-batch\\(es\\) \\[0\\]"),
    ("sync-missing", lambda a: _edit(a, 0, 0, lambda x: _drop(x, "0SYNC_FACTOR#0")),
     "layer 0 on worker 0 has no SYNC_FACTOR in the cycle"),
    ("layer-out-of-range", lambda a: _edit(a, 1, 0, lambda x: _move_before(x + [Action(K.INVERT, 0, layer=5)], "0INVERT#5", "STEP")),
     "stage 0 has 2 K-FAC layers"),
    ("duplicate-unit", lambda a: _edit(a, 0, 1, lambda x: x[:-1] + [Action.from_str("1INVERT#0"), x[-1]]),
     "appears twice"),
    ("pipeline-differs", lambda a: _edit(a, 1, 0, lambda x: _drop(x, "0SEND_F1>1")),
     "different pipeline actions"),
]


@pytest.mark.parametrize("name, break_it, message", _BROKEN, ids=[b[0] for b in _BROKEN])
def test_check_assignment_catches_hand_broken_assignments_with_the_grid(name, break_it, message):
    a = break_it(_small(interval=2, deferred=True))
    with pytest.raises(ScheduleError, match=message) as info:
        check_assignment(a)
    text = str(info.value)
    assert "step W0" in text  # the step × worker grid
    if name not in ("missing-precond", "missing-curvature"):
        assert "[" in text.split("step W0", 1)[1]  # with the failing cell marked


def test_sync_factor_missing_on_one_replica_is_reported_as_a_collective():
    a = critical_path_assignment(build_schedule("chimera", 2, 2), [1, 1], 1)
    broken = _edit(a, 0, 1, lambda x: _drop(x, "0SYNC_FACTOR@1#0"))
    with pytest.raises(ScheduleError, match="collective over every replica"):
        check_assignment(broken)


def test_factor_syncs_in_different_orders_on_twins_are_caught():
    a = critical_path_assignment(build_schedule("chimera", 2, 2), [2, 2], 1)

    def swap(acts):
        i, j = acts.index(Action.from_str("0SYNC_FACTOR#0")), acts.index(Action.from_str("0SYNC_FACTOR#1"))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    broken = _edit(a, 0, 0, swap)
    with pytest.raises(ScheduleError, match="different orders"):
        check_assignment(broken)
    assert stuck_positions(broken.phases[0])  # the abstract execution deadlocks too


def test_not_deferred_needs_the_inverse_before_preconditioning():
    a = _small()
    broken = _edit(a, 0, 1, lambda x: _move_before(x, "1PRECOND", "1INVERT#0"))
    with pytest.raises(ScheduleError, match="comes after the replica's PRECOND"):
        check_assignment(broken)
    check_assignment(replace(broken, deferred=True))  # PipeFisher may precondition first


def test_check_schedule_kfac_rules_on_a_five_action_schedule():
    placement = Placement(1, 1, 1, {(0, 0, 0): 0})
    s = Schedule("hand", 1, 1, placement, {0: _acts("0F0 0B0 0SYNC_GRAD 0CURV_A0 0PRECOND STEP")}, (0,))
    check_schedule(s)  # a None-layer unit covers all layers
    with pytest.raises(ScheduleError, match="0CURV_A1 on worker 0 runs before 0F1, whose input it needs"):
        check_schedule(replace(s, num_micro_batches=2, pipe_of_micro_batch=(0, 0), actions={
            0: _acts("0F0 0CURV_A1 0F1 0B0 0B1 0SYNC_GRAD 0PRECOND STEP")}))
    with pytest.raises(ScheduleError, match="mixes the all-layers form"):
        check_schedule(replace(s, actions={0: _acts("0F0 0B0 0SYNC_GRAD 0CURV_A0 0CURV_A0#1 0PRECOND STEP")}))
    with pytest.raises(ScheduleError, match="takes no micro-batch"):
        check_schedule(replace(s, actions={0: _acts("0F0 0B0 0SYNC_GRAD 0INVERT3 0PRECOND STEP")}))
    with pytest.raises(ScheduleError, match="STEP on worker 0 comes before"):
        check_schedule(replace(s, actions={0: _acts("0F0 0B0 0SYNC_GRAD 0PRECOND STEP 0INVERT")}))
    check_schedule(build_schedule("1f1b", 2, 2))  # no K-FAC: no PRECOND needed
    with pytest.raises(ScheduleError, match="PRECOND of stage 0"):
        check_schedule(build_schedule("1f1b", 2, 2), kfac=True)


# -- JSON --------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["chimera", "interleaved"])
def test_json_round_trip(tmp_path: Path, method):
    s = build_schedule(method, 2, 4, 2)
    a = replace(critical_path_assignment(s, [6] * s.num_stages, 3, deferred=True),
                metadata={"predicted": {"utilization": 0.5}})
    path = assignment_to_json(a, tmp_path / "sub" / "assignment.json")
    data = json.loads(path.read_text())
    assert data["format"] == "pipefisher-assignment/1"
    assert (data["method"], data["num_micro_batches"], data["dp_width"], data["interval"], data["deferred"]) == \
        (method, 4, 2, 3, True)
    assert data["phases"][0]["0"][0] == str(a.phases[0].actions[0][0])
    back = assignment_from_json(path)
    assert back == a and back.metadata == a.metadata
    assert [p.actions for p in back.phases] == [p.actions for p in a.phases]


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "assignment.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


_READER_ERRORS = [
    ("format", lambda d: d.update(format="pipefisher-assignment/0"), "field 'format' is 'pipefisher-assignment/0'"),
    ("missing-field", lambda d: d.pop("interval"), "field 'interval' is missing"),
    ("wrong-type", lambda d: d.update(deferred="yes"), "field 'deferred' = 'yes' has the wrong type"),
    ("bad-method", lambda d: d.update(method="pipedream"), "unknown schedule"),
    ("interval-vs-phases", lambda d: d.update(interval=3), "'phases' has 2 entries but 'interval' is 3"),
    ("worker-keys", lambda d: d["phases"][0].pop("1"), "phases\\[0\\]' must map every worker"),
    ("bad-action", lambda d: d["phases"][1]["0"].__setitem__(0, "0X9"), "phases\\[1\\]\\[\"0\"\\]': cannot parse action"),
    ("kfac-layers", lambda d: d.update(kfac_layers=[2]), "field 'kfac_layers' = \\[2\\] needs 2"),
    ("fails-checks", lambda d: d["phases"][1]["1"].remove("1PRECOND"), "field 'phases' fails the assignment checks"),
]


@pytest.mark.parametrize("name, corrupt, message", _READER_ERRORS, ids=[e[0] for e in _READER_ERRORS])
def test_reader_names_the_file_the_field_and_the_fix(tmp_path: Path, name, corrupt, message):
    data = assignment_to_dict(_small(interval=2))
    corrupt(data)
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=message) as info:
        assignment_from_json(path)
    assert str(path) in str(info.value) and "schedule.py" in str(info.value)


def test_reader_rejects_non_json_and_missing_files(tmp_path: Path):
    with pytest.raises(ValueError, match="not a JSON file"):
        assignment_from_json(_write(tmp_path, "{not json"))
    with pytest.raises(ValueError, match="no such assignment file"):
        assignment_from_json(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="expected a JSON object"):
        assignment_from_dict([1, 2])


# -- the simulator's K-FAC rules ---------------------------------------------------------------


def _one_stage(text: str, layers: int = 2) -> tuple[Schedule, CostModel]:
    placement = Placement(1, 1, 1, {(0, 0, 0): 0})
    s = Schedule("hand", 1, 1, placement, {0: _acts(text)}, (0,))
    cost = CostModel(forward_ns=(10,), backward_ns=(20,), sync_ns=(5,), step_ns=1,
                     curv_a_ns=((3, 4),), curv_b_ns=((5, 6),), sync_factor_ns=((7, 8),),
                     invert_ns=((9, 10),), precond_ns=(2,))
    return s, cost


def test_simulator_runs_kfac_units_with_their_costs_and_waits():
    s, cost = _one_stage("0F0 0CURV_A0#1 0B0 0SYNC_GRAD 0CURV_B0 0SYNC_FACTOR#0 0INVERT#0 0PRECOND STEP")
    spans = {e.name: (e.start_ns, e.end_ns) for e in simulate(s, cost)}
    assert spans == {
        "0F0": (0, 10), "0CURV_A0#1": (10, 14), "0B0": (14, 34),
        "0SYNC_GRAD": (34, 39),
        "0CURV_B0": (34, 45),  # no layer: the sum over the stage's layers (5 + 6)
        "0SYNC_FACTOR#0": (45, 52),  # asynchronous ...
        "0INVERT#0": (52, 61),  # ... but the inversion waits for it
        "0PRECOND": (61, 63), "STEP": (63, 64),
    }


def test_precond_waits_for_the_gradient_all_reduce_and_step_not_for_factor_syncs():
    s, cost = _one_stage("0F0 0B0 0SYNC_GRAD 0PRECOND 0CURV_A0#0 0SYNC_FACTOR#0 STEP")
    spans = {e.name: (e.start_ns, e.end_ns) for e in simulate(s, cost)}
    assert spans["0PRECOND"] == (35, 37)  # SYNC_GRAD ends at 30 + 5
    assert spans["STEP"] == (40, 41) and spans["0SYNC_FACTOR#0"] == (40, 47)  # still running after STEP


def test_factor_sync_starts_when_every_replica_arrives():
    a = critical_path_assignment(build_schedule("chimera", 2, 2), [1, 1], 1)
    cost = CostModel.uniform(2, 10, 10, kfac_layers=1, curv_a_ns=1, curv_b_ns=1, sync_factor_ns=4, invert_ns=2)
    events = simulate_phases(a.phases, cost)
    for stage in (0, 1):
        syncs = [e for e in events if e.kind == "SYNC_FACTOR" and Action.from_str(e.name).stage == stage]
        assert len(syncs) == 2 and len({(e.start_ns, e.end_ns) for e in syncs}) == 1
        assert syncs[0].duration_ns == 4


def test_simulate_phases_runs_each_phase_in_turn_and_base_simulation_is_unchanged():
    s = build_schedule("1f1b", 2, 4)
    a = critical_path_assignment(s, [2, 2], 3)
    cost = CostModel.uniform(2, 10, 20, kfac_layers=2, curv_a_ns=1, curv_b_ns=1, invert_ns=1, precond_ns=1)
    events = simulate_phases(a.phases, cost, cycles=2)
    assert {e.step for e in events} == set(range(6))
    assert {e.step for e in events if e.kind == "INVERT"} == {0, 3}
    # A schedule without K-FAC units simulates exactly as before the K-FAC rules existed.
    plain = CostModel.uniform(2, 10, 20)
    assert [(e.name, e.start_ns) for e in simulate(s, plain)] == \
        [(e.name, e.start_ns) for e in simulate(s, CostModel.uniform(2, 10, 20, kfac_layers=2, curv_a_ns=5))]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"curv_a_ns": ((1, 2),)}, "curv_a_ns has 1 rows"),
        ({"curv_a_ns": ((1,), (1,)), "invert_ns": ((1, 1), (1,))}, "give every K-FAC kind the same layers"),
        ({"invert_ns": ((1,), (-1,))}, "non-negative"),
        ({"precond_ns": (1,)}, "precond_ns has 1 entries"),
        ({"sync_factor_ns": 3}, "one tuple of per-layer ns per stage"),
    ],
    ids=["rows", "layer-counts", "negative", "precond-length", "scalar"],
)
def test_cost_model_rejects_bad_kfac_tables(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CostModel(forward_ns=(1, 1), backward_ns=(1, 1), **kwargs)


def test_kfac_cost_of_a_layer_the_model_does_not_have_is_an_error():
    cost = CostModel.uniform(2, 1, kfac_layers=3, curv_a_ns=2)
    assert cost.kfac_layers == (3, 3) and cost.kfac_ns(K.CURV_A, 1, None) == 6
    assert CostModel.uniform(2, 1).kfac_layers is None
    with pytest.raises(ValueError, match="has 3 K-FAC layers"):
        cost.kfac_ns(K.CURV_A, 0, 3)


def test_with_preconditioning_follows_the_order_of_the_gradient_syncs():
    s = with_preconditioning(build_schedule("chimera", 4, 4))
    acts = [str(x) for x in s.actions[0]]
    assert acts[-3:] == ["3PRECOND@1", "0PRECOND", "STEP"]  # the up replica synced first
    check_schedule(s, kfac=True)


# -- factors more often than inverses; the curvature age bound (issue 28) -----------------------


def test_critical_path_refreshes_factors_every_f_steps_and_inverts_every_k():
    a = critical_path_assignment(build_schedule("1f1b", 2, 2), [2, 2], 4, factor_interval=2)
    kinds = [{x.kind for acts in ph.actions.values() for x in acts if x.kind.is_kfac} for ph in a.phases]
    assert [K.CURV_A in k for k in kinds] == [True, False, True, False]
    assert [K.SYNC_FACTOR in k for k in kinds] == [True, False, True, False]
    assert [K.INVERT in k for k in kinds] == [True, False, False, False]
    assert (a.factor_every, a.refreshes_per_cycle) == (2, 2)
    assert assignment_from_dict(assignment_to_dict(a)) == a
    assert critical_path_assignment(build_schedule("1f1b", 2, 2), [2, 2], 4, factor_interval=4).factor_interval == 0
    with pytest.raises(ValueError, match="factor_interval=3"):
        critical_path_assignment(build_schedule("1f1b", 2, 2), [2, 2], 4, factor_interval=3)
    # A factor refresh missing from phase 2, or its sync moved after the next refresh's curvature:
    dropped = _edit(a, 2, 0, lambda acts: [x for x in acts if x.kind not in (K.CURV_A, K.CURV_B, K.SYNC_FACTOR)])
    with pytest.raises(ScheduleError, match="has curvature in 1 phase"):
        check_assignment(dropped)
    units = [Action.from_str("0SYNC_FACTOR#0"), Action.from_str("0INVERT#0")]
    late = _edit(_edit(a, 0, 0, lambda acts: _drop(_drop(acts, "0SYNC_FACTOR#0"), "0INVERT#0")), 3, 0,
                 lambda acts: _move_before(acts + units, "0SYNC_FACTOR#0", "0PRECOND"))
    late = _edit(late, 3, 0, lambda acts: _move_before(acts, "0INVERT#0", "0PRECOND"))
    with pytest.raises(ScheduleError, match="after the curvature of the next factor refresh"):
        check_assignment(late)


@pytest.mark.parametrize("deferred, promote, expected", [(False, "at_cycle_end", 2), (True, "at_cycle_end", 5),
                                                          (True, "when_ready", 3)])
def test_curvature_age_bound_per_rule_on_the_critical_path(deferred, promote, expected):
    """Curvature and INVERT in phase 0 at k = 3: k − 1 fresh, 2k − 1 at the cycle's end, k when ready."""
    a = critical_path_assignment(build_schedule("1f1b", 2, 2), [2, 2], 3, deferred=deferred)
    assert curvature_age_bound(a, promote) == expected
    with pytest.raises(ValueError, match="promote"):
        curvature_age_bound(a, "later")


def test_curvature_age_bound_counts_an_inverts_lag_behind_its_curvature():
    """Layer 1 of stage 1 inverted two phases after its curvature (phase 0): k + 2 when ready."""
    a = _small(interval=3, deferred=True)
    x = Action.from_str("1INVERT#1")
    a = _edit(_edit(a, 0, 1, lambda acts: _drop(acts, "1INVERT#1")), 2, 1, lambda acts: acts[:-1] + [x, acts[-1]])
    check_assignment(a)
    assert curvature_age_bound(a, "when_ready") == 5 and curvature_age_bound(a, "at_cycle_end") == 5
    assert curvature_age_bound(replace(a, deferred=False), "at_cycle_end") == 4
