"""What-if search: rank pipeline shapes and optimizers by predicted throughput under a memory budget.

For a model, a device count and a global batch, every combination of method, stages D (a divisor
of the device count; data-parallel width W = devices / D), micro-batch size, recomputation and
optimizer is either ranked by predicted samples per second (simulated with
:func:`~pipefisher.planning.costs.estimate_costs`; PipeFisher planned with
:func:`~pipefisher.planning.assign.plan_pipefisher`) or excluded with the reason: a shape the
method does not support, a global batch that does not split into micro-batches, or a memory
estimate (:func:`~pipefisher.planning.memory.estimate_memory`) over the budget.

One data-parallel group is simulated (the groups run identical lists); W enters through the
all-reduce costs and the global batch.

The methods are every schedule train.py runs (``METHODS``): ``chimera-doubling`` is
``pipeline=chimera pipeline.chimera_stacking=doubling``. Each one's memory is the memory model's
for its own schedule (forward doubling holds D more activations than direct concatenation; the V
schedules zb-v, dualpipev, v-half and v-min two chunks per worker, v-half and v-min under a smaller
activation bound). A split backward (zb-h1 and the V schedules) costs ``split_backward_ratio`` × B for its
I + W together (each half of it): 1.07 measured on bert-mini (bench/README.md), where the FLOPs
alone would give 1.0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass, replace

from pipefisher.config import V_METHODS
from pipefisher.model.config import BertConfig
from pipefisher.planning.costs import Hardware, RunShape, estimate_run_costs, stage_parameters
from pipefisher.planning.memory import estimate_memory, worker_parameters
from pipefisher.planning.optimizer_costs import ELEMENTWISE_OPTIMIZERS, muon_matrices, optimizer_step_seconds
from pipefisher.planning.pipefisher_plan import PlanOptions, pipefisher_defaults, plan_for
from pipefisher.planning.predict import predict_assignment, predict_schedule
from pipefisher.schedules.kfac import critical_path_assignment
from pipefisher.simulate import CostModel

__all__ = ["METHODS", "SPLIT_BACKWARD_RATIO", "Candidate", "format_candidates", "split_backward_costs", "what_if"]

log = logging.getLogger(__name__)

METHODS = ("gpipe", "1f1b", "chimera", "chimera-doubling", "interleaved", "zb-h1", *V_METHODS)
SPLIT_METHODS = ("zb-h1", *V_METHODS)  # their backward is split into I and W
SPLIT_BACKWARD_RATIO = 1.0  # (I+W)/B: the same FLOPs as B; measured in the pipeline 0.96 (bert-mini) and 1.00 (bert-medium; bench/README.md §8, §13)
OPTIMIZERS = ("nvlamb", "adamw", "muon", "kfac", "pipefisher")


@dataclass(frozen=True)
class Candidate:
    """One configuration of the search and its prediction (or why it was excluded).

    Attributes:
        method, stages, num_virtual, micro_batch_size, dp_width, num_micro_batches, recompute,
        optimizer: the configuration (``stages`` = workers per pipeline).
        samples_per_s: predicted throughput (None when excluded before simulation).
        step_time_s: predicted mean step time.
        utilization: predicted bubble utilization.
        interval: K-FAC refresh interval (1 for nvlamb and the kfac baseline).
        memory_gb: estimated memory of the most loaded worker.
        excluded: why the configuration cannot run, or None.
    """

    method: str
    stages: int
    num_virtual: int
    micro_batch_size: int
    dp_width: int
    num_micro_batches: int
    recompute: bool
    optimizer: str
    samples_per_s: float | None = None
    step_time_s: float | None = None
    utilization: float | None = None
    interval: int | None = None
    memory_gb: float | None = None
    excluded: str | None = None

    @property
    def shape(self) -> str:
        """The configuration without the optimizer."""
        v = f" v={self.num_virtual}" if self.method in ("interleaved", *V_METHODS) else ""
        n = self.num_micro_batches or "-"
        return (f"{self.method} D={self.stages}{v} W={self.dp_width} mbs={self.micro_batch_size} N={n} "
                f"recompute={str(self.recompute).lower()}")

    @property
    def label(self) -> str:
        return f"{self.shape} {self.optimizer}"


def shape_problem(bert: BertConfig, method: str, d: int, v: int, n: int) -> str | None:
    if method in ("chimera", "chimera-doubling") and d % 2:
        return f"{method} needs an even number of stages (stages={d})"
    if method == "chimera-doubling" and n % (2 * d):
        return f"chimera-doubling needs num_micro_batches={n} to be a multiple of 2 x stages={2 * d}"
    if method in V_METHODS and n < 2 * d:
        return f"{method} needs num_micro_batches={n} to be at least 2 x stages={2 * d}"
    if method == "interleaved" and d == 1 and v > 1:
        return "interleaved needs stages>=2 (one stage leaves its virtual stages nobody to pass activations to)"
    if d * v > bert.num_layers + 2:  # train.py's limit (config.validation): the embeddings and the heads may have stages of their own
        return (f"{d * v} model stages exceed model.num_layers={bert.num_layers} + 2 (one encoder layer per stage, "
                f"plus a stage for the heads and one for the embeddings)")
    if method in ("chimera", "interleaved") and n % d:
        return f"{method} needs num_micro_batches={n} to be a multiple of stages={d}"
    return None


def what_if(bert: BertConfig, *, devices: int, memory_gb: float, global_batch: int,
            hardware: Hardware = Hardware(), methods: Sequence[str] = METHODS,
            micro_batch_sizes: Sequence[int] = (4, 8, 16, 32), optimizers: Sequence[str] = OPTIMIZERS,
            recompute: Sequence[bool] = (False, True), num_virtual: int = 2, seq_len: int = 128,
            max_predictions: int = 20, precision: str = "fp32", max_interval: int = 8,
            split_backward_ratio: float = SPLIT_BACKWARD_RATIO, plan_options: PlanOptions | None = None,
            device: str = "cuda") -> list[Candidate]:
    """Rank configurations by predicted throughput; list the excluded ones with the reason.

    Args:
        bert: the model.
        devices: GPUs (workers) available; every configuration uses all of them.
        memory_gb: memory per device.
        global_batch: sequences per optimizer step.
        hardware: device and link speeds for the cost estimate.
        methods, micro_batch_sizes, optimizers, recompute: the search space.
        num_virtual: model chunks per worker for interleaved.
        seq_len, max_predictions, precision: the data shape.
        max_interval: largest PipeFisher refresh interval (with ``plan_options`` None).
        split_backward_ratio: (I+W)/B of zb-h1 and zb-v, a split backward's cost relative to a full one.
        plan_options: PipeFisher's planner options; None: train.py's ``optimizer=pipefisher`` defaults with
            ``max_interval`` (``planning.pipefisher_plan``, [Note: one planning path]).
        device: whose peak the memory model predicts (``planning.memory``): ``cuda`` or ``cpu``.

    Returns:
        The feasible candidates, best first, then the excluded ones.
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"whatif method {m!r}: choose from {', '.join(METHODS)}")
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise ValueError(f"whatif optimizer {o!r}: choose from {', '.join(OPTIMIZERS)}")
    if not split_backward_ratio > 0:
        raise ValueError(f"split_backward_ratio={split_backward_ratio!r}: (I+W)/B must be positive, e.g. 1.07")
    if devices < 1 or global_batch < 1 or not memory_gb > 0:
        raise ValueError(f"devices={devices}, global_batch={global_batch}, memory_gb={memory_gb}: all must be positive")
    ranked: list[Candidate] = []
    excluded: list[Candidate] = []
    budget = memory_gb * 1e9
    options = plan_options or replace(pipefisher_defaults(), max_interval=max_interval)
    divisors = [x for x in range(1, devices + 1) if devices % x == 0]
    progress = Progress(len(methods) * len(divisors))
    for method in methods:
        v = num_virtual if method == "interleaved" else 2 if method in V_METHODS else 1
        for d in divisors:
            w = devices // d
            progress.start(f"{method} D={d} W={w}")
            for mbs in micro_batch_sizes:
                for rc in recompute:
                    base = Candidate(method, d, v, mbs, w, 0, rc, "")
                    if global_batch % (mbs * w):
                        for o in optimizers:
                            excluded.append(replace(base, optimizer=o, excluded=(
                                f"global_batch={global_batch} is not a multiple of micro_batch_size×data_parallel={mbs * w}")))
                        continue
                    n = global_batch // (mbs * w)
                    base = replace(base, num_micro_batches=n)
                    problem = shape_problem(bert, method, d, v, n)
                    if problem:
                        excluded += [replace(base, optimizer=o, excluded=problem) for o in optimizers]
                        continue
                    run = RunShape(bert, method, d, n, mbs, w, v, seq_len, max_predictions, None, rc, precision)
                    ranked_here, excluded_here = _evaluate(run, base, optimizers, hardware, budget, options,
                                                           split_backward_ratio, device)
                    ranked += ranked_here
                    excluded += excluded_here
    progress.done(len(ranked), len(excluded))
    ranked.sort(key=lambda c: -c.samples_per_s)
    return ranked + excluded


class Progress:
    """One log line per (method, stages) group of the search, with the elapsed time and a rough
    ETA (the mean time of the groups so far), so a search of a minute or more is not silent (issue 16)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.count = 0
        self.t0 = time.monotonic()

    def start(self, what: str) -> None:
        elapsed = time.monotonic() - self.t0
        eta = f", about {elapsed / self.count * (self.total - self.count):.0f} s left" if self.count else ""
        self.count += 1
        log.info("whatif: [%d/%d] %s (%.0f s elapsed%s)", self.count, self.total, what, elapsed, eta)

    def done(self, ranked: int, excluded: int) -> None:
        log.info("whatif: searched %d groups in %.0f s: %d configurations ranked, %d excluded",
                 self.total, time.monotonic() - self.t0, ranked, excluded)


def split_backward_costs(cost: CostModel, ratio: float) -> CostModel:
    """``cost`` with each stage's I and W at half of ``ratio`` × its full backward."""
    half = [round(b * ratio / 2) for b in cost.backward_ns]
    return replace(cost, input_grad_ns=tuple(half), weight_grad_ns=tuple(half))


def _evaluate(run: RunShape, base: Candidate, optimizers: Sequence[str], hardware: Hardware, budget: float,
              options: PlanOptions, split_backward_ratio: float,
              device: str = "cuda") -> tuple[list[Candidate], list[Candidate]]:
    schedule = run.build_schedule(dp_width=1)
    cost = estimate_run_costs(run, hardware)
    if run.method in SPLIT_METHODS:
        cost = split_backward_costs(cost, split_backward_ratio)
    ranked, excluded = [], []
    for opt in optimizers:
        cand = replace(base, optimizer=opt)
        mem = estimate_memory(run, opt, schedule, device=device)
        if mem.total > budget:
            excluded.append(replace(cand, memory_gb=mem.total_gb, excluded=(
                f"memory {mem.describe()} exceeds memory_gb={budget / 1e9:g}")))
            continue
        if opt in ELEMENTWISE_OPTIMIZERS:
            pred, _ = predict_schedule(schedule, cost if opt == "nvlamb" else _step_cost(run, schedule, cost, opt,
                                                                                           hardware))
        else:
            if opt == "kfac":
                a = critical_path_assignment(schedule, run.kfac_layers, 1)
            else:
                a = plan_for(schedule, cost, run.kfac_layers, options).assignment
            mem = estimate_memory(run, opt, schedule, a, device)
            if mem.total > budget:
                excluded.append(replace(cand, memory_gb=mem.total_gb, interval=a.interval, excluded=(
                    f"memory {mem.describe()} (with K-FAC captures) exceeds memory_gb={budget / 1e9:g}")))
                continue
            pred, _ = predict_assignment(a, cost, opt)
        ranked.append(replace(cand, samples_per_s=run.global_batch / pred.step_time_s, step_time_s=pred.step_time_s,
                              utilization=pred.utilization, interval=pred.interval, memory_gb=mem.total_gb))
    return ranked, excluded


def _step_cost(run: RunShape, schedule, cost: CostModel, optimizer: str, hardware: Hardware) -> CostModel:
    """``cost`` with STEP charging ``optimizer``'s own step in place of NVLAMB's 28 bytes per parameter
    (``planning.optimizer_costs``), on the most loaded worker."""
    params = stage_parameters(run.bert, run.partition)
    delta = 0.0
    for w in schedule.actions:
        stages = [s for (_, _, s) in schedule.placement.stages_of(w)]
        p = worker_parameters(run, params, stages)
        mats = [m for s in stages for m in muon_matrices(run.bert, run.encoder_layers[s])]
        delta = max(delta, optimizer_step_seconds(optimizer, p, mats, hardware)
                    - optimizer_step_seconds("nvlamb", p, mats, hardware))
    return replace(cost, step_ns=cost.step_ns + max(0, round(delta * 1e9)))


def ranking_lines(ranked: Sequence[Any], top: int, noun: str, plural: str, memory_decimals: int) -> list[str]:
    """Header and one line per ranked row (at most ``top``; rows with ``samples_per_s``, ``step_time_s``,
    ``utilization``, ``interval``, ``memory_gb`` and ``label``), then what was left off or that nothing fits:
    the ranking of :func:`format_candidates` and of the strategy search's ``format_strategies``."""
    lines = [f"{'rank':>4}  {'samples/s':>10}  {'step ms':>9}  {'util':>6}  {'k':>2}  {'mem GB':>7}  {noun}"]
    for i, c in enumerate(ranked[:top], 1):
        lines.append(f"{i:>4}  {c.samples_per_s:>10.1f}  {c.step_time_s * 1e3:>9.2f}  {c.utilization:>6.1%}  "
                     f"{c.interval:>2}  {c.memory_gb:>7.{memory_decimals}f}  {c.label}")
    if len(ranked) > top:
        lines.append(f"      … {len(ranked) - top} more feasible {plural}")
    if not ranked:
        lines.append(f"      no {noun} fits: raise memory_gb or devices, or lower the batch")
    return lines


def format_candidates(candidates: Sequence[Candidate], top: int = 20) -> str:
    """The ranking and the exclusions as text (at most ``top`` lines of each)."""
    ranked = [c for c in candidates if c.excluded is None]
    excluded = [c for c in candidates if c.excluded is not None]
    lines = ranking_lines(ranked, top, "configuration", "configurations", memory_decimals=1)
    # One line per configuration and reason (listing its optimizers); over-budget ones first.
    groups: dict[tuple[str, str], list[str]] = {}
    for c in excluded:
        groups.setdefault((c.shape, c.excluded), []).append(c.optimizer)
    order = sorted(groups, key=lambda key: "exceeds memory_gb" not in key[1])
    lines.append(f"excluded ({len(excluded)} configurations):")
    for shape, reason in order[:top]:
        lines.append(f"      {shape} {','.join(groups[(shape, reason)])}: {reason}")
    if len(order) > top:
        lines.append(f"      … {len(order) - top} more (all rows in whatif.json)")
    return "\n".join(lines)
