"""Schedule generators, passes and static checks (pure Python, no torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipefisher.schedules import (
    GENERATORS,
    Action,
    ActionKind,
    Placement,
    Schedule,
    ScheduleError,
    add_communication,
    add_grad_sync_and_step,
    build_schedule,
    check_schedule,
    chimera,
    get_generator,
    gpipe,
    interleaved,
    one_f_one_b,
)
from pipefisher.schedules.chimera_doubling import chimera_doubling, chimera_doubling_peaks
from pipefisher.simulate import peak_activations

K = ActionKind


# -- helpers -----------------------------------------------------------------------------------


def _linear(num_stages: int) -> Placement:
    return Placement(num_stages, 1, 1, {(0, 0, s): s for s in range(num_stages)})


def _chimera2() -> Placement:
    return Placement(2, 2, 1, {(0, 0, 0): 0, (0, 0, 1): 1, (0, 1, 1): 0, (0, 1, 0): 1})


def make(rows: dict[int, str], num_stages: int = 2, num_micro_batches: int = 1,
         placement: Placement | None = None, pipe_of: tuple[int, ...] | None = None) -> Schedule:
    """A schedule from per-worker action strings, e.g. ``{0: "0F0 0B0", 1: "1F0 1B0"}``."""
    return Schedule(
        method="hand",
        num_stages=num_stages,
        num_micro_batches=num_micro_batches,
        placement=placement or _linear(num_stages),
        actions={w: tuple(Action.from_str(t) for t in text.split()) for w, text in rows.items()},
        pipe_of_micro_batch=pipe_of or (0,) * num_micro_batches,
    )


def strings(schedule: Schedule) -> dict[int, str]:
    return {w: " ".join(map(str, acts)) for w, acts in schedule.actions.items()}


def compute_only(schedule: Schedule) -> dict[int, list[Action]]:
    return {w: [a for a in acts if a.kind.is_compute] for w, acts in schedule.actions.items()}


# -- registry and shape validation -------------------------------------------------------------


def test_registry_names_the_methods():
    assert set(GENERATORS) == {"gpipe", "1f1b", "chimera", "interleaved", "zb-h1", "zb-v", "chimera-doubling",
                               "dualpipev", "v-half", "v-min"}


def test_every_method_accepts_one_virtual_chunk():
    # Callers may pass the config's pipeline.num_virtual (1 unless interleaved or a V schedule) to
    # every method; a V (zb-v, dualpipev, v-half, v-min) is exactly two chunks per worker, and it says so.
    for method in GENERATORS:
        if method in ("zb-v", "dualpipev", "v-half", "v-min"):
            with pytest.raises(ValueError, match=f"pipeline.num_virtual=1: {method} places exactly 2 model chunks"):
                build_schedule(method, 2, 4, num_virtual=1)
            assert build_schedule(method, 2, 4, num_virtual=2).num_stages == 4
            continue
        assert build_schedule(method, 2, 4 if method == "chimera-doubling" else 2, num_virtual=1).num_stages == 2


def test_unknown_method_error_lists_valid_names():
    with pytest.raises(ValueError, match="gpipe, 1f1b, chimera, interleaved"):
        get_generator("pipedream")
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zero-bubble", 4, 8)


@pytest.mark.parametrize(
    "method, stages, micro_batches, dp, options, message",
    [
        ("chimera", 3, 6, 1, {}, "stages=3: chimera needs an even number of stages; use stages=2 or stages=4"),
        ("chimera", 4, 6, 1, {}, "num_micro_batches=6: chimera needs a multiple of stages=4.*use num_micro_batches=4 or 8"),
        ("chimera", 4, 2, 1, {}, "num_micro_batches=2: .*use num_micro_batches=4"),
        ("interleaved", 4, 6, 1, {"num_virtual": 2}, "num_micro_batches=6: interleaved needs a multiple of stages=4"),
        ("interleaved", 2, 2, 1, {"num_virtual": 0}, r"pipeline.num_virtual=0"),
        ("gpipe", 0, 4, 1, {}, "stages=0: must be a positive integer"),
        ("1f1b", 2, 0, 1, {}, "num_micro_batches=0"),
        ("1f1b", 2, 2, 0, {}, "data_parallel=0"),
        ("gpipe", 2, 2, 1, {"num_virtual": 2}, "takes no option num_virtual; accepted: none"),
        ("interleaved", 2, 2, 1, {"chunks": 2}, "takes no option chunks; accepted: num_virtual"),
    ],
    ids=["chimera-odd-D", "chimera-N-not-multiple", "chimera-N-below-D", "interleaved-N-not-multiple",
         "interleaved-v0", "zero-stages", "zero-micro-batches", "zero-dp", "gpipe-unknown-option",
         "interleaved-unknown-option"],
)
def test_unsupported_shapes_raise_with_field_and_fix(method, stages, micro_batches, dp, options, message):
    with pytest.raises(ValueError, match=message):
        build_schedule(method, stages, micro_batches, dp, **options)


# -- generators --------------------------------------------------------------------------------


def test_chimera_matches_design_example_exactly():
    # DESIGN.md, "Schedules": D=4, N=4, the down pipe carries 0-1 and the up pipe 2-3.
    design = {
        0: "F0 F1 F2 B2 F3 B3 B0 B1",
        1: "F0 F2 F1 F3 B2 B0 B3 B1",
        2: "F2 F0 F3 F1 B0 B2 B1 B3",
        3: "F2 F3 F0 B0 F1 B1 B2 B3",
    }
    s = chimera(4, 4)
    got = {w: " ".join(f"{a.kind.value}{a.micro_batch}" for a in acts) for w, acts in s.actions.items()}
    assert got == design
    assert s.pipe_of_micro_batch == (0, 0, 1, 1)
    assert all(a.pipe == s.pipe_of_micro_batch[a.micro_batch] for acts in s.actions.values() for a in acts)


def test_chimera_places_down_stage_r_and_up_stage_mirror_on_each_worker():
    s = chimera(4, 8, dp_width=2)
    for dp in range(2):
        for r in range(4):
            w = dp * 4 + r
            assert s.placement.stages_of(w) == sorted([(dp, 0, r), (dp, 1, 3 - r)])
    assert s.pipe_of_micro_batch == (0, 0, 1, 1, 0, 0, 1, 1)
    assert s.placement.replicas_of_stage(1) == [1, 2, 5, 6]


def test_chimera_concatenated_units_fill_the_previous_units_tail():
    # Unit 1 (micro-batches 4-7) starts on worker 0 before unit 0's last backward (B1).
    order = [str(a) for a in chimera(4, 8).actions[0]]
    assert order.index("0F4") < order.index("0B1")


def test_one_f_one_b_warms_up_d_minus_1_minus_s_forwards():
    s = one_f_one_b(3, 4)
    assert strings(s) == {
        0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    }


def test_one_f_one_b_with_fewer_micro_batches_than_stages():
    assert strings(one_f_one_b(4, 2))[0] == "0F0 0F1 0B0 0B1"


def test_gpipe_runs_all_forwards_then_all_backwards_in_ascending_order():
    assert strings(gpipe(2, 3)) == {0: "0F0 0F1 0F2 0B0 0B1 0B2", 1: "1F0 1F1 1F2 1B0 1B1 1B2"}


def test_interleaved_has_d_times_v_stages_round_robin_on_workers():
    s = interleaved(4, 8, num_virtual=2)
    assert s.num_stages == 8 and s.num_workers == 4
    assert all(s.placement.worker_of(0, 0, k) == k % 4 for k in range(8))
    # Megatron order on worker 0: chunk 0 for micro-batches 0-3, then chunk 1 (stage 4) for 0-3.
    assert [str(a) for a in s.actions[0][:8]] == ["0F0", "0F1", "0F2", "0F3", "4F0", "4F1", "4F2", "4F3"]
    # Last worker warms up with (v-1)·D = 4 forwards, then alternates.
    assert [str(a) for a in s.actions[3][:7]] == ["3F0", "3F1", "3F2", "3F3", "7F0", "7B0", "7F1"]


def test_data_parallel_groups_run_identical_orders_on_their_own_workers():
    for generator in (gpipe, one_f_one_b, chimera, interleaved):
        s = generator(4, 8, dp_width=3)
        assert s.num_workers == 12 and s.dp_width == 3
        for w in range(4):
            assert s.actions[w] == s.actions[w + 4] == s.actions[w + 8]
        assert s.placement.dp_group_of(9) == 2


def test_generators_emit_compute_only_and_pass_the_compute_checks():
    for generator in (gpipe, one_f_one_b, chimera, interleaved):
        s = generator(4, 8)
        assert all(a.kind.is_compute for acts in s.actions.values() for a in acts)
        check_schedule(s, complete=False)


_GRID = [
    (m, d, n, w)
    for m in ("gpipe", "1f1b", "chimera", "interleaved")
    for d in (1, 2, 3, 4, 6)
    for n in (1, 2, 3, 4, 8, 12)
    for w in (1, 2)
    if not (m == "chimera" and (d % 2 or n % d))
    and not (m == "interleaved" and n % d)
    and (w == 1 or n in (4, 12))
]


@pytest.mark.parametrize("method, d, n, w", _GRID, ids=[f"{m}-D{d}-N{n}-W{w}" for m, d, n, w in _GRID])
def test_built_schedule_is_complete_and_keeps_the_generator_order(method, d, n, w):
    s = build_schedule(method, d, n, w)  # runs check_schedule
    assert compute_only(s) == {k: list(v) for k, v in get_generator(method)(d, n, w).actions.items()}
    for worker, acts in s.actions.items():
        assert acts[-1] == Action(K.STEP)
        syncs = sorted((a.stage, a.pipe) for a in acts if a.kind == K.SYNC_GRAD)
        assert syncs == sorted((st, p) for (_, p, st) in s.placement.stages_of(worker))


def test_action_strings_round_trip_on_built_schedules():
    for s in (build_schedule("chimera", 4, 8, 2), build_schedule("interleaved", 2, 4, num_virtual=3)):
        for acts in s.actions.values():
            for a in acts:
                assert Action.from_str(str(a)) == a


# -- passes ------------------------------------------------------------------------------------


def test_add_communication_on_a_five_action_schedule():
    s = make({0: "0F0 0B0", 1: "1F0 1B0"})
    assert strings(add_communication(s)) == {
        0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0",
        1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0",
    }
    assert strings(s) == {0: "0F0 0B0", 1: "1F0 1B0"}  # input untouched


def test_add_communication_orders_clusters_to_avoid_rendezvous_deadlock():
    # Natural order would be W1: 1B0 1SEND_B0>0 1RECV_F1<0 while W0 sits in 0SEND_F1>1.
    out = strings(add_communication(make({0: "0F0 0F1 0B0 0B1", 1: "1F0 1B0 1F1 1B1"}, num_micro_batches=2)))
    assert out == {
        0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1",
        1: "1RECV_F0<0 1F0 1B0 1RECV_F1<0 1SEND_B0>0 1F1 1B1 1SEND_B1>0",
    }


def test_add_communication_posts_a_receive_early_when_the_order_needs_it():
    # Interleaved D=2, v=2, N=4: W0 must take B1's gradient before it can send B0's.
    s = add_communication(interleaved(2, 4, num_virtual=2))
    order = [str(a) for a in s.actions[0]]
    assert order.index("2RECV_B1<1") < order.index("2SEND_B0>1") < order.index("2B1")
    check_schedule(s, complete=False)


def test_add_communication_skips_co_located_stages():
    s = add_communication(interleaved(1, 2, num_virtual=3))
    assert not any(a.kind.is_comm for acts in s.actions.values() for a in acts)


def test_add_grad_sync_and_step_on_a_small_schedule():
    s = make({0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0"})
    assert strings(add_grad_sync_and_step(s)) == {
        0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0 0SYNC_GRAD STEP",
        1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1SYNC_GRAD STEP",
    }


def test_chimera_replica_that_finishes_early_syncs_before_its_last_backward():
    acts = [str(a) for a in build_schedule("chimera", 4, 4).actions[0]]
    # Worker 0 finishes the up pipe's stage 3 (slot 6) before the down pipe's stage 0 (slot 9).
    assert acts.index("3SYNC_GRAD@1") < acts.index("0B1") < acts.index("0SYNC_GRAD") < acts.index("STEP")


def test_passes_refuse_to_run_twice():
    s = add_grad_sync_and_step(add_communication(one_f_one_b(2, 2)))
    with pytest.raises(ValueError, match="add_communication expects a schedule without"):
        add_communication(s)
    with pytest.raises(ValueError, match="add_grad_sync_and_step runs once"):
        add_grad_sync_and_step(s)


# -- static checks -----------------------------------------------------------------------------

GOOD = {0: "0F0 0SEND_F0>1 0RECV_B0<1 0B0 0SYNC_GRAD STEP", 1: "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1SYNC_GRAD STEP"}
GOOD_1F1B = {  # 1F1B, D=2, N=2, complete
    0: "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1 0SYNC_GRAD STEP",
    1: "1RECV_F0<0 1F0 1B0 1RECV_F1<0 1SEND_B0>0 1F1 1B1 1SEND_B1>0 1SYNC_GRAD STEP",
}
GOOD_CHIMERA = {  # Chimera, D=2, N=2, complete
    0: "0F0 0SEND_F0>1 1RECV_F1@1<1 1F1@1 1B1@1 1SEND_B1@1>1 0RECV_B0<1 1SYNC_GRAD@1 0B0 0SYNC_GRAD STEP",
    1: "0F1@1 1RECV_F0<0 0SEND_F1@1>0 1F0 1B0 0RECV_B1@1<0 1SEND_B0>0 1SYNC_GRAD 0B1@1 0SYNC_GRAD@1 STEP",
}


def test_hand_made_good_schedules_pass():
    check_schedule(make(GOOD))
    check_schedule(make(GOOD_1F1B, num_micro_batches=2))
    check_schedule(make(GOOD_CHIMERA, num_micro_batches=2, placement=_chimera2(), pipe_of=(0, 1)))
    assert strings(build_schedule("chimera", 2, 2)) == GOOD_CHIMERA


def _edit(rows: dict[int, str], worker: int, old: str, new: str) -> dict[int, str]:
    assert old in rows[worker]
    return {**rows, worker: " ".join(rows[worker].replace(old, new).split())}


# (id, rows, extra make() kwargs, complete, message fragment, marked cell or None)
_BROKEN = [
    ("missing-backward", _edit(GOOD, 0, "0RECV_B0<1 0B0", ""), {}, True, "0B0 is missing on worker 0", None),
    ("duplicate-forward", _edit(GOOD, 0, "0F0 0SEND", "0F0 0F0 0SEND"), {}, True, "0F0 appears 2 times", "[0F0]"),
    ("backward-before-own-forward", {0: "0B0 0F0", 1: "1F0 1B0"}, {}, False, "runs before its own forward", "[0B0]"),
    ("co-located-stage-order", {0: "1F0 0F0 1B0 0B0"},
     {"placement": Placement(2, 1, 1, {(0, 0, 0): 0, (0, 0, 1): 0})}, False,
     "runs before the forward of stage 0", "[1F0]"),
    ("stage-on-wrong-worker", _edit(GOOD, 0, "0F0", "1F0"), {}, True, "does not hold stage 1", "[1F0]"),
    ("micro-batch-on-wrong-pipe", _edit(GOOD_CHIMERA, 0, "0F0 0SEND", "0F0 0F1 0SEND"),
     {"num_micro_batches": 2, "placement": _chimera2(), "pipe_of": (0, 1)}, True, "travels on pipe 1", "[0F1]"),
    ("wrong-peer", {0: "0F0 0SEND_F0>2 0B0", 1: "1F0 1B0", 2: "2F0 2B0"}, {"num_stages": 3}, False,
     "the peer must be worker 1", "[0SEND_F0>2]"),
    ("recv-missing", _edit(GOOD, 1, "1RECV_F0<0 ", ""), {}, True, "1F0 on worker 1 needs 1RECV_F0<0 before it", "[1F0]"),
    ("recv-after-consumer", _edit(GOOD, 1, "1RECV_F0<0 1F0", "1F0 1RECV_F0<0"), {}, True,
     "1RECV_F0<0 on worker 1 must come before 1F0", "[1RECV_F0<0]"),
    ("send-twice", _edit(GOOD, 0, "0SEND_F0>1", "0SEND_F0>1 0SEND_F0>1"), {}, True, "appears twice", "[0SEND_F0>1]"),
    ("send-without-compute", _edit(GOOD, 1, "1SYNC_GRAD", "1SEND_F0>0 1SYNC_GRAD"), {}, True,
     "has no neighbor", "[1SEND_F0>0]"),
    ("rendezvous-deadlock", _edit(GOOD_1F1B, 1, "1RECV_F1<0 1SEND_B0>0", "1SEND_B0>0 1RECV_F1<0"),
     {"num_micro_batches": 2}, True, "deadlock under blocking send/receive", "[0SEND_F1>1]"),
    ("compute-dependency-cycle", {0: "0F0 0B0 0F1 0B1", 1: "1F1 1B1 1F0 1B0"}, {"num_micro_batches": 2}, False,
     "deadlock", "[0B0]"),
    ("sync-missing", _edit(GOOD, 1, "1SYNC_GRAD ", ""), {}, True, "worker 1 never runs SYNC_GRAD for stage 1", None),
    ("sync-before-last-backward", _edit(GOOD, 0, "0RECV_B0<1 0B0 0SYNC_GRAD", "0SYNC_GRAD 0RECV_B0<1 0B0"), {},
     True, "comes before the replica's last backward", "[0SYNC_GRAD]"),
    ("sync-twice", _edit(GOOD, 0, "0SYNC_GRAD", "0SYNC_GRAD 0SYNC_GRAD"), {}, True, "appears 2 times", "[0SYNC_GRAD]"),
    ("step-twice", _edit(GOOD, 0, "STEP", "STEP STEP"), {}, True, "2 STEP actions", "[STEP]"),
    ("step-missing", _edit(GOOD, 0, " STEP", ""), {}, True, "0 STEP actions", None),
    ("step-before-work", _edit(GOOD, 0, "0RECV_B0<1 0B0 0SYNC_GRAD STEP", "STEP 0RECV_B0<1 0B0 0SYNC_GRAD"), {},
     True, "STEP on worker 0 comes before", "[STEP]"),
    ("collective-order-mismatch", _edit(GOOD_CHIMERA, 1, "1SYNC_GRAD 0B1@1 0SYNC_GRAD@1", "0B1@1 0SYNC_GRAD@1 1SYNC_GRAD"),
     {"num_micro_batches": 2, "placement": _chimera2(), "pipe_of": (0, 1)}, True,
     "issue them in different orders", "[1SYNC_GRAD@1]"),
]


@pytest.mark.parametrize("rows, kwargs, complete, message, marked", [c[1:] for c in _BROKEN],
                         ids=[c[0] for c in _BROKEN])
def test_check_catches_hand_made_broken_schedule(rows, kwargs, complete, message, marked):
    with pytest.raises(ScheduleError) as info:
        check_schedule(make(rows, **kwargs), complete=complete)
    text = str(info.value)
    assert message in text
    assert "step W0" in text  # the grid is part of the message
    if marked is not None:
        assert marked in text


def test_complete_check_requires_communication_and_sync():
    with pytest.raises(ScheduleError, match="needs 0SEND_F0>1 after it"):
        check_schedule(make({0: "0F0 0B0", 1: "1F0 1B0"}))
    with pytest.raises(ScheduleError, match="never runs SYNC_GRAD"):
        check_schedule(add_communication(make({0: "0F0 0B0", 1: "1F0 1B0"})))
    check_schedule(make({0: "0F0 0B0", 1: "1F0 1B0"}), complete=False)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


# -- import boundaries -------------------------------------------------------------------------


def test_schedules_and_simulate_import_neither_torch_distributed_nor_runtime():
    code = (
        "import sys, pipefisher.schedules, pipefisher.simulate; "
        "assert 'torch.distributed' not in sys.modules, 'torch.distributed'; "
        "assert 'pipefisher.runtime' not in sys.modules, 'pipefisher.runtime'"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=root, env=env)
    assert result.returncode == 0, result.stderr


# -- Chimera with forward doubling (issue 26, item 1) -------------------------------------------


def _short(acts) -> str:
    return " ".join(f"{a.kind}{a.micro_batch}" for a in acts if a.kind.is_compute)


def test_chimera_doubling_reproduces_the_issue_example_on_worker_0():
    # Issue 26 (from the public Chimera code): D=4, N=8, the down pipe carries 0-3, the up pipe 4-7.
    s = chimera_doubling(4, 8)
    assert _short(s.actions[0]) == "F0 F1 F2 F3 F4 F5 B4 F6 F7 B5 B0 B6 B1 B7 B2 B3"
    assert s.pipe_of_micro_batch == (0, 0, 0, 0, 1, 1, 1, 1)
    # Worker 3 mirrors worker 0 (down and up pipe swapped: micro-batch j <-> j +- 4).
    mirror = {f"{k}{j}": f"{k}{(j + 4) % 8}" for k in "FB" for j in range(8)}
    assert _short(s.actions[3]) == " ".join(mirror[x] for x in _short(s.actions[0]).split())
    assert s.placement.stages_of(0) == [(0, 0, 0), (0, 1, 3)]


def test_chimera_doubling_runs_every_forward_slot_as_a_pair_on_the_outer_workers():
    # Worker 0 holds stage 0 of the down pipe: each of its forwards of a pipe comes in back-to-back pairs.
    for n in (8, 16):
        acts = [a for a in chimera_doubling(4, n).actions[0] if a.kind.is_compute]
        forwards = [i for i, a in enumerate(acts) if a.kind == K.FORWARD]
        assert all(acts[i + 1].kind == K.FORWARD and acts[i + 1].micro_batch == acts[i].micro_batch + 1
                   for i in forwards if acts[i].micro_batch % 2 == 0)


@pytest.mark.parametrize("d, n, w", [(2, 4, 1), (4, 8, 1), (4, 16, 2), (8, 16, 1), (8, 32, 1)])
def test_chimera_doubling_built_schedule_passes_the_checker_within_its_activation_bound(d, n, w):
    s = build_schedule("chimera-doubling", d, n, w)  # runs check_schedule
    bound = chimera_doubling_peaks(d)
    check_schedule(s, max_activations={dp * d + r: bound[r] for dp in range(w) for r in range(d)})
    assert compute_only(s) == {k: list(v) for k, v in chimera_doubling(d, n, w).actions.items()}


def test_checker_refuses_chimera_doubling_at_direct_concatenations_activation_bound():
    direct = peak_activations(build_schedule("chimera", 4, 8))  # 3 4 4 3
    assert [direct[w] for w in range(4)] == [3, 4, 4, 3]
    with pytest.raises(ScheduleError, match=r"worker 0 holds 4 micro-batch activations at 0F3, more than its bound 3"):
        check_schedule(build_schedule("chimera-doubling", 4, 8), max_activations=direct)


@pytest.mark.parametrize("stages, n, message", [
    (4, 4, "num_micro_batches=4: chimera with pipeline.chimera_stacking=doubling needs a multiple of 2 x stages = 8; "
           "use num_micro_batches=8, or pipeline.chimera_stacking=direct"),
    (4, 12, "use num_micro_batches=8 or 16"),
    (3, 6, "stages=3: chimera needs an even number of stages; use stages=2 or stages=4"),
])
def test_chimera_doubling_refuses_unsupported_shapes(stages, n, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_schedule("chimera-doubling", stages, n)
