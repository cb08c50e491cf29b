"""The convergence study's time to target (§7) repriced on today's step costs, per schedule × optimizer.

    python bench/reprice.py --out DIR --measure      # D=2 measured: every (schedule, arm) pipeline, rotated rounds
    python bench/reprice.py --out DIR --paired 20    # the optimizer step alone, the arms taking turns in one process
    python bench/reprice.py --out DIR --simulate     # D=8 simulated (N=8 and 16) from D=2 profiles taken here
    python bench/reprice.py --out DIR                # the tables (markdown) from DIR/d2.json and DIR/d8.json
    python bench/reprice.py --out DIR --calibration bench/calibration/budget_b32_valid.json --target-loss 6.24
                                                     # the same tables with a calibration's steps

Steps to target are the study's (bench/studies/07-convergence.md, seeds 0-2 mean and range; the numerics do not
depend on the schedule, the placement or Newton-Schulz's time), or with ``--calibration`` a calibration file's
(``pipefisher.planning.calibration``, e.g. study 18's budget method) at each ``--target-loss``: NVLAMB's steps to
the loss × each optimizer's steps multiplier and its seed interval ([Note: steps from a calibration]); step costs
are measured or simulated here; time to target = steps × step cost; its interval = the seed range of steps × the
step, at D=2 × the step's range over rounds as well (the fewest steps at the fastest round to the most at the
slowest). Bench study 17 (bench/studies/17-repriced-time-to-target.md) reads the output.

[Note: steps from a calibration]
A calibration gives the reference's (NVLAMB's) seed-mean steps to a loss and, per optimizer, its steps over the
reference's with an interval over seed pairs (which already holds the reference's seed spread). So NVLAMB's time
is one number and an arm's interval is NVLAMB's steps × the multiplier's interval × the step: "sep." from NVLAMB
means the multiplier's interval times the step ratio excludes 1. PipeFisher takes the entry at the k its planner
picked in that setting (the nearest larger k measured, ``Calibration.entry``) with train.py's
``promote_inverses=when_ready``; an optimizer the file has no entry for (AdamW in study 18's) is "not calibrated",
out of the ranking, as the strategy search refuses to rank it by time.

[Note: profiles taking turns]
D=8 settings at different N are simulated from different profiles (micro-batch 32/N), so a comparison across N
compares two profiles. One profile per micro-batch size is not enough: in three repeats on a 2-core Xeon the
simulated chimera N=16 NVLAMB step came out 0.75×, 1.34× and 0.96× its N=8 step, and the best configuration's
time over chimera N=8 NVLAMB's 0.52–0.75× with it, while the ratios within one N (one profile) held.
So ``--profiles R`` (default 3) takes R profiles per micro-batch size, the sizes taking turns, and simulates each
N from their element-wise median (``step_costs.median_costs``); the report prints every profile's F+B and STEP.

D=2 measured: ``train.py stages=2 pipeline=<schedule>`` with 4 micro-batches of 8 (global batch 32, bert-tiny,
vocabulary 8,192, seq 64, 10 predictions: the study's shape), synthetic data of that shape (step cost does not
depend on the text), evaluation off, both workers unpinned; per run the mean step over whole refresh cycles after
the first two (``convergence.cycle_mean_step_s``, the study's estimator), per (schedule, arm) the median over
rounds; the order of the runs rotates every round.

D=8 simulated: ``--profiles`` (3) ``optimizer=kfac`` profiles at D=2 chimera per micro-batch size (4 for N=8, 2 for
N=16: batch 32), their element-wise median, scaled to one encoder layer per model stage (``--layers`` otherwise;
``bench/step_costs.py``); NVLAMB, K-FAC every step and PipeFisher (its planner's defaults) as step_costs.py
simulates them, and AdamW and Muon as NVLAMB's pipeline with the STEP action's cost
scaled by that optimizer's step / NVLAMB's, measured side by side in one process (``--paired``: the optimizer
step alone on the whole bert-tiny, one thread as a D=2 worker has, arms taking turns; Muon with ``ns_dtype=auto``
and ``bf16``; AdamW and Muon also with ``optimizer.adamw_kernel=fused``, the ``-fused`` arms).
Two-chunk schedules (interleaved, zb-v, dualpipev, v-half, v-min) are simulated on 2D model stages; ``--layers 16``
gives every schedule the same 16-layer model (2 layers per stage for one chunk per worker, 1 per chunk for two),
the default one layer per model stage (8 layers for one chunk, 16 for two). A (schedule, N) its generator refuses
(zb-v and dualpipev need N ≥ 2D) is skipped and listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
import step_costs as sc
from convergence import arm_overrides, cycle_mean_step_s

from pipefisher.planning.calibration import Calibration
from pipefisher.schedules.kfac import kfac_layer_counts

# --- the study's steps to target (07-convergence.md: mean, min, max over seeds 0-2) --------------------------
TARGETS = ("H-0.2", "H-0.3")
STUDY_STEPS: dict[str, dict[str, tuple[int, int, int]]] = {
    "nvlamb": {"H-0.2": (672, 594, 742), "H-0.3": (1606, 1586, 1631)},
    "adamw": {"H-0.2": (915, 844, 976), "H-0.3": (1606, 1517, 1673)},
    "muon": {"H-0.2": (676, 597, 757), "H-0.3": (1245, 1186, 1301)},
    "kfac-k1": {"H-0.2": (541, 528, 555), "H-0.3": (1261, 1203, 1349)},
    # PipeFisher's own D=2 run (when_ready, max_staleness 8: curvature 2-8 steps old), used for every schedule
    "pipefisher": {"H-0.2": (571, 542, 610), "H-0.3": (1277, 1248, 1312)},
}
#: which study arm's steps an arm's time uses (Muon's steps do not depend on its Newton-Schulz precision)
#: nor on AdamW's kernel (optimizer.adamw_kernel=fused rounds differently, ~1e-7 per step: tests/test_adamw_kernel.py)
STEPS_OF = {"nvlamb": "nvlamb", "adamw": "adamw", "adamw-fused": "adamw", "muon": "muon", "muon-fused": "muon",
            "muon-bf16": "muon", "kfac-k1": "kfac-k1", "pipefisher": "pipefisher"}
#: the calibration entry (optimizer, k) of each study arm; PipeFisher's k is its plan's ([Note: steps from a calibration])
CALIBRATION_KEY = {"nvlamb": ("nvlamb", None), "adamw": ("adamw", None), "muon": ("muon", None),
                   "kfac-k1": ("kfac", 1), "pipefisher": ("pipefisher", None)}
PIPEFISHER_PROMOTE = "when_ready"  # train.py optimizer=pipefisher's optimizer.promote_inverses


@dataclasses.dataclass(frozen=True)
class StepsSource:
    """Where the steps to a target come from: study 7's seed tables (no calibration) or a calibration file at
    the given held-out losses ([Note: steps from a calibration])."""

    calibration: Calibration | None = None
    losses: tuple[float, ...] = ()

    @property
    def targets(self) -> tuple[str, ...]:
        """The column names: H-0.2 and H-0.3 (study 7), or ``L=<loss>`` per calibrated loss."""
        return TARGETS if self.calibration is None else tuple(f"L={x:.3f}" for x in self.losses)

    def steps(self, arm: str, target: str, pipefisher_k: int | None = None) -> tuple[float, float, float] | None:
        """(mean, low, high) steps of ``arm`` to ``target``; None where the calibration has no entry for it."""
        study_arm = STEPS_OF[arm]
        if self.calibration is None:
            return STUDY_STEPS[study_arm][target]
        loss = float(target.removeprefix("L="))
        ref = self.calibration.reference_steps(loss)
        if ref is None:
            return None
        optimizer, k = CALIBRATION_KEY[study_arm]
        promote = PIPEFISHER_PROMOTE if optimizer == "pipefisher" else None
        multiplier = self.calibration.steps_multiplier(optimizer, pipefisher_k if optimizer == "pipefisher" else k,
                                                       loss, promote)
        if multiplier is None:
            return None
        m, lo, hi = multiplier
        return ref * m, ref * lo, ref * hi

    def describe(self) -> str:
        """One line: where the steps came from (the report's first line)."""
        if self.calibration is None:
            return "steps: study 7's seed tables (bench/studies/07-convergence.md, seeds 0-2; one 2,000-step schedule)"
        return (f"steps: {self.calibration.describe()}; at held-out loss "
                + ", ".join(f"{x:g}" for x in self.losses) + f" ({self.calibration.reference}'s steps "
                + ", ".join(f"{self.calibration.reference_steps(x):.0f}" for x in self.losses) + ")")


STUDY = StepsSource()

SCHEDULES = ("chimera", "1f1b", "zb-h1", "zb-v")
#: the D=2 runs: (schedule, arm)
D2_RUNS = ([("chimera", a) for a in ("nvlamb", "adamw", "muon", "muon-bf16", "kfac-k1", "pipefisher")]
           + [(s, a) for s in ("1f1b", "zb-h1", "zb-v") for a in ("nvlamb", "muon")] + [("1f1b", "pipefisher")])
SHAPE = ["model=bert-tiny", "model.vocab_size=8192", "data.seq_len=64", "data.max_predictions=10"]
DECAY_PER_STEP = 0.95  # the study's factor decay per step (convergence.py --decay-per-step)


def arm_keys(arm: str) -> list[str]:
    """train.py overrides of ``arm``: the study's arms, PipeFisher's own plan, Muon at a forced precision."""
    if arm == "pipefisher":
        return ["optimizer=pipefisher", f"optimizer.factor_decay={DECAY_PER_STEP:g}", "optimizer.factor_decay_per=step"]
    if arm == "muon-bf16":
        return ["optimizer=muon", "optimizer.ns_dtype=bf16"]
    if arm.endswith("-fused"):  # adamw-fused, muon-fused: AdamW (Muon's AdamW half) on torch's fused kernel
        return [f"optimizer={arm.removesuffix('-fused')}", "optimizer.adamw_kernel=fused"]
    return arm_overrides(arm, DECAY_PER_STEP)


def run_steps(arm: str, steps: int) -> int:
    """PipeFisher needs two refresh cycles of warm-up and one to time (k <= 8): at least 32 steps."""
    return max(steps, 32) if arm == "pipefisher" else steps


def measure_d2(out: Path, rounds: int, steps: int, runs: list[tuple[str, str]], timeout_s: int) -> dict[str, Any]:
    """Seconds per step of each (schedule, arm) at D=2 (see the module docstring); writes ``out/d2.json``."""
    per: dict[str, list[float]] = {f"{s}/{a}": [] for s, a in runs}
    loads: list[str] = [h.load()]
    ks: dict[str, int] = {}
    doc: dict[str, Any] = {}
    for r in range(rounds):
        order = h.rotated(runs, r)
        for schedule, arm in order:
            key = f"{schedule}/{arm}"
            run_dir = out / "d2" / f"round{r}" / schedule / arm
            cmd = [sys.executable, "train.py", *SHAPE, "stages=2", f"pipeline={schedule}", "micro_batch_size=8",
                   "num_micro_batches=4", f"steps={run_steps(arm, steps)}", "eval.every_steps=0", "device=cpu",
                   "progress=false", "wandb.mode=disabled", "log_every=50", "save_final=false", *arm_keys(arm),
                   f"hydra.run.dir={run_dir}"]
            done = subprocess.run(cmd, cwd=h.REPO, capture_output=True, text=True, timeout=timeout_s)
            if done.returncode:
                raise RuntimeError(f"{key}: train.py exited with {done.returncode}:\n{done.stderr[-3000:]}")
            mean, k = cycle_mean_step_s(h.step_rows(run_dir))
            per[key].append(mean)
            ks[key] = k
            loads.append(h.load())
            print(f"  round {r}: {key} {mean * 1e3:.1f} ms/step (k={k}, {loads[-1]})", flush=True)
            doc = _d2_doc(out, per, ks, loads, rounds, steps)  # after every run: an interrupted measurement keeps its rounds
    return doc


def _d2_doc(out: Path, per: dict[str, list[float]], ks: dict[str, int], loads: list[str], rounds: int, steps: int) -> dict[str, Any]:
    doc = {"command": "python " + " ".join(sys.argv), "rounds": rounds, "steps": steps, "loads": loads,
           "hardware": _hardware(), "runs": {key: {"step_s": statistics.median(v), "rounds_s": v, "k": ks[key]}
                                             for key, v in per.items() if v}}
    (out / "d2.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _hardware() -> str:
    from pipefisher.hardware import describe_hardware

    return describe_hardware()


# --- the optimizer step alone, paired -------------------------------------------------------------------------

PAIRED_ARMS = {"nvlamb": ["optimizer=nvlamb"], "adamw": ["optimizer=adamw"], "muon": ["optimizer=muon"],
               "muon-bf16": ["optimizer=muon", "optimizer.ns_dtype=bf16"],
               "adamw-fused": ["optimizer=adamw", "optimizer.adamw_kernel=fused"],
               "muon-fused": ["optimizer=muon", "optimizer.adamw_kernel=fused"]}


def paired_steps(out: Path, reps: int) -> dict[str, Any]:
    """The optimizer step alone (``make_optimizer``, as train.py builds it) on the whole bert-tiny of the study's
    shape (what one chimera D=2 worker steps: its two stages are the whole model), the arms in one process taking
    turns step by step (A B C D, B C D A, ...), fixed random gradients; per arm the median. The pipelines of
    NVLAMB, AdamW and Muon are the same, so this difference is the whole difference of their steps. Writes
    ``out/paired.json``."""
    import torch

    from pipefisher.model import BertConfig, build_full_model
    from pipefisher.optim.factory import make_optimizer

    torch.manual_seed(0)
    torch.set_num_threads(1)  # what each of the two D=2 workers gets on 2 cores (training.set_cpu_threads)
    arms = list(PAIRED_ARMS)
    opts, grads = {}, None
    for arm in arms:
        cfg = h.compose([*SHAPE, "steps=1000", *PAIRED_ARMS[arm]])
        model = build_full_model(BertConfig(num_layers=2, hidden_size=128, num_heads=2, intermediate_size=512,
                                            vocab_size=8192), seed=0)
        named = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
        if grads is None:
            grads = [torch.randn_like(q) * 1e-3 for _, q in named]
        for (_, q), g in zip(named, grads):
            q.grad = g.clone()
        opts[arm] = make_optimizer(cfg, named, torch.device("cpu"), log_here=False)[0]
    norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(reps + 1):
        for arm in h.rotated(arms, r):
            start = time.perf_counter()
            opts[arm].step(grad_norm=norm)
            if r:  # the first round builds the optimizers' state
                times[arm].append(time.perf_counter() - start)
    doc = {"command": "python " + " ".join(sys.argv), "hardware": _hardware(), "threads": torch.get_num_threads(),
           "reps": reps, "load": h.load(),
           "step_s": {a: statistics.median(v) for a, v in times.items()},
           "pair_ratio_to_nvlamb": {a: statistics.median(x / y for x, y in zip(v, times["nvlamb"]))
                                    for a, v in times.items()}}
    (out / "paired.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("  optimizer step alone (ms): " + ", ".join(f"{a} {v * 1e3:.2f}" for a, v in doc["step_s"].items()),
          flush=True)
    return doc


# --- D=8 simulated ---------------------------------------------------------------------------------------------

def _costs(path: Path) -> tuple[Any, Any]:
    from pipefisher.planning.costs import RunShape, costs_from_profile
    from pipefisher.profiling import read_profile

    profile = read_profile(path)
    return costs_from_profile(profile, path=path), RunShape.from_train_config(profile.metadata["config"])


def simulate_d8(out: Path, methods: tuple[str, ...], ns: tuple[int, ...], reps: int,
                layers: int | None = None, profiles: int = 3) -> dict[str, Any]:
    """D=8 step seconds per (method, N, arm); AdamW's and Muon's STEP = the profile's STEP × their paired
    optimizer step over NVLAMB's (``out/paired.json``, measured first when missing); the simulated model has
    ``layers`` encoder layers (default one per model stage, ``step_costs.simulated_run``); a (method, N) the
    schedule's generator refuses (zb-v needs N ≥ 2D) is skipped with its reason. Each N's costs are the
    element-wise median of ``profiles`` profiles, the micro-batch sizes taking turns (a single profile's load
    moved N=16's step over N=8's by 0.75–1.34× in three repeats: [Note: profiles taking turns]). Writes
    ``out/d8.json``."""
    paired = out / "paired.json"
    ratio = (json.loads(paired.read_text()) if paired.is_file() else paired_steps(out, reps))["pair_ratio_to_nvlamb"]
    sims: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    taken: dict[int, list[Any]] = {n: [] for n in ns}
    measured_of: dict[int, Any] = {}
    for r in range(profiles):
        for n in h.rotated(list(ns), r):
            mb = 32 // n
            keys = sc.profile_overrides("bert-tiny", 64, mb, max_predictions=10, method="chimera", micro_batches=4,
                                        overrides=["model.vocab_size=8192"])
            print(f"profile {r + 1}/{profiles} (optimizer=kfac, micro-batch {mb}): python profile.py "
                  f"{' '.join(keys)} ({h.load()})", flush=True)
            cost, measured_of[n] = sc.load_costs(sc.profile_run(keys, out / f"kfac-profile-mb{mb}-{r}"))
            taken[n].append(cost)
    step_ms = {f"micro-batch {32 // n}": [c.step_ns / 1e6 for c in taken[n]] for n in ns}
    work_ms = {f"micro-batch {32 // n}": [(sum(c.forward_ns) + sum(c.backward_ns)) / 1e6 for c in taken[n]]
               for n in ns}
    for n in ns:
        cost, measured = sc.median_costs(taken[n]), measured_of[n]
        for method in methods:
            target = sc.simulated_run(measured, 8, method, n, layers)
            scaled = sc.scale_costs(cost, measured, target)
            try:
                schedule = sc.simulated_schedule(target, scaled)
            except ValueError as err:
                skipped[f"{method}/N={n}"] = str(err)
                print(f"  D=8 {method} N={n}: skipped ({err})", flush=True)
                continue
            rows = sc.arm_step_costs(schedule, scaled, kfac_layer_counts(schedule, target.encoder_layers),
                                     intervals=(1,))  # what simulated_step_costs does, on the schedule built here
            res = {"nvlamb": rows["nvlamb"]["step_s"], "kfac-k1": rows["kfac-k1"]["step_s"],
                   "pipefisher": rows["pipefisher"]["step_s"]}
            for arm in [a for a in ("adamw", "adamw-fused", "muon", "muon-fused", "muon-bf16") if a in ratio]:
                c = dataclasses.replace(cost, step_ns=round(cost.step_ns * ratio[arm]))
                res[arm] = sc.steady_step_ns((schedule,), sc.scale_costs(c, measured, target)) / 1e9
            sims[f"{method}/N={n}"] = {"step_s": res, "pipefisher_k": rows["pipefisher"]["k"],
                                       "pipefisher_note": rows["pipefisher"]["note"]}
            print(f"  D=8 {method} N={n}: " + ", ".join(f"{a} {v * 1e3:.1f} ms" for a, v in res.items()), flush=True)
    doc = {"command": "python " + " ".join(sys.argv), "hardware": _hardware(), "step_ratio_to_nvlamb": ratio,
           "profiles": profiles, "profile_step_ms": step_ms, "profile_f_plus_b_ms": work_ms, "layers": layers,
           "simulated": sims, "skipped": skipped}
    (out / "d8.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# --- tables ----------------------------------------------------------------------------------------------------


def time_to_target(arm: str, step_s: float, target: str, step_range: tuple[float, float] | None = None,
                   source: StepsSource = STUDY, pipefisher_k: int | None = None) -> tuple[float, float, float] | None:
    """(mean, low, high) seconds to ``target``: ``source``'s steps (mean, seed range) × ``step_s``; with
    ``step_range`` (the step's lowest and highest measurement) the interval also spans the step's noise:
    [fewest steps × lowest step, most steps × highest step]. None: ``source`` has no steps for ``arm``."""
    steps = source.steps(arm, target, pipefisher_k)
    if steps is None:
        return None
    m, lo, hi = steps
    s_lo, s_hi = step_range or (step_s, step_s)
    return m * step_s, lo * s_lo, hi * s_hi


def overlap(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether two [low, high] intervals overlap (the arms are then not separated)."""
    return a[1] <= b[2] and b[1] <= a[2]


def setting_table(steps: dict[str, float], title: str, ranges: dict[str, tuple[float, float]] | None = None,
                  source: StepsSource = STUDY, pipefisher_k: int | None = None) -> str:
    """Markdown: per arm its step, × NVLAMB's step, time to each target (s, interval over seeds and, with
    ``ranges``, over the step's measurements), × NVLAMB's time [range over the intervals' ends] and whether it
    is separated from NVLAMB's and from the fastest arm (intervals disjoint); "not calibrated" where ``source``
    has no steps for the arm (left out of the fastest)."""
    ref = steps["nvlamb"]
    ranges = ranges or {}
    targets = source.targets
    times = {t: {a: tt for a, s in steps.items()
                 if (tt := time_to_target(a, s, t, ranges.get(a), source, pipefisher_k)) is not None}
             for t in targets}
    best = {t: min(times[t], key=lambda a: times[t][a][0]) for t in targets}
    rows = []
    for arm, s in steps.items():
        row = [arm, f"{s * 1e3:.1f}", f"{s / ref:.3f}"]
        for t in targets:
            if arm not in times[t]:
                row += ["not calibrated", "", ""]
                continue
            tt, nv = times[t][arm], times[t]["nvlamb"]
            ratio = f"{tt[0] / nv[0]:.2f} [{tt[1] / nv[2]:.2f}–{tt[2] / nv[1]:.2f}]"
            sep = "" if arm == "nvlamb" else (" not sep." if overlap(tt, nv) else " sep.")
            b = best[t]
            vs_best = "fastest" if arm == b else (f"{'overlaps' if overlap(tt, times[t][b]) else 'behind'} {b}")
            row += [f"{tt[0]:.0f} [{tt[1]:.0f}–{tt[2]:.0f}]", ratio + sep, vs_best]
        rows.append(row)
    head = ["arm", "step ms", "× nvlamb step"]
    for t in targets:
        head += [f"{t}: s [interval]", f"{t}: × nvlamb", f"{t}: vs fastest"]
    return f"**{title}**\n\n" + h.table(head, rows)


def report(out: Path, source: StepsSource = STUDY) -> str:
    parts = [source.describe()]
    d2 = out / "d2.json"
    if d2.is_file():
        doc = json.loads(d2.read_text())
        parts.append(f"D=2 measured: {doc['hardware']}; `{doc['command']}`; {doc['loads'][0]} before, "
                     f"{doc['loads'][-1]} after")
        by_sched: dict[str, dict[str, float]] = {}
        for key, r in doc["runs"].items():
            s, a = key.split("/")
            by_sched.setdefault(s, {})[a] = r["step_s"]
        for s, steps in by_sched.items():
            rounds = {a: doc["runs"][f"{s}/{a}"]["rounds_s"] for a in steps}
            k = doc["runs"].get(f"{s}/pipefisher", {}).get("k")
            parts.append(setting_table(steps, f"D=2 measured, {s}, 4 micro-batches of 8",
                                       {a: (min(v), max(v)) for a, v in rounds.items()}, source, k))
            parts.append("rounds (ms): " + "; ".join(f"{a} " + ", ".join(f"{x * 1e3:.0f}" for x in v)
                                                    for a, v in rounds.items()))
        all_runs = {key: r["step_s"] for key, r in doc["runs"].items()}
        parts.append(ranking(all_runs, "D=2 measured, every (schedule, arm)",
                             {key: (min(r["rounds_s"]), max(r["rounds_s"])) for key, r in doc["runs"].items()},
                             source, {key.split("/")[0]: r["k"] for key, r in doc["runs"].items()
                                      if key.endswith("/pipefisher")}))
    paired = out / "paired.json"
    if paired.is_file():
        doc = json.loads(paired.read_text())
        parts.append(f"Optimizer step alone, paired ({doc['hardware']}, {doc['threads']} thread, {doc['reps']} "
                     f"rounds, {doc['load']}; `{doc['command']}`)\n\n" + h.table(
                         ["arm", "step ms (median)", "× nvlamb (median of pairs)"],
                         [[a, 1e3 * v, doc["pair_ratio_to_nvlamb"][a]] for a, v in doc["step_s"].items()]))
    d8 = out / "d8.json"
    if d8.is_file():
        doc = json.loads(d8.read_text())
        layers = doc.get("layers")
        model = (f"{layers} encoder layers split evenly over the model stages" if layers
                 else "one encoder layer per model stage")

        def ms(v: float | list[float]) -> str:
            return f"{v:.2f}" if isinstance(v, float) else "/".join(f"{x:.1f}" for x in v)

        work = doc.get("profile_f_plus_b_ms", {})
        parts.append(f"D=8 simulated ({model}; each N's costs the median of {doc.get('profiles', 1)} profile(s)): "
                     f"{doc['hardware']}; `{doc['command']}`; the profiles' STEP (ms): "
                     + ", ".join(f"{a} {ms(v)}" for a, v in doc["profile_step_ms"].items())
                     + ("; their F+B over both stages (ms): " + ", ".join(f"{a} {ms(v)}" for a, v in work.items())
                        if work else "")
                     + "; optimizer step / NVLAMB's (paired): "
                     + ", ".join(f"{a} {v:.3f}" for a, v in doc["step_ratio_to_nvlamb"].items()))
        for setting, r in doc["simulated"].items():
            parts.append(setting_table(r["step_s"], f"D=8 simulated, {setting} (PipeFisher k={r['pipefisher_k']}, "
                                                    f"{r['pipefisher_note']})", None, source, r["pipefisher_k"]))
        if doc.get("skipped"):
            parts.append("not simulated: " + "; ".join(f"{k} ({why})" for k, why in doc["skipped"].items()))
        all_runs = {f"{setting}/{a}": v for setting, r in doc["simulated"].items() for a, v in r["step_s"].items()}
        parts.append(ranking(all_runs, "D=8 simulated, every (schedule, N, arm)", None, source,
                             {setting: r["pipefisher_k"] for setting, r in doc["simulated"].items()}))
    return "\n\n".join(parts) + "\n"


def ranking(steps: dict[str, float], title: str, ranges: dict[str, tuple[float, float]] | None = None,
            source: StepsSource = STUDY, pipefisher_ks: dict[str, int] | None = None) -> str:
    """The eight fastest (setting/arm) to the hardest target (H-0.3, or the calibration's last loss) over all of
    a setting's runs, with overlap against the first; uncalibrated arms left out. ``pipefisher_ks``: PipeFisher's
    k per setting (the key less its arm)."""
    ranges, ks = ranges or {}, pipefisher_ks or {}
    target = source.targets[-1]
    timed = ((key, time_to_target(key.rsplit("/", 1)[1], s, target, ranges.get(key), source,
                                  ks.get(key.rsplit("/", 1)[0]))) for key, s in steps.items())
    rows = sorted(((key, t) for key, t in timed if t is not None), key=lambda kv: kv[1][0])
    first = rows[0][1]
    return f"**{title}, fastest to {target}**\n\n" + h.table(
        ["rank", "schedule/arm", "s [interval]", "vs first"],
        [[i + 1, k, f"{t[0]:.0f} [{t[1]:.0f}–{t[2]:.0f}]", "" if i == 0 else
          ("overlaps" if overlap(t, first) else "separated")] for i, (k, t) in enumerate(rows[:8])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--measure", action="store_true", help="D=2 measured runs (minutes)")
    p.add_argument("--simulate", action="store_true", help="D=8 simulated from profiles taken here (minutes)")
    p.add_argument("--paired", type=int, default=0, metavar="REPS", help="the optimizer step alone, paired, REPS rounds")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="steps per D=2 run (PipeFisher at least 32)")
    p.add_argument("--runs", default="", help="schedule/arm,... (default: the study's list, D2_RUNS)")
    p.add_argument("--methods", default="chimera,1f1b,zb-h1", help="D=8 simulated schedules")
    p.add_argument("--micro-batches", default="8,16", help="D=8 simulated N (batch 32: micro-batch 32/N)")
    p.add_argument("--layers", type=int, default=None,
                   help="D=8 simulated model's encoder layers (default one per model stage: 8, or 16 for a "
                        "two-chunk schedule; give 16 to compare every schedule on one model)")
    p.add_argument("--profiles", type=int, default=3, help="D=8: profiles per micro-batch size, taking turns; "
                   "each N's costs are their element-wise median")
    p.add_argument("--timeout-s", type=int, default=900)
    p.add_argument("--calibration", type=Path, default=None,
                   help="steps from this calibration file (bench/convergence.py --calibration-out) instead of study 7's")
    p.add_argument("--target-loss", default="",
                   help="--calibration: held-out losses, comma-separated (default: the file's hardest)")
    args = p.parse_args()
    source = STUDY  # checked before any measurement: a bad --calibration or --target-loss costs no minutes
    if args.calibration is not None:
        cal, losses = h.read_calibration_for(args.calibration, [float(x) for x in args.target_loss.split(",") if x])
        source = StepsSource(cal, losses)
    elif args.target_loss:
        raise SystemExit("--target-loss needs --calibration FILE (study 7's targets are H-0.2 and H-0.3)")
    methods = tuple(args.methods.split(","))
    if args.simulate:
        if args.profiles < 1:
            raise SystemExit(f"--profiles {args.profiles}: take at least one profile per micro-batch size (3 or more "
                             f"to compare N=8 with N=16)")
        unknown = [m for m in methods if m not in sc.SIMULATED_METHODS]
        if unknown:
            raise SystemExit(f"--methods {','.join(unknown)}: use {', '.join(sc.SIMULATED_METHODS)}")
        for m in methods:  # a bad --layers is refused here, before the profiles' minutes
            try:
                sc.layers_per_model_stage(m, 8, args.layers)
            except ValueError as err:
                raise SystemExit(str(err)) from None
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [tuple(x.split("/")) for x in args.runs.split(",") if x] or D2_RUNS
    start = time.perf_counter()
    if args.measure:
        measure_d2(args.out, args.rounds, args.steps, runs, args.timeout_s)  # type: ignore[arg-type]
    if args.paired:
        paired_steps(args.out, args.paired)
    if args.simulate:
        simulate_d8(args.out, methods, tuple(int(n) for n in args.micro_batches.split(",")), args.paired or 20,
                    args.layers, args.profiles)
    text = report(args.out, source)
    (args.out / "tables.md").write_text(text)
    print(text)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    h.main_guard(main)
