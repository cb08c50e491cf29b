"""What ``python train.py -m cluster=slurm`` shows and does while its SLURM jobs run (issue 24).

hydra-submitit's launcher submits the sweep as a job array and waits in silence; ours
(``hydra_plugins.pipefisher_slurm.sweep_launcher.SweepSlurmLauncher``, chosen by ``conf/cluster/slurm.yaml``) uses
this module to

- say where the task logs are (submitit's folder) and log progress: jobs pending / running / done
  and the latest step of each run from its ``metrics.jsonl`` (:func:`watch`);
- cancel the sweep's jobs on Ctrl-C or SIGTERM (``scancel``), naming them, and exit with 130 or
  143 without a traceback (:func:`cancel`);
- read job states from ``squeue`` on a cluster without accounting (:class:`SqueueWatcher`).

[Note: job states without accounting]
submitit learns that a job ended from its result file or, when the job left none, from ``sacct``.
On a cluster without accounting (``AccountingStorageType=accounting_storage/none``, as the one
``scripts/slurm/start.sh`` starts) every sacct call fails: sacct prints "Slurm accounting storage
is disabled" and submitit logs "Bypassing sacct error" (three times: its two handlers and Hydra's),
at 2, 4, 8, … s after each submission. There the states come from ``squeue --states=all`` instead,
which lists a job until ``MinJobAge`` seconds (300 by default) after it ended; one no longer listed
counts as ended (submitit then reads its result, or reports the missing one with the task's log).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
import typing as tp
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

__all__ = ["Run", "SqueueWatcher", "accounting_error", "job_states_from_squeue", "latest_step", "progress_line",
           "watch", "cancel", "log_folder", "Interrupted", "interrupts_raise", "interrupts_deferred"]

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0  # at most one progress line this often while only steps change
_POLL_S = 1.0  # how often result files (and, through the watcher, job states) are looked at
_RUNNING = ("RUNNING", "COMPLETING", "CONFIGURING", "STAGE_OUT")


@dataclass(frozen=True)
class Run:
    """One run of the sweep: Hydra's job number, its overrides, its run folder and step count."""

    num: int
    overrides: tuple[str, ...]
    folder: Path | None  # None when its path cannot be known before the job runs
    steps: int | None

    @property
    def label(self) -> str:
        """``#<num>``, as Hydra lists the sweep's jobs when it submits them."""
        return f"#{self.num}"


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while the launcher waited for its jobs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# -- job states --------------------------------------------------------------------------------------


def accounting_error() -> str | None:
    """Why ``sacct`` cannot report job states here (its first error line), or None when it can."""
    try:
        res = subprocess.run(["sacct", "-n", "-X", "-o", "JobID", "-j", "1"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"sacct: {e}"
    if res.returncode == 0:
        return None
    return (res.stderr.strip().splitlines() or [f"sacct exited with status {res.returncode}"])[0]


class SqueueWatcher(SlurmInfoWatcher):
    """submitit's job-state watcher, reading ``squeue --states=all`` instead of ``sacct``.

    See [Note: job states without accounting].
    """

    def _make_command(self) -> list[str] | None:
        ids = sorted({x.split("_")[0] for x in self._registered - self._finished})
        if not ids:
            return None
        return ["squeue", "-h", "-r", "--states=all", "-o", "%i|%T", "-j", ",".join(ids)]

    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        text = string.decode() if isinstance(string, bytes) else string
        return {job: {"State": state} for job, _, state in
                (line.strip().partition("|") for line in text.splitlines() if "|" in line)}

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        try:
            res = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("squeue failed: %s", e)
            return
        # squeue exits with 1 when none of the ids is known any more ("Invalid job id specified").
        if res.returncode and "Invalid job id" not in res.stderr:
            log.debug("squeue failed: %s", res.stderr.strip())
            return
        info = self.read_info(res.stdout)
        for job_id in self._registered - self._finished:
            self._info_dict[job_id] = info.get(job_id, {"State": "ENDED"})  # not listed: ended long ago
        self._last_status_check = time.time()
        self._finished |= {j for j in self._registered if self.is_done(j, mode="cache")}


@contextmanager
def job_states_from_squeue(delay_s: float = 10.0) -> Iterator[SqueueWatcher]:
    """Let every submitit SLURM job made inside read its state from ``squeue`` (polled at most
    every ``delay_s``); submitit's sacct watcher comes back on exit."""
    previous = SlurmJob.watcher
    SlurmJob.watcher = SqueueWatcher(delay_s=delay_s)  # type: ignore[arg-type]  (submitit compares it with a float)
    try:
        yield SlurmJob.watcher
    finally:
        SlurmJob.watcher = previous


def _state(job: SlurmJob) -> str:
    """``pending``, ``running`` or ``done`` (a result file for every task, or SLURM says it ended)."""
    if job.done():
        return "done"
    return "running" if job.watcher.get_state(job.job_id, mode="cache").upper() in _RUNNING else "pending"


# -- progress ----------------------------------------------------------------------------------------


def latest_step(metrics: Path, chunk: int = 4096) -> int | None:
    """The ``step`` of the last complete record of a ``metrics.jsonl`` (0-based), or None."""
    try:
        with metrics.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chunk))
            lines = f.read().split(b"\n")
    except OSError:
        return None
    for line in reversed(lines[:-1]):  # the part after the last newline may be half-written
        try:
            step = json.loads(line).get("step")
        except ValueError:
            continue
        if isinstance(step, int):
            return step
    return None


def progress_line(states: Sequence[str], runs: Sequence[Run], limit: int = 8) -> str:
    """``SLURM jobs: 0 pending, 2 running, 0 done of 2; steps: #0 3/5, #1 1/5``: the counts, then
    the steps finished by each running job's run (at most ``limit`` of them)."""
    counts = ", ".join(f"{states.count(s)} {s}" for s in ("pending", "running", "done"))
    steps = []
    for state, run in zip(states, runs):
        step = latest_step(run.folder / "metrics.jsonl") if state == "running" and run.folder else None
        if step is not None:
            steps.append(f"{run.label} {step + 1}/{run.steps if run.steps is not None else '?'}")
    more = f", … ({len(steps) - limit} more)" if len(steps) > limit else ""
    return f"SLURM jobs: {counts} of {len(states)}" + (f"; steps: {', '.join(steps[:limit])}{more}" if steps else "")


def watch(jobs: Sequence[SlurmJob], runs: Sequence[Run], every_s: float = PROGRESS_EVERY_S,
          poll_s: float = _POLL_S, say: Callable[[str], None] = log.info) -> None:
    """Wait until every job is done, saying :func:`progress_line` when a job changes state and,
    while only steps advance, at most every ``every_s``."""
    last_counts: tuple[int, ...] | None = None
    last_line, last_said = "", 0.0
    while True:
        states = [_state(j) for j in jobs]
        counts = tuple(states.count(s) for s in ("pending", "running", "done"))
        line = progress_line(states, runs)
        if counts != last_counts or (line != last_line and time.monotonic() - last_said >= every_s):
            say(line)
            last_counts, last_line, last_said = counts, line, time.monotonic()
        if counts[2] == len(jobs):
            return
        time.sleep(poll_s)


# -- Ctrl-C ------------------------------------------------------------------------------------------

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Interrupted` in the main thread while inside."""

    def stop(signum: int, frame: tp.Any) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def interrupts_deferred() -> Iterator[list[int]]:
    """SIGINT and SIGTERM are recorded (into the yielded list), not acted on, while inside: a
    submission that sbatch already accepted is not cut off before its job ids are known."""
    seen: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in _STOP_SIGNALS}
    try:
        yield seen
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else as given."""
    full, cwd = path.resolve(), Path.cwd().resolve()
    return str(full.relative_to(cwd)) if cwd in full.parents else str(path)


def log_folder(jobs: Sequence[SlurmJob]) -> str:
    """Where submitit keeps the jobs' task logs: ``<sweep dir>/.submitit/<job id>/``."""
    return f"{shown(jobs[0].paths.folder.parent)}/<job id>/" if jobs else "(no job)"


def _varying(runs: Sequence[Run]) -> dict[int, str]:
    """``{run number: the overrides that differ between the runs}`` (all of them for one run)."""
    common = set.intersection(*(set(r.overrides) for r in runs)) if len(runs) > 1 else set()
    return {r.num: " ".join(o for o in r.overrides if o not in common) for r in runs}


def cancel(jobs: Sequence[SlurmJob], runs: Sequence[Run], signum: int, say: Callable[[str], None] = log.warning) -> None:
    """``scancel`` every job that has not finished, and say which (with the overrides that set
    their runs apart) and where their task logs are. Signals that arrive meanwhile are ignored."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in _STOP_SIGNALS}
    try:
        left = [(j, r) for j, r in zip(jobs, runs)
                if not all(sub.paths.result_pickle.exists() for sub in (j._sub_jobs or [j]))]
        if left:
            res = subprocess.run(["scancel", *(j.job_id for j, _ in left)], capture_output=True, text=True,
                                 timeout=60)
            if res.returncode:
                say(f"scancel failed: {res.stderr.strip()}")
        varying = _varying(runs)
        named = ", ".join(f"{j.job_id} ({r.label} {varying[r.num]})".replace(" )", ")") for j, r in left)
        say(f"got {signal.Signals(signum).name}: cancelled {len(left)} of {len(jobs)} SLURM jobs"
            + (f": {named}" if left else " (all had finished)") + f"; task logs in {log_folder(jobs)}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
