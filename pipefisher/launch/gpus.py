"""GPUs of a ``cluster=slurm`` run, checked on the submitting machine before any job is queued.

SLURM gives a job's tasks only the GPUs it asked for (``hydra.launcher.gpus_per_node``). Without
the request a ``device=auto`` run finds no CUDA on the nodes and trains on the CPU over gloo, and a
request smaller than the tasks on a node leaves workers without a GPU of their own (issue 25). On
the node, every worker checks again before it joins the process group
(``pipefisher.runtime.device.check_local_gpus``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipefisher.config import KFAC_OPTIMIZERS, ConfigError

__all__ = ["GpuRequestError", "CheckGpuRequest", "check_gpu_request", "signal_delay_note"]

log = logging.getLogger(__name__)


class GpuRequestError(ConfigError):
    """A ``cluster=slurm`` GPU request that cannot give each worker its own GPU."""


def check_gpu_request(device: str, gpus_per_node: int | None, tasks_per_node: int) -> None:
    """Refuse a SLURM request that leaves a GPU run's workers without their own GPU.

    Args:
        device: the run's ``device`` (``cpu`` asks for no GPU and passes).
        gpus_per_node: ``hydra.launcher.gpus_per_node`` (None: no GPU requested).
        tasks_per_node: workers per node (``hydra.launcher.tasks_per_node``).

    Raises:
        GpuRequestError: one line naming the setting and the fix.
    """
    if device == "cpu":
        return
    if gpus_per_node is None:
        raise GpuRequestError(
            f"cluster=slurm device={device} without hydra.launcher.gpus_per_node: SLURM gives the tasks no GPU and "
            f"the run would train on CPU over gloo; add hydra.launcher.gpus_per_node={tasks_per_node} "
            "(one GPU per worker), or device=cpu for a CPU run")
    if int(gpus_per_node) < tasks_per_node:
        raise GpuRequestError(
            f"hydra.launcher.gpus_per_node={gpus_per_node} is fewer than the {tasks_per_node} workers per node; each "
            f"worker needs its own GPU: set hydra.launcher.gpus_per_node={tasks_per_node}, or spread the workers over "
            "more nodes (cluster.nodes)")


def signal_delay_note(device: str, optimizer: str, hidden_size: int, signal_delay_s: int) -> str | None:
    """A warning when SLURM's notice before the time limit may not cover the step in progress and
    the checkpoint after it: K-FAC on the CPU with a bert-base-sized model (H >= 768) takes minutes (issue 25)
    per step there (inverting 768 x 768 and 3072 x 3072 factors per layer), on a GPU seconds.

    Returns:
        The warning's text, or None.
    """
    if device != "cpu" or optimizer not in KFAC_OPTIMIZERS or hidden_size < 768 or signal_delay_s >= 600:
        return None
    return (f"hydra.launcher.signal_delay_s={signal_delay_s} with optimizer={optimizer} on CPU at hidden_size="
            f"{hidden_size}: one step can take longer than that, so the step in progress and the checkpoint after it "
            "may not finish before SLURM's time limit; raise hydra.launcher.signal_delay_s (e.g. 900)")


class CheckGpuRequest(Callback):
    """Hydra callback (listed in ``conf/cluster/slurm.yaml``): :func:`check_gpu_request` (and
    :func:`signal_delay_note`'s warning) at the start of a ``-m`` sweep, before the launcher submits anything. A sweep over ``device`` is checked with
    its base value. Hydra turns a callback's exception into a warning and goes on, so the refusal
    leaves through ``SystemExit``: the message alone on stderr, status 1."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        try:
            check_gpu_request(str(config.device), launcher.get("gpus_per_node"), int(launcher.tasks_per_node))
        except GpuRequestError as err:
            program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"
            raise SystemExit(f"{program}: {err}") from None
        note = signal_delay_note(str(config.device), str(config.optimizer.name), int(config.model.hidden_size),
                                 int(launcher.get("signal_delay_s") or 0))
        if note:
            log.warning("%s", note)
