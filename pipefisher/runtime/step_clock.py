"""When a worker's actions ran: the CPU clock, or CUDA events read once at the end of the step.

[Note: timing on a GPU]
On CPU an action's time is ``time.perf_counter_ns()`` around it. On CUDA the CPU returns long before
the kernels it launched end, so the CPU clock alone says when work was *queued*. Two modes:

- ``sync`` (``profile.py``'s runs): synchronize the stream after every compute, K-FAC unit, STEP and
  receive, so the CPU clock around an action is its GPU time. The timeline is exact, and the CPU
  cannot run ahead of the GPU, which slows training a little; profiles want the former.
- ``events`` (training): record a CUDA event before and after each action on the current stream and
  convert them to the CPU clock once, at the end of the step (one synchronization per step). An
  NCCL receive's ``wait()`` returns at once and only makes the stream wait, so the events around a
  RECV span the wait on the GPU, and the F or B that consumes the message starts after it: the wait
  is the RECV's, not the compute's.

The conversion: at the step's start the stream is synchronized, the CPU clock read (t0) and a base
event recorded; an event e then happened at t0 + base.elapsed_time(e) (ms → ns).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["StepClock", "CLOCK_MODES"]

CLOCK_MODES = ("cpu", "sync", "events")


class StepClock:
    """Marks the start and end of actions; :meth:`ns` turns marks into ns after :meth:`finish`.

    Args:
        mode: ``cpu`` (perf_counter), ``sync`` (synchronize, then perf_counter) or ``events``
            (CUDA events, read at the end of the step); [Note: timing on a GPU].
        new_event: factory of timing events (``torch.cuda.Event(enable_timing=True)``); injectable
            for tests.
        synchronize: waits for the device's queued work (``torch.cuda.current_stream().synchronize``).
    """

    def __init__(self, mode: str, new_event: Callable[[], Any] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        if mode not in CLOCK_MODES:
            raise ValueError(f"clock mode {mode!r}: use one of {', '.join(CLOCK_MODES)}")
        self.mode = mode
        if mode != "cpu" and (new_event is None or synchronize is None):
            import torch

            new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
            synchronize = synchronize or (lambda: torch.cuda.current_stream().synchronize())
        self._new_event = new_event
        self._synchronize = synchronize
        self._t0 = 0
        self._base: Any = None

    def start_step(self) -> None:
        """Anchor the step's events to the CPU clock (``events``: one synchronization)."""
        if self.mode == "events":
            self._synchronize()
            self._t0 = time.perf_counter_ns()
            self._base = self._new_event()
            self._base.record()

    def mark(self, settle: bool = False) -> Any:
        """A point in time: an int (ns) or a recorded event. ``settle``: in ``sync`` mode, wait for
        the device first (after an action whose GPU time should be its own)."""
        if self.mode == "events":
            event = self._new_event()
            event.record()
            return event
        if settle and self.mode == "sync":
            self._synchronize()
        return time.perf_counter_ns()

    def finish(self) -> None:
        """Wait for the step's events (``events``), so that :meth:`ns` can read them."""
        if self.mode == "events":
            self._synchronize()

    def ns(self, mark: Any) -> int:
        """The CPU-clock time of a mark, in ns."""
        if self.mode != "events":
            return int(mark)
        return self._t0 + round(self._base.elapsed_time(mark) * 1e6)
