"""What the profile readers return, and the error they raise."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipefisher.timeline import Event

__all__ = ["Profile", "ProfileError", "WorkerInfo"]


class ProfileError(ValueError):
    """A profile database cannot be read; the message names the file, the table and the fix."""


@dataclass(frozen=True)
class WorkerInfo:
    """Where one worker's events came from.

    Attributes:
        worker: worker index (``Event.worker``).
        rank: torch.distributed rank of the worker's process.
        global_tid: the Nsight Systems ``globalTid`` its ranges carry (pid and tid inside,
            see ``pipefisher.profiling.nsys``).
        host: host name, or None when unknown.
    """

    worker: int
    rank: int
    global_tid: int
    host: str | None = None


@dataclass
class Profile:
    """The contents of a profile database (or of several per-rank exports).

    Attributes:
        events: timeline events, in the order they were written (our files) or by start time.
        metadata: run metadata (``PIPEFISHER_META``; empty for an nsys export).
        workers: per-worker origin, keyed by worker index.
        source: ``"pipefisher"`` for a file written by ``write_profile``, ``"nsys"`` otherwise.
        gpu: whether event times are kernel times (GPU spans) rather than CPU ranges.
        notes: what the reader had to guess or drop, one sentence each (for summaries).
        hosts_utc_offset_ns: ``{host: UTC ns - event ns}`` where recorded (clock alignment).
    """

    events: list[Event]
    metadata: dict[str, Any] = field(default_factory=dict)
    workers: dict[int, WorkerInfo] = field(default_factory=dict)
    source: str = "pipefisher"
    gpu: bool = False
    notes: list[str] = field(default_factory=list)
    hosts_utc_offset_ns: dict[str, int] = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        """Number of workers: those in the worker map and those with events."""
        return len(set(self.workers) | {e.worker for e in self.events})
