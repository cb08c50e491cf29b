"""Where a worker ran: host, process, thread and its clock, recorded by the worker itself.

Each worker calls :func:`local_origin` in its own process (so the host name is that worker's
``socket.gethostname()``, not rank 0's) and rank 0 gathers them for ``profile.sqlite`` and
``timeline.json``.

[Note: clocks per host]
Timeline events carry ``time.perf_counter_ns()`` values (CLOCK_MONOTONIC on Linux): one clock per
host, shared by its processes, unrelated across hosts. A worker records ``utc_offset_ns`` =
``time.time_ns() - time.perf_counter_ns()`` once, so an event time ``t`` of that host is UTC
``t + utc_offset_ns``. Durations and per-host spans need no offset; placing hosts on one axis (a
trace viewer) does, to the accuracy of the hosts' NTP sync (about a millisecond).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WorkerOrigin", "local_origin"]


@dataclass(frozen=True)
class WorkerOrigin:
    """One worker's host, process and clock.

    Attributes:
        host: the worker's ``socket.gethostname()``.
        pid: its OS process id.
        tid: the OS thread id of the thread that ran its actions.
        utc_offset_ns: UTC ns minus ``perf_counter_ns`` on its host ([Note: clocks per host]).
        process_name: its program (``argv[0]``'s file name).
    """

    host: str
    pid: int
    tid: int
    utc_offset_ns: int
    process_name: str = "python"


def local_origin() -> WorkerOrigin:
    """This process's origin, taken in the calling thread (the one that runs the actions)."""
    utc, mono = time.time_ns(), time.perf_counter_ns()
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    return WorkerOrigin(socket.gethostname(), os.getpid(), threading.get_native_id(), utc - mono, name)
