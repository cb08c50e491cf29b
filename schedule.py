"""Plan K-FAC work into pipeline bubbles (PipeFisher): ``python schedule.py from=profile.sqlite``.

Examples:
    python schedule.py from=outputs/2026-01-01/12-00-00/profile.sqlite   # the profiled run
    python schedule.py model=bert-base pipeline=chimera stages=8 num_micro_batches=8   # estimated
    python schedule.py whatif=true devices=16 memory_gb=40 global_batch=256   # rank configurations

Writes assignment.json (``python train.py optimizer=pipefisher optimizer.schedule=<it>``),
timeline.pdf/png and prints predicted utilization and step times.
"""

from pipefisher.planning.cli import schedule_main

if __name__ == "__main__":
    schedule_main()
