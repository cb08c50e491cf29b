"""Per-worker memory estimate of a run: weights, gradients, optimizer state, activations, captures.

[Note: memory model] (bytes per worker; ``estimate_memory`` gives the one that needs the most)::

    weights, gradients   4 per parameter of every stage replica the worker holds (fp32 master)
    optimizer            the step's temporary, 4 per parameter (NVLAMB holds one at a time: the clipped
                         gradient copy, then the update, ``optim/nvlamb.py``), and the state:
                         NVLAMB, AdamW: 2 moments, 8 per parameter (Muon: 4, one moment, for the
                         encoder's Linear weights); K-FAC adds per Linear layer the two
                         factors and their inverses, 4·((in+1)² + out²) each set: 2 sets for kfac,
                         3 for PipeFisher (deferred: the inverses in use and the ones being built);
                         with ``preconditioner="ekfac"`` the eigenbases take the inverses' place and
                         each layer adds its second moment in the eigenbasis, 4·(in+1)·out
    activations          the peak over the worker's action list of the activations its micro-batches
                         leave, each in the stage it went through (:func:`activation_peak`: a forward
                         adds, its B or, split, its W frees; one stage per worker: ``peak_activations``
                         × that stage's): per encoder
                         layer S·b·H·(34 + 5·A·S/H) bytes at 16 bits (Korthikanti et al., 2022,
                         "Reducing activation recomputation"), twice that in fp32; with recomputation
                         only each layer's input (S·b·H elements) plus one layer's full activations,
                         stage by stage (``RunShape.recompute_flags``: recompute may cover some stages);
                         the last stage adds the MLM log-probabilities cross-entropy saves, b·P·V in
                         fp32, and its worker two more of them for the heads' backward
                         (:func:`heads_logits_bytes`; 19.5 MB per micro-batch on bert-mini at b=8)
    captures (K-FAC)     a layer's input x (T × in) from its F until its CURV_A, its output gradient
                         (T × out) from its B until its CURV_B, for the layers refreshed in a step:
                         the peak over the worker's action list, the largest over the phases
    allocator, runtime   by ``device`` (:data:`DEVICES`), what the measured peak holds beyond live tensors:
                         cuda: nothing (the figure is ``max_memory_allocated``, live tensors only; the
                         caching allocator's reserved pool above it is :func:`cuda_reserved_bytes`);
                         cpu (peak resident set beyond the RSS before the model was built): glibc
                         keeps freed blocks resident in its arenas (blocks under its mmap threshold,
                         which rises to 32 MiB as tensors are freed) and a step's transient tensors
                         (gradients, the optimizer's temporary, activations, captures; not the
                         gradients and temporaries of parameter tensors of 32 MiB or more, always
                         mmapped: :func:`mmapped_parameters`) reuse them only partly, so
                         ``CPU_HEAP_RETENTION`` × transient more; and ``CPU_RUNTIME_BYTES``
                         of memory that is no tensor (the worker's Python objects, thread pools, gloo,
                         one-time kernel set-up): both measured, bench/studies/15-memory-model.md

The CUDA context and library handles (787 MB per process on an H200, torch 2.11) are outside
``max_memory_allocated`` and this model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipefisher.config import KFAC_OPTIMIZERS, OPTIMIZERS
from pipefisher.model.config import BertConfig
from pipefisher.planning.costs import RunShape, kfac_linear_dims, stage_parameters
from pipefisher.schedules import ActionKind, Schedule
from pipefisher.schedules.kfac import Assignment

__all__ = ["CPU_HEAP_RETENTION", "CPU_RUNTIME_BYTES", "CUDA_RESERVED_SLACK", "DEVICES", "GLIBC_MMAP_THRESHOLD_MAX",
           "MemoryEstimate", "activation_peak", "cuda_reserved_bytes", "device_overhead", "estimate_memory",
           "estimate_memory_per_worker", "mmapped_parameters"]

K = ActionKind
GB = 1e9
DEVICES = ("cuda", "cpu")
# Measured on the 2-core AMD EPYC (glibc 2.36, torch 2.13 CPU, one intra-op thread per worker), bert-mini and
# bert-medium, D=2, 1f1b / zb-v / chimera: bench/studies/15-memory-model.md. The runtime is the peak less the live tensors
# with glibc's mmap threshold fixed at 64 KiB (no retention); the retention is the rest over the transient.
CPU_RUNTIME_BYTES = 80e6
CPU_HEAP_RETENTION = 0.8
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): a block this large or larger is always
# mmapped and unmapped at its free, so none of it is retained.
GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
# The caching allocator's reserved pool over max_memory_allocated, as a fraction of the live tensors: 0.28 on
# bert-mini and 0.12 on bert-medium measured (H200, torch 2.11+cu130, stages=1, bench/memory_model_cuda.py).
CUDA_RESERVED_SLACK = 0.2


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one worker, by component (see [Note: memory model])."""

    worker: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    captures: float
    allocator: float = 0.0
    runtime: float = 0.0

    @property
    def tensors(self) -> float:
        """The live tensors at the peak: what CUDA's ``max_memory_allocated`` measures."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.captures

    @property
    def total(self) -> float:
        return self.tensors + self.allocator + self.runtime

    @property
    def total_gb(self) -> float:
        return self.total / GB

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GB:.1f}" for name in
                          ("weights", "gradients", "optimizer", "activations", "captures", "allocator", "runtime")
                          if name not in ("allocator", "runtime") or getattr(self, name))
        return f"{self.total_gb:.1f} GB on worker {self.worker} ({parts} GB)"


def _activation_bytes(run: RunShape, stage: int) -> float:
    """Activations one micro-batch leaves in model stage ``stage`` (its own recompute flag)."""
    encoder_layers, first = run.encoder_layers[stage], stage == 0
    b, s = run.micro_batch_size, run.seq_len
    h, a = run.bert.hidden_size, run.bert.num_heads
    per_layer_16 = s * b * h * (34 + 5 * a * s / h)
    scale = run.bytes_per_element / 2
    if run.recompute_flags[stage]:
        layers = encoder_layers * s * b * h * run.bytes_per_element + per_layer_16 * scale
    else:
        layers = encoder_layers * per_layer_16 * scale
    return layers + (s * b * h * run.bytes_per_element if first else 0) + saved_heads_bytes(run, stage)


def heads_logits_bytes(run: RunShape) -> float:
    """One micro-batch's MLM log-probabilities, b·P·V in fp32: what cross-entropy saves for its
    backward (fp32 under autocast too, ``model.bert``'s loss casts the logits); its backward makes
    two more of that size at once (the loss's and the logits' gradients)."""
    return 4.0 * run.micro_batch_size * run.max_predictions * run.bert.vocab_size


def saved_heads_bytes(run: RunShape, stage: int) -> float:
    """What one micro-batch leaves in ``stage`` for the heads' backward: the log-probabilities on the last stage."""
    return heads_logits_bytes(run) if stage == run.num_model_stages - 1 else 0.0


def heads_backward_bytes(run: RunShape, stages: Sequence[int]) -> float:
    """The two b·P·V buffers of the heads' backward, on the worker holding the last stage."""
    return 2.0 * heads_logits_bytes(run) if run.num_model_stages - 1 in stages else 0.0


def tied_parameters(bert: BertConfig) -> int:
    """Parameters of the tied word-embedding / decoder weight (V × H)."""
    return bert.vocab_size * bert.hidden_size


def worker_parameters(run: RunShape, params: Sequence[float], stages: Sequence[int], tied_once: bool = True) -> float:
    """Parameters of a worker's ``stages`` (``params`` per model stage): where it holds the first and the last
    stage and ``tied_once`` (sdp = tp = 1), the tied word embedding once (``runtime.build.tie_local_copies``)."""
    p = sum(params[s] for s in stages)
    if tied_once and 0 in stages and run.num_model_stages - 1 in stages and run.num_model_stages > 1:
        p -= tied_parameters(run.bert)
    return p


def activation_peak(schedule: Schedule, worker: int, stage_bytes: Callable[[int], float]) -> float:
    """Most activation bytes ``worker`` holds at once: over its action list, each forward adds what one
    micro-batch leaves in that action's stage (``stage_bytes(stage)``), each B (a split backward: its W)
    takes it away again. With one stage per worker this is ``peak_activations`` × that stage's bytes; a
    worker holding several stages (Chimera, V shapes, interleaved) counts each micro-batch in its own stage."""
    held = peak = 0.0
    for a in schedule.actions[worker]:
        if a.kind == K.FORWARD:
            held += stage_bytes(a.stage)
            peak = max(peak, held)
        elif a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
            held -= stage_bytes(a.stage)
    return peak


def _capture_peak(phase: Schedule, worker: int, run: RunShape, kfac_layers: list[int]) -> float:
    tokens = run.micro_batch_size * run.seq_len
    elem = run.bytes_per_element
    dims = {s: kfac_linear_dims(run.bert, n) for s, n in enumerate(run.encoder_layers)}
    acts = phase.actions[worker]
    refreshed: dict[tuple[int, int], set[int]] = defaultdict(set)
    for a in acts:
        if a.kind in (K.CURV_A, K.CURV_B):
            refreshed[(a.stage, a.pipe)].update(range(kfac_layers[a.stage]) if a.layer is None else (a.layer,))
    held = peak = 0.0
    for a in acts:
        key = (a.stage, a.pipe)
        if (a.kind == K.FORWARD or a.kind.is_input_backward) and key in refreshed:
            side = 0 if a.kind == K.FORWARD else 1
            held += sum(tokens * dims[a.stage][layer][side] * elem for layer in refreshed[key])
        elif a.kind in (K.CURV_A, K.CURV_B):
            side = 0 if a.kind == K.CURV_A else 1
            layers = range(kfac_layers[a.stage]) if a.layer is None else (a.layer,)
            held -= sum(tokens * dims[a.stage][layer][side] * elem for layer in layers)
        peak = max(peak, held)
    return peak


def mmapped_parameters(run: RunShape, stages: Sequence[int], tied_once: bool = True) -> float:
    """Parameters of a worker's ``stages`` in tensors of at least ``GLIBC_MMAP_THRESHOLD_MAX`` bytes in fp32:
    their gradients and the optimizer's temporaries are mmapped blocks, never retained on CPU. The word
    embedding / decoder (V × H; once where ``worker_parameters`` counts it once) and encoder Linear weights."""
    def big(n: float) -> float:
        return n if 4.0 * n >= GLIBC_MMAP_THRESHOLD_MAX else 0.0

    last = run.num_model_stages - 1
    ends = [s for s in stages if s in (0, last)]
    if tied_once and 0 in ends and last in ends and run.num_model_stages > 1:
        ends = [0]
    if run.num_model_stages == 1:
        ends = [0]  # one stage: the embedding is the decoder, one tensor
    n = len(ends) * big(tied_parameters(run.bert))
    return n + sum(big(i * o) for s in stages for i, o in kfac_linear_dims(run.bert, run.encoder_layers[s]))


def device_overhead(transient: float, device: str) -> tuple[float, float]:
    """(allocator, runtime) bytes a worker's measured peak holds beyond its live tensors on ``device``,
    given its ``transient`` tensor bytes in blocks glibc may retain (gradients, the optimizer's temporary,
    activations, captures; less those of :func:`mmapped_parameters`): [Note: memory model]."""
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: choose one of {', '.join(DEVICES)}")
    if device == "cpu":
        return CPU_HEAP_RETENTION * transient, CPU_RUNTIME_BYTES
    return 0.0, 0.0


def cuda_reserved_bytes(est: MemoryEstimate) -> float:
    """The CUDA caching allocator's reserved pool at the peak (``max_memory_reserved``) of a worker
    estimated for ``device="cuda"``: its live tensors and ``CUDA_RESERVED_SLACK`` of them more."""
    return est.tensors * (1.0 + CUDA_RESERVED_SLACK)


def estimate_memory_per_worker(run: RunShape, optimizer: str, schedule: Schedule | None = None,
                               assignment: Assignment | None = None,
                               device: str = "cuda") -> dict[int, MemoryEstimate]:
    """Memory of every worker of ``run`` under ``optimizer`` ([Note: memory model]).

    Args:
        run: the run's shape.
        optimizer: ``nvlamb``, ``kfac``, ``pipefisher``, ``adamw`` or ``muon``.
        schedule: the run's schedule (built from ``run`` when None).
        assignment: the K-FAC assignment, for the capture memory (none counted when None).
        device: ``cuda`` (the peak ``max_memory_allocated`` measures) or ``cpu`` (the peak resident
            set beyond the process's before its model was built).

    Returns:
        Worker rank -> its estimate, one entry per worker of the schedule.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    device_overhead(0.0, device)  # the device's name checked before any work
    schedule = schedule or run.build_schedule()
    params = stage_parameters(run.bert, run.partition)
    encoder = run.encoder_layers
    factor_sets = {"kfac": 2, "pipefisher": 3}.get(optimizer, 0)
    out: dict[int, MemoryEstimate] = {}
    for w in sorted(schedule.actions):
        stages = [s for (_, _, s) in schedule.placement.stages_of(w)]
        p = worker_parameters(run, params, stages)
        factors = sum(4.0 * ((i + 1) ** 2 + o * o) for s in stages for i, o in kfac_linear_dims(run.bert, encoder[s]))
        act = activation_peak(schedule, w, lambda s: _activation_bytes(run, s)) + heads_backward_bytes(run, stages)
        moments = 8.0 * p  # the state
        if run.preconditioner == "ekfac" and optimizer in KFAC_OPTIMIZERS:  # v in the eigenbasis
            moments += 4.0 * sum((i + 1) * o for s in stages for i, o in kfac_linear_dims(run.bert, encoder[s]))
        if optimizer == "muon":  # one moment for the encoder's Linear weights
            moments -= 4.0 * sum(i * o for s in stages for i, o in kfac_linear_dims(run.bert, encoder[s]))
        captures = 0.0
        if assignment is not None and optimizer in KFAC_OPTIMIZERS:
            captures = max(_capture_peak(ph, w, run, list(assignment.kfac_layers)) for ph in assignment.phases)
        temporary = 4.0 * p  # the step's one temporary per parameter
        allocator, runtime = device_overhead(8.0 * (p - mmapped_parameters(run, stages)) + act + captures, device)
        out[w] = MemoryEstimate(w, 4.0 * p, 4.0 * p, moments + temporary + factor_sets * factors, act, captures,
                                allocator, runtime)
    return out


def estimate_memory(run: RunShape, optimizer: str, schedule: Schedule | None = None,
                    assignment: Assignment | None = None, device: str = "cuda") -> MemoryEstimate:
    """Memory of the most loaded worker of ``run`` under ``optimizer`` ([Note: memory model]).

    Args and errors as :func:`estimate_memory_per_worker`.

    Returns:
        The estimate of the worker with the largest total (the lowest rank among equals).
    """
    per_worker = estimate_memory_per_worker(run, optimizer, schedule, assignment, device)
    return max(per_worker.values(), key=lambda est: est.total)
