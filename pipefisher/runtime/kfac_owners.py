"""K-FAC layer owners among a stage's replicas (``optimizer.kfac_owners=replicas``, issue 36).

Entry points: :func:`plan_owners` (who inverts and preconditions which layer, a pure function) and
:func:`owned_layers` (this worker's share, per stage replica); ``runtime.kfac_work.KfacWork`` performs it.

[Note: K-FAC owners among replicas]
A stage held by several replicas (Chimera's two pipes, data-parallel copies) has, after its gradient all-reduce
and its factor all-reduce, the same gradients and the same factors on every replica, so every replica computes
the same inverses (INVERT) and the same preconditioned gradients (PRECOND): Chimera's twins do a stage's K-FAC
work twice, and at D=2 Chimera has no bubble to hide it in (bench/studies/16-optimizer-placement.md: PipeFisher's
step 1.10–1.13× NVLAMB's there). With ``kfac_owners=replicas`` each layer of the stage gets one owner among the
stage's replicas (:func:`plan_owners`: the most expensive layer first, to the least loaded replica; cost ∝ the
INVERT and PRECOND FLOPs of an [O, I] layer, O³ + I³ + O·I·(O + I)). Only the owner inverts the layer; at PRECOND
each replica preconditions the layers it owns (after recording the others' gradient norms, which the clip reads:
``clip_before_precondition``), and one collective over the stage's group, started at PRECOND and waited for
before the STEP that reads the gradients, copies every layer's preconditioned gradient from its owner to the
others: an all-gather (``runtime.flat_all_gather``: each member's own layers packed into one piece, padded to the
largest), or where that would move more bytes (``optim.owners.exchange_gathers``: many members, few layers) an
all-reduce (a sum) with the others' layers zeroed, x + 0 = x exactly. So every replica's gradients equal the
owner's, which are bit for bit what each replica computes with ``holder`` (the same inputs through the same
operations); at two members the all-gather moves half the bytes of the all-reduce, the only exchange until
bench/studies/16's last section;
the parameters equal ``holder``'s (tests/test_kfac_owners.py). Curvature (CURV_A, CURV_B) is still captured by
every replica from its own micro-batches and all-reduced, as before; a replica keeps no inverses for layers it does
not own, so a checkpoint written under one setting cannot continue under the other (``checkpoint_io``'s matching
fields). The schedule is unchanged: a replica runs the INVERT units of a layer it does not own as no-ops, without
waiting for that layer's factor all-reduce ([Note: a non-owner does not wait] in ``runtime.kfac_work``); the planner
prices them at 0 and adds the exchange (``planning.owner_costs`` [Note: pricing owners]). Not under ``sdp``/``tp`` (refused at config time).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist

from pipefisher.optim import KFACPreconditioner
from pipefisher.optim.owners import layer_cost, plan_owners

__all__ = ["layer_cost", "layer_owners", "owned_layers", "plan_owners"]

StageKey = tuple[int, int]  # (pipe, stage)


def owned_layers(preconditioners: Mapping[StageKey, KFACPreconditioner],
                 groups: Mapping[int, dist.ProcessGroup | None]) -> dict[StageKey, frozenset[str]]:
    """Per stage replica of this worker whose stage has a group (several replicas): the names of the layers it
    owns (:func:`plan_owners` over the group's members, this rank's index in the group). Replicas without a group
    are absent: they own every layer and exchange nothing."""
    stages = [stage for _, stage in preconditioners]
    if len(set(stages)) != len(stages):
        raise ValueError(f"kfac_owners=replicas: this worker holds two replicas of one stage ({sorted(preconditioners)}); "
                         f"owners are planned per worker of a stage's group: use optimizer.kfac_owners=holder")
    out: dict[StageKey, frozenset[str]] = {}
    for (pipe, stage), pre in preconditioners.items():
        group = groups.get(stage)
        if group is None:
            continue
        me = dist.get_rank(group)
        out[(pipe, stage)] = frozenset(n for n, o in layer_owners(pre, dist.get_world_size(group)).items() if o == me)
    return out


def layer_owners(pre: KFACPreconditioner, members: int) -> dict[str, int]:
    """Each K-FAC layer of ``pre`` (by name, in ``layer_names`` order) and the index in its stage's group of the
    member that owns it (:func:`plan_owners` over the layers' weight shapes): the same on every member."""
    names = pre.layer_names
    shapes = [tuple(pre.layer(n).module.weight.shape) for n in names]
    return dict(zip(names, plan_owners(shapes, members)))  # type: ignore[arg-type]
