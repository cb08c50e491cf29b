"""The launcher ``cluster=slurm`` selects (``conf/cluster/slurm.yaml``): hydra-submitit's
``SlurmLauncher`` that says where the task logs are, logs the sweep's progress, cancels its jobs on
Ctrl-C or SIGTERM, and reads job states from ``squeue`` on a cluster without accounting.

See ``pipefisher.launch.sweep`` (imported when a sweep is launched, not here: Hydra imports this
module at every start while it looks for plugins, and ``pipefisher.launch`` imports torch).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict

__all__ = ["SweepSlurmLauncher"]

log = logging.getLogger(__name__)


class SweepSlurmLauncher(SlurmLauncher):
    """``SlurmLauncher`` with progress, Ctrl-C that cancels the sweep's jobs, and quiet job states."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from pipefisher.launch import sweep

        assert self.config is not None
        every_s = float(OmegaConf.select(self.config, "cluster.progress_every_s", default=sweep.PROGRESS_EVERY_S))
        no_accounting = sweep.accounting_error()
        if no_accounting:
            log.info("this SLURM keeps no job accounting (%s): job states come from squeue every %g s", no_accounting,
                     every_s)
        with sweep.job_states_from_squeue(every_s) if no_accounting else nullcontext():
            with sweep.interrupts_deferred() as seen:
                jobs = self._submit(job_overrides, initial_job_idx)
            runs = [self._run(o, initial_job_idx + i) for i, o in enumerate(job_overrides)]
            log.info("submitted SLURM job%s %s; task logs in %s", "s" * (len(jobs) > 1),
                     ", ".join(j.job_id for j in jobs), sweep.log_folder(jobs))
            try:
                with sweep.interrupts_raise():
                    if seen:
                        raise sweep.Interrupted(seen[0])
                    sweep.watch(jobs, runs, every_s=every_s)
                    return [j.results()[0] for j in jobs]
            except sweep.Interrupted as stop:
                sweep.cancel(jobs, runs, stop.signum)
                raise SystemExit(128 + stop.signum) from None

    def _submit(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        """Submit the sweep as one job array: hydra-submitit's ``launch`` up to its wait."""
        import submitit

        assert self.config is not None
        init_keys = {"submitit_folder", "max_num_timeout"}
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=self.params["submitit_folder"],
                                         slurm_max_num_timeout=self.params["max_num_timeout"])
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v
                                      for k, v in self.params.items() if k not in init_keys})
        log.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR, self.config.hydra.sweep.dir)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        # The jobs run a plain SlurmLauncher (the same state): a node then needs hydra-submitit,
        # not this plugin, to unpickle it.
        plain = SlurmLauncher.__new__(SlurmLauncher)
        plain.__dict__.update(self.__dict__)
        return executor.map_array(plain, *zip(*params))

    def _run(self, overrides: Sequence[str], num: int) -> Any:
        """The sweep's run ``num``: its folder and step count, from its config as the job will compose it."""
        from pipefisher.launch.sweep import Run

        assert self.hydra_context is not None and self.config is not None
        try:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = num
            folder, steps = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir), cfg.get("steps")
        except Exception:  # noqa: BLE001  (e.g. a subdir naming hydra.job.id, known only in the job)
            folder, steps = None, None
        return Run(num, tuple(filter_overrides(overrides)), folder, steps if isinstance(steps, int) else None)
