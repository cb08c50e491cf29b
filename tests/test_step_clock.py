"""The executor's step clock ([Note: timing on a GPU]): CUDA-event marks become CPU-clock ns after
one synchronization per step; ``sync`` mode synchronizes where told. No GPU needed: the events are
stand-ins with CUDA's ``record`` / ``elapsed_time`` interface."""

from __future__ import annotations

import time

import pytest

from pipefisher.runtime.step_clock import StepClock


class _FakeEvent:
    """``elapsed_time`` in ms between two records of a device clock that we drive by hand."""

    device_ms = 0.0

    def record(self) -> None:
        self.at = _FakeEvent.device_ms

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return other.at - self.at


def test_events_mode_reads_device_time_once_per_step() -> None:
    syncs = []
    clock = StepClock("events", new_event=_FakeEvent, synchronize=lambda: syncs.append(1))
    _FakeEvent.device_ms = 100.0
    clock.start_step()
    t0 = clock._t0
    _FakeEvent.device_ms = 102.5  # the device reaches the action 2.5 ms after the step's base event
    start = clock.mark(settle=True)  # settle is a sync-mode request: no synchronization here
    _FakeEvent.device_ms = 104.0
    end = clock.mark()
    assert len(syncs) == 1  # the anchor only
    clock.finish()
    assert len(syncs) == 2
    assert clock.ns(start) == t0 + 2_500_000 and clock.ns(end) == t0 + 4_000_000


def test_sync_mode_synchronizes_only_when_settling_and_cpu_never() -> None:
    syncs = []
    clock = StepClock("sync", new_event=_FakeEvent, synchronize=lambda: syncs.append(1))
    clock.start_step()
    a = clock.mark()
    b = clock.mark(settle=True)
    clock.finish()
    assert syncs == [1] and isinstance(a, int) and clock.ns(b) >= clock.ns(a)
    cpu = StepClock("cpu")
    before = time.perf_counter_ns()
    assert cpu.ns(cpu.mark(settle=True)) >= before


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="clock mode 'gpu': use one of cpu, sync, events"):
        StepClock("gpu")
