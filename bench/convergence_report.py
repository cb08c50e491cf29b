"""The convergence study's report: ``table.md``, ``results.json`` and the figures in the study's folder.

Tables per global batch size: the tuning grids and picks; steps to each target per arm (mean ± sd
[range] over seeds); time to each target per setting (steps × the arm's step cost there) with ratios
against NVLAMB and against the best other arm, marked separated or not; the staleness arms' held-out
loss at equal steps. Figures: held-out loss against step and against time (seed bands: the range
over seeds), and the staleness cost.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import convergence_analysis as ca


def _score_text(score: float, by_steps: bool) -> str:
    """A tuning score as text: steps to the hardest target, or the final loss (no target, or missed)."""
    if not math.isfinite(score):
        return "diverged"
    if not by_steps:
        return f"final {score:.3f}"
    if score >= ca.UNREACHED:
        return f"missed (final {score - ca.UNREACHED:.3f})"
    return f"{score:.0f} steps"


def _finals_text(finals: dict[float, float], best: float | None, edge: bool | None, by_steps: bool) -> str:
    cells = [f"{v:g}: {_score_text(f, by_steps)}" for v, f in sorted(finals.items())]
    tail = "" if best is None else f" → **{best:g}**" + (" (at the grid's edge)" if edge else "")
    return ", ".join(cells) + tail


def seed_curves(results: dict[str, dict[str, Any]], picks: ca.Picks, spec: ca.StudySpec, batch: int,
                arm: str) -> list[list[tuple[int, float]]]:
    """The held-out curves of ``arm``'s finished runs at its pick, one per seed."""
    curves = []
    for seed in range(spec.seeds):
        run = ca.chosen_run(picks, batch, arm, seed)
        if run is not None and run.key in results and results[run.key]["status"] == "ok":
            curves.append(results[run.key]["curve"])
    return curves


def steps_intervals(curves: list[list[tuple[int, float]]], targets: dict[str, float]) -> dict[str, ca.Interval]:
    return {name: ca.seed_interval([ca.steps_to_target(c, t) for c in curves]) for name, t in targets.items()}


def best_other(times: dict[str, ca.Interval], arm: str) -> str | None:
    """The arm other than ``arm`` (and other than its PipeFisher twins) with the lowest mean time, among
    arms whose every seed reached the target."""
    others = {a: t for a, t in times.items() if a != arm and t.complete}
    return min(others, key=lambda a: others[a].mean) if others else None


def write(out: Path, args: argparse.Namespace, spec: ca.StudySpec, data: Any, results: dict[str, dict[str, Any]]) -> None:
    """Write table.md, results.json and the figures of the study in ``out``."""
    unigram = data.unigram if data is not None else math.nan
    drops = [float(d) for d in args.drops.split(",")]
    targets = ca.targets_below(unigram, drops) if math.isfinite(unigram) else {}
    hardest = min(targets.values()) if targets else None
    scores = {k: ca.tuning_score(r["curve"], hardest) for k, r in results.items()}
    _, picks = ca.plan_runs(spec, scores)
    costs: dict[str, dict[str, float]] = json.loads(args.step_costs.read_text()) if args.step_costs else {}
    ks = ca.pipefisher_ks(args.pipefisher_k)
    pf = {setting: ca.pipefisher_arm(k) for setting, k in ks.items()}
    lines = [f"# Convergence study: {args.model}, seq {args.seq_len}, micro-batch {args.micro_batch_size}",
             "",
             (f"Held-out unigram entropy H = {unigram:.3f} nats (cross-entropy under the training frequencies "
              f"{data.cross:.3f}); targets: " + ", ".join(f"{n} = {t:.3f}" for n, t in targets.items()))
             if data is not None else "Synthetic data: no held-out text, no targets.",
             f"Seeds per final arm: {spec.seeds}; K-FAC factor decay {args.decay_per_step} ** k; "
             f"PipeFisher's interval per setting: {ks}.", ""]
    report: dict[str, Any] = {"targets": targets, "unigram": unigram, "batches": {}}
    arms = list(dict.fromkeys(spec.final_arms))
    curves = {b: {a: seed_curves(results, picks, spec, b, a) for a in arms} for b in spec.steps}
    for batch, steps in spec.steps.items():
        lines += [f"## Global batch {batch} ({batch // args.micro_batch_size} × {args.micro_batch_size}), "
                  f"{steps} steps", "", "Tuning at seed 0 (per value: steps to the hardest target; a run that missed it ranks behind, by its "
                  "final held-out loss):", ""]
        for fam in spec.lr_grid:
            lines.append(f"- {fam}: " + _finals_text(picks.lr_finals.get((batch, fam), {}), picks.lr.get((batch, fam)),
                                                     picks.lr_edge.get((batch, fam)), bool(targets)))
        if batch in picks.damping_finals:
            lines.append("- kfac damping at its lr: " + _finals_text(picks.damping_finals[batch], picks.damping.get(batch),
                                                                     picks.damping_edge.get(batch), bool(targets)))
        steps_by_arm = {a: steps_intervals(curves[batch][a], targets) for a in arms}
        lines += ["", "Steps to target (mean ± sd [range] over seeds):", "",
                  "| arm | seeds | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
        for a in arms:
            label = a + "".join(f" (PipeFisher {s})" for s, p in pf.items() if p == a)
            lines.append(f"| {label} | {len(curves[batch][a])} | " + " | ".join(steps_by_arm[a][t].text() for t in targets) + " |")
        batch_report: dict[str, Any] = {"steps_to_target": {a: {t: vars(i) for t, i in v.items()}
                                                            for a, v in steps_by_arm.items()}, "time": {}}
        for setting, cost in _settings(costs, batch).items():
            priced = {a: cost[_cost_arm(a, pf, setting)] for a in arms if _cost_arm(a, pf, setting) in cost}
            if not priced:
                continue
            lines += ["", f"Time to target, {setting} (steps × step cost; ratio [range], separated or not):", "",
                      "| arm | step s | " + " | ".join(f"{t} s | ×nvlamb | ×best other" for t in targets) + " |",
                      "|---|---|" + "---|---|---|" * len(targets)]
            times = {t: {a: ca.time_to_target(steps_by_arm[a][t], s) for a, s in priced.items()
                         if steps_by_arm[a][t].n > 0} for t in targets}
            for a, s in priced.items():
                cells = [a, f"{s:.3f}"]
                for t in targets:
                    ti = times[t].get(a)
                    if ti is None:
                        cells += ["not reached", "–", "–"]
                        continue
                    base = times[t].get("nvlamb")
                    twins = {*pf.values(), *(x for x in times[t] if ca.pipefisher_run(x) is not None)}
                    other = best_other({x: v for x, v in times[t].items() if x not in twins or x == a}, a)  # not its twin
                    cells += [ti.text(), ca.ratio(ti, base).text() if base else "–",
                              f"{ca.ratio(ti, times[t][other]).text()} ({other})" if other else "–"]
                lines.append("| " + " | ".join(cells) + " |")
            batch_report["time"][setting] = {t: {a: vars(i) for a, i in v.items()} for t, v in times.items()}
        ref = curves[batch].get("kfac-k1", [])
        gaps = {a: ca.max_mean_gap(curves[batch][a], ref) for a in arms if a != "kfac-k1"}
        if any(g is not None for g in gaps.values()):
            lines += ["", "Held-out gap to K-FAC refreshing every step: the largest difference of seed-mean held-out "
                      "loss over every evaluation (positive: behind kfac-k1):", "",
                      "| arm | seeds | max gap (nats) | at step |", "|---|---|---|---|"]
            for a, g in gaps.items():
                if g is not None:
                    lines.append(f"| {a} | {len(curves[batch][a])} | {g[0]:+.3f} | {g[1]} |")
            batch_report["max_gap_to_kfac_k1"] = {a: g for a, g in gaps.items() if g is not None}
        if hardest is not None:
            multipliers = _write_staleness_curves(out, batch, targets, results, picks, spec, arms)
            hard = min(targets, key=targets.get)
            nv, k1 = steps_by_arm.get("nvlamb", {}).get(hard), steps_by_arm.get("kfac-k1", {}).get(hard)
            if nv is not None and k1 is not None and nv.complete and k1.complete:
                tradeoff = _trade_off_lines(costs, batch, multipliers, k1.mean / nv.mean, hard)
                lines += tradeoff[0]
                batch_report["trade_off"] = tradeoff[1]
        stale = list(dict.fromkeys(["kfac-k1"] + list(spec.stale_arms)))
        marks = [steps // 4, steps // 2, 3 * steps // 4, steps]
        lines += ["", "Staleness at seed 0: held-out loss after equal steps (k = refresh interval; deferred: inverses "
                  "used from the next cycle on, PipeFisher's numerics):", "",
                  "| arm | " + " | ".join(f"@{m}" for m in marks) + " |", "|---|" + "---|" * len(marks)]
        for a in stale:
            run = ca.chosen_run(picks, batch, a, 0)
            r = results.get(run.key) if run is not None else None
            if r is None:
                continue
            lines.append(f"| {a} | " + " | ".join(_num(ca.loss_at(r["curve"], m)) for m in marks) + " |")
        lines += ["", "Every finished run (the tuning runs included): final held-out loss and steps to each target:", "",
                  "| run | final | " + " | ".join(targets) + " |", "|---|---|" + "---|" * len(targets)]
        for key, r in sorted(results.items()):
            if r["batch"] != batch:
                continue
            reached = [ca.steps_to_target(r["curve"], t) for t in targets.values()]
            lines.append(f"| {key} | {r['final']:.3f} | " + " | ".join("not reached" if s is None else f"{s:.0f}"
                                                                       for s in reached) + " |")
        report["batches"][str(batch)] = batch_report
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    _figures(out, spec, picks, results, curves, targets, costs, pf)
    print("\n".join(lines))


def _trade_off_lines(costs: dict[str, dict[str, float]], batch: int,
                     multipliers: dict[str, dict[int, tuple[float, int]]],
                     kfac1_over_nvlamb: float, target: str) -> tuple[list[str], dict[str, Any]]:
    """The trade-off tables of ``batch`` (one per step-cost setting with ``pipefisher-kK`` or more than one
    ``kfac-kK`` entry) and their figures for results.json."""
    lines: list[str] = []
    report: dict[str, Any] = {}
    for setting, cost in _settings(costs, batch).items():
        rows = ca.trade_off(cost, multipliers, kfac1_over_nvlamb) if "nvlamb" in cost else []
        if not any(r.pipefisher_step is not None for r in rows) and sum(r.kfac_step is not None for r in rows) < 2:
            continue
        lines += ["", f"Trade-off, {setting}: what a refresh every k steps costs per step and in steps to {target} "
                  f"(steps multiplier: mean steps of kfac-kK[-deferred] over kfac-k1's on the same seeds; time × "
                  f"nvlamb = step × multiplier × kfac-k1's mean steps over NVLAMB's, {kfac1_over_nvlamb:.3f}):", "",
                  "| k | PipeFisher step × nvlamb | deferred: steps × (seeds) | time × nvlamb | when_ready plan (age ≤ k): "
                  "step × nvlamb | steps × (seeds) | time × nvlamb | K-FAC fresh, critical path: step × nvlamb | "
                  "steps × (seeds) | time × nvlamb |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r.k} | {_num(r.pipefisher_step)} | {_num(r.deferred_steps)} ({r.deferred_seeds}) | "
                         f"{_num(r.pipefisher_time)} | {_num(r.ready_step)} | {_num(r.ready_steps)} ({r.ready_seeds}) | "
                         f"{_num(r.ready_time)} | "
                         f"{_num(r.kfac_step)} | {_num(r.fresh_steps)} ({r.fresh_seeds}) | {_num(r.kfac_time)} |")
        report[setting] = [dict(vars(r), pipefisher_time=r.pipefisher_time, ready_time=r.ready_time,
                                kfac_time=r.kfac_time) for r in rows]
    return lines, report


def _write_staleness_curves(out: Path, batch: int, targets: dict[str, float], results: dict[str, dict[str, Any]],
                            picks: ca.Picks, spec: ca.StudySpec,
                            arms: list[str]) -> dict[str, dict[int, tuple[float, int]]]:
    """staleness_b<batch>.json (deferred arms: promote_inverses=at_cycle_end) and
    staleness_b<batch>_when_ready.json (``-ready`` arms), the files ``optimizer.staleness_curve``
    takes: steps multiplier per k at the hardest target (pipefisher.planning.staleness).

    Returns:
        mode (deferred, ready, fresh) -> :func:`convergence_analysis.staleness_multipliers` of the K-FAC arms."""
    name, target = min(targets.items(), key=lambda kv: kv[1])
    steps: dict[str, dict[int, float | None]] = {}
    for arm in dict.fromkeys(["kfac-k1", *spec.stale_arms, *arms]):
        for seed in range(spec.seeds):
            run = ca.chosen_run(picks, batch, arm, seed)
            r = results.get(run.key) if run is not None else None
            if r is not None and r["status"] == "ok":
                steps.setdefault(arm, {})[seed] = ca.steps_to_target(r["curve"], target)
    multipliers = {mode: ca.staleness_multipliers(steps, mode) for mode in ("deferred", "ready", "fresh")}
    for mode, suffix in (("deferred", ""), ("ready", "_when_ready")):
        mult = multipliers[mode]
        if len(mult) < 2:
            continue
        doc = {"promote_inverses": ca.PROMOTE_OF_MODE[mode], "multiplier": {str(k): round(m, 4) for k, (m, _) in mult.items()},
               "seeds": {str(k): n for k, (_, n) in mult.items()}, "target": f"{name} = {target:.3f}",
               "source": f"bench/convergence.py study {out.name}, global batch {batch}: steps of kfac-kK-{mode} / "
                         f"kfac-k1 over the same seeds"}
        (out / f"staleness_b{batch}{suffix}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return multipliers


def _cost_arm(arm: str, pf: dict[str, str], setting: str) -> str:
    """The step-cost entry of ``arm`` in ``setting``: PipeFisher's trajectory arm costs PipeFisher's step
    there, and PipeFisher's own D=2 run (``pipefisher-d2[-cM]``) costs the timed ``pipefisher[-cM]`` at D=2
    only (its plan is D=2's: unpriced elsewhere);
    another deferred arm costs what critical-path K-FAC at its interval costs."""
    curvature = ca.pipefisher_run(arm)
    if curvature is not None:  # pipefisher-d2[-cM]: the timed pipefisher[-cM]
        return ("pipefisher" + (f"-c{curvature}" if curvature else "")) if setting.split()[0] == "D=2" else arm
    if pf.get(setting.split()[0]) == arm or pf.get(setting) == arm:
        return "pipefisher"
    return arm.removesuffix("-deferred")


def _settings(costs: dict[str, dict[str, float]], batch: int) -> dict[str, dict[str, float]]:
    """The step-cost settings that apply to ``batch``: a setting named "..., batch N" only to batch N."""
    out = {}
    for name, cost in costs.items():
        tail = name.rpartition("batch ")[2]
        if "batch " not in name or (tail.isdigit() and int(tail) == batch):
            out[name] = cost
    return out


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.3f}"


def _figures(out: Path, spec: ca.StudySpec, picks: ca.Picks, results: dict[str, dict[str, Any]],
             curves_by_batch: dict[int, dict[str, list]],
             targets: dict[str, float], costs: dict[str, dict[str, float]], pf: dict[str, str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    for batch in spec.steps:
        settings = [None] + list(_settings(costs, batch))
        fig, axes = plt.subplots(1, len(settings), figsize=(6.2 * len(settings), 4.4), squeeze=False)
        for ax, setting in zip(axes[0], settings):
            for arm in dict.fromkeys(spec.final_arms):
                curves = curves_by_batch[batch][arm]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                x = np.array([s for s, _ in curves[0][:n]], dtype=float)
                if setting is not None:
                    key = _cost_arm(arm, pf, setting)
                    if key not in costs[setting]:
                        continue
                    x = x * costs[setting][key]
                y = np.array([[v for _, v in c[:n]] for c in curves])
                label = arm + "".join(f" = PipeFisher {s}" for s, p in pf.items() if p == arm)
                line, = ax.plot(x, y.mean(0), lw=1.4, label=f"{label} ({len(curves)} seeds)")
                ax.fill_between(x, y.min(0), y.max(0), color=line.get_color(), alpha=0.2)
            for (name, t), color in zip(targets.items(), ("gray", "black", "silver")):
                ax.axhline(t, color=color, ls="--", lw=0.8, label=f"target {name} = {t:.2f}")
            ax.set_xlabel("step" if setting is None else f"seconds ({setting} step cost × steps)")
            ax.set_ylabel("held-out MLM loss")
            ax.set_title(f"batch {batch}" + ("" if setting is None else f", {setting}"))
            if targets:
                lo = min(targets.values()) - 0.15
                ax.set_ylim(lo, lo + 1.0)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"heldout_b{batch}.png", dpi=110)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6.2, 4.4))
        for arm in dict.fromkeys(["kfac-k1"] + list(spec.stale_arms) + ["nvlamb"]):
            run = ca.chosen_run(picks, batch, arm, 0)
            if run is None or run.key not in results:
                continue
            c = results[run.key]["curve"]
            ax.plot([s for s, _ in c], [v for _, v in c], lw=1.2, ls=":" if arm.endswith("deferred") else "-", label=arm)
        for (name, t), color in zip(targets.items(), ("gray", "black", "silver")):
            ax.axhline(t, color=color, ls="--", lw=0.8)
        if targets:
            lo = min(targets.values()) - 0.15
            ax.set_ylim(lo, lo + 1.0)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out MLM loss (seed 0)")
        ax.set_title(f"staleness, batch {batch}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"staleness_b{batch}.png", dpi=110)
        plt.close(fig)
