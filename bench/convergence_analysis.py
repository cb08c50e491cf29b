"""The convergence study's pure parts: targets, steps to target, seed intervals, separation, the
step-cost composition, hyper-parameter picks and the plan of runs (no training run here).

``bench/convergence.py`` runs what :func:`plan_runs` asks for and reports with the rest;
``tests/test_convergence_bench.py`` tests each piece against hand-computed cases.

[Note: what a target means]
A target is a held-out MLM loss (``eval_mlm_loss`` of the run's evaluations, the same held-out
micro-batches for every run) below the unigram entropy of the held-out masked labels: ``H − d``
for each drop ``d``. A run reaches it at the first evaluation at or below it; the step count is
interpolated linearly between that evaluation and the one before (evaluations are ``every`` steps
apart, so an unreached target is "not reached", never the run's length). No target is derived from
any arm's own curve.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# --- targets ----------------------------------------------------------------------------------


def unigram_entropy(labels: np.ndarray) -> float:
    """Entropy in nats of the empirical distribution of ``labels``: the held-out MLM loss of a
    model that knew the held-out token frequencies and nothing else."""
    counts = np.bincount(np.asarray(labels).ravel().astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_cross_entropy(heldout: np.ndarray, train: np.ndarray, vocab_size: int, alpha: float = 0.5) -> float:
    """Cross-entropy in nats of the held-out labels under the training labels' frequencies (add-``alpha``
    smoothed): what a model that learned only the training unigram scores on held-out text."""
    counts = np.bincount(np.asarray(train).ravel().astype(np.int64), minlength=vocab_size)[:vocab_size] + alpha
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(heldout).ravel().astype(np.int64)].mean())


def masked_labels(shards: Sequence[Path]) -> np.ndarray:
    """The masked-token labels of NVIDIA-format shards (positions > 0; position 0 is [CLS], padding)."""
    import h5py

    out = []
    for path in shards:
        with h5py.File(path, "r") as f:
            ids, pos = np.asarray(f["masked_lm_ids"]), np.asarray(f["masked_lm_positions"])
        out.append(ids[pos > 0])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def targets_below(unigram: float, drops: Sequence[float]) -> dict[str, float]:
    """``{"H-0.5": H - 0.5, ...}`` for each drop in nats (positive, ascending order kept)."""
    if any(not d > 0 for d in drops):
        raise ValueError(f"target drops {list(drops)}: each must be a positive number of nats below the unigram entropy")
    return {f"H-{d:g}": unigram - d for d in drops}


# --- curves -----------------------------------------------------------------------------------


def eval_curve(rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """``(steps done, held-out MLM loss)`` of each evaluation in a run's step rows (``step`` counts from
    0, so the evaluation after step ``s`` is at ``s + 1`` steps); a non-finite or missing loss is NaN."""
    curve = []
    for r in rows:
        if "eval_mlm_loss" in r and "step" in r:
            v = r["eval_mlm_loss"]
            curve.append((int(r["step"]) + 1, math.nan if v is None else float(v)))
    return sorted(curve)


def steps_to_target(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """Steps to the first evaluation at or below ``target``, interpolated linearly from the evaluation
    before it (None when no evaluation reaches it; see [Note: what a target means])."""
    prev: tuple[int, float] | None = None
    for steps, loss in curve:
        if math.isfinite(loss) and loss <= target:
            if prev is None or not math.isfinite(prev[1]) or prev[1] <= target:
                return float(steps)
            frac = (prev[1] - target) / (prev[1] - loss)
            return prev[0] + frac * (steps - prev[0])
        prev = (steps, loss)
    return None


def final_loss(curve: Sequence[tuple[int, float]], last: int = 1) -> float:
    """Mean held-out loss of the last ``last`` evaluations; ``inf`` when the run diverged (any NaN) or has none."""
    if not curve or any(not math.isfinite(v) for _, v in curve):
        return math.inf
    return statistics.fmean(v for _, v in curve[-last:])


def loss_at(curve: Sequence[tuple[int, float]], steps: int) -> float | None:
    """The held-out loss evaluated after exactly ``steps`` steps, or None."""
    return next((v for s, v in curve if s == steps), None)


def max_mean_gap(curves: Sequence[Sequence[tuple[int, float]]],
                 reference: Sequence[Sequence[tuple[int, float]]]) -> tuple[float, int] | None:
    """Largest gap of seed-mean held-out loss, ``curves`` minus ``reference``, over the evaluation steps
    that every run of both holds, and the step where it lies (None without a common step). Issue 28's
    goal measures PipeFisher this way against K-FAC refreshing every step ("within 0.02 nats at every
    step"). A diverged run (NaN) makes the gap ``inf``."""
    runs = [dict(c) for c in curves]
    refs = [dict(c) for c in reference]
    if not runs or not refs:
        return None
    common = sorted(set.intersection(*(set(r) for r in runs + refs)))
    if not common:
        return None
    gaps = [(statistics.fmean(r[s] for r in runs) - statistics.fmean(r[s] for r in refs), s) for s in common]
    if any(not math.isfinite(g) for g, _ in gaps):
        return math.inf, next(s for g, s in gaps if not math.isfinite(g))
    return max(gaps)


UNREACHED = 1e6  # tuning score of a run that missed the target: UNREACHED + its final loss


def tuning_score(curve: Sequence[tuple[int, float]], target: float | None) -> float:
    """What a grid minimizes: steps to ``target`` (the study's hardest), else ``UNREACHED`` + the final
    held-out loss (a run that missed ranks behind every run that reached it, by its loss), ``inf`` if
    the run diverged. Without a target (synthetic data): the final loss."""
    final = final_loss(curve)
    if target is None or not math.isfinite(final):
        return final
    steps = steps_to_target(curve, target)
    return steps if steps is not None else UNREACHED + final


# --- seeds ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """Mean, standard deviation and range of one figure over seeds; ``missing`` seeds did not reach
    the target (their value is unknown, above the run's length), so mean and range are then of the
    seeds that did and the interval is open above."""

    mean: float
    sd: float
    lo: float
    hi: float
    n: int
    missing: int = 0

    @property
    def complete(self) -> bool:
        return self.missing == 0 and self.n > 0

    def scaled(self, factor: float) -> Interval:
        """The interval of ``factor`` × the figure (e.g. steps × seconds per step)."""
        return Interval(self.mean * factor, self.sd * factor, self.lo * factor, self.hi * factor, self.n, self.missing)

    def text(self, fmt: str = "{:.0f}") -> str:
        if self.n == 0:
            return "not reached" if self.missing else "no run yet"
        body = f"{fmt.format(self.mean)} ± {fmt.format(self.sd)} [{fmt.format(self.lo)}–{fmt.format(self.hi)}]"
        return body + (f", {self.missing} of {self.n + self.missing} not reached" if self.missing else "")


def seed_interval(values: Sequence[float | None]) -> Interval:
    """:class:`Interval` of ``values`` (one per seed; None = target not reached by that seed)."""
    got = [float(v) for v in values if v is not None]
    missing = len(values) - len(got)
    if not got:
        return Interval(math.nan, math.nan, math.nan, math.nan, 0, missing)
    sd = statistics.stdev(got) if len(got) > 1 else 0.0
    return Interval(statistics.fmean(got), sd, min(got), max(got), len(got), missing)


def separated(a: Interval, b: Interval) -> bool:
    """Whether the seed ranges of ``a`` and ``b`` do not overlap. An interval with a seed that missed
    the target is open above: it separates only as the larger one (``a`` missing, ``b`` complete and
    ``b.hi < a.lo``) — and never with fewer than 2 seeds on either side."""
    if a.n + a.missing < 2 or b.n + b.missing < 2:
        return False
    for low, high in ((a, b), (b, a)):
        if low.complete and high.n > 0 and low.hi < high.lo:
            return True
        if low.complete and high.n == 0:
            return True  # every seed of `high` missed what every seed of `low` reached
    return False


@dataclass(frozen=True)
class Ratio:
    """``a / b`` of two seed intervals: the ratio of the means and the range from the extremes, over
    the seeds that reached the target. ``missed`` counts, for ``a`` and for ``b``, the seeds that did
    not (left out of those means: a missing seed of ``a`` would raise the ratio, one of ``b`` lower it),
    ``seeds`` all the seeds of each; :meth:`text` says so whenever one missed."""

    mean: float
    lo: float
    hi: float
    established: bool  # the intervals separate (see `separated`)
    missed: tuple[int, int] = (0, 0)  # seeds of a, of b, that did not reach the target
    seeds: tuple[int, int] = (0, 0)  # seeds of a, of b

    @property
    def complete(self) -> bool:
        """Whether every seed of both sides reached the target (the means are of all seeds)."""
        return self.missed == (0, 0)

    def text(self) -> str:
        if not math.isfinite(self.mean):
            return "–"
        verdict = "separated" if self.established else "not separated"
        body = f"{self.mean:.2f} [{self.lo:.2f}–{self.hi:.2f}] {verdict}"
        if self.complete:
            return body
        sides = [f"{m} of {n} seeds of {side} missed the target" for side, m, n in
                 zip(("the first", "the second"), self.missed, self.seeds) if m]
        bound = ("a lower bound" if self.missed[0] and not self.missed[1] else
                 "an upper bound" if self.missed[1] and not self.missed[0] else "neither bound")
        return f"{body} (of the seeds that reached it: {'; '.join(sides)}; the ratio is {bound})"


def ratio(a: Interval, b: Interval) -> Ratio:
    """:class:`Ratio` of ``a`` to ``b`` (NaN when either has no seed that reached the target); the
    seeds either side that missed it are counted in ``missed`` and named by :meth:`Ratio.text`."""
    counts = {"missed": (a.missing, b.missing), "seeds": (a.n + a.missing, b.n + b.missing)}
    if a.n == 0 or b.n == 0 or b.mean <= 0 or b.lo <= 0:
        return Ratio(math.nan, math.nan, math.nan, separated(a, b), **counts)
    return Ratio(a.mean / b.mean, a.lo / b.hi, a.hi / b.lo, separated(a, b), **counts)


# --- step costs -------------------------------------------------------------------------------


def time_to_target(steps: Interval, step_s: float) -> Interval:
    """Seconds to a target in one setting: steps to it (measured, per seed) × that setting's step cost
    of the arm (one number: a measured median or a simulated step)."""
    if not step_s > 0:
        raise ValueError(f"step cost {step_s!r}: must be a positive number of seconds")
    return steps.scaled(step_s)


# --- picks ------------------------------------------------------------------------------------


def pick(finals: Mapping[float, float]) -> tuple[float | None, bool]:
    """``(value, at_edge)``: the grid value with the lowest final held-out loss (a diverged run, ``inf``
    or NaN, is never picked; None when every run diverged) and whether it is the grid's smallest or
    largest value (then the optimum is not bracketed)."""
    finite = {v: f for v, f in finals.items() if math.isfinite(f)}
    if not finite:
        return None, True
    best = min(finite, key=lambda v: (finite[v], v))
    return best, best in (min(finals), max(finals))


def beyond_edge(grid: Sequence[float], best: float, factor: float = 2.0) -> float:
    """The next grid value past the edge ``best`` sits on (× or ÷ ``factor``)."""
    return _round(max(grid) * factor if best == max(grid) else min(grid) / factor)


def _round(value: float) -> float:
    """``value`` to 12 significant digits: grid values reached by different products compare equal."""
    return float(f"{value:.12g}")


# --- the plan of runs -------------------------------------------------------------------------


KFAC_ARM = re.compile(r"kfac-k(?P<k>[1-9][0-9]*)(?:-i(?P<i>[1-9][0-9]*))?(?:-(?P<mode>deferred|ready))?")


def kfac_arm(arm: str) -> tuple[int, int, str] | None:
    """``kfac-kK[-iM][-deferred|-ready]`` -> (K, M, mode), None for other arms: factors every K steps,
    inverses every M (default K; a multiple of K), inverses used at once (``fresh``), from the next
    cycle (``deferred``, PipeFisher's numerics) or from the step after their inversion (``ready``,
    ``promote_inverses=when_ready``). ValueError for a malformed K-FAC arm."""
    if not arm.startswith("kfac-"):
        return None
    m = KFAC_ARM.fullmatch(arm)
    if m is None:
        raise ValueError(f"unknown arm {arm!r}: kfac-kK, kfac-kK-deferred, kfac-kK-ready, kfac-kK-iM[-deferred|-ready]")
    k = int(m["k"])
    i = int(m["i"]) if m["i"] else k
    if i % k:
        raise ValueError(f"arm {arm!r}: the inverse interval {i} must be a multiple of the factor interval {k}")
    return k, i, m["mode"] or "fresh"


def kfac_interval(arm: str) -> int | None:
    """K of a K-FAC arm (:func:`kfac_arm`; None for other arms)."""
    parsed = kfac_arm(arm)
    return None if parsed is None else parsed[0]


PROMOTE_OF_MODE = {"deferred": "at_cycle_end", "ready": "when_ready"}


def staleness_multipliers(steps: Mapping[str, Mapping[int, float | None]], mode: str) -> dict[int, tuple[float, int]]:
    """Steps multiplier per refresh interval k for the PipeFisher planner
    (``pipefisher.planning.staleness``): mean steps to a target of ``kfac-kK-<mode>`` over its seeds
    divided by mean steps of ``kfac-k1`` (fresh, every step) over the same seeds, with the number of
    seeds. ``steps``: arm -> {seed: steps, None where the run missed the target}. A k with a seed that
    missed the target (or whose kfac-k1 seed did) is left out: its multiplier is unknown, not large.
    Decoupled arms (``-iM``) are left out. k = 1 is ``kfac-k1-<mode>`` where it ran, else 1.0 with 0 seeds."""
    if mode not in (*PROMOTE_OF_MODE, "fresh"):
        raise ValueError(f"mode={mode!r}: deferred, ready or fresh")
    ref = steps.get("kfac-k1", {})
    out: dict[int, tuple[float, int]] = {1: (1.0, 0)}
    for arm, by_seed in steps.items():
        parsed = kfac_arm(arm)
        if parsed is None or parsed[0] != parsed[1] or parsed[2] != mode:
            continue
        seeds = [s for s in by_seed if s in ref]
        if not seeds or any(by_seed[s] is None or ref[s] is None for s in seeds):
            continue
        out[parsed[0]] = (statistics.fmean(by_seed[s] for s in seeds) / statistics.fmean(ref[s] for s in seeds),
                          len(seeds))
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class TradeOff:
    """One refresh interval k on the trade-off curve of one step-cost setting: what k costs per step
    (against NVLAMB's step) and in steps (against K-FAC every step), and the time to target both give,
    against NVLAMB's. ``pipefisher_*``: PipeFisher's bubble plan at k with deferred inverses;
    ``kfac_*``: K-FAC refreshing every k steps on the critical path, inverses used at once.
    ``ready_*``: PipeFisher's plan at k whose curvature is at most k steps old with
    ``promote_inverses=when_ready`` (``pipefisher-kK-ready`` of ``bench/step_costs.py``: every INVERT in
    its curvature's phase, the numerics of the ``kfac-kK-ready`` arms).
    A figure is None where its step cost or steps multiplier was not measured."""

    k: int
    pipefisher_step: float | None
    deferred_steps: float | None
    deferred_seeds: int
    ready_steps: float | None
    ready_seeds: int
    kfac_step: float | None
    fresh_steps: float | None
    fresh_seeds: int
    steps_kfac1_over_nvlamb: float
    ready_step: float | None = None

    def _time(self, step: float | None, steps: float | None) -> float | None:
        return None if step is None or steps is None else step * steps * self.steps_kfac1_over_nvlamb

    @property
    def pipefisher_time(self) -> float | None:
        """PipeFisher at k: time to target over NVLAMB's = step ratio × steps multiplier × kfac-k1's steps
        over NVLAMB's."""
        return self._time(self.pipefisher_step, self.deferred_steps)

    @property
    def ready_time(self) -> float | None:
        """PipeFisher at k with inverses promoted when ready, over NVLAMB's time."""
        return self._time(self.ready_step, self.ready_steps)

    @property
    def kfac_time(self) -> float | None:
        """K-FAC every k steps on the critical path, over NVLAMB's time."""
        return self._time(self.kfac_step, self.fresh_steps)


def trade_off(costs: Mapping[str, float], multipliers: Mapping[str, Mapping[int, tuple[float, int]]],
              steps_kfac1_over_nvlamb: float) -> list[TradeOff]:
    """The trade-off curve of one setting: for every k with a ``pipefisher-kK``, ``pipefisher-kK-ready`` or
    ``kfac-kK`` step cost in ``costs`` (seconds per step, beside ``nvlamb``) and a steps multiplier of the matching mode
    (``multipliers[mode]`` of :func:`staleness_multipliers` for ``deferred``, ``ready`` and ``fresh``;
    the k = 1 entry with 0 seeds that it adds for a mode with no k = 1 arm is not a measurement)."""
    base = costs["nvlamb"]

    def measured(mode: str, k: int) -> tuple[float | None, int]:
        m, n = multipliers.get(mode, {}).get(k, (None, 0))
        return (None, 0) if n == 0 and not (mode == "fresh" and k == 1) else (m, n)

    out = []
    for k in sorted(set().union(*(set(m) for m in multipliers.values()))):
        pf, kf, ready = costs.get(f"pipefisher-k{k}"), costs.get(f"kfac-k{k}"), costs.get(f"pipefisher-k{k}-ready")
        f = (1.0, 0) if k == 1 and "fresh" not in multipliers else measured("fresh", k)
        row = TradeOff(k, None if pf is None else pf / base, *measured("deferred", k), *measured("ready", k),
                       None if kf is None else kf / base, *f, steps_kfac1_over_nvlamb,
                       None if ready is None else ready / base)
        if any(t is not None for t in (row.pipefisher_time, row.ready_time, row.kfac_time)):
            out.append(row)
    return out


def simulated_setting(doc: Mapping[str, Any]) -> tuple[str, dict[str, float]]:
    """The step-cost setting of a ``bench/step_costs.py --json`` file: ``"D=<stages> simulated, batch <B>"``
    (B = micro-batch size × micro-batches × data-parallel width of its simulated run) and its arms'
    seconds per step (``pipefisher-kK`` included), as the study's step_costs.json holds them. AdamW and
    Muon get NVLAMB's step, as step_costs.py states (their optimizer work is not in the profile)."""
    run = doc["simulated_run"]
    batch = run["micro_batch_size"] * run["num_micro_batches"] * run.get("dp_width", 1)
    arms = {arm: float(row["step_s"]) for arm, row in doc["simulated"].items()}
    return f"D={run['stages']} simulated, batch {batch}", {**arms, "adamw": arms["nvlamb"], "muon": arms["nvlamb"]}


def pipefisher_arm(k: int) -> str:
    """The arm that stands in for PipeFisher's numerics at interval k: K-FAC refreshing every k steps,
    inverses deferred a cycle."""
    return f"kfac-k{k}-deferred"


def pipefisher_ks(text: str) -> dict[str, int]:
    """``"D=2:7,D=8:5"`` -> ``{"D=2": 7, "D=8": 5}``: PipeFisher's planned interval per setting."""
    out = {}
    for item in text.split(","):
        setting, _, k = item.rpartition(":")
        if not setting or not k.isdigit() or int(k) < 1:
            raise ValueError(f"--pipefisher-k {text!r}: give setting:k pairs such as D=2:7,D=8:5")
        out[setting] = int(k)
    return out


EKFAC_ARM = re.compile(r"ekfac-k(?P<k>[1-9][0-9]*)(?P<deferred>-deferred)?")


def ekfac_arm(arm: str) -> tuple[int, bool] | None:
    """``ekfac-kK[-deferred]`` -> (K, deferred), None for other arms: optimizer=ekfac (Adam in the
    eigenbasis of K-FAC's factors, issue 28 item 3) with factors and eigenbases refreshed every K
    steps, used at once or from the next cycle on (PipeFisher's placement). ValueError if malformed."""
    if not arm.startswith("ekfac-"):
        return None
    m = EKFAC_ARM.fullmatch(arm)
    if m is None:
        raise ValueError(f"unknown arm {arm!r}: ekfac-kK or ekfac-kK-deferred")
    return int(m["k"]), bool(m["deferred"])


#: PipeFisher itself, run as a D=2 chimera pipeline of 2 processes with the plan its planner makes:
#: its curvature ages are the plan's, not a stand-in's (the ``kfac-kK-*`` arms run one process);
#: ``-cM``: curvature from the first M micro-batches of each pipe (``optimizer.curvature_micro_batches``).
PIPEFISHER_D2 = re.compile(r"pipefisher-d2(?:-c(?P<c>[1-9][0-9]*))?")


def pipefisher_run(arm: str) -> int | None:
    """``pipefisher-d2[-cM]`` -> M (0: curvature from every micro-batch); None for other arms."""
    m = PIPEFISHER_D2.fullmatch(arm)
    return None if m is None else int(m["c"] or 0)


def family(arm: str) -> str:
    """The arm whose learning rate (and damping) an arm shares: every K-FAC arm (PipeFisher's run too)
    uses kfac-k1's pick, every ekfac arm ekfac-k1's (lr only: damping does not enter ekfac)."""
    if arm.startswith("ekfac"):
        return "ekfac"
    return "kfac" if arm.startswith("kfac") or pipefisher_run(arm) is not None else arm


def tuned_arm(fam: str) -> str:
    """The arm a family's lr grid runs: kfac-k1 for kfac, ekfac-k1 for ekfac, else the family itself."""
    return {"kfac": "kfac-k1", "ekfac": "ekfac-k1"}.get(fam, fam)


@dataclass(frozen=True)
class Run:
    """One training run of the study."""

    batch: int
    arm: str
    lr: float
    seed: int
    damping: float | None = None  # K-FAC arms only

    @property
    def key(self) -> str:
        damping = "" if self.damping is None else f"-d{self.damping:g}"
        return f"b{self.batch}/{self.arm}/lr{self.lr:g}{damping}-s{self.seed}"


@dataclass(frozen=True)
class StudySpec:
    """What the study runs. ``steps``: run length per global batch size (the lr schedule's length)."""

    steps: Mapping[int, int]
    lr_grid: Mapping[str, Sequence[float]]  # family -> initial grid
    damping_grid: Sequence[float] = (1e-3,)  # K-FAC damping grid at kfac's picked lr; the first is the default
    stale_arms: Sequence[str] = ()  # K-FAC arms run at kfac's pick, seed 0 (staleness curve)
    final_arms: Sequence[str] = ()  # arms run with every seed at their family's pick
    seeds: int = 3
    max_extend: int = 2  # grid values added past an edge, per family and batch
    factor: float = 2.0

    def grid_for(self, fam: str) -> list[float]:
        return list(self.lr_grid[fam])


@dataclass
class Picks:
    """What :func:`plan_runs` decided from the results so far, per batch size."""

    lr: dict[tuple[int, str], float] = field(default_factory=dict)  # (batch, family) -> lr
    lr_edge: dict[tuple[int, str], bool] = field(default_factory=dict)
    lr_finals: dict[tuple[int, str], dict[float, float]] = field(default_factory=dict)
    damping: dict[int, float] = field(default_factory=dict)
    damping_edge: dict[int, bool] = field(default_factory=dict)
    damping_finals: dict[int, dict[float, float]] = field(default_factory=dict)


def tune_grid(initial: Sequence[float], finals: Mapping[float, float], max_extend: int,
              factor: float) -> tuple[list[float], list[float], float | None, bool]:
    """``(values, missing, pick, at_edge)`` of a grid search: ``initial`` extended past the edge the best
    value sits on, one value at a time, up to ``max_extend`` values; ``missing``: values without a
    result yet (the pick is None until there are none)."""
    values = list(initial)
    for extended in range(max_extend + 1):
        missing = [v for v in values if v not in finals]
        if missing:
            return values, missing, None, True
        best, edge = pick({v: finals[v] for v in values})
        if best is None or not edge or extended == max_extend or len(values) < 2:
            return values, [], best, edge
        values.append(beyond_edge(values, best, factor))
    raise AssertionError("unreachable")


def _grid_values(spec: StudySpec, name: str) -> list[float]:
    """Every value a grid can reach: its initial values and ``max_extend`` steps past either edge."""
    initial, factor = (spec.damping_grid, 10.0) if name == "damping" else (spec.grid_for(name), spec.factor)
    lo, hi = min(initial), max(initial)
    return sorted(set(initial) | {_round(lo / factor ** i) for i in range(1, spec.max_extend + 1)}
                  | {_round(hi * factor ** i) for i in range(1, spec.max_extend + 1)})


def plan_runs(spec: StudySpec, results: Mapping[str, float]) -> tuple[list[Run], Picks]:
    """The runs the study still needs, given the final held-out losses of the runs done so far
    (``results``: run key -> final loss, ``inf`` if diverged), and the picks made from them.

    Order of decisions per batch size: each family's lr on its grid at seed 0 (grid extended past an
    edge, up to ``max_extend`` values); K-FAC's damping at kfac-k1's lr; then the staleness arms at
    kfac's pick, and every final arm with every seed at its family's pick (seed 0 is the tuning run
    itself when the arm is the one tuned). Runs whose inputs are not decided yet are not listed.
    """
    todo: list[Run] = []
    picks = Picks()
    d0 = spec.damping_grid[0]
    for batch in spec.steps:
        for fam in spec.lr_grid:
            arm = tuned_arm(fam)
            damping = d0 if fam == "kfac" else None
            finals = {r.lr: results[r.key] for r in (Run(batch, arm, v, 0, damping) for v in _grid_values(spec, fam))
                      if r.key in results}
            values, missing, best, edge = tune_grid(spec.grid_for(fam), finals, spec.max_extend, spec.factor)
            todo += [Run(batch, arm, v, 0, damping) for v in missing]
            picks.lr_finals[(batch, fam)] = {v: finals[v] for v in values if v in finals}
            if best is not None:
                picks.lr[(batch, fam)] = best
                picks.lr_edge[(batch, fam)] = edge
        kfac_lr = picks.lr.get((batch, "kfac"))
        if kfac_lr is not None:
            dfinals = {r.damping: results[r.key] for r in (Run(batch, "kfac-k1", kfac_lr, 0, d)
                                                          for d in _grid_values(spec, "damping")) if r.key in results}
            dvalues, dmissing, dbest, dedge = tune_grid(spec.damping_grid, dfinals, spec.max_extend, 10.0)
            todo += [Run(batch, "kfac-k1", kfac_lr, 0, d) for d in dmissing]
            picks.damping_finals[batch] = {d: dfinals[d] for d in dvalues if d in dfinals}
            if dbest is not None:
                picks.damping[batch] = dbest
                picks.damping_edge[batch] = dedge
        for arm in list(dict.fromkeys(list(spec.final_arms) + list(spec.stale_arms))):
            fam = family(arm)
            lr = picks.lr.get((batch, fam))
            damping = picks.damping.get(batch) if fam == "kfac" else None
            if lr is None or (fam == "kfac" and damping is None):
                continue
            seeds = range(spec.seeds) if arm in spec.final_arms else range(1)
            for seed in seeds:
                r = Run(batch, arm, lr, seed, damping)
                if r.key not in results and r not in todo:
                    todo.append(r)
    return todo, picks


def chosen_run(picks: Picks, batch: int, arm: str, seed: int) -> Run | None:
    """The run of ``arm`` at its family's pick for ``seed`` (None while undecided)."""
    fam = family(arm)
    lr = picks.lr.get((batch, fam))
    damping = picks.damping.get(batch) if fam == "kfac" else None
    if lr is None or (fam == "kfac" and damping is None):
        return None
    return Run(batch, arm, lr, seed, damping)


# --- the budget method (issue 37 item 1; Wen et al., arXiv 2509.02046) -------------------------
#
# [Note: speed-up by budgets]
# Each run has its own lr schedule ending at its budget (train.py's ``steps``), and its lr is tuned per
# budget; what a run yields is its final held-out loss. Per arm, final loss against budget is a curve
# L(B). The budget an arm needs for a loss L is B(L), the first crossing of L along increasing B,
# interpolated linearly in log B between the two budgets around it (no extrapolation past the smallest
# or largest budget). The speed-up at L is B_ref(L) / B_arm(L): > 1 when the arm needs fewer steps.
# Unlike steps to a target inside one fixed schedule, no arm is read mid-schedule, so the ratio does
# not depend on where the target sits in anyone's schedule. The value is from the seed-mean curves;
# the interval is the range over (reference seed, arm seed) pairs of the per-seed curves' ratio.


def budget_to_reach(points: Sequence[tuple[float, float]], loss: float) -> float | None:
    """The budget whose run ends at held-out ``loss`` ([Note: speed-up by budgets]).

    Args:
        points: (budget in steps, final held-out loss) of runs each ending its schedule at its budget.
        loss: the held-out loss.

    Returns:
        The first crossing of ``loss`` along increasing budget, interpolated in log budget; None when no
        budget reaches it, or the smallest budget already ends below it (it would need extrapolation).
    """
    pts = sorted((float(b), float(v)) for b, v in points if math.isfinite(v))
    if not pts or pts[0][1] < loss:
        return None
    if pts[0][1] == loss:
        return pts[0][0]
    for (b0, l0), (b1, l1) in zip(pts, pts[1:]):
        if l0 >= loss >= l1:
            if loss == l1:
                return b1
            f = (l0 - loss) / (l0 - l1)
            return math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
    return None


def _mean_curve(finals: Mapping[int, Sequence[float]]) -> list[tuple[float, float]]:
    return [(b, statistics.fmean(v)) for b, v in sorted(finals.items()) if v and all(math.isfinite(x) for x in v)]


def _seed_curves(finals: Mapping[int, Sequence[float]]) -> list[list[tuple[float, float]]]:
    seeds = min((len(v) for v in finals.values()), default=0)
    return [[(b, v[s]) for b, v in sorted(finals.items())] for s in range(seeds)]


def budget_losses(finals: Mapping[int, Sequence[float]], count: int = 5) -> list[float]:
    """``count`` held-out losses, evenly spaced from the reference's seed-mean final loss at its smallest
    budget down to that at its largest (highest first): the range a budget sweep speaks for."""
    curve = _mean_curve(finals)
    if len(curve) < 2 or count < 1:
        return []
    hi, lo = curve[0][1], min(v for _, v in curve)
    if count == 1:
        return [lo]
    return [hi - (hi - lo) * i / (count - 1) for i in range(count)]


def budget_speedups(finals: Mapping[str, Mapping[int, Sequence[float]]], reference: str,
                    losses: Sequence[float]) -> dict[str, list[dict[str, float]]]:
    """Speed-up of every arm over ``reference`` at each of ``losses`` ([Note: speed-up by budgets]).

    Args:
        finals: arm -> budget -> final held-out loss per seed (seed order; the same seeds at every budget).
        reference: the arm the speed-ups are relative to (in ``finals``).
        losses: held-out losses (e.g. :func:`budget_losses` of the reference).

    Returns:
        arm (the reference too, at 1) -> [{"loss", "value", "low", "high", "pairs"}] at the losses both the
        arm's and the reference's seed-mean curves reach without extrapolation, highest loss first; ``low`` /
        ``high`` the range over seed pairs whose curves both reach the loss (``pairs`` of them; the value kept
        inside the range).
    """
    if reference not in finals:
        raise ValueError(f"reference {reference!r} has no runs; the arms with runs are {sorted(finals)}")
    ref_mean, ref_seeds = _mean_curve(finals[reference]), _seed_curves(finals[reference])
    out: dict[str, list[dict[str, float]]] = {}
    for arm, runs in finals.items():
        mean, seeds = _mean_curve(runs), _seed_curves(runs)
        points = []
        for loss in sorted(losses, reverse=True):
            b_ref, b_arm = budget_to_reach(ref_mean, loss), budget_to_reach(mean, loss)
            if b_ref is None or b_arm is None:
                continue
            value = b_ref / b_arm
            pairs = [r / a for r, a in ((budget_to_reach(rs, loss), budget_to_reach(s, loss))
                                        for rs in ref_seeds for s in seeds) if r is not None and a is not None]
            low, high = (min(pairs), max(pairs)) if pairs else (value, value)
            points.append({"loss": loss, "value": value, "low": min(low, value), "high": max(high, value),
                           "pairs": len(pairs)})
        if points:
            out[arm] = points
    return out


def budget_finals(results: Sequence[Mapping[str, Any]], text: str | None = None) -> dict[str, dict[int, list[float]]]:
    """arm -> budget -> final held-out loss per seed, at each (arm, budget)'s tuned lr: the (lr, damping) whose
    seed-0 run ends lowest (Wen et al. tune the lr per budget; the study's grids run at seed 0), then every seed
    of it in seed order. ``results``: the runs' ``result.json`` (``arm``, ``lr``, ``damping``, ``seed``,
    ``steps`` = the budget, ``final``, ``status``, ``final_by_text``); runs that did not finish are left out.
    ``text``: the losses are ``final_by_text[text]`` (the final weights on another held-out text; runs
    without it are left out) instead of ``final``, of the same runs: the lr is still the one whose seed-0 run
    ends lowest on ``final`` (the text the study tuned on), so a second text checks the same runs."""
    groups: dict[tuple[str, int], dict[tuple[float, float | None], dict[int, tuple[float, float]]]] = {}
    for r in results:
        if r.get("status") != "ok":
            continue
        if text is not None and text not in r.get("final_by_text", {}):
            continue
        value = float(r["final"] if text is None else r["final_by_text"][text])
        key = (r["arm"], int(r["steps"]))
        groups.setdefault(key, {}).setdefault((r["lr"], r.get("damping")), {})[int(r["seed"])] = (float(r["final"]),
                                                                                                  value)
    out: dict[str, dict[int, list[float]]] = {}
    for (arm, budget), by_lr in groups.items():
        tuned = [s for s in by_lr.values() if 0 in s]
        if not tuned:
            continue
        best = min(tuned, key=lambda s: (s[0][0], statistics.fmean(v[0] for v in s.values())))
        out.setdefault(arm, {})[budget] = [best[s][1] for s in sorted(best)]
    return out


def calibration_optimizer(arm: str) -> dict[str, Any] | None:
    """The calibration entry keys an arm stands for (``planning.calibration``), None for arms the search has
    no candidate for: nvlamb, adamw, muon; ``kfac-kK`` K-FAC refreshing every K steps on the critical path;
    ``kfac-kK-deferred`` / ``-ready`` PipeFisher's numerics at k = K (inverses at cycle end / when ready)."""
    if arm in ("nvlamb", "adamw", "muon"):
        return {"optimizer": arm}
    parsed = kfac_arm(arm) if arm.startswith("kfac-") else None
    if parsed is None or parsed[0] != parsed[1]:
        return None
    k, _, mode = parsed
    if mode == "fresh":
        return {"optimizer": "kfac", "k": k}
    return {"optimizer": "pipefisher", "k": k, "promote_inverses": PROMOTE_OF_MODE[mode]}


def calibration_entries(speedups: Mapping[str, Sequence[Mapping[str, float]]], reference: str) -> list[dict[str, Any]]:
    """The calibration file's ``optimizers`` from :func:`budget_speedups` (the reference and arms without an
    entry left out; ``arm`` kept for the record)."""
    out = []
    for arm, points in sorted(speedups.items()):
        keys = calibration_optimizer(arm)
        if arm == reference or keys is None:
            continue
        out.append({**keys, "arm": arm, "speedup": [{k: (round(p[k], 5) if k != "pairs" else int(p[k]))
                                                      for k in ("loss", "value", "low", "high", "pairs")}
                                                     for p in points]})
    return out


def reference_steps(finals: Mapping[int, Sequence[float]], losses: Sequence[float]) -> list[tuple[float, float]]:
    """(loss, budget) of the reference's seed-mean curve at each of ``losses`` it reaches (the calibration's
    ``reference_steps``)."""
    curve = _mean_curve(finals)
    return [(loss, b) for loss in losses if (b := budget_to_reach(curve, loss)) is not None]


def calibration_table(doc: Mapping[str, Any]) -> str:
    """A calibration document's speed-ups as a markdown table: one row per held-out loss (the reference's
    budget for it beside), one column per optimizer entry, ``value [low–high] (n pairs)`` (the range over the n
    seed pairs whose single-seed curves both reach the loss: near the ends of the budget range fewer do, and the
    range is then narrower than the seeds' spread; ``–`` where the entry does not reach the loss without
    extrapolating)."""
    entries = doc["optimizers"]
    names = [e.get("arm") or e["optimizer"] for e in entries]
    lines = [f"| held-out loss | {doc['reference']} budget | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for ref in doc["reference_steps"]:
        cells = []
        for e in entries:
            p = next((p for p in e["speedup"] if abs(p["loss"] - ref["loss"]) < 1e-6), None)
            cells.append("–" if p is None else f"{p['value']:.2f} [{p.get('low', p['value']):.2f}–"
                                                 f"{p.get('high', p['value']):.2f}]"
                                                 + (f" ({p['pairs']} pairs)" if "pairs" in p else ""))
        lines.append(f"| {ref['loss']:.3f} | {ref['steps']:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_texts(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Whether two calibrations of the same runs on two held-out texts agree: per optimizer entry (matched by
    ``arm``, else by optimizer) and per loss point, paired by its place in each document's ``reference_steps``
    (the losses are evenly spaced over each text's reference range, so point i of both is read at about the
    same reference budget). ``agree``: the seed intervals [low, high] overlap. Points missing on either
    text are left out."""
    def index(doc: Mapping[str, Any]) -> dict[str, dict[int, Mapping[str, float]]]:
        losses = [r["loss"] for r in doc["reference_steps"]]
        out: dict[str, dict[int, Mapping[str, float]]] = {}
        for e in doc["optimizers"]:
            for p in e["speedup"]:
                i = next((i for i, loss in enumerate(losses) if abs(loss - p["loss"]) < 1e-6), None)
                if i is not None:
                    out.setdefault(e.get("arm") or e["optimizer"], {})[i] = p
        return out

    ia, ib = index(a), index(b)
    ref_a, ref_b = a["reference_steps"], b["reference_steps"]
    rows = []
    for name in [n for n in ia if n in ib]:
        for i in sorted(set(ia[name]) & set(ib[name])):
            pa, pb = ia[name][i], ib[name][i]
            lo_a, hi_a = pa.get("low", pa["value"]), pa.get("high", pa["value"])
            lo_b, hi_b = pb.get("low", pb["value"]), pb.get("high", pb["value"])
            rows.append({"arm": name, "point": i, "loss_a": pa["loss"], "loss_b": pb["loss"],
                         "pairs": (pa.get("pairs"), pb.get("pairs")),
                         "budget_a": ref_a[i]["steps"], "budget_b": ref_b[i]["steps"],
                         "a": (pa["value"], lo_a, hi_a), "b": (pb["value"], lo_b, hi_b),
                         "agree": lo_a <= hi_b and lo_b <= hi_a})
    return rows
