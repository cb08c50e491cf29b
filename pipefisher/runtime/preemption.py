"""Stopping on a signal: SLURM's preemption warning (checkpoint, requeue, resume) and Ctrl-C/SIGTERM.

SLURM warns a job before it takes the nodes away: ``--signal=USR2@<s>`` (submitit asks for it,
``hydra.launcher.signal_delay_s``) before the time limit, and ``scancel --signal=USR2`` or a
preemption policy at any time. The signal reaches every worker at a slightly different moment,
somewhere inside a step; a worker cannot stop there without leaving its peers blocked in a send.

[Note: stopping on a signal]
1. :func:`install` replaces the signal's handler in every process that gets it with one that only
   records it (and remembers the handler it replaced: submitit's, in a submitit job).
2. At the end of each step the workers agree whether any of them got the signal (the flag rides
   on the step's loss all-reduce, so it costs nothing): all stop after the same step.
3. They save a checkpoint of that step (whatever ``checkpoint.every_steps`` says) and meet at a
   barrier, so the checkpoint is complete before anyone leaves.
4. Worker 0 (or, when the workers are local processes of one launcher process, the launcher)
   requeues the job (:func:`requeue`): submitit's handler pickles the job again and calls
   ``scontrol requeue``; without submitit we call it ourselves. Every worker then exits with
   status 255, and the job step ends. If the job cannot be requeued (submitit's
   ``max_num_timeout`` reached), every worker raises instead, naming the checkpoint.
5. The requeued job (``SLURM_RESTART_COUNT`` > 0) runs the same config in the same output
   directory; :func:`resume_mode` turns ``resume=none`` into ``auto`` there, so it continues from
   that checkpoint with the loss trajectory of an uninterrupted run.

The requeue path needs SLURM (``cluster.requeue``, on by default); outside a SLURM job the
workers leave SIGUSR2 alone.

[Note: Ctrl-C and SIGTERM]
The same agreement stops a run of local worker processes on :data:`INTERRUPT_SIGNALS` (issue 16,
item 3), without the requeue:
1. The launcher process records SIGINT and SIGTERM (:func:`install`) and passes them on to its
   workers as SIGINT (:func:`forward_to`), again every poll until they are gone: a worker that
   is still starting up ignores SIGINT (it inherits SIG_IGN, :func:`interrupts_ignored_by_children`,
   so that a Ctrl-C during its imports is no traceback) and would miss a single one. A Ctrl-C
   reaches the workers directly too (one foreground process group); recording twice is harmless.
2. A worker records SIGINT and SIGTERM too (:func:`stop_on_interrupt`): ``timeout``, ``kill --
   -PGID`` and job managers signal every process of the group, so the workers get SIGTERM
   directly, at slightly different moments inside a step (issue 40, item 2). A worker that died
   of it would leave its peers in a send and the run without its checkpoint.
   (The launcher ends the peers of a failed worker with SIGKILL, after a short grace in which
   most end by themselves: [Note: failures end the whole job] in ``pipefisher.launch.failures``.)
   ``torch.multiprocessing`` also makes SIGINT a worker's
   parent-death signal: a worker whose launcher was killed stops after the step too.
3. The workers agree at the step's end as in [Note: stopping on a signal], save a checkpoint
   when the run has checkpointing on, and exit normally; rank 0 leaves :data:`PREEMPTED_FILE`
   with the step and the checkpoint (``null`` when none was saved). After that a worker ignores
   both signals: Python's shutdown would put back their default action, and a worker that
   finished would die of the launcher's next pass-on (or of a second group signal). When only
   workers got the signal (``kill <worker pid>``), the launcher learns of the stop from that file
   and ends as if it had got SIGTERM itself.
4. The launcher waits a bounded time for that (a long step must not hold the user hostage),
   kills the workers that are left, or at once on a second signal (:func:`repeated`), names
   the step and the last checkpoint, and exits with :func:`exit_code` (130 on SIGINT, 143 on
   SIGTERM, the shell's convention).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Union

__all__ = [
    "PREEMPTION_SIGNAL",
    "PREEMPTED_EXIT_CODE",
    "PREEMPTED_FILE",
    "INTERRUPT_SIGNALS",
    "in_slurm_job",
    "watching",
    "requeued_attempt",
    "resume_mode",
    "install",
    "uninstall",
    "requested",
    "received",
    "interrupted",
    "repeated",
    "exit_code",
    "forward_to",
    "pass_on",
    "interrupts_ignored_by_children",
    "stop_on_interrupt",
    "requeue",
    "RequeueError",
]

log = logging.getLogger(__name__)

#: The signal SLURM sends ahead of a time limit (``--signal=USR2@…``, as submitit asks) or a preemption.
PREEMPTION_SIGNAL = signal.SIGUSR2
#: Exit status of every worker process after a checkpoint-and-requeue (what submitit uses too).
PREEMPTED_EXIT_CODE = 255
#: Rank 0 leaves ``{"step", "checkpoint"}`` in this file of the run's output directory when the
#: workers stopped on the signal; the process that owns the requeue reads it.
PREEMPTED_FILE = "preempted.json"
#: Signals that stop a run of local workers after a step, without a requeue (see [Note: Ctrl-C and SIGTERM]).
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)

Handler = Union[Callable[[int, Union[types.FrameType, None]], Any], int, None]

_received: list[int] = []  # signals recorded since install()
_previous: dict[int, Handler] = {}  # handler each installed signal had before
_forward: list[int] = []  # child pids the signal is passed on to (local worker processes)
_interrupts = 0  # how many interrupt signals were recorded since install()


def in_slurm_job() -> bool:
    """Whether this process runs inside a SLURM job allocation."""
    return "SLURM_JOB_ID" in os.environ


def watching(requeue: bool) -> bool:
    """Whether this process handles SLURM's warning signal: ``cluster.requeue`` inside a SLURM job."""
    return requeue and in_slurm_job()


def requeued_attempt() -> int:
    """How many times SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 outside SLURM)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def resume_mode(resume: str, requeue_enabled: bool) -> str:
    """The ``resume`` a run uses: ``auto`` instead of ``none`` in a requeued SLURM job (see
    [Note: stopping on a signal]); anything else as configured."""
    if resume == "none" and requeue_enabled and requeued_attempt() > 0:
        log.info("requeued SLURM job (SLURM_RESTART_COUNT=%d): resume=auto", requeued_attempt())
        return "auto"
    return resume


def _record(signum: int, frame: types.FrameType | None) -> None:
    global _interrupts
    if signum in INTERRUPT_SIGNALS:
        _interrupts += 1  # the launcher reports it from its own loop (see [Note: Ctrl-C and SIGTERM])
    if signum not in _received:
        _received.append(signum)
        if signum not in INTERRUPT_SIGNALS:
            # The logging module is not reentrant; a signal may arrive inside a log call.
            os.write(2, f"[pipefisher] pid {os.getpid()}: got {signal.Signals(signum).name}; "
                        "checkpointing after this step, then requeueing\n".encode())
    _pass_on(signum)


def _pass_on(signum: int) -> None:
    """Send ``signum`` to the processes of :func:`forward_to` that still run; an interrupt signal
    goes on as SIGINT (workers keep SIGTERM's default action: see [Note: Ctrl-C and SIGTERM])."""
    if signum in INTERRUPT_SIGNALS:
        signum = signal.SIGINT
    for pid in _forward:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def install(signals: Iterable[int] = (PREEMPTION_SIGNAL,)) -> None:
    """Record ``signals`` instead of acting on them, remembering the handlers they had.

    Must run in the main thread. Idempotent: a second call keeps the first call's saved handlers.
    """
    for s in signals:
        current = signal.getsignal(s)
        if current is _record:
            continue
        _previous[s] = current
        signal.signal(s, _record)


def uninstall() -> None:
    """Put the saved handlers back and forget what was recorded."""
    global _interrupts
    for s, h in _previous.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    _previous.clear()
    _received.clear()
    _forward.clear()
    _interrupts = 0


def requested() -> bool:
    """Whether a recorded signal asks this process to stop (since :func:`install`)."""
    return bool(_received)


def received() -> int | None:
    """The first signal recorded since :func:`install`, or None."""
    return _received[0] if _received else None


def interrupted() -> bool:
    """Whether an interrupt signal (:data:`INTERRUPT_SIGNALS`) was recorded since :func:`install`."""
    return _interrupts > 0


def repeated() -> bool:
    """Whether interrupt signals came more than once (a second Ctrl-C: stop at once)."""
    return _interrupts > 1


def exit_code(signum: int) -> int:
    """Exit status of a process that stopped on ``signum``: 128 + its number (130 for SIGINT)."""
    return 128 + int(signum)


def forward_to(pids: Iterable[int]) -> None:
    """Pass recorded signals on to these processes too (the local workers of a launcher process)."""
    _forward[:] = list(pids)
    pass_on()


def pass_on() -> None:
    """Send the first recorded signal (if any) to the processes of :func:`forward_to` again."""
    if _received:
        _pass_on(_received[0])


@contextlib.contextmanager
def interrupts_ignored_by_children(signals: Iterable[int] = INTERRUPT_SIGNALS) -> Iterator[None]:
    """Start processes inside this block with ``signals`` ignored (a disposition that survives exec).

    A worker started with ``spawn`` imports torch for seconds before it can install its own
    handler (:func:`stop_on_interrupt`); with Python's default handler a Ctrl-C there would end
    it with a ``KeyboardInterrupt`` traceback, and a SIGTERM to the process group would kill it.
    This process ignores them for the moment of the start (milliseconds: a Ctrl-C then is lost,
    and the user presses it again; the launcher passes a recorded signal on again every poll),
    then gets its handlers back.
    """
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stop_on_interrupt(signals: Iterable[int] = INTERRUPT_SIGNALS) -> Iterator[None]:
    """In a local worker process: record ``signals`` (SIGINT, SIGTERM) inside this block, so that
    the worker stops after the step all workers agree on (see [Note: Ctrl-C and SIGTERM]);
    :func:`requested` then says so.

    After the block they are ignored: the launcher keeps passing SIGINT on until the process is
    gone, and Python's shutdown puts the default action back where a Python handler was set (a
    worker that had finished would die of the signal and look failed).
    """
    signals = tuple(signals)
    install(signals)
    try:
        yield
    finally:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)


class RequeueError(RuntimeError):
    """SLURM or submitit did not requeue the job (e.g. too many time-outs)."""


def requeue(step: int, checkpoint: str | os.PathLike) -> None:
    """Requeue this SLURM job after the workers checkpointed ``step`` in ``checkpoint``; returns
    once it is requeued.

    In a submitit job whose handler was saved by :func:`install` in this process, submitit does
    it (it pickles the job for the next attempt, counts time-outs against
    ``hydra.launcher.max_num_timeout`` and calls ``scontrol requeue``); otherwise
    ``scontrol requeue $SLURM_JOB_ID`` is run here. The caller then exits with
    :data:`PREEMPTED_EXIT_CODE`.

    Raises:
        RequeueError: the job was not requeued; the message says why, where the checkpoint is
            and how to go on.
    """
    try:
        _requeue(f"workers checkpointed after step {step} in {checkpoint}")
    except RequeueError as err:
        raise RequeueError(f"stopped after step {step} on SLURM's signal with a checkpoint in {checkpoint}, "
                           f"but {err}; resubmit the run with resume=auto") from err


def _requeue(reason: str) -> None:
    signum = _received[0] if _received else PREEMPTION_SIGNAL
    previous = _previous.get(signum)
    owner = getattr(previous, "__self__", None)
    job = os.environ.get("SLURM_JOB_ID")
    log.warning("%s: requeueing SLURM job %s", reason, job or "?")
    if callable(previous) and owner is not None and type(owner).__module__.startswith("submitit"):
        try:
            previous(signum, None)  # submitit's checkpoint_and_try_requeue
        except SystemExit:  # it requeued and wants the process to end: our caller does that
            return
        except Exception as e:  # UncompletedJobError: submitit refused
            raise RequeueError(f"submitit did not requeue job {job}: {e} (raise hydra.launcher.max_num_timeout "
                               "to allow more)") from e
        raise RequeueError(f"submitit's handler returned without requeueing job {job} (not the job's task 0?)")
    if job is None:
        raise RequeueError("not inside a SLURM job (SLURM_JOB_ID is not set)")
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise RequeueError(f"`scontrol requeue {job}` failed: {getattr(e, 'stderr', '') or e}") from e
