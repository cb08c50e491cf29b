"""The folder of a run that failed on bad input: removed when it holds only what Hydra wrote, else
the error goes into its log. So a refused command leaves nothing behind (train.py, profile.py,
schedule.py, finetune.py; issue 24)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

__all__ = ["clean_up_failed_run"]

log = logging.getLogger(__name__)


def _hydra_only(run_dir: Path, job_name: str, overrides: list[str]) -> bool:
    """Whether ``run_dir`` holds nothing but what Hydra wrote before this task ran.

    Its ``.hydra/overrides.yaml`` must be this run's: another run may share the folder (one given
    as ``hydra.run.dir``), and its files must stay.
    """
    if not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= {".hydra", f"{job_name}.log"}:
        return False
    try:
        return list(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml")) == overrides
    except Exception:  # noqa: BLE001  (missing or half-written: not provably ours)
        return False


def clean_up_failed_run(message: str) -> None:
    """Remove the failed run's directory if the run wrote nothing into it, else log ``message`` there."""
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    if _hydra_only(run_dir, hc.job.name, list(hc.overrides.task)):
        for handler in logging.getLogger().handlers:  # the job's log file lives in the folder
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
                handler.close()
        shutil.rmtree(run_dir, ignore_errors=True)
        # And the date folder of `outputs/<date>/<time>` when it is now empty: only below the
        # working directory, where Hydra made it (a folder the user named stays).
        parent, cwd = run_dir.parent.resolve(), Path.cwd().resolve()
        if cwd in parent.parents and parent.parent != cwd and not any(parent.iterdir()):
            parent.rmdir()
        return
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "run failed: %s", (message,), None)
    for handler in logging.getLogger().handlers:  # the file only: stderr gets it from Hydra
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
