"""Schedules in torch.distributed.pipelining's compute-only CSV format, from the command line.

    python -m pipefisher.torch_schedule export zb-v --stages 2 --micro-batches 4 -o zbv.csv   # ours -> CSV
    python -m pipefisher.torch_schedule torch DualPipeV --stages 2 --micro-batches 4 -o dpv.csv  # torch's -> CSV
    python -m pipefisher.torch_schedule check dpv.csv        # our checker and passes on a CSV
    python train.py pipeline=csv pipeline.csv=dpv.csv stages=2   # run it in our executor

The format and what it cannot express (Chimera's two pipes): ``pipefisher.schedules.torch_csv``.
``torch`` writes the file with torch's own ``_dump_csv(format="compute_only")`` (multi-stage
schedules) or the same CSV writer over ``_get_pipeline_order()`` (single-stage ones, which have no
``_dump_csv``); the schedule class is built on stand-ins that carry only what its constructor reads
(stage index, stage count, group size and rank), since its order does not depend on the model.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path
from types import SimpleNamespace

from pipefisher.schedules import ScheduleError, build_schedule
from pipefisher.schedules.torch_csv import build_from_torch_csv, to_torch_csv

__all__ = ["torch_schedule_csv", "main"]


def torch_schedule_csv(name: str, ranks: int, num_micro_batches: int, stages_per_rank: int | None = None) -> str:
    """torch's own compute-only CSV of schedule class ``name`` (``get_schedule_class``: ``1F1B``,
    ``GPipe``, ``Interleaved1F1B``, ``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``, …)
    for ``ranks`` ranks; ``stages_per_rank`` defaults to 1 for single-stage classes and 2 otherwise."""
    import io

    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    v = stages_per_rank or (1 if single else 2)
    total = ranks * v

    def stand_in(index: int) -> SimpleNamespace:
        return SimpleNamespace(num_stages=total, group_size=ranks, group_rank=0, stage_index=index, submod=None,
                               is_first=index == 0, is_last=index == total - 1)

    buffer = io.StringIO()
    if single:
        order = cls(stand_in(0), num_micro_batches)._get_pipeline_order()
        writer = csv.writer(buffer)  # as PipelineScheduleMulti._dump_csv writes its rows
        for rank in order:
            writer.writerow(order[rank])
        return buffer.getvalue()
    schedule = cls([stand_in(i) for i in range(v)], num_micro_batches)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "schedule.csv"
        schedule._dump_csv(str(path), format="compute_only")  # torch's own writer
        return path.read_text()


def main(argv: list[str] | None = None) -> int:
    """The command line above; returns the exit status (1 with a one-line error)."""
    parser = argparse.ArgumentParser(prog="python -m pipefisher.torch_schedule", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ours = sub.add_parser("export", help="one of our generators -> torch compute-only CSV")
    ours.add_argument("method")
    theirs = sub.add_parser("torch", help="one of torch's schedule classes -> its compute-only CSV")
    theirs.add_argument("name")
    theirs.add_argument("--stages-per-rank", type=int, default=None)
    for p in (ours, theirs):
        p.add_argument("--stages", type=int, required=True, help="ranks (our workers per pipeline)")
        p.add_argument("--micro-batches", type=int, required=True)
        p.add_argument("-o", "--output", type=Path, required=True)
    ours.add_argument("--num-virtual", type=int, default=1)
    check = sub.add_parser("check", help="our checker and passes on a torch compute-only CSV")
    check.add_argument("file", type=Path)
    check.add_argument("--data-parallel", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            text = to_torch_csv(build_schedule(args.method, args.stages, args.micro_batches, num_virtual=args.num_virtual))
        elif args.command == "torch":
            text = torch_schedule_csv(args.name, args.stages, args.micro_batches, args.stages_per_rank)
        else:
            schedule = build_from_torch_csv(args.file.read_text(), dp_width=args.data_parallel)
            print(schedule.format_grid())
            print(f"{args.file}: accepted: {schedule.num_workers} workers, {schedule.num_stages} stages, "
                  f"{schedule.num_micro_batches} micro-batches; run it with python train.py pipeline=csv "
                  f"pipeline.csv={args.file} stages={schedule.num_workers // args.data_parallel}")
            return 0
    except ScheduleError as err:
        print(f"rejected by our checker: {err}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    args.output.write_text(text)
    print(f"wrote {args.output}: {len(text.splitlines())} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
