"""One training step's schedule by method name: generate (``generators.GENERATORS``), complete
(:func:`~pipefisher.schedules.passes.add_communication`, :func:`~pipefisher.schedules.passes.add_grad_sync_and_step`)
and check (:func:`~pipefisher.schedules.checks.check_schedule`). Re-exported by ``pipefisher.schedules``.
"""

from __future__ import annotations

import inspect
from typing import Any

from pipefisher.schedules.checks import check_schedule
from pipefisher.schedules.generators import HOIST_POLICY, get_generator
from pipefisher.schedules.ir import Schedule
from pipefisher.schedules.passes import add_communication, add_grad_sync_and_step

__all__ = ["build_schedule"]


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
