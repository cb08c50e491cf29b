"""The convergence study's time to target (§7) repriced on today's step costs, per schedule × optimizer.

    python bench/reprice.py --out DIR --measure      # D=2 measured: every (schedule, arm) pipeline, rotated rounds
    python bench/reprice.py --out DIR --simulate     # D=8 simulated (N=8 and 16) from D=2 profiles taken here
    python bench/reprice.py --out DIR                # the tables (markdown) from DIR/d2.json and DIR/d8.json

Steps to target are the study's (bench/studies/07-convergence.md, seeds 0-2 mean and range; the numerics do not
depend on the schedule, the placement or Newton-Schulz's time), step costs are measured or simulated here;
time to target = steps × step cost, its interval = the seed range of steps × the step (the step's own noise is
given beside it, not folded in). Bench study 17 (bench/studies/17-repriced-time-to-target.md) reads the output.

D=2 measured: ``train.py stages=2 pipeline=<schedule>`` with 4 micro-batches of 8 (global batch 32, bert-tiny,
vocabulary 8,192, seq 64, 10 predictions: the study's shape), synthetic data of that shape (step cost does not
depend on the text), evaluation off, both workers unpinned; per run the mean step over whole refresh cycles after
the first two (``convergence.cycle_mean_step_s``, the study's estimator), per (schedule, arm) the median over
rounds; the order of the runs rotates every round.

D=8 simulated: one ``optimizer=kfac`` profile at D=2 chimera (micro-batch 4 for N=8, 2 for N=16: batch 32), scaled
to one encoder layer per stage (``bench/step_costs.py``); NVLAMB, K-FAC every step and PipeFisher (its planner's
defaults) as step_costs.py simulates them, and AdamW and Muon as NVLAMB's pipeline with the STEP action's cost
scaled by that optimizer's STEP / NVLAMB's STEP measured side by side in ``profile.py`` runs of D=2 chimera here
(Muon with ``ns_dtype=auto`` and ``bf16``). zb-v (two model chunks per worker) is not in step_costs.py's methods.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness as h
import step_costs as sc
from convergence import arm_overrides, cycle_mean_step_s

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
STEPS_OF = {"nvlamb": "nvlamb", "adamw": "adamw", "muon": "muon", "muon-bf16": "muon", "kfac-k1": "kfac-k1",
            "pipefisher": "pipefisher"}

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
        order = runs[r % len(runs):] + runs[:r % len(runs)]
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


# --- D=8 simulated ---------------------------------------------------------------------------------------------

STEP_ARMS = {"nvlamb": ["optimizer=nvlamb"], "adamw": ["optimizer=adamw"], "muon": ["optimizer=muon"],
             "muon-bf16": ["optimizer=muon", "optimizer.ns_dtype=bf16"]}


def step_action_ns(out: Path, rounds: int) -> dict[str, float]:
    """Mean STEP action (ns, per worker) of each optimizer in ``profile.py`` runs of D=2 chimera at the study's
    shape, the optimizers' runs in rotated rounds; per optimizer the median over rounds."""
    arms = list(STEP_ARMS)
    per: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            keys = [*SHAPE, "stages=2", "pipeline=chimera", "micro_batch_size=8", "num_micro_batches=4", "steps=6",
                    *STEP_ARMS[arm]]
            path = sc.profile_run(keys, out / "step-profiles" / f"round{r}" / arm)
            cost, _ = _costs(path)
            per[arm].append(cost.step_ns)
            print(f"  STEP round {r}: {arm} {cost.step_ns / 1e6:.2f} ms ({h.load()})", flush=True)
    return {a: statistics.median(v) for a, v in per.items()}


def _costs(path: Path) -> tuple[Any, Any]:
    from pipefisher.planning.costs import RunShape, costs_from_profile
    from pipefisher.profiling import read_profile

    profile = read_profile(path)
    return costs_from_profile(profile, path=path), RunShape.from_train_config(profile.metadata["config"])


def simulate_d8(out: Path, methods: tuple[str, ...], ns: tuple[int, ...], step_rounds: int) -> dict[str, Any]:
    """D=8 step seconds per (method, N, arm); writes ``out/d8.json``."""
    steps_ns = step_action_ns(out, step_rounds)
    sims: dict[str, Any] = {}
    for n in ns:
        mb = 32 // n
        keys = sc.profile_overrides("bert-tiny", 64, mb, max_predictions=10, method="chimera", micro_batches=4,
                                    overrides=["model.vocab_size=8192"])
        print(f"profiling (optimizer=kfac, micro-batch {mb}): python profile.py {' '.join(keys)} ({h.load()})",
              flush=True)
        cost, measured = sc.load_costs(sc.profile_run(keys, out / f"kfac-profile-mb{mb}"))
        for method in methods:
            rows = sc.simulated_step_costs(cost, measured, 8, method, n, intervals=(1,))
            res = {"nvlamb": rows["nvlamb"]["step_s"], "kfac-k1": rows["kfac-k1"]["step_s"],
                   "pipefisher": rows["pipefisher"]["step_s"]}
            target = sc.simulated_run(measured, 8, method, n)
            schedule = target.build_schedule(dp_width=1)
            for arm in ("adamw", "muon", "muon-bf16"):
                c = dataclasses.replace(cost, step_ns=round(cost.step_ns * steps_ns[arm] / steps_ns["nvlamb"]))
                res[arm] = sc.steady_step_ns((schedule,), sc.scale_costs(c, measured, target)) / 1e9
            sims[f"{method}/N={n}"] = {"step_s": res, "pipefisher_k": rows["pipefisher"]["k"],
                                       "pipefisher_note": rows["pipefisher"]["note"]}
            print(f"  D=8 {method} N={n}: " + ", ".join(f"{a} {v * 1e3:.1f} ms" for a, v in res.items()), flush=True)
    doc = {"command": "python " + " ".join(sys.argv), "hardware": _hardware(), "step_action_ms":
           {a: v / 1e6 for a, v in steps_ns.items()}, "simulated": sims}
    (out / "d8.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# --- tables ----------------------------------------------------------------------------------------------------


def time_to_target(arm: str, step_s: float, target: str) -> tuple[float, float, float]:
    """(mean, low, high) seconds to ``target``: the study's steps (mean, seed range) × ``step_s``."""
    m, lo, hi = STUDY_STEPS[STEPS_OF[arm]][target]
    return m * step_s, lo * step_s, hi * step_s


def overlap(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether two [low, high] intervals overlap (the arms are then not separated)."""
    return a[1] <= b[2] and b[1] <= a[2]


def setting_table(steps: dict[str, float], title: str) -> str:
    """Markdown: per arm its step, × NVLAMB's step, time to each target (s, seed interval), × NVLAMB's time
    [range over seed pairs] and whether it is separated from NVLAMB's and from the fastest arm."""
    ref = steps["nvlamb"]
    times = {t: {a: time_to_target(a, s, t) for a, s in steps.items()} for t in TARGETS}
    best = {t: min(times[t], key=lambda a: times[t][a][0]) for t in TARGETS}
    rows = []
    for arm, s in steps.items():
        row = [arm, f"{s * 1e3:.1f}", f"{s / ref:.3f}"]
        for t in TARGETS:
            tt, nv = times[t][arm], times[t]["nvlamb"]
            ratio = f"{tt[0] / nv[0]:.2f} [{tt[1] / nv[2]:.2f}–{tt[2] / nv[1]:.2f}]"
            sep = "" if arm == "nvlamb" else (" not sep." if overlap(tt, nv) else " sep.")
            b = best[t]
            vs_best = "fastest" if arm == b else (f"{'overlaps' if overlap(tt, times[t][b]) else 'behind'} {b}")
            row += [f"{tt[0]:.0f} [{tt[1]:.0f}–{tt[2]:.0f}]", ratio + sep, vs_best]
        rows.append(row)
    head = ["arm", "step ms", "× nvlamb step"]
    for t in TARGETS:
        head += [f"{t}: s [seeds]", f"{t}: × nvlamb", f"{t}: vs fastest"]
    return f"**{title}**\n\n" + h.table(head, rows)


def report(out: Path) -> str:
    parts = []
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
            parts.append(setting_table(steps, f"D=2 measured, {s}, 4 micro-batches of 8"))
            parts.append("rounds (ms): " + "; ".join(f"{a} " + ", ".join(f"{x * 1e3:.0f}" for x in v)
                                                    for a, v in rounds.items()))
        all_runs = {key: r["step_s"] for key, r in doc["runs"].items()}
        parts.append(ranking(all_runs, "D=2 measured, every (schedule, arm)"))
    d8 = out / "d8.json"
    if d8.is_file():
        doc = json.loads(d8.read_text())
        parts.append(f"D=8 simulated: {doc['hardware']}; `{doc['command']}`; STEP action per worker at D=2 "
                     "chimera (ms): " + ", ".join(f"{a} {v:.2f}" for a, v in doc["step_action_ms"].items()))
        for setting, r in doc["simulated"].items():
            parts.append(setting_table(r["step_s"], f"D=8 simulated, {setting} (PipeFisher k={r['pipefisher_k']}, "
                                                    f"{r['pipefisher_note']})"))
        all_runs = {f"{setting}/{a}": v for setting, r in doc["simulated"].items() for a, v in r["step_s"].items()}
        parts.append(ranking(all_runs, "D=8 simulated, every (schedule, N, arm)"))
    return "\n\n".join(parts) + "\n"


def ranking(steps: dict[str, float], title: str) -> str:
    """The five fastest (schedule, arm) to H-0.3 over all of a setting's runs, with overlap against the first."""
    rows = sorted(((k, time_to_target(k.rsplit("/", 1)[1], s, "H-0.3")) for k, s in steps.items()),
                  key=lambda kv: kv[1][0])
    first = rows[0][1]
    return f"**{title}, fastest to H-0.3**\n\n" + h.table(
        ["rank", "schedule/arm", "s [seeds]", "vs first"],
        [[i + 1, k, f"{t[0]:.0f} [{t[1]:.0f}–{t[2]:.0f}]", "" if i == 0 else
          ("overlaps" if overlap(t, first) else "separated")] for i, (k, t) in enumerate(rows[:8])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--measure", action="store_true", help="D=2 measured runs (minutes)")
    p.add_argument("--simulate", action="store_true", help="D=8 simulated from profiles taken here (minutes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="steps per D=2 run (PipeFisher at least 32)")
    p.add_argument("--runs", default="", help="schedule/arm,... (default: the study's list, D2_RUNS)")
    p.add_argument("--methods", default="chimera,1f1b,zb-h1", help="D=8 simulated schedules")
    p.add_argument("--micro-batches", default="8,16", help="D=8 simulated N (batch 32: micro-batch 32/N)")
    p.add_argument("--step-rounds", type=int, default=2, help="rounds of the STEP profiles")
    p.add_argument("--timeout-s", type=int, default=900)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [tuple(x.split("/")) for x in args.runs.split(",") if x] or D2_RUNS
    start = time.perf_counter()
    if args.measure:
        measure_d2(args.out, args.rounds, args.steps, runs, args.timeout_s)  # type: ignore[arg-type]
    if args.simulate:
        simulate_d8(args.out, tuple(args.methods.split(",")), tuple(int(n) for n in args.micro_batches.split(",")),
                    args.step_rounds)
    text = report(args.out)
    (args.out / "tables.md").write_text(text)
    print(text)
    if not math.isclose(start, time.perf_counter()):
        print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    h.main_guard(main)
