"""Pipeline schedules as data: the action IR, generators, passes and static checks.

Entry point: :func:`build_schedule` (``registry.py``: generator → :func:`add_communication` →
:func:`add_grad_sync_and_step` → :func:`check_schedule`). K-FAC work over a refresh cycle:
:class:`Assignment`, :func:`critical_path_assignment`, :func:`check_assignment` and the JSON form
(:func:`assignment_to_json` / :func:`assignment_from_json`) in ``pipefisher.schedules.kfac``.
Held-out evaluation: :func:`forward_only` / :func:`build_eval_schedule` (F and its messages only)
in ``pipefisher.schedules.evaluation``.
Nothing here imports torch.
"""

from __future__ import annotations

from pipefisher.schedules.checks import ScheduleError, check_schedule
from pipefisher.schedules.evaluation import build_eval_schedule, forward_only
from pipefisher.schedules.generators import (
    GENERATORS,
    HOIST_POLICY,
    chimera,
    get_generator,
    gpipe,
    interleaved,
    one_f_one_b,
)
from pipefisher.schedules.ir import Action, ActionKind, Placement, Schedule
from pipefisher.schedules.kfac import (
    Assignment,
    assignment_from_json,
    assignment_to_json,
    check_assignment,
    critical_path_assignment,
    kfac_layer_counts,
    strip_kfac,
)
from pipefisher.schedules.passes import add_communication, add_grad_sync_and_step, per_stage_steps
from pipefisher.schedules.registry import build_schedule

__all__ = [
    "Action",
    "ActionKind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "GENERATORS",
    "get_generator",
    "gpipe",
    "one_f_one_b",
    "chimera",
    "interleaved",
    "add_communication",
    "add_grad_sync_and_step",
    "per_stage_steps",
    "check_schedule",
    "build_schedule",
    "build_eval_schedule",
    "forward_only",
    "Assignment",
    "assignment_from_json",
    "assignment_to_json",
    "check_assignment",
    "critical_path_assignment",
    "kfac_layer_counts",
    "strip_kfac",
]
