"""Does K-FAC's gain at refresh interval k=1 come from curvature of the very batch it preconditions?

Issue 28, item 0. Refreshing the curvature every step beats NVLAMB by far on bert-mini, while
refreshing every 2 or 4 steps loses almost all of the gain. This script runs, one process, same
data, weights, seed and batches:

    nvlamb             NVLAMB alone
    kfac-k1            K-FAC refreshed every step: step t is preconditioned with factors that
                       include step t's own batch (the empirical Fisher of the very batch, folded
                       into the running average with weight 1 - factor_decay)
    kfac-k1-prev       K-FAC refreshed every step, inverses used from the NEXT step on
                       (``optimizer.deferred_inverse=true`` at k=1): step t is preconditioned with
                       the factors of steps 0..t-1 (their running average), i.e. exactly the
                       kfac-k1 curvature minus step t's own batch, one step old
    kfac-k2            refresh every 2 steps, used at once (curvature age 0-1)
    kfac-k2-deferred   refresh every 2 steps, used from the next cycle (PipeFisher's numerics, age 1-3)

and, with ``--arms``, kfac-k2 and kfac-k2-deferred with ``optimizer.factor_decay=0.9025`` = 0.95²: the
running average decays once per refresh, so at k = 2 and decay 0.95 it remembers twice as many steps
as at k = 1; 0.95^k gives it k = 1's memory in steps (bench/README.md §10).

[Note: k=1 with deferred inverses]
``KfacWork.begin_step`` promotes the pending inverses at the start of every phase-0 step, and at k=1
every step is phase 0; the INVERT of step t (deferred) goes to ``pending``. So step t runs PRECOND with
the inverses made at step t-1 from the running factors as they stood after step t-1's update: every
batch up to t-1, none of step t. Step 0 is not preconditioned (no inverses yet). ``curvature_age`` is 1.

    python bench/kfac_staleness_check.py                  # bert-mini, WikiText-2 train, 120 steps: ~20 min
    python bench/kfac_staleness_check.py --arms kfac-k2-decay0.9025,kfac-k2-deferred-decay0.9025
    python bench/kfac_staleness_check.py --model bert-tiny --steps 300
    python bench/kfac_staleness_check.py --dry-run        # the commands only
    python bench/kfac_staleness_check.py --synthetic      # no text needed (synthetic data)

Every run is ``python train.py ... hydra.run.dir=<out>/<arm>`` in a subprocess, one at a time (the
project's training path and its metrics.jsonl), pinned to one core (``--cpus``), with the learning-rate
schedule of a ``--schedule-steps`` (1500) run, as issue 28's runs, stopped after ``--steps``. The shards come from ``python -m pipefisher.data.prepare
--holdout-fraction 0.05`` (WordPiece vocabulary trained on the text; 5 % of the documents go to
``heldout/``, read by ``eval.every_steps``), cached under ``--cache-dir`` by a hash of the text, the
options and prepare.py. The table gives the training MLM loss as a trailing 50-step mean (every batch
is unseen at these step counts, so it is a held-out figure too) and the held-out MLM loss.
"""

from __future__ import annotations

import argparse
import datetime
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

import _harness as h

DEFAULT_TEXT = h.REPO.parent / "shared" / "data" / "wikitext-2" / "train.txt"
SEQ_LEN, MAX_PREDICTIONS = 128, 20


def _kfac(k: int, deferred: bool = False) -> list[str]:
    return ["optimizer=kfac", f"optimizer.curvature_interval={k}", f"optimizer.inverse_interval={k}",
            f"optimizer.deferred_inverse={str(deferred).lower()}"]


#: arm -> (train.py overrides, what curvature preconditions step t)
ARMS: dict[str, tuple[list[str], str]] = {
    "nvlamb": (["optimizer=nvlamb"], "none"),
    "kfac-k1": (_kfac(1), "batches 0..t (t's own batch included)"),
    "kfac-k1-prev": (_kfac(1, deferred=True), "batches 0..t-1 (one step old, t's batch excluded)"),
    "kfac-k2": (_kfac(2), "batches 0..2⌊t/2⌋ (age 0-1)"),
    "kfac-k2-deferred": (_kfac(2, deferred=True), "batches 0..2⌊t/2⌋-2 (age 1-3)"),
    # Not in the default set (--arms): the running average's memory per step at k = 2 made that of k = 1.
    "kfac-k2-decay0.9025": (_kfac(2) + ["optimizer.factor_decay=0.9025"],
                            "as kfac-k2, factor_decay 0.95² (k=1's decay per step)"),
    "kfac-k2-deferred-decay0.9025": (_kfac(2, deferred=True) + ["optimizer.factor_decay=0.9025"],
                                     "as kfac-k2-deferred, factor_decay 0.95²"),
}
DEFAULT_ARMS = ("nvlamb", "kfac-k1", "kfac-k1-prev", "kfac-k2", "kfac-k2-deferred")


def prepare_options(args: argparse.Namespace) -> dict[str, Any]:
    """``python -m pipefisher.data.prepare`` flags of the shards (``_harness.prepared_shards``)."""
    return {"seq_len": SEQ_LEN, "max_predictions": MAX_PREDICTIONS, "dupe_factor": args.dupe_factor,
            "vocab_size": args.vocab_size, "holdout_fraction": args.holdout_fraction, "seed": args.data_seed}


def common_overrides(args: argparse.Namespace, data: tuple[Path, int] | None) -> list[str]:
    """The train.py overrides every arm shares."""
    common = [f"model={args.model}", "stages=1", f"micro_batch_size={args.micro_batch_size}",
              f"num_micro_batches={args.num_micro_batches}", f"steps={args.schedule_steps or args.steps}",
              f"lr={args.lr:g}",
              f"seed={args.seed}", f"data.seq_len={SEQ_LEN}", f"data.max_predictions={MAX_PREDICTIONS}",
              f"eval.every_steps={args.eval_every}", f"eval.batches={args.eval_batches}",
              "device=cpu", "progress=false", "wandb.mode=disabled", "log_every=10"]
    if data is not None:
        common += ["data=hdf5", f"data.path={data[0]}", f"model.vocab_size={data[1]}"]
    return common


def run_arm(arm: str, common: Sequence[str], out: Path, steps: int, timeout_s: float,
            pin: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Run one arm's train.py until ``steps`` steps are logged; returns its metrics records (the step
    rows, in order).

    The run's ``steps`` override (the lr schedule's length) may be longer: the process is then stopped
    once step ``steps - 1`` (with its evaluation, which shares the step's row) is in metrics.jsonl.
    ``pin``: a command prefix such as ``taskset -c 1`` (train.py gives a process one intra-op thread
    per core it may run on; see ``--cpus``).
    """
    run_dir = out / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [*pin, sys.executable, "train.py", *common, *ARMS[arm][0], f"hydra.run.dir={run_dir}"]
    log_path = run_dir / "train.log"
    with log_path.open("w") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=h.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        start, stopped = time.monotonic(), False
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"{arm}: timed out after {timeout_s:.0f} s")
                if len(h.step_rows(run_dir)) >= steps:
                    stopped = True
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: train.py and its worker
                proc.wait()
    rows = h.step_rows(run_dir)
    if len(rows) < steps or (not stopped and proc.returncode):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{arm}: train.py exited with {proc.returncode} after {len(rows)} steps:\n{tail}")
    return rows[:steps]


def trailing_mean(values: Sequence[float], end: int, window: int) -> float:
    """Mean of ``values[end - window : end]`` (steps end-window .. end-1)."""
    part = [v for v in values[max(0, end - window):end] if v is not None and math.isfinite(v)]
    return statistics.fmean(part) if part else math.nan


def summarize(rows: Sequence[dict[str, Any]], checkpoints: Sequence[int], window: int) -> dict[str, Any]:
    mlm = [r.get("mlm_loss") for r in rows]
    evals = {int(r["step"]) + 1: r["eval_mlm_loss"] for r in rows if r.get("eval_mlm_loss") is not None}
    ages = [r["curvature_age"] for r in rows if r.get("curvature_age") is not None]
    times = [r["step_time_s"] for r in rows[1:] if r.get("step_time_s") is not None]
    return {
        "steps": len(rows),
        "train": {c: trailing_mean(mlm, c, window) for c in checkpoints if c <= len(rows)},
        "eval": evals,
        "age": (min(ages), max(ages)) if ages else None,
        "preconditioned_steps": len(ages),
        "step_s": statistics.median(times) if times else math.nan,
    }


def table(summaries: dict[str, dict[str, Any]], checkpoints: Sequence[int], window: int) -> str:
    eval_steps = sorted({s for v in summaries.values() for s in v["eval"]})
    head = (["arm", "curvature preconditioning step t", "age"] + [f"train {window} @{c}" for c in checkpoints]
            + [f"held-out @{s}" for s in eval_steps] + ["step s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, s in summaries.items():
        age = "–" if s["age"] is None else f"{s['age'][0]}–{s['age'][1]}"
        cells = [arm, ARMS[arm][1], age]
        cells += [f"{s['train'][c]:.3f}" if c in s["train"] else "" for c in checkpoints]
        cells += [f"{s['eval'][e]:.3f}" if e in s["eval"] else "" for e in eval_steps]
        cells.append(f"{s['step_s']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_table(losses: dict[str, list[float]], steps: int, bin_steps: int = 10, bins: int = 5) -> str:
    """Mean over each ``bin_steps``-step bin of the last ``bins`` bins of (arm's MLM − NVLAMB's MLM) at
    the same step: every arm sees the same batches, so the batch-to-batch noise, which is larger than
    these differences, cancels in the pairs."""
    starts = [s for s in range(steps - bins * bin_steps, steps, bin_steps) if s >= 0]
    head = ["arm"] + [f"steps {s}–{s + bin_steps - 1}" for s in starts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = losses["nvlamb"]
    for arm, values in losses.items():
        if arm == "nvlamb":
            continue
        cells = [statistics.fmean(a - b for a, b in zip(values[s:s + bin_steps], base[s:s + bin_steps]))
                 for s in starts]
        lines.append("| " + " | ".join([arm] + [f"{c:+.3f}" for c in cells]) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="raw WikiText or sentence-per-line text")
    p.add_argument("--synthetic", action="store_true", help="synthetic data instead of --text")
    p.add_argument("--model", default="bert-mini")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--schedule-steps", type=int, default=1500,
                   help="the run's `steps` (length of the warm-up and decay schedule); the runs are stopped after "
                        "--steps. Default 1500, as issue 28's runs: the first --steps steps then see its early "
                        "phase (warm-up 5 %% = 75 steps, then the rate near its peak). 0: --steps")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-micro-batches", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=16, help="held-out micro-batches per evaluation")
    p.add_argument("--window", type=int, default=50, help="trailing mean of the training MLM loss")
    p.add_argument("--checkpoints", default="50,100,150,200,250,300", help="steps at which the table shows it")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"any of {','.join(ARMS)}")
    p.add_argument("--dupe-factor", type=int, default=1)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--holdout-fraction", type=float, default=0.05)
    p.add_argument("--data-seed", type=int, default=12345)
    p.add_argument("--cache-dir", type=Path, default=h.REPO / "bench" / ".cache" / "staleness")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/staleness/<time>")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="per arm")
    p.add_argument("--cpus", default="1",
                   help="taskset CPU list for train.py ('' = no pinning). train.py runs one intra-op thread per "
                        "core it may use; on a shared 2-core machine two threads contending with other processes "
                        "make a step many times slower (tests/conftest.py), so the default pins it to core 1")
    p.add_argument("--reuse", action="store_true",
                   help="an arm whose run in --out already logged --steps steps is read, not run again")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--prepare-only", action="store_true", help="prepare (or find) the shards, then stop")
    return p


def main() -> None:
    args = _parser().parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {unknown}; arms: {', '.join(ARMS)}")
    data = None
    if not args.synthetic:
        text = args.text.resolve()
        if text.is_file():
            data = h.prepared_shards(text, args.cache_dir.resolve(), prepare_options(args), args.dry_run)
        else:
            print(f"{text}: not found; synthetic data instead", flush=True)
    if args.prepare_only:
        return
    out = (args.out or h.REPO / "bench" / "results" / "staleness"
           / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    common = common_overrides(args, data)
    pin = ["taskset", "-c", args.cpus] if args.cpus and shutil.which("taskset") else []
    if args.dry_run:
        for arm in arms:
            print("$ " + shlex.join([*pin, "python", "train.py", *common, *ARMS[arm][0], f"hydra.run.dir={out / arm}"]))
        return
    checkpoints = [c for c in (int(x) for x in args.checkpoints.split(",") if x) if c <= args.steps]
    if args.steps not in checkpoints:
        checkpoints.append(args.steps)
    summaries: dict[str, dict[str, Any]] = {}
    start = time.monotonic()
    losses: dict[str, list[float]] = {}
    for arm in arms:
        done = out / arm / "metrics.jsonl"
        if args.reuse and done.is_file() and len(h.step_rows(out / arm)) >= args.steps:
            rows = h.step_rows(out / arm)[:args.steps]
        else:
            rows = run_arm(arm, common, out, args.steps, args.timeout_s, pin)
        summaries[arm] = summarize(rows, checkpoints, args.window)
        losses[arm] = [math.nan if r.get("mlm_loss") is None else float(r["mlm_loss"]) for r in rows]
        last = summaries[arm]["train"].get(args.steps, math.nan)
        print(f"[{time.monotonic() - start:6.0f} s, {h.load()}] {arm}: {len(rows)} steps, train MLM "
              f"({args.window}-step mean) {last:.3f}, held-out {summaries[arm]['eval']}", flush=True)
    (out / "results.json").write_text(json.dumps(summaries, indent=1, default=str) + "\n")
    data_line = (f"data: {data[0].name} (vocab {data[1]})" if data else "data: synthetic")
    report = (f"{args.model}, one process, batch {args.micro_batch_size} x {args.num_micro_batches}, lr {args.lr:g} "
              f"(schedule of {args.schedule_steps or args.steps} steps), seed {args.seed}, {args.steps} steps; "
              f"{data_line}\n\n" + table(summaries, checkpoints, args.window))
    if "nvlamb" in losses and len(losses) > 1:
        report += "\n\nTraining MLM loss minus NVLAMB's at the same step, mean per bin:\n\n" + paired_table(losses, args.steps)
    (out / "table.md").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
