"""Forward-only (evaluation) schedules: a training schedule's forwards and their messages.

Held-out evaluation runs through the run's own pipeline (DESIGN.md, "Measuring a run"): the same
placement and, per worker, the same relative order of ``F``, ``SEND_F`` and ``RECV_F`` as a
training step, with no backward, gradient sync, optimizer step or K-FAC work. Nothing here
imports torch.

[Note: forward-only orders cannot deadlock]
No method's order needs changing. Take the training schedule's completing rendezvous execution
(it exists: ``check_schedule`` proved it) and keep only its forward events. When a kept
``SEND_F``/``RECV_F`` pair completed there, every earlier kept action of both workers had
completed before it, so in the forward-only lists both workers stand exactly at that pair; the
projected sequence is therefore a complete execution of the forward-only schedule. Blocking
executions of fixed per-worker lists are confluent (a pair that can complete stays completable),
so the checker's greedy run finds it. ``check_schedule(..., forward_only=True)`` verifies each
result anyway.

The training order is not the fastest forward-only order everywhere: simulated with unit
forwards, gpipe, 1f1b, zb-h1 and interleaved take the ideal N + (D−1)/v, but chimera's slot
order makes each basic unit wait for the previous one (D=4, N=32: 48 units of time for 32 of
work; D=8: 56) and zb-v's memory-capped order lags too (D=8, N=32: 49 against 35.5).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipefisher.schedules.checks import check_schedule
from pipefisher.schedules.ir import ActionKind, Schedule
from pipefisher.schedules.passes import add_communication
from pipefisher.schedules.registry import build_schedule

__all__ = ["FORWARD_KINDS", "forward_only", "build_eval_schedule"]

FORWARD_KINDS = frozenset({ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F})
"""The kinds a forward-only schedule keeps."""


def forward_only(schedule: Schedule, num_micro_batches: int | None = None) -> Schedule:
    """The forward-only schedule of ``schedule``: its F, SEND_F and RECV_F in each worker's order.

    Everything else goes (B, I, W, SEND_B, RECV_B, SYNC_GRAD, STEP, K-FAC units); method,
    placement and ``pipe_of_micro_batch`` are kept. A compute-only input gets its forward
    messages from :func:`~pipefisher.schedules.passes.add_communication`.

    Args:
        schedule: a training schedule (``build_schedule`` output, or a K-FAC phase of one).
        num_micro_batches: evaluation micro-batches per data-parallel group; None or
            ``schedule.num_micro_batches`` filters ``schedule`` itself. Another count regenerates
            the method's schedule for it with the same D, W and chunks per worker (default
            generator options otherwise: zb-v's ``order_costs``/``stage_costs`` are not kept; use
            :func:`build_eval_schedule` with them). Alternatively loop passes of training's N.

    Returns:
        A forward-only schedule, checked with ``check_schedule(..., forward_only=True)``.

    Raises:
        ValueError: ``num_micro_batches`` is not allowed by the method (the message names the
            constraint, e.g. chimera/interleaved: a multiple of the stages; zb-v: at least 2D).
        ScheduleError: the result fails the forward-only check.
    """
    if num_micro_batches is not None and num_micro_batches != schedule.num_micro_batches:
        workers_per_group = schedule.placement.num_workers // schedule.dp_width
        schedule = build_schedule(schedule.method, workers_per_group, num_micro_batches, schedule.dp_width,
                                  num_virtual=schedule.num_stages // workers_per_group)
    had_comm = any(a.kind.is_comm for acts in schedule.actions.values() for a in acts)
    out = replace(schedule, actions={w: tuple(a for a in acts if a.kind in FORWARD_KINDS)
                                     for w, acts in schedule.actions.items()})
    if not had_comm:
        out = add_communication(out)
    check_schedule(out, forward_only=True)
    return out


def build_eval_schedule(method: str, num_stages: int, num_micro_batches: int, dp_width: int = 1,
                        **options: Any) -> Schedule:
    """``forward_only(build_schedule(method, num_stages, num_micro_batches, dp_width, **options))``.

    Arguments as for :func:`pipefisher.schedules.build_schedule`; the result is checked with
    ``check_schedule(..., forward_only=True)``.

    Raises:
        ValueError: unknown method or option, or a shape the method does not support.
    """
    return forward_only(build_schedule(method, num_stages, num_micro_batches, dp_width, **options))
