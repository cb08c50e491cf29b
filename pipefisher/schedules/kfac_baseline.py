"""The K-FAC baseline of a PipeFisher plan: the same work units, moved onto the critical path.

``optimizer=kfac optimizer.schedule=<assignment.json>`` runs every K-FAC unit of each phase of a
PipeFisher plan right before that phase's preconditioning (after the pipeline's flush), in the
same relative order and with the same deferral of inverses. The curvature of each layer then
comes from the same step and the same inverses are used at every step, so the parameters equal
PipeFisher's; only the time differs. This isolates what filling the bubbles buys.
"""

from __future__ import annotations

from dataclasses import replace

from pipefisher.schedules.ir import ActionKind
from pipefisher.schedules.kfac import Assignment, check_assignment

__all__ = ["on_critical_path"]


def on_critical_path(assignment: Assignment) -> Assignment:
    """``assignment`` with each phase's K-FAC units (except PRECOND) moved to just before the
    worker's first PRECOND, keeping their relative order (so collectives stay consistent)."""
    phases = []
    for phase in assignment.phases:
        actions = {}
        for w, acts in phase.actions.items():
            units = [a for a in acts if a.kind.is_kfac and a.kind != ActionKind.PRECOND]
            rest = [a for a in acts if not (a.kind.is_kfac and a.kind != ActionKind.PRECOND)]
            first = next(i for i, a in enumerate(rest) if a.kind in (ActionKind.PRECOND, ActionKind.STEP))
            actions[w] = tuple(rest[:first] + units + rest[first:])
        phases.append(replace(phase, actions=actions))
    out = replace(assignment, phases=tuple(phases),
                  metadata={**assignment.metadata, "planner": "critical_path_of_plan"})
    check_assignment(out)
    return out
