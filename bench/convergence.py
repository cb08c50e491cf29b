"""Does PipeFisher pay? Steps and time to held-out loss targets for NVLAMB, AdamW, Muon, K-FAC and
PipeFisher, with tuned learning rates and several seeds.

    python bench/convergence.py --quick              # bert-tiny, 120 steps, 2 seeds, small grids: minutes
    python bench/convergence.py                      # the study (hours on this machine; see bench/README.md §7)
    python bench/convergence.py --out DIR --continue # finished runs in DIR are kept, the rest run
    python bench/convergence.py --out DIR --report-only      # tables and figures from DIR's runs
    python bench/convergence.py --dry-run            # the data preparation and the first runs' commands
    python bench/convergence.py --calibration-from DIR_500,DIR_1000,DIR_2000 --calibration-out cal.json
                                                     # the planner's calibration from studies at several budgets

What it does (bench/README.md §7 has the choices and the figures):

- Data: WikiText-2 ``train.txt`` → shards with a WordPiece vocabulary trained on it; ``valid.txt``
  (no article shared) → held-out shards with that vocabulary, read by every evaluation
  (``data.eval_path``). Without the text, synthetic data (the targets then mean little).
- Targets: the unigram entropy H of the held-out masked labels minus ``--drops`` nats
  (``convergence_analysis`` [Note: what a target means]); nothing depends on any arm's curve.
- Tuning: a grid picks the value whose run reaches the hardest target in the fewest steps (a run that
  misses it ranks behind, by its final loss; ``tuning_score``), since time to target is what the study
  compares.
- Runs: ``train.py`` at one process (``stages=1``; every pipeline method and PipeFisher's plan give
  the same trajectory as one process, tested; ``pipefisher-d2`` runs its 2 processes unpinned), each pinned to one core, ``--jobs`` at a time, in
  ``<out>/runs/<batch>/<arm>/<lr>...``; a run that finished keeps its ``result.json`` and is not run
  again. ``plan_runs`` decides what is still needed: lr grids per family at seed 0 (extended past
  an edge), K-FAC's damping, the staleness arms, then every final arm at every seed.
- Arms: ``pipefisher-d2`` is PipeFisher itself, a D=2 chimera pipeline of 2 processes (4 micro-batches)
  with the plan its planner makes under train.py's defaults, so its curvature ages are the plan's
  (``pipefisher-d2-cM``: curvature from the first M micro-batches of each pipe; ``--timing-arms``
  times it as ``pipefisher-cM``);
  ``nvlamb``, ``adamw``, ``muon``, ``kfac-kK`` (critical-path K-FAC refreshing every K steps,
  used at once) and ``kfac-kK-deferred`` (inverses used from the next cycle on: PipeFisher's
  numerics at interval K). PipeFisher's stand-in in a setting is ``kfac-kP-deferred`` with P the interval
  its planner picks there (``--pipefisher-k``; the D=8 setting has no run of its own). ``ekfac-kK[-deferred]`` (family ``ekfac``, its own lr
  grid ``--grid-ekfac`` at ekfac-k1, no damping): optimizer=ekfac, Adam in the eigenbasis of K-FAC's
  factors (issue 28 item 3), bases refreshed every K steps, used at once or from the next cycle on. Every K-FAC arm's factor decay is
  ``--decay-per-step`` ** K per refresh, so the running average remembers the same number of steps
  whatever K (bench/README.md §10; train.py's default ``optimizer.factor_decay_per=step`` does the same,
  the arms spell it out per refresh). PipeFisher's k per setting (default D=2:7, D=8:5) is what its
  planner picks at batch 32: the built-in estimate at D=2, ``bench/step_costs.py`` at D=8.
- Step costs (``--step-costs FILE``, JSON ``{setting: {arm: seconds}}``): a setting is a placement
  (``D=2 measured``: paired rounds of the real pipeline; ``D=8 simulated``: bench/step_costs.py).
  Time to target = steps to target × the arm's step cost in that setting.
- Calibration (issue 37; ``--calibration-from`` / ``--calibration-out``): the budget method of Wen et al.
  (arXiv 2509.02046). Run the study once per budget (``--out DIR_B --steps B``: each run's lr schedule ends at B,
  each budget tunes its own lr; give ``--eval-every`` dividing every B so a run's last evaluation is at its end),
  then read every DIR's runs: per arm and budget the final held-out loss at the lr whose seed-0 run ends lowest,
  the speed-up over the reference = ratio of the budgets reaching the same final loss (interpolated in log
  budget) at ``--calibration-points`` losses over the reference's range, with the range over seed pairs
  (``convergence_analysis`` [Note: speed-up by budgets]). Writes ``planning.calibration``'s JSON, which
  ``schedule.py whatif=true calibration=<file>`` ranks by.
- A second held-out text (``--holdout-fraction F``): whole articles of ``train.txt`` (WikiText's `` = Title = ``
  units) held out at document level by the preparation (never in the training shards), beside ``valid.txt``.
  Every run then saves its final weights and the driver evaluates them on both texts, on the same
  ``--eval-batches`` × ``--micro-batch-size`` sequences of each (``final_by_text`` in ``result.json``; the
  valid.txt figure equals the run's own last evaluation). ``--calibration-text articles`` writes the calibration
  of those runs on the articles (the lr still picked on valid.txt), ``--calibration-compare FILE`` says point by
  point whether two texts' speed-ups agree within their seed intervals. ``--tune-by final`` makes the grids pick
  by final held-out loss (a budget study), not by steps to the hardest target (study 7).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as h
import convergence_analysis as ca

TEXT_DIR = h.REPO.parent / "shared" / "data" / "wikitext-2"


def arm_overrides(arm: str, decay_per_step: float) -> list[str]:
    """train.py overrides of ``arm`` (see the module docstring)."""
    if arm in ("nvlamb", "adamw", "muon"):
        return [f"optimizer={arm}"]
    curvature = ca.pipefisher_run(arm)
    if curvature is not None:  # its own plan (the planner's defaults), decaying the factors per step like the arms
        return ["optimizer=pipefisher", f"optimizer.factor_decay={decay_per_step:g}", "optimizer.factor_decay_per=step",
                *([f"optimizer.curvature_micro_batches={curvature}"] if curvature else [])]
    eparsed = ca.ekfac_arm(arm)
    if eparsed is not None:  # Adam in K-FAC's eigenbasis: K-FAC's intervals, decay and deferral
        k, deferred = eparsed
        return ["optimizer=ekfac", f"optimizer.curvature_interval={k}", f"optimizer.inverse_interval={k}",
                f"optimizer.deferred_inverse={str(deferred).lower()}",
                f"optimizer.factor_decay={decay_per_step ** k:.6g}", "optimizer.factor_decay_per=refresh"]
    parsed = ca.kfac_arm(arm)
    if parsed is None:
        raise ValueError(f"unknown arm {arm!r}: nvlamb, adamw, muon, a K-FAC arm (kfac-kK[-iM][-deferred|-ready]), "
                         "ekfac-kK[-deferred] or pipefisher-d2[-cM]")
    k, i, mode = parsed
    return ["optimizer=kfac", f"optimizer.curvature_interval={k}", f"optimizer.inverse_interval={i}",
            f"optimizer.deferred_inverse={str(mode != 'fresh').lower()}",
            *(["optimizer.promote_inverses=when_ready"] if mode == "ready" else []),
            f"optimizer.factor_decay={decay_per_step ** k:.6g}", "optimizer.factor_decay_per=refresh"]


QUICK = {"model": "bert-tiny", "batches": "32", "steps": "120", "eval_every": 20, "eval_batches": 8, "seeds": 2,
         "grid_nvlamb": "5e-3,1e-2", "grid_adamw": "2e-3,4e-3", "grid_muon": "2e-3,4e-3", "grid_kfac": "5e-3,1e-2",
         "grid_ekfac": "5e-3,1e-2", "damping": "1e-3", "stale": "kfac-k2-deferred", "drops": "0.05,0.1",
         "max_extend": 0, "dupe_factor": 1}
FULL = {"model": "bert-tiny", "batches": "32", "steps": "2000", "eval_every": 50, "eval_batches": 24, "seeds": 3,
        "grid_nvlamb": "5e-3,1e-2,2e-2", "grid_adamw": "1e-3,2e-3,4e-3", "grid_muon": "1e-3,2e-3,4e-3",
        "grid_kfac": "5e-3,1e-2,2e-2", "grid_ekfac": "2.5e-3,5e-3,1e-2", "damping": "1e-3,1e-2",
        "stale": "kfac-k1-deferred,kfac-k2,kfac-k2-deferred,kfac-k4,kfac-k4-deferred,kfac-k8,kfac-k8-deferred",
        "drops": "0.2,0.3", "max_extend": 2, "dupe_factor": 3}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="minutes: bert-tiny, 120 steps, 2 seeds, 2-value grids")
    p.add_argument("--out", type=Path, default=None, help="default bench/results/convergence/<time>")
    p.add_argument("--continue", dest="resume", action="store_true", help="keep --out's finished runs")
    p.add_argument("--report-only", action="store_true", help="report from --out's finished runs; run nothing")
    p.add_argument("--dry-run", action="store_true", help="print the commands of the first runs only")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, each pinned to its own core")
    p.add_argument("--text-dir", type=Path, default=TEXT_DIR, help="holds train.txt and valid.txt")
    p.add_argument("--cache-dir", type=Path, default=h.REPO / "bench" / ".cache" / "convergence")
    p.add_argument("--model", help="model config (default bert-tiny)")
    p.add_argument("--batches", help="global batch sizes, comma-separated (each = --micro-batch-size × micro-batches)")
    p.add_argument("--steps", help="run length per batch size, comma-separated in --batches' order (one value: all)")
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--max-predictions", type=int, default=10)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--dupe-factor", type=int)
    p.add_argument("--holdout-fraction", type=float, default=0.0,
                   help="hold out this fraction of train.txt's articles (document level, never trained on) as a "
                        "second held-out text beside valid.txt; every run's final weights are evaluated on both "
                        "(result.json final_by_text). 0: valid.txt only, the shards of study 7")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-batches", type=int, help="held-out micro-batches per evaluation")
    p.add_argument("--seeds", type=int)
    for fam in ("nvlamb", "adamw", "muon", "kfac", "ekfac"):
        p.add_argument(f"--grid-{fam}", help=f"initial lr grid of {fam}")
    p.add_argument("--damping", help="K-FAC damping grid at kfac-k1's lr (the first is the lr grid's)")
    p.add_argument("--max-extend", type=int, help="grid values added past an edge")
    p.add_argument("--families", default="nvlamb,adamw,muon,kfac", help="arm families to tune")
    p.add_argument("--stale", help="K-FAC arms run at kfac's pick with seed 0 (staleness curve)")
    p.add_argument("--final", default=None, help="arms run with every seed (default: the families' arms, "
                                                   "kfac-k1, PipeFisher's stand-in per setting and pipefisher-d2)")
    p.add_argument("--pipefisher-k", default="D=2:7,D=8:5",
                   help="setting:k of PipeFisher's plan per setting (bench/step_costs.py prints it)")
    p.add_argument("--decay-per-step", type=float, default=0.95)
    p.add_argument("--drops", help="targets: held-out unigram entropy minus these nats")
    p.add_argument("--tune-by", choices=("target", "final"), default="target",
                   help="what a grid minimizes: steps to the hardest target (study 7), or the final held-out loss "
                        "(a budget study for --calibration-from: Wen et al. tune each budget's lr by its final loss)")
    p.add_argument("--step-costs", type=Path, default=None, help="JSON {setting: {arm: seconds per step}}")
    p.add_argument("--measure-d2", action="store_true",
                   help="time every arm's real pipeline at D=2 (chimera; --timing-pipelines and --timing-placements "
                        "add others) in rotated rounds into <out>/step_costs.json, "
                        "then report; run it on a quiet machine")
    p.add_argument("--add-simulated", type=Path, action="append", default=[], metavar="FILE",
                   help="a bench/step_costs.py --json file: its simulated arms (pipefisher-kK included) go into "
                        "<out>/step_costs.json as 'D=<stages> simulated, batch <B>' (repeatable)")
    p.add_argument("--timing-rounds", type=int, default=3)
    p.add_argument("--timing-steps", type=int, default=40, help="steps per timing run (whole cycles after two)")
    p.add_argument("--timing-arms", default=",".join(TIMED_ARMS),
                   help=f"the arms --measure-d2 times (of {','.join(TIMED_ARMS)}); a subset replaces the setting's "
                        "figures with the subset's, so give it another --out")
    p.add_argument("--timing-pipelines", default="chimera",
                   help="pipelines --measure-d2 times each arm on, comma-separated (chimera: the study's setting; "
                        "any other is its own setting in step_costs.json)")
    p.add_argument("--timing-placements", default="global",
                   help="optimizer_placement values --measure-d2 times, comma-separated (global, per_stage)")
    p.add_argument("--timeout-s", type=float, default=7200.0, help="per run")
    p.add_argument("--calibration-from", default=None, metavar="DIRS",
                   help="comma-separated --out folders of studies at different --steps (budgets), or runs files "
                        "(--calibration-runs-out): read their runs")
    p.add_argument("--calibration-out", type=Path, default=None, metavar="FILE",
                   help="write the budget-method calibration of --calibration-from's runs here, then stop")
    p.add_argument("--calibration-reference", default="nvlamb", help="the arm speed-ups are relative to")
    p.add_argument("--calibration-points", type=int, default=5, help="held-out losses the speed-ups are read at")
    p.add_argument("--calibration-runs-out", type=Path, default=None, metavar="FILE",
                   help="write the runs of --calibration-from (final losses per arm, lr, seed and budget; no curves) "
                        "into one JSON file that --calibration-from reads like a folder, then stop (commit it: the run "
                        "folders are not)")
    p.add_argument("--calibration-compare", type=Path, default=None, metavar="FILE",
                   help="another text's calibration of the same runs: print whether the speed-ups agree (seed "
                        "intervals overlap) point by point")
    p.add_argument("--calibration-text", choices=(VALID, ARTICLES), default=VALID,
                   help="the held-out text whose final losses the calibration reads: valid.txt, or the train.txt "
                        "articles held out with --holdout-fraction (one calibration file per text)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with --quick's or the full study's defaults where a flag was not given."""
    args = _parser().parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def study_spec(args: argparse.Namespace) -> ca.StudySpec:
    """The :class:`StudySpec` of the arguments (final arms include PipeFisher's arm of every setting)."""
    batches = [int(b) for b in args.batches.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    if len(steps) == 1:
        steps = steps * len(batches)
    if len(steps) != len(batches):
        raise SystemExit(f"--steps {args.steps}: one value, or one per batch size of --batches {args.batches}")
    for b in batches:
        if b % args.micro_batch_size:
            raise SystemExit(f"--batches {b}: not a multiple of --micro-batch-size {args.micro_batch_size}")
    families = [f for f in args.families.split(",") if f]
    grids = {f: _floats(getattr(args, f"grid_{f}")) for f in families}
    if args.final:
        final = [a for a in args.final.split(",") if a]
    else:
        final = [ca.tuned_arm(f) for f in families]
        if "kfac" in families:
            try:
                ks = ca.pipefisher_ks(args.pipefisher_k)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            final += sorted({ca.pipefisher_arm(k) for k in ks.values()}) + ["pipefisher-d2"]
    stale = [a for a in args.stale.split(",") if a] if "kfac" in families else []
    for arm in stale + final:
        arm_overrides(arm, args.decay_per_step)  # unknown arms fail here, before any run
        if ca.family(arm) not in families:
            raise SystemExit(f"arm {arm}: its family {ca.family(arm)} is not in --families {args.families}")
    return ca.StudySpec(steps=dict(zip(batches, steps)), lr_grid=grids, damping_grid=_floats(args.damping),
                        stale_arms=stale, final_arms=final, seeds=args.seeds, max_extend=args.max_extend)


# --- data -------------------------------------------------------------------------------------


@dataclass
class Data:
    train: Path | None
    heldout: Path | None
    vocab: int
    unigram: float  # entropy of the held-out masked labels
    cross: float  # cross-entropy of those labels under the training labels' frequencies
    articles: Path | None = None  # whole train.txt articles held out (never trained on): the second held-out text

    def texts(self) -> dict[str, Path]:
        """Held-out text name -> its shards: ``valid`` (the runs' curve), ``articles`` when held out."""
        return {name: path for name, path in ((VALID, self.heldout), (ARTICLES, self.articles)) if path is not None}


VALID, ARTICLES = "valid", "articles"  # the held-out texts: valid.txt; whole train.txt articles (--holdout-fraction)


def prepare(args: argparse.Namespace) -> Data | None:
    """The study's shards (None: synthetic data, when the text is missing)."""
    train_txt, valid_txt = args.text_dir / "train.txt", args.text_dir / "valid.txt"
    if not (train_txt.is_file() and valid_txt.is_file()):
        print(f"{args.text_dir}: train.txt or valid.txt missing; synthetic data (targets mean little)", flush=True)
        return None
    common = {"seq_len": args.seq_len, "max_predictions": args.max_predictions, "seed": 12345}
    # --holdout-fraction 0 keeps the options (and the cache key, the shards) of the study before it existed
    held_out = {"holdout_fraction": args.holdout_fraction} if args.holdout_fraction else {}
    train, vocab = h.prepared_shards(train_txt, args.cache_dir,
                                     {**common, "vocab_size": args.vocab_size, "dupe_factor": args.dupe_factor,
                                      **held_out}, args.dry_run)
    if args.dry_run and not (train / "vocab.txt").is_file():
        print(f"(then {valid_txt} with {train / 'vocab.txt'}, dupe factor 1, as the held-out shards)")
        return Data(train, None, vocab, math.nan, math.nan)
    heldout, _ = h.prepared_shards(valid_txt, args.cache_dir,
                                   {**common, "vocab": str(train / "vocab.txt"), "dupe_factor": 1}, args.dry_run)
    if args.dry_run:
        return Data(train, heldout, vocab, math.nan, math.nan)
    held = ca.masked_labels(sorted(heldout.glob("*.hdf5")))
    seen = ca.masked_labels(sorted(train.glob("*.hdf5")))
    from pipefisher.data.heldout import heldout_path

    articles = heldout_path(train) if args.holdout_fraction else None
    if args.holdout_fraction and articles is None:
        raise SystemExit(f"{train}: no heldout/ folder although --holdout-fraction {args.holdout_fraction}; "
                         f"delete {train} so that it is prepared again")
    return Data(train, heldout, vocab, ca.unigram_entropy(held), ca.unigram_cross_entropy(held, seen, vocab), articles)


def common_overrides(args: argparse.Namespace, data: Data | None, batch: int, steps: int, *, stages: int = 1,
                     num_micro_batches: int | None = None, evaluate: bool = True) -> list[str]:
    """train.py overrides every run at ``batch`` shares: one process, micro-batches of
    ``--micro-batch-size`` by default (``num_micro_batches`` splits ``batch`` otherwise), with the
    held-out evaluation (``evaluate``) on the same ``--eval-batches`` × ``--micro-batch-size`` sequences
    whatever the micro-batch (train.py's ``eval.batches`` counts micro-batches)."""
    n = num_micro_batches or batch // args.micro_batch_size
    held_out = args.eval_batches * args.micro_batch_size
    if evaluate and held_out % (batch // n):
        raise SystemExit(f"{n} micro-batches of {batch // n}: the held-out set of {held_out} sequences "
                         f"(--eval-batches × --micro-batch-size) is not a whole number of them")
    out = [f"model={args.model}", f"stages={stages}", f"micro_batch_size={batch // n}",
           f"num_micro_batches={n}", f"steps={steps}",
           f"data.seq_len={args.seq_len}", f"data.max_predictions={args.max_predictions}",
           *((f"eval.every_steps={args.eval_every}", f"eval.batches={held_out // (batch // n)}") if evaluate
             else ("eval.every_steps=0",)),
           "device=cpu", "progress=false", "wandb.mode=disabled", "log_every=50",
           # the final weights are evaluated on the second held-out text after the run (final_by_text)
           f"save_final={str(evaluate and data is not None and data.articles is not None).lower()}"]
    if data is not None:
        out += ["data=hdf5", f"data.path={data.train}", f"data.eval_path={data.heldout}", f"model.vocab_size={data.vocab}"]
    return out


def hardest_target(args: argparse.Namespace, data: Data | None) -> float | None:
    """The lowest target (H minus the largest drop): the grids pick the lr that reaches it first."""
    if data is None or not math.isfinite(data.unigram):
        return None
    return min(ca.targets_below(data.unigram, [float(d) for d in args.drops.split(",")]).values())


def run_stages(arm: str) -> int:
    """Processes of ``arm``'s run: 2 for PipeFisher's own D=2 pipeline, 1 for every other arm."""
    return 2 if ca.pipefisher_run(arm) is not None else 1


def run_command(args: argparse.Namespace, data: Data | None, spec: ca.StudySpec, run: ca.Run, run_dir: Path) -> list[str]:
    """train.py's command line of ``run``: one process, or PipeFisher's D=2 pipeline of 4 micro-batches
    (the shape ``--measure-d2`` times)."""
    stages = run_stages(run.arm)
    shape = {"stages": stages, "num_micro_batches": 4} if stages > 1 else {}
    cmd = [sys.executable, "train.py", *common_overrides(args, data, run.batch, spec.steps[run.batch], **shape),
           *(["pipeline=chimera"] if stages > 1 else []),
           *arm_overrides(run.arm, args.decay_per_step), f"lr={run.lr:g}", f"seed={run.seed}"]
    if run.damping is not None:
        cmd.append(f"optimizer.damping={run.damping:g}")
    return cmd + [f"hydra.run.dir={run_dir}"]


# --- runs -------------------------------------------------------------------------------------


def summarize_run(run: ca.Run, rows: list[dict[str, Any]], status: str, wall_s: float,
                  final_by_text: dict[str, float] | None = None) -> dict[str, Any]:
    """A run's ``result.json``: ``final`` is the last held-out evaluation of its curve (valid.txt);
    ``final_by_text`` the final weights' held-out loss per text (:func:`final_by_text`), when evaluated."""
    curve = ca.eval_curve(rows)
    times = [r["step_time_s"] for r in rows[1:] if r.get("step_time_s") is not None]
    out = {"key": run.key, "batch": run.batch, "arm": run.arm, "lr": run.lr, "seed": run.seed, "damping": run.damping,
           "status": status, "final": ca.final_loss(curve) if status == "ok" else math.inf, "curve": curve,
           "steps": len(rows), "step_s_median": statistics.median(times) if times else None, "wall_s": wall_s}
    if final_by_text is not None:
        out["final_by_text"] = final_by_text
    return out


def final_by_text(args: argparse.Namespace, data: Data | None, run_dir: Path, status: str) -> dict[str, float] | None:
    """The held-out MLM loss of a run's final weights (``<run>/final/``) on every held-out text
    (:meth:`Data.texts`: valid.txt and the held-out train.txt articles), on the same ``--eval-batches`` ×
    ``--micro-batch-size`` sequences of each that the runs evaluate; ``inf`` for a diverged run. None when the
    study holds out no articles (one text: the curve's last evaluation says it all)."""
    if data is None or data.articles is None:
        return None
    if status != "ok":
        return {name: math.inf for name in data.texts()}
    import torch

    from pipefisher.evaluation import evaluate_folder

    torch.set_num_threads(1)
    return {name: evaluate_folder(run_dir / "final", shards, batches=args.eval_batches,
                                  micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                                  max_predictions=args.max_predictions)["eval_mlm_loss"]
            for name, shards in data.texts().items()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class _Flight:
    run: ca.Run
    pid: int
    slot: int
    started: float
    proc: subprocess.Popen | None = None  # None: adopted from an earlier driver


class Runner:
    """Runs the study's train.py processes, ``jobs`` at a time, each pinned to one core.

    Each run's folder holds ``pid`` (its train.py process) while it runs and ``result.json`` once it
    ended. A driver stopped with SIGTERM leaves its runs going; the next driver (``--continue``)
    adopts the ones still alive and finishes them from their files. Ctrl-C stops the runs too.
    """

    def __init__(self, args: argparse.Namespace, data: Data | None, spec: ca.StudySpec, out: Path) -> None:
        self.args, self.data, self.spec, self.out = args, data, spec, out
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        self.running: dict[str, _Flight] = {}
        self.start = time.monotonic()
        self.target = hardest_target(args, data) if args.tune_by == "target" else None  # None: by final loss

    def run_dir(self, run: ca.Run) -> Path:
        return self.out / "runs" / run.key

    def scores(self, results: dict[str, dict[str, Any]]) -> dict[str, float]:
        """Each run's :func:`tuning_score` against the study's hardest target."""
        return {k: ca.tuning_score(r["curve"], self.target) for k, r in results.items()}

    def results(self) -> dict[str, dict[str, Any]]:
        found = {}
        for path in (self.out / "runs").glob("b*/*/*/result.json"):
            r = json.loads(path.read_text())
            found[r["key"]] = r
        return found

    def _free_slot(self) -> int:
        busy = {f.slot for f in self.running.values()}
        return next(i for i in range(max(self.args.jobs, len(busy) + 1)) if i not in busy)

    def adopt(self, run: ca.Run) -> bool:
        """Take over ``run`` if an earlier driver's train.py for it is still alive."""
        pid_file = self.run_dir(run) / "pid"
        if not pid_file.is_file() or (self.run_dir(run) / "result.json").is_file():
            return False
        pid = int(pid_file.read_text().split()[0])
        if not _alive(pid):
            return False
        started = time.monotonic() - max(0.0, time.time() - pid_file.stat().st_mtime)
        self.running[run.key] = _Flight(run, pid, self._free_slot(), started)
        print(f"  adopted {run.key} (pid {pid})", flush=True)
        return True

    def launch(self, run: ca.Run) -> None:
        slot = self._free_slot()
        run_dir = self.run_dir(run)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = run_command(self.args, self.data, self.spec, run, run_dir)
        if shutil.which("taskset") and len(self.cores) > 1 and run_stages(run.arm) == 1:  # a pipeline: every core
            cmd = ["taskset", "-c", str(self.cores[slot % len(self.cores)])] + cmd
        with (run_dir / "train.log").open("w") as log:
            log.write("$ " + shlex.join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=h.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        (run_dir / "pid").write_text(f"{proc.pid}\n")
        self.running[run.key] = _Flight(run, proc.pid, slot, time.monotonic(), proc)

    def reap(self) -> list[dict[str, Any]]:
        """Finish the runs whose process ended (or ran past --timeout-s); returns their results."""
        done = []
        for key, f in list(self.running.items()):
            wall = time.monotonic() - f.started
            ended = f.proc.poll() is not None if f.proc is not None else not _alive(f.pid)
            if not ended and wall < self.args.timeout_s:
                continue
            if not ended:
                os.killpg(f.pid, signal.SIGKILL)
                if f.proc is not None:
                    f.proc.wait()
            del self.running[key]
            run_dir = self.run_dir(f.run)
            rows = h.step_rows(run_dir)
            text = (run_dir / "train.log").read_text(errors="replace")
            code = f.proc.returncode if f.proc is not None else None
            if code in (0, None) and len(rows) >= self.spec.steps[f.run.batch] and "Traceback" not in text:
                status = "ok"
            elif "FloatingPointError" in text:  # on_nonfinite=stop: a NaN/inf loss or gradient (diverged)
                status = "diverged"
            else:
                tail = "\n".join(text.splitlines()[-25:])
                raise RuntimeError(f"{key}: train.py exited with {code} after {len(rows)} steps "
                                   f"(log {run_dir / 'train.log'}):\n{tail}")
            result = summarize_run(f.run, rows, status, wall, final_by_text(self.args, self.data, run_dir, status))
            result["vocab_sha256"] = vocab_digest(self.data)
            (run_dir / "result.json").write_text(json.dumps(result) + "\n")
            done.append(result)
        return done

    def stop_all(self) -> None:
        for f in self.running.values():
            if _alive(f.pid):
                os.killpg(f.pid, signal.SIGKILL)
            if f.proc is not None:
                f.proc.wait()
        self.running.clear()

    def eta_s(self, todo: list[ca.Run], results: dict[str, dict[str, Any]]) -> float:
        """Seconds left for ``todo`` (and the runs in flight) at ``jobs`` runs at a time, from the
        wall times of finished runs of the same arm and batch (else of any run, else 5 minutes)."""
        walls: dict[tuple[int, str], list[float]] = {}
        for r in results.values():
            walls.setdefault((r["batch"], r["arm"]), []).append(r["wall_s"])
        every = [w for ws in walls.values() for w in ws] or [300.0]

        def guess(run: ca.Run) -> float:
            return statistics.median(walls.get((run.batch, run.arm), every))

        left = sum(guess(r) for r in todo)
        left += sum(max(0.0, guess(f.run) - (time.monotonic() - f.started)) for f in self.running.values())
        return left / max(1, self.args.jobs)

    def loop(self) -> None:
        """Run until :func:`plan_runs` asks for nothing more, printing progress after each run. The plan
        is made again only when a run has ended (its result is what can change it)."""
        results = self.results()
        while True:
            todo, _ = ca.plan_runs(self.spec, self.scores(results))
            waiting = [r for r in todo if r.key not in self.running and not self.adopt(r)]
            while waiting and len(self.running) < self.args.jobs:
                run = waiting.pop(0)
                print(f"  start {run.key}", flush=True)
                self.launch(run)
            if not self.running:
                return
            finished = self.reap()
            while not finished:
                time.sleep(2.0)
                finished = self.reap()
            results.update((r["key"], r) for r in finished)
            todo, _ = ca.plan_runs(self.spec, self.scores(results))
            eta = self.eta_s([t for t in todo if t.key not in self.running], results)
            for r in finished:
                print(f"[{(time.monotonic() - self.start) / 60:5.1f} min, {h.load()}] {r['key']}: {r['status']}, "
                      f"final held-out {r['final']:.3f}, {r['wall_s'] / 60:.1f} min; {len(results)} done, "
                      f"{len(self.running)} running, {len(todo) - len(self.running)} known to come, "
                      f"≥ {eta / 60:.0f} min left", flush=True)


# --- step costs at D=2, measured ------------------------------------------------------------------

#: arm -> train.py overrides of its real pipelined run (PipeFisher: its own plan from the built-in estimate)
TIMED_ARMS = ("nvlamb", "adamw", "muon", "kfac-k1", "kfac-k2", "kfac-k4", "kfac-k8", "pipefisher")


#: a timed PipeFisher with curvature from M micro-batches of each pipe (the ``pipefisher-d2-cM`` run's step)
TIMED_PIPEFISHER = re.compile(r"pipefisher-c(?P<c>[1-9][0-9]*)")


def timed_overrides(arm: str, decay_per_step: float) -> list[str]:
    """train.py overrides of a timed arm: ``pipefisher`` (its plan), ``pipefisher-cM``, else the study arm's."""
    if arm == "pipefisher":
        return ["optimizer=pipefisher"]
    m = TIMED_PIPEFISHER.fullmatch(arm)
    if m:
        return ["optimizer=pipefisher", f"optimizer.curvature_micro_batches={m['c']}"]
    return arm_overrides(arm, decay_per_step)


def timed_pipefisher(arm: str) -> bool:
    """Whether ``arm`` is ``pipefisher-cM`` (M ≥ 1), which --timing-arms takes beside TIMED_ARMS."""
    return TIMED_PIPEFISHER.fullmatch(arm) is not None


def cycle_mean_step_s(rows: list[dict[str, Any]]) -> tuple[float, int]:
    """(mean step time over whole refresh cycles after the first two, cycle length k): a refresh every
    k steps (``kfac_phase`` 0..k-1 on the rows) counts once per k steps; the first two cycles (warm-up,
    and PipeFisher's cycle without inverses) are left out."""
    phases = [r.get("kfac_phase") for r in rows]
    k = 1 + max((p for p in phases if p is not None), default=0)
    start = 2 * k
    while start < len(rows) and phases[start] not in (None, 0):
        start += 1
    usable = (len(rows) - start) // k * k
    if usable < k:
        raise ValueError(f"{len(rows)} steps hold no whole refresh cycle of {k} after the first two")
    return statistics.fmean(r["step_time_s"] for r in rows[start:start + usable]), k


def timing_setting(batch: int, pipeline: str = "chimera", placement: str = "global") -> str:
    """The step_costs.json setting of ``--measure-d2`` timings: the study's own name for chimera with the
    global step, the pipeline and ``optimizer_placement`` named in it otherwise."""
    if (pipeline, placement) == ("chimera", "global"):
        return f"D=2 measured, batch {batch}"
    return f"D=2 measured, {pipeline}, optimizer_placement={placement}, batch {batch}"


def measure_d2(args: argparse.Namespace, data: Data | None, out: Path, batch: int, rounds: int,
               steps: int, arms: tuple[str, ...] = TIMED_ARMS, pipelines: tuple[str, ...] = ("chimera",),
               placements: tuple[str, ...] = ("global",)) -> dict[str, dict[str, float]]:
    """Seconds per step of each arm's real pipeline at D=2 (4 micro-batches of batch/4) on each of
    ``pipelines`` with each ``optimizer_placement`` of ``placements``, in ``rounds`` rounds with the runs'
    order rotated every round; per run the median over rounds of :func:`cycle_mean_step_s`, keyed by
    :func:`timing_setting`. Evaluation off; both workers unpinned (one per core)."""
    runs = [(a, p, q) for p in pipelines for q in placements for a in arms]
    per_run: dict[tuple[str, str, str], list[float]] = {r: [] for r in runs}
    for r in range(rounds):
        for arm, pipeline, placement in h.rotated(runs, r):
            name = arm if (pipeline, placement) == ("chimera", "global") else f"{arm}-{pipeline}-{placement}"
            run_dir = out / "timing" / f"round{r}" / name
            shutil.rmtree(run_dir, ignore_errors=True)
            common = common_overrides(args, data, batch, steps, stages=2, num_micro_batches=4, evaluate=False)
            cmd = [sys.executable, "train.py", *common, f"pipeline={pipeline}", f"optimizer_placement={placement}",
                   *timed_overrides(arm, args.decay_per_step), f"hydra.run.dir={run_dir}"]
            done = subprocess.run(cmd, cwd=h.REPO, capture_output=True, text=True, timeout=args.timeout_s)
            if done.returncode:
                raise RuntimeError(f"timing {name}: train.py exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            mean, k = cycle_mean_step_s(h.step_rows(run_dir))
            per_run[(arm, pipeline, placement)].append(mean)
            print(f"  timing round {r}: {name} {mean * 1e3:.1f} ms/step (k={k}, {h.load()})", flush=True)
    settings: dict[str, dict[str, float]] = {}
    for (arm, pipeline, placement), values in per_run.items():
        settings.setdefault(timing_setting(batch, pipeline, placement), {})[arm] = statistics.median(values)
    return settings


def step_costs_file(out: Path, args: argparse.Namespace) -> Path | None:
    """--step-costs, else the study's own step_costs.json when it exists."""
    if args.step_costs:
        return args.step_costs
    own = out / "step_costs.json"
    return own if own.is_file() else None


RUNS_FORMAT = "pipefisher-budget-runs/1"
RUN_FIELDS = ("arm", "lr", "damping", "seed", "steps", "batch", "status", "final", "final_by_text", "step_s_median",
              "wall_s", "vocab_sha256")  # what a runs file keeps of a result.json (not its curve)


def vocab_digest(data: Data | None) -> str | None:
    """sha256 of the training shards' vocab.txt (which token ids the run saw: a vocabulary trained before 043350b
    differs between trainings, [Note: a deterministic WordPiece vocabulary] in pipefisher/data/prepare.py)."""
    if data is None or data.train is None or not (data.train / "vocab.txt").is_file():
        return None
    import hashlib

    return hashlib.sha256((data.train / "vocab.txt").read_bytes()).hexdigest()


def vocabularies(results: list[dict[str, Any]]) -> str:
    """The vocabularies of ``results``' runs in one phrase: each sha256 (12 hex) with its run count."""
    counts: dict[str, int] = {}
    for r in results:
        key = (r.get("vocab_sha256") or "unrecorded")[:12]
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} ({n} runs)" for k, n in sorted(counts.items()))


def run_results(source: Path) -> list[dict[str, Any]]:
    """The runs of a study folder (every ``result.json``) or of a runs file (``--calibration-runs-out``'s JSON,
    format ``pipefisher-budget-runs/1``: ``{"runs": [...]}``, e.g. ``bench/studies/data/18-budget-runs.json``)."""
    if source.is_file():
        doc = json.loads(source.read_text())
        if doc.get("format") != RUNS_FORMAT:
            raise SystemExit(f"{source}: format {doc.get('format')!r}, not {RUNS_FORMAT!r}: give a study folder or a "
                             f"runs file written by --calibration-runs-out")
        return list(doc["runs"])
    return [json.loads(p.read_text()) for p in sorted((source / "runs").glob("b*/*/*/result.json"))]


def runs_document(sources: list[Path], hardware: str) -> dict[str, Any]:
    """A runs file of ``sources``' runs (each a folder or a runs file): the fields the calibration reads
    (:data:`RUN_FIELDS`), so that a calibration can be rebuilt after the run folders are gone."""
    runs = [{k: r.get(k) for k in RUN_FIELDS} for src in sources for r in run_results(src)]
    return {"format": RUNS_FORMAT, "what": f"the runs of {', '.join(map(str, sources))}", "hardware": hardware,
            "runs": sorted(runs, key=lambda r: (r["steps"], r["arm"], r["lr"], r["seed"]))}


def calibration_from_runs(args: argparse.Namespace, dirs: list[Path], data: Data | None) -> dict[str, Any]:
    """The budget-method calibration document ([Note: the calibration file]) of the runs in ``dirs``."""
    from omegaconf import OmegaConf

    from pipefisher.config import ModelConfig
    from pipefisher.planning.calibration import calibration_document

    results = [r for d in dirs for r in run_results(d)]
    batches = sorted({int(r["batch"]) for r in results})
    if len(batches) != 1:
        raise SystemExit(f"--calibration-from {args.calibration_from}: runs at global batches {batches}; one batch "
                         f"per calibration (give the folders of one batch)")
    text = None if args.calibration_text == VALID else args.calibration_text
    if text is not None and not any(text in r.get("final_by_text", {}) for r in results):
        raise SystemExit(f"--calibration-text {text}: no run of {args.calibration_from} was evaluated on it; run the "
                         f"budget studies with --holdout-fraction F (e.g. 0.1), or use --calibration-text {VALID}")
    finals = ca.budget_finals(results, text)
    ref = args.calibration_reference
    if ref not in finals or len(finals[ref]) < 2:
        raise SystemExit(f"--calibration-reference {ref}: finished runs at {sorted(finals.get(ref, {}))} budget(s); "
                         f"the budget method needs two or more (study folders at other --steps)")
    keys = ca.calibration_optimizer(ref)
    if keys is None or "k" in keys:
        raise SystemExit(f"--calibration-reference {ref}: give nvlamb, adamw or muon")
    losses = ca.budget_losses(finals[ref], args.calibration_points)
    speedups = ca.budget_speedups(finals, ref, losses)
    raw = OmegaConf.load(h.REPO / "pipefisher" / "conf" / "model" / f"{args.model}.yaml")
    raw.pop("defaults", None)
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), raw)
    seeds = sorted({int(r["seed"]) for r in results if r["arm"] == ref})
    return calibration_document(
        method="budget",
        model={"name": str(model.name), "num_layers": int(model.num_layers), "hidden_size": int(model.hidden_size),
               "num_heads": int(model.num_heads), "vocab_size": data.vocab if data is not None else int(model.vocab_size)},
        batch={"global_batch": batches[0], "seq_len": args.seq_len, "max_predictions": args.max_predictions},
        data={"train": (f"{args.text_dir / 'train.txt'}" + (f" less the articles held out (--holdout-fraction "
                                                             f"{args.holdout_fraction:g})" if args.holdout_fraction else "")
                        + f": {data.train}; the runs' vocabulary sha256: {vocabularies(results)}") if data else "synthetic",
              "heldout": (HELDOUT_TEXTS[args.calibration_text].format(fraction=args.holdout_fraction)
                          + f": {data.texts()[args.calibration_text]}, the first {args.eval_batches * args.micro_batch_size}"
                          f" sequences") if data else "synthetic"},
        seeds=seeds, hardware=hardware_line(),
        reference=keys["optimizer"], budgets=sorted({b for arm in finals.values() for b in arm}),
        reference_steps=ca.reference_steps(finals[ref], losses), optimizers=ca.calibration_entries(speedups, ref),
        provenance=f"python bench/convergence.py --calibration-from {args.calibration_from}: {len(results)} runs; per "
                   f"arm and budget the lr whose seed-0 run ends lowest, every seed of it; speed-up = ratio of "
                   f"budgets reaching the same final held-out loss (log-budget interpolation), interval over seed "
                   f"pairs (bench/convergence_analysis.py [Note: speed-up by budgets])",
        limits=f"one model ({args.model}), one global batch ({batches[0]}), one held-out text per file; losses "
               f"{losses[0]:.3f} .. {losses[-1]:.3f} only (no extrapolation); PipeFisher entries are the K-FAC "
               f"stand-in arms at their k (kfac-kK-deferred / -ready)" if losses else "no loss in range")


def compare_table(a: dict[str, Any], b: dict[str, Any]) -> str:
    """:func:`convergence_analysis.compare_texts` of two calibrations as a markdown table."""
    rows = ca.compare_texts(a, b)

    def pairs(n: int | None) -> str:
        return "" if n is None else f" ({n} pairs)"

    lines = ["| arm | point | loss (this) | reference budget | speed-up (this) | loss (other) | reference budget | "
             "speed-up (other) | intervals overlap |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['point']} | {r['loss_a']:.3f} | {r['budget_a']:.0f} | "
                     f"{r['a'][0]:.2f} [{r['a'][1]:.2f}–{r['a'][2]:.2f}]{pairs(r['pairs'][0])} | {r['loss_b']:.3f} | "
                     f"{r['budget_b']:.0f} | {r['b'][0]:.2f} [{r['b'][1]:.2f}–{r['b'][2]:.2f}]{pairs(r['pairs'][1])} | "
                     f"{'yes' if r['agree'] else '**no**'} |")
    agree = sum(r["agree"] for r in rows)
    return "\n".join(lines) + f"\n\n{agree} of {len(rows)} points agree within their seed intervals"


HELDOUT_TEXTS = {VALID: "WikiText-2 valid.txt (no article shared with train.txt)",
                 ARTICLES: "whole WikiText-2 train.txt articles held out at document level (fraction {fraction:g}, "
                           "never trained on; the WordPiece vocabulary was trained on all of train.txt)"}


def hardware_line() -> str:
    """Where the runs ran: the CPU (model, flags), torch, how the runs were placed (steps do not depend on it)."""
    from pipefisher.hardware import describe_hardware

    return (f"{describe_hardware('cpu')} in the driver; {platform.platform()}; each run pinned to one core "
            f"(taskset), 1 torch thread (steps and losses do not depend on the hardware or the load)")


def main() -> None:
    args = parse_args()
    if args.calibration_runs_out is not None:
        if not args.calibration_from:
            raise SystemExit("--calibration-runs-out needs --calibration-from DIR,DIR,... (the runs to write)")
        from pipefisher.atomic import write_text_atomic

        doc = runs_document([Path(d) for d in args.calibration_from.split(",") if d], hardware_line())
        write_text_atomic(args.calibration_runs_out, json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.calibration_runs_out}: {len(doc['runs'])} runs")
        return
    if args.calibration_out is not None:
        if not args.calibration_from:
            raise SystemExit("--calibration-out needs --calibration-from DIR,DIR,... (studies at several --steps)")
        from pipefisher.planning.calibration import write_calibration

        dirs = [Path(d) for d in args.calibration_from.split(",") if d]
        doc = calibration_from_runs(args, dirs, prepare(args))
        path = write_calibration(args.calibration_out, doc)
        print(f"wrote {path}\n\nspeed-up over {doc['reference']} (budgets {doc['budgets']}; held-out "
              f"{doc['data']['heldout']}):\n{ca.calibration_table(doc)}")
        if args.calibration_compare is not None:
            print(f"\nagainst {args.calibration_compare}:\n{compare_table(doc, json.loads(args.calibration_compare.read_text()))}")
        return
    spec = study_spec(args)
    out = (args.out or h.REPO / "bench" / "results" / "convergence"
           / datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    if out.exists() and any((out / "runs").glob("*")) and not (args.resume or args.report_only):
        raise SystemExit(f"{out} holds runs: add --continue to keep them, or choose another --out")
    data = prepare(args)
    if args.dry_run:
        todo, _ = ca.plan_runs(spec, {})
        for run in todo[: 2 * len(spec.lr_grid)]:
            print("$ " + shlex.join(run_command(args, data, spec, run, out / "runs" / run.key)))
        print(f"... {len(todo)} runs known now; more follow from their results")
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps({"argv": sys.argv[1:], "args": vars(args)}, default=str, indent=1) + "\n")
    if data is not None:
        print(f"held-out unigram entropy H = {data.unigram:.3f} nats; cross-entropy under the training "
              f"frequencies {data.cross:.3f}", flush=True)
    runner = Runner(args, data, spec, out)
    if not (args.report_only or args.measure_d2):
        try:
            runner.loop()
        except KeyboardInterrupt:  # Ctrl-C stops the runs; SIGTERM leaves them to the next --continue
            runner.stop_all()
            raise
    if args.measure_d2:
        path = out / "step_costs.json"
        costs = json.loads(path.read_text()) if path.is_file() else {}
        arms = tuple(a for a in args.timing_arms.split(",") if a)
        if not arms or any(a not in TIMED_ARMS and not timed_pipefisher(a) for a in arms):
            raise SystemExit(f"--timing-arms {args.timing_arms!r}: choose from {','.join(TIMED_ARMS)} or pipefisher-cM")
        pipelines = tuple(x for x in args.timing_pipelines.split(",") if x)
        placements = tuple(x for x in args.timing_placements.split(",") if x)
        for batch in spec.steps:
            costs.update(measure_d2(args, data, out, batch, args.timing_rounds, args.timing_steps, arms,
                                    pipelines, placements))
        path.write_text(json.dumps(costs, indent=1) + "\n")
    if args.add_simulated:
        path = out / "step_costs.json"
        costs = json.loads(path.read_text()) if path.is_file() else {}
        for sim in args.add_simulated:
            setting, arms = ca.simulated_setting(json.loads(sim.read_text()))
            costs[setting] = {**costs.get(setting, {}), **arms}
            print(f"{path}: {setting} from {sim} ({len(arms)} arms)")
        path.write_text(json.dumps(costs, indent=1) + "\n")
    args.step_costs = step_costs_file(out, args)
    import convergence_report

    convergence_report.write(out, args, spec, data, runner.results())


if __name__ == "__main__":
    h.main_guard(main)
