"""Time to target loss on real text: NVLAMB, K-FAC on the critical path and PipeFisher (issue 13).

    python bench/convergence.py                 # bert-mini on WikiText-2 valid, 1f1b and chimera at D=2
    python bench/convergence.py --quick         # bert-tiny, 1f1b, 40 steps, no sweep: ~4 min
    python bench/convergence.py --dry-run       # print the commands only
    python bench/convergence.py --lr-sweep 5e-3,1e-2,2e-2 --staleness 1,2,4,8

Every run is ``python train.py ... hydra.run.dir=<dir>`` in a subprocess (the project's own training
path, metrics.jsonl included) on NVIDIA-format shards that ``python -m pipefisher.data.prepare`` makes
from the text (raw WikiText or one sentence per line), cached under ``--cache-dir`` by a hash of the
text, the preparation options and prepare.py itself. The MLM loss is smoothed by a trailing mean over
``--smooth`` (50) steps; a run reaches a target at the first step whose smoothed loss is at or below it.

Targets: ``nvlamb`` = NVLAMB's final smoothed MLM loss in the same pipeline (the others reach it in
fewer steps or seconds, or not); ``unigram`` = the unigram entropy of the masked-token labels of the
prepared shards (the loss of a model that ignores context, the first plateau of pretraining) minus
``--unigram-margin``, or ``--target``.

[Note: interleaved rounds]
The machine is shared, so a slow spell must not fall on one arm. With ``--chunk-steps C`` every run
goes ``C`` steps at a time in rounds (arms rotated every round): a run writes a checkpoint every C
steps (``checkpoint.every_steps=C resume=auto``); once the checkpoint after the chunk's last step is
complete its process group is stopped, and the next round resumes it, which continues exactly the
trajectory of an uninterrupted run (README "Checkpoints and resume"). ``step_time_s`` excludes process
start and checkpoint writes; the first step after each resume carries some warm-up. Time to target is
given as measured (sum of ``step_time_s`` up to the step) and as steps x the run's median step time;
the ratios use the latter, which a burst of load on some steps does not move.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np

import _harness as h
from pipefisher.tracking.metrics import read_metrics

DEFAULT_TEXT = h.REPO.parent / "shared" / "data" / "wikitext-2" / "valid.txt"
PREPARE_SOURCE = h.REPO / "pipefisher" / "data" / "prepare.py"
SEQ_LEN, MAX_PREDICTIONS = 128, 20

#: The optimizer arms and their Hydra overrides (edit here). ``kfac`` becomes one arm per
#: ``--kfac-intervals`` value, ``kfac-k<K>`` (critical-path K-FAC refreshing every K steps);
#: ``--staleness`` adds ``stale-k<K>`` arms (below). Extra overrides: ``--extra ARM:key=value``.
ARMS: dict[str, list[str]] = {
    "nvlamb": ["optimizer=nvlamb"],
    "kfac": ["optimizer=kfac"],
    "pipefisher": ["optimizer=pipefisher"],
}


def kfac_overrides(k: int, *, deferred: bool = False) -> list[str]:
    """Critical-path K-FAC refreshing every ``k`` steps; ``deferred``: with PipeFisher's staleness
    (inverses of a refresh used from the next cycle on), the numerics of PipeFisher at interval k."""
    extra = ["optimizer.deferred_inverse=true"] if deferred else []
    return ARMS["kfac"] + [f"optimizer.curvature_interval={k}", f"optimizer.inverse_interval={k}", *extra]


def family(arm: str) -> str:
    """``kfac`` for ``kfac-k8``, ``stale`` for ``stale-k4``; the name itself otherwise."""
    return arm.split("-")[0]


# --- pure functions (tested in tests/test_convergence_bench.py) ---------------------------------

def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start); NaN stays NaN."""
    if window < 1:
        raise ValueError(f"window={window}: must be at least 1")
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


def steps_to_target(smoothed: Sequence[float], target: float) -> int | None:
    """Optimizer steps taken when the smoothed loss first is at or below ``target`` (None: never)."""
    for i, v in enumerate(smoothed):
        if v <= target:
            return i + 1
    return None


def seconds_to(step_times: Sequence[float], steps: int | None) -> float | None:
    """Sum of the first ``steps`` step times (None when the target was not reached)."""
    return None if steps is None else math.fsum(step_times[:steps])


def unigram_entropy(labels: np.ndarray, valid: np.ndarray | None = None) -> float:
    """Entropy in nats of the empirical distribution of ``labels`` (where ``valid``; default: non-0).

    The MLM loss of a model that predicts every masked token from its frequency alone.
    """
    labels = np.asarray(labels)
    ids = labels[np.asarray(valid, dtype=bool)] if valid is not None else labels[labels != 0]
    counts = np.bincount(ids.ravel().astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def shards_unigram_entropy(shards: Sequence[Path]) -> float:
    """`unigram_entropy` of ``masked_lm_ids`` over NVIDIA-format shards (padding: position 0)."""
    labels, valid = [], []
    for path in shards:
        with h5py.File(path, "r") as f:
            labels.append(np.asarray(f["masked_lm_ids"]))
            valid.append(np.asarray(f["masked_lm_positions"]) > 0)  # position 0 is [CLS], never masked
    return unigram_entropy(np.concatenate(labels), np.concatenate(valid))


def mlm_losses(records: Sequence[dict[str, Any]]) -> list[float]:
    """The MLM loss of each record; NaN where metrics.jsonl holds null (a non-finite loss)."""
    return [math.nan if r.get("mlm_loss") is None else float(r["mlm_loss"]) for r in records]


def typical_step_s(records: Sequence[dict[str, Any]]) -> float:
    """A step's typical time: the mean over the refresh cycle's phases (``kfac_phase``; one phase
    without K-FAC) of each phase's median ``step_time_s``. The medians ignore bursts of load; the
    mean over phases still counts a refresh every k steps once per k steps, which a plain median
    of critical-path K-FAC's steps would drop."""
    by_phase: dict[int, list[float]] = {}
    for r in records:
        if r.get("step_time_s") is not None:
            by_phase.setdefault(int(r.get("kfac_phase") or 0), []).append(float(r["step_time_s"]))
    return statistics.fmean(statistics.median(v) for v in by_phase.values()) if by_phase else math.nan


def summarize(records: Sequence[dict[str, Any]], targets: dict[str, float | None], window: int,
              step_s: float | None = None) -> dict[str, Any]:
    """Final smoothed MLM loss, step times and, per target, steps and seconds to reach it.

    ``seconds_est`` is steps x ``step_s``, by default the run's own :func:`typical_step_s`
    (``--retime`` passes one measured on a quiet machine).
    """
    mlm = mlm_losses(records)
    times = [float(r.get("step_time_s") or 0.0) for r in records]
    sm = smooth(mlm, window) if mlm else []
    typical = typical_step_s(records) if step_s is None else step_s
    out: dict[str, Any] = {
        "steps": len(records), "final_mlm": sm[-1] if sm else math.nan,
        "median_step_s": statistics.median(times) if times else math.nan,
        "mean_step_s": statistics.fmean(times) if times else math.nan,
        "typical_step_s": typical, "sum_step_s": math.fsum(times), "targets": {},
    }
    for name, target in targets.items():
        n = None if target is None else steps_to_target(sm, target)
        out["targets"][name] = {"target": target, "steps": n, "seconds": seconds_to(times, n),
                                "seconds_est": None if n is None else n * typical}
    for key in ("refresh_interval", "kfac_plan"):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            out[key] = values[-1]
    ages = [r["curvature_age"] for r in records if isinstance(r.get("curvature_age"), (int, float))]
    if ages:
        out["curvature_age_mean"], out["curvature_age_max"] = statistics.fmean(ages), max(ages)
    return out


def batch_noise(values: Sequence[float], window: int) -> list[float]:
    """Each loss of the second half of a run minus the mean of the ``window`` losses centred on it:
    how much a batch's loss differs from its neighbours' (the same batches for every arm)."""
    half = len(values) // 2
    return [values[i] - statistics.fmean(values[max(0, i - window // 2): i + window // 2])
            for i in range(half, len(values))]


def best_kfac(summaries: dict[str, dict[str, Any]], target: str) -> str | None:
    """The critical-path K-FAC arm (``kfac-k*``) reaching ``target`` in the least steps x median time."""
    reached = [(s["targets"][target]["seconds_est"], arm) for arm, s in summaries.items()
               if family(arm) == "kfac" and s["targets"].get(target, {}).get("seconds_est") is not None]
    return min(reached)[1] if reached else None


def ratios(summaries: dict[str, dict[str, Any]], target: str, baseline: str = "nvlamb") -> dict[str, dict[str, Any]]:
    """Per arm: time (steps x median step) and steps to ``target`` over NVLAMB's and the best kfac's."""
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    def get(arm: str | None, key: str) -> float | None:
        return None if arm is None or arm not in summaries else summaries[arm]["targets"].get(target, {}).get(key)

    kfac = best_kfac(summaries, target)
    return {arm: {"time_x_nvlamb": div(get(arm, "seconds_est"), get(baseline, "seconds_est")),
                  "time_x_best_kfac": div(get(arm, "seconds_est"), get(kfac, "seconds_est")),
                  "steps_x_nvlamb": div(get(arm, "steps"), get(baseline, "steps")),
                  "best_kfac": kfac}
            for arm in summaries}


def pick_lr(finals: dict[float, float]) -> float | None:
    """The learning rate with the lowest final smoothed loss (NaN and missing runs never win)."""
    ok = {lr: v for lr, v in finals.items() if v is not None and math.isfinite(v)}
    return min(ok, key=lambda lr: (ok[lr], lr)) if ok else None


def parse_extra(items: Sequence[str]) -> dict[str, list[str]]:
    """``--extra ARM:key=value`` (repeatable; ARM a name or a family such as ``kfac``) -> overrides."""
    out: dict[str, list[str]] = {}
    for item in items:
        arm, sep, override = item.partition(":")
        if not sep or not arm or "=" not in override:
            raise ValueError(f"--extra {item!r}: expected ARM:key=value, e.g. pipefisher:optimizer.curvature_micro_batches=1")
        out.setdefault(arm, []).append(override)
    return out


def parse_variants(items: Sequence[str]) -> dict[str, tuple[str, list[str]]]:
    """``--variant NAME=ARM:key=value[,key=value...]`` -> {NAME: (ARM, overrides)}: an arm NAME that runs
    as ARM (a name of the arm table, e.g. ``pipefisher`` or ``kfac-k1``) with the overrides added."""
    out: dict[str, tuple[str, list[str]]] = {}
    for item in items:
        name, sep, rest = item.partition("=")
        base, colon, overrides = rest.partition(":")
        pairs = [o for o in overrides.split(",") if o]
        if not (sep and colon and name and base) or not pairs or any("=" not in o for o in pairs):
            raise ValueError(f"--variant {item!r}: expected NAME=ARM:key=value[,key=value], "
                             "e.g. pipefisher-clipafter=pipefisher:optimizer.clip_before_precondition=false")
        if name in out:
            raise ValueError(f"--variant {item!r}: {name} is given twice")
        out[name] = (base, pairs)
    return out


def parse_lrs(items: Sequence[str]) -> dict[str, float]:
    """``--lr ARM=value`` (repeatable; ARM a name or a family) or ``--lr value`` for every arm (``*``)."""
    out: dict[str, float] = {}
    for item in items:
        arm, sep, value = item.rpartition("=")
        try:
            out[arm if sep else "*"] = float(value)
        except ValueError:
            raise ValueError(f"--lr {item!r}: expected ARM=value or value, e.g. --lr pipefisher=1e-2") from None
    return out


def for_arm(table: dict[str, Any], arm: str) -> list[Any]:
    """Entries of ``table`` that apply to ``arm``: ``*``, then its family, then its own name."""
    keys = ["*", family(arm)] + ([arm] if arm != family(arm) else [])
    return [table[k] for k in keys if k in table]


def parse_list(text: str | None, kind: type = str) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()] if text else []


# --- data ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Prepared:
    path: Path
    vocab_size: int
    unigram_entropy: float
    num_instances: int
    num_documents: int


def prepare_command(text: Path, out: Path, dupe_factor: int, seed: int) -> list[str]:
    return [sys.executable, "-m", "pipefisher.data.prepare", "--input", str(text), "--output-dir", str(out),
            "--seq-len", str(SEQ_LEN), "--max-predictions", str(MAX_PREDICTIONS), "--dupe-factor", str(dupe_factor),
            "--seed", str(seed), "--input-format", "auto", "--no-progress"]


def cache_key(text: Path, dupe_factor: int, seed: int) -> str:
    """Hash of the text, the preparation options and prepare.py (a changed preparation re-prepares)."""
    digest = hashlib.sha256()
    digest.update(text.read_bytes())
    digest.update(json.dumps({"seq_len": SEQ_LEN, "max_predictions": MAX_PREDICTIONS, "dupe_factor": dupe_factor,
                              "seed": seed, "format": "auto"}, sort_keys=True).encode())
    digest.update(PREPARE_SOURCE.read_bytes())
    return digest.hexdigest()[:16]


def prepare_data(text: Path, cache_dir: Path, dupe_factor: int, seed: int) -> Prepared:
    """Shards and vocab of ``text``, from the cache or made by ``python -m pipefisher.data.prepare``."""
    final = cache_dir / f"{text.stem}-{cache_key(text, dupe_factor, seed)}"
    if not (final / "unigram.json").is_file():
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = prepare_command(text, tmp, dupe_factor, seed)
        print(f"preparing {text} -> {final}\n$ {shlex.join(cmd)}", flush=True)
        done = subprocess.run(cmd, cwd=h.REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"data preparation failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        entropy = shards_unigram_entropy(sorted(tmp.glob("*.hdf5")))
        (tmp / "unigram.json").write_text(json.dumps({"unigram_entropy": entropy}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    info = json.loads((final / "prepare.json").read_text())
    return Prepared(final, int(info["vocab_size_actual"]), json.loads((final / "unigram.json").read_text())["unigram_entropy"],
                    int(info["num_instances"]), int(info["num_documents"]))


# --- runs ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Job:
    """One ``train.py`` run (possibly in several chunks)."""

    phase: str  # main or sweep
    pipeline: str
    arm: str
    overrides: list[str]
    lr: float | None
    steps: int
    run_dir: Path
    status: str = "pending"  # pending, done, failed
    done_steps: int = 0
    wall_s: float = 0.0
    chunks: int = 0
    error: str = ""

    @property
    def label(self) -> str:
        lr = "" if self.lr is None else f" lr={self.lr:g}"
        return f"{self.phase} {self.pipeline} {self.arm}{lr}"

    def command(self, common: Sequence[str], chunk: int, resume: bool = False) -> list[str]:
        """The ``train.py`` command; ``chunk``: checkpoint every so many steps; ``resume``: continue from the last."""
        cmd = [sys.executable, "train.py", *common, f"pipeline={self.pipeline}", f"steps={self.steps}", *self.overrides]
        if self.lr is not None:
            cmd.append(f"lr={self.lr:g}")
        if chunk:
            cmd += [f"checkpoint.every_steps={chunk}", "checkpoint.keep_last=1"]
        if resume:
            cmd.append("resume=auto")
        return cmd + [f"hydra.run.dir={self.run_dir}"]

    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.is_file():
            return []
        by_step = {int(r["step"]): r for r in read_metrics(path) if "step" in r}
        return [by_step[s] for s in sorted(by_step)]


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def _stop(proc: subprocess.Popen) -> None:
    """Kill the run's process group (its own session: the launcher and its workers)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _chunk_saved(root: Path, step: int) -> bool:
    """The checkpoint after ``step`` is complete and the older one pruned (rank 0 is done with it)."""
    if not (root / f"step_{step}" / "manifest.json").is_file():
        return False
    return all(p.name == f"step_{step}" for p in root.glob("step_*"))


def run_chunk(job: Job, cmd: list[str], until: int, timeout_s: float) -> None:
    """Run ``job`` up to ``until`` steps (its process is stopped after that checkpoint unless it is the last)."""
    job.run_dir.mkdir(parents=True, exist_ok=True)
    log_path = job.run_dir / "train.log"
    final = until >= job.steps
    with log_path.open("a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=h.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        manifest_seen: float | None = None
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    _stop(proc)
                    job.status, job.error = "failed", f"timed out after {timeout_s:.0f} s\n" + _tail(log_path)
                    break
                if not final:
                    root = job.run_dir / "checkpoints"
                    if (root / f"step_{until - 1}" / "manifest.json").is_file() and manifest_seen is None:
                        manifest_seen = time.monotonic()
                    if _chunk_saved(root, until - 1) or (manifest_seen and time.monotonic() - manifest_seen > 5):
                        _stop(proc)
                        break
                time.sleep(0.2)
        except BaseException:
            _stop(proc)
            raise
        job.wall_s += time.monotonic() - start
    job.chunks += 1
    if job.status == "failed":
        return
    done = len(job.records())
    if proc.returncode not in (0, -signal.SIGKILL) or done < until:
        job.status = "failed"
        job.error = f"exit status {proc.returncode} after {done} of {until} steps\n" + _tail(log_path)
        return
    job.done_steps = min(done, until)  # a stopped process may have logged a step past its checkpoint
    if final:
        job.status = "done"


def rotated(items: Sequence[Any], r: int) -> list[Any]:
    """``items`` rotated left by ``r``: round r of interleaved rounds starts with a different run."""
    return list(items[r % len(items):]) + list(items[:r % len(items)])


def sweep_dir(out: Path, pipeline: str, arm: str, lr: float) -> Path:
    """Where the lr sweep's run of ``arm`` at ``lr`` lives."""
    return out / "sweep" / pipeline / arm / f"lr{lr:g}"


def pick_up(job: Job) -> None:
    """``--continue``: a run already in ``job.run_dir`` continues from its newest chunk checkpoint
    (``step_<n>`` with a manifest and n + 1 logged steps), or from the start if it has none."""
    saved = sorted((int(p.name.removeprefix("step_")) for p in (job.run_dir / "checkpoints").glob("step_*")
                    if (p / "manifest.json").is_file()), reverse=True)
    logged = len(job.records())
    done = next((n + 1 for n in saved if logged >= n + 1), 0)
    if done:
        job.done_steps, job.chunks = done, 1
        print(f"continuing {job.label} after step {done} ({job.run_dir})", flush=True)
    elif job.run_dir.exists():
        shutil.rmtree(job.run_dir)


def run_jobs(jobs: list[Job], common: Sequence[str], chunk: int, timeout_s: float, keep_checkpoints: bool,
             window: int) -> None:
    """Every job to its last step, in rotated rounds of ``chunk`` steps (0: each job whole, in order)."""
    if not jobs:
        return
    rounds = math.ceil(max(j.steps for j in jobs) / chunk) if chunk else 1
    start = time.monotonic()
    for r in range(rounds):
        for job in rotated(jobs, r):
            if job.status != "pending":
                continue
            until = min(job.steps, (r + 1) * chunk) if chunk else job.steps
            if until <= job.done_steps:
                continue
            run_chunk(job, job.command(common, chunk, resume=job.chunks > 0), until, timeout_s)
            records = job.records()
            loss = smooth(mlm_losses(records), window)[-1] if records else math.nan
            state = "FAILED" if job.status == "failed" else f"step {job.done_steps}/{job.steps}"
            print(f"[{time.monotonic() - start:7.1f} s, {h.load()}] {job.label}: {state}, "
                  f"smoothed MLM {loss:.3f}, process wall {job.wall_s:.1f} s", flush=True)
            if job.status == "failed":
                print(f"  run failed; log tail ({job.run_dir / 'train.log'}):\n{job.error}", file=sys.stderr, flush=True)
            if job.status in ("done", "failed") and not keep_checkpoints:
                shutil.rmtree(job.run_dir / "checkpoints", ignore_errors=True)


# --- the benchmark -------------------------------------------------------------------------------

QUICK = {"model": "bert-tiny", "pipelines": "1f1b", "steps": 40, "kfac_intervals": "1", "chunk_steps": 20, "smooth": 10}
FULL = {"model": "bert-mini", "pipelines": "1f1b,chimera", "steps": 600, "kfac_intervals": "1,8", "chunk_steps": 100,
        "smooth": 50}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="raw WikiText or one sentence per line (default: %(default)s)")
    p.add_argument("--model", help="bert-tiny|bert-mini|bert-small|... (default bert-mini; --quick: bert-tiny)")
    p.add_argument("--pipelines", help="comma-separated (default 1f1b,chimera; --quick: 1f1b)")
    p.add_argument("--stages", type=int, default=2, help="D (default 2 = the cores here)")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, help="steps per run (default 600; --quick: 40)")
    p.add_argument("--arms", default="nvlamb,kfac,pipefisher", help=f"comma-separated names of ARMS: {', '.join(ARMS)}")
    p.add_argument("--kfac-intervals", help="one kfac-k<K> arm per K (default 1,8; --quick: 1)")
    p.add_argument("--extra", action="append", default=[], metavar="ARM:KEY=VALUE",
                   help="extra override for an arm or family (kfac, stale), repeatable")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARM:KEY=VALUE[,KEY=VALUE]",
                   help="one more arm NAME: ARM with these overrides, e.g. "
                        "pipefisher-clipafter=pipefisher:optimizer.clip_before_precondition=false (repeatable; "
                        "NAME's family, the part before the first '-', takes --lr and --extra of that family)")
    p.add_argument("--lr", action="append", default=[], metavar="ARM=VALUE",
                   help="fixed peak lr for an arm or family, or VALUE for all (default: the config's)")
    p.add_argument("--lr-sweep", help="comma-separated lrs: first run each arm without --lr at each (first pipeline, "
                                      "--sweep-steps), pick the lowest final smoothed loss")
    p.add_argument("--sweep-steps", type=int, help="steps of a sweep run (default steps/3)")
    p.add_argument("--sweep-only", action="store_true", help="stop after the lr sweep")
    p.add_argument("--staleness", help="comma-separated k: add stale-k<K> arms (kfac, curvature_interval=K, "
                                       "deferred_inverse=true) on the first pipeline")
    p.add_argument("--target", type=float, help="fixed MLM target instead of unigram entropy - margin")
    p.add_argument("--unigram-margin", type=float, default=0.3, help="nats below the unigram entropy (default 0.3)")
    p.add_argument("--smooth", type=int, help="trailing-mean window in steps (default 50, --quick: 10: a step's loss differs from its "
                                              "neighbours' by about 0.12 nats, the same for every arm, see the "
                                              "report's 'Batch noise' line; --retime: the run's own unless given)")
    p.add_argument("--chunk-steps", type=int, help="steps per turn of interleaved rounds, 0 = whole runs in turn "
                                                   "(default 100; --quick: 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data order (all arms alike)")
    p.add_argument("--dupe-factor", type=int, default=5, help="data preparation: passes with new masks")
    p.add_argument("--cache-dir", type=Path, default=h.REPO / "bench" / ".cache" / "convergence")
    p.add_argument("--out", type=Path, help="output dir (default bench/results/convergence/<timestamp>)")
    p.add_argument("--run-timeout-s", type=float, default=3600.0, help="limit of one process (a chunk)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--continue", dest="continue_runs", action="store_true",
                   help="main runs already in --out continue from their last chunk checkpoint (same arguments)")
    p.add_argument("--plan-from-profile", action="store_true",
                   help="per pipeline, profile the run (profile.py, optimizer=kfac, 6 steps) and plan PipeFisher from the "
                        "measured costs (schedule.py from=profile.sqlite); the pipefisher arm trains with that plan")
    p.add_argument("--quick", action="store_true", help="bert-tiny, 1f1b, 40 steps in 2 rounds, kfac k=1, no sweep: ~1 min after the data preparation")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--retime", type=Path, metavar="DIR",
                   help="re-measure step times for a finished run in DIR on a quiet machine: each main run's command "
                        "(not the staleness arms) for --timing-steps steps, --timing-rounds rotated rounds; DIR's "
                        "report is rewritten with time to target = steps of the runs x the timed typical step")
    p.add_argument("--timing-steps", type=int, default=40, help="--retime: steps per timing run (default 40)")
    p.add_argument("--timing-rounds", type=int, default=2,
                   help="--retime: rotated rounds (default 2; 0: only write the report again, with the step "
                        "times of an earlier --retime)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    smooth_given = args.smooth is not None
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.pipelines = parse_list(args.pipelines)
    args.arms = parse_list(args.arms)
    args.kfac_intervals = parse_list(args.kfac_intervals, int)
    args.staleness = parse_list(args.staleness, int)
    args.lr_sweep = parse_list(args.lr_sweep, float)
    args.extra = parse_extra(args.extra)
    args.variant = parse_variants(args.variant)
    args.lr = parse_lrs(args.lr)
    args.smooth_given = smooth_given
    args.sweep_steps = args.sweep_steps or max(2 * args.smooth, args.steps // 3)
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown:
        raise ValueError(f"--arms {unknown}: unknown; choose from {', '.join(ARMS)} (or edit ARMS)")
    return args


def arm_table(args: argparse.Namespace) -> dict[str, list[str]]:
    """Arm name -> overrides (ARMS with kfac expanded per interval), extras appended."""
    arms: dict[str, list[str]] = {}
    for name in args.arms:
        if name == "kfac":
            arms.update({f"kfac-k{k}": kfac_overrides(k) for k in args.kfac_intervals})
        else:
            arms[name] = list(ARMS[name])
    arms = {arm: o + [x for extra in for_arm(args.extra, arm) for x in extra] for arm, o in arms.items()}
    for name, (base, overrides) in args.variant.items():
        if base not in arms:
            raise ValueError(f"--variant {name}={base}:...: no arm {base} in this run ({', '.join(arms)})")
        if name in arms:
            raise ValueError(f"--variant {name}=...: {name} is an arm already; choose another name")
        arms[name] = arms[base] + args.extra.get(name, []) + overrides  # base's extras are in arms[base]
    return arms


def stale_table(args: argparse.Namespace) -> dict[str, list[str]]:
    arms = {f"stale-k{k}": kfac_overrides(k, deferred=True) for k in args.staleness}
    return {arm: o + [x for extra in for_arm(args.extra, arm) for x in extra] for arm, o in arms.items()}


def fixed_lr(args: argparse.Namespace, arm: str) -> float | None:
    found = for_arm(args.lr, arm)
    return found[-1] if found else None


def common_overrides(args: argparse.Namespace, data_path: Path | str, vocab: int | str) -> list[str]:
    """The ``train.py`` overrides every run of the benchmark shares."""
    return [f"model={args.model}", f"model.vocab_size={vocab}", f"stages={args.stages}",
            f"micro_batch_size={args.micro_batch_size}", f"num_micro_batches={args.num_micro_batches}",
            "data=hdf5", f"data.path={data_path}", f"data.seq_len={SEQ_LEN}", f"data.max_predictions={MAX_PREDICTIONS}",
            f"seed={args.seed}", "device=cpu", "progress=false", "wandb.mode=disabled"]


def main() -> None:
    args = parse_args()
    if args.retime:
        return retime(args.retime, args.timing_steps, args.timing_rounds, args.run_timeout_s,
                      args.smooth if args.smooth_given else None)
    out = args.out or h.REPO / "bench" / "results" / "convergence" / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = out.resolve()
    text = args.text.resolve()
    if not text.is_file():
        raise FileNotFoundError(f"{text}: no such text file (--text)")
    started, load_before = time.monotonic(), h.load()
    if args.dry_run:
        cached = [p for p in args.cache_dir.glob(f"{text.stem}-{cache_key(text, args.dupe_factor, args.seed)}")
                  if (p / "unigram.json").is_file()]
        data = None
        if cached:
            info = json.loads((cached[0] / "prepare.json").read_text())
            data_path, vocab = cached[0], str(info["vocab_size_actual"])
        else:
            data_path, vocab = args.cache_dir / f"{text.stem}-<hash>", "<size of the prepared vocab.txt>"
            print("$ " + shlex.join(prepare_command(text, data_path, args.dupe_factor, args.seed)))
    else:
        data = prepare_data(text, args.cache_dir.resolve(), args.dupe_factor, args.seed)
        data_path, vocab = data.path, str(data.vocab_size)
        print(f"data: {data.path} ({data.num_documents} documents, {data.num_instances} instances, "
              f"vocab {data.vocab_size}, unigram entropy of the masked labels {data.unigram_entropy:.3f} nats)")
    common = common_overrides(args, data_path, vocab)
    arms, stale = arm_table(args), stale_table(args)
    first = args.pipelines[0]

    # 1. lr sweep on the first pipeline, for the arms without a fixed lr.
    # Variants without a fixed lr take their base arm's: they are not swept.
    sweep_jobs = [Job("sweep", first, arm, o, lr, args.sweep_steps, sweep_dir(out, first, arm, lr))
                  for arm, o in arms.items() if fixed_lr(args, arm) is None and arm not in args.variant
                  for lr in args.lr_sweep]
    plans: dict[tuple[str, str], Path] = {}

    def add_plan(job: Job) -> None:
        """--plan-from-profile: a pipefisher-family job trains with the plan made from its own profile."""
        if not args.plan_from_profile or args.dry_run or family(job.arm) != "pipefisher":
            return
        if (job.pipeline, job.arm) not in plans:
            plan_dir = out / job.pipeline / ("plan" if job.arm == "pipefisher" else f"plan-{job.arm}")
            plans[job.pipeline, job.arm] = plan_from_profile(common, job.pipeline, job.overrides, plan_dir)
        job.overrides = job.overrides + [f"optimizer.schedule={plans[job.pipeline, job.arm]}"]

    for job in sweep_jobs:
        add_plan(job)
    picked: dict[str, float | None] = {}
    if args.dry_run:
        _print_commands(sweep_jobs, common, args.chunk_steps)
    else:
        run_jobs(sweep_jobs, common, args.chunk_steps, args.run_timeout_s, args.keep_checkpoints, args.smooth)
        for arm in {j.arm for j in sweep_jobs}:
            finals = {j.lr: summarize(j.records(), {}, args.smooth)["final_mlm"] if j.status == "done" else None
                      for j in sweep_jobs if j.arm == arm}
            picked[arm] = pick_lr(finals)
    if args.sweep_only:
        if not args.dry_run:
            _report(args, out, data, {}, sweep_jobs, [], picked, load_before, started)
        return

    def lr_of(arm: str) -> float | None:
        if fixed_lr(args, arm) is not None:
            return fixed_lr(args, arm)
        if arm in args.variant:
            return lr_of(args.variant[arm][0])
        if family(arm) == "stale":  # staleness arms take the first kfac arm's lr
            kfac = next((a for a in arms if family(a) == "kfac"), None)
            return lr_of(kfac) if kfac else None
        return picked.get(arm)

    # 2. The comparison (and the staleness arms on the first pipeline), interleaved in rounds.
    jobs = [Job("main", p, arm, o, lr_of(arm), args.steps, out / p / arm)
            for p in args.pipelines for arm, o in {**arms, **(stale if p == first else {})}.items()]
    for job in jobs:
        add_plan(job)
    if args.dry_run:
        if args.lr_sweep:
            print("# main runs: lr= of each swept arm is the one the sweep picks")
        _print_commands(jobs, common, args.chunk_steps)
        return
    if args.continue_runs:
        for job in jobs:
            pick_up(job)
    run_jobs(jobs, common, args.chunk_steps, args.run_timeout_s, args.keep_checkpoints, args.smooth)
    _report(args, out, data, {p: [j for j in jobs if j.pipeline == p] for p in args.pipelines}, sweep_jobs,
            [j for j in jobs if family(j.arm) == "stale"], picked, load_before, started)


#: schedule.py keys that mirror pipefisher's optimizer keys (the plan must be made with the same).
PLAN_KEYS = ("curvature_micro_batches", "max_staleness", "max_interval")


def plan_from_profile(common: Sequence[str], pipeline: str, overrides: Sequence[str], out: Path) -> Path:
    """Profile ``pipeline`` with K-FAC on the critical path (its units measured), then plan PipeFisher
    from that profile with ``schedule.py`` (the project's own workflow: README, "Profile a pipeline");
    returns the plan's ``assignment.json``.

    Raises:
        RuntimeError: profile.py or schedule.py failed (the message holds its output's tail).
    """
    keys = [o for o in overrides if o.split("=")[0].removeprefix("optimizer.") in PLAN_KEYS]
    profile_cmd = [sys.executable, "profile.py", *common, f"pipeline={pipeline}", "optimizer=kfac", "steps=6",
                   *[k for k in keys if not k.startswith(("optimizer.max_staleness", "optimizer.max_interval"))],
                   f"hydra.run.dir={out / 'profile'}"]
    plan_cmd = [sys.executable, "schedule.py", f"from={out / 'profile' / 'profile.sqlite'}", "plot=false",
                *[k.removeprefix("optimizer.") for k in keys], f"hydra.run.dir={out}"]
    for cmd in (profile_cmd, plan_cmd):
        print("$ " + shlex.join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, cwd=h.REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd[1:])} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    print((out / "summary.txt").read_text(), flush=True)
    return out / "assignment.json"


def _print_commands(jobs: Sequence[Job], common: Sequence[str], chunk: int) -> None:
    if jobs and chunk:
        print(f"# each run goes {chunk} steps per turn, rotated among the runs; a turn's process is stopped once its "
              f"checkpoint is complete, and the next round runs the same command with resume=auto")
    for job in jobs:
        print("$ " + shlex.join(job.command(common, chunk)))


def _cell(value: float | None, fmt: str = "{:.3f}", missing: str = "not reached") -> str:
    return missing if value is None else fmt.format(value)


def _report(args: argparse.Namespace, out: Path, data: Prepared | None, by_pipeline: dict[str, list[Job]],
            sweep_jobs: list[Job], stale_jobs: list[Job], picked: dict[str, float | None], load_before: str,
            started: float, timing: dict[str, dict[str, dict[str, Any]]] | None = None) -> None:
    """Tables (stdout and table.md), results.json, loss_vs_step.png and loss_vs_time.png.

    ``timing``: per pipeline and arm, the ``--retime`` figures (``typical_step_s`` of quiet timing
    runs), which then give the seconds to target instead of each run's own step times.
    """
    timing = timing or {}
    unigram = None if data is None else data.unigram_entropy
    fixed_target = args.target if args.target is not None else (None if unigram is None else unigram - args.unigram_margin)
    target_names = {"nvlamb": "NVLAMB's final smoothed MLM", "unigram": (
        f"fixed --target {args.target}" if args.target is not None
        else f"unigram entropy {unigram:.3f} - {args.unigram_margin} nats")}
    lines = [f"{args.model}, {args.stages} stages, micro-batch {args.micro_batch_size} x {args.num_micro_batches}, "
             f"seq {SEQ_LEN}, {args.steps} steps; text {args.text.name}"
             + ("" if data is None else f" ({data.num_instances} instances, vocab {data.vocab_size})")
             + f"; MLM loss smoothed over {args.smooth} steps  "]
    results: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                               "data": None if data is None else {**dataclasses.asdict(data), "path": str(data.path)},
                               "pipelines": {}, "sweep": [], "picked_lr": picked}
    if sweep_jobs:
        rows = []
        for j in sweep_jobs:
            final = summarize(j.records(), {}, args.smooth)["final_mlm"] if j.status == "done" else None
            rows.append([j.arm, f"{j.lr:g}", _cell(final) if j.status == "done" else "FAILED",
                         "picked" if picked.get(j.arm) == j.lr else ""])
            results["sweep"].append({"arm": j.arm, "lr": j.lr, "final_mlm": final, "status": j.status})
        lines += ["", f"### lr sweep ({sweep_jobs[0].pipeline}, {args.sweep_steps} steps)", "",
                  h.table(["arm", "lr", "final MLM (smoothed)", ""], rows)]
    summaries: dict[str, dict[str, dict[str, Any]]] = {}
    for pipeline, jobs in by_pipeline.items():
        done = {j.arm: summarize(j.records(), {}, args.smooth) for j in jobs if j.status == "done"}
        targets = {"nvlamb": done["nvlamb"]["final_mlm"] if "nvlamb" in done else None, "unigram": fixed_target}
        timed = timing.get(pipeline, {})
        summ = {j.arm: summarize(j.records(), targets, args.smooth, timed.get(j.arm, {}).get("typical_step_s"))
                for j in jobs if j.status == "done"}
        summaries[pipeline] = summ
        main_arms = {a: s for a, s in summ.items() if family(a) != "stale"}
        noise = {j.arm: batch_noise(mlm_losses(j.records()), args.smooth) for j in jobs if j.status == "done"}
        if len(noise.get("nvlamb", [])) > 2:
            corr = [float(np.corrcoef(noise["nvlamb"], v)[0, 1]) for a, v in noise.items()
                    if a != "nvlamb" and len(v) == len(noise["nvlamb"])]
            lines += ["", f"Batch noise: in the second half of the runs NVLAMB's loss of a step differs from the "
                          f"{args.smooth}-step mean around it by {statistics.pstdev(noise['nvlamb']):.3f} nats (std)"
                          + (f"; that difference correlates {min(corr):.3f}–{max(corr):.3f} with the other arms' "
                             "(same batches)" if corr else "") + ".  "]
        run_rows = [[j.arm, "config" if j.lr is None else f"{j.lr:g}",
                     summ[j.arm].get("refresh_interval", "-") if j.arm in summ else "-",
                     j.status if j.status != "done" else summ[j.arm]["steps"],
                     summ[j.arm]["final_mlm"] if j.arm in summ else math.nan,
                     summ[j.arm]["median_step_s"] if j.arm in summ else math.nan,
                     summ[j.arm]["mean_step_s"] if j.arm in summ else math.nan,
                     summ[j.arm]["typical_step_s"] if j.arm in summ else math.nan,
                     summ[j.arm]["sum_step_s"] if j.arm in summ else math.nan, j.wall_s, j.chunks]
                    for j in jobs if family(j.arm) != "stale"]
        lines += ["", f"### {pipeline}: runs", "", h.table(
            ["arm", "lr", "k", "steps", "final MLM (sm.)", "median step s", "mean step s",
             "timed step s" if timed else "typical step s", "Σ step s", "process wall s", "processes"], run_rows)]
        if timed:
            lines += ["", f"Timed step s: typical step time of quiet timing runs (--retime: "
                          f"{next(iter(timed.values()))['rounds']} rotated rounds of "
                          f"{next(iter(timed.values()))['steps']} steps per arm, the first step of each dropped).  "]
        target_rows = []
        for name, target in targets.items():
            r = ratios(main_arms, name)
            for arm, s in main_arms.items():
                t, label = s["targets"][name], f"{name} ({_cell(target)})"
                if t["steps"] is None:
                    target_rows.append([label, arm, f"not reached (final {s['final_mlm']:.3f})", *["-"] * 6])
                    continue
                target_rows.append([label, arm, t["steps"], _cell(t["seconds"], "{:.1f}"), _cell(t["seconds_est"], "{:.1f}"),
                                    _cell(r[arm]["time_x_nvlamb"], "{:.3f}", "-"),
                                    _cell(r[arm]["time_x_best_kfac"], "{:.3f}", "-"),
                                    r[arm]["best_kfac"] or "-", _cell(r[arm]["steps_x_nvlamb"], "{:.3f}", "-")])
        lines += ["", f"### {pipeline}: time to target", "", h.table(
            ["target", "arm", "steps", "s (Σ measured)", "s (steps × typical)", "time × nvlamb", "time × best kfac",
             "best kfac", "steps × nvlamb"], target_rows),
            "", "Ratios use steps × the typical step time "
                + ("of the quiet timing runs" if timed else "of the run (per refresh phase the median step time, "
                   "averaged over the phases: robust to bursts of load, and a refresh every k steps counts once per k)")
                + "; Σ measured is the sum of the run's step_time_s up to that step. Targets: "
                + "; ".join(f"{k} = {v}" for k, v in target_names.items()) + ".  "]
        results["pipelines"][pipeline] = {"targets": targets, "runs": [_job_result(j, summ.get(j.arm)) for j in jobs]}
    if stale_jobs:
        summ = summaries.get(stale_jobs[0].pipeline, {})
        rows = []
        for j in stale_jobs:
            s = summ.get(j.arm)
            rows.append([j.arm.removeprefix("stale-k"), j.status if s is None else s["final_mlm"],
                         *([_cell(s["targets"][n]["steps"], "{}") for n in ("nvlamb", "unigram")] if s else ["-", "-"]),
                         math.nan if s is None else s["median_step_s"]])
        lines += ["", f"### staleness ({stale_jobs[0].pipeline}: kfac, curvature_interval=k, deferred_inverse=true "
                      "= PipeFisher's numerics at interval k)", "",
                  h.table(["k", "final MLM (sm.)", "steps to nvlamb", "steps to unigram", "median step s"], rows)]
    failed = [j for js in [sweep_jobs, *by_pipeline.values()] for j in js if j.status == "failed"]
    for j in failed:
        lines += ["", f"FAILED: {j.label} ({j.run_dir / 'train.log'}):", "```", j.error, "```"]
    lines += ["", h.caveat(args.stages) + "  ", f"Machine: {load_before} before, {h.load()} after; "
              f"{(time.monotonic() - started) / 60:.1f} min in all."]
    report = "\n".join(lines)
    print("\n" + report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(report + "\n")
    results["elapsed_s"] = time.monotonic() - started
    if timing:
        results["timing"] = timing
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    if by_pipeline:
        _plots(out, by_pipeline, {p: results["pipelines"][p]["targets"] for p in by_pipeline}, args.smooth, timing)
    print(f"\nwritten: {out}/table.md, results.json, loss_vs_step.png, loss_vs_time.png")


def retime(out: Path, steps: int, rounds: int, timeout_s: float, smooth: int | None = None) -> None:
    """``--retime``: time every main run of the finished benchmark in ``out`` again (the same command,
    ``steps`` steps, each run once per round, rounds rotated), then rewrite its report with those
    step times. Steps to target come from the trajectories, which do not depend on the machine's load
    (same seed, same batches); only the seconds need a quiet machine."""
    started, load_before = time.monotonic(), h.load()
    out = out.resolve()
    results = json.loads((out / "results.json").read_text())
    ns = parse_args([])
    for key, value in results["args"].items():
        setattr(ns, key, value)
    ns.text, ns.cache_dir = Path(ns.text), Path(ns.cache_dir)
    ns.smooth = smooth or ns.smooth
    data = None
    if results.get("data"):
        data = Prepared(**{**results["data"], "path": Path(results["data"]["path"])})
    common = common_overrides(ns, data.path if data else "", data.vocab_size if data else "")
    by_pipeline: dict[str, list[Job]] = {}
    for pipeline, found in results["pipelines"].items():
        by_pipeline[pipeline] = [Job(r["phase"], pipeline, r["arm"], list(r["overrides"]), r["lr"], ns.steps,
                                     Path(r["run_dir"]), r["status"], wall_s=r["process_wall_s"], chunks=r["processes"])
                                 for r in found["runs"]]
    timed_jobs = [j for js in by_pipeline.values() for j in js if j.status == "done" and family(j.arm) != "stale"]
    if not timed_jobs:
        raise RuntimeError(f"{out}/results.json: no finished main runs to time")
    if rounds == 0:  # report again only, with the step times of an earlier --retime
        _report(ns, out, data, by_pipeline, *_sweep_and_stale(out, results, ns, by_pipeline),
                results.get("picked_lr", {}), load_before, started, results.get("timing"))
        return
    records: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(rounds):
        for base in rotated(timed_jobs, r):
            job = dataclasses.replace(base, phase="timing", steps=steps, status="pending", done_steps=0, wall_s=0.0,
                                      chunks=0, run_dir=out / "timing" / f"round{r}" / base.pipeline / base.arm)
            shutil.rmtree(job.run_dir, ignore_errors=True)
            run_chunk(job, job.command(common, 0), steps, timeout_s)
            if job.status != "done":
                raise RuntimeError(f"timing run {job.label} failed:\n{job.error}")
            timed = job.records()[1:]  # the first step warms up
            records.setdefault((job.pipeline, job.arm), []).extend(timed)
            print(f"[{time.monotonic() - started:7.1f} s, {h.load()}] timing round {r + 1}/{rounds} {job.pipeline} "
                  f"{job.arm}: typical step {typical_step_s(timed):.3f} s", flush=True)
    load = h.load()
    timing: dict[str, dict[str, dict[str, Any]]] = {}
    for (pipeline, arm), recs in records.items():
        timing.setdefault(pipeline, {})[arm] = {"typical_step_s": typical_step_s(recs), "steps": steps,
                                                "rounds": rounds, "load": load}
    _report(ns, out, data, by_pipeline, *_sweep_and_stale(out, results, ns, by_pipeline),
            results.get("picked_lr", {}), load_before, started, timing)


def _sweep_and_stale(out: Path, results: dict[str, Any], ns: argparse.Namespace,
                     by_pipeline: dict[str, list[Job]]) -> tuple[list[Job], list[Job]]:
    """The lr sweep's runs and the staleness arms of a finished benchmark, for its report."""
    first = next(iter(results["pipelines"]))
    sweep = [Job("sweep", first, x["arm"], [], x["lr"], ns.sweep_steps, sweep_dir(out, first, x["arm"], x["lr"]),
                 x["status"]) for x in results.get("sweep", [])]
    return sweep, [j for js in by_pipeline.values() for j in js if family(j.arm) == "stale"]


def _job_result(job: Job, summary: dict[str, Any] | None) -> dict[str, Any]:
    records = job.records()
    return {"arm": job.arm, "phase": job.phase, "lr": job.lr, "overrides": job.overrides, "status": job.status,
            "error": job.error, "run_dir": str(job.run_dir), "process_wall_s": job.wall_s, "processes": job.chunks,
            "summary": summary,
            "metrics": {k: [r.get(k) for r in records] for k in ("step", "loss", "mlm_loss", "step_time_s")}}


def _plots(out: Path, by_pipeline: dict[str, list[Job]], targets: dict[str, dict[str, float | None]], window: int,
           timing: dict[str, dict[str, dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    time_label = "seconds (steps × " + ("timed typical step, --retime)" if timing else "typical step time)")
    for name, xlabel in (("loss_vs_step", "step"), ("loss_vs_time", time_label)):
        fig, axes = plt.subplots(1, len(by_pipeline), figsize=(6 * len(by_pipeline), 4.2), squeeze=False)
        for ax, (pipeline, jobs) in zip(axes[0], by_pipeline.items()):
            for job in jobs:
                records = job.records()
                if not records:
                    continue
                y = smooth(mlm_losses(records), window)
                step_s = timing.get(pipeline, {}).get(job.arm, {}).get("typical_step_s") or typical_step_s(records)
                x = np.arange(1, len(y) + 1) * (1.0 if name == "loss_vs_step" else step_s)
                stale = family(job.arm) == "stale"
                ax.plot(x, y, lw=0.8 if stale else 1.5, ls=":" if stale else "-", label=job.arm)
            for (tname, value), color in zip(targets[pipeline].items(), ("gray", "black")):
                if value is not None:
                    ax.axhline(value, color=color, ls="--", lw=0.8, label=f"target {tname} {value:.2f}")
            ax.set_title(pipeline)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(f"MLM loss (mean of {window} steps)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    h.main_guard(main)
