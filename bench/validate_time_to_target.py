"""Validate the strategy search's time to target at D=2 (or --stages 4) measured (issue 37's goals), every schedule × optimizer.

    python bench/validate_time_to_target.py --out DIR --measure --steps 8   # every pair, 2 rounds (see below)
    python bench/validate_time_to_target.py --out DIR --measure --quick     # 6 pairs, the same way (6 min here)
    python bench/validate_time_to_target.py --out DIR --diagnose            # each action's cost: search vs profile
    python bench/validate_time_to_target.py --out DIR --top-pick            # goal 2: the top pick trained to H-0.3
    python bench/validate_time_to_target.py --out DIR --interleaved 84      # the same pairs in one pair of processes
    python bench/validate_time_to_target.py --out DIR                       # the tables again from DIR/validation.json

Duration: a round is 40 train.py runs (8 schedules x 5 optimizers), 20-60 s each on 2 cores at load 6-10 (most of it
start-up), so 35-50 min per round there, more while other benchmarks hold the lock; ``--rounds 1`` halves it,
``--quick`` is 6 runs.

Shape: bert-tiny (vocabulary 8,192, seq 64, 10 predictions), global batch 32 in 4 micro-batches of 8, 2 workers
(pp=2, one pipeline): the convergence study's, whose steps the calibration holds.

Predicted (the search's own path): ``run_whatif`` (``schedule.py whatif=true``) over pp × dp at world 2, micro-batch
8, every schedule and optimizer, ranked by time to target with the planner's calibration
(``bench/calibration/study_b32_fixed_schedule.json``) at H-0.3 (held-out loss 6.24); its pp=2 rows are the pairs.
Costs, two ways, both the search's (FLOP estimates; no profile):

- ``measured rates`` (the figure the goals are judged by): ``comm_costs=<file>`` that
  ``python -m pipefisher.measure.collectives --model bert-tiny --vocab-size 8192 --seq-len 64 --max-predictions 10
  --micro-batch-sizes 8`` wrote in this session, under the same lock and just before the runs: gloo collectives,
  the whole model's forward+backward FLOP rate at micro-batch 8 and NVLAMB's step bandwidth, measured here;
- ``built-in keys``: docs/time-to-target.md's keys (``flops_per_s=9.8e10 p2p_bytes_per_s=2e9
  memory_bytes_per_s=1e10``, no file).

Measured (the real executor): each pair's strategy file (``strategy_document``; PipeFisher's with the searched
plan, as ``schedule.py`` writes the best one) run as ``train.py strategy=<file>``, synthetic data of the shape (a
step's cost does not depend on the text), evaluation off; per run the mean step over whole refresh cycles after
the first two (``convergence.cycle_mean_step_s``, the study's estimator); the pairs' order rotated every round;
per pair the median over rounds. Each run holds ``/tmp/pipefisher-bench.lock`` (``flock``), as does the
measurement of the rates.

Measured interleaved (``--interleaved ROUNDS``, after ``--measure`` into the same DIR): the same strategy files,
each a ``PipelineWorker`` of the same ``--stages`` processes, one step each per round in rotated order (``_harness``
[Note: measuring on a shared CPU]), each pair's ROUNDS rounded up to a multiple of 2k (``pair_rounds``: whole
refresh cycles in each half; a pair leaves the rotation when its rounds are done); per pair the mean step of
each half of the rounds. Separate train.py runs differ from run to run by ~10 % on 2 cores (start-up,
memory placement, the load); steps interleaved in one pair of processes share all of it, so their order can be
compared with the prediction's at the goal's resolution. ``train_step`` alone is timed, so these are compared
with the predictions without train.py's bookkeeping. The rates file's own GPipe step (NVLAMB, N=8, a shape no pair
runs) runs in the same rotation: its time there against the file's says how much faster or slower the machine ran
during the pairs than when the rates were measured, and the report judges the step goal on the predictions carried
by that factor as well (the raw figures stay the goal's).

Time to target = the calibration's steps to H-0.3 (its reference's steps × the optimizer's multiplier) × the
step. The steps are the same number for predicted and measured (trajectories do not depend on placement), so
the order test is a test of step times weighted by each optimizer's steps.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import _harness as h

SCHEDULES = ("gpipe", "1f1b", "chimera", "chimera-doubling", "interleaved", "zb-h1", "zb-v", "dualpipev", "v-half",
             "v-min")  # every schedule train.py runs (planning.whatif.METHODS)
OPTIMIZERS = ("nvlamb", "adamw", "muon", "kfac", "pipefisher")
QUICK_PAIRS = (("chimera", "nvlamb"), ("chimera", "muon"), ("chimera", "pipefisher"), ("1f1b", "nvlamb"),
               ("1f1b", "kfac"), ("zb-v", "adamw"))
CALIBRATION = h.REPO / "bench" / "calibration" / "study_b32_fixed_schedule.json"
TARGET_LOSS = 6.24  # H-0.3 of the study's held-out text (H = 6.540)
MODEL = ["model=bert-tiny", "model.vocab_size=8192", "data.seq_len=64", "data.max_predictions=10"]
STAGES = 2  # D: pipeline stages = workers (--stages; 4 needs at least 4 cores, and V schedules then need 6 layers)
SEARCH = [*MODEL, "global_batch=32", "memory_gb=8", "memory_device=cpu", "search.micro_batch_sizes=[8]",
          "search.recompute=[false]", "search.sdp=[1]", "search.tp=[1]", "search.top=200",
          f"calibration={CALIBRATION}", f"target_loss={TARGET_LOSS}"]
BUILTIN_KEYS = ["flops_per_s=9.8e10", "p2p_bytes_per_s=2e9", "memory_bytes_per_s=1e10"]  # docs/time-to-target.md
COLLECTIVES = ["--model", "bert-tiny", "--vocab-size", "8192", "--seq-len", "64", "--max-predictions", "10",
               "--micro-batch-sizes", "8", "--max-bytes", "4m", "--executor-micro-batches", "8"]
# The executor's per-schedule steps (compute.executor.methods) are measured at N=8, the runs at N=4: the factor each
# schedule's step is priced with is then a prediction for the runs, not a copy of one of them.
DECAY_PER_STEP = 0.95  # the study's factor decay (no effect on a step's cost; kept so the runs are the study's)
LOCK = "/tmp/pipefisher-bench.lock"
REFERENCE = "reference"  # the rates file's own GPipe step, run again beside the pairs (reference_shape)
GOAL_SPEARMAN, GOAL_STEP_ERROR = 0.8, 0.10


# --- the pure parts (tests/test_validate_time_to_target.py) ---------------------------------------------------


def ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, smallest first; tied values share the mean of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties: mean ranks).

    Raises:
        ValueError: fewer than two pairs, unequal lengths, or a constant side (no order to compare).
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"spearman needs two equally long series of at least 2 values, got {len(xs)} and {len(ys)}")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        raise ValueError("spearman: one series is constant, so it has no order to compare")
    return sxy / math.sqrt(sxx * syy)


@dataclass(frozen=True)
class Row:
    """One (schedule, optimizer) pair: predicted beside measured."""

    schedule: str
    optimizer: str
    steps: float  # the calibration's steps to the target (the same for predicted and measured)
    predicted_s: float  # step, measured rates
    measured_s: float  # step, median over rounds
    rounds_s: tuple[float, ...]
    builtin_s: float | None = None  # step, built-in keys
    k_predicted: int = 1
    k_measured: int | None = None

    @property
    def error(self) -> float:
        """Predicted step / measured - 1."""
        return self.predicted_s / self.measured_s - 1

    @property
    def builtin_error(self) -> float | None:
        return None if self.builtin_s is None else self.builtin_s / self.measured_s - 1

    @property
    def predicted_time_s(self) -> float:
        return self.steps * self.predicted_s

    @property
    def measured_time_s(self) -> float:
        return self.steps * self.measured_s


def assemble_rows(predicted: Mapping[str, Mapping[str, Any]], measured: Mapping[str, Sequence[float]],
                  builtin: Mapping[str, Mapping[str, Any]] | None = None,
                  measured_k: Mapping[str, int] | None = None) -> list[Row]:
    """Rows of the pairs measured in every key of ``measured`` (``schedule/optimizer``: its rounds' steps, s).

    ``predicted`` / ``builtin``: per key ``{"step_s", "steps", "k"}`` (the search's step, its steps to the target
    and PipeFisher's k). A measured pair the prediction lacks is an error (the search refused what train.py ran).
    """
    rows = []
    for key, rounds in measured.items():
        if not rounds:
            continue
        if key not in predicted:
            raise ValueError(f"{key}: measured but not predicted (the search has no pp=2 row for it)")
        schedule, optimizer = key.split("/")
        p = predicted[key]
        b = (builtin or {}).get(key)
        rows.append(Row(schedule, optimizer, float(p["steps"]), float(p["step_s"]), statistics.median(rounds),
                        tuple(rounds), None if b is None else float(b["step_s"]), int(p.get("k") or 1),
                        (measured_k or {}).get(key)))
    return rows


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Spearman of predicted against measured time to target (measured rates; built-in keys where every row has
    one), the worst step error, the pairs within the goal's 10 %, and whether each goal is met."""
    out: dict[str, Any] = {"pairs": len(rows)}
    if len(rows) >= 2:
        out["spearman"] = spearman([r.predicted_time_s for r in rows], [r.measured_time_s for r in rows])
        if all(r.builtin_s is not None for r in rows):
            out["spearman_builtin"] = spearman([r.steps * r.builtin_s for r in rows], [r.measured_time_s for r in rows])
    if rows:
        worst = max(rows, key=lambda r: abs(r.error))
        out["worst_error"] = worst.error
        out["worst_pair"] = f"{worst.schedule}/{worst.optimizer}"
        out["within_goal"] = sum(abs(r.error) <= GOAL_STEP_ERROR for r in rows)
        if all(r.builtin_error is not None for r in rows):
            wb = max(rows, key=lambda r: abs(r.builtin_error))
            out["worst_error_builtin"] = wb.builtin_error
            out["worst_pair_builtin"] = f"{wb.schedule}/{wb.optimizer}"
        out["spearman_met"] = out.get("spearman", -1.0) >= GOAL_SPEARMAN
        out["step_error_met"] = abs(out["worst_error"]) <= GOAL_STEP_ERROR
    return out


def with_kfac_units_in_search(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document whose K-FAC unit rates the search prices CURV/PRECOND/INVERT by
    (``compute.kfac_in_search``; off in what ``measure.collectives`` writes)."""
    out = json.loads(json.dumps(doc))
    out.setdefault("compute", {})["kfac_in_search"] = True
    return out


def without_pieces(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without the per-piece times (``compute.micro_batch.<size>.pieces``), so
    the search prices stages by the whole model's FLOP rate and forward share, as before the pieces were measured."""
    out = json.loads(json.dumps(doc))
    for row in (out.get("compute", {}).get("micro_batch") or {}).values():
        row.pop("pieces", None)
    return out


def without_executor_overhead(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without the executor's measured overhead per action
    (``compute.executor``), so the search adds nothing to each F, B, I and W."""
    out = json.loads(json.dumps(doc))
    out.get("compute", {}).pop("executor", None)
    return out


def without_executor_methods(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without the per-schedule executor steps (``compute.executor.methods``),
    so the search scales no schedule's compute ([Note: per-schedule executor factor]); the overhead per action
    stays."""
    out = json.loads(json.dumps(doc))
    (out.get("compute", {}).get("executor") or {}).pop("methods", None)
    return out


def without_kfac_factor(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without the K-FAC steps the executor ran (``compute.executor.kfac``), so
    the search prices K-FAC's units as measured alone ([Note: K-FAC unit factor])."""
    out = json.loads(json.dumps(doc))
    (out.get("compute", {}).get("executor") or {}).pop("kfac", None)
    return out


def without_bookkeeping(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without train.py's measured bookkeeping per step
    (``compute.executor.bookkeeping_seconds``), so the search adds nothing to each predicted step for it."""
    out = json.loads(json.dumps(doc))
    (out.get("compute", {}).get("executor") or {}).pop("bookkeeping_seconds", None)
    return out


def round_rows(doc: Mapping[str, Any], r: int) -> list[Row]:
    """Round ``r`` alone: its own prediction (from the rates measured just before it) against its own runs, for the
    pairs measured in it (the rounds' runs are appended in order, so a pair's ``r``-th entry is round ``r``'s)."""
    measured = {k: [v[r]] for k, v in doc["measured"].items() if len(v) > r}
    return assemble_rows(doc["predicted_rounds"][r], measured, doc.get("builtin"), doc.get("measured_k"))


def decompose(rows: Sequence[Row]) -> dict[str, Any]:
    """Where the step error sits: the common factor (median of predicted / measured over every pair: a rate that
    is off for all of them, e.g. measured at another load), each optimizer's and each schedule's median ratio
    over that factor, and the worst pair once the common factor is divided out (a diagnostic, not the goal)."""
    ratio = {(r.schedule, r.optimizer): r.predicted_s / r.measured_s for r in rows}
    common = statistics.median(ratio.values())
    by_opt: dict[str, list[float]] = {}
    by_sched: dict[str, list[float]] = {}
    for (sched, opt), x in ratio.items():
        by_opt.setdefault(opt, []).append(x / common)
        by_sched.setdefault(sched, []).append(x / common)
    worst = max(ratio, key=lambda k: abs(ratio[k] / common - 1))
    return {"common": common, "optimizer": {k: statistics.median(v) for k, v in by_opt.items()},
            "schedule": {k: statistics.median(v) for k, v in by_sched.items()},
            "worst_after_common": ("/".join(worst), ratio[worst] / common - 1),
            "within_after_common": sum(abs(x / common - 1) <= GOAL_STEP_ERROR for x in ratio.values())}


def round_spread(rows: Sequence[Row]) -> tuple[float, float, int] | None:
    """The measurement's own noise: per pair measured in two rounds or more, its slowest round / fastest - 1;
    (median, largest, pairs) over those pairs, or None. No step error below it can be shown."""
    spreads = [max(r.rounds_s) / min(r.rounds_s) - 1 for r in rows if len(r.rounds_s) >= 2]
    return (statistics.median(spreads), max(spreads), len(spreads)) if spreads else None


def round_spearman(rows: Sequence[Row]) -> tuple[float, int] | None:
    """Spearman of round 0's measured time to target against round 1's, over the pairs measured in both: how well
    the measurement orders the pairs against itself, the ceiling for any prediction on this machine."""
    both = [r for r in rows if len(r.rounds_s) >= 2]
    if len(both) < 3:
        return None
    return spearman([r.steps * r.rounds_s[0] for r in both], [r.steps * r.rounds_s[1] for r in both]), len(both)


def twin_spread(rows: Sequence[Row], a: str = "nvlamb", b: str = "adamw") -> dict[str, float]:
    """Per schedule, NVLAMB's measured step / AdamW's - 1: the same pipeline and nearly the same optimizer step
    (AdamW's is NVLAMB's without the trust ratio, a few % of a D=2 step), so the search prices them equal and
    any difference is the measurement's noise."""
    steps = {(r.schedule, r.optimizer): r.measured_s for r in rows}
    return {s: steps[(s, a)] / steps[(s, b)] - 1 for s, o in steps if o == a and (s, b) in steps}


def diagnostic_line(rows: Sequence[Row], measured: str = "measured") -> str:
    """:func:`decompose` in one line: the common factor, each optimizer's and schedule's ratio over it, the worst
    pair and the pairs within the goal once it is divided out (a diagnostic, not the goal)."""
    d = decompose(rows)
    return (f"diagnostic: predicted / {measured} step over every pair, median {d['common']:.2f} (a rate off for all "
            f"of them); over that factor, by optimizer: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(d["optimizer"].items()))
            + "; by schedule: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(d["schedule"].items()))
            + f"; worst pair then {d['worst_after_common'][0]} {d['worst_after_common'][1]:+.0%}, "
            f"{d['within_after_common']} of {len(rows)} within {GOAL_STEP_ERROR:.0%}")


def table_lines(rows: Sequence[Row]) -> list[str]:
    """Markdown: every pair, fastest measured time first, with both ranks."""
    pr = ranks([r.predicted_time_s for r in rows])
    mr = ranks([r.measured_time_s for r in rows])
    order = sorted(range(len(rows)), key=lambda i: (mr[i], pr[i]))
    head = ["schedule", "optimizer", "k pred/meas", "steps to H-0.3", "pred step ms", "meas step ms [rounds]",
            "error", "built-in ms (error)", "pred time s", "meas time s", "pred rank", "meas rank"]
    body = []
    for i in order:
        r = rows[i]
        builtin = "-" if r.builtin_s is None else f"{r.builtin_s * 1e3:.1f} ({r.builtin_error:+.0%})"
        body.append([r.schedule, r.optimizer, f"{r.k_predicted}/{r.k_measured if r.k_measured is not None else '-'}",
                     f"{r.steps:.0f}", f"{r.predicted_s * 1e3:.1f}",
                     f"{r.measured_s * 1e3:.1f} [" + ", ".join(f"{x * 1e3:.0f}" for x in r.rounds_s) + "]",
                     f"{r.error:+.1%}", builtin, f"{r.predicted_time_s:.0f}", f"{r.measured_time_s:.0f}",
                     f"{pr[i]:g}", f"{mr[i]:g}"])
    return h.table(head, body).splitlines()


def median_prediction(rounds: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per pair, round 0's prediction with the step the median over the rounds' predictions (each from the rates
    measured just before that round); the steps and k are round 0's (the plan that ran)."""
    out = {}
    for key, first in rounds[0].items():
        steps = [r[key]["step_s"] for r in rounds if key in r]
        out[key] = {**first, "step_s": statistics.median(steps), "rounds_step_s": steps}
    return out


def same_schedules(stages: int = 2) -> dict[str, str]:
    """Schedules whose action lists at this shape (pp=``stages``, 4 micro-batches) equal an earlier one's in
    ``SCHEDULES``: schedule -> that one (v-half and v-min are zb-v's at D=2, N=4). They run the same executor
    work, so they are measured (and counted) once. Schedules the shape cannot build are left out."""
    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import RunShape

    bert = BertConfig(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512, vocab_size=8192)
    seen: dict[str, str] = {}
    out = {}
    for m in SCHEDULES:
        v = 2 if m in ("interleaved", "zb-v", "dualpipev", "v-half", "v-min") else 1
        try:
            sched = RunShape(bert, m, stages, 4, 8, 1, v, 64, 10).build_schedule(dp_width=1)
        except ValueError:
            continue
        key = repr(sorted((w, [str(a) for a in acts]) for w, acts in sched.actions.items()))
        if key in seen:
            out[m] = seen[key]
        else:
            seen[key] = m
    return out


def pairs_of(quick: bool, spec: str = "", stages: int = 2) -> list[tuple[str, str]]:
    """The (schedule, optimizer) pairs: ``spec`` (``schedule/optimizer,...``), the quick six, or every one."""
    if spec:
        out = [tuple(x.split("/")) for x in spec.split(",") if x]
        bad = [f"{s}/{o}" for s, o in out if s not in SCHEDULES or o not in OPTIMIZERS]
        if bad:
            raise ValueError(f"--pairs {','.join(bad)}: schedules {', '.join(SCHEDULES)}; optimizers "
                             f"{', '.join(OPTIMIZERS)}")
        return out  # type: ignore[return-value]
    if quick:
        return list(QUICK_PAIRS)
    same = same_schedules(stages)
    return [(s, o) for s in SCHEDULES if s not in same for o in OPTIMIZERS]


# --- the search's prediction ----------------------------------------------------------------------------------


def _schedule_config(overrides: Sequence[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from pipefisher.planning.config import register_schedule_configs, to_schedule_config

    register_schedule_configs()
    with initialize_config_dir(config_dir=str(h.REPO / "pipefisher" / "conf"), version_base="1.3"):
        return to_schedule_config(compose(config_name="schedule", overrides=list(overrides)))


def _strategy(row: Mapping[str, Any]) -> Any:
    from pipefisher.planning.strategy_search import Strategy

    names = {f.name for f in fields(Strategy)}
    values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in row.items() if k in names}
    return Strategy(**values)


def predict(out: Path, keys: Sequence[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """``schedule.py whatif=true`` (``run_whatif``) with the study's shape and ``keys``; per ``schedule/optimizer``
    of its pp=2 rows the step, steps to the target and k, and the whole search (text, top pick)."""
    from pipefisher.planning.cli import run_whatif

    cfg = _schedule_config([*SEARCH, f"devices={STAGES}", *keys])
    text = run_whatif(cfg, out)
    found = [_strategy(r) for r in json.loads((out / "whatif.json").read_text())]
    ranked = [s for s in found if s.excluded is None]
    pairs = {}
    for s in ranked:
        if s.stages == STAGES and s.dp == 1:
            pairs[f"{s.method}/{s.optimizer}"] = {"step_s": s.step_time_s, "steps": s.time_to_target_s / s.step_time_s,
                                                  "k": s.interval, "age": s.curvature_age,
                                                  "time_s": s.time_to_target_s, "time_rank": s.time_rank}
    refused = {f"{s.method}/{s.optimizer}": s.excluded for s in found if s.excluded and s.stages == STAGES}
    return pairs, {"text": text, "top": ranked[0].label if ranked else None, "refused": refused,
                   "strategy": str(out / "strategy.json")}


def write_strategies(out: Path, keys: Sequence[str], pairs: Sequence[tuple[str, str]]) -> dict[str, Path]:
    """One strategy file per pair, as ``schedule.py whatif=true`` writes its best (PipeFisher with its plan over
    every data-parallel group), from the search's rows in ``out/whatif.json``."""
    from pipefisher.planning.cli import _bert, _hardware
    from pipefisher.planning.comm_costs import CommCosts
    from pipefisher.planning.pipefisher_plan import PlanOptions
    from pipefisher.planning.strategy_file import strategy_document, write_strategy
    from pipefisher.planning.strategy_search import strategy_plan

    cfg = _schedule_config([*SEARCH, f"devices={STAGES}", *keys])
    hardware = _hardware(cfg)
    comm = CommCosts.from_json(cfg.comm_costs, hardware) if cfg.comm_costs else None
    rows = {(s.method, s.optimizer): s for s in map(_strategy, json.loads((out / "whatif.json").read_text()))
            if s.excluded is None and s.stages == STAGES and s.dp == 1}
    files = {}
    for schedule, optimizer in pairs:
        s = rows[(schedule, optimizer)]
        plan = None
        if optimizer == "pipefisher":
            plan = strategy_plan(s, _bert(cfg), hardware=hardware, comm=comm, seq_len=cfg.data.seq_len,
                                 max_predictions=cfg.data.max_predictions, precision=cfg.precision,
                                 plan_options=PlanOptions.from_optimizer(cfg),
                                 split_backward_ratio=cfg.search.split_backward_ratio, dp_width=None)
        doc = strategy_document(s, cfg.model, cfg.data, cfg.precision, search={"devices": STAGES, "comm_costs": cfg.comm_costs},
                                plan=plan)
        files[f"{schedule}/{optimizer}"] = write_strategy(out / "strategies" / f"{schedule}-{optimizer}.json", doc)
    return files


# --- measurement -----------------------------------------------------------------------------------------------


@contextmanager
def bench_lock() -> Iterator[None]:
    """``flock /tmp/pipefisher-bench.lock`` around a timing."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure_rates(path: Path) -> None:
    with bench_lock():
        subprocess.run([sys.executable, "-m", "pipefisher.measure.collectives", "--out", str(path), *COLLECTIVES,
                        "--world", str(STAGES)],
                       cwd=h.REPO, check=True, stdout=subprocess.DEVNULL)


def run_keys(optimizer: str) -> list[str]:
    """train.py keys beside ``strategy=``: the study's factor decay for the K-FAC arms (no cost effect)."""
    if optimizer == "pipefisher":
        return [f"optimizer.factor_decay={DECAY_PER_STEP:g}", "optimizer.factor_decay_per=step"]
    if optimizer == "kfac":
        return [f"optimizer.factor_decay={DECAY_PER_STEP:g}", "optimizer.factor_decay_per=refresh"]
    return []


def run_steps(k: int, steps: int) -> int:
    """Two refresh cycles of warm-up and at least one timed (``cycle_mean_step_s``)."""
    return max(steps, 3 * k)


def measure_round(out: Path, r: int, files: Mapping[str, Path], ks: Mapping[str, int], steps: int,
                  timeout_s: int, doc: dict[str, Any]) -> None:
    """Round ``r`` of the runs, the pairs' order rotated by ``r``; ``doc`` (``measured``, ``measured_k``,
    ``loads``) updated and written after every run."""
    from convergence import cycle_mean_step_s

    keys = list(files)
    doc.setdefault("measured", {k: [] for k in keys})
    doc.setdefault("measured_k", {})
    reference = reference_of(out / f"collectives-round{r}.json")
    if reference is not None:  # the rates' own GPipe step as a train.py run, rotated with the pairs
        keys.append(REFERENCE)
    for key in keys[r % len(keys):] + keys[:r % len(keys)]:
        common = ["eval.every_steps=0", "device=cpu", "progress=false", "wandb.mode=disabled", "log_every=50",
                  "save_final=false"]
        if key == REFERENCE:
            run_dir = out / "runs" / f"round{r}" / REFERENCE
            cmd = [sys.executable, "train.py", *reference_keys(reference), f"steps={run_steps(1, steps)}", *common,
                   f"hydra.run.dir={run_dir}"]
            with bench_lock():
                done = subprocess.run(cmd, cwd=h.REPO, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode:
                raise RuntimeError(f"reference: train.py exited with {done.returncode}:\n{done.stderr[-3000:]}")
            mean, _ = cycle_mean_step_s(h.step_rows(run_dir))
            doc.setdefault("reference_rounds", []).append({**reference, "measured": [mean]})
            print(f"  round {r}: reference (the rates' GPipe step) {mean * 1e3:.1f} ms/step", flush=True)
            continue
        schedule, optimizer = key.split("/")
        run_dir = out / "runs" / f"round{r}" / f"{schedule}-{optimizer}"
        cmd = [sys.executable, "train.py", f"strategy={files[key]}", f"steps={run_steps(ks[key], steps)}",
               *common, *run_keys(optimizer), f"hydra.run.dir={run_dir}"]
        with bench_lock():
            load_before = h.load()
            done = subprocess.run(cmd, cwd=h.REPO, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(f"{key}: train.py exited with {done.returncode}:\n{done.stderr[-3000:]}")
        mean, k = cycle_mean_step_s(h.step_rows(run_dir))
        doc["measured"][key].append(mean)
        doc["measured_k"][key] = k
        doc["loads"].append(load_before)
        print(f"  round {r}: {key} {mean * 1e3:.1f} ms/step (k={k}, {load_before})", flush=True)
        (out / "validation.json").write_text(json.dumps(doc, indent=1) + "\n")


# --- the same pairs interleaved: every pair in the same two processes, step by step --------------------------


def pair_rounds(k: int, at_least: int) -> int:
    """One pair's rounds: the fewest of at least ``at_least`` whose halves each hold whole refresh cycles of its k
    (a multiple of 2k; k=0 counts as 1), so no pair runs more than 2k - 1 rounds past ``at_least`` whatever the
    other pairs' k."""
    unit = 2 * max(1, int(k))
    return unit * max(1, math.ceil(at_least / unit))


def halves(seconds: Sequence[float]) -> list[float]:
    """Mean step of the first and of the second half of a pair's rounds (each half whole refresh cycles when the
    rounds are :func:`pair_rounds`): the measurement twice, from one interleaved run."""
    mid = len(seconds) // 2
    if mid == 0:
        raise ValueError(f"halves: {len(seconds)} round(s); two halves need at least 2")
    return [statistics.fmean(seconds[:mid]), statistics.fmean(seconds[mid:2 * mid])]


def halves_drift(measured: Mapping[str, Sequence[float]]) -> tuple[float, float, float] | None:
    """(median first/second half over the pairs, then each pair's |ratio / that median - 1|: median and largest),
    or None without pairs: the machine's drift during the run, common to all pairs, apart from each pair's noise."""
    ratios = [h[0] / h[1] for h in measured.values() if len(h) == 2 and h[1] > 0]
    if not ratios:
        return None
    common = statistics.median(ratios)
    dev = [abs(x / common - 1) for x in ratios]
    return common, statistics.median(dev), max(dev)


def reference_shape(rates: Mapping[str, Any]) -> dict[str, Any] | None:
    """The step ``measure.collectives`` timed on GPipe (``compute.executor.methods.gpipe``: NVLAMB, synthetic data,
    the file's model) as a shape to run again beside the pairs, with the seconds the file holds for it; None where
    the file has no such step. None of the pairs runs this shape (the file's N is 8, the pairs' 4)."""
    compute = rates.get("compute") or {}
    gpipe = ((compute.get("executor") or {}).get("methods") or {}).get("gpipe") or {}
    if "step_seconds" not in gpipe:
        return None
    return {"model": compute["model"], "vocab_size": compute.get("vocab_size"), "seq_len": compute["seq_len"],
            "max_predictions": compute["max_predictions"], "micro_batch_size": gpipe["micro_batch_size"],
            "micro_batches": gpipe["micro_batches"], "rates_step_s": float(gpipe["step_seconds"]),
            "rates_bookkeeping_s": float(gpipe.get("bookkeeping_seconds") or 0.0)}


def reference_of(rates: Path) -> dict[str, Any] | None:
    """:func:`reference_shape` of the rates file at ``rates``; None where there is no such file."""
    return reference_shape(json.loads(rates.read_text())) if rates.is_file() else None


def reference_keys(shape: Mapping[str, Any]) -> list[str]:
    """train.py's keys for the reference (:func:`reference_shape`): the config ``measure.executor_overhead``'s
    ``pipeline_config`` composes for GPipe at that shape, over ``STAGES`` processes."""
    keys = [f"model={shape['model']}", "pipeline=gpipe", f"stages={STAGES}",
            f"micro_batch_size={shape['micro_batch_size']}", f"num_micro_batches={shape['micro_batches']}",
            f"data.seq_len={shape['seq_len']}", f"data.max_predictions={shape['max_predictions']}", "optimizer=nvlamb"]
    return keys + ([f"model.vocab_size={shape['vocab_size']}"] if shape.get("vocab_size") else [])


def carried(predicted: Mapping[str, Mapping[str, Any]], factor: float) -> dict[str, dict[str, Any]]:
    """``predicted`` with every step (and time to target) times ``factor``: the predictions carried to the speed the
    machine had during the run, as the reference measured it against the rates file (``interleaved_lines``). A
    common factor: it changes no order, only every step error alike."""
    return {k: {**p, "step_s": p["step_s"] * factor,
                **({"time_s": p["time_s"] * factor} if "time_s" in p else {})} for k, p in predicted.items()}


def compose_strategy(path: Path, overrides: Sequence[str]) -> Any:
    """The run config ``train.py strategy=<path> <overrides>`` would validate (the file's keys set first)."""
    from hydra import compose, initialize_config_dir

    from pipefisher.config import register_configs, to_train_config
    from pipefisher.planning.strategy_file import apply_strategy

    register_configs()
    keys = [f"strategy={path}", *overrides]
    with initialize_config_dir(config_dir=str(h._CONF_DIR), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=keys)
    apply_strategy(dcfg, keys)
    return to_train_config(dcfg)


def _interleaved_worker(rank: int, world: int, pairs: list[tuple[str, str, list[str]]], warmup: int,
                        rounds: Mapping[str, int], reference: Mapping[str, Any] | None = None) -> dict[str, Any]:
    import torch

    from pipefisher.runtime.worker import PipelineWorker

    workers = {key: PipelineWorker(compose_strategy(Path(path), overrides), rank, world, torch.device("cpu"))
               for key, path, overrides in pairs}
    if reference is not None:  # the rates file's own GPipe step (reference_shape)
        from pipefisher.measure.executor_overhead import pipeline_config

        cfg = pipeline_config("gpipe", reference["model"], reference["micro_batch_size"], reference["micro_batches"],
                              reference["seq_len"], reference["max_predictions"], world, torch.device("cpu"),
                              reference["vocab_size"])
        workers[REFERENCE] = PipelineWorker(cfg, rank, world, torch.device("cpu"))
    seconds: dict[str, list[float]] = {key: [] for key in workers}
    for key, s, _ in h.timed_rounds(workers, warmup, rounds):
        seconds[key].append(s)
    return {"seconds": seconds, "threads": torch.get_num_threads()}


def measure_interleaved(out: Path, doc: dict[str, Any], at_least: int, warmup: int) -> None:
    """Every pair of ``doc`` (its round-0 strategy files) as a ``PipelineWorker`` in the same ``STAGES`` processes,
    one step each per round in rotated order ([Note: measuring on a shared CPU]); writes per pair the mean step of
    each half of the rounds into ``doc["interleaved"]`` (``train_step`` alone: train.py's bookkeeping is not in it,
    so it is compared with the predictions without bookkeeping). Where ``out/collectives-round0.json`` timed GPipe's
    executor step, that step runs in the rotation too (:func:`reference_shape`), its halves in
    ``doc["interleaved"]["reference"]``: how fast the machine ran during the pairs against when the rates were
    measured (``reference_line``)."""
    keys = sorted(doc["measured"])
    k = {key: int(doc["predicted_rounds"][0][key].get("k") or 1) for key in keys}
    rounds = {key: pair_rounds(k[key], at_least) for key in keys}
    files = {key: out / "search-round0" / "strategies" / f"{key.replace('/', '-')}.json" for key in keys}
    missing = [str(f) for f in files.values() if not f.is_file()]
    if missing:
        raise SystemExit(f"--interleaved: no strategy file {missing[0]} (run --measure into {out} first)")
    pairs = [(key, str(files[key]), [f"steps={warmup + rounds[key] + 1}", "eval.every_steps=0", "device=cpu",
                                     "progress=false", "wandb.mode=disabled", "save_final=false",
                                     *run_keys(key.split("/")[1])]) for key in keys]
    reference = reference_of(out / "collectives-round0.json")
    if reference is not None:  # as many rounds as a pair of k=1: both halves measured alike
        rounds = {**rounds, REFERENCE: pair_rounds(1, at_least)}
    load_before = h.load()
    start = time.perf_counter()
    with bench_lock():
        result = h.launch(_interleaved_worker, STAGES, pairs, warmup, rounds, reference)[0]["result"]
    seconds = dict(result["seconds"])
    ref_seconds = seconds.pop(REFERENCE, None)
    doc["interleaved"] = {"rounds": {key: n for key, n in rounds.items() if key != REFERENCE}, "warmup": warmup,
                          "load_before": load_before, "load_after": h.load(),
                          "threads": result["threads"], "seconds": round(time.perf_counter() - start),
                          "measured": {key: halves(v) for key, v in seconds.items()},
                          "k": k}
    if ref_seconds is not None:
        doc["interleaved"]["reference"] = {**reference, "measured": halves(ref_seconds)}


def without_measured_bookkeeping(doc: Mapping[str, Any], key: str) -> list[dict[str, dict[str, Any]]]:
    """``doc[key]``'s rounds of predictions less the bookkeeping each round's search added to every step (a constant
    per round: its ``predicted_rounds`` step less its ``predicted_no_bookkeeping_rounds`` step); [] where ``doc``
    lacks either."""
    rounds, plain, bare = doc.get(key) or [], doc.get("predicted_rounds") or [], doc.get("predicted_no_bookkeeping_rounds") or []
    if not rounds or len(plain) != len(rounds) or len(bare) != len(rounds):
        return []
    out = []
    for alt, p, b in zip(rounds, plain, bare):
        pair = next(iter(p))
        book = p[pair]["step_s"] - b[pair]["step_s"]
        out.append({k: {**v, "step_s": v["step_s"] - book} for k, v in alt.items()})
    return out


def rounds_text(rounds: int | Mapping[str, int]) -> str:
    """``84 rounds`` (every pair alike, as runs before :func:`pair_rounds` stored it) or ``84-90 rounds per pair``."""
    if isinstance(rounds, int):
        return f"{rounds} rounds"
    lo, hi = min(rounds.values()), max(rounds.values())
    return f"{lo} rounds per pair" if lo == hi else f"{lo}-{hi} rounds per pair"


def _carried_summary(predicted: Mapping[str, Mapping[str, Any]], measured: Mapping[str, Sequence[float]],
                     factor: float) -> tuple[dict[str, Any], float]:
    """:func:`summary` of ``predicted`` carried by ``factor`` (:func:`carried`) against ``measured``, and the median
    step error: what :func:`reference_line` and :func:`reference_halves_line` report."""
    rows = assemble_rows(carried(predicted, factor), measured)
    return summary(rows), statistics.median(r.error for r in rows)


def reference_line(reference: Mapping[str, Any], predicted: Mapping[str, Mapping[str, Any]],
                   measured: Mapping[str, Sequence[float]], where: str = "in the rotation",
                   bookkeeping: bool = False) -> str:
    """The rates file's GPipe step run again beside the pairs (:func:`reference_shape`; ``reference["measured"]``:
    its times there) against the file's own figure (with train.py's bookkeeping where ``bookkeeping``: a train.py
    run's step carries it): the factor by which the machine ran slower (> 1) or faster during the pairs than when
    the rates were measured, and the step goal judged on the predictions carried by it (:func:`carried`). Unlike
    the diagnostic's common factor, it is measured on a shape none of the pairs runs, not fitted to them."""
    again = statistics.fmean(reference["measured"])
    then = reference["rates_step_s"] + (reference.get("rates_bookkeeping_s", 0.0) if bookkeeping else 0.0)
    factor = again / then
    s, median = _carried_summary(predicted, measured, factor)
    return (f"reference: the rates file's GPipe step (NVLAMB, N={reference['micro_batches']}, micro-batch "
            f"{reference['micro_batch_size']}) run again {where} took {again * 1e3:.1f} ms against the file's "
            f"{then * 1e3:.1f} ms ({factor:.3f}: the machine's speed in the run against the "
            f"rates'); the predictions carried by it: worst step error {s['worst_error']:+.1%} ({s['worst_pair']}), "
            f"{s['within_goal']} of {s['pairs']} within {GOAL_STEP_ERROR:.0%}, median {median:+.1%} (Spearman unchanged)")


def reference_halves_line(reference: Mapping[str, Any], predicted: Mapping[str, Mapping[str, Any]],
                          measured: Mapping[str, Sequence[float]]) -> str:
    """:func:`reference_line` half by half: each half's predictions carried by the reference's time in that half,
    against the pairs' steps of the same half, with the reference's drift between its halves beside the pairs'
    (:func:`halves_drift`). Where the reference drifts otherwise than the pairs, its factor does not carry the
    machine's speed to them, and the mean's verdict is not decided by it."""
    parts = []
    for half, name in enumerate(("first", "second")):
        factor = reference["measured"][half] / reference["rates_step_s"]
        s, median = _carried_summary(predicted, {k: [v[half]] for k, v in measured.items() if len(v) == 2}, factor)
        parts.append(f"{name} half {factor:.3f}: {s['within_goal']} of {s['pairs']} within {GOAL_STEP_ERROR:.0%}, worst "
                     f"{s['worst_error']:+.1%} ({s['worst_pair']}), median {median:+.1%}")
    line = "reference half by half (each half's factor against that half's steps): " + "; ".join(parts)
    drift = halves_drift(measured)
    if drift:
        line += (f"; first / second half: the reference {reference['measured'][0] / reference['measured'][1]:.3f}, "
                 f"the pairs {drift[0]:.3f} (median)")
    return line


def interleaved_lines(doc: Mapping[str, Any]) -> list[str]:
    """The interleaved measurement against the predictions without bookkeeping (and with it), and against itself."""
    il = doc["interleaved"]
    predicted = median_prediction(doc.get("predicted_no_bookkeeping_rounds") or doc["predicted_rounds"])
    rows = assemble_rows(predicted, il["measured"], doc.get("builtin"))  # k: the plan's, not read back from the run
    s = summary(rows)
    lines = [f"interleaved: every pair in the same {doc.get('stages', 2)} processes, one step each per round in rotated "
             f"order, {rounds_text(il['rounds'])} after {il['warmup']} (whole refresh cycles), {il['seconds']} s, "
             f"{il['load_before']} before, {il['load_after']} after; a pair's step = the mean of each half, their "
             "mean; predicted without train.py's bookkeeping (the harness times train_step alone)", ""]
    lines += table_lines(rows)
    lines += ["", f"interleaved: Spearman {s['spearman']:.3f} (goal >= {GOAL_SPEARMAN}: "
                  f"{'met' if s['spearman_met'] else 'not met'}"
                  + (f"; {s['spearman_builtin']:.3f} with the built-in keys, steps far off: the calibration's steps "
                     "order most pairs" if "spearman_builtin" in s else "") + f"), worst step error {s['worst_error']:+.1%} "
                  f"({s['worst_pair']}; goal within {GOAL_STEP_ERROR:.0%}: {'met' if s['step_error_met'] else 'not met'}), "
                  f"{s['within_goal']} of {s['pairs']} within {GOAL_STEP_ERROR:.0%}, median step error "
                  f"{statistics.median(r.error for r in rows):+.1%}"]
    with_book = assemble_rows(median_prediction(doc["predicted_rounds"]), il["measured"])
    wb = summary(with_book)
    lines.append(f"interleaved against the predictions with the bookkeeping: Spearman {wb['spearman']:.3f}, worst "
                 f"{wb['worst_error']:+.1%}, {wb['within_goal']} of {wb['pairs']} within {GOAL_STEP_ERROR:.0%}, median "
                 f"{statistics.median(r.error for r in with_book):+.1%}")
    for key, how in REPRICINGS:  # the pricings that carry the bookkeeping, less it
        alt = without_measured_bookkeeping(doc, key) if key in WITH_BOOKKEEPING else []
        if alt:
            alt_rows = assemble_rows(median_prediction(alt), il["measured"])
            a = summary(alt_rows)
            lines.append(f"interleaved against the predictions {how}: Spearman {a['spearman']:.3f}, worst "
                         f"{a['worst_error']:+.1%} ({a['worst_pair']}), {a['within_goal']} of {a['pairs']} within "
                         f"{GOAL_STEP_ERROR:.0%}, median {statistics.median(r.error for r in alt_rows):+.1%} "
                         f"({decompose(alt_rows)['within_after_common']} within {GOAL_STEP_ERROR:.0%} over its "
                         "common factor)")
    if il.get("reference"):
        lines.append(reference_line(il["reference"], predicted, il["measured"]))
        lines.append(reference_halves_line(il["reference"], predicted, il["measured"]))
    if len(rows) >= 2:  # the rates were measured minutes before the interleaved run: a drift moves every pair alike
        lines.append(diagnostic_line(rows, "interleaved"))
    ceiling, spread = round_spearman(rows), round_spread(rows)
    if ceiling and spread:
        lines.append(f"interleaved against itself (first half of the rounds against the second): Spearman "
                     f"{ceiling[0]:.3f}; a pair's halves differ by {spread[0]:.1%} (median over {spread[2]} pairs; "
                     f"largest {spread[1]:.1%})")
    drift = halves_drift(il["measured"])
    if drift:
        lines.append(f"first half / second half of every pair: median {drift[0]:.3f} (a drift of the machine common to "
                     f"all pairs: it moves every step, not their order); each pair's halves over that: median "
                     f"{drift[1]:.1%}, largest {drift[2]:.1%} (the pairs' own noise)")
    if doc.get("measured"):
        runs = assemble_rows(predicted, doc["measured"])
        both = [(r, x) for r in runs for x in rows if (r.schedule, r.optimizer) == (x.schedule, x.optimizer)]
        lines.append(f"interleaved against the separate train.py runs (same pairs): Spearman "
                     f"{spearman([a.measured_time_s for a, _ in both], [b.measured_time_s for _, b in both]):.3f}, "
                     f"their steps / interleaved median {statistics.median(a.measured_s / b.measured_s for a, b in both):.3f}")
    return lines


# --- which cost is mispriced: the search's costs beside a profile's, taken back to back -----------------------

PROFILE_KEYS = [*MODEL, "stages=2", "pipeline=chimera", "micro_batch_size=8", "num_micro_batches=4", "steps=8",
                "profile.warmup_steps=2"]


def _kfac_mean(table: Sequence[Sequence[int]]) -> float:
    values = [x for row in table for x in row]
    return statistics.fmean(values) if values else float("nan")


def cost_rows(predicted: Any, profiled: Any) -> list[list[Any]]:
    """(cost, search ms, profiled ms, search / profiled) per cost kind of two ``CostModel``s of one run: F and B per
    stage, STEP, the gradient sync per stage, a message, and the K-FAC units (mean over layers)."""
    out = []

    def row(name: str, a: float, b: float) -> None:
        out.append([name, a / 1e6, b / 1e6, a / b if b else float("nan")])

    for s, (a, b) in enumerate(zip(predicted.forward_ns, profiled.forward_ns)):
        row(f"F stage {s}", a, b)
    for s, (a, b) in enumerate(zip(predicted.backward_ns, profiled.backward_ns)):
        row(f"B stage {s}", a, b)
    row("STEP", predicted.step_ns, profiled.step_ns)
    for s, (a, b) in enumerate(zip(predicted.sync_ns, profiled.sync_ns)):
        row(f"SYNC_GRAD stage {s}", a, b)
    row("message (p2p)", predicted.p2p_ns, profiled.p2p_ns)
    for name in ("curv_a_ns", "curv_b_ns", "invert_ns", "sync_factor_ns"):
        a, b = _kfac_mean(getattr(predicted, name)), _kfac_mean(getattr(profiled, name))
        if a == a and b == b:
            row(f"{name[:-3].upper()} (mean per layer)", a, b)
    if predicted.precond_ns and profiled.precond_ns:
        for s, (a, b) in enumerate(zip(predicted.precond_ns, profiled.precond_ns)):
            row(f"PRECOND stage {s}", a, b)
    return out


def diagnose(out: Path, optimizers: Sequence[str] = ("kfac", "muon")) -> dict[str, Any]:
    """Under the lock, back to back: the rates (``measure.collectives``), then ``profile.py`` of chimera pp=2 at the
    study's shape per optimizer; the search's cost model of that run (``pipeline_costs`` with those rates, K-FAC
    units included) beside ``costs_from_profile``. Writes ``out/diagnose.json``."""
    from pipefisher.model.config import BertConfig
    from pipefisher.planning.comm_costs import CommCosts
    from pipefisher.planning.costs import RunShape, costs_from_profile
    from pipefisher.planning.strategy_search import pipeline_costs
    from pipefisher.profiling import read_profile

    bert = BertConfig(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512, vocab_size=8192)
    run = RunShape(bert, "chimera", 2, 4, 8, 1, 1, 64, 10)
    doc: dict[str, Any] = {"hardware": _hardware(), "uptime_before": _uptime(), "profiles": {}}
    for opt in optimizers:
        rates = out / f"diagnose-collectives-{opt}.json"
        prof_dir = out / f"diagnose-profile-{opt}"
        with bench_lock():
            load = h.load()
            subprocess.run([sys.executable, "-m", "pipefisher.measure.collectives", "--out", str(rates), *COLLECTIVES],
                           cwd=h.REPO, check=True, stdout=subprocess.DEVNULL)
            done = subprocess.run([sys.executable, "profile.py", "device=cpu", "progress=false", "wandb.mode=disabled",
                                   *PROFILE_KEYS, f"optimizer={opt}", f"hydra.run.dir={prof_dir}"],
                                  cwd=h.REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"profile.py optimizer={opt} failed:\n{done.stderr[-3000:]}")
        comm = CommCosts.from_json(rates)
        hw = comm.hardware_for(8)
        schedule = run.build_schedule(dp_width=1)
        # the K-FAC units as the search plans with them: the FLOP estimate, CURV/PRECOND at the measured unit rates
        # and the factor all-reduces by the measured collectives where the file has them (hybrid_costs)
        search = pipeline_costs(run, hw, comm, schedule=schedule, optimizer=opt if opt == "muon" else "nvlamb")
        profile = read_profile(prof_dir / "profile.sqlite")
        measured = costs_from_profile(profile, run, path=prof_dir / "profile.sqlite")
        doc["profiles"][opt] = {"load": load, "rates": comm.describe(), "rows": cost_rows(search, measured)}
        print(f"  diagnose {opt} ({load}):", flush=True)
        print(h.table(["cost", "search ms", "profiled ms", "search / profiled"], doc["profiles"][opt]["rows"]),
              flush=True)
    doc["uptime_after"] = _uptime()
    (out / "diagnose.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# --- goal 2: the search's top pick, trained to the held-out target ----------------------------------------------

STUDY_LR = {"nvlamb": 5e-3, "adamw": 1e-3, "muon": 2e-3, "kfac": 5e-3, "pipefisher": 5e-3}  # 07-convergence.md picks
STUDY_DAMPING = 1e-3
STUDY_STEPS = 2000  # the calibration's one schedule: its lr decays to step 2000
HELDOUT_SEQUENCES = 768  # the study's held-out set (eval_batches 24 x micro-batch 32)
EVAL_EVERY = 50


def time_at_steps(rows: Sequence[Mapping[str, Any]], steps: float) -> float:
    """Training seconds (the sum of ``step_time_s``, evaluations left out) of the first ``steps`` steps, the last
    step counted in proportion where ``steps`` is fractional (an interpolated steps-to-target)."""
    whole = int(steps)
    times = [float(r["step_time_s"]) for r in rows if "step_time_s" in r]
    if len(times) < math.ceil(steps):
        raise ValueError(f"{len(times)} step rows do not cover {steps:g} steps")
    extra = (steps - whole) * times[whole] if steps > whole else 0.0
    return sum(times[:whole]) + extra


def top_pick(out: Path, timeout_s: int, text_dir: Path) -> dict[str, Any]:
    """Search (rates measured now), run the top pick with ``train.py strategy=`` on the study's data (WikiText-2,
    prepared as bench/convergence.py prepares it) with held-out evaluation every 50 steps, stop once an evaluation
    is at or below H-0.3, and compare the training time to the target with the prediction. Writes
    ``out/top_pick.json``."""
    import argparse as ap
    import os
    import signal

    import convergence as cv
    import convergence_analysis as ca

    data = cv.prepare(ap.Namespace(text_dir=text_dir, cache_dir=h.REPO / "bench" / ".cache" / "convergence",
                                   seq_len=64, max_predictions=10, vocab_size=8192, dupe_factor=3, dry_run=False))
    if data is None:
        raise SystemExit(f"{text_dir}: the study's text (train.txt, valid.txt) is missing; give --text-dir")
    target = data.unigram - 0.3
    rates = out / "top-collectives.json"
    measure_rates(rates)
    predicted, search = predict(out / "top-search", [f"comm_costs={rates}"])
    strategy = json.loads(Path(search["strategy"]).read_text())
    opt, mbs = strategy["optimizer"], strategy["micro_batch_size"]
    cmd = [sys.executable, "train.py", f"strategy={search['strategy']}", "data=hdf5", f"data.path={data.train}",
           f"data.eval_path={data.heldout}", "data.seq_len=64", "data.max_predictions=10", f"steps={STUDY_STEPS}",
           f"eval.every_steps={EVAL_EVERY}", f"eval.batches={HELDOUT_SEQUENCES // mbs}", f"lr={STUDY_LR[opt]:g}",
           "seed=0", "device=cpu", "progress=false", "wandb.mode=disabled", "log_every=50", "save_final=false",
           *run_keys(opt), *([f"optimizer.damping={STUDY_DAMPING:g}"] if opt in ("kfac", "pipefisher") else []),
           f"hydra.run.dir={out / 'top-run'}"]
    doc: dict[str, Any] = {"hardware": _hardware(), "uptime_before": _uptime(), "strategy": search["strategy"],
                           "top": search["top"], "heldout_entropy": data.unigram, "target": target,
                           "predicted_step_s": strategy["predicted"]["step_time_s"],
                           "predicted_time_s": strategy["predicted"].get("time_to_target_s"),
                           "steps_multiplier": strategy["predicted"].get("steps_multiplier"),
                           "command": " ".join(cmd), "loads": []}
    print(f"top pick: {search['top']}; target {target:.3f} (H {data.unigram:.3f}); predicted "
          f"{doc['predicted_time_s']:.0f} s; $ {doc['command']}", flush=True)
    with bench_lock():
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=h.REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        reached = None
        while proc.poll() is None and time.monotonic() - start < timeout_s:
            time.sleep(5)
            doc["loads"].append(h.load())
            rows = h.step_rows(out / "top-run")
            reached = ca.steps_to_target(ca.eval_curve(rows), target)
            if reached is not None:
                doc["wall_to_eval_s"] = time.monotonic() - start
                os.killpg(proc.pid, signal.SIGTERM)
                break
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    rows = h.step_rows(out / "top-run")
    doc["uptime_after"] = _uptime()
    doc["curve"] = ca.eval_curve(rows)
    if reached is None:
        doc["reached"] = None
    else:
        doc["reached"] = reached
        doc["measured_time_s"] = time_at_steps(rows, reached)
        doc["measured_step_s"] = doc["measured_time_s"] / reached
        doc["calibration_steps"] = doc["predicted_time_s"] / doc["predicted_step_s"]
        doc["error"] = doc["predicted_time_s"] / doc["measured_time_s"] - 1
    (out / "top_pick.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _load_range(loads: Sequence[str], when: str) -> str:
    """``1-min load average <when>: min-max, median N`` of ``h.load()`` lines."""
    values = [float(x.split()[1]) for x in loads]
    return (f"1-min load average {when}: {min(values):.1f}-{max(values):.1f}, median {statistics.median(values):.1f} "
            f"on {loads[0].split()[-2]} cores") if values else ""


def top_pick_lines(doc: Mapping[str, Any]) -> list[str]:
    lines = [f"top pick (goal 2): {doc['top']}; `{doc['command']}`", f"hardware: {doc['hardware']}",
             f"uptime before: {doc['uptime_before']}; after: {doc['uptime_after']}",
             _load_range(doc.get("loads", []), "while it trained (every 5 s)")]
    if doc.get("reached") is None:
        lines.append(f"did not reach {doc['target']:.3f} (last evaluations {doc['curve'][-3:]})")
        return lines
    lines.append(h.table(["", "steps to H-0.3", "step ms", "time to H-0.3 s"], [
        ["predicted (calibration x search)", f"{doc['calibration_steps']:.0f}", f"{doc['predicted_step_s'] * 1e3:.1f}",
         f"{doc['predicted_time_s']:.0f}"],
        ["measured (this run, seed 0)", f"{doc['reached']:.0f}", f"{doc['measured_step_s'] * 1e3:.1f}",
         f"{doc['measured_time_s']:.0f} (training; {doc['wall_to_eval_s']:.0f} wall with evaluations)"]]))
    lines.append(f"predicted / measured time - 1: {doc['error']:+.1%} (goal within 10 %: "
                 f"{'met' if abs(doc['error']) <= 0.10 else 'not met'}); of it steps "
                 f"{doc['calibration_steps'] / doc['reached'] - 1:+.1%}, step {doc['predicted_step_s'] / doc['measured_step_s'] - 1:+.1%}")
    return lines


# --- report ----------------------------------------------------------------------------------------------------


#: documents' alternative predictions of the same runs, and how each was priced (report lines)
def without_muon_factor(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without the Muon steps the executor ran (``compute.executor.muon``), so
    the search prices Muon's step by its model alone ([Note: Muon step factor])."""
    out = json.loads(json.dumps(doc))
    (out.get("compute", {}).get("executor") or {}).pop("muon", None)
    return out


def without_ns_rate(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A ``measure.collectives`` document without the measured Newton–Schulz rate (``compute.newton_schulz``), so
    the search prices Muon's orthogonalization at the model's forward + backward FLOP rate, as before it was
    measured."""
    out = json.loads(json.dumps(doc))
    out.get("compute", {}).pop("newton_schulz", None)
    return out


REPRICINGS = (
    ("predicted_kfac_units_rounds", "with K-FAC's measured unit rates (compute.kfac_in_search)"),
    ("predicted_flop_rate_rounds", "without the per-piece times (each stage's FLOPs at the whole model's rate, split "
                                   "by the forward share)"),
    ("predicted_no_overhead_rounds", "without the executor's terms (compute.executor: its overhead per action and, "
                                     "where measured, the per-schedule factors)"),
    ("predicted_no_schedule_factor_rounds", "without the per-schedule executor factors (compute.executor.methods)"),
    ("predicted_no_kfac_factor_rounds", "without the K-FAC unit factor (compute.executor.kfac)"),
    ("predicted_no_muon_factor_rounds", "without the Muon step factor (compute.executor.muon)"),
    ("predicted_no_ns_rate_rounds", "without the measured Newton-Schulz rate (compute.newton_schulz: Muon's "
                                    "orthogonalization at the model's FLOP rate)"),
    ("predicted_no_bookkeeping_rounds", "without train.py's bookkeeping per step (compute.executor.bookkeeping_seconds)"),
    # files written at 695ee81-8e2b352, when the search used the share and K-FAC unit rates by default
    ("predicted_legacy_rounds", "without the measured forward share and K-FAC unit rates (B = 2F, K-FAC at the "
                                "model's rate)"),
)


#: each repricing measured with the rates: its key, its files' suffix, the rates file it searches
REPRICE_FILES = (
    ("predicted_kfac_units_rounds", "kfac-units", with_kfac_units_in_search),
    ("predicted_flop_rate_rounds", "flop-rate", without_pieces),
    ("predicted_no_overhead_rounds", "no-overhead", without_executor_overhead),
    ("predicted_no_schedule_factor_rounds", "no-schedule-factor", without_executor_methods),
    ("predicted_no_kfac_factor_rounds", "no-kfac-factor", without_kfac_factor),
    ("predicted_no_muon_factor_rounds", "no-muon-factor", without_muon_factor),
    ("predicted_no_ns_rate_rounds", "no-ns-rate", without_ns_rate),
    ("predicted_no_bookkeeping_rounds", "no-bookkeeping", without_bookkeeping),
)


#: the repricings whose searches add train.py's bookkeeping (the no-overhead one drops compute.executor whole)
WITH_BOOKKEEPING = ("predicted_kfac_units_rounds", "predicted_flop_rate_rounds", "predicted_no_schedule_factor_rounds",
                    "predicted_no_kfac_factor_rounds", "predicted_no_muon_factor_rounds", "predicted_no_ns_rate_rounds")


def restep(doc: Mapping[str, Any], calibration: Any, loss: float) -> dict[str, Any]:
    """``doc`` with every pair's steps to the target taken from another calibration at held-out ``loss``: its
    reference's steps × the optimizer's multiplier at the pair's k (PipeFisher: its plan's, when_ready, as
    ``train.py optimizer=pipefisher`` runs it). The steps are the same number on the predicted and the measured side,
    so the step errors do not move; the order does. Pairs of an optimizer the calibration has no entry for (AdamW in
    study 18's) are left out of every table, and listed under ``"unpriced"``.

    Raises:
        CalibrationError: ``loss`` outside the calibration's range (names it).
    """
    ref = calibration.steps_to(loss, field="--target-loss")
    out = json.loads(json.dumps(doc))
    unpriced: set[str] = set()

    def steps_of(key: str, row: Mapping[str, Any]) -> float | None:
        optimizer = key.split("/")[1]  # the search's optimizer names are the calibration's; k is the row's interval
        promote = "when_ready" if optimizer == "pipefisher" else None
        m = calibration.steps_multiplier(optimizer, row.get("k"), loss, promote)
        return None if m is None else ref * m[0]

    def reprice(rows: dict[str, Any]) -> None:
        for key in list(rows):
            steps = steps_of(key, rows[key])
            if steps is None:
                unpriced.add(key)
                del rows[key]
            else:
                rows[key]["steps"] = steps
                rows[key]["time_s"] = steps * rows[key]["step_s"]

    for name in ("predicted", "builtin"):
        if out.get(name):
            reprice(out[name])
    for name, value in list(out.items()):
        if name.startswith("predicted") and name.endswith("rounds"):
            for rows in value:
                reprice(rows)
    out["unpriced_measured"] = {k: v for k, v in out.get("measured", {}).items() if k in unpriced}  # the noise check
    for measured in [out.get("measured", {}), (out.get("interleaved") or {}).get("measured", {})]:
        for key in [k for k in measured if k in unpriced]:
            del measured[key]
    out["unpriced"] = sorted(unpriced)
    out["steps_from"] = f"{calibration.describe()}; at held-out loss {loss:g} ({calibration.reference}'s steps {ref:.0f})"
    return out


def report(doc: Mapping[str, Any]) -> str:
    rows = assemble_rows(doc["predicted"], doc["measured"], doc.get("builtin"), doc.get("measured_k"))
    s = summary(rows)
    loads = doc.get("loads", [])
    lines = [f"hardware: {doc['hardware']}", f"command: `{doc['command']}`",
             f"uptime before: {doc.get('uptime_before', '?')}; after: {doc.get('uptime_after', '?')}",
             _load_range(loads, "at the runs' starts"),
             "rates measured here (the search's comm_costs):", *[f"- {x}" for x in doc.get("rates", [])], ""]
    if doc.get("steps_from"):
        lines[1:1] = [f"steps to the target: {doc['steps_from']}"
                      + (f"; not calibrated, left out: {', '.join(doc['unpriced'])}" if doc.get("unpriced") else "")]
    lines += table_lines(rows)
    lines.append("")
    if "spearman" in s:
        lines.append(f"Spearman (predicted vs measured time to H-0.3, {s['pairs']} pairs): {s['spearman']:.3f} with "
                     f"measured rates (goal >= {GOAL_SPEARMAN}: {'met' if s['spearman_met'] else 'not met'})"
                     + (f", {s['spearman_builtin']:.3f} with the built-in keys" if "spearman_builtin" in s else ""))
    if rows:
        lines.append(f"worst step error: {s['worst_error']:+.1%} ({s['worst_pair']}; goal within "
                     f"{GOAL_STEP_ERROR:.0%}: {'met' if s['step_error_met'] else 'not met'}); {s['within_goal']} of "
                     f"{s['pairs']} pairs within {GOAL_STEP_ERROR:.0%}; median step error "
                     f"{statistics.median(r.error for r in rows):+.1%}"
                     + (f"; built-in keys: worst {s['worst_error_builtin']:+.0%} ({s['worst_pair_builtin']})"
                        if "worst_error_builtin" in s else ""))
        lines.append(f"steps to H-0.3 are the calibration's for both columns, so these ranks order step time x each "
                     f"optimizer's steps ({', '.join(sorted({f'{r.optimizer} {r.steps:.0f}' for r in rows}))})")
    for r in range(len(doc.get("predicted_rounds", []))) if len(doc.get("predicted_rounds", [])) > 1 else ():
        rr = round_rows(doc, r)
        if len(rr) >= 3:
            sr = summary(rr)
            lines.append(f"round {r} alone (its own rates against its own runs, {len(rr)} pairs): Spearman "
                         f"{sr['spearman']:.3f}, median step error {statistics.median(x.error for x in rr):+.0%}, "
                         f"worst {sr['worst_error']:+.0%} ({sr['worst_pair']}), {sr['within_goal']} within 10 %")
    for key, how in REPRICINGS:  # the same runs priced another way from the same rates files
        if doc.get(key):
            alt_rows = assemble_rows(median_prediction(doc[key]), doc["measured"])
            alt = summary(alt_rows)
            if "spearman" in alt:
                lines.append(f"the same runs priced {how}: Spearman {alt['spearman']:.3f}, worst step error "
                             f"{alt['worst_error']:+.1%} ({alt['worst_pair']}), {alt['within_goal']} of {alt['pairs']} "
                             f"within {GOAL_STEP_ERROR:.0%}, median step error "
                             f"{statistics.median(r.error for r in alt_rows):+.1%}")
    every_run = {**doc["measured"], **doc.get("unpriced_measured", {})}  # AdamW's runs count here even if unpriced
    twins = twin_spread([Row(*key.split("/"), 1.0, 1.0, statistics.median(v), tuple(v))
                         for key, v in every_run.items() if v])
    if twins:
        lines.append("NVLAMB / AdamW measured step - 1 (the same pipeline, priced equal): " + ", ".join(
            f"{k} {v:+.0%}" for k, v in twins.items()) + f"; median |.| {statistics.median(abs(v) for v in twins.values()):.0%}"
            " (the measurement's noise on this machine)")
    ceiling = round_spearman(rows)
    if ceiling:
        lines.append(f"Spearman of round 0's measured times against round 1's ({ceiling[1]} pairs): {ceiling[0]:.3f} "
                     "(the measurement against itself: the ceiling for any prediction here)")
    spread = round_spread(rows)
    if spread:
        lines.append(f"the same pair's rounds differ by {spread[0]:.0%} (median over {spread[2]} pairs; largest "
                     f"{spread[1]:.0%}): the measurement's noise on this machine, against the goal's 10 %")
    if doc.get("reference_rounds"):  # each round against its own rates file; the median of those factors
        refs = doc["reference_rounds"]
        factors = [statistics.fmean(x["measured"]) / (x["rates_step_s"] + x.get("rates_bookkeeping_s", 0.0))
                   for x in refs]
        i = sorted(range(len(refs)), key=lambda j: factors[j])[(len(refs) - 1) // 2]
        lines.append(reference_line(refs[i], doc["predicted"], doc["measured"],
                                    f"as a train.py run (round {i} of {len(refs)}: the median factor)", bookkeeping=True))
    if len(rows) >= 2:
        lines.append(diagnostic_line(rows))
    if doc.get("search_top"):
        lines.append(f"the search's top pick over world {doc.get('stages', 2)} (measured rates): {doc['search_top']}")
    if doc.get("same_schedules"):
        lines.append("measured once: " + "; ".join(f"{m} = {o}" for m, o in doc["same_schedules"].items())
                     + f" (the same action lists at pp={doc.get('stages', 2)}, 4 micro-batches: the same executor work)")
    if doc.get("refused"):
        lines.append(f"refused by the search at pp={doc.get('stages', 2)}: " + "; ".join(f"{k}: {v}" for k, v in doc["refused"].items()))
    if doc.get("interleaved"):
        lines += ["", *interleaved_lines(doc)]
    return "\n".join(lines) + "\n"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--measure", action="store_true", help="measure the rates, predict, run every pair (minutes)")
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK_PAIRS)} pairs only")
    p.add_argument("--pairs", default="", help="schedule/optimizer,... (default: every pair, or --quick's)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stages", type=int, default=2, choices=(2, 4),
                   help="D: pp=D, one pipeline, D worker processes (4: on a machine of at least 4 cores)")
    p.add_argument("--steps", type=int, default=12, help="steps per run (K-FAC refresh cycles: at least 4k)")
    p.add_argument("--timeout-s", type=int, default=600)
    p.add_argument("--top-pick", action="store_true",
                   help="goal 2: train the search's top pick to H-0.3 on WikiText-2 (--timeout-s bounds it)")
    p.add_argument("--text-dir", type=Path, default=Path("/work/shared/data/wikitext-2"),
                   help="--top-pick: WikiText-2's train.txt and valid.txt")
    p.add_argument("--diagnose", action="store_true",
                   help="the search's cost of each action beside a profile's (chimera pp=2, kfac and muon), back to back")
    p.add_argument("--calibration", type=Path, default=None,
                   help=f"steps from this calibration file (default {CALIBRATION.name}): the search's with --measure; "
                        "on a DIR measured before, its pairs' steps repriced (the step errors do not change)")
    p.add_argument("--target-loss", type=float, default=TARGET_LOSS, help="held-out loss of the target (H-0.3: 6.24)")
    p.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                   help="after --measure (or on a DIR it filled): every pair again in the same processes, one step "
                        "each per round, at least ROUNDS rounds of whole refresh cycles (e.g. 84: the measurement's "
                        "noise drops from separate runs' ~10 %% to ~2 %%, so the goals can be decided)")
    args = p.parse_args()
    global STAGES
    STAGES = args.stages
    calibration = None
    if args.calibration is not None or args.target_loss != TARGET_LOSS:  # checked before any minute is spent
        calibration, _ = h.read_calibration_for(args.calibration or CALIBRATION, [args.target_loss])
        SEARCH[-2:] = [f"calibration={args.calibration or CALIBRATION}", f"target_loss={args.target_loss}"]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = args.out / "validation.json"
    if args.top_pick:
        top_pick(args.out, args.timeout_s, args.text_dir)
    if args.diagnose:
        diagnose(args.out)
    if args.measure:
        pairs = pairs_of(args.quick, args.pairs, STAGES)
        doc: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "hardware": _hardware(),
                               "uptime_before": _uptime(), "loads": [], "rounds": args.rounds, "steps": args.steps,
                               "rates": [], "predicted_rounds": [], "same_schedules": same_schedules(STAGES),
                               "stages": STAGES}
        doc["builtin"], _ = predict(args.out / "search-builtin", BUILTIN_KEYS)
        files: dict[str, Path] = {}
        for r in range(args.rounds):  # the rates measured again before every round: the load moves them
            from pipefisher.planning.comm_costs import CommCosts

            rates = args.out / f"collectives-round{r}.json"
            measure_rates(rates)
            doc["rates"].append(f"round {r} ({h.load()}): {CommCosts.from_json(rates).describe()}")
            keys = [f"comm_costs={rates}"]
            predicted, search = predict(args.out / f"search-round{r}", keys)
            missing = [f"{s}/{o}" for s, o in pairs if f"{s}/{o}" not in predicted]
            if missing and not args.pairs and r == 0:  # every pair: those the search refuses at this D are reported
                pairs = [(s, o) for s, o in pairs if f"{s}/{o}" in predicted]
                missing = []
            if missing:
                raise SystemExit(f"the search has no pp={STAGES} row for {', '.join(missing)}: "
                                 + "; ".join(f"{k}: {search['refused'].get(k, '?')}" for k in missing))
            doc["predicted_rounds"].append(predicted)
            # the same rates priced other ways (one term taken out or K-FAC's unit rates put in), against the same
            # runs: what each term changes, with the measurement held fixed
            for key, suffix, transform in REPRICE_FILES:
                alt = args.out / f"collectives-round{r}-{suffix}.json"
                alt.write_text(json.dumps(transform(json.loads(rates.read_text()))))
                doc.setdefault(key, []).append(
                    predict(args.out / f"search-round{r}-{suffix}", [f"comm_costs={alt}"])[0])
            if r == 0:  # what runs: round 0's search (PipeFisher's plan from its rates)
                doc.update(search_top=search["top"], refused=search["refused"], search_text=search["text"])
                files = write_strategies(args.out / f"search-round{r}", keys, pairs)
            doc["predicted"] = median_prediction(doc["predicted_rounds"])
            measure_round(args.out, r, files, {k: doc["predicted_rounds"][0][k]["k"] for k in files}, args.steps,
                          args.timeout_s, doc)
        doc["uptime_after"] = _uptime()
        path.write_text(json.dumps(doc, indent=1) + "\n")
    if args.interleaved:
        if not path.is_file():
            raise SystemExit(f"--interleaved: {path} missing; run --measure into {args.out} first")
        doc = json.loads(path.read_text())
        measure_interleaved(args.out, doc, args.interleaved, warmup=4)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    parts = []
    if (args.out / "top_pick.json").is_file():
        parts.append("\n".join(top_pick_lines(json.loads((args.out / "top_pick.json").read_text()))))
    if (args.out / "diagnose.json").is_file():
        diag = json.loads((args.out / "diagnose.json").read_text())
        parts += [f"diagnose {opt} ({p['load']}; {p['rates']}):\n" + h.table(
            ["cost", "search ms", "profiled ms", "search / profiled"], p["rows"]) for opt, p in diag["profiles"].items()]
    if not path.is_file():
        print("\n\n".join(parts))
        return
    doc = json.loads(path.read_text())
    name = "validation.md"
    if calibration is not None:  # the pairs' steps from this calibration (uncalibrated optimizers left out)
        doc = restep(doc, calibration, args.target_loss)
        name = f"validation-{Path(args.calibration or CALIBRATION).stem}-{args.target_loss:g}.md"
    text = "\n\n".join([report(doc), *parts])
    (args.out / name).write_text(text)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s)")


def _hardware() -> str:
    from pipefisher.hardware import describe_hardware

    return describe_hardware()


if __name__ == "__main__":
    h.main_guard(main)
