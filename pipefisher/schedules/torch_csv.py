"""torch.distributed.pipelining's compute-only CSV schedule format, both ways (issue 26, item 4).

torch 2.13 writes a schedule with ``PipelineScheduleMulti._dump_csv`` (``format="compute_only"``
for ``_PipelineScheduleRuntime``) and reads it with ``_load_csv``: one CSV row per pipeline rank,
one cell per time step, each cell an ``_Action`` string such as ``0F2`` (stage 0, forward,
micro-batch 2), ``1I0`` / ``1W0`` (split backward), ``3B1`` (full backward) or empty (a bubble);
DualPipeV's cells may be ``(0F3;3B1)OVERLAP_F_B``, two computes torch's runtime runs one after the
other; ``REDUCE_GRAD`` cells (torch's gradient reduction, found in single-stage schedules' orders)
are skipped. The stage → rank mapping is implied by where a stage's actions are (torch's
``_validate_schedule``), so any placement of stages on ranks with one copy of each stage can be
written: 1F1B, GPipe, interleaved (loop), ZB-H1, ZB-V and DualPipeV (V).

What the format cannot hold, and :func:`to_torch_csv` refuses:

- **Chimera** (``chimera``, ``chimera-doubling``): two pipes run the same D stages on different
  workers (stage s of the down pipe on worker s, of the up pipe on worker D−1−s). A torch schedule
  maps each stage index to one rank and has no pipe field; relabelling the up pipe as stages
  D … 2D−1 would describe a 2D-stage model, not two replicas of one that all-reduce gradients.
- K-FAC work, gradient synchronization and ``STEP`` (torch's compute-only format has F, B, I, W
  only; its runtime adds REDUCE_GRAD itself); they are dropped, and an imported schedule gets ours
  from our passes. Data parallelism is outside the format too: the CSV holds one pipeline (group
  0's workers) and an import is replicated over ``dp_width`` groups.

Communication is never read from or written to the CSV: an import gets it from
:func:`~pipefisher.schedules.passes.add_communication` and torch's runtime from its own
``_add_send_recv``. Nothing here imports torch or does file I/O (callers read and write the text).
"""

from __future__ import annotations

import csv
import io
import re

from pipefisher.schedules.checks import check_schedule
from pipefisher.schedules.ir import Action, ActionKind, Placement, Schedule
from pipefisher.schedules.passes import add_communication, add_grad_sync_and_step

__all__ = ["CSV_METHOD", "to_torch_csv", "from_torch_csv", "build_from_torch_csv", "csv_shape"]

CSV_METHOD = "csv"  # Schedule.method of an imported schedule (pipeline=csv)
_COMPUTE_KINDS = {k.value: k for k in ActionKind if k.is_compute}  # F, B, I, W: the same letters as torch's
_CELL_RE = re.compile(r"^(?P<stage>\d+)(?P<kind>[FBIW])(?P<mb>\d+)$")
_REDUCE_GRAD_RE = re.compile(r"^\d+REDUCE_GRAD$")  # in Schedule1F1B._get_pipeline_order's lists
_OVERLAP_RE = re.compile(r"^\((?P<subs>[^()]*)\)OVERLAP_F_B$")


def to_torch_csv(schedule: Schedule) -> str:
    """The compute order of data-parallel group 0, in torch's compute-only CSV layout.

    Row r is worker r's F, B, I and W in order (communication, SYNC_GRAD, STEP and K-FAC units are
    left out); no bubble cells are written (torch's runtime and ours run a list in order; the
    cells' timing is not part of the order).

    Args:
        schedule: a compute-only or complete schedule with one pipe.

    Returns:
        CSV text; ``from_torch_csv`` reads it back, and so does torch's ``_load_csv``.

    Raises:
        ValueError: the schedule has two pipes (Chimera), which the format cannot express.
    """
    if schedule.placement.num_pipes != 1:
        raise ValueError(
            f"{schedule.method}: torch's schedule format maps each stage to one rank and has no pipes; "
            f"{schedule.method} runs stages on two workers each (down and up pipe), so it cannot be exported")
    workers = sorted(w for (dp, _, _), w in schedule.placement.workers.items() if dp == 0)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for w in sorted(set(workers)):
        writer.writerow([str(a) for a in schedule.actions[w] if a.kind.is_compute])
    return buffer.getvalue()


def _parse_cell(cell: str, rank: int, step: int) -> list[Action]:
    cell = cell.strip()
    if not cell or _REDUCE_GRAD_RE.match(cell):
        return []  # a bubble, or torch's gradient reduction (our passes add SYNC_GRAD)
    overlap = _OVERLAP_RE.match(cell)
    if overlap:  # torch's runtime runs the sub-actions one after the other; so do we
        return [a for sub in overlap["subs"].split(";") for a in _parse_cell(sub, rank, step)]
    m = _CELL_RE.match(cell)
    if m is None:
        raise ValueError(f"rank {rank}, step {step}: {cell!r} is not a compute action of torch's compute-only "
                         f"format (e.g. 0F2, 1B0, 1I0, 1W0, (0F3;3B1)OVERLAP_F_B)")
    return [Action(_COMPUTE_KINDS[m["kind"]], int(m["stage"]), int(m["mb"]))]


def csv_shape(text: str) -> tuple[int, int, int]:
    """(ranks, stages, micro-batches) of a torch compute-only CSV, as :func:`from_torch_csv` reads
    it: micro-batches = forwards of stage 0 (torch's ``_validate_schedule`` counts them per stage).

    Raises:
        ValueError: an unreadable cell, or no forward of stage 0.
    """
    rows = [[a for step, cell in enumerate(row) for a in _parse_cell(cell, rank, step)]
            for rank, row in enumerate(csv.reader(io.StringIO(text)))]
    while rows and not rows[-1]:
        rows.pop()  # a trailing empty line
    stages = {a.stage for row in rows for a in row}
    n = sum(1 for row in rows for a in row if a.stage == 0 and a.kind == ActionKind.FORWARD)
    if not rows or n == 0:
        raise ValueError("the CSV holds no forward of stage 0 (expected rows such as 0F0,0F1,...)")
    return len(rows), max(stages) + 1, n


def from_torch_csv(text: str, num_micro_batches: int | None = None, dp_width: int = 1,
                   method: str = CSV_METHOD) -> Schedule:
    """A compute-only schedule from torch's compute-only CSV (``_dump_csv`` output).

    The placement is where each stage's actions are (stage s on the rank whose row holds it,
    replicated over ``dp_width`` groups as ``worker = dp * ranks + rank``); one pipe; OVERLAP_F_B
    cells become their sub-actions in order. Nothing is checked beyond the format: run
    :func:`~pipefisher.schedules.checks.check_schedule` (``build_from_torch_csv`` does).

    Args:
        text: the CSV text, one row per rank.
        num_micro_batches: N; None takes the number of forwards of stage 0.
        dp_width: W, data-parallel copies of the pipeline.
        method: ``Schedule.method`` of the result.

    Returns:
        A compute-only schedule (F, B, I, W) with ``ranks * dp_width`` workers.

    Raises:
        ValueError: an unreadable cell, a stage on two ranks, or stage indices with a gap.
    """
    ranks, num_stages, n = csv_shape(text)
    n = n if num_micro_batches is None else num_micro_batches
    orders: list[list[Action]] = []
    home: dict[int, int] = {}
    for rank, row in enumerate(csv.reader(io.StringIO(text))):
        if rank >= ranks:
            break
        order = [a for step, cell in enumerate(row) for a in _parse_cell(cell, rank, step)]
        for a in order:
            if home.setdefault(a.stage, rank) != rank:
                raise ValueError(f"stage {a.stage} has actions on rank {home[a.stage]} and rank {rank}; torch's "
                                 f"format places each stage on one rank")
        orders.append(order)
    missing = sorted(set(range(num_stages)) - set(home))
    if missing:
        raise ValueError(f"stages {missing} have no action; stage indices must be 0..{num_stages - 1}")
    workers = {(dp, 0, s): dp * ranks + r for dp in range(dp_width) for s, r in home.items()}
    actions = {dp * ranks + r: tuple(order) for dp in range(dp_width) for r, order in enumerate(orders)}
    return Schedule(method=method, num_stages=num_stages, num_micro_batches=n,
                    placement=Placement(num_stages=num_stages, num_pipes=1, dp_width=dp_width, workers=workers),
                    actions=actions, pipe_of_micro_batch=(0,) * n)


def build_from_torch_csv(text: str, num_micro_batches: int | None = None, dp_width: int = 1) -> Schedule:
    """Import a torch CSV and complete it as ``build_schedule`` does a generator's output: our
    checker on the compute order, then our passes (messages, SYNC_GRAD, STEP), then the checker
    on the result.

    Raises:
        ValueError: an unreadable CSV (see :func:`from_torch_csv`).
        ScheduleError: the compute order fails our checker (e.g. torch 2.13's 1F1B export, whose
            last rank runs micro-batches 1..N).
    """
    schedule = from_torch_csv(text, num_micro_batches, dp_width)
    check_schedule(schedule, complete=False)
    schedule = add_grad_sync_and_step(add_communication(schedule))
    check_schedule(schedule)
    return schedule
