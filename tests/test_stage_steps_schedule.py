"""Per-stage optimizer steps as schedule actions (issue 36, item 1): the pass, the checker's rules
for the stage STEP and the simulator's (``schedules.passes`` [Note: per-stage optimizer steps])."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipefisher.planning.step_placement import place_stage_steps
from pipefisher.schedules import (Action, ActionKind, ScheduleError, build_schedule, check_assignment, check_schedule,
                                  critical_path_assignment)
from pipefisher.schedules.passes import per_stage_steps
from pipefisher.simulate import CostModel, simulate

K = ActionKind
METHODS = [("gpipe", 4, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 2), ("chimera", 2, 4, 1), ("chimera", 4, 8, 1),
           ("chimera", 2, 4, 2), ("interleaved", 2, 4, 1), ("zb-h1", 4, 8, 1), ("zb-v", 2, 4, 1), ("zb-v", 4, 8, 1),
           ("dualpipev", 2, 4, 1), ("chimera-doubling", 4, 8, 1)]
IDS = [f"{m}-D{d}-N{n}-W{w}" for m, d, n, w in METHODS]


def _build(method: str, d: int, n: int, w: int):
    return build_schedule(method, d, n, w, **({"num_virtual": 2} if method == "interleaved" else {}))


def test_stage_step_string_form_round_trips():
    for text in ("1STEP@1", "0STEP", "STEP"):
        assert str(Action.from_str(text)) == text
    assert Action.from_str("3STEP@1") == Action(K.STEP, 3, None, 1)


@pytest.mark.parametrize("method, d, n, w", METHODS, ids=IDS)
def test_every_replica_steps_once_after_its_last_action_and_the_checker_agrees(method, d, n, w):
    base = _build(method, d, n, w)
    s = per_stage_steps(base)
    check_schedule(s)
    for worker, acts in s.actions.items():
        assert acts[-1] == Action(K.STEP)
        # nothing but the stage steps was added, nothing else moved
        assert [a for a in acts if not (a.kind == K.STEP and a.stage is not None)] == list(base.actions[worker])
        for _, pipe, stage in s.placement.stages_of(worker):
            at = [i for i, a in enumerate(acts) if a == Action(K.STEP, stage, None, pipe)]
            assert len(at) == 1
            assert all(i < at[0] for i, a in enumerate(acts) if (a.stage, a.pipe) == (stage, pipe) and a.kind != K.STEP)


def test_per_stage_steps_runs_once_and_needs_a_complete_schedule():
    s = per_stage_steps(build_schedule("1f1b", 2, 2))
    with pytest.raises(ValueError, match="already has per-stage STEPs"):
        per_stage_steps(s)
    plain = build_schedule("1f1b", 2, 2)
    cut = replace(plain, actions={w: acts[:-1] for w, acts in plain.actions.items()})
    with pytest.raises(ValueError, match="does not end with STEP"):
        per_stage_steps(cut)


def test_positions_before_the_replicas_last_action_are_refused():
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="must follow its replica's last action"):
        per_stage_steps(s, {1: {(1, 0): 0}})


def _broken(edit) -> None:
    s = per_stage_steps(build_schedule("1f1b", 2, 2))
    acts = list(s.actions[1])
    check_schedule(replace(s, actions={**s.actions, 1: tuple(edit(acts))}))


def test_checker_rejects_a_stage_step_before_its_sync_grad():
    def early(acts):
        i = acts.index(Action(K.STEP, 1))
        step = acts.pop(i)
        acts.insert(acts.index(Action(K.SYNC_GRAD, 1)), step)
        return acts
    with pytest.raises(ScheduleError, match=r"1STEP on worker 1 comes before 1SYNC_GRAD"):
        _broken(early)


def test_checker_rejects_a_stage_step_twice_or_a_replica_without_one():
    with pytest.raises(ScheduleError, match=r"runs 1STEP 2 times"):
        _broken(lambda acts: acts[:-1] + [Action(K.STEP, 1), acts[-1]])
    with pytest.raises(ScheduleError, match=r"runs 1STEP 0 times"):
        _broken(lambda acts: [a for a in acts if a != Action(K.STEP, 1)])


def test_checker_rejects_a_stage_step_on_a_worker_without_the_stage():
    with pytest.raises(ScheduleError, match="does not hold stage 0"):
        _broken(lambda acts: acts[:-1] + [Action(K.STEP, 0), acts[-1]])


def test_kfac_precond_moves_with_its_stage_step_and_the_phases_stay_valid():
    base = build_schedule("chimera", 4, 8)
    a = critical_path_assignment(base, [3] * 4, 2)
    placed = replace(a, phases=tuple(per_stage_steps(p) for p in a.phases))
    check_assignment(placed)
    for phase in placed.phases:
        for acts in phase.actions.values():
            for i, x in enumerate(acts):
                if x.kind == K.PRECOND:
                    assert acts[i + 1] == Action(K.STEP, x.stage, None, x.pipe)
    # a stage STEP before its replica's PRECOND is refused
    acts = list(placed.phases[0].actions[0])
    i = next(i for i, x in enumerate(acts) if x.kind == K.PRECOND)
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    with pytest.raises(ScheduleError, match="comes before .*PRECOND"):
        check_schedule(replace(placed.phases[0], actions={**placed.phases[0].actions, 0: tuple(acts)}), kfac=True)


# -- simulator ---------------------------------------------------------------------------------


def _step_time(schedule, cost) -> int:
    """Steady-state step time: between the ends of the last two of three simulated steps."""
    events = simulate(schedule, cost, steps=3)
    ends = [max(e.end_ns for e in events if e.step == k) for k in range(3)]
    return ends[2] - ends[1]


def test_simulated_stage_step_waits_for_its_all_reduce_only():
    # chimera D=2: worker 0's up-pipe replica (stage 1) steps while its down-pipe replica's all-reduce runs
    s = per_stage_steps(build_schedule("chimera", 2, 4))
    cost = CostModel.uniform(2, 1000, 2000, sync_ns=500, stage_step_ns=700)
    events = {(e.worker, e.name): e for e in simulate(s, cost)}
    early, late = events[(0, "1STEP@1")], events[(0, "0STEP")]
    sync0 = events[(0, "0SYNC_GRAD")]
    assert early.start_ns < sync0.end_ns  # overlaps the later all-reduce
    assert early.start_ns >= events[(0, "1SYNC_GRAD@1")].end_ns
    assert late.start_ns >= sync0.end_ns
    assert late.duration_ns == early.duration_ns == 700


@pytest.mark.parametrize("method, d, n, w", METHODS, ids=IDS)
def test_per_stage_steps_never_simulate_slower_than_the_global_step(method, d, n, w):
    s = _build(method, d, n, w)
    held = max(len(s.placement.stages_of(x)) for x in s.actions)
    for sync in (0, 500):
        glob = CostModel.uniform(s.num_stages, 1000, 2000, sync_ns=sync, step_ns=700 * held)
        per = CostModel.uniform(s.num_stages, 1000, 2000, sync_ns=sync, stage_step_ns=700)
        assert _step_time(per_stage_steps(s), per) <= _step_time(s, glob)
        placed = place_stage_steps(s, per)
        check_schedule(placed)
        assert _step_time(placed, per) <= _step_time(per_stage_steps(s), per)


def test_chimera_steps_overlap_the_twin_all_reduces():
    # global: all-reduce, barrier, 2 x 700 of steps; per stage: the first replica's step hides under
    # the second replica's all-reduce (13.4 against 13.9 units at F=1, B=2, all-reduce 0.5)
    s = build_schedule("chimera", 2, 4)
    glob = CostModel.uniform(2, 1000, 2000, sync_ns=500, step_ns=1400)
    per = CostModel.uniform(2, 1000, 2000, sync_ns=500, stage_step_ns=700)
    assert _step_time(s, glob) == 13900
    assert _step_time(per_stage_steps(s), per) == 13400


def test_1f1b_gains_nothing_in_the_simulator_the_global_step_already_runs_per_worker():
    # After the barrier each worker steps and goes on, so a heavy last stage's step (3 units, the
    # heads) is hidden by the (D-1)F its next forward needs to arrive, in both placements; only
    # stage 0's step is on the critical path, in both. The gains are elsewhere (all-reduces, bubbles).
    s = build_schedule("1f1b", 4, 8)
    steps = (1000, 1000, 1000, 3000)
    glob = CostModel(forward_ns=(1000,) * 4, backward_ns=(2000,) * 4, worker_step_ns=steps)
    per = CostModel(forward_ns=(1000,) * 4, backward_ns=(2000,) * 4, stage_step_ns=steps)
    assert _step_time(per_stage_steps(s), per) == _step_time(s, glob) == 34000


def test_measured_costs_read_stage_steps_apart_from_the_final_step():
    from pipefisher.runtime.step_metrics import measured_costs

    s = per_stage_steps(build_schedule("chimera", 2, 4))
    cost = CostModel(forward_ns=(1000, 1000), backward_ns=(2000, 2000), stage_step_ns=(300, 500),
                     worker_step_ns=(70, 90))
    got = measured_costs(simulate(s, cost), s)
    assert got.stage_step_ns == (300, 500)
    assert got.worker_step_ns == (70, 90)
