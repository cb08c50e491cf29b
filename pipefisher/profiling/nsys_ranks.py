"""Which worker (torch.distributed rank) each action range of Nsight Systems exports belongs to.

[Note: ranks of an nsys export]
A capture knows processes and threads, not ranks. In this order of preference, an action range's
worker is:

1. the prefix of its name, ``w{N}:`` or ``rank{N}:`` (e.g. ``w2:0F1``), if every range has one;
2. one process with several threads holding ranges: the threads, in globalTid order (workers run
   as threads of one process);
3. the ``rank=N`` NVTX mark its process recorded (``pipefisher.profiling.nvtx.mark_rank``), if
   every process has one;
4. the rank in its file's name, when each file holds one process: ``rank3`` or ``procid3`` as
   ``nsys profile -o report_rank%q{RANK}`` (torchrun) or ``%q{SLURM_PROCID}`` (SLURM) write it;
5. otherwise pid order, files first, with a warning: pids say nothing about ranks, and ranges put
   on the wrong worker give a wrong plan silently (issue 15, item 5).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipefisher.profiling.nsys_gpu import TID_MASK, process_key
from pipefisher.profiling.types import ProfileError, WorkerInfo

__all__ = ["FILE_RANK_RE", "RangeOrigin", "assign_workers"]

log = logging.getLogger(__name__)

FILE_RANK_RE = re.compile(r"(?:rank|procid)[_\-=.]?(\d+)", re.IGNORECASE)

Key = tuple[int, int]  # (file index, NVTX_EVENTS rowid)
Process = tuple[int, int]  # (file index, process_key(globalTid))


@dataclass(frozen=True)
class RangeOrigin:
    """Where one action range was recorded."""

    file: int
    global_tid: int
    prefix_worker: int | None = None


def _file_ranks(files: Sequence[Path], processes: Sequence[Process]) -> dict[Process, int] | None:
    if len({f for f, _ in processes}) != len(processes):
        return None  # a file holds several processes: its name cannot name all their ranks
    out = {}
    for f, key in processes:
        found = FILE_RANK_RE.findall(files[f].name)
        if len(found) != 1:
            return None
        out[(f, key)] = int(found[0])
    return out


def _check_unique(ranks: Mapping[Process, int], files: Sequence[Path], how: str) -> None:
    seen: dict[int, Process] = {}
    for proc, rank in sorted(ranks.items()):
        if rank in seen:
            a, b = seen[rank], proc
            raise ProfileError(
                f"{files[a[0]]} (pid {(a[1] >> 24) & TID_MASK}) and {files[b[0]]} (pid {(b[1] >> 24) & TID_MASK}) "
                f"are both rank {rank} by {how}; pass each rank's export once")
        seen[rank] = proc


def assign_workers(origins: Mapping[Key, RangeOrigin], marks: Mapping[Process, int],
                   files: Sequence[Path]) -> tuple[dict[Key, int], dict[int, WorkerInfo], list[str]]:
    """Workers of action ranges by [Note: ranks of an nsys export].

    Args:
        origins: each action range's file, thread and name prefix.
        marks: ``{(file, process): rank}`` from ``rank=N`` marks.
        files: the exports, by file index.

    Returns:
        ``{key: worker}``, the worker map, and notes on guesses (also logged as warnings).

    Raises:
        ProfileError: two processes claim one rank.
    """
    notes: list[str] = []
    if origins and all(o.prefix_worker is not None for o in origins.values()):
        worker_of = {k: o.prefix_worker for k, o in origins.items()}  # type: ignore[misc]
    else:
        processes = sorted({(o.file, process_key(o.global_tid)) for o in origins.values()})
        threads = sorted({o.global_tid for o in origins.values()})
        if len(processes) == 1 and len(threads) > 1:
            index = {t: i for i, t in enumerate(threads)}
            worker_of = {k: index[o.global_tid] for k, o in origins.items()}
        else:
            by_file = _file_ranks(files, processes)
            if all(p in marks for p in processes):
                ranks = {p: marks[p] for p in processes}
                _check_unique(ranks, files, "their rank=N marks")
            elif by_file is not None and len(processes) > 1:
                ranks = by_file
                _check_unique(ranks, files, "their file names")
            elif len(processes) == 1:
                ranks = {processes[0]: 0}
            else:
                ranks = {p: i for i, p in enumerate(processes)}
                unmarked = len([p for p in processes if p not in marks])
                notes.append(
                    f"ranks taken from pid order ({unmarked} of {len(processes)} processes recorded no "
                    f"'rank=N' NVTX mark, and the file names hold no rank): if pids are not in rank order "
                    f"the plan is wrong; call pipefisher.profiling.nvtx.mark_rank(rank) in each worker, or "
                    f"name per-rank exports report_rank%q{{RANK}}")
                log.warning("%s", notes[-1])
            worker_of = {k: ranks[(o.file, process_key(o.global_tid))] for k, o in origins.items()}
    infos: dict[int, WorkerInfo] = {}
    for k in sorted(origins):
        w = worker_of[k]
        if w not in infos:
            infos[w] = WorkerInfo(w, w, origins[k].global_tid)
    return worker_of, dict(sorted(infos.items())), notes
