"""How a job of local workers ends when one fails: with the root cause's error, and no worker left.

[Note: failures end the whole job]
Local workers are started with ``torch.multiprocessing.start_processes`` and joined by
:func:`join_or_raise`. When one exits with an exception or is killed, its peers usually fail too,
from the closed connection, and whichever exit is seen first need not be the cause: a worker that
raised may still be unwinding (its process group already closed) when a peer's "connection closed"
ends. So the launcher gives the others :data:`FAILURE_GRACE_S` to end by themselves, kills those
still running, and raises for the root cause: the first failed worker whose error is not a peer
failure (a closed connection or a timeout), else the first failed one, with the ranks of the others
named. A worker that stalls without exiting is caught by the process-group timeout
(``cluster.worker_timeout_s``): its peers' blocking receives and collectives raise, and they exit.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import time

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["FAILURE_GRACE_S", "join_or_raise", "kill_workers", "peer_failure"]

log = logging.getLogger(__name__)

#: After a worker fails, how long its peers get to end by themselves (most fail at once from the
#: closed connection) before they are killed: see [Note: failures end the whole job].
FAILURE_GRACE_S = 5.0
#: What a worker's error says when it failed because a peer did (a closed connection, a timeout).
_PEER_FAILURE_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                       "DistNetworkError", "DistBackendError", "DistStoreError", "caused by a remote worker crashing")


def peer_failure(err: BaseException | str) -> bool:
    """Whether ``err`` (an exception or a worker's traceback) is how a worker learns that a peer
    failed: a closed connection or a timeout of the process group, as opposed to a failure of its own."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return any(s in text for s in _PEER_FAILURE_TEXTS)


def join_or_raise(context: mp.ProcessContext, timeout: float) -> bool:
    """Wait up to ``timeout`` s; True when all workers exited cleanly, False while some run.

    Raises:
        ProcessRaisedException, ProcessExitedException: a worker failed; the others were given
            :data:`FAILURE_GRACE_S` to end and then killed, and the error raised is the root
            cause's ([Note: failures end the whole job]).
    """
    ready = multiprocessing.connection.wait(list(context.sentinels), timeout=timeout)
    first = None
    for sentinel in ready:
        index = context.sentinels.pop(sentinel)
        context.processes[index].join()
        if context.processes[index].exitcode != 0:
            first = index
            break
    if first is None:
        return not context.sentinels
    deadline = time.monotonic() + FAILURE_GRACE_S
    for process in context.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    killed = {i for i, process in enumerate(context.processes) if process.is_alive()}
    kill_workers(context)
    context.sentinels.clear()
    failed = [first] + [i for i, process in enumerate(context.processes)
                        if i != first and i not in killed and process.exitcode != 0]
    errors = {i: _worker_error(context, i) for i in failed}
    cause = next((i for i in failed if not peer_failure(errors[i][0])), first)
    err = errors[cause][1]
    others = [i for i in failed if i != cause]
    if others:
        log.error("worker %d failed; worker%s %s failed after it%s", cause, "s" if len(others) > 1 else "",
                  ", ".join(map(str, others)), f" ({len(killed)} killed)" if killed else "")
    raise err


def _worker_error(context: mp.ProcessContext, index: int) -> tuple[str, Exception]:
    """(worker ``index``'s traceback or exit, the exception that reports it), as torch's join words it."""
    process = context.processes[index]
    if os.access(context.error_files[index], os.R_OK):
        with open(context.error_files[index], "rb") as fh:
            trace = pickle.load(fh)
        return trace, mp.ProcessRaisedException(
            f"\n\n-- Process {index:d} terminated with the following error:\n{trace}", index, process.pid)
    code = process.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"<Unknown signal {-code}>"
        message = f"process {index:d} terminated with signal {name}"
        return message, mp.ProcessExitedException(message, error_index=index, error_pid=process.pid,
                                                   exit_code=code, signal_name=name)
    message = f"process {index:d} terminated with exit code {code}"
    return message, mp.ProcessExitedException(message, error_index=index, error_pid=process.pid, exit_code=code)


def kill_workers(context: mp.ProcessContext) -> None:
    """Kill the workers that still run and reap them all."""
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join()
