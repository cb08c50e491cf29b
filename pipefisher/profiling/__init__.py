"""Profiling: timelines to ``profile.sqlite`` and back (also from real Nsight Systems exports),
Perfetto traces, timeline pictures and utilization tables.

Entry points: :func:`write_profile` / :func:`read_profile` (``profile.sqlite``, see
``pipefisher.profiling.sqlite``), :func:`read_nsys` (``nsys export --type sqlite`` files, one or
one per rank), :func:`write_trace_json` (``timeline.json``), :func:`plot_timeline` (PDF + PNG),
:func:`utilization_table` (what the CLI prints), :func:`local_origin` (a worker's host, pid and
clock) and :func:`mark_rank` (the ``rank=N`` NVTX mark a worker leaves in an nsys capture).
"""

from pipefisher.profiling.nsys import KFAC_KINDS, read_nsys
from pipefisher.profiling.nvtx import mark_rank
from pipefisher.profiling.origin import WorkerOrigin, local_origin
from pipefisher.profiling.plot import KIND_COLORS, OVERSUBSCRIBED_NOTE, plot_timeline, utilization_table
from pipefisher.profiling.sqlite import META_KEYS, read_profile, write_profile
from pipefisher.profiling.trace_json import write_trace_json
from pipefisher.profiling.types import Profile, ProfileError, WorkerInfo
from pipefisher.profiling.utilization import utilization_per_host

__all__ = [
    "KFAC_KINDS",
    "KIND_COLORS",
    "META_KEYS",
    "OVERSUBSCRIBED_NOTE",
    "Profile",
    "ProfileError",
    "WorkerInfo",
    "WorkerOrigin",
    "local_origin",
    "mark_rank",
    "plot_timeline",
    "read_nsys",
    "read_profile",
    "utilization_per_host",
    "utilization_table",
    "write_profile",
    "write_trace_json",
]
