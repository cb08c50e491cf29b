"""Shared helpers of the benchmark scripts: config composition, worker processes, timing, tables.

The scripts in ``bench/`` import this module by name (``python bench/<name>.py`` puts ``bench/`` on
``sys.path``). Nothing here is part of the ``pipefisher`` package.

[Note: measuring on a shared CPU]
The benchmark machine has few cores and other jobs run beside us. Every ratio is therefore measured
side by side in one run: the variants being compared live in the same worker processes and take
turns step by step (A B A B …, the order rotated every round), and the tables report medians, so
background noise hits both sides alike. Workers are forked from a parent that has imported torch
but run no operation yet (OpenMP's thread pool does not survive ``fork``), each gets
``cores // workers`` intra-op threads (at least 1, DESIGN.md "Conventions"), and they meet in a
gloo process group through a file.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pipefisher

from pipefisher.config import TrainConfig, register_configs, to_train_config
from pipefisher.runtime.teardown import release_process_group

__all__ = [
    "REPO",
    "BatchFeed",
    "TensorStage",
    "compose",
    "cores",
    "caveat",
    "launch",
    "timed_step",
    "rotated",
    "timed_rotation",
    "timed_rounds",
    "median",
    "load",
    "table",
    "peak_rss_mib",
    "main_guard",
]

REPO = Path(__file__).resolve().parents[1]
_CONF_DIR = Path(pipefisher.__file__).resolve().parent / "conf"  # the conf train.py composes

# Settings every benchmark shares: CPU, no progress bar, no wandb.
_BASE = ["device=cpu", "progress=false", "wandb.mode=disabled"]


def compose(overrides: Sequence[str]) -> TrainConfig:
    """The validated run config of ``train.py`` with ``overrides`` (after the benchmark defaults)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(_CONF_DIR), version_base="1.3"):
        return to_train_config(hydra_compose(config_name="config", overrides=_BASE + list(overrides)))


def cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def caveat(workers: int) -> str:
    """The DESIGN.md caveat for a CPU figure measured with ``workers`` processes."""
    c = cores()
    if workers <= c:
        return f"{workers} worker(s) on {c} cores: figures carry over to one worker per device."
    return (f"{workers} workers on {c} cores (OVERSUBSCRIBED): one worker's bubble is another's compute, "
            "so bubbles cost little here and these figures do not carry over to a cluster; "
            "reach larger D through the simulator (bench/executor_overhead.py).")


def _child(rank: int, fn: Callable[..., Any], world: int, out_dir: str, args: tuple) -> None:
    threads = max(1, cores() // world)
    torch.set_num_threads(threads)
    rss_at_start = peak_rss_mib()
    path = Path(out_dir) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=900))
        try:
            result = fn(rank, world, *args)
        finally:
            release_process_group()
        payload = {"result": result, "threads": threads, "rss_at_start_mib": rss_at_start,
                   "peak_rss_mib": peak_rss_mib()}
    except BaseException:
        payload = {"error": traceback.format_exc()}
        path.write_text(json.dumps(payload))
        raise
    path.write_text(json.dumps(payload))


def launch(fn: Callable[..., Any], world: int, *args: Any) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, *args)`` in ``world`` forked processes joined in a gloo group.

    ``fn`` must return something JSON can hold. The parent must not have run a torch operation.

    Returns:
        Per rank: ``{"result", "threads", "rss_at_start_mib", "peak_rss_mib"}`` (peak RSS from
        ``getrusage(RUSAGE_SELF).ru_maxrss`` of that worker process; a forked child starts from the
        parent's resident set, interpreter and imports, which is ``rss_at_start_mib``).

    Raises:
        RuntimeError: a worker failed; the message holds its traceback.
    """
    with tempfile.TemporaryDirectory(prefix="pipefisher-bench-") as out_dir:
        try:
            mp.start_processes(_child, args=(fn, world, out_dir, args), nprocs=world, join=True, start_method="fork")
        except Exception as exc:
            errors = [json.loads(p.read_text()).get("error", "") for p in sorted(Path(out_dir).glob("rank*.json"))]
            raise RuntimeError(f"benchmark workers failed: {exc}\n" + "\n".join(e for e in errors if e)) from exc
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def timed_step(run: Callable[[], Any]) -> tuple[float, Any]:
    """Wall time of ``run()`` on the slowest worker, started together after a barrier.

    Returns:
        ``(seconds, run's return value)``; the seconds are the same on every rank.
    """
    dist.barrier()
    start = time.perf_counter()
    value = run()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item()), value


T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def rotated(items: Sequence[T], round_: int) -> list[T]:
    """``items`` in round ``round_``'s order: rotated left by the round (A B C D, B C D A, …), so that
    each takes every position in turn and none always runs first after the others."""
    k = round_ % len(items)
    return [*items[k:], *items[:k]]


def timed_rotation(runners: Mapping[K, Callable[[int], V]], warmup: int,
                   rounds: int | Mapping[K, int]) -> Iterator[tuple[int, K, float, V]]:
    """Run every runner once per round, ``runner(step)``, in :func:`rotated` order, each timed on the slowest rank
    (:func:`timed_step`); call it on every rank of the group. ``rounds`` per key: a runner leaves the rotation after
    its own ``warmup + rounds[key]`` rounds, the others go on.

    Yields:
        On every rank, warm-up included: ``(step, key, seconds, runner's return value)``; ``step`` is the round.
    """
    keys = list(runners)
    last = {key: warmup + (rounds if isinstance(rounds, int) else rounds[key]) for key in keys}
    for step in range(max(last.values(), default=0)):
        for key in rotated([key for key in keys if step < last[key]], step):
            seconds, value = timed_step(lambda: runners[key](step))
            yield step, key, seconds, value


def timed_rounds(workers: Mapping[K, Any], warmup: int,
                 rounds: int | Mapping[K, int]) -> Iterator[tuple[K, float, list]]:
    """Step every worker of this process once per round, in :func:`rotated` order, each step timed on the
    slowest rank (:func:`timed_step`); call it on every rank of the group.

    Args:
        workers: one ``PipelineWorker`` (anything with ``train_step(step)`` returning ``(losses, result)``
            whose ``result.events`` is this rank's timeline) per variant, built alike on every rank.
        warmup: rounds run first and not reported.
        rounds: rounds reported after them, or per key (:func:`timed_rotation`).

    Yields:
        On rank 0 only, after the warm-up: ``(key, seconds, events)`` for each step, ``events`` being every
        rank's timeline of that step gathered on rank 0. Other ranks yield nothing but take part in every step.
    """
    rank0 = dist.get_rank() == 0
    steps = {key: worker.train_step for key, worker in workers.items()}
    for step, key, seconds, (_, result) in timed_rotation(steps, warmup, rounds):
        gathered: list | None = [None] * dist.get_world_size() if rank0 else None
        dist.gather_object(result.events, gathered, dst=0)
        if rank0 and step >= warmup:
            yield key, seconds, [e for evs in gathered for e in evs]


def load() -> str:
    """The 1-minute load average against the cores, e.g. ``load 1.9 on 2 cores`` (others' jobs count too)."""
    return f"load {os.getloadavg()[0]:.1f} on {cores()} cores"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (``ru_maxrss``, KiB on Linux) in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (pastes into bench/README.md as it is)."""
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


class BatchFeed:
    """One stage's micro-batches of the current step for torch.distributed.pipelining, handed out
    in forward order: the k-th forward of a step on a stage is micro-batch k (true for every torch
    schedule the benchmarks run). See ``vs_torch_pipelining.py``, [Note: one BERT stage, two
    calling conventions].

    Args:
        worker: a ``PipelineWorker``; its ``get_batch(step, micro_batch)`` gives the batch.
    """

    def __init__(self, worker: Any) -> None:
        self.worker, self.step, self.next = worker, 0, 0

    def start(self, step: int) -> None:
        self.step, self.next = step, 0

    def take(self) -> dict[str, torch.Tensor]:
        mb, self.next = self.next, self.next + 1
        return self.worker.get_batch(self.step, mb)


class TensorStage(nn.Module):
    """A ``BertStage`` with torch.distributed.pipelining's convention: one tensor in, one out;
    the micro-batch comes from its :class:`BatchFeed`."""

    def __init__(self, stage: nn.Module, feed: BatchFeed) -> None:
        super().__init__()
        self.stage = stage
        self.feed = feed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.feed.take()
        return self.stage(None if self.stage.has_embeddings else x, batch)  # (B, S, H) or [mlm, nsp]


def main_guard(main: Callable[[], None]) -> None:
    """Print the machine it runs on (every table's figures belong to it), run ``main``; exit 1 with the error
    when the benchmark fails to run."""
    from pipefisher.hardware import describe_hardware

    print(f"hardware: {describe_hardware()}", flush=True)
    try:
        main()
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not crash with a trace only
        traceback.print_exc()
        print(f"benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)


# --------------------------------------------------------------------------------------------
# train.py runs and their text (convergence.py, kfac_staleness_check.py)
# --------------------------------------------------------------------------------------------


def read_calibration_for(path: Path, losses: Sequence[float],
                         field: str = "--target-loss") -> tuple[Any, tuple[float, ...]]:
    """Read a calibration file (``planning.calibration``) and check, before any minute is measured, that its
    steps reach every target in ``losses`` (none given: the file's default target); a target outside its
    range exits naming ``field``.

    Returns:
        The calibration and the targets checked.
    """
    from pipefisher.planning.calibration import read_calibration

    calibration = read_calibration(path)
    losses = tuple(losses) or (calibration.default_target,)
    for loss in losses:
        try:
            calibration.steps_to(loss, field=field)
        except ValueError as err:
            raise SystemExit(str(err)) from None
    return calibration, losses


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The step rows of a run's ``metrics.jsonl``, one per step in order (an evaluation that came as
    its own record of a step is merged into that step's row); empty when there is no file yet."""
    from pipefisher.tracking.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for r in read_metrics(path):
            if "step" in r:
                by_step.setdefault(int(r["step"]), {}).update(r)
    return [by_step[s] for s in sorted(by_step)]


# --------------------------------------------------------------------------------------------
# Prepared text
# --------------------------------------------------------------------------------------------

PREPARE_SOURCE = REPO / "pipefisher" / "data" / "prepare.py"


def prepare_cache_key(paths: Sequence[Path], options: dict[str, Any]) -> str:
    """Hash of the input files (text, an existing vocabulary), the preparation options, prepare.py and the
    tokenizers version (its trainer makes the vocabulary): a change to any of them prepares again."""
    import hashlib

    import tokenizers

    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    digest.update(json.dumps(options, sort_keys=True).encode())
    digest.update(PREPARE_SOURCE.read_bytes())
    digest.update(tokenizers.__version__.encode())
    return digest.hexdigest()[:16]


def prepare_command(text: Path, out: Path, options: dict[str, Any]) -> list[str]:
    """``python -m pipefisher.data.prepare`` with ``options`` (keys are its flags without ``--``, ``_``
    for ``-``; ``vocab``: an existing vocab.txt)."""
    cmd = [sys.executable, "-m", "pipefisher.data.prepare", "--input", str(text), "--output-dir", str(out),
           "--no-progress"]
    for key, value in sorted(options.items()):
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def prepared_shards(text: Path, cache_dir: Path, options: dict[str, Any], dry_run: bool = False) -> tuple[Path, int]:
    """(shard folder, vocabulary size) of ``text`` prepared with ``options``, from the cache under
    ``cache_dir`` or made now (into a temporary folder renamed when complete, so an interrupted
    preparation is never taken for a finished one)."""
    import shlex
    import shutil
    import subprocess

    inputs = [text] + ([Path(options["vocab"])] if options.get("vocab") else [])
    final = Path(cache_dir) / f"{text.stem}-{prepare_cache_key(inputs, options)}"
    if not (final / "prepare.json").is_file():
        tmp = final.with_name(final.name + ".tmp")
        cmd = prepare_command(text, tmp, options)
        print("$ " + shlex.join(cmd), flush=True)
        if dry_run:
            return final, -1
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"data preparation failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        print(f"prepared {text} -> {final} in {time.monotonic() - start:.0f} s", flush=True)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    info = json.loads((final / "prepare.json").read_text())
    return final, int(info["vocab_size_actual"])
