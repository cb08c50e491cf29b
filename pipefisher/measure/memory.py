"""Peak memory of this process per step, and the planner's prediction to set beside it.

[Note: peak memory per step]
CUDA: the caching allocator's ``max_memory_allocated`` since ``reset_peak_memory_stats`` (tensors
only; the CUDA context and the cache's free blocks are not in it, nor in the prediction).
CPU (Linux): the resident set's high-water mark ``VmHWM`` of /proc/self/status, reset to the
current RSS by writing "5" to /proc/self/clear_refs (Linux ≥ 4.0). RSS includes the interpreter and
libraries (the baseline, taken before the model is built, which the summary subtracts) and the
freed blocks glibc keeps, which the prediction for ``device="cpu"`` counts (``planning.memory``). Where the reset is refused, the peak is over the process's lifetime (``kind`` says so);
elsewhere ``resource.getrusage``'s ``ru_maxrss`` (lifetime).
"""

from __future__ import annotations

import re
import sys

import torch

from pipefisher.planning.costs import RunShape
from pipefisher.planning.memory import estimate_memory_per_worker
from pipefisher.schedules import Schedule
from pipefisher.schedules.kfac import Assignment

__all__ = ["PeakMemory", "current_bytes", "predicted_peak_bytes"]

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


class PeakMemory:
    """Peak memory of this process since the last ``reset()`` ([Note: peak memory per step]).

    Attributes:
        device: the device measured.
        kind: ``"cuda max_memory_allocated"``, ``"cpu peak RSS (per step)"`` or
            ``"cpu peak RSS (process lifetime)"``.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.kind = "cuda max_memory_allocated"
        elif sys.platform.startswith("linux"):
            self.kind = "cpu peak RSS (per step)"
        else:
            self.kind = "cpu peak RSS (process lifetime)"

    def reset(self) -> None:
        """Start a new measurement window (a no-op where only the lifetime peak exists)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "cpu peak RSS (per step)":
            try:
                with open(_CLEAR_REFS, "w") as f:
                    f.write("5")
            except OSError:
                self.kind = "cpu peak RSS (process lifetime)"

    def read(self) -> int:
        """Peak bytes since the last ``reset()`` (or over the process's lifetime, see ``kind``)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        hwm = _status_bytes("VmHWM")
        if hwm is not None:
            return hwm
        import resource  # Unix only; absent on Windows

        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, kB elsewhere


def predicted_peak_bytes(run: RunShape, optimizer: str, schedule: Schedule | None = None,
                         assignment: Assignment | None = None, device: str = "cuda") -> dict[int, float]:
    """The planner's predicted peak memory of every worker (``estimate_memory_per_worker``'s totals).

    Args:
        run: the run's shape.
        optimizer: ``nvlamb``, ``kfac``, ``pipefisher``, ``adamw`` or ``muon``.
        schedule: the run's schedule (built from ``run`` when None).
        assignment: the K-FAC assignment, for the capture memory.
        device: the device type measured (``cuda``: ``max_memory_allocated``; ``cpu``: the peak RSS
            beyond the baseline, glibc's retention and the worker's non-tensor memory included).

    Returns:
        Worker rank -> bytes.
    """
    per_worker = estimate_memory_per_worker(run, optimizer, schedule, assignment, device)
    return {w: est.total for w, est in per_worker.items()}


def current_bytes(device: torch.device | str = "cpu") -> int:
    """Memory this process holds now: CUDA ``memory_allocated``; CPU resident set size (VmRSS).

    Taken before a worker builds its model, it is the baseline a peak RSS includes beyond what the
    planner predicts (interpreter, torch, libraries)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    rss = _status_bytes("VmRSS")
    return 0 if rss is None else rss


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in bytes; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    with open(_STATUS) as f:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None
