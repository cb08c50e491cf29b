"""Process start on one machine, and adoption of an environment that already started the workers.

[Note: failures end the whole job]
Local workers are started with ``torch.multiprocessing.start_processes``: when one exits with an
exception or is killed, ``join`` terminates the others at once and raises with the failed worker's
rank and traceback. A worker that stalls without exiting is caught by the process-group timeout
(``cluster.worker_timeout_s``): its peers' blocking receives and collectives raise, and they exit.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.config import TrainConfig
from pipefisher.launch.slurm import slurm_task_env
from pipefisher.runtime.worker import run_worker, schedule_for
from pipefisher.tracking import WandbLogger, read_metrics, run_name_from_overrides
from pipefisher.training import train_single_process

__all__ = ["run_training", "launch_workers"]

log = logging.getLogger(__name__)


def _env_world() -> tuple[int, int, int, int] | None:
    """(rank, world, local_rank, local_world) from torchrun's or a SLURM job step's variables, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        return (int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
                int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    task = slurm_task_env()  # also exports MASTER_ADDR/MASTER_PORT for init_process_group
    if task is not None:
        return task.rank, task.world_size, task.local_rank, task.local_world_size
    return None


def _spawned_worker(index: int, cfg: TrainConfig, world: int, addr: str, port: int, output_dir: str,
                    run_name: str | None, group: str | None) -> None:
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(world))
    logging.basicConfig(level=logging.INFO, format=f"[worker {index}] %(levelname)s %(name)s: %(message)s")
    run_worker(cfg, index, world, output_dir, run_name=run_name, group=group, local_rank=index,
               local_world_size=world, external_store=True)


def launch_workers(cfg: TrainConfig, output_dir: str | os.PathLike, run_name: str | None = None,
                   group: str | None = None) -> dict[str, Any]:
    """Run the ``stages × data_parallel`` workers of ``cfg`` and return rank 0's last metrics.

    Inside torchrun (``RANK``/``WORLD_SIZE`` set) this process is one worker; otherwise it starts
    all workers as local processes and waits for them.
    """
    schedule_for(cfg)  # build and check the schedule before any process starts
    env = _env_world()
    if env is not None:
        rank, world, local_rank, local_world = env
        return run_worker(cfg, rank, world, output_dir, run_name=run_name, group=group,
                          local_rank=local_rank, local_world_size=local_world)
    world = cfg.num_workers
    addr = cfg.cluster.master_addr
    # This process hosts the rendezvous store on a port the OS picks while binding it, so no other
    # program can take the port between choosing and binding it.
    timeout = datetime.timedelta(seconds=cfg.cluster.worker_timeout_s)
    store = dist.TCPStore(addr, cfg.cluster.master_port, world, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    port = store.port
    log.info("starting %d workers on this machine (%s:%d)", world, addr, port)
    mp.start_processes(
        _spawned_worker,
        args=(cfg, world, addr, port, str(output_dir), run_name, group),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    del store
    metrics = read_metrics(Path(output_dir) / "metrics.jsonl")
    return metrics[-1] if metrics else {}


def run_training(cfg: TrainConfig, output_dir: str | os.PathLike, overrides: list[str] | None = None,
                 sweep_dir: str | None = None) -> dict[str, Any]:
    """Train one run described by ``cfg``; metrics go to ``output_dir/metrics.jsonl`` and wandb.

    ``stages=1, data_parallel=1`` with NVLAMB trains in this process (unless profiling,
    checkpointing or resuming); anything else runs pipeline workers (one process for a single stage).

    Returns:
        The last step's metrics (rank 0's view).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run_name = run_name_from_overrides(overrides or []) or None
    group = cfg.wandb.group or (Path(sweep_dir).name if sweep_dir else None)
    # Profiles need the executor's timeline, K-FAC runs as schedule actions in the executor, and
    # checkpoints and resume are the pipeline worker's (pipefisher.runtime.checkpoint).
    if (cfg.num_workers > 1 or cfg.profile.enabled or cfg.optimizer.name != "nvlamb"
            or cfg.checkpoint.enabled or cfg.resume != "none"):
        result = launch_workers(cfg, output_dir, run_name=run_name, group=group)
    else:
        logger = WandbLogger(asdict(cfg), project=cfg.wandb.project, group=group, name=run_name,
                             mode=cfg.wandb.mode, dir=str(output_dir), enabled=True)
        try:
            result = train_single_process(cfg, output_dir, logger)
        finally:
            logger.finish()
    log.info("finished: %s", {k: result[k] for k in ("step", "loss") if k in result})
    return result
