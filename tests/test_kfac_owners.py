"""``optimizer.kfac_owners=replicas`` (issue 36, ``runtime.kfac_owners`` [Note: K-FAC owners among replicas]):
each layer a stage's replicas share is inverted and preconditioned once, by its owner; the parameters equal
``kfac_owners=holder``'s bit for bit (and so single-process training), with clipping on and off, on Chimera's
twins and on data-parallel copies; each replica does about half of the work."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipefisher.config import ConfigError
from pipefisher.optim.owners import plan_owners
from pipefisher.planning.costs import kfac_linear_dims
from pipefisher.runtime.build import kfac_assignment, run_shape, schedule_for
from pipefisher.runtime.checkpoint_io import config_fields, config_hash
from pipefisher.schedules.checks import ScheduleError, check_schedule
from pipefisher.schedules.ir import ActionKind
from pipefisher.schedules.passes import per_stage_steps
from pipefisher.schedules.kfac import Assignment, assignment_to_json, check_assignment
from pipefisher.runtime.kfac_owners import layer_cost, plan_owners
from tests.dist_harness import run_cases
from tests.test_optimizer_placement import OFF, ROLL_BACK, _cfg

STEPS = 5


def test_layer_cost_counts_both_inverses_and_the_preconditioning() -> None:
    assert layer_cost(4, 2) == 64 + 8 + 4 * 2 * 6
    assert layer_cost(2, 4) == layer_cost(4, 2)


def test_owners_take_the_most_expensive_layer_first_to_the_least_loaded_replica() -> None:
    # bert's six Linears per encoder layer: q, k, v, attention output [H, H], intermediate [4H, H], output [H, 4H]
    h = 8
    shapes = [(h, h)] * 4 + [(4 * h, h), (h, 4 * h)]
    assert plan_owners(shapes, 1) == [0] * 6
    owners = plan_owners(shapes, 2)
    assert owners[4] != owners[5]  # the two large layers on different replicas
    assert owners == [0, 1, 0, 1, 0, 1]  # then the small ones alternate, each to the lighter side
    loads = [sum(layer_cost(*s) for s, o in zip(shapes, owners) if o == m) for m in (0, 1)]
    assert loads[0] == loads[1]
    assert plan_owners(shapes, 8)[:6] == [2, 3, 4, 5, 0, 1]  # more replicas than large layers: one layer each
    with pytest.raises(ValueError, match="at least one replica"):
        plan_owners(shapes, 0)


def test_kfac_owners_is_validated_with_a_one_line_error_and_is_part_of_a_checkpoints_identity() -> None:
    with pytest.raises(ConfigError, match="optimizer.kfac_owners='all': choose one of holder, replicas"):
        _cfg("chimera", 2, 4, "kfac", "global", OFF, "optimizer.kfac_owners=all")
    with pytest.raises(ConfigError, match="optimizer.kfac_owners='replicas': needs sdp=1 and tp=1.*kfac_owners=holder"):
        _cfg("1f1b", 2, 4, "kfac", "global", OFF, "optimizer.kfac_owners=replicas", "sdp=2")
    holder = _cfg("chimera", 2, 4, "kfac", "global", OFF)
    replicas = _cfg("chimera", 2, 4, "kfac", "global", OFF, "optimizer.kfac_owners=replicas")
    assert "optimizer.kfac_owners" not in config_fields(holder)  # the default keeps old checkpoints' hash
    assert config_fields(replicas)["optimizer.kfac_owners"] == "replicas"
    assert config_hash(config_fields(holder)) != config_hash(config_fields(replicas))


DP = ("data_parallel=2",)
# (schedule, optimizer, placement, clip, extra): Chimera's twins (kfac every step, PipeFisher's plan), clipping
# that changes the step (ROLL_BACK: the global norm is above it), per-stage steps; 1F1B's data-parallel copies.
CASES = [("chimera", "kfac", "global", OFF), ("chimera", "kfac", "global", ROLL_BACK),
         ("chimera", "pipefisher", "global", ROLL_BACK), ("chimera", "pipefisher", "per_stage", ROLL_BACK),
         ("chimera", "ekfac", "global", ROLL_BACK), ("1f1b", "kfac", "global", ROLL_BACK, *DP)]
OWNERS = ("holder", "replicas")


def _owners_cfg(case: tuple, owners: str, *plan: str):
    method, optimizer, placement, clip, *extra = case
    return _cfg(method, 2, 4, optimizer, placement, clip, f"optimizer.kfac_owners={owners}", f"steps={STEPS}", *extra,
                *plan)


def _id(case: tuple) -> str:
    method, optimizer, placement, clip, *extra = case
    return "-".join([method, optimizer, placement, f"clip{clip:g}", *(["dp2"] if tuple(extra) == DP else [])])


def _one_plan(case: tuple, folder: Path) -> dict[str, tuple[str, ...]]:
    """PipeFisher: per arm, the plan file it runs (``optimizer.schedule``): ``replicas`` the plan the planner makes
    for it, ``holder`` :func:`_inverted_where_owned` of that plan. The planner prices owners ([Note: pricing
    owners]): a replica's INVERT of a layer it does not own costs nothing and may sit in another step than its
    owner's (where the runtime skips it), so holder's own plan and replicas' refresh some layers in other steps
    (other curvature ages, other numbers); the comparison is of the owners' arithmetic on one refresh cycle."""
    if case[1] != "pipefisher":
        return {owners: () for owners in OWNERS}
    cfg = _owners_cfg(case, "replicas")
    planned = kfac_assignment(cfg, schedule_for(cfg))
    plans = {"replicas": planned, "holder": _inverted_where_owned(planned, cfg)}
    return {owners: (f"optimizer.schedule={assignment_to_json(plan, folder / f'{_id(case)}-{owners}.json')}",)
            for owners, plan in plans.items()}


def _inverted_where_owned(a: Assignment, cfg) -> Assignment:
    """``a`` with every layer inverted by all replicas of its stage in the step its owner inverts it (the owner's
    INVERT kept, copies put before the others' final STEP), the non-owners' INVERTs dropped: what ``holder`` must
    run to compute what ``replicas`` computes with ``a``."""
    run = run_shape(cfg)
    owner = [plan_owners([(o, i) for i, o in kfac_linear_dims(run.bert, n)], 2) for n in run.encoder_layers]
    phases = []
    for phase in a.phases:
        placement = phase.placement
        where = {(p, s): w for (_, p, s), w in placement.workers.items()}
        owned = []
        for w, acts in phase.actions.items():
            for x in acts:
                if x.kind == ActionKind.INVERT:
                    assert x.layer is not None, "per-layer INVERT units expected"
                    members = placement.replicas_of_stage(x.stage)
                    if members.index(w) == owner[x.stage][x.layer]:
                        owned.append(x)
        actions = {}
        for w, acts in phase.actions.items():
            copies = [replace(x, pipe=p) for x in owned for (p, s), v in where.items()
                      if s == x.stage and v == w and p != x.pipe]
            kept = [x for x in acts[:-1] if x.kind != ActionKind.INVERT or x in owned]
            actions[w] = (*kept, *copies, acts[-1])
        phases.append(replace(phase, actions=actions))
    out = replace(a, phases=tuple(phases))
    check_assignment(out)
    return out


@pytest.fixture(scope="module")
def owner_results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict[str, dict]]:
    results = {}
    plans = tmp_path_factory.mktemp("plans")
    for cases in ([c for c in CASES if c[4:] != DP], [c for c in CASES if c[4:] == DP]):  # one spawn per world
        files = {c: _one_plan(c, plans) for c in cases}
        out = run_cases([(_owners_cfg(c, owners, *files[c][owners]), STEPS) for c in cases for owners in OWNERS],
                        tmp_path_factory.mktemp("kfac_owners"))
        results.update({c: dict(zip(OWNERS, out[2 * i:2 * i + 2])) for i, c in enumerate(cases)})
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kfac_owners_replicas_equals_holder_bit_for_bit_with_half_the_work(case, owner_results) -> None:
    holder, owners = owner_results[case]["holder"], owner_results[case]["replicas"]
    for r in holder:
        assert owners[r]["losses"] == holder[r]["losses"]
        assert owners[r]["rollbacks"] == holder[r]["rollbacks"]
        assert owners[r]["curvature_age"] == holder[r]["curvature_age"]  # the owners' ages reach every replica
        for name, value in holder[r]["params"].items():
            torch.testing.assert_close(owners[r]["params"][name], value, rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
        for name, value in holder[r]["grads"].items():  # the first step's gradients, preconditioned where owned
            torch.testing.assert_close(owners[r]["grads"][name], value, rtol=0, atol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
    inverted = [holder[r]["kfac_work"][0] for r in sorted(holder)], [owners[r]["kfac_work"][0] for r in sorted(owners)]
    preconditioned = ([holder[r]["kfac_work"][1] for r in sorted(holder)],
                      [owners[r]["kfac_work"][1] for r in sorted(owners)])
    assert all(n > 0 for n in inverted[0] + preconditioned[0])  # K-FAC acted in these steps
    # every replica pair shares each layer: together the replicas do one holder's share, split evenly
    group = 2
    assert sum(inverted[1]) * group == sum(inverted[0])
    assert sum(preconditioned[1]) * group == sum(preconditioned[0])
    assert max(inverted[1]) < max(inverted[0]) and max(preconditioned[1]) < max(preconditioned[0])


def test_stage_steps_follow_every_precond_of_their_worker_when_owners_exchange() -> None:
    """[Note: stage steps after the exchanges]: PipeFisher's plan for Chimera D=2 with owners, stepped per stage.
    Placed as for holder (each STEP right after its own PRECOND), a worker's stage STEP waits for a twin whose
    PRECOND comes after its own STEP of the other stage: the checker, told PRECOND is an exchange, finds the
    deadlock (CI's run of this file hung there until gloo's timeout); placed with ``exchanges=True`` every phase
    passes, and holder's rule is unchanged."""
    cfg = _owners_cfg(CASES[3], "replicas")
    assignment = kfac_assignment(cfg, schedule_for(cfg))
    deadlocked = 0
    for phase in assignment.phases:
        check_schedule(per_stage_steps(phase, exchanges=True), kfac=True, exchanges=True)
        holder_order = per_stage_steps(phase)
        check_schedule(holder_order, kfac=True)  # without exchanges there is nothing to wait for
        try:
            check_schedule(holder_order, kfac=True, exchanges=True)
        except ScheduleError as err:
            assert "owners' exchanges" in str(err)
            deadlocked += 1
        for w, acts in per_stage_steps(phase, exchanges=True).actions.items():
            kinds = [(x.kind, x.stage) for x in acts]
            last_precond = max(i for i, (k, _) in enumerate(kinds) if k == ActionKind.PRECOND)
            assert all(i > last_precond for i, (k, s) in enumerate(kinds) if k == ActionKind.STEP)
    assert deadlocked >= 1
    check_assignment(replace(assignment, phases=tuple(per_stage_steps(p, exchanges=True) for p in assignment.phases)),
                     exchanges=True)


def test_a_non_owners_invert_leaves_the_factor_all_reduce_to_the_end_of_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a non-owner does not wait] (``runtime.kfac_work``): a replica's INVERT of a layer it does not own
    waits for no all-reduce (its own layer's INVERT does), and the end of the step folds the one left in flight, so
    the replica's running factors are what folding at INVERT gave them."""
    import torch

    from pipefisher.optim import KFACPreconditioner
    from pipefisher.runtime import kfac_work
    from pipefisher.schedules import Action

    waits: list[tuple[str, ...]] = []

    class InFlight:  # a one-replica "all-reduce": the sum is the tensor itself; records who waits
        def __init__(self, tensors, names):
            self.tensors, self.names = tensors, names

        def wait(self) -> None:
            waits.append(self.names)

        def finish(self):
            self.wait()
            return self.tensors

    class Pair:  # the stage's group: two replicas
        def size(self) -> int:
            return 2

    def run_step(owned):
        torch.manual_seed(0)
        layers = {"a": torch.nn.Linear(3, 4), "b": torch.nn.Linear(4, 2)}
        work = kfac_work.KfacWork({(0, 0): KFACPreconditioner(layers, include=None)}, {0: Pair()},
                                  deferred=False, owned=owned)
        names: list[tuple[str, ...]] = []  # the layer of each SYNC_FACTOR started, in order
        monkeypatch.setattr(kfac_work.FlatAllReduce, "start",
                            staticmethod(lambda tensors, group: InFlight(tensors, names[-1])))
        actions = [Action.from_str(s) for s in ("0CURV_A0#0", "0CURV_A0#1", "0CURV_B0#0", "0CURV_B0#1")]
        work.begin_step(actions, phase=0, step=0)
        with work.forward((0, 0), 0):
            out = layers["b"](torch.tanh(layers["a"](torch.randn(5, 3))))
        out.square().sum().backward()
        for a in actions:
            work.run(a)
        waited = {}
        for layer, name in enumerate("ab"):
            names.append((name,))
            work.run(Action.from_str(f"0SYNC_FACTOR#{layer}"))
        for layer, name in enumerate("ab"):
            invert = Action.from_str(f"0INVERT#{layer}")
            waited[name] = work.wait_for_syncs(invert)
            work.run(invert)
        before_end = list(waits)
        work.end_step()
        pre = work.pre[(0, 0)]
        return waited, before_end, [t.clone() for n in "ab" for t in (pre.layer(n).a, pre.layer(n).b)], work.inverted

    waits.clear()
    waited, before_end, factors, inverted = run_step({(0, 0): frozenset({"a"})})
    assert waited == {"a": True, "b": False} and inverted == 1
    assert ("b",) not in before_end and waits[-1] == ("b",)  # b's all-reduce waited for at the end of the step
    waits.clear()
    waited_all, _, factors_all, inverted_all = run_step(None)  # holder: every INVERT waits for its layer's
    assert waited_all == {"a": True, "b": True} and inverted_all == 2
    for mine, every in zip(factors, factors_all):
        assert torch.equal(mine, every)
