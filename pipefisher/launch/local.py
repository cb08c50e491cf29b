"""Process start on one machine, and adoption of an environment that already started the workers.

Before any worker starts, the config and the schedule are checked, and so is the checkpoint a
``resume`` asks for (it must fit the run: :func:`check_resume`). In a SLURM job the process that
owns SLURM's warning signal requeues the job after the workers checkpointed on it (see
``pipefisher.runtime.preemption``).

[Note: failures end the whole job]
Local workers are started with ``torch.multiprocessing.start_processes``: when one exits with an
exception or is killed, ``join`` terminates the others at once and raises with the failed worker's
rank and traceback. A worker that stalls without exiting is caught by the process-group timeout
(``cluster.worker_timeout_s``): its peers' blocking receives and collectives raise, and they exit.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.config import TrainConfig
from pipefisher.launch.slurm import report_lost_tasks, slurm_task_env
from pipefisher.runtime import preemption
from pipefisher.runtime.checkpoint import check_compatible, checkpoint_root, resolve_resume, verify_checkpoint
from pipefisher.runtime.preemption import PREEMPTED_EXIT_CODE, PREEMPTED_FILE
from pipefisher.runtime.worker import kfac_assignment, run_worker, schedule_for
from pipefisher.schedules.ir import Schedule
from pipefisher.tracking import WandbLogger, read_metrics, run_name_from_overrides
from pipefisher.training import train_single_process

__all__ = ["run_training", "launch_workers", "check_resume", "WorkerFailed"]

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


def check_resume(cfg: TrainConfig, output_dir: str | os.PathLike, schedule: Schedule) -> None:
    """Check the checkpoint that ``cfg.resume`` asks for against the run, before workers start.

    The workers check it again (rank 0, :func:`~pipefisher.runtime.checkpoint.agree_on_resume`);
    here a mismatch costs no process start. ``schedule`` is the run's (:func:`schedule_for`).

    Raises:
        CheckpointError: an explicit ``resume`` path holds no valid checkpoint.
        ConfigError: the checkpoint does not fit this run (stage count, model, K-FAC interval, …).
    """
    resume = preemption.resume_mode(cfg.resume, preemption.watching(cfg.cluster.requeue))
    if resume == "none":
        return
    folder = resolve_resume(dataclasses.replace(cfg, resume=resume), checkpoint_root(cfg, output_dir))
    if folder is None:
        return
    interval = kfac_assignment(cfg, schedule).interval if cfg.optimizer.name != "nvlamb" else None
    check_compatible(verify_checkpoint(folder), cfg, cfg.num_workers, interval, folder)


class WorkerFailed(RuntimeError):
    """A worker started by SLURM (a job step's task) or torchrun failed; the message holds its
    traceback and, when it failed because of them, its failed peers' errors."""


def _peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is how a worker learns that a peer failed: a closed connection or a timeout
    of the process group, as opposed to a failure of its own."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out"))


def _requeue_if_preempted(output_dir: Path) -> None:
    """After the workers stopped on SLURM's signal (they left :data:`PREEMPTED_FILE`): requeue, exit."""
    marker = output_dir / PREEMPTED_FILE
    if not marker.is_file():
        return
    info = json.loads(marker.read_text())
    marker.unlink()
    preemption.requeue(info["step"], info["checkpoint"])
    sys.exit(PREEMPTED_EXIT_CODE)


def launch_workers(cfg: TrainConfig, output_dir: str | os.PathLike, run_name: str | None = None,
                   group: str | None = None) -> dict[str, Any]:
    """Run the ``stages × data_parallel`` workers of ``cfg`` and return rank 0's last metrics.

    Inside torchrun (``RANK``/``WORLD_SIZE`` set) or a multi-task SLURM step this process is one
    worker; otherwise it starts all workers as local processes and waits for them. In a SLURM job
    (``cluster.requeue``), a preemption or time-limit signal ends in a checkpoint and a requeue:
    this function then exits the process with status 255 instead of returning.
    """
    schedule = schedule_for(cfg)  # build and check the schedule before any process starts
    if cfg.optimizer.schedule and cfg.optimizer.name != "nvlamb":
        kfac_assignment(cfg, schedule)  # a plan made for another run fails here, not in the workers
    env = _env_world()
    if env is not None:
        rank, world, local_rank, local_world = env
        try:
            result = run_worker(cfg, rank, world, output_dir, run_name=run_name, group=group,
                                local_rank=local_rank, local_world_size=local_world, requeue_here=True)
        except Exception as err:
            # Hydra keeps a failed job's exception but not its traceback: put the traceback in the
            # message, and (worker 0's error being the one the launcher shows) name failed peers.
            trace = traceback.format_exc()
            log.error("worker %d failed:\n%s", rank, trace)
            peers = report_lost_tasks(err) if _peer_failure(err) else {}
            raise WorkerFailed(f"worker {rank} failed:\n{trace}" + "".join(
                f"\n--- SLURM task {t} failed:\n{text.strip()}" for t, text in sorted(peers.items()))) from err
        if result.get("preempted"):  # checkpointed, and worker 0 requeued the job
            sys.exit(PREEMPTED_EXIT_CODE)
        return result
    check_resume(cfg, output_dir, schedule)
    watch = preemption.watching(cfg.cluster.requeue)
    if watch:  # SLURM's signal is recorded and passed on; the workers act on it at a step's end
        preemption.install()
    world = cfg.num_workers
    addr = cfg.cluster.master_addr
    # This process hosts the rendezvous store on a port the OS picks while binding it, so no other
    # program can take the port between choosing and binding it.
    timeout = datetime.timedelta(seconds=cfg.cluster.worker_timeout_s)
    store = dist.TCPStore(addr, cfg.cluster.master_port, world, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    port = store.port
    log.info("starting %d workers on this machine (%s:%d)", world, addr, port)
    context = mp.start_processes(
        _spawned_worker,
        args=(cfg, world, addr, port, str(output_dir), run_name, group),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    if watch:
        preemption.forward_to(context.pids())  # a signal sent to this process alone reaches the workers
    while not context.join():
        pass
    del store
    if watch:
        _requeue_if_preempted(Path(output_dir))
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
    # In a SLURM job, the workers also handle preemption (checkpoint and requeue).
    if (cfg.num_workers > 1 or cfg.profile.enabled or cfg.optimizer.name != "nvlamb"
            or cfg.checkpoint.enabled or cfg.resume != "none"
            or preemption.watching(cfg.cluster.requeue)):
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
