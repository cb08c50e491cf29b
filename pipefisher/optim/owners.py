"""Who inverts and preconditions each K-FAC layer of a stage held by several replicas (``optimizer.kfac_owners=
replicas``, issue 36): a pure function of the layers' shapes, shared by the runtime (``runtime.kfac_owners``) and the
planner that prices it (``planning.owner_costs``), so both give every layer the same owner."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["exchange_gathers", "layer_cost", "plan_owners"]


def layer_cost(out_features: int, in_features: int) -> int:
    """Relative INVERT + PRECOND cost of an [O, I] layer: O³ + I³ (both factors' inverses) + O·I·(O + I)."""
    return out_features ** 3 + in_features ** 3 + out_features * in_features * (out_features + in_features)


def plan_owners(shapes: Sequence[tuple[int, int]], members: int) -> list[int]:
    """The owner (0 .. ``members`` − 1) of each layer of ``shapes`` ([O, I] per layer): the layers by cost,
    the most expensive first (ties: the earlier layer), each to the member with the least cost so far (ties: the
    lowest index). The same answer on every rank.

    Raises:
        ValueError: ``members`` < 1.
    """
    if members < 1:
        raise ValueError(f"members={members}: a stage has at least one replica")
    load = [0] * members
    owner = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda j: (-layer_cost(*shapes[j]), j)):
        m = min(range(members), key=lambda r: (load[r], r))
        owner[i] = m
        load[m] += layer_cost(*shapes[i])
    return owner


def exchange_gathers(piece_sizes: Sequence[int]) -> bool:
    """Whether the owners' exchange of preconditioned gradients is an all-gather (each member's own layers in one
    piece, padded to the largest) rather than an all-reduce of every piece (the others' zeroed): per member the
    all-gather moves (g − 1)·max, a ring all-reduce 2(g − 1)/g·sum, so the all-gather where g·max < 2·sum (two
    members with any split but all on one; not eight members for bert's six layers, whose largest piece is a
    third of the whole). Both give every member the owner's values exactly."""
    g = len(piece_sizes)
    return g > 1 and g * max(piece_sizes) < 2 * sum(piece_sizes)
