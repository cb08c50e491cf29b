"""Start a run's workers: in this process, as local processes, or from a torchrun/SLURM environment.

Entry points: :func:`run_training` (what ``train.py`` calls) and :func:`launch_workers`.
"""

from pipefisher.launch.local import launch_workers, run_training

__all__ = ["run_training", "launch_workers"]
