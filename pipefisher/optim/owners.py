"""Who inverts and preconditions each K-FAC layer of a stage held by several replicas (``optimizer.kfac_owners=
replicas``, issue 36): a pure function of the layers' shapes, shared by the runtime (``runtime.kfac_owners``) and the
planner that prices it (``planning.owner_costs``), so both give every layer the same owner."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["layer_cost", "plan_owners"]


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
