"""The NVTX mark that tells a profile which torch.distributed rank a process is.

An ``nsys profile`` capture knows pids, not ranks, and per-rank exports of one run may come from
different hosts whose pids say nothing about rank order. A worker that calls :func:`mark_rank`
once at start leaves an NVTX mark ``rank=N`` (eventType 34, NvtxMark) in its process's capture;
``pipefisher.profiling.nsys`` maps the process's ranges to worker N through it (issue 15, item 5).
"""

from __future__ import annotations

import re

__all__ = ["RANK_MARK_RE", "mark_rank", "rank_mark_text"]

RANK_MARK_RE = re.compile(r"^rank=(?P<rank>\d+)$")


def rank_mark_text(rank: int) -> str:
    """The mark's text, ``"rank=N"``."""
    if rank < 0:
        raise ValueError(f"rank={rank}: a torch.distributed rank is >= 0")
    return f"rank={rank}"


def mark_rank(rank: int) -> bool:
    """Emit the NVTX mark ``rank=N`` from this process when CUDA (hence NVTX) is available.

    Cheap when no profiler is attached (NVTX calls are no-ops then); call it once per process,
    before the first step.

    Returns:
        Whether a mark was emitted (False without CUDA: CPU runs write ranks to profile.sqlite).
    """
    text = rank_mark_text(rank)
    import torch  # torch is heavy; the profile readers that import this module must not need it

    if not torch.cuda.is_available():
        return False
    torch.cuda.nvtx.mark(text)
    return True
