"""Forward-only (evaluation) schedules: ``forward_only`` / ``build_eval_schedule`` and
``check_schedule(..., forward_only=True)`` (pure Python, no torch)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from pipefisher.schedules import (
    Action,
    ActionKind,
    Placement,
    Schedule,
    ScheduleError,
    build_eval_schedule,
    build_schedule,
    check_schedule,
    critical_path_assignment,
    forward_only,
    get_generator,
)
from pipefisher.schedules.evaluation import FORWARD_KINDS

K = ActionKind

_OPTIONS = {"interleaved": {"num_virtual": 2}}


def _valid_n(method: str, d: int) -> tuple[int, ...]:
    if method in ("chimera", "interleaved"):
        return (d, 2 * d, 3 * d)
    if method == "zb-v":
        return (2 * d, 2 * d + 1, 3 * d)
    return (1, d, 2 * d + 1)


GRID = [(m, d, n, w) for m in ("gpipe", "1f1b", "chimera", "interleaved", "zb-h1", "zb-v")
        for d in (2, 4) for n in _valid_n(m, d) for w in (1, 2)]
GRID_IDS = [f"{m}-D{d}-N{n}-W{w}" for m, d, n, w in GRID]


def _forward_part(schedule: Schedule) -> dict[int, tuple[Action, ...]]:
    return {w: tuple(a for a in acts if a.kind in FORWARD_KINDS) for w, acts in schedule.actions.items()}


def _forwards(schedule: Schedule) -> dict[int, list[Action]]:
    return {w: [a for a in acts if a.kind == K.FORWARD] for w, acts in schedule.actions.items()}


# -- every method ------------------------------------------------------------------------------


@pytest.mark.parametrize("method, d, n, w", GRID, ids=GRID_IDS)
def test_forward_only_keeps_the_training_forward_order_and_passes_the_check(method, d, n, w):
    train = build_schedule(method, d, n, w, **_OPTIONS.get(method, {}))
    ev = forward_only(train)
    check_schedule(ev, forward_only=True)
    assert (ev.method, ev.num_stages, ev.num_micro_batches) == (method, train.num_stages, n)
    assert ev.placement == train.placement and ev.pipe_of_micro_batch == train.pipe_of_micro_batch
    # No method needed reordering: each worker keeps its F/SEND_F/RECV_F in the training order.
    assert ev.actions == _forward_part(train)
    assert _forwards(ev) == _forwards(train)
    assert all(a.kind in FORWARD_KINDS for acts in ev.actions.values() for a in acts)
    # One F per (dp, pipe, stage, micro-batch), on the worker that holds the replica.
    computes = Counter((w_, a) for w_, acts in ev.actions.items() for a in acts if a.kind.is_compute)
    assert all(a.kind == K.FORWARD for _, a in computes) and set(computes.values()) == {1}
    expected = {(train.placement.worker_of(dp, p, s), Action(K.FORWARD, s, j, p))
                for dp in range(w) for j, p in enumerate(train.pipe_of_micro_batch)
                for s in range(train.num_stages)}
    assert set(computes) == expected
    assert build_eval_schedule(method, d, n, w, **_OPTIONS.get(method, {})) == ev


def test_forward_only_of_a_compute_only_schedule_gets_its_forward_messages():
    for method, d, n in (("1f1b", 4, 6), ("chimera", 4, 8), ("zb-v", 2, 4)):
        gen = get_generator(method)(d, n, 2)
        ev = forward_only(gen)
        assert _forwards(ev) == _forwards(gen)
        assert any(a.kind == K.SEND_F for acts in ev.actions.values() for a in acts)


def test_zb_v_options_carry_into_the_eval_schedule():
    opts = {"order_costs": [1.0, 1.2, 1.0], "stage_costs": [2.0, 1.0, 1.0, 3.0], "activation_memory": 1.5}
    ev = build_eval_schedule("zb-v", 2, 5, **opts)
    assert _forwards(ev) == _forwards(build_schedule("zb-v", 2, 5, **opts))


# -- other evaluation micro-batch counts -------------------------------------------------------


@pytest.mark.parametrize("method, d, n, eval_n", [("gpipe", 2, 4, 3), ("1f1b", 4, 4, 9), ("chimera", 4, 8, 12),
                                                  ("interleaved", 2, 4, 6), ("zb-h1", 2, 2, 5), ("zb-v", 2, 4, 7)])
def test_forward_only_regenerates_the_method_for_another_micro_batch_count(method, d, n, eval_n):
    opts = _OPTIONS.get(method, {})
    for w in (1, 2):
        ev = forward_only(build_schedule(method, d, n, w, **opts), eval_n)
        assert ev.num_micro_batches == eval_n
        assert ev == build_eval_schedule(method, d, eval_n, w, **opts)
    same = build_schedule(method, d, n, **opts)
    assert forward_only(same, n) == forward_only(same)


@pytest.mark.parametrize("method, d, n, eval_n, message", [
    ("chimera", 4, 8, 6, "chimera needs a multiple of stages=4"),
    ("interleaved", 2, 4, 3, "interleaved needs a multiple of stages=2"),
    ("zb-v", 2, 4, 3, "zb-v needs at least 2 x stages = 4"),
])
def test_forward_only_refuses_a_micro_batch_count_the_method_does_not_allow(method, d, n, eval_n, message):
    train = build_schedule(method, d, n, **_OPTIONS.get(method, {}))
    with pytest.raises(ValueError, match=message):
        forward_only(train, eval_n)
    with pytest.raises(ValueError, match=message):
        build_eval_schedule(method, d, eval_n, **_OPTIONS.get(method, {}))


# -- K-FAC phases ------------------------------------------------------------------------------


@pytest.mark.parametrize("method, d, n", [("1f1b", 2, 4), ("chimera", 2, 4), ("zb-v", 2, 4)])
def test_forward_only_drops_the_kfac_units_of_a_phase(method, d, n):
    base = build_schedule(method, d, n)
    assignment = critical_path_assignment(base, [2] * base.num_stages, 2)
    assert any(a.kind.is_kfac for acts in assignment.phases[0].actions.values() for a in acts)
    for phase in assignment.phases:
        ev = forward_only(phase)
        assert not any(a.kind.is_kfac for acts in ev.actions.values() for a in acts)
        assert ev == forward_only(base)


# -- the checker -------------------------------------------------------------------------------


def _placement(num_stages: int) -> Placement:
    return Placement(num_stages, 1, 1, {(0, 0, s): s for s in range(num_stages)})


def make(rows: dict[int, str], num_micro_batches: int = 2, num_stages: int = 2) -> Schedule:
    return Schedule("hand", num_stages, num_micro_batches, _placement(num_stages),
                    {w: tuple(Action.from_str(t) for t in text.split()) for w, text in rows.items()},
                    (0,) * num_micro_batches)


GOOD = {0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1", 1: "1RECV_F0<0 1F0 1RECV_F1<0 1F1"}


def _edit(worker: int, old: str, new: str) -> dict[int, str]:
    assert old in GOOD[worker]
    return {**GOOD, worker: " ".join(GOOD[worker].replace(old, new).split())}


def test_hand_made_forward_only_schedule_passes_and_is_not_a_training_schedule():
    check_schedule(make(GOOD), forward_only=True)
    check_schedule(make({0: "0F0 0F1", 1: "1F0 1F1"}), forward_only=True, complete=False)
    with pytest.raises(ScheduleError, match="0B0 is missing"):
        check_schedule(make(GOOD))
    with pytest.raises(ScheduleError, match="only F, SEND_F and RECV_F"):
        check_schedule(build_schedule("1f1b", 2, 2), forward_only=True)


_BROKEN = [
    ("missing-recv", _edit(1, "1RECV_F1<0 ", ""), "1F1 on worker 1 needs 1RECV_F1<0 before it", "[1F1]"),
    ("missing-send", _edit(0, " 0SEND_F1>1", ""), "0F1 on worker 0 needs 0SEND_F1>1 after it", "[0F1]"),
    ("backward-left-in", _edit(0, "0F1", "0F1 0B0"), "0B0 on worker 0 is a backward", "[0B0]"),
    ("input-grad-left-in", _edit(1, "1F1", "1F1 1I1"), "1I1 on worker 1 is a backward", "[1I1]"),
    ("weight-grad-left-in", _edit(1, "1F1", "1F1 1W1"), "1W1 on worker 1 is a backward", "[1W1]"),
    ("backward-message-left-in", _edit(0, "0F1", "0RECV_B0<1 0F1"), "0RECV_B0<1 on worker 0 is a backward message",
     "[0RECV_B0<1]"),
    ("sync-left-in", _edit(1, "1F1", "1F1 1SYNC_GRAD"), "1SYNC_GRAD on worker 1 is a SYNC_GRAD", "[1SYNC_GRAD]"),
    ("step-left-in", _edit(0, "0SEND_F1>1", "0SEND_F1>1 STEP"), "STEP on worker 0 is a STEP", "[STEP]"),
    ("kfac-left-in", _edit(0, "0F0", "0F0 0CURV_A0"), "0CURV_A0 on worker 0 is a K-FAC unit", "[0CURV_A0]"),
    ("duplicated-forward", _edit(0, "0F1", "0F1 0F1"), "0F1 appears 2 times on worker 0", "[0F1]"),
    ("missing-forward", _edit(1, "1RECV_F1<0 1F1", ""), "1F1 is missing on worker 1", None),
    ("deadlock", {0: GOOD[0], 1: "1RECV_F1<0 1F1 1RECV_F0<0 1F0"}, "deadlock under blocking send/receive",
     "[0SEND_F0>1]"),
]


@pytest.mark.parametrize("rows, message, marked", [c[1:] for c in _BROKEN], ids=[c[0] for c in _BROKEN])
def test_forward_only_check_catches_broken_schedule(rows, message, marked):
    with pytest.raises(ScheduleError) as info:
        check_schedule(make(rows), forward_only=True)
    text = str(info.value)
    assert message in text and "step W0" in text
    if marked is not None:
        assert marked in text


def test_forward_only_check_rejects_edits_of_a_generated_eval_schedule():
    ev = build_eval_schedule("chimera", 4, 8, 2)
    acts = dict(ev.actions)
    recv = next(i for i, a in enumerate(acts[1]) if a.kind == K.RECV_F)
    with pytest.raises(ScheduleError, match="needs .*RECV_F"):
        check_schedule(replace(ev, actions={**acts, 1: acts[1][:recv] + acts[1][recv + 1:]}), forward_only=True)
    f = next(a for a in acts[2] if a.kind == K.FORWARD)
    with pytest.raises(ScheduleError, match="appears 2 times"):
        check_schedule(replace(ev, actions={**acts, 2: acts[2] + (f,)}), forward_only=True)
    b = Action(K.BACKWARD, f.stage, f.micro_batch, f.pipe)
    with pytest.raises(ScheduleError, match="is a backward"):
        check_schedule(replace(ev, actions={**acts, 2: acts[2] + (b,)}), forward_only=True)


def test_forward_only_check_refuses_kfac_true():
    with pytest.raises(ValueError, match="contradicts forward_only"):
        check_schedule(make(GOOD), forward_only=True, kfac=True)
