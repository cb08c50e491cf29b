"""Step cost per optimizer arm, simulated at D stages from per-stage costs measured here.

    python bench/step_costs.py --model bert-tiny --seq-len 64 --micro-batch-size 32 --stages 8 --method chimera --micro-batches 8
    python bench/step_costs.py --profile outputs/.../profile.sqlite --stages 8    # reuse a profile
    python bench/step_costs.py ... --override model.vocab_size=8192 --json costs.json

The convergence study (``bench/convergence.py``) counts each optimizer's steps to a loss target in
single-process runs; this module gives the other factor, seconds per step, for a pipelined setting
that is simulated (``pipefisher.simulate``), and the same simulation at the measured D=2 so the two
can stand beside the measured D=2 step times. Importable API: :func:`profile_overrides` and
:func:`profile_run` (measure), :func:`load_costs`, :func:`simulated_run` and :func:`scale_costs`,
:func:`arm_step_costs`, :func:`simulated_step_costs`, :func:`measured_step_costs`, :func:`steady_step_ns`.

1. **Measure.** ``python profile.py`` (the project's own training path, synthetic data, CPU, gloo)
   runs the model at D=2 (``--profile-method``, chimera; ``--profile-micro-batches``, 4) with
   ``optimizer=kfac`` refreshing every step, so every K-FAC unit (CURV_A, CURV_B, SYNC_FACTOR per
   layer, INVERT per layer, PRECOND per stage) is recorded; ``costs_from_profile`` turns the events
   into a ``CostModel`` (means per stage, kind and layer).
2. **Scale to D stages** (:func:`scale_costs`): every simulated model stage holds m encoder layers of
   the measured width (``--layers``: one per model stage by default); its F, B (I, W), PRECOND and
   gradient all-reduce are m × the measured model's totals per encoder layer, i.e. the mean over the
   measured stages divided by the encoder layers a measured stage holds (for bert-tiny at D=2: exactly
   the mean of the two stages), and its 6m K-FAC layers cost the mean of the measured K-FAC layers at
   the same position (query, key, value, attention output, intermediate, output). Two-chunk methods
   (interleaved, zb-v, dualpipev, v-half, v-min: ``TWO_CHUNK_METHODS``) have 2D model stages, so the
   same model is ``--layers 2D`` for every method (2 layers per stage for one chunk per worker, 1 per
   chunk for two).
3. **Simulate each arm** on the D-stage schedule (``--method``, default chimera as in the PipeFisher
   paper; ``--micro-batches`` N, default 2D, the N/D of the measured D=2 runs, N=4):

   - ``nvlamb``: the pipeline alone (also the figure for adamw and muon);
   - ``kfac-k{K}``: ``critical_path_assignment(..., interval=K)``, all of a refresh after phase 0's
     flush, PRECOND in every step;
   - ``pipefisher-k{K}``: ``plan_interval(..., K)``, PipeFisher's bubble plan at a forced interval
     (what each k costs, for the trade-off against stale curvature's steps);
   - ``pipefisher-k{K}-ready``: the fastest plan at K whose curvature is at most K steps old with
     inverses promoted when ready: the plain plan if every INVERT is in its curvature's phase, else
     ``plan_interval(..., K, max_invert_lag=0)`` (the numerics of the ``kfac-kK-ready`` arms);
   - ``pipefisher``: ``plan_pipefisher`` under optimizer=pipefisher's defaults (``max_interval`` 8,
     ``promote="when_ready"``, ``max_staleness`` 8), the k it picks reported.

   PipeFisher rows carry ``curvature_age``: the plan's age bound under when_ready promotion.

   The step time of every arm is the same estimator (:func:`steady_step_ns`): simulate one whole
   refresh cycle (k steps; 1 for nvlamb) as warm-up and ``cycles`` (2) more, and divide the time
   between the last STEP of the warm-up cycle and the last STEP of the run by the steps after it
   (the pipeline fill of the first step does not count; a factor all-reduce or a worker that runs
   into the next cycle does).

Approximations (say them wherever a figure is used):

- The measured stages hold one encoder layer of bert-tiny plus the embeddings (stage 0) or the MLM
  and NSP heads (stage 1); the heads (a vocabulary-wide decoder on the masked positions) cost several
  encoder layers (bert-tiny, seq 64, micro-batch 32: stage 1's F is 5-6x stage 0's), so a simulated
  stage carries ``1/L`` of the embeddings and heads beside its layer:
  its F and B are larger, relative to its K-FAC work, than a bare encoder layer's would be, which
  makes K-FAC look cheaper than for a deep model of the same width.
- F and B are from a K-FAC run (forwards and backwards of a refresh step capture the layers' inputs
  and output gradients); STEP is the measured NVLAMB step of a D=2 worker, scaled by the parameter
  share of a simulated worker (stages per worker / encoder layers per measured stage; x1 for a
  chimera profile simulated as chimera). adamw and muon are given NVLAMB's step cost and pipeline.
- Gradient and factor all-reduces cost what issuing them took (``costs_from_profile``), and nothing
  where the simulated method has one replica per stage; messages keep the measured latency.
- CPU costs (workers <= cores, DESIGN.md "Conventions"), measured on a shared machine: absolute
  times follow the load of the moment (two profiles of the same run here differed 2.3x), ratios to
  nvlamb much less; the simulator has no contention, no per-step global barrier, and runs K-FAC
  units at their measured means.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h
from pipefisher.planning.assign import plan_interval, plan_pipefisher
from pipefisher.schedules.kfac import curvature_age_bound
from pipefisher.planning.costs import RunShape, costs_from_profile
from pipefisher.profiling import read_profile
from pipefisher.schedules import ActionKind, Schedule, build_schedule
from pipefisher.schedules.kfac import LINEARS_PER_ENCODER_LAYER, critical_path_assignment, kfac_layer_counts
from pipefisher.simulate import CostModel, simulate_phases

__all__ = ["INTERVALS", "METHODS", "SIMULATED_METHODS", "TWO_CHUNK_METHODS", "arm_step_costs", "default_max_predictions",
           "layers_per_model_stage", "load_costs", "measured_step_costs", "median_costs", "profile_overrides",
           "profile_run", "scale_costs", "simulated_run", "simulated_schedule", "simulated_step_costs",
           "steady_step_ns"]

INTERVALS = (1, 2, 4, 8)
METHODS = ("gpipe", "1f1b", "chimera", "zb-h1")  # one model chunk per worker: what a profile is taken on
TWO_CHUNK_METHODS = ("interleaved", "zb-v", "dualpipev", "v-half", "v-min")  # two model chunks per worker
SIMULATED_METHODS = METHODS + TWO_CHUNK_METHODS
_BASE = ["device=cpu", "progress=false", "wandb.mode=disabled"]  # as _harness.compose


# -- 1. measure --------------------------------------------------------------------------------


def default_max_predictions(seq_len: int) -> int:
    """Masked positions per sequence at NVIDIA's phase-1 rate, 20 per 128 tokens (64 -> 10)."""
    return max(1, round(20 * seq_len / 128))


def profile_overrides(model: str, seq_len: int, micro_batch_size: int, *, max_predictions: int | None = None,
                      method: str = "chimera", micro_batches: int = 4, steps: int = 6,
                      overrides: Sequence[str] = ()) -> list[str]:
    """The ``profile.py`` keys of the D=2 measurement (``overrides`` last, so they win)."""
    p = default_max_predictions(seq_len) if max_predictions is None else max_predictions
    return [f"model={model}", "stages=2", f"pipeline={method}", f"micro_batch_size={micro_batch_size}",
            f"num_micro_batches={micro_batches}", f"data.seq_len={seq_len}", f"data.max_predictions={p}",
            f"steps={steps}", "optimizer=kfac", *overrides]


def profile_run(keys: Sequence[str], out_dir: str | Path | None = None) -> Path:
    """Run ``python profile.py <keys>`` (CPU, no wandb) and return its ``profile.sqlite``.

    The keys are composed and validated first (``_harness.compose``), so a bad key fails before
    any worker starts. The run's log is ``<out_dir>/profile.log``.

    Raises:
        RuntimeError: the profiling run failed; the message holds the end of its log.
    """
    h.compose(list(keys))
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="step-costs-"))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "profile.log"
    cmd = [sys.executable, "profile.py", *_BASE, *keys, f"hydra.run.dir={out}"]
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=h.REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    path = out / "profile.sqlite"
    if rc != 0 or not path.is_file():
        tail = "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); end of {log}:\n{tail}")
    return path


def load_costs(path: str | Path) -> tuple[CostModel, RunShape]:
    """The measured cost model of a profile and the run it was taken from (its config)."""
    profile = read_profile(path)
    cost = costs_from_profile(profile, path=path)  # names the file and the fix when the config is missing
    return cost, RunShape.from_train_config(profile.metadata["config"])


def median_costs(costs: Sequence[CostModel]) -> CostModel:
    """The element-wise median of cost models of the same run (repeated profiles): every action's cost, per stage
    and per K-FAC layer, is the median over the profiles (one profile's load moves its costs together: four
    profiles of the same run gave F+B of 32.7–40.4 ms at micro-batch 4 and 16.8–24.7 ms at 2,
    bench/studies/18-budget-calibration.md).

    Raises:
        ValueError: no cost models, or models of different shapes (stages, K-FAC layers).
    """
    if not costs:
        raise ValueError("median_costs: give at least one cost model")

    def med(values: Sequence[Any], name: str) -> Any:
        if isinstance(values[0], tuple):
            if len({len(v) for v in values}) != 1:
                raise ValueError(f"median_costs: {name} differs in shape between the profiles (not the same run)")
            return tuple(med([v[i] for v in values], name) for i in range(len(values[0])))
        return round(statistics.median(values))

    return CostModel(**{f.name: med([getattr(c, f.name) for c in costs], f.name)
                        for f in dataclasses.fields(CostModel)})


# -- 2. scale ----------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> int:
    return round(statistics.fmean(values))


def scale_costs(cost: CostModel, measured: RunShape, target: RunShape) -> CostModel:
    """``cost`` (per stage of ``measured``) as a cost model of ``target``, m encoder layers in every stage.

    Per simulated stage: F, B, I, W, PRECOND and the gradient all-reduce are the mean over the
    measured stages divided by ``e = L / D_measured``, the encoder layers a measured stage holds
    (the measured model's total per encoder layer), times m; its 6m K-FAC layers cost the mean of
    the measured K-FAC layers at the same position within an encoder layer; STEP scales with a
    worker's parameter share, ``step · (target stages per worker) · m / (measured stages per worker · e)``.
    All-reduces cost 0 where ``target`` has one replica per stage.

    Raises:
        ValueError: ``target``'s stages hold unequal numbers of encoder layers (or none), the widths
            differ, or ``cost`` has no K-FAC tables.
    """
    m = target.encoder_layers[0]
    if m < 1 or target.encoder_layers != [m] * target.num_model_stages:
        raise ValueError(f"target run has encoder layers {target.encoder_layers} per stage; give every stage the "
                         f"same number, at least one (simulated_run does: model.num_layers a multiple of the "
                         f"model stages)")
    if target.bert.hidden_size != measured.bert.hidden_size:
        raise ValueError(f"target hidden size {target.bert.hidden_size} != measured {measured.bert.hidden_size}")
    if cost.kfac_layers is None:
        raise ValueError("the cost model has no K-FAC unit costs; measure with optimizer=kfac")
    d, n = target.num_model_stages, LINEARS_PER_ENCODER_LAYER
    e = measured.bert.num_layers / measured.num_model_stages

    def per_stage(values: Sequence[int]) -> tuple[int, ...]:
        return (round(statistics.fmean(values) * m / e),) * d

    def per_layer(table: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        by_position: dict[int, list[int]] = defaultdict(list)
        for row in table:
            for layer, value in enumerate(row):
                by_position[layer % n].append(value)
        return (tuple(_mean(by_position[pos]) for pos in range(n)) * m,) * d

    replicated = target.num_replicas > 1
    zeros = ((0,) * (n * m),) * d
    return CostModel(
        forward_ns=per_stage(cost.forward_ns),
        backward_ns=per_stage(cost.backward_ns),
        input_grad_ns=per_stage(cost.input_grad_ns),
        weight_grad_ns=per_stage(cost.weight_grad_ns),
        p2p_ns=cost.p2p_ns,
        sync_ns=per_stage(cost.sync_ns) if replicated else (0,) * d,
        step_ns=round(cost.step_ns * target.stages_per_worker * m / (measured.stages_per_worker * e)),
        curv_a_ns=per_layer(cost.curv_a_ns),
        curv_b_ns=per_layer(cost.curv_b_ns),
        sync_factor_ns=per_layer(cost.sync_factor_ns) if replicated else zeros,
        invert_ns=per_layer(cost.invert_ns),
        precond_ns=per_stage(cost.precond_ns),
    )


# -- 3. simulate -------------------------------------------------------------------------------


def steady_step_ns(phases: Sequence[Schedule], cost: CostModel, cycles: int = 2) -> float:
    """Mean step time over ``cycles`` whole refresh cycles after a first (warm-up) cycle.

    Simulates ``1 + cycles`` cycles of ``phases`` (``simulate_phases``) and divides the time from
    the last STEP of the first cycle to the last STEP of the last one by ``cycles · len(phases)``.
    """
    if cycles < 1:
        raise ValueError(f"cycles={cycles}: average over at least one cycle after the warm-up")
    k = len(phases)
    step_end: dict[int, int] = defaultdict(int)
    for e in simulate_phases(phases, cost, cycles=cycles + 1):
        if e.kind == ActionKind.STEP.value:
            step_end[e.step] = max(step_end[e.step], e.end_ns)
    return (step_end[(cycles + 1) * k - 1] - step_end[k - 1]) / (cycles * k)


def arm_step_costs(schedule: Schedule, cost: CostModel, kfac_layers: Sequence[int], *,
                   intervals: Sequence[int] = INTERVALS, max_interval: int = 8, curvature_micro_batches: int = 0,
                   cycles: int = 2, max_staleness: int | None = 8,
                   promote: str = "when_ready") -> dict[str, dict[str, Any]]:
    """Simulated step time of each optimizer arm on ``schedule`` under ``cost``.

    Returns:
        ``{arm: {"step_s", "k", "ratio_to_nvlamb", "note"}}`` for ``nvlamb`` (k None),
        ``kfac-k{K}`` for K in ``intervals`` (critical path), ``pipefisher-k{K}`` (the bubble plan
        at the forced interval K: its step cost for the trade-off against staleness) and
        ``pipefisher`` (its planned k; its note gives the planner's lower bound k_min, the share of
        a refresh the plan puts in bubbles, and whether the planner fell back to the critical path).
    """
    out: dict[str, dict[str, Any]] = {}

    def add(arm: str, step_ns: float, k: int | None, note: str = "", age: int | None = None) -> None:
        out[arm] = {"step_s": step_ns / 1e9, "k": k, "note": note,
                    **({"curvature_age": age} if age is not None else {})}

    def exposed_note(spilled_ns: int, tail_ns: int) -> str:
        exposed = spilled_ns + tail_ns
        return f"{exposed / 1e6:.2f} ms of a refresh outside the bubbles" if exposed else "refresh within the bubbles"

    add("nvlamb", steady_step_ns((schedule,), cost, cycles), None)
    for k in intervals:
        a = critical_path_assignment(schedule, kfac_layers, k, curvature_micro_batches=curvature_micro_batches)
        add(f"kfac-k{k}", steady_step_ns(a.phases, cost, cycles), k)
    for k in intervals:
        a, stats = plan_interval(schedule, cost, kfac_layers, k, curvature_micro_batches=curvature_micro_batches)
        age = curvature_age_bound(a, "when_ready")
        add(f"pipefisher-k{k}", steady_step_ns(a.phases, cost, cycles), k,
            exposed_note(stats.spilled_ns, stats.tail_ns), age)
        if age > k:  # some INVERT lags its curvature: plan k keeping each in its curvature's phase
            a, stats = plan_interval(schedule, cost, kfac_layers, k, curvature_micro_batches=curvature_micro_batches,
                                     max_invert_lag=0)
            age = curvature_age_bound(a, "when_ready")
        add(f"pipefisher-k{k}-ready", steady_step_ns(a.phases, cost, cycles), k,
            exposed_note(stats.spilled_ns, stats.tail_ns), age)
    plan = plan_pipefisher(schedule, cost, kfac_layers, max_interval=max_interval, max_staleness=max_staleness,
                           promote=promote, curvature_micro_batches=curvature_micro_batches)
    meta = plan.metadata
    work = meta.get("kfac_work_ns", 0)
    exposed = meta.get("spilled_ns", 0) + meta.get("tail_ns", 0)
    note = f"k_min={meta.get('k_min')}, {1 - exposed / work if work else 1:.0%} of a refresh in bubbles"
    if meta.get("fallback"):
        note += "; critical path was faster (planner's fallback)"
    add("pipefisher", steady_step_ns(plan.phases, cost, cycles), plan.interval, note,
        curvature_age_bound(plan, promote))
    base = out["nvlamb"]["step_s"]
    for row in out.values():
        row["ratio_to_nvlamb"] = row["step_s"] / base
    return out


def simulated_run(measured: RunShape, stages: int = 8, method: str = "chimera",
                  micro_batches: int | None = None, layers: int | None = None) -> RunShape:
    """The D-stage run of the simulation: ``measured``'s width, seq and micro-batch size, ``layers``
    encoder layers (default: one per model stage, i.e. D, or 2D for a two-chunk method) split evenly over
    the model stages (D, or 2D for a method in ``TWO_CHUNK_METHODS``), N = ``micro_batches`` (default 2D).

    Raises:
        ValueError: an unknown method, or ``layers`` not a positive multiple of the model stages.
    """
    m = layers_per_model_stage(method, stages, layers)
    chunks = 2 if method in TWO_CHUNK_METHODS else 1
    bert = dataclasses.replace(measured.bert, num_layers=m * stages * chunks)
    return dataclasses.replace(measured, bert=bert, method=method, stages=stages,
                               num_micro_batches=micro_batches or 2 * stages, dp_width=1, num_virtual=chunks,
                               layers_per_stage=(m,) * (stages * chunks), order_costs=None, activation_memory=1.0)


def layers_per_model_stage(method: str, stages: int, layers: int | None = None) -> int:
    """Encoder layers in each model stage when ``layers`` (default: one per model stage) are split evenly over
    ``method``'s model stages at D = ``stages`` (D, or 2D for a two-chunk method).

    Raises:
        ValueError: an unknown method, or ``layers`` not a positive multiple of the model stages.
    """
    if method not in SIMULATED_METHODS:
        raise ValueError(f"--method {method!r}: use one of {', '.join(SIMULATED_METHODS)}")
    model_stages = stages * (2 if method in TWO_CHUNK_METHODS else 1)
    layers = model_stages if layers is None else layers
    if layers < model_stages or layers % model_stages:
        raise ValueError(f"--layers {layers}: {method} at D={stages} has {model_stages} model stages; give a "
                         f"multiple of {model_stages} so that every stage holds the same encoder layers")
    return layers // model_stages


def simulated_step_costs(cost: CostModel, measured: RunShape, stages: int = 8, method: str = "chimera",
                         micro_batches: int | None = None, layers: int | None = None,
                         **options: Any) -> dict[str, dict[str, Any]]:
    """:func:`arm_step_costs` at D = ``stages`` (``layers`` encoder layers, :func:`simulated_run`) from the
    measured costs scaled by :func:`scale_costs`.

    ``options`` go to :func:`arm_step_costs` (intervals, max_interval, curvature_micro_batches, cycles).
    """
    target = simulated_run(measured, stages, method, micro_batches, layers)
    scaled = scale_costs(cost, measured, target)
    schedule = simulated_schedule(target, scaled)
    return arm_step_costs(schedule, scaled, kfac_layer_counts(schedule, target.encoder_layers), **options)


LIST_SCHEDULED = ("zb-v", "v-half", "v-min")  # their order comes from a list scheduler given stage costs


def simulated_schedule(target: RunShape, cost: CostModel) -> Schedule:
    """The schedule of the simulated run (one data-parallel group). zb-v, v-half and v-min are ordered by the
    costs they are simulated with (``cost``'s per-stage F and mean F/I/W), not by ``RunShape``'s estimate of
    the partition: the simulated stages are equal (each carries its share of the embeddings and heads), while
    the estimate puts the heads in the V's last stage, and an order built for that stage took 2.5× as long on
    equal stages in tests/test_reprice_bench.py's case."""
    if target.method not in LIST_SCHEDULED:
        return target.build_schedule(dp_width=1)
    options: dict[str, Any] = {"stage_costs": list(cost.forward_ns),
                               "order_costs": [statistics.fmean(x) for x in
                                               (cost.forward_ns, cost.input_grad_ns, cost.weight_grad_ns)]}
    if target.method == "zb-v":
        options["activation_memory"] = target.activation_memory
    return build_schedule(target.method, target.stages, target.num_micro_batches, 1,
                          num_virtual=target.num_virtual, **options)


def measured_step_costs(cost: CostModel, measured: RunShape, micro_batches: int | None = None,
                        **options: Any) -> dict[str, dict[str, Any]]:
    """:func:`arm_step_costs` of the measured run itself (its D, method and stages, the measured
    costs unscaled); ``micro_batches`` overrides its N."""
    run = dataclasses.replace(measured, num_micro_batches=micro_batches or measured.num_micro_batches)
    return arm_step_costs(run.build_schedule(dp_width=1), cost, run.kfac_layers, **options)


# -- CLI ---------------------------------------------------------------------------------------


def _cost_line(cost: CostModel) -> str:
    ms = 1e-6
    layers = cost.kfac_layers or ()
    curv = statistics.fmean(sum(a) + sum(b) for a, b in zip(cost.curv_a_ns, cost.curv_b_ns)) * ms
    inv = statistics.fmean(sum(r) for r in cost.invert_ns) * ms
    return (f"per stage (mean): F {statistics.fmean(cost.forward_ns) * ms:.2f} ms, B "
            f"{statistics.fmean(cost.backward_ns) * ms:.2f} ms, PRECOND {statistics.fmean(cost.precond_ns) * ms:.2f} ms, "
            f"curvature of one micro-batch {curv:.2f} ms and inversion {inv:.2f} ms over its {layers[0] if layers else 0} "
            f"K-FAC layers; STEP {cost.step_ns * ms:.2f} ms per worker; message {cost.p2p_ns * ms:.2f} ms")


def _table(rows: dict[str, dict[str, Any]]) -> str:
    return h.table(["arm", "k", "step ms", "step / nvlamb", "curvature age (when ready)", "note"],
                   [[arm, "" if r["k"] is None else r["k"], 1e3 * r["step_s"], r["ratio_to_nvlamb"],
                     r.get("curvature_age", ""), r["note"]] for arm, r in rows.items()])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", type=Path, help="an existing profile.sqlite (of an optimizer=kfac run) "
                        "instead of measuring; its config gives the model, seq and micro-batch size")
    parser.add_argument("--model", default="bert-tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--max-predictions", type=int, default=None, help="default: 20 per 128 tokens")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a config key for the profiling run, e.g. model.vocab_size=8192 (repeatable)")
    parser.add_argument("--profile-method", default="chimera", choices=METHODS)
    parser.add_argument("--profile-micro-batches", type=int, default=4)
    parser.add_argument("--profile-steps", type=int, default=6, help="steps of the profiling run (the first "
                        "is left out of the profile)")
    parser.add_argument("--profile-dir", type=Path, default=None, help="where the profiling run writes "
                        "(default: a new folder under the system's temp dir)")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--method", default="chimera", choices=SIMULATED_METHODS)
    parser.add_argument("--layers", type=int, default=None, help="encoder layers of the simulated model (default: "
                        "one per model stage: --stages, twice that for a two-chunk method)")
    parser.add_argument("--micro-batches", type=int, default=None, help="N at --stages (default 2 x stages)")
    parser.add_argument("--intervals", default=",".join(map(str, INTERVALS)), help="K of the kfac-k<K> arms")
    parser.add_argument("--max-interval", type=int, default=8, help="the largest k PipeFisher's planner tries")
    parser.add_argument("--max-staleness", type=int, default=8, help="the planner's bound on the curvature age "
                        "(optimizer.max_staleness; 0 = none)")
    parser.add_argument("--promote-inverses", default="when_ready", choices=("when_ready", "at_cycle_end"),
                        help="optimizer.promote_inverses of the planned pipefisher arm")
    parser.add_argument("--curvature-micro-batches", type=int, default=0,
                        help="a refresh's curvature from the first n micro-batches per pipe (0: all)")
    parser.add_argument("--cycles", type=int, default=2, help="refresh cycles averaged after the warm-up cycle")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    path = args.profile
    if path is None:
        keys = profile_overrides(args.model, args.seq_len, args.micro_batch_size,
                                 max_predictions=args.max_predictions, method=args.profile_method,
                                 micro_batches=args.profile_micro_batches, steps=args.profile_steps,
                                 overrides=args.override)
        print(f"profiling: python profile.py {' '.join(keys)} ({h.load()})", flush=True)
        start = time.perf_counter()
        path = profile_run(keys, args.profile_dir)
        print(f"profile: {path} ({time.perf_counter() - start:.0f} s, {h.load()} after; reuse it with "
              f"--profile {path})")
    cost, measured = load_costs(path)
    options = {"intervals": [int(k) for k in args.intervals.split(",")], "max_interval": args.max_interval,
               "curvature_micro_batches": args.curvature_micro_batches, "cycles": args.cycles,
               "max_staleness": args.max_staleness or None, "promote": args.promote_inverses}
    target = simulated_run(measured, args.stages, args.method, args.micro_batches, args.layers)
    sim = simulated_step_costs(cost, measured, args.stages, args.method, args.micro_batches, args.layers, **options)
    at_measured = measured_step_costs(cost, measured, **options)

    b = measured.bert
    print(f"\nmeasured: {b.num_layers} layers x H={b.hidden_size} (vocab {b.vocab_size}), {measured.method} "
          f"D={measured.stages} N={measured.num_micro_batches}, micro-batch {measured.micro_batch_size} x seq "
          f"{measured.seq_len} (P={measured.max_predictions}), optimizer=kfac, CPU; {path}")
    print("  stage F ms: " + ", ".join(f"{f / 1e6:.2f}" for f in cost.forward_ns)
          + "; B ms: " + ", ".join(f"{x / 1e6:.2f}" for x in cost.backward_ns))
    print(f"\nSimulated: {args.method}, D={target.stages}, N={target.num_micro_batches}, "
          f"{target.encoder_layers[0]} encoder layer(s) of H={b.hidden_size} in each of {target.num_model_stages} "
          f"model stages (+1/{b.num_layers} of the measured embeddings and heads per layer); "
          f"{_cost_line(scale_costs(cost, measured, target))}")
    print(_table(sim))
    print(f"\nSimulated at the measured shape: {measured.method}, D={measured.stages}, "
          f"N={measured.num_micro_batches}, measured costs unscaled")
    print(_table(at_measured))
    print("\nStep: mean over whole refresh cycles after a warm-up cycle (simulator, no contention); nvlamb's "
          "figure also stands for adamw and muon (same pipeline, NVLAMB's measured step cost); "
          "kfac-k<K>: the refresh after phase 0's flush, every K steps.")
    if args.json is not None:
        args.json.write_text(json.dumps({"profile": str(path), "measured_run": dataclasses.asdict(measured),
                                         "simulated_run": dataclasses.asdict(target),
                                         "simulated": sim, "measured_shape": at_measured}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    h.main_guard(main)
