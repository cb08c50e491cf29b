"""Process start on one machine, and adoption of an environment that already started the workers.

A local worker's failure ends the whole job (``launch/failures.py``). Before any worker starts, the config and the schedule are checked, and so is the checkpoint a
``resume`` asks for (it must fit the run: :func:`check_resume`). In a SLURM job the process that
owns SLURM's warning signal requeues the job after the workers checkpointed on it (see
``pipefisher.runtime.preemption``).

[Note: Ctrl-C and SIGTERM to the launcher]
SIGINT or SIGTERM to the launcher process (or Ctrl-C to the whole foreground group) stops the
local workers after the step they are in, with a checkpoint when the run has checkpointing on or
trained for ``checkpoint.on_stop_after_s`` (``pipefisher.runtime.preemption``, [Note: Ctrl-C and
SIGTERM]). The launcher waits for that at most ``cluster.stop_grace_s`` (:data:`STOP_GRACE_S`), or three times the longest
step so far when that is longer (a bert-base K-FAC step on a CPU takes minutes), or kills the
workers at once on a second signal; no worker outlives it. It then logs ``interrupted at step n;
last checkpoint: <folder or none>``, with a checkpoint the command that continues from it (the
same command in the same run folder with ``resume=auto``), and exits with 130 (SIGINT) or 143
(SIGTERM) (issue 16, items 1 and 3).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.config import KFAC_OPTIMIZERS, TrainConfig
from pipefisher.launch.failures import join_or_raise, kill_workers, peer_failure
from pipefisher.launch.slurm import report_lost_tasks, slurm_task_env
from pipefisher.runtime import preemption
from pipefisher.runtime.checkpoint import (check_compatible, checkpoint_root, find_latest, resolve_resume,
                                           verify_checkpoint)
from pipefisher.runtime.device import check_local_gpus
from pipefisher.runtime.preemption import INTERRUPT_SIGNALS, PREEMPTED_EXIT_CODE, PREEMPTED_FILE
from pipefisher.runtime.worker import kfac_assignment, run_worker, schedule_for
from pipefisher.schedules.ir import Schedule
from pipefisher.tracking import read_metrics, run_name_from_overrides

__all__ = ["run_training", "launch_workers", "check_resume", "WorkerFailed", "STOP_GRACE_S", "WORKER_STOP_SIGNALS"]

log = logging.getLogger(__name__)

#: ``cluster.stop_grace_s``'s default: how long the launcher waits, after SIGINT or SIGTERM, for the
#: workers to finish their step (and checkpoint) before it kills them: under the 30 s a supervisor
#: usually allows after its SIGTERM (SLURM's KillWait, Kubernetes' grace period). See [Note: Ctrl-C
#: and SIGTERM to the launcher].
STOP_GRACE_S = 20.0
_POLL_S = 0.25  # how often the launcher looks at its workers and at recorded signals
#: The signals a local worker records and stops on after the agreed step ([Note: Ctrl-C and SIGTERM]).
WORKER_STOP_SIGNALS = INTERRUPT_SIGNALS


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
                    run_name: str | None, group: str | None, launcher: int) -> None:
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(world))
    logging.basicConfig(level=logging.INFO, format=f"[worker {index}] %(levelname)s %(name)s: %(message)s")
    # SIGINT and SIGTERM were ignored until here (interrupts_ignored_by_children)
    with preemption.stop_on_interrupt(WORKER_STOP_SIGNALS):
        if os.getppid() != launcher:
            # The launcher died while this process started up: torch's death signal for it (SIGINT)
            # was ignored then, and the rendezvous store went with the launcher.
            log.warning("worker %d: the launcher process %d is gone; not starting", index, launcher)
            return
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
    interval = kfac_assignment(cfg, schedule).interval if cfg.optimizer.name in KFAC_OPTIMIZERS else None
    check_compatible(verify_checkpoint(folder), cfg, cfg.num_workers, interval, folder)


class WorkerFailed(RuntimeError):
    """A worker started by SLURM (a job step's task) or torchrun failed; the message holds its
    traceback and, when it failed because of them, its failed peers' errors."""


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
                   group: str | None = None, resume_command: str | None = None) -> dict[str, Any]:
    """Run the ``stages × data_parallel`` workers of ``cfg`` and return rank 0's last metrics.

    Inside torchrun (``RANK``/``WORLD_SIZE`` set) or a multi-task SLURM step this process is one
    worker; otherwise it starts all workers as local processes and waits for them, or, for a run
    of one worker, runs that worker in this process (no process start: :func:`_run_in_this_process`). In a SLURM job
    (``cluster.requeue``), a preemption or time-limit signal ends in a checkpoint and a requeue:
    this function then exits the process with status 255 instead of returning. After SIGINT or
    SIGTERM it exits with 130 or 143, naming the checkpoint and ``resume_command`` (the command
    line that continues this run from its latest checkpoint), when given.
    """
    schedule = schedule_for(cfg)  # build and check the schedule before any process starts
    if cfg.optimizer.schedule and cfg.optimizer.name in KFAC_OPTIMIZERS:
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
            peers = report_lost_tasks(err, cfg.cluster.lost_task_grace_s) if peer_failure(err) else {}
            raise WorkerFailed(f"worker {rank} failed:\n{trace}" + "".join(
                f"\n--- SLURM task {t} failed:\n{text.strip()}" for t, text in sorted(peers.items()))) from err
        if result.get("preempted"):  # checkpointed, and worker 0 requeued the job
            sys.exit(PREEMPTED_EXIT_CODE)
        return result
    check_local_gpus(cfg.device, cfg.num_workers)  # one GPU per local worker, before any process starts
    watch = preemption.watching(cfg.cluster.requeue)
    # Signals are recorded and passed on; the workers act on them at a step's end. SLURM's warning
    # signal (watch) ends in a requeue, SIGINT/SIGTERM in an exit: see [Note: Ctrl-C and SIGTERM to the launcher].
    handled = INTERRUPT_SIGNALS + ((preemption.PREEMPTION_SIGNAL,) if watch else ())
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        preemption.install(handled)
    try:
        check_resume(cfg, output_dir, schedule)
        if not preemption.interrupted():
            if cfg.num_workers == 1:
                _run_in_this_process(cfg, output_dir, run_name, group)
            else:
                _run_local_workers(cfg, output_dir, run_name, group)
        signum = preemption.received()
        if signum is None and not watch and (Path(output_dir) / PREEMPTED_FILE).is_file():
            # Only workers got the signal (`kill <worker pid>`): they stopped together all the same.
            log.warning("a worker got a stop signal: the workers stopped together")
            signum = signal.SIGTERM
        if signum in INTERRUPT_SIGNALS:
            _exit_interrupted(cfg, Path(output_dir), signum, resume_command)
        if watch:
            _requeue_if_preempted(Path(output_dir))
    finally:
        preemption.uninstall()
    metrics = read_metrics(Path(output_dir) / "metrics.jsonl")
    return metrics[-1] if metrics else {}


def _run_local_workers(cfg: TrainConfig, output_dir: str | os.PathLike, run_name: str | None,
                       group: str | None) -> None:
    """Start the workers as processes of this one and wait until all exited; none outlives this call.

    Raises:
        ProcessRaisedException, ProcessExitedException: a worker failed (unless a stop was
            asked for: see [Note: Ctrl-C and SIGTERM to the launcher]).
    """
    world = cfg.num_workers
    addr = cfg.cluster.master_addr
    # This process hosts the rendezvous store on a port the OS picks while binding it, so no other
    # program can take the port between choosing and binding it.
    timeout = datetime.timedelta(seconds=cfg.cluster.worker_timeout_s)
    store = dist.TCPStore(addr, cfg.cluster.master_port, world, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    port = store.port
    log.info("starting %d workers on this machine (%s:%d)", world, addr, port)
    if cfg.cluster.nodes > 1:  # only SLURM's launcher (train.py -m) spreads workers over nodes
        log.warning("cluster.nodes=%d has no effect on a run started without -m: its workers start on this "
                    "machine (python train.py -m cluster=slurm cluster.nodes=%d ... sends it to SLURM)",
                    cfg.cluster.nodes, cfg.cluster.nodes)
    _warn_if_oversubscribed(cfg)
    with preemption.interrupts_ignored_by_children(WORKER_STOP_SIGNALS):
        context = mp.start_processes(
            _spawned_worker,
            args=(cfg, world, addr, port, str(output_dir), run_name, group, os.getpid()),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
    preemption.forward_to(context.pids())  # a signal sent to this process alone reaches the workers
    try:
        _wait_for_workers(context, cfg.cluster.stop_grace_s, Path(output_dir))
    finally:
        kill_workers(context)
        del store


def _run_in_this_process(cfg: TrainConfig, output_dir: str | os.PathLike, run_name: str | None,
                         group: str | None) -> None:
    """Run the one worker of a one-worker run in this process: a process group of one (gloo, or
    NCCL on a GPU) over a store this process hosts, and the worker's loop, as a started worker runs it.

    A signal stops it as it stops local workers ([Note: Ctrl-C and SIGTERM to the launcher]): after
    the step, with a checkpoint by the same rules; a second SIGINT or SIGTERM stops it at once (a
    ``KeyboardInterrupt`` inside the step), and the caller then names the last finished step.
    """
    timeout = datetime.timedelta(seconds=cfg.cluster.worker_timeout_s)
    store = dist.TCPStore(cfg.cluster.master_addr, cfg.cluster.master_port, 1, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR=cfg.cluster.master_addr, MASTER_PORT=str(store.port))
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for s in INTERRUPT_SIGNALS:  # the launcher's handler records it (launch_workers); a second one stops at once
            previous[s] = signal.signal(s, _stop_at_once_when_repeated(signal.getsignal(s)))
    try:
        run_worker(cfg, 0, 1, output_dir, run_name=run_name, group=group, local_rank=0, local_world_size=1,
                   external_store=True)
    except KeyboardInterrupt:
        if not preemption.interrupted():  # Python's own handler: no recorded signal (e.g. no handler installed)
            raise
        log.warning("stopping now (second signal)")
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        del store


def _stop_at_once_when_repeated(record: Any) -> Any:
    """``record`` (the handler that records a signal), raising ``KeyboardInterrupt`` from the second
    interrupt signal on, so that a second Ctrl-C ends a step that runs in this process."""
    def handler(signum: int, frame: Any) -> None:
        if callable(record):
            record(signum, frame)
        if preemption.repeated():
            raise KeyboardInterrupt
    return handler


def _warn_if_oversubscribed(cfg: TrainConfig) -> None:
    """One warning line when the local workers outnumber the CPU cores they train on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if on_cpu and cfg.num_workers > cores:
        log.warning("%d workers on %d CPU cores: they take turns on the cores, so steps take longer and one "
                    "worker's bubble is another's compute (timings and utilization do not carry over to one "
                    "device per worker)", cfg.num_workers, cores)


def _grace_s(grace_s: float, output_dir: Path) -> tuple[float, float | None]:
    """(how long the workers get to stop, the longest step so far or None): at least ``grace_s``,
    and three longest steps (finish the step, save, leave) when that is longer."""
    metrics_file = output_dir / "metrics.jsonl"
    times = [r["step_time_s"] for r in (read_metrics(metrics_file) if metrics_file.is_file() else [])
             if isinstance(r.get("step_time_s"), (int, float))]
    longest = max(times) if times else None
    return max(grace_s, 3 * longest if longest else 0.0), longest


def _wait_for_workers(context: mp.ProcessContext, grace_s: float, output_dir: Path | None = None) -> None:
    """Join the workers; after SIGINT/SIGTERM give them ``grace_s`` (or three of the longest steps
    in ``output_dir``'s metrics, when longer) to stop, then kill them."""
    deadline: float | None = None
    while True:
        try:
            if join_or_raise(context, _POLL_S):
                return
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            if not preemption.interrupted():
                raise
            # E.g. a peer killed after the grace period, or a worker still starting up.
            log.warning("worker %d ended with an error while stopping: %s", err.error_index,
                        str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__)
            return
        if not preemption.interrupted():
            continue
        signum = preemption.received()
        name = signal.Signals(signum).name if signum is not None else "a signal"
        if deadline is None:
            grace_s, longest = _grace_s(grace_s, output_dir) if output_dir is not None else (grace_s, None)
            deadline = time.monotonic() + grace_s
            log.warning("got %s: the workers stop after the step they are in (at most %.0f s%s; send it again to "
                        "stop them at once)", name, grace_s,
                        f": steps take up to {longest:.0f} s" if longest and 3 * longest >= grace_s else "")
        if preemption.repeated() or time.monotonic() > deadline:
            log.warning("stopping the workers now (%s)", "second signal" if preemption.repeated()
                        else f"still running {grace_s:.0f} s after {name}")
            return  # the caller kills them
        preemption.pass_on()  # again: a worker still starting up ignores SIGINT


def _exit_interrupted(cfg: TrainConfig, output_dir: Path, signum: int,
                      resume_command: str | None = None) -> NoReturn:
    """Name the last finished step, the last checkpoint and the command that continues from it
    (``resume_command``, else the same command with ``resume=<checkpoint>``), then exit with
    128 + ``signum``."""
    step: int | None = None
    folder: str | os.PathLike | None = None
    marker = output_dir / PREEMPTED_FILE  # rank 0's {"step", "checkpoint"} when the workers agreed to stop
    if marker.is_file():
        info = json.loads(marker.read_text())
        marker.unlink()
        step, folder = info.get("step"), info.get("checkpoint")
    if step is None:
        metrics_file = output_dir / "metrics.jsonl"
        rows = read_metrics(metrics_file) if metrics_file.is_file() else []
        step = rows[-1].get("step") if rows else None
    if not folder:  # none saved on stopping: an earlier one, if any
        folder = find_latest(checkpoint_root(cfg, output_dir))
    if sys.stderr.isatty():  # end the progress bar's line (a worker's, left open when it stopped)
        sys.stderr.write("\n")
    log.warning("interrupted at step %s; last checkpoint: %s", "0 (no step finished)" if step is None else step,
                folder or "none")
    if not folder and step is not None and cfg.checkpoint.on_stop_after_s >= 0:
        log.warning("(a stop saves a checkpoint once the run trained checkpoint.on_stop_after_s=%g s, or with "
                    "checkpoint.every_steps / checkpoint.every_minutes)", cfg.checkpoint.on_stop_after_s)
    if folder and resume_command:
        log.warning("to continue from it: %s", resume_command)
    elif folder:
        log.warning("to continue, run the same command with resume=%s", folder)
    sys.exit(preemption.exit_code(signum))


def run_training(cfg: TrainConfig, output_dir: str | os.PathLike, overrides: list[str] | None = None,
                 sweep_dir: str | None = None, resume_command: str | None = None) -> dict[str, Any]:
    """Train one run described by ``cfg``; metrics go to ``output_dir/metrics.jsonl`` and wandb.

    Every run trains through the worker and its loop (``pipefisher.runtime.worker``): a run of
    one worker in this process, more as local processes, torchrun's or SLURM's (:func:`launch_workers`).
    ``resume_command``: the command line that continues this run from its latest checkpoint,
    printed when a signal stopped it after a checkpoint.

    Returns:
        The last step's metrics (rank 0's view).
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run_name = run_name_from_overrides(overrides or []) or None
    group = cfg.wandb.group or (Path(sweep_dir).name if sweep_dir else None)
    result = launch_workers(cfg, output_dir, run_name=run_name, group=group, resume_command=resume_command)
    log.info("finished: %s", {k: result[k] for k in ("step", "loss") if k in result})
    return result
