"""Profiling: timelines to ``profile.sqlite`` and back (also from real Nsight Systems exports),
timeline pictures and utilization tables.

Entry points: :func:`write_profile` / :func:`read_profile` (``profile.sqlite``, see
``pipefisher.profiling.sqlite``), :func:`read_nsys` (an ``nsys export --type sqlite`` file),
:func:`plot_timeline` (PDF + PNG) and :func:`utilization_table` (what the CLI prints).
"""

from pipefisher.profiling.nsys import KFAC_KINDS, Profile, ProfileError, WorkerInfo, read_nsys
from pipefisher.profiling.plot import KIND_COLORS, OVERSUBSCRIBED_NOTE, plot_timeline, utilization_table
from pipefisher.profiling.sqlite import META_KEYS, read_profile, write_profile

__all__ = [
    "KFAC_KINDS",
    "KIND_COLORS",
    "META_KEYS",
    "OVERSUBSCRIBED_NOTE",
    "Profile",
    "ProfileError",
    "WorkerInfo",
    "plot_timeline",
    "read_nsys",
    "read_profile",
    "utilization_table",
    "write_profile",
]
