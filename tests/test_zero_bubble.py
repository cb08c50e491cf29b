"""Zero-bubble schedules: the split backward (I, W) in the IR, the checker, the simulator (against
closed forms and the lower bound), the generators, and the executor's deferred weight gradients
(against a plain backward). Whole-pipeline equivalence with single-process training is in
``test_pipeline_equivalence.py`` and ``test_pipeline_kfac.py``."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from pipefisher.model import BertConfig, build_full_model
from pipefisher.runtime.split_backward import apply_weight_grads, deferring, enable_split_backward
from pipefisher.schedules import build_schedule
from pipefisher.schedules.checks import ScheduleError, check_schedule
from pipefisher.schedules.generators import one_f_one_b
from pipefisher.schedules.ir import Action, ActionKind, Placement, Schedule
from pipefisher.schedules.zero_bubble import merge_adjacent_backwards, zb_h1, zb_v
from pipefisher.simulate import CostModel, peak_activations, simulate
from pipefisher.data.synthetic import SyntheticSource

K = ActionKind
U = 1000  # one cost unit in ns


def _span(schedule: Schedule, cost: CostModel) -> int:
    events = simulate(schedule, cost)
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


# -- the IR ------------------------------------------------------------------------------------


def test_split_actions_round_trip_through_their_string_form() -> None:
    for text in ("1I4", "1W4", "3I2@1", "0W0"):
        assert str(Action.from_str(text)) == text
    assert Action.from_str("2INVERT#1").kind == K.INVERT  # "I" does not shadow INVERT
    assert K.BACKWARD_INPUT.is_input_backward and K.BACKWARD.is_input_backward
    assert not K.BACKWARD_WEIGHT.is_input_backward and K.BACKWARD_WEIGHT.is_compute


# -- simulator against closed forms ----------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3, 4, 8])
@pytest.mark.parametrize("n_per_d", [1, 2, 4])
def test_zb_h1_step_is_the_closed_form(d: int, n_per_d: int) -> None:
    # Qi et al. 2024, Sec. 2.1: with F = I = W, ZB-H1's bubble is (D-1)(F+I-W), a third of 1F1B's
    # (D-1)(F+I+W).
    n = n_per_d * d
    cost = CostModel.uniform(d, U, 2 * U, input_grad_ns=U, weight_grad_ns=U)
    assert _span(zb_h1(d, n, merge=False), cost) == n * 3 * U + (d - 1) * (U + U - U)
    assert _span(one_f_one_b(d, n), cost) == n * 3 * U + (d - 1) * 3 * U


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.parametrize("n_per_d", [2, 3, 4])
def test_zb_v_step_is_the_lower_bound_with_equal_costs(d: int, n_per_d: int) -> None:
    # Lower bound of a synchronous step: N(F+I+W) + (D-1)F/v with v = 2 chunks; a chunk costs
    # half a worker-share (f = F/2 ...).
    n = n_per_d * d
    f = U // 2
    cost = CostModel.uniform(2 * d, f, 2 * f, input_grad_ns=f, weight_grad_ns=f)
    assert _span(zb_v(d, n, merge=False), cost) == n * 3 * U + (d - 1) * U // 2


@pytest.mark.parametrize("d", [2, 4, 8])
def test_activation_memory_stays_at_one_f_one_b_peak(d: int) -> None:
    # ZB-H1: every stage holds up to D micro-batches between F and W, 1F1B's peak (its first
    # stage); ZB-V: 2D chunk activations, i.e. D micro-batches of a worker's share of the model.
    n = 4 * d
    assert max(peak_activations(one_f_one_b(d, n)).values()) == d
    assert set(peak_activations(zb_h1(d, n, merge=False)).values()) == {d}
    assert max(peak_activations(zb_v(d, n, merge=False)).values()) <= 2 * d


def test_merging_joins_only_pairs_nobody_waits_for() -> None:
    split = zb_v(2, 4, merge=False)
    merged = merge_adjacent_backwards(split)
    everywhere = merge_adjacent_backwards(split, everywhere=True)
    where = split.placement.workers
    for w, acts in merged.actions.items():
        for a in acts:
            if a.kind == K.BACKWARD:  # a merged pair sends its gradient to nobody else
                assert a.stage == 0 or where[(0, 0, a.stage - 1)] == w
    count = lambda s: sum(a.kind == K.BACKWARD for acts in s.actions.values() for a in acts)  # noqa: E731
    assert 0 < count(merged) < count(everywhere)
    for s in (merged, everywhere):
        check_schedule(add_all(s))
    # Merging where a remote stage waits delays it: simulated with I + W = 1.1 B.
    cost = CostModel.uniform(4, U, 2 * U, input_grad_ns=1200, weight_grad_ns=1000)
    assert _span(merged, cost) <= _span(split, cost) < _span(everywhere, cost)


def add_all(schedule: Schedule) -> Schedule:
    from pipefisher.schedules.passes import add_communication, add_grad_sync_and_step
    return add_grad_sync_and_step(add_communication(schedule))


@pytest.mark.parametrize("method", ["zb-h1", "zb-v"])
@pytest.mark.parametrize("d,n,w", [(2, 4, 1), (2, 8, 2), (4, 8, 1), (4, 16, 2)])
def test_built_schedules_pass_the_checker(method: str, d: int, n: int, w: int) -> None:
    s = build_schedule(method, d, n, w, **({"num_virtual": 2} if method == "zb-v" else {}))
    assert s.num_stages == (2 * d if method == "zb-v" else d)
    for acts in s.actions.values():  # the SYNC_GRAD of a replica follows its last B or W
        for a in acts:
            if a.kind == K.SYNC_GRAD:
                i = acts.index(a)
                assert not any(x.kind in (K.BACKWARD, K.BACKWARD_WEIGHT, K.BACKWARD_INPUT) and x.stage == a.stage
                               for x in acts[i + 1:])


def test_zb_v_refuses_too_few_micro_batches() -> None:
    with pytest.raises(ValueError, match="num_micro_batches=6: zb-v needs at least 2 x stages = 8 .*num_micro_batches=8"):
        zb_v(4, 6)


# -- checker rules ----------------------------------------------------------------------------


def _edit(schedule: Schedule, worker: int, actions: list[Action]) -> Schedule:
    return replace(schedule, actions={**schedule.actions, worker: tuple(actions)})


def test_checker_rejects_a_w_before_its_own_i() -> None:
    s = zb_h1(2, 2, merge=False)
    acts = list(s.actions[0])
    i, w = acts.index(Action(K.BACKWARD_INPUT, 0, 0)), acts.index(Action(K.BACKWARD_WEIGHT, 0, 0))
    acts[i], acts[w] = acts[w], acts[i]
    with pytest.raises(ScheduleError, match="0W0 on worker 0 runs before its own I"):
        check_schedule(_edit(s, 0, acts), complete=False)


def test_checker_rejects_a_backward_that_is_both_full_and_split() -> None:
    s = zb_h1(2, 2, merge=False)
    acts = list(s.actions[0]) + [Action(K.BACKWARD, 0, 1)]
    with pytest.raises(ScheduleError, match="0B1 and 0I1 both on worker 0"):
        check_schedule(_edit(s, 0, acts), complete=False)


def test_checker_rejects_an_i_without_its_w() -> None:
    s = zb_h1(2, 2, merge=False)
    acts = [a for a in s.actions[1] if a != Action(K.BACKWARD_WEIGHT, 1, 1)]
    with pytest.raises(ScheduleError, match="1W1 is missing on worker 1"):
        check_schedule(_edit(s, 1, acts), complete=False)


def test_checker_rejects_an_activation_gradient_sent_before_its_i() -> None:
    s = add_all(zb_h1(2, 2, merge=False))
    acts = list(s.actions[1])
    send = next(a for a in acts if a.kind == K.SEND_B)
    i = acts.index(Action(K.BACKWARD_INPUT, send.stage, send.micro_batch))
    acts.remove(send)
    acts.insert(i, send)
    with pytest.raises(ScheduleError, match=f"{send} on worker 1 must come after"):
        check_schedule(_edit(s, 1, acts))


def test_checker_rejects_torch_one_f_one_b_export_with_shifted_forwards() -> None:
    # torch 2.13's Schedule1F1B._get_pipeline_order exports the last rank's forwards as F1..F4
    # instead of F0..F3 (D=2, N=4), which its own _validate_schedule rejects; written here as our
    # schedule data, our checker must reject it too.
    rank0 = [Action(K.FORWARD, 0, j) for j in range(2)] + [
        Action(K.BACKWARD, 0, 0), Action(K.FORWARD, 0, 2), Action(K.BACKWARD, 0, 1), Action(K.FORWARD, 0, 3),
        Action(K.BACKWARD, 0, 2), Action(K.BACKWARD, 0, 3)]
    shifted = [Action(K.FORWARD, 1, j + 1) for j in range(4)]
    rank1 = [x for pair in zip(shifted, [Action(K.BACKWARD, 1, j) for j in range(4)]) for x in pair]
    placement = Placement(2, 1, 1, {(0, 0, 0): 0, (0, 0, 1): 1})
    s = Schedule("torch-1f1b-export", 2, 4, placement, {0: tuple(rank0), 1: tuple(rank1)}, (0,) * 4)
    with pytest.raises(ScheduleError, match="1F4 on worker 1: micro-batch out of range"):
        check_schedule(s, complete=False)


# -- deferred weight gradients against a plain backward ------------------------------------------


@pytest.mark.parametrize("recompute", [False, True])
def test_i_then_w_gives_the_gradients_of_one_backward(recompute: bool) -> None:
    # The whole model as one stage: the MLM decoder's weight is the word embeddings' (tied), so
    # its gradient is the sum of the lookup's (in I) and the decoder's (deferred to W), once each
    # (pytorch#180952 reports shared weights counted twice under split backward).
    config = BertConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=600, hidden_dropout=0.0,
                        attention_dropout=0.0)
    plain = build_full_model(config, seed=3, recompute=recompute)
    split = copy.deepcopy(plain)
    # Linear: 6 per encoder layer; pooler, transform, decoder, NSP. Embedding: word, position, token type.
    assert enable_split_backward([split]) == 2 * 6 + 4 + 3
    assert split.cls.predictions.decoder.weight is split.bert.embeddings.word_embeddings.weight
    source = SyntheticSource(seq_len=16, max_predictions=3, vocab_size=600, seed=0)
    batches = [source.get_samples(range(4 * j, 4 * j + 4)) for j in range(2)]
    for b in batches:
        plain(None, b).sum().backward()
    stores = []
    for b in batches:  # I, I, then W, W: the order a zero-bubble schedule may run them in
        with deferring([]) as store:
            split(None, b).sum().backward()
        stores.append(store)
        assert split.bert.encoder.layer["0"].attention.self.query.weight.grad is None  # deferred
    for store in stores:
        apply_weight_grads(store)
    for (name, p), (_, q) in zip(plain.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _qkv_inputs_filed(precision: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One I (under bf16 autocast or in fp32) of a one-layer BERT: the x operands filed for layer 0's
    query, key and value, and the weight gradients of I + W and of a plain backward (same autocast)."""
    config = BertConfig(num_layers=1, hidden_size=32, num_heads=2, vocab_size=600, hidden_dropout=0.0,
                        attention_dropout=0.0)
    plain = build_full_model(config, seed=3)
    split = copy.deepcopy(plain)
    enable_split_backward([split])
    batch = SyntheticSource(seq_len=16, max_predictions=3, vocab_size=600, seed=0).get_samples(range(4))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        loss = plain(None, batch).sum()
    loss.backward()
    with deferring([]) as store, autocast:
        loss = split(None, batch).sum()
    with deferring(store):
        loss.backward()
    attention = split.bert.encoder.layer["0"].attention.self
    qkv = {id(attention.query.weight), id(attention.key.weight), id(attention.value.weight)}
    xs = [x for param, _, x in store if id(param) in qkv]
    apply_weight_grads(store)
    grads = {n: p.grad for n, p in split.named_parameters()}
    return xs, grads, {n: p.grad for n, p in plain.named_parameters()}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shared_qkv_input_is_filed_once_and_w_equals_a_plain_backward(precision: str) -> None:
    """Defect 3 (issue 25): under bf16 the store held a bf16 copy of the shared Q/K/V input per layer
    (3 distinct storages); it holds the forward's saved input, one fp32 storage, and casts in W."""
    xs, split_grads, plain_grads = _qkv_inputs_filed(precision)
    assert len(xs) == 3
    assert len({x.untyped_storage().data_ptr() for x in xs}) == 1
    assert {x.dtype for x in xs} == {torch.float32}  # as the forward saved it: no copy under autocast
    for name, grad in plain_grads.items():  # cast-then-multiply in W is what autocast's backward does
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# -- zb-v's order: costs and memory --------------------------------------------------------------


def test_zb_v_order_by_measured_costs_and_more_memory_approach_the_bound() -> None:
    # With I > W (measured on CPU BERT stages: I ~ 1.2 F, W ~ F) the unit-cost order at 1F1B's
    # memory is a few per cent over the bound; ordering by the real costs and, more so, a larger
    # activation bound close the gap.
    d, n = 4, 8
    f, i, w = 500, 600, 500  # per chunk
    cost = CostModel.uniform(2 * d, f, i + w, input_grad_ns=i, weight_grad_ns=w)
    bound = n * 2 * (f + i + w) + (d - 1) * f
    unit = _span(zb_v(d, n, merge=False), cost)
    ordered = _span(zb_v(d, n, merge=False, order_costs=(f, i, w)), cost)
    roomy = _span(zb_v(d, n, merge=False, order_costs=(f, i, w), activation_memory=1.5), cost)
    assert bound < unit and ordered <= unit and roomy <= ordered
    assert roomy <= 1.01 * bound
    assert max(peak_activations(zb_v(d, n, merge=False, order_costs=(f, i, w))).values()) <= 2 * d
    assert max(peak_activations(zb_v(d, n, merge=False, activation_memory=1.5)).values()) <= 3 * d


@pytest.mark.parametrize("overrides,message", [
    (["pipeline=1f1b", "pipeline.activation_memory=1.5"], "pipeline.activation_memory=1.5: only pipeline=zb-v"),
    (["pipeline=zb-v", "stages=2", "pipeline.order_costs=[1,0,1]"], "pipeline.order_costs=[1.0, 0.0, 1.0]: give three positive"),
    (["pipeline=zb-v", "stages=2", "pipeline.activation_memory=0.5"], "pipeline.activation_memory=0.5: a multiple of 1F1B"),
    (["pipeline=zb-v", "stages=2", "num_micro_batches=3"], "num_micro_batches=3: zb-v needs at least 2 x stages = 4"),
    (["pipeline=zb-v", "stages=2", "pipeline.num_virtual=1"], "pipeline.num_virtual=1: zb-v places exactly 2"),
])
def test_zero_bubble_config_errors_name_the_field_and_the_fix(overrides: list[str], message: str) -> None:
    from pipefisher.config import ConfigError
    from tests.conftest import compose_train
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compose_train(overrides)


def test_num_micro_batches_auto_fills_the_v() -> None:
    from tests.conftest import compose_train
    assert compose_train(["pipeline=zb-v", "stages=2"]).num_micro_batches == 4
    assert compose_train(["pipeline=zb-h1", "stages=2"]).num_micro_batches == 2


def test_schedule_py_recognizes_zero_bubble_profiles_whatever_their_order() -> None:
    # A zb-v run orders its V by its model's stage costs, and which I+W pairs merge depends on that
    # order: inference from a profile's actions must still name zb-v (and zb-h1 by its order).
    from pipefisher.planning.infer import infer_shape
    cost = CostModel.uniform(4, U, 2 * U)
    tuned = build_schedule("zb-v", 2, 8, num_virtual=2, stage_costs=[0.05, 1, 2, 2.4])
    assert tuned.actions != build_schedule("zb-v", 2, 8, num_virtual=2).actions
    shape = infer_shape(simulate(tuned, cost))
    # at D=2 v-min's and v-half's caps are zb-v's 2D: the same schedule, named after zb-v first
    assert (shape.methods, shape.stages, shape.num_micro_batches, shape.num_virtual) == (("zb-v", "v-min", "v-half"), 2, 8, 2)
    h1 = infer_shape(simulate(build_schedule("zb-h1", 2, 4), CostModel.uniform(2, U, 2 * U)))
    assert "zb-h1" in h1.methods and (h1.stages, h1.num_micro_batches) == (2, 4)


def test_the_planner_and_train_py_build_the_same_zb_v_schedule() -> None:
    from pipefisher.runtime.worker import run_shape, schedule_for
    from tests.conftest import compose_train
    cfg = compose_train(["pipeline=zb-v", "stages=2", "model=bert-mini", "num_micro_batches=8"])
    from pipefisher.planning.costs import RunShape
    from dataclasses import asdict
    from_profile = RunShape.from_train_config(asdict(cfg))  # what schedule.py reads from profile.sqlite
    assert from_profile.partition == run_shape(cfg).partition
    assert from_profile.build_schedule().actions == schedule_for(cfg).actions


@pytest.mark.parametrize("method", ["zb-h1", "zb-v"])
def test_curvature_beside_w_runs_after_the_micro_batchs_w(method: str) -> None:
    # [Note: curvature beside W]: every CURV_A/CURV_B of a micro-batch runs after that micro-batch's
    # W (or its merged B) on the same worker; after_capture lets CURV_B run right after the I.
    from pipefisher.planning.assign import plan_pipefisher
    from pipefisher.schedules.kfac import kfac_layer_counts
    schedule = build_schedule(method, 2, 4, **({"num_virtual": 2} if method == "zb-v" else {}))
    layers = kfac_layer_counts(schedule, [1] * schedule.num_stages)
    cost = CostModel.uniform(schedule.num_stages, 10 * U, 20 * U, input_grad_ns=11 * U, weight_grad_ns=9 * U,
                             kfac_layers=6, curv_a_ns=U, curv_b_ns=U, invert_ns=2 * U, precond_ns=U)
    for placement, after in (("beside_w", (K.BACKWARD_WEIGHT, K.BACKWARD)),
                             ("after_capture", (K.BACKWARD_INPUT, K.BACKWARD, K.FORWARD))):
        plan = plan_pipefisher(schedule, cost, layers, curvature_placement=placement)
        assert plan.metadata["curvature_placement"] == placement
        seen = 0
        for phase in plan.phases:
            for acts in phase.actions.values():
                for i, a in enumerate(acts):
                    if a.kind in (K.CURV_A, K.CURV_B):
                        seen += 1
                        before = {(x.kind, x.stage, x.micro_batch) for x in acts[:i]}
                        assert any((k, a.stage, a.micro_batch) in before for k in after), (placement, a)
                        if placement == "beside_w":
                            assert ((K.BACKWARD_WEIGHT, a.stage, a.micro_batch) in before
                                    or (K.BACKWARD, a.stage, a.micro_batch) in before), a
        assert seen > 0
