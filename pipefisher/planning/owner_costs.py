"""What K-FAC's work costs each replica when every layer has one owner (``optimizer.kfac_owners=replicas``).

Entry point: :func:`with_owners` (a cost model priced the way ``runtime.kfac_owners`` runs).

[Note: pricing owners]
Under ``kfac_owners=replicas`` a stage held by several replicas (Chimera's twins) has each K-FAC layer inverted
and preconditioned by one owner (``optim.owners.plan_owners``, the same function the runtime calls, over the same
members: the stage's workers in rank order, ``Placement.replicas_of_stage``); the other replicas run that layer's
INVERT as a no-op, precondition only their own layers at PRECOND, and one exchange of the stage's K-FAC
gradients (an all-gather of each member's own layers, or where that moves more, an all-reduce of all of them,
the others' zeroed: ``optim.owners.exchange_gathers``), started at PRECOND and waited for before STEP, gives
every replica every layer's preconditioned gradient (``runtime.kfac_owners`` [Note: K-FAC owners among
replicas]). Priced here as:

    INVERT of (stage, layer) on a replica      the holder's cost if it owns the layer, else 0
    PRECOND of a stage on a replica            its owned layers' share of the stage's PRECOND, split over the
                                               layers by their FLOPs 2·in·out·(in + out) (``planning.costs``)
    the exchange (``CostModel.exchange_ns``)   with the search's collective model (``comm``): the all-gather of
                                               g pieces of at most P parameters, or the all-reduce of the S K-FAC
                                               parameters, at its latency and bandwidth (``exchange_seconds``);
                                               from a cost model alone (a profile, train.py's estimate): the
                                               stage's gradient all-reduce × what the exchange moves against it
                                               (``exchange_share``: g·P/2p or S/p of the stage's p parameters);
                                               after the last replica's PRECOND; STEP waits for it

Before this the planner priced every replica's INVERT and PRECOND under ``replicas`` as under ``holder``, so the
step it predicted (and the k it chose) was that of work the run does not do (bench/studies/16: the run halves
INVERT and the exchange takes back half of what that saves). A stage with one replica, or without K-FAC layers,
is priced as before.

[Note: owners across data-parallel copies]
With ``data_parallel`` > 1 a stage's replicas include every copy's workers, and train.py plans owners over all of
them (``runtime.build.kfac_assignment`` plans the schedule the worker runs, which holds every group): at dp=2 a
Chimera stage has four members, a 1F1B stage two. The search simulates one copy for every other candidate (the
copies run the same actions on the same costs; holder's plan of every copy predicts the one copy's k and step,
tested for 1F1B and Chimera at dp=2), but a ``replicas`` plan differs per copy (each copy inverts its own
share of the layers), so the search plans and simulates it on the schedule of every copy
(``strategy_search._evaluate``) and ``strategy_plan`` writes that plan: the step ranked is the step of the plan
the strategy file carries. Before this the search ranked ``replicas`` on the one copy only (Chimera's twins, two
members at any dp) and not at all on one-pipe schedules with dp > 1, where train.py's plan has as many members
as copies. Measured on one stage with two copies: bench/studies/16-optimizer-placement.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipefisher.optim.owners import exchange_gathers, plan_owners
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import RunShape, kfac_linear_dims, stage_parameters
from pipefisher.schedules import Placement, Schedule
from pipefisher.simulate import CostModel

__all__ = ["doubly_held_stage", "exchange_seconds", "exchange_share", "shares_a_stage", "with_owners"]


def doubly_held_stage(placement: Placement) -> int | None:
    """The first stage one worker holds two replicas of (owners are planned per worker of a stage's group, so
    ``kfac_owners=replicas`` is refused there), or None."""
    for stage in range(placement.num_stages):
        holders = [w for (_, _, s), w in placement.workers.items() if s == stage]
        if len(holders) != len(set(holders)):
            return stage
    return None


def shares_a_stage(placement: Placement) -> bool:
    """Whether some stage has replicas on several workers, none holding two: where owners differ from holders."""
    return doubly_held_stage(placement) is None and any(
        len(placement.replicas_of_stage(s)) > 1 for s in range(placement.num_stages))


def exchange_share(dims: Sequence[tuple[int, int]], owner: Sequence[int], stage_params: int, members: int) -> float:
    """The owners' exchange as a fraction of the stage's gradient all-reduce (same bytes per second): a ring
    all-reduce of the stage's p parameters moves 2(g − 1)/g · p per member; the exchange moves (g − 1)·P, P the
    largest member's K-FAC parameters, as an all-gather, or 2(g − 1)/g · S, S all of them, as an all-reduce,
    whichever ``exchange_gathers`` picks (the runtime's choice). ``dims``: (in, out) per K-FAC layer; ``owner``:
    each one's member (``plan_owners``); 0 for one member or no parameters."""
    if members <= 1 or stage_params <= 0:
        return 0.0
    piece = [0] * members
    for (i, o), m in zip(dims, owner):
        piece[m] += i * o + o
    moved = members * max(piece) if exchange_gathers(piece) else 2 * sum(piece)
    return moved / (2 * stage_params)


def exchange_seconds(dims: Sequence[tuple[int, int]], owner: Sequence[int], members: int, comm: CommCosts) -> float:
    """The owners' exchange under ``comm``'s collective model (measured latency and bandwidth where it has them):
    an all-gather of ``members`` pieces padded to the largest (4 bytes per parameter; ``comm`` counts the gathered
    output), or where ``exchange_gathers`` picks it an all-reduce of all the K-FAC parameters."""
    if members <= 1:
        return 0.0
    piece = [0] * members
    for (i, o), m in zip(dims, owner):
        piece[m] += i * o + o
    if exchange_gathers(piece):
        return comm.seconds("all_gather", members, 4.0 * members * max(piece))
    return comm.seconds("all_reduce", members, 4.0 * sum(piece))


def with_owners(cost: CostModel, schedule: Schedule, run: RunShape, comm: CommCosts | None = None) -> CostModel:
    """``cost`` with each layer's INVERT and PRECOND on its owner only, and the owners' exchange ([Note: pricing
    owners]): by ``comm``'s collective model where given (the search's: its latency counts, which the scaled
    gradient all-reduce leaves out), else the stage's gradient all-reduce scaled by ``exchange_share``.

    Raises:
        ValueError: ``cost`` has no K-FAC tables, or a worker holds two replicas of one stage (the runtime refuses
            owners there too).
    """
    if cost.kfac_layers is None:
        raise ValueError("kfac_owners=replicas: the cost model has no K-FAC unit costs to divide among owners")
    placement = schedule.placement
    stage = doubly_held_stage(placement)
    if stage is not None:
        raise ValueError(f"kfac_owners=replicas: a worker holds two replicas of stage {stage}; owners are planned "
                         f"per worker of a stage's group: use optimizer.kfac_owners=holder")
    params = stage_parameters(run.bert, run.partition)
    owners, precond, exchange = [], [], []
    for stage, n in enumerate(run.encoder_layers):
        dims = kfac_linear_dims(run.bert, n)  # (in, out) per layer
        if len(dims) != cost.kfac_layers[stage]:
            raise ValueError(f"kfac_owners=replicas: stage {stage} has {len(dims)} K-FAC layers by the model, "
                             f"{cost.kfac_layers[stage]} by the cost model; price the run's own shape")
        members = len(placement.replicas_of_stage(stage))
        plan = plan_owners([(o, i) for i, o in dims], members)
        owners.append(tuple(plan))
        flops = [2 * i * o * (i + o) for i, o in dims]
        total = sum(flops)
        precond.append(tuple(round(cost.precond_ns[stage] * f / total) for f in flops) if total else ())
        exchange.append(round(exchange_seconds(dims, plan, members, comm) * 1e9) if comm is not None else
                        round(cost.sync_ns[stage] * exchange_share(dims, plan, params[stage], members)))
    return replace(cost, kfac_owner=tuple(owners), precond_layer_ns=tuple(precond), exchange_ns=tuple(exchange))
