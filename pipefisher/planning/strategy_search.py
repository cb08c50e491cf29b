"""The hybrid strategy search: pipeline (every schedule) × data parallel × sharded data parallel × tensor
parallel × micro-batches × recompute × optimizer, ranked by simulated samples/s under a per-worker memory budget.

Why one module: a candidate's memory, cost model and feasibility are all computed from the same mesh shape (pp
× dp × sdp × tp) and :class:`Strategy`, and the search ranks them together; splitting memory from costs would
split one candidate's evaluation.

Entry points: :func:`search_strategies` (the ranking, the excluded with the reason),
:func:`hybrid_costs` (the simulator's cost model of one candidate), :func:`hybrid_memory_per_worker`
(its memory), :func:`format_strategies`.

A candidate puts ``pp · dp · sdp · tp`` = ``devices`` workers on a mesh: ``pp`` pipeline stages
(``stages``), ``tp`` tensor-parallel ranks inside each stage, ``sdp`` pipelines whose stage replicas
shard their weights, gradients and optimizer state over each other (FSDP2), and ``dp`` such blocks
replicated (plain data parallel). One pipeline is simulated (``simulate``), as in ``whatif``; the
global batch is ``micro_batch_size · num_micro_batches · dp · sdp``. ``sdp`` and ``tp`` are uniform over
stages and layers: train.py runs one of each for the whole model, and a strategy it cannot run is what the search is meant to end (Galvatron's per-layer ``tp_sizes_enc`` /
``dp_types_enc`` are written per stage into the strategy file, all equal). Recompute is chosen per model
stage (issue 27; train.py's ``recompute_stages``): none, all, or, where recomputing nothing runs out of
memory, the first j stages of :func:`recompute_order` (most activation memory first), j = 1 .. D-1.

[Note: the time model] (per micro-batch; collectives priced by ``planning.comm_costs``: measured, or
the ring model; compute from FLOPs at ``Hardware.flops_per_s``, which a measurement can set)::

    F of stage s     FLOPs(embeddings, heads) + FLOPs(encoder layers) / tp, at flops_per_s
                     + tp > 1: 2 all_reduce(tp, b·S·H·bytes) per encoder layer (Megatron: after the
                       attention output and the FFN output projections), on the critical path
    B                2 F's compute (3 F where the stage recomputes) + 2 all_reduce per layer (4 there);
                     with a measured forward share f (``measure.collectives``: the forward alone beside the
                     forward + backward) the stage's compute of F + B is split f : 1 - f instead
    CURV, PRECOND, INVERT   K-FAC's FLOP estimate (``planning.costs``) at flops_per_s, or, where the file
                     sets compute.kfac_in_search, at the rates ``measure.collectives`` timed for these units
    tp > 1, measured F and B times the measured over the modelled forward + backward of the whole
                     model at that tp (``tp_measured_over_modelled``; ``measure.collectives --model``
                     times it): DTensor's dispatch and the split products' rate, which FLOPs miss
    message          p2p(b·S·H·bytes) between neighbouring stages (each tp rank to its peer)
    SYNC_GRAD(s)     sdp > 1: reduce_scatter(sdp, 4·p_s) + all_reduce(dp·twins, 4·p'_s / sdp)
                     sdp = 1: all_reduce(dp·twins, 4·p'_s)      (p'_s: without the tied word embedding)
    SYNC_FACTOR      K-FAC (sdp = 1): all_reduce(dp·twins, 4·(in² + out²)) per layer, A and G together
    STEP             sdp > 1: all_gather(sdp, 4·p_s) of the next step's weights (one gather per stage
                     per step, reshard_after_forward=false; charged here, where it is sequential too)
                     + all_reduce(tied holders / sdp, 4·V·H / sdp) of the tied weight (stage 0 and the
                     last stage, D > 1 or dp > 1) + all_reduce(world, 8) of the global norm
                     + the optimizer's own step on the most loaded worker (``planning.optimizer_costs``:
                     NVLAMB, AdamW 28 bytes per local parameter at memory_bytes_per_s; Muon 20 on its
                     matrices and their Newton-Schulz FLOPs; K-FAC and PipeFisher NVLAMB's plus their units)

    p_s: the stage's parameters on one tp rank (encoder Linear weights, their column-split biases / tp).

Left out: overlap of the all-gather with the first forward and of the reduce-scatter with later
backwards (both are charged in full: the executor waits for the gather before the first F, and the
reduce-scatter runs when it is issued); without a tp measurement, tp's smaller matrix products running
at another FLOP rate than the whole ones and DTensor's overhead; contention between a worker's compute and its own collectives on CPU; the
vocabulary-parallel embedding (tp shards encoder layers only); sequence parallel; sdp with
reshard_after_forward=true (an all-gather per F and per B: not searched).

[Note: the memory model] (bytes per worker, the largest over the pipeline's workers; p the
parameters of the stage replicas a worker holds on its tp rank)::

    sdp = 1   weights 4p, gradients 4p, optimizer 12p (NVLAMB's and AdamW's two moments and the step's
              one temporary per parameter; Muon 8 on its matrices: ``planning.optimizer_costs``):
              planning.memory's
    sdp = k   weights 4p/k sharded + 4p gathered for the step (reshard_after_forward=false), gradients
              4p accumulated unsharded over the step's micro-batches (gradient sync off until the
              stage's last backward; the 4p/k shard the reduce-scatter writes replaces them),
              optimizer 12p/k (Muon's as above, / k)
    activations  the peak over the worker's actions of what its in-flight micro-batches leave, each in
              its own stage (planning.memory.activation_peak); per encoder layer
              S·b·H·(10 + 24/tp + 5·A·S/(H·tp)) bytes at 16 bits, twice in fp32 (Korthikanti et al.
              2022, Table 2, tensor parallel without sequence parallel; at tp = 1 planning.memory's
              34 + 5AS/H); recompute keeps each layer's input (S·b·H) and one layer's activations;
              the last stage's MLM log-probabilities, as planning.memory counts them
    comm buffers the gradient sync's flat copy (sdp = 1 with replicas: 4p'), or FSDP's reduce-scatter
              input (sdp > 1: 4p); reported beside the rest, and in the total only as
              max(activations, comm buffers): the sync runs after the stage's last backward, when
              that stage's activations are gone

    allocator, runtime  planning.memory's for the search's ``device`` (cpu: glibc's retention of the
              transient tensors and the worker's non-tensor memory; cuda: none, the peak being
              ``max_memory_allocated``)

Left out: the interpreter and torch before the model (the measured peaks subtract them), the CUDA
context and the caching allocator's reserved pool over the allocated peak, K-FAC under sdp or tp
(refused by train.py: its factors are not sharded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from pipefisher.config import V_METHODS, TrainConfig
from pipefisher.config.choices import KFAC_OWNERS
from pipefisher.model.config import BertConfig
from pipefisher.model.partition import layer_costs
from pipefisher.planning.calibration import Calibration
from pipefisher.planning.comm_costs import PIECES, CommCosts, ExecutorStep
from pipefisher.planning.costs import Hardware, RunShape, estimate_run_costs, kfac_linear_dims, stage_parameters
from pipefisher.planning.executor_calibration import scale_compute, scale_kfac_units, scale_step_beyond, solve_factor
from pipefisher.planning.memory import (activation_peak, device_overhead, estimate_memory, heads_backward_bytes,
                                        mmapped_parameters, saved_heads_bytes, tied_parameters,
                                        worker_parameters)
from pipefisher.planning.optimizer_costs import (ELEMENTWISE_OPTIMIZERS, muon_matrices, optimizer_state_bytes,
                                                 optimizer_step_seconds)
from pipefisher.planning.owner_costs import shares_a_stage, with_owners
from pipefisher.planning.pipefisher_plan import PipeFisherPlan, PlanOptions, pipefisher_defaults, plan_for
from pipefisher.planning.predict import predict_assignment, predict_schedule
from pipefisher.planning.time_to_target import rank_by_time_to_target, time_lines
from pipefisher.planning.whatif import METHODS, OPTIMIZERS, SPLIT_BACKWARD_RATIO, SPLIT_METHODS, split_backward_costs
from pipefisher.planning.whatif import Progress, ranking_lines
from pipefisher.planning.whatif import shape_problem as _pipeline_problem
from pipefisher.schedules import Schedule
from pipefisher.schedules.kfac import critical_path_assignment
from pipefisher.simulate import CostModel, peak_activations

__all__ = ["HybridMemory", "Strategy", "format_strategies", "hybrid_costs", "hybrid_memory_per_worker",
           "executor_factor", "kfac_unit_factor", "model_stages", "muon_step_factor", "pipeline_costs",
           "recompute_order", "search_strategies", "strategy_plan", "tp_available", "tp_sharded_parameters"]

log = logging.getLogger(__name__)
GB = 1e9
_CHIMERA = ("chimera", "chimera-doubling")


def tp_available() -> bool:
    """Whether this version's train.py has tensor parallel (a ``tp`` key)."""
    return "tp" in {f.name for f in fields(TrainConfig)}


@dataclass(frozen=True)
class Strategy:
    """One point of the hybrid space and its prediction (or why it was excluded).

    Attributes:
        method, stages (pp), num_virtual, dp, sdp, tp, micro_batch_size, num_micro_batches, recompute,
        optimizer: the configuration (recompute: in every model stage).
        recompute_stages: with ``recompute`` False, the model stages that recompute (partial recompute);
            empty: none.
        samples_per_s, step_time_s, utilization, interval: the simulated step (interval: K-FAC's k).
        memory_gb: the most loaded worker's total; memory_per_worker_gb: every worker of a pipeline.
        excluded: why it cannot run, or None.
        curvature_age: K-FAC and PipeFisher: the oldest curvature a step preconditions with (steps).
        kfac_owners: PipeFisher: ``optimizer.kfac_owners`` its plan is priced and run with (``replicas``: each
            layer inverted and preconditioned once among a stage's replicas, [Note: pricing owners]).
        steps_multiplier, steps_low, steps_high: steps to the target relative to the calibration's reference
            (its seed interval); None: not calibrated (``planning.time_to_target``).
        time_to_target_s: predicted time to the target (steps x step time), or relative to the reference's
            steps where the calibration has no absolute steps; throughput_rank, time_rank: the two ranks.
    """

    method: str
    stages: int
    num_virtual: int
    dp: int
    sdp: int
    tp: int
    micro_batch_size: int
    num_micro_batches: int
    recompute: bool
    optimizer: str
    samples_per_s: float | None = None
    step_time_s: float | None = None
    utilization: float | None = None
    interval: int | None = None
    memory_gb: float | None = None
    memory_per_worker_gb: tuple[float, ...] = ()
    excluded: str | None = None
    recompute_stages: tuple[int, ...] = ()
    curvature_age: int | None = None
    kfac_owners: str = "holder"
    steps_multiplier: float | None = None
    steps_low: float | None = None
    steps_high: float | None = None
    time_to_target_s: float | None = None
    throughput_rank: int | None = None
    time_rank: int | None = None

    @property
    def devices(self) -> int:
        return self.stages * self.dp * self.sdp * self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp * self.sdp

    @property
    def label(self) -> str:
        v = f" v={self.num_virtual}" if self.method in ("interleaved", *V_METHODS) else ""
        return (f"{self.method} pp={self.stages}{v} dp={self.dp} sdp={self.sdp} tp={self.tp} "
                f"mbs={self.micro_batch_size} N={self.num_micro_batches or '-'} "
                f"recompute={self._recompute_label} {self.optimizer}"
                f"{' owners=replicas' if self.kfac_owners == 'replicas' else ''}")

    @property
    def _recompute_label(self) -> str:
        if self.recompute_stages and not self.recompute:
            return "stages" + ",".join(map(str, self.recompute_stages))
        return str(self.recompute).lower()

    @property
    def num_model_stages(self) -> int:
        return model_stages(self.method, self.stages, self.num_virtual)

    @property
    def recompute_flags(self) -> tuple[bool, ...]:
        """Per model stage, whether it recomputes (what the strategy file's per_stage checkpoint says)."""
        return tuple(self.recompute or s in self.recompute_stages for s in range(self.num_model_stages))

    def run_shape(self, bert: BertConfig, seq_len: int, max_predictions: int, precision: str = "fp32") -> RunShape:
        """The pipeline's shape (``dp_width`` counts every replica fed its own data: dp × sdp)."""
        return RunShape(bert, self.method, self.stages, self.num_micro_batches, self.micro_batch_size,
                        self.dp * self.sdp, self.num_virtual, seq_len, max_predictions, None, self.recompute,
                        precision,
                        recompute_stages=tuple(self.recompute_stages) if self.recompute_stages and not self.recompute
                        else None)


def model_stages(method: str, stages: int, num_virtual: int) -> int:
    """Model stages of a pipeline: ``stages`` × ``num_virtual`` for interleaved and the V schedules, else ``stages``."""
    return stages * (num_virtual if method in ("interleaved", *V_METHODS) else 1)


# -- parameters ----------------------------------------------------------------------------------


def tp_sharded_parameters(bert: BertConfig) -> int:
    """Parameters of one encoder layer that tensor parallel splits (Megatron's column/row split):
    the q, k, v and FFN-in weights and biases (columns), the attention-out and FFN-out weights (rows);
    the row-split layers' biases and the LayerNorms stay whole."""
    h, f = bert.hidden_size, bert.intermediate_size or 4 * bert.hidden_size
    return 4 * h * h + 2 * h * f + 3 * h + f


def _local_parameters(run: RunShape, tp: int) -> list[float]:
    """Parameters of each model stage on one tp rank (``stage_parameters``: the tied word embedding in
    stage 0 and again, as the MLM decoder, in the last stage; once where one stage holds both)."""
    shard = tp_sharded_parameters(run.bert) * (1 - 1 / tp)
    return [p - n * shard for p, n in zip(stage_parameters(run.bert, run.partition), run.encoder_layers)]


def _untied(params: Sequence[float], bert: BertConfig) -> list[float]:
    """Each stage's parameters (``_local_parameters``) without its copy of the tied word embedding
    (stage 0 and the last stage hold one each): the executor leaves the tied weight out of SYNC_GRAD
    and all-reduces it at STEP."""
    d, tied = len(params), tied_parameters(bert)
    return [p - tied * (s in (0, d - 1)) for s, p in enumerate(params)]


def _stages_of(schedule: Schedule, worker: int) -> list[int]:
    return [s for (_, _, s) in schedule.placement.stages_of(worker)]


# -- memory --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HybridMemory:
    """Bytes of one worker by component ([Note: the memory model])."""

    worker: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    captures: float = 0.0
    comm_buffers: float = 0.0
    allocator: float = 0.0
    runtime: float = 0.0

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.captures
                + max(self.activations, self.comm_buffers) + self.allocator + self.runtime)

    @property
    def total_gb(self) -> float:
        return self.total / GB

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GB:.2f}" for name in
                          ("weights", "gradients", "optimizer", "activations", "comm_buffers", "allocator", "runtime")
                          if name not in ("allocator", "runtime") or getattr(self, name))
        return f"{self.total_gb:.2f} GB on worker {self.worker} ({parts} GB)"


def _layer_activation_bytes(run: RunShape, tp: int) -> float:
    """One encoder layer's activations for one micro-batch ([Note: the memory model])."""
    b, s = run.micro_batch_size, run.seq_len
    h, a = run.bert.hidden_size, run.bert.num_heads
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp)) * run.bytes_per_element / 2


def _stage_activation_bytes(run: RunShape, tp: int, stage: int) -> float:
    """Activations one micro-batch leaves in model stage ``stage`` (its own recompute flag)."""
    encoder_layers, first = run.encoder_layers[stage], stage == 0
    b, s, h, e = run.micro_batch_size, run.seq_len, run.bert.hidden_size, run.bytes_per_element
    if run.recompute_flags[stage]:
        layers = encoder_layers * s * b * h * e + _layer_activation_bytes(run, tp)
    else:
        layers = encoder_layers * _layer_activation_bytes(run, tp)
    return layers + (s * b * h * e if first else 0) + saved_heads_bytes(run, stage)


def hybrid_memory_per_worker(run: RunShape, sdp: int = 1, tp: int = 1, schedule: Schedule | None = None,
                             optimizer: str = "nvlamb", device: str = "cuda") -> dict[int, HybridMemory]:
    """The memory of every worker of one pipeline of ``run`` ([Note: the memory model]).

    Args:
        run: the pipeline's shape (``dp_width``: all replicas, dp × sdp).
        sdp: workers sharding each stage replica (FSDP2, reshard_after_forward=false).
        tp: tensor-parallel ranks of each stage.
        schedule: the pipeline's schedule (one data-parallel group); built from ``run`` when None.
        optimizer: nvlamb, adamw or muon (``planning.optimizer_costs``); K-FAC's factors are planning.memory's.
        device: whose peak: ``cuda`` (``max_memory_allocated``) or ``cpu`` (peak RSS beyond the baseline:
            planning.memory's allocator and runtime terms).

    Returns:
        Worker rank (of the simulated pipeline) -> its estimate.
    """
    device_overhead(0.0, device)  # the device's name checked before any work
    schedule = schedule or run.build_schedule(dp_width=1)
    params = _local_parameters(run, tp)
    untied = _untied(params, run.bert)
    replicas = run.num_replicas // sdp  # members of the gradient all-reduce after sharding
    out = {}
    for w in sorted(schedule.actions):
        stages = _stages_of(schedule, w)
        p = worker_parameters(run, params, stages, tied_once=sdp == 1 and tp == 1)
        act = (activation_peak(schedule, w, lambda s: _stage_activation_bytes(run, tp, s))
               + heads_backward_bytes(run, stages))
        state = optimizer_state_bytes(optimizer, p, _muon_parameters(run, stages) / tp, sdp)
        if sdp == 1:
            buffers = 4.0 * sum(untied[s] for s in stages) if replicas > 1 else 0.0
            # transient: gradients, the step's temporary, activations or buffers
            extra = device_overhead(8.0 * (p - mmapped_parameters(run, stages)) + max(act, buffers), device)
            out[w] = HybridMemory(w, 4.0 * p, 4.0 * p, state, act, 0.0, buffers, *extra)
        else:
            # transient: the gathered weights, the gradients, the shard's temporary, activations or buffers
            extra = device_overhead(4.0 * p + 4.0 * p + 4.0 * p / sdp + max(act, 4.0 * p), device)
            out[w] = HybridMemory(w, 4.0 * p / sdp + 4.0 * p, 4.0 * p, state, act, 0.0, 4.0 * p, *extra)
    return out


def _muon_parameters(run: RunShape, stages: Sequence[int]) -> float:
    """Parameters of Muon's matrices (encoder Linear weights) in model ``stages``, unsplit."""
    return float(sum(i * o for s in stages for i, o in muon_matrices(run.bert, run.encoder_layers[s])))


# -- time ----------------------------------------------------------------------------------------


def hybrid_costs(run: RunShape, sdp: int, tp: int, hardware: Hardware, comm: CommCosts,
                 schedule: Schedule | None = None, optimizer: str = "nvlamb") -> CostModel:
    """The simulator's cost model of one pipeline of a hybrid candidate ([Note: the time model]).

    K-FAC unit costs are the FLOP estimate's (``planning.costs``; K-FAC runs only at sdp = tp = 1); with
    ``comm.kfac_in_search``, CURV_A/CURV_B (and with K-FAC's Cholesky, not EKFAC's eigh, PRECOND and INVERT) at the
    rates ``comm`` measured for them (``kfac_flops_per_s``). At tp = 1 a stage's F and B are the sums of its pieces'
    measured times where ``comm`` has them (``piece_seconds``: embeddings, encoder layers, heads); otherwise its FLOPs
    at the whole model's rate, F + B split by the measured forward share (``forward_share``), else 1:2 (FLOPs).
    ``schedule``: one data-parallel group's (built from ``run`` when None), for the stages per worker.
    ``optimizer``: whose step STEP charges (nvlamb, adamw, muon; K-FAC and PipeFisher: nvlamb's).
    """
    schedule = schedule or run.build_schedule(dp_width=1)
    base = estimate_run_costs(run, hardware)
    bert, e = run.bert, run.bytes_per_element
    costs = layer_costs(bert, run.seq_len, run.max_predictions)
    encoder_flops = costs[1]
    activation = run.micro_batch_size * run.seq_len * bert.hidden_size * e
    tp_ar = comm.seconds("all_reduce", tp, activation)
    forward, backward = [], []
    measured = tp_measured_over_modelled(comm, tp, run.micro_batch_size)
    share = comm.nearest(comm.forward_share, run.micro_batch_size)
    pieces = comm.nearest(comm.piece_seconds, run.micro_batch_size) if tp == 1 else None
    for (first, last), layers, rc in zip(run.partition, run.encoder_layers, run.recompute_flags):
        if pieces is not None and set(pieces) == set(PIECES):
            f, b = _stage_seconds_from_pieces(pieces, [run.micro_batch_size * c for c in costs[first:last + 1]],
                                              first, bert.num_layers, rc)
            forward.append(f)
            backward.append(b)
            continue
        f, b = _stage_seconds(sum(costs[first:last + 1]), encoder_flops, layers, tp, tp_ar,
                              run.micro_batch_size / hardware.flops_per_s, rc)
        if share is not None:
            f, b = _split_by_share(f, b, share, rc, 2 * layers * tp_ar, (4 if rc else 2) * layers * tp_ar)
        forward.append(measured * f)
        backward.append(measured * b)
    params = _local_parameters(run, tp)
    d = run.num_model_stages
    tied = tied_parameters(bert)
    replicas = run.num_replicas // sdp  # dp copies × Chimera's twins
    sync = []
    for p, untied in zip(params, _untied(params, bert)):
        if sdp > 1:
            sync.append(comm.seconds("reduce_scatter", sdp, 4.0 * p) + comm.seconds("all_reduce", replicas, 4.0 * untied / sdp))
        else:
            sync.append(comm.seconds("all_reduce", replicas, 4.0 * untied))
    # The tied weight: holders of stage 0 or the last one (every replica's one worker at D = 1), per sdp index.
    holders = run.dp_width * (1 if d == 1 else 2) // sdp
    element_wise = optimizer if optimizer in ELEMENTWISE_OPTIMIZERS else "nvlamb"
    # a worker holding the first and the last stage steps the tied weight once (runtime.build.tie_local_copies)
    own = max(optimizer_step_seconds(element_wise, worker_parameters(run, params, _stages_of(schedule, w),
                                                                      tied_once=sdp == 1 and tp == 1),
                                     [m for s in _stages_of(schedule, w)
                                      for m in muon_matrices(bert, run.encoder_layers[s])], hardware, comm, sdp, tp)
              for w in schedule.actions)
    step = (own + comm.seconds("all_reduce", holders, 4.0 * tied / sdp)
            + comm.seconds("all_reduce", run.num_workers * tp, 8.0))
    if sdp > 1:
        step += max(comm.seconds("all_gather", sdp, 4.0 * p) for p in params)
    # K-FAC's factor all-reduces (A and G of each layer over the replicas) by the same collective model as the
    # gradients': measured latency and bandwidth where comm has them (the FLOP estimate's ring model has no latency)
    factor_sync = tuple(tuple(_ns(comm.seconds("all_reduce", replicas, 4.0 * (i * i + o * o)))
                              for i, o in kfac_linear_dims(bert, n)) for n in run.encoder_layers)
    cost = replace(base, forward_ns=tuple(_ns(x) for x in forward), backward_ns=tuple(_ns(x) for x in backward),
                   p2p_ns=_ns(comm.seconds("p2p", 2, activation)) if d > 1 else 0,
                   sync_ns=tuple(_ns(x) for x in sync), step_ns=_ns(step), input_grad_ns=(), weight_grad_ns=(),
                   sync_factor_ns=factor_sync)
    kfac = comm.nearest(comm.kfac_flops_per_s, run.micro_batch_size) if comm.kfac_in_search else None
    if kfac is not None:  # the estimate's FLOPs at the units' own measured rates, not the model's
        curv_rate, pre_rate, inv_rate = kfac
        curv = hardware.flops_per_s / curv_rate
        cost = replace(cost, curv_a_ns=tuple(tuple(round(x * curv) for x in row) for row in base.curv_a_ns),
                       curv_b_ns=tuple(tuple(round(x * curv) for x in row) for row in base.curv_b_ns))
        if run.preconditioner == "kfac":  # measured with K-FAC's kernels (EKFAC's eigh and rotations are others)
            pre = hardware.flops_per_s / pre_rate
            cost = replace(cost, precond_ns=tuple(round(x * pre) for x in base.precond_ns))
            if inv_rate is not None:
                inv = hardware.flops_per_s / inv_rate
                cost = replace(cost, invert_ns=tuple(tuple(round(x * inv) for x in row) for row in base.invert_ns))
    return cost


def _stage_seconds_from_pieces(pieces: Mapping[str, tuple[float, float, float]], layer_flops: Sequence[float],
                               first: int, num_layers: int, recompute: bool) -> tuple[float, float]:
    """(F, B) of one micro-batch through the stage whose pipeline layers from ``first`` have forward FLOPs
    ``layer_flops``: each layer the measured time of its piece (embeddings, encoder layer, heads) scaled by its
    FLOPs over the measured piece's (1 where the run's model and micro-batch are the measured ones); a recomputing
    B adds its forward again."""
    f = b = 0.0
    for layer, flops in enumerate(layer_flops, start=first):
        piece = "embeddings" if layer == 0 else "heads" if layer == num_layers + 1 else "encoder_layer"
        seconds_f, seconds_fb, measured_flops = pieces[piece]
        scale = flops / measured_flops if measured_flops > 0 else 1.0
        f += seconds_f * scale
        b += (seconds_fb - seconds_f) * scale
    return f, b + (f if recompute else 0.0)


def _split_by_share(f: float, b: float, share: float, recompute: bool, f_comm: float,
                    b_comm: float) -> tuple[float, float]:
    """(F, B) of a stage with the compute of one forward + backward split as measured (``share`` = the forward's
    part); the tensor-parallel all-reduces (``f_comm``, ``b_comm``) stay where they are, and a recomputing B
    keeps its extra forward."""
    fc, bc = f - f_comm, b - b_comm
    total = fc + bc - (fc if recompute else 0.0)  # one forward + one backward of compute
    new_f = share * total
    return new_f + f_comm, total - new_f + (new_f if recompute else 0.0) + b_comm

def _stage_seconds(stage_flops: float, encoder_flops: float, layers: int, tp: int, tp_all_reduce_s: float,
                   seconds_per_flop: float, recompute: bool) -> tuple[float, float]:
    """(F, B) of one micro-batch through a stage of ``stage_flops`` forward FLOPs, ``layers`` encoder
    layers of ``encoder_flops`` each split over ``tp`` ranks ([Note: the time model])."""
    f = (stage_flops - layers * encoder_flops + layers * encoder_flops / tp) * seconds_per_flop
    return (f + 2 * layers * tp_all_reduce_s,
            f * (3.0 if recompute else 2.0) + (4 if recompute else 2) * layers * tp_all_reduce_s)


def tp_measured_over_modelled(comm: CommCosts, tp: int, micro_batch_size: int) -> float:
    """How much longer than this model a tensor-parallel forward + backward measured: the whole
    measured model (``comm.compute_model``) at ``tp`` and the nearest measured micro-batch size, against
    3 forwards' FLOPs (the encoder's split over ``tp``) at the measured one-process rate plus 4
    activation all-reduces per layer. 1 where nothing was measured at ``tp`` ([Note: the time model])."""
    rows = {b: s for (t, b), s in comm.tp_seconds_fb.items() if t == tp}
    if tp <= 1 or not rows or comm.compute_model is None:
        return 1.0
    b = min(rows, key=lambda m: (abs(m - micro_batch_size), -m))
    size, seq_len, max_predictions = comm.compute_model
    bert = BertConfig.from_size(size.removeprefix("bert-"))
    if comm.compute_vocab_size is not None:  # measured at the run's vocabulary (measure.collectives --vocab-size)
        bert = replace(bert, vocab_size=comm.compute_vocab_size)
    costs = layer_costs(bert, seq_len, max_predictions)
    f, bwd = _stage_seconds(sum(costs), costs[1], bert.num_layers, tp,
                            comm.seconds("all_reduce", tp, 4.0 * b * seq_len * bert.hidden_size),
                            b / comm.hardware_for(b).flops_per_s, False)
    return rows[b] / (f + bwd)


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def pipeline_costs(run: RunShape, hardware: Hardware, comm: CommCosts | None = None, sdp: int = 1, tp: int = 1,
                   schedule: Schedule | None = None, split_backward_ratio: float = SPLIT_BACKWARD_RATIO,
                   optimizer: str = "nvlamb") -> CostModel:
    """The cost model the search prices a pipeline with and PipeFisher is planned under, by the search and by
    train.py alike ([Note: one planning path]): :func:`hybrid_costs`, with a split backward's I and W at
    ``split_backward_ratio`` × B on zb-h1 and the V schedules, and the executor's measured time per compute action
    added to each (:func:`with_action_overhead`); where ``comm`` measured them, Muon's step beyond NVLAMB's and
    K-FAC's units scaled by their executor factors (:func:`muon_step_factor`, :func:`kfac_unit_factor`)."""
    comm = comm if comm is not None else CommCosts({}, hardware)
    cost = _scheduled_costs(run, hardware, comm, sdp, tp, schedule, split_backward_ratio, optimizer)
    if optimizer == "muon":
        h = muon_step_factor(comm, split_backward_ratio, run)
        if h != 1.0:
            cost = scale_step_beyond(cost, _scheduled_costs(run, hardware, comm, sdp, tp, schedule,
                                                            split_backward_ratio), h)
    if run.preconditioner != "kfac":  # the factor is measured with K-FAC's kernels, not EKFAC's eigh and rotations
        return cost
    return scale_kfac_units(cost, kfac_unit_factor(comm, split_backward_ratio, run))


def _scheduled_costs(run: RunShape, hardware: Hardware, comm: CommCosts, sdp: int, tp: int, schedule: Schedule | None,
                     split_backward_ratio: float, optimizer: str = "nvlamb") -> CostModel:
    """:func:`pipeline_costs` before the K-FAC unit factor and Muon's step factor."""
    cost = hybrid_costs(run, sdp, tp, hardware, comm, schedule, optimizer)
    cost = split_backward_costs(cost, split_backward_ratio) if run.method in SPLIT_METHODS else cost
    factor = executor_factor(run, comm, split_backward_ratio)
    return with_action_overhead(scale_compute(cost, factor), comm.action_overhead_s)


def kfac_unit_factor(comm: CommCosts, split_backward_ratio: float = SPLIT_BACKWARD_RATIO,
                     run: RunShape | None = None) -> float:
    """The factor on K-FAC's units ([Note: K-FAC unit factor], ``planning.executor_calibration``): solved on the
    schedule ``comm`` measured with K-FAC every step (``kfac_executor_steps``) so that its simulated K-FAC step,
    priced as the search prices it, exceeds its simulated NVLAMB step by the measured extra (K-FAC's step less
    NVLAMB's, taking turns), or, where only K-FAC's step was measured, equals it. The schedule is ``run``'s own
    where it was measured at ``run.stages``, else GPipe's (else the first measured); 1 where none was measured.
    Cached on ``comm``."""
    picked = _measured_entry(comm, comm.kfac_executor_steps, run)
    if picked is None:
        return 1.0
    method, e = picked
    key = ("kfac-units", method, e, comm.hardware, split_backward_ratio)
    if key not in comm.factor_cache:
        shape, schedule, hw = _measured_shape(comm, method, e)
        base = _scheduled_costs(shape, hw, comm, 1, 1, schedule, split_backward_ratio)
        assignment = critical_path_assignment(schedule, shape.kfac_layers, 1)
        target = e.step_seconds if e.extra_seconds is None else \
            predict_schedule(schedule, base)[0].step_time_s + e.extra_seconds
        comm.factor_cache[key] = solve_factor(lambda g: predict_assignment(
            assignment, scale_kfac_units(base, g), "kfac")[0].step_time_s, target)
    return comm.factor_cache[key]


def muon_step_factor(comm: CommCosts, split_backward_ratio: float = SPLIT_BACKWARD_RATIO,
                     run: RunShape | None = None) -> float:
    """The factor on Muon's STEP beyond NVLAMB's ([Note: Muon step factor], ``planning.executor_calibration``):
    solved, as :func:`kfac_unit_factor` is, on the schedule ``comm`` measured with Muon and NVLAMB taking turns
    (``muon_executor_steps``; ``run``'s own at its D, else GPipe's) so that the simulated Muon step exceeds the
    simulated NVLAMB step by the measured extra; 1 where none was measured or where the model prices Muon's step
    no dearer than NVLAMB's (nothing to scale). Cached on ``comm``."""
    picked = _measured_entry(comm, comm.muon_executor_steps, run)
    if picked is None:
        return 1.0
    method, e = picked
    key = ("muon-step", method, e, comm.hardware, split_backward_ratio)
    if key not in comm.factor_cache:
        shape, schedule, hw = _measured_shape(comm, method, e)
        plain = _scheduled_costs(shape, hw, comm, 1, 1, schedule, split_backward_ratio)
        muon = _scheduled_costs(shape, hw, comm, 1, 1, schedule, split_backward_ratio, "muon")
        if muon.step_ns <= plain.step_ns:
            comm.factor_cache[key] = 1.0
        else:
            nvlamb = predict_schedule(schedule, plain)[0].step_time_s
            target = e.step_seconds if e.extra_seconds is None else nvlamb + e.extra_seconds
            comm.factor_cache[key] = solve_factor(lambda h: predict_schedule(
                schedule, scale_step_beyond(muon, plain, h))[0].step_time_s, target)
    return comm.factor_cache[key]


def _measured_entry(comm: CommCosts, steps: Mapping[str, ExecutorStep],
                    run: RunShape | None) -> tuple[str, ExecutorStep] | None:
    """``run``'s schedule's measured step where it was measured at ``run.stages``, else GPipe's (else the first
    measured); None where nothing was measured or ``comm`` has no model to price it on."""
    if not steps or comm.compute_model is None:
        return None
    own = steps.get(run.method) if run is not None else None
    if own is not None and own.stages == run.stages:
        return run.method, own
    return min(steps.items(), key=lambda kv: (kv[0] != "gpipe", kv[0]))


def _measured_shape(comm: CommCosts, method: str, e: ExecutorStep) -> tuple[RunShape, Schedule, Hardware]:
    """The run shape, schedule (one pipeline) and hardware of a step the executor measured (``e``)."""
    size, seq_len, max_predictions = comm.compute_model
    bert = BertConfig.from_size(size.removeprefix("bert-"))
    if comm.compute_vocab_size is not None:
        bert = replace(bert, vocab_size=comm.compute_vocab_size)
    shape = RunShape(bert, method, e.stages, e.micro_batches, e.micro_batch_size, 1, e.num_virtual, seq_len,
                     max_predictions)
    return shape, shape.build_schedule(dp_width=1), comm.hardware_for(e.micro_batch_size)


def executor_factor(run: RunShape, comm: CommCosts, split_backward_ratio: float = SPLIT_BACKWARD_RATIO) -> float:
    """The factor by which ``run.method``'s F, B, I and W are scaled at the D its step was measured at
    ([Note: per-schedule executor factor], ``planning.executor_calibration``); 1 where ``comm`` has no measured
    step of that schedule at ``run.stages``. Solved once per schedule and hardware, then cached on ``comm``."""
    e = comm.executor_steps.get(run.method)
    if e is None or e.stages != run.stages or comm.compute_model is None:
        return 1.0
    key = (run.method, comm.hardware, split_backward_ratio)
    if key not in comm.factor_cache:
        shape, schedule, hw = _measured_shape(comm, run.method, e)
        base = hybrid_costs(shape, 1, 1, hw, comm, schedule)
        base = split_backward_costs(base, split_backward_ratio) if run.method in SPLIT_METHODS else base
        comm.factor_cache[key] = solve_factor(lambda r: predict_schedule(
            schedule, with_action_overhead(scale_compute(base, r), comm.action_overhead_s))[0].step_time_s,
            e.step_seconds)
    return comm.factor_cache[key]


def with_action_overhead(cost: CostModel, seconds: float) -> CostModel:
    """``cost`` with the executor's own time per compute action (``CommCosts.action_overhead_s``) added to every F,
    B, I and W."""
    if seconds <= 0:
        return cost
    o = _ns(seconds)
    return replace(cost, forward_ns=tuple(x + o for x in cost.forward_ns),
                   backward_ns=tuple(x + o for x in cost.backward_ns),
                   input_grad_ns=tuple(x + o for x in cost.input_grad_ns),
                   weight_grad_ns=tuple(x + o for x in cost.weight_grad_ns))


def strategy_plan(s: Strategy, bert: BertConfig, *, hardware: Hardware = Hardware(), comm: CommCosts | None = None,
                  seq_len: int = 128, max_predictions: int = 20, precision: str = "fp32",
                  plan_options: PlanOptions | None = None, split_backward_ratio: float = SPLIT_BACKWARD_RATIO,
                  dp_width: int | None = 1) -> PipeFisherPlan:
    """PipeFisher's plan of strategy ``s``, as the search made it ([Note: one planning path]).

    ``dp_width``: the data-parallel groups of the planned schedule: 1 (the one pipeline the search simulates),
    or None for every group (dp · sdp: what train.py runs, and what a strategy file carries). Under
    ``kfac_owners=replicas`` always every group: the search plans owners over every copy of a stage too
    ([Note: owners across data-parallel copies]).
    """
    run = s.run_shape(bert, seq_len, max_predictions, precision)
    hw = comm.hardware_for(s.micro_batch_size) if comm is not None else hardware
    cost = pipeline_costs(run, hw, comm, s.sdp, s.tp, run.build_schedule(dp_width=1), split_backward_ratio)
    options = replace(plan_options or pipefisher_defaults(), kfac_owners=s.kfac_owners)
    width = None if s.kfac_owners == "replicas" else dp_width
    return plan_for(run.build_schedule(dp_width=width), cost, run.kfac_layers, options, run,
                    comm if comm is not None else CommCosts({}, hw))


# -- the search ----------------------------------------------------------------------------------


def _shape_problem(bert: BertConfig, method: str, d: int, v: int, n: int, sdp: int, tp: int, optimizer: str,
                   tp_ok: bool) -> str | None:
    problem = _pipeline_problem(bert, method, d, v, n)  # whatif's rules of each schedule
    if problem:
        return problem
    if tp > 1 and not tp_ok:
        return "tensor parallel (tp) is not in this version's train.py"
    if tp > 1 and not bert.splits_over(tp):
        return f"tp={tp} must divide the heads ({bert.num_heads}) and the FFN width"
    if (sdp > 1 or tp > 1) and optimizer not in ELEMENTWISE_OPTIMIZERS:
        return (f"optimizer={optimizer} needs whole weights: K-FAC with sdp/tp > 1 needs sharded factors "
                f"(not built)")
    return None


def search_strategies(bert: BertConfig, *, devices: int, memory_gb: float, global_batch: int,
                      hardware: Hardware = Hardware(), comm: CommCosts | None = None,
                      methods: Sequence[str] = METHODS, micro_batch_sizes: Sequence[int] = (4, 8, 16, 32),
                      optimizers: Sequence[str] = OPTIMIZERS, recompute: Sequence[bool] = (False, True),
                      sdp_degrees: Sequence[int] = (1, 2, 4, 8), tp_degrees: Sequence[int] = (1, 2, 4, 8),
                      num_virtual: int = 2, seq_len: int = 128, max_predictions: int = 20, precision: str = "fp32",
                      plan_options: PlanOptions | None = None, split_backward_ratio: float = SPLIT_BACKWARD_RATIO,
                      refusal: Callable[[Strategy], str | None] | None = None,
                      calibration: Calibration | None = None, target_loss: float | None = None,
                      device: str = "cuda", kfac_owners: Sequence[str] = ("holder",)) -> list[Strategy]:
    """Rank every hybrid configuration that uses all ``devices`` by predicted time to target (with a
    calibration; ``planning.time_to_target``), else by simulated samples/s.

    Args:
        bert: the model.
        devices: workers (GPUs, or CPU processes); pp · dp · sdp · tp = devices.
        memory_gb: the budget per worker, against the model's total ([Note: the memory model]).
        global_batch: sequences per optimizer step.
        hardware: FLOP rate and memory bandwidth (and the ring model's bandwidths without ``comm``).
        comm: collective costs (measured); None: the ring model of ``hardware``.
        methods, micro_batch_sizes, optimizers, recompute, sdp_degrees, tp_degrees: the space.
        num_virtual: model chunks per worker for interleaved.
        seq_len, max_predictions, precision: the data shape.
        plan_options: PipeFisher's planner options; None: train.py's ``optimizer=pipefisher`` defaults
            (``pipefisher_plan.pipefisher_defaults``; [Note: one planning path]).
        split_backward_ratio: (I+W)/B of zb-h1 and zb-v.
        refusal: why train.py would refuse a strategy (``strategy_file.refusal``: its config checks), or
            None; a refused strategy is excluded with that reason, so the ranking holds runnable ones.
        calibration: steps to a held-out loss per optimizer (``planning.calibration``); None: throughput alone.
        target_loss: the held-out loss; None: the calibration's hardest.
        device: whose peak the memory model predicts: ``cuda`` or ``cpu`` (``planning.memory``'s
            allocator and runtime terms).
        kfac_owners: PipeFisher's ``optimizer.kfac_owners`` to rank: ``replicas`` adds, where a stage has replicas
            on several workers (Chimera's twins, data-parallel copies), the plan priced with each layer on its
            owner (``planning.owner_costs``), planned and simulated over every copy ([Note: owners across
            data-parallel copies]); its steps are holder's (the same arithmetic), its step its own.

    Returns:
        The feasible strategies, best first (each with its throughput rank and, with a calibration, its time to
        target and that rank), then the excluded ones with the reason.

    Raises:
        ValueError: an unknown method or optimizer, or a non-positive size; the message names it.
    """
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"whatif method {m!r}: choose from {', '.join(METHODS)}")
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise ValueError(f"whatif optimizer {o!r}: choose from {', '.join(OPTIMIZERS)}")
    if not kfac_owners or any(o not in KFAC_OWNERS for o in kfac_owners):
        raise ValueError(f"search.kfac_owners={list(kfac_owners)}: choose from {', '.join(KFAC_OWNERS)}, e.g. "
                         f"[holder, replicas]")
    for name, values in (("sdp_degrees", sdp_degrees), ("tp_degrees", tp_degrees)):
        if not values or any(x < 1 for x in values):
            raise ValueError(f"search.{name}={list(values)}: give degrees >= 1, e.g. [1, 2]")
    if devices < 1 or global_batch < 1 or not memory_gb > 0:
        raise ValueError(f"devices={devices}, global_batch={global_batch}, memory_gb={memory_gb}: all must be positive")
    comm = replace(comm, hardware=hardware) if comm is not None else CommCosts({}, hardware)
    tp_ok = tp_available()
    plan_options = plan_options or pipefisher_defaults()
    budget = memory_gb * GB
    ranked, excluded = [], []
    divisors = [x for x in range(1, devices + 1) if devices % x == 0]
    progress = Progress(len(methods) * len(divisors))  # one log line per (method, pp) group, with an ETA
    for method in methods:
        v = num_virtual if method == "interleaved" else 2 if method in V_METHODS else 1
        for d in divisors:
            progress.start(f"{method} pp={d}")
            for tp in (t for t in sorted(set(tp_degrees)) if devices % (d * t) == 0):
                for sdp in (k for k in sorted(set(sdp_degrees)) if devices % (d * tp * k) == 0):
                    dp = devices // (d * tp * sdp)
                    for mbs in micro_batch_sizes:
                        hw = comm.hardware_for(mbs)  # measured compute rates, where the file has them
                        for rc in recompute:
                            base = Strategy(method, d, v, dp, sdp, tp, mbs, 0, rc, "")
                            if global_batch % (mbs * dp * sdp):
                                excluded += [replace(base, optimizer=o, excluded=(
                                    f"global_batch={global_batch} is not a multiple of micro_batch_size x dp x "
                                    f"sdp={mbs * dp * sdp}")) for o in optimizers]
                                continue
                            base = replace(base, num_micro_batches=global_batch // (mbs * dp * sdp))

                            def evaluate(cand: Strategy, hw: Hardware = hw) -> tuple[list[Strategy], list[Strategy]]:
                                return _evaluate(bert, cand, optimizers, hw, comm, budget, seq_len, max_predictions,
                                                 precision, plan_options, split_backward_ratio, tp_ok, refusal, device,
                                                 kfac_owners)

                            r, x = evaluate(base)
                            if not rc and True in recompute and _memory_bound(x):
                                r2, x2 = _partial_recompute(base, bert, seq_len, max_predictions, precision, evaluate)
                                r, x = r + r2, x + x2
                            ranked += r
                            excluded += x
    progress.done(len(ranked), len(excluded))
    ranked, _notes = rank_by_time_to_target(ranked, calibration, target_loss, model=bert, global_batch=global_batch,
                                            promote=plan_options.promote_inverses)
    return ranked + excluded


def _owner_choices(schedule: Schedule, wanted: Sequence[str]) -> tuple[str, ...]:
    """The ``optimizer.kfac_owners`` of ``wanted`` that differ on ``schedule`` (every data-parallel copy):
    ``replicas`` where a stage has replicas on several workers, each worker one of them (Chimera's twins,
    data-parallel copies); elsewhere it runs as ``holder`` does, so only ``holder`` is ranked."""
    shared = shares_a_stage(schedule.placement)
    return tuple(o for o in wanted if o == "holder" or shared) or ("holder",)


def _memory_bound(excluded: Sequence[Strategy]) -> bool:
    """Whether some of a candidate's optimizers were excluded for memory alone: :func:`_evaluate` sets
    ``memory_gb`` on an excluded candidate only when its memory exceeded the budget."""
    return any(c.memory_gb is not None for c in excluded)


def recompute_order(run: RunShape, schedule: Schedule, tp: int = 1) -> list[int]:
    """Model stages, most activation memory first: the in-flight micro-batches at the peak of the worker
    holding the stage (``peak_activations``; the largest over its holders) × what one micro-batch leaves
    in it without recompute. In 1F1B-like schedules the first stages hold the most in-flight micro-batches,
    so they come first; recomputing a prefix of this order cuts the peak where it is highest."""
    plain = replace(run, recompute=False, recompute_stages=None)
    peaks = peak_activations(schedule)
    held = [0.0] * run.num_model_stages
    for w in schedule.actions:
        for s in _stages_of(schedule, w):
            held[s] = max(held[s], peaks[w] * _stage_activation_bytes(plain, tp, s))
    return sorted(range(run.num_model_stages), key=lambda s: (-held[s], s))


def _partial_recompute(base: Strategy, bert: BertConfig, seq_len: int, max_predictions: int, precision: str,
                       evaluate: Callable[[Strategy], tuple[list[Strategy], list[Strategy]]]
                       ) -> tuple[list[Strategy], list[Strategy]]:
    """Candidates between none and all (issue 27): recompute the first j stages of :func:`recompute_order`,
    j = 1 .. stages-1, until every optimizer fits (a larger j is only slower). ``base`` recomputes nothing
    and ran out of memory for some optimizer."""
    run = base.run_shape(bert, seq_len, max_predictions, precision)
    order = recompute_order(run, run.build_schedule(dp_width=1), base.tp)
    ranked: list[Strategy] = []
    excluded: list[Strategy] = []
    for j in range(1, run.num_model_stages):
        r, x = evaluate(replace(base, recompute_stages=tuple(sorted(order[:j]))))
        ranked += r
        excluded += x
        if not _memory_bound(x):
            break
    return ranked, excluded


def _evaluate(bert: BertConfig, base: Strategy, optimizers: Sequence[str], hardware: Hardware, comm: CommCosts,
              budget: float, seq_len: int, max_predictions: int, precision: str, plan_options: PlanOptions,
              split_backward_ratio: float, tp_ok: bool,
              refusal: Callable[[Strategy], str | None] | None,
              device: str = "cuda", kfac_owners: Sequence[str] = ("holder",)) -> tuple[list[Strategy], list[Strategy]]:
    ranked, excluded = [], []
    run = base.run_shape(bert, seq_len, max_predictions, precision)
    todo = []
    for opt in optimizers:
        problem = _shape_problem(bert, base.method, base.stages, base.num_virtual, base.num_micro_batches,
                                 base.sdp, base.tp, opt, tp_ok)
        if problem is None and refusal is not None:
            problem = refusal(replace(base, optimizer=opt))
        if problem:
            excluded.append(replace(base, optimizer=opt, excluded=problem))
        else:
            todo.append(opt)
    if not todo:
        return ranked, excluded
    schedule = run.build_schedule(dp_width=1)
    cost = pipeline_costs(run, hardware, comm, base.sdp, base.tp, schedule, split_backward_ratio)
    memory = hybrid_memory_per_worker(run, base.sdp, base.tp, schedule, device=device)
    # owners are planned over every copy of a stage ([Note: owners across data-parallel copies])
    wide = (run.build_schedule(dp_width=None) if "pipefisher" in todo and "replicas" in kfac_owners and base.dp > 1
            else schedule)
    for opt, owners in [(o, w) for o in todo for w in (_owner_choices(wide, kfac_owners) if o == "pipefisher"
                                                      else ("holder",))]:
        cand = replace(base, optimizer=opt, kfac_owners=owners)
        age = None
        if opt in ELEMENTWISE_OPTIMIZERS:
            mem = memory if opt == "nvlamb" else hybrid_memory_per_worker(run, base.sdp, base.tp, schedule, opt,
                                                                                   device)
            per_worker = tuple(m.total_gb for m in mem.values())
            own = cost if opt == "nvlamb" else pipeline_costs(run, hardware, comm, base.sdp, base.tp, schedule,
                                                                split_backward_ratio, opt)
            pred, _ = predict_schedule(schedule, own)
        else:  # K-FAC at sdp = tp = 1: planning.memory's model with its factors and captures
            planned = wide if owners == "replicas" else schedule
            if opt == "kfac":
                a = critical_path_assignment(schedule, run.kfac_layers, 1)
                age = 0
            else:
                plan = plan_for(planned, cost, run.kfac_layers, replace(plan_options, kfac_owners=owners), run, comm)
                a, age = plan.assignment, plan.age_bound
            est = estimate_memory(run, opt, planned, a, device)
            m = (memory if planned is schedule else
                 hybrid_memory_per_worker(run, base.sdp, base.tp, planned, device=device))[est.worker]
            more = max(m.comm_buffers - m.activations, 0)  # the buffers' excess, retained like the rest on cpu
            per_worker = ((est.total + more + device_overhead(more, device)[0]) / GB,)
            priced = with_owners(cost, planned, run, comm) if owners == "replicas" else cost
            pred, _ = predict_assignment(a, priced, opt)
        worst = max(per_worker)
        if worst * GB > budget:
            excluded.append(replace(cand, memory_gb=worst, memory_per_worker_gb=per_worker, excluded=(
                f"memory {worst:.2f} GB exceeds memory_gb={budget / GB:g}")))
            continue
        step_s = pred.step_time_s + comm.step_bookkeeping_s  # what train.py's step_time_s holds
        ranked.append(replace(cand, samples_per_s=base.global_batch / step_s, step_time_s=step_s,
                              utilization=pred.utilization, interval=pred.interval, memory_gb=worst,
                              memory_per_worker_gb=per_worker, curvature_age=age))
    return ranked, excluded


def format_strategies(strategies: Sequence[Strategy], top: int = 20, notes: Sequence[str] = ()) -> str:
    """The ranking and the exclusions as text (at most ``top`` lines of each); ranked by time to target, the
    time rank beside the throughput rank (``time_to_target.time_lines``), and ``notes`` under the table."""
    ranked = [c for c in strategies if c.excluded is None]
    excluded = [c for c in strategies if c.excluded is not None]
    if any(c.time_rank is not None for c in ranked):
        lines = time_lines(ranked, top, "strategy", "strategies")
    else:
        lines = ranking_lines(ranked, top, "strategy", "strategies", memory_decimals=2)
    lines += [f"note: {n}" for n in notes]
    groups: dict[str, list[str]] = {}
    for c in excluded:
        groups.setdefault(c.excluded, []).append(c.label)
    lines.append(f"excluded ({len(excluded)} strategies), by reason:")
    for reason in sorted(groups, key=lambda r: "exceeds memory_gb" not in r)[:top]:
        shown = groups[reason]
        lines.append(f"      {len(shown)} x {reason} (e.g. {shown[0]})")
    return "\n".join(lines)

