"""Pipeline schedules as data: the action IR, generators, passes and static checks.

Entry point: :func:`build_schedule` (generator → :func:`add_communication` →
:func:`add_grad_sync_and_step` → :func:`check_schedule`). K-FAC work over a refresh cycle:
:class:`Assignment`, :func:`critical_path_assignment`, :func:`check_assignment` and the JSON form
(:func:`assignment_to_json` / :func:`assignment_from_json`) in ``pipefisher.schedules.kfac``.
Held-out evaluation: :func:`forward_only` / :func:`build_eval_schedule` (F and its messages only)
in ``pipefisher.schedules.evaluation``.
Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from typing import Any

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


def build_schedule(method: str, num_stages: int, num_micro_batches: int, dp_width: int = 1,
                   **options: Any) -> Schedule:
    """Generate, complete and check the schedule of one training step.

    Args:
        method: a name in ``GENERATORS`` (``gpipe``, ``1f1b``, ``chimera``, ``interleaved``, ``zb-h1``, ``zb-v``,
            ``chimera-doubling``, ``dualpipev``, ``v-half``, ``v-min``).
        num_stages: D, workers per pipeline (for ``interleaved`` the model has D·num_virtual stages).
        num_micro_batches: N, micro-batches per step per data-parallel group.
        dp_width: W, data-parallel copies of the pipeline (or Chimera pair).
        **options: method-specific options, e.g. ``num_virtual`` for ``interleaved``
            (``num_virtual=1`` is accepted by every method, so callers may pass the config's
            ``pipeline.num_virtual`` unconditionally).

    Returns:
        A checked schedule with computes, point-to-point messages, one SYNC_GRAD per stage replica
        and one STEP per worker.

    Raises:
        ValueError: unknown method or option, or a shape the method does not support (the message
            names the field and the fix).
        ScheduleError: the completed schedule fails a check (a bug in a generator or pass).
    """
    generator = get_generator(method)
    accepted = [name for name in inspect.signature(generator).parameters
                if name not in ("num_stages", "num_micro_batches", "dp_width")]
    if "num_virtual" not in accepted and options.get("num_virtual") == 1:
        options = {k: v for k, v in options.items() if k != "num_virtual"}  # one chunk per worker
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"pipeline method {method!r} takes no option {', '.join(unknown)}; "
                         f"accepted: {', '.join(accepted) or 'none'}")
    schedule = generator(num_stages, num_micro_batches, dp_width, **options)
    hoist = HOIST_POLICY.get(method, "earliest_send")
    schedule = add_grad_sync_and_step(add_communication(schedule, hoist), hoist)
    check_schedule(schedule)
    return schedule
