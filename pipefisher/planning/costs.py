"""Per-stage action costs for the simulator: estimated from FLOPs, or measured in a profile.

Why one module: both sources of a cost model fill the same :class:`RunShape`'s costs, and the profile path
falls back on the FLOP estimate for the K-FAC units a profile lacks, so both share the FLOP formulas of [Note:
FLOP estimates].

Two sources of a :class:`~pipefisher.simulate.CostModel` with K-FAC unit costs:

- :func:`estimate_costs`: FLOP counts of the model at a given sustained FLOP rate and link speeds,
  so one can plan for a cluster one does not have;
- :func:`costs_from_profile`: means per stage and kind of the events of a ``profile.sqlite``; the
  K-FAC units from the profile when it has them, else the FLOP estimate at the FLOP rate the
  profile's forwards achieved.

[Note: FLOP estimates] (T = micro_batch_size · seq_len tokens of one micro-batch; one Linear
layer with ``in``/``out`` features; 2 FLOPs per multiply-add)::

    F      = layer_costs(...) summed over the stage's pipeline layers, times micro_batch_size
    B      = 2 F (3 F with recomputation: the forward runs again)
    CURV_A = 2 T in²      CURV_B = 2 T out²                       per micro-batch, per layer
    INVERT = (in³ + out³) (2/3 + 1)   Cholesky of each damped factor and the inverse from it
    PRECOND= 2 in out (in + out)      B⁻¹ G A⁻¹, per layer, summed over the stage

With ``preconditioner="ekfac"`` (eigenbases, Adam in them: ``optim.ekfac``) the refresh and the
per-step rescaling cost more::

    INVERT = 4 (in³ + out³)               eigh with eigenvectors: 8/3 n³ to reduce to tridiagonal
                                          form and build Q, ~4/3 n³ for divide and conquer (Demmel,
                                          Applied Numerical Linear Algebra, §5.3)
    PRECOND= 4 in out (in + out) + 10 in out   Q_Bᵀ G Q_A, the second moment and division, Q_B (.) Q_Aᵀ

so ekfac's INVERT is 2.4× K-FAC's and PRECOND a little over 2×; ``bench/ekfac_costs.py`` measured
2.7× and 3.1× on one CPU core (the elementwise work is memory-bound there). A profile's own units
replace these estimates.
    all-reduce of n bytes over r replicas (ring) = 2 (r−1)/r · n / bandwidth; 0 for r = 1

Gradients and factors travel in fp32. The optimizer step is memory-bound: 28 bytes per parameter
(read weight, gradient, two moments; write weight and moments) at ``memory_bytes_per_s``.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipefisher.config import V_METHODS, schedule_method
from pipefisher.model.config import BertConfig
from pipefisher.model.partition import layer_costs, partition_layers, stage_costs
from pipefisher.profiling import Profile
from pipefisher.schedules import Action, ActionKind, Schedule, build_schedule
from pipefisher.schedules.kfac import LINEARS_PER_ENCODER_LAYER
from pipefisher.schedules.passes import matching_send
from pipefisher.simulate import CostModel, compute_cost_fields, mean_ns, worker_step_costs
from pipefisher.timeline import is_wait

__all__ = [
    "Hardware",
    "RunShape",
    "costs_from_profile",
    "encoder_layers_per_stage",
    "estimate_costs",
    "estimate_run_costs",
    "kfac_linear_dims",
    "stage_parameters",
]

log = logging.getLogger(__name__)
K = ActionKind

INVERT_FLOPS_PER_N3 = 2.0 / 3.0 + 1.0  # Cholesky + inverse from the factor, per n³
EIGH_FLOPS_PER_N3 = 4.0  # symmetric eigendecomposition with eigenvectors (ekfac's INVERT), per n³
EKFAC_ELEMENTWISE_FLOPS = 10.0  # ekfac's per-element second moment, bias correction and division
PRECONDITIONERS = ("kfac", "ekfac")
STEP_BYTES_PER_PARAM = 28  # LAMB: read w, g, m, v (16 B); write w, m, v (12 B), fp32


@dataclass(frozen=True)
class Hardware:
    """What a device and its links sustain (defaults: an A100/H100-class GPU node, fp32/TF32).

    Attributes:
        flops_per_s: sustained matrix-multiply rate of one device.
        p2p_bytes_per_s: point-to-point bandwidth between neighbouring stages.
        allreduce_bytes_per_s: all-reduce bus bandwidth; None means ``p2p_bytes_per_s``.
        memory_bytes_per_s: device memory bandwidth (the optimizer step is memory-bound).
    """

    flops_per_s: float = 1.0e14
    p2p_bytes_per_s: float = 5.0e10
    allreduce_bytes_per_s: float | None = None
    memory_bytes_per_s: float = 1.5e12

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not value > 0:
                raise ValueError(f"{f.name}={value!r}: must be positive, e.g. {f.name}={f.default}")

    @property
    def allreduce(self) -> float:
        return self.allreduce_bytes_per_s or self.p2p_bytes_per_s


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def encoder_layers_per_stage(partition: Sequence[tuple[int, int]], num_layers: int) -> list[int]:
    """Encoder layers in each stage of a ``partition_layers`` result (pipeline layers 1..L)."""
    return [max(0, min(last, num_layers) - max(first, 1) + 1) for first, last in partition]


def kfac_linear_dims(config: BertConfig, encoder_layers: int) -> list[tuple[int, int]]:
    """(in, out) features of a stage's K-FAC layers, in order (``schedules.kfac.LINEAR_NAMES``)."""
    h, f = config.hidden_size, config.intermediate_size or 4 * config.hidden_size
    return ([(h, h)] * 4 + [(h, f), (f, h)]) * encoder_layers


def stage_parameters(config: BertConfig, partition: Sequence[tuple[int, int]]) -> list[int]:
    """Parameters of each stage; the last stage counts its copy of the tied word embeddings, except
    where one stage holds the embeddings and the heads: there the word embedding is the decoder, one
    tensor, counted once."""
    h, v = config.hidden_size, config.vocab_size
    f = config.intermediate_size or 4 * h
    embeddings = (v + config.max_position_embeddings + config.type_vocab_size) * h + 2 * h
    encoder = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    heads = (h * h + h + 2 * h + v) + v * h + (h * h + h) + (2 * h + 2)
    per_layer = [embeddings] + [encoder] * config.num_layers + [heads]
    last = len(per_layer) - 1
    return [sum(per_layer[first:end + 1]) - (v * h if first == 0 and end == last else 0) for first, end in partition]


def _allreduce_s(num_bytes: float, replicas: int, bandwidth: float) -> float:
    return 0.0 if replicas <= 1 else 2.0 * (replicas - 1) / replicas * num_bytes / bandwidth


_CHIMERA = ("chimera", "chimera-doubling")  # two pipes: every worker holds two stage replicas


@dataclass(frozen=True)
class RunShape:
    """The run a plan is for: model, pipeline, batch and sequence shape.

    Attributes:
        bert: the architecture.
        method: the schedule generator (gpipe, 1f1b, chimera, chimera-doubling, interleaved, zb-h1, zb-v,
            dualpipev, v-half, v-min;
            ``config.schedule_method`` of the run's pipeline keys).
        stages: D, workers per pipeline (the config's ``stages``).
        num_micro_batches: N per step per data-parallel group.
        micro_batch_size: sequences per micro-batch.
        dp_width: W, data-parallel copies.
        num_virtual: model chunks per worker (interleaved).
        seq_len: S.
        max_predictions: P, masked positions per sequence.
        layers_per_stage: encoder layers per model stage; None balances by estimated cost.
        recompute: activation recomputation in the backward, in every model stage.
        recompute_stages: the model stages that recompute (``recompute`` False), or None: as ``recompute``
            says; ``recompute_flags`` gives the per-stage answer either way.
        precision: fp32 or bf16 (bytes of activations).
        order_costs: zb-v: the relative [F, I, W] its list scheduler orders by (None: equal).
        activation_memory: zb-v: the activation bound as a multiple of 1F1B's peak.
        preconditioner: kfac (Cholesky inverses) or ekfac (eigenbases): what INVERT and PRECOND cost.
    """

    bert: BertConfig
    method: str
    stages: int
    num_micro_batches: int
    micro_batch_size: int
    dp_width: int = 1
    num_virtual: int = 1
    seq_len: int = 128
    max_predictions: int = 20
    layers_per_stage: tuple[int, ...] | None = None
    recompute: bool = False
    precision: str = "fp32"
    order_costs: tuple[float, ...] | None = None
    activation_memory: float = 1.0
    preconditioner: str = "kfac"
    recompute_stages: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.preconditioner not in PRECONDITIONERS:
            raise ValueError(f"preconditioner={self.preconditioner!r}: must be one of {', '.join(PRECONDITIONERS)}")
        chosen = self.recompute_stages
        if chosen is not None and (self.recompute or any(not 0 <= s < self.num_model_stages for s in chosen)):
            raise ValueError(f"recompute_stages={list(chosen)}: give model-stage indices in "
                             f"0..{self.num_model_stages - 1} with recompute=False (recompute=True means every stage)")

    @property
    def recompute_flags(self) -> tuple[bool, ...]:
        """Per model stage, whether its backward recomputes the forward (B = 3F, less activation memory)."""
        chosen = set(self.recompute_stages or ())
        return tuple(self.recompute or s in chosen for s in range(self.num_model_stages))

    @property
    def num_model_stages(self) -> int:
        return self.stages * self.num_virtual

    @property
    def partition(self) -> list[tuple[int, int]]:
        return partition_layers(self.bert, self.num_model_stages, self.seq_len, self.max_predictions,
                                self.layers_per_stage, v_shape=self.method in V_METHODS)

    @property
    def encoder_layers(self) -> list[int]:
        return encoder_layers_per_stage(self.partition, self.bert.num_layers)

    @property
    def kfac_layers(self) -> list[int]:
        return [LINEARS_PER_ENCODER_LAYER * n for n in self.encoder_layers]

    @property
    def num_replicas(self) -> int:
        """Replicas of each stage (members of its all-reduces)."""
        return self.dp_width * (2 if self.method in _CHIMERA else 1)

    @property
    def stages_per_worker(self) -> int:
        return 2 if self.method in _CHIMERA else self.num_virtual

    @property
    def num_workers(self) -> int:
        return self.stages * self.dp_width

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.num_micro_batches * self.dp_width

    @property
    def bytes_per_element(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def build_schedule(self, dp_width: int | None = None) -> Schedule:
        """The run's checked schedule (``dp_width`` overrides W, e.g. 1 to simulate one group); what
        ``train.py`` runs (``runtime.worker.schedule_for`` calls this)."""
        options: dict[str, Any] = {}
        if self.method in ("zb-v", "v-half", "v-min"):  # list scheduled by the V partition's estimated stage costs
            estimate = stage_costs(layer_costs(self.bert, self.seq_len, self.max_predictions), self.partition)
            options = {"order_costs": self.order_costs, "stage_costs": [max(c, 1e-3 * max(estimate)) for c in estimate]}
            if self.method == "zb-v":
                options["activation_memory"] = self.activation_memory
        return build_schedule(self.method, self.stages, self.num_micro_batches,
                              self.dp_width if dp_width is None else dp_width, num_virtual=self.num_virtual,
                              **options)

    @classmethod
    def from_train_config(cls, cfg: Mapping[str, Any]) -> RunShape:
        """From a train config as a dict (``dataclasses.asdict(TrainConfig)``, profile metadata).

        Raises:
            KeyError: a field is missing (callers name the file).
        """
        m, p, d = cfg["model"], cfg["pipeline"], cfg["data"]
        bert = BertConfig(
            vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], num_layers=m["num_layers"],
            num_heads=m["num_heads"], intermediate_size=m.get("intermediate_size"),
            max_position_embeddings=m.get("max_position_embeddings", 512),
            type_vocab_size=m.get("type_vocab_size", 2))
        lps = p.get("layers_per_stage")
        method = schedule_method(p["method"], p.get("chimera_stacking", "direct"))
        return cls(bert=bert, method=method, stages=cfg["stages"],
                   num_micro_batches=cfg["num_micro_batches"], micro_batch_size=cfg["micro_batch_size"],
                   dp_width=cfg.get("data_parallel", 1), num_virtual=p.get("num_virtual", 1),
                   seq_len=d["seq_len"], max_predictions=d["max_predictions"],
                   layers_per_stage=tuple(lps) if lps else None, recompute=bool(cfg.get("recompute", False)),
                   recompute_stages=tuple(cfg["recompute_stages"]) if cfg.get("recompute_stages") else None,
                   precision=cfg.get("precision", "fp32"),
                   order_costs=tuple(p["order_costs"]) if p.get("order_costs") else None,
                   activation_memory=float(p.get("activation_memory", 1.0)),
                   preconditioner=str(cfg.get("optimizer", {}).get("preconditioner", "kfac")))


def _kfac_flops(bert: BertConfig, encoder_layers: Sequence[int], tokens: int,
                preconditioner: str = "kfac") -> dict[str, list[list[float]]]:
    """FLOPs of each K-FAC unit per stage and layer ([Note: FLOP estimates])."""
    ekfac = preconditioner == "ekfac"
    per_n3 = EIGH_FLOPS_PER_N3 if ekfac else INVERT_FLOPS_PER_N3
    out: dict[str, list[list[float]]] = {"curv_a": [], "curv_b": [], "invert": [], "precond": []}
    for n in encoder_layers:
        dims = kfac_linear_dims(bert, n)
        out["curv_a"].append([2.0 * tokens * i * i for i, _ in dims])
        out["curv_b"].append([2.0 * tokens * o * o for _, o in dims])
        out["invert"].append([(i ** 3 + o ** 3) * per_n3 for i, o in dims])
        out["precond"].append([(4.0 * i * o * (i + o) + EKFAC_ELEMENTWISE_FLOPS * i * o) if ekfac
                               else 2.0 * i * o * (i + o) for i, o in dims])
    return out


def _factor_sync_ns(bert: BertConfig, encoder_layers: Sequence[int], replicas: int,
                    bandwidth: float) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(_ns(_allreduce_s(4.0 * (i * i + o * o), replicas, bandwidth))
                       for i, o in kfac_linear_dims(bert, n)) for n in encoder_layers)


def estimate_costs(bert_config: BertConfig, num_stages: int, micro_batch_size: int, seq_len: int,
                   max_predictions: int, flops_per_s: float, p2p_bytes_per_s: float, *,
                   layers_per_stage: Sequence[int] | None = None, num_replicas: int = 1,
                   stages_per_worker: int = 1, allreduce_bytes_per_s: float | None = None,
                   memory_bytes_per_s: float = 1.5e12, bytes_per_element: int = 4,
                   recompute: bool | Sequence[bool] = False, preconditioner: str = "kfac") -> CostModel:
    """A FLOP-based cost model with K-FAC unit costs ([Note: FLOP estimates]).

    Args:
        bert_config: the architecture.
        num_stages: model stages (D, or D·v for interleaved).
        micro_batch_size: sequences per micro-batch.
        seq_len: S.
        max_predictions: P (the MLM head runs only at masked positions).
        flops_per_s: sustained FLOP rate of one device.
        p2p_bytes_per_s: bandwidth of a stage-to-stage message.
        layers_per_stage: encoder layers per stage; None balances by cost (``partition_layers``).
        num_replicas: replicas of each stage (2·W for Chimera, W otherwise); sets all-reduce costs.
        stages_per_worker: stage replicas per worker (2 for Chimera, v for interleaved); sets
            the optimizer step's cost.
        allreduce_bytes_per_s: all-reduce bandwidth; None means ``p2p_bytes_per_s``.
        memory_bytes_per_s: memory bandwidth (optimizer step).
        bytes_per_element: activation bytes per element in messages (4 fp32, 2 bf16).
        recompute: the backward recomputes the forward (B = 3F): in every stage (a bool) or per stage (one
            flag per stage).
        preconditioner: kfac or ekfac (the INVERT and PRECOND estimates).

    Returns:
        The cost model; ``cost.kfac_layers`` is 6 per encoder layer of each stage.
    """
    if not flops_per_s > 0 or not p2p_bytes_per_s > 0:
        raise ValueError(f"flops_per_s={flops_per_s}, p2p_bytes_per_s={p2p_bytes_per_s}: both must be positive")
    partition = partition_layers(bert_config, num_stages, seq_len, max_predictions, layers_per_stage)
    encoder = encoder_layers_per_stage(partition, bert_config.num_layers)
    fwd = [c * micro_batch_size / flops_per_s for c in
           stage_costs(layer_costs(bert_config, seq_len, max_predictions), partition)]
    params = stage_parameters(bert_config, partition)
    bandwidth = allreduce_bytes_per_s or p2p_bytes_per_s
    kfac = _kfac_flops(bert_config, encoder, micro_batch_size * seq_len, preconditioner)
    flags = [recompute] * num_stages if isinstance(recompute, bool) else list(recompute)
    if len(flags) != num_stages:
        raise ValueError(f"recompute has {len(flags)} per-stage flags for {num_stages} stages; give one per stage")

    def table(name: str) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(_ns(x / flops_per_s) for x in row) for row in kfac[name])

    return CostModel(
        forward_ns=tuple(_ns(f) for f in fwd),
        backward_ns=tuple(_ns(f * (3.0 if rc else 2.0)) for f, rc in zip(fwd, flags)),
        p2p_ns=_ns(micro_batch_size * seq_len * bert_config.hidden_size * bytes_per_element / p2p_bytes_per_s),
        sync_ns=tuple(_ns(_allreduce_s(4.0 * p, num_replicas, bandwidth)) for p in params),
        step_ns=_ns(max(params) * stages_per_worker * STEP_BYTES_PER_PARAM / memory_bytes_per_s),
        curv_a_ns=table("curv_a"),
        curv_b_ns=table("curv_b"),
        sync_factor_ns=_factor_sync_ns(bert_config, encoder, num_replicas, bandwidth),
        invert_ns=table("invert"),
        precond_ns=tuple(_ns(sum(row) / flops_per_s) for row in kfac["precond"]),
    )


def estimate_run_costs(run: RunShape, hardware: Hardware = Hardware()) -> CostModel:
    """:func:`estimate_costs` for a :class:`RunShape`."""
    return estimate_costs(run.bert, run.num_model_stages, run.micro_batch_size, run.seq_len,
                          run.max_predictions, hardware.flops_per_s, hardware.p2p_bytes_per_s,
                          layers_per_stage=run.encoder_layers, num_replicas=run.num_replicas,
                          stages_per_worker=run.stages_per_worker,
                          allreduce_bytes_per_s=hardware.allreduce_bytes_per_s,
                          memory_bytes_per_s=hardware.memory_bytes_per_s,
                          bytes_per_element=run.bytes_per_element, recompute=run.recompute_flags,
                          preconditioner=run.preconditioner)


# -- from a profile ----------------------------------------------------------------------------


def costs_from_profile(profile: Profile, run: RunShape | None = None, *,
                       path: str | Path | None = None) -> CostModel:
    """Means per stage and kind of a profile's events, as a cost model for the simulator.

    F, B, SYNC_GRAD (per stage) and STEP (overall, and per worker) are the means of their events; the message latency is
    the median, over receives that waited, of receive end − matching send start. K-FAC units come
    from the profile when it recorded them (per stage and layer; a unit recorded for all layers at
    once is split in proportion to the FLOP estimate); units it lacks are estimated from FLOPs at
    the FLOP rate the stage's forwards achieved (``run`` gives the model). Waits for all-reduces
    (``timeline.is_wait``) are left out: SYNC_GRAD and SYNC_FACTOR cost what starting the
    asynchronous all-reduce took on the worker, and no action is charged for its wait.

    Args:
        profile: what ``read_profile`` returned.
        run: the run's shape; None reads it from ``profile.metadata["config"]``.
        path: the profile's file, for messages.

    Raises:
        ValueError: the profile does not fit the run (stage count, K-FAC layer indices), lacks
            forwards or backwards of a stage, or carries no run config when ``run`` is None; the
            message names the file, the field and the fix.
    """
    where = str(path) if path is not None else "profile"
    if run is None:
        cfg = profile.metadata.get("config")
        if not isinstance(cfg, Mapping):
            raise ValueError(f"{where}: field metadata.config is missing (an nsys export, or written without "
                             f"it); rerun profile.py, or give the run's keys (model=, pipeline=, stages=, ...)")
        try:
            run = RunShape.from_train_config(cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: field metadata.config is not a train config ({exc!r}); rerun "
                             f"profile.py with this version of pipefisher") from None
    d = run.num_model_stages
    kfac_layers = run.kfac_layers
    durations: dict[tuple[str, int, int | None], list[int]] = defaultdict(list)
    steps: list[int] = []
    worker_steps: dict[int, list[int]] = defaultdict(list)
    stage_steps: dict[int, list[int]] = defaultdict(list)
    sends: dict[tuple[int, int, str], int] = {}
    recvs: list[tuple[int, int, Action, int, int]] = []
    for e in profile.events:
        try:
            a = Action.from_str(e.name)
        except ValueError:
            continue
        if is_wait(e):  # an action's wait for an all-reduce: neither the action's cost nor the all-reduce's
            continue
        if a.kind == K.STEP and a.stage is not None:  # a stage STEP (optimizer_placement=per_stage)
            stage_steps[a.stage].append(e.duration_ns)
            continue
        if a.kind == K.STEP:
            steps.append(e.duration_ns)
            worker_steps[e.worker].append(e.duration_ns)
            continue
        if a.stage is not None and not 0 <= a.stage < d:
            raise ValueError(f"{where}: event {e.name!r} names stage {a.stage}, but the run has {d} stages "
                             f"(field metadata.num_stages / config stages); profile the run you plan for "
                             f"or pass its stages= and pipeline=")
        if a.kind.is_kfac and a.layer is not None and a.layer >= kfac_layers[a.stage]:
            raise ValueError(f"{where}: event {e.name!r} names K-FAC layer {a.layer} of stage {a.stage}, "
                             f"which has {kfac_layers[a.stage]} (6 Linear layers per encoder layer; field "
                             f"config.model / pipeline.layers_per_stage); profile the same model and partition")
        if a.kind in (K.SEND_F, K.SEND_B):
            sends[(e.step, e.worker, e.name)] = e.start_ns
        elif a.kind in (K.RECV_F, K.RECV_B):
            recvs.append((e.step, e.worker, a, e.start_ns, e.end_ns))
        else:
            durations[(a.kind.value, a.stage, a.layer)].append(e.duration_ns)
    for kind in ("F", "B"):  # a stage's backwards may all be split: I and W then stand for B
        missing = [s for s in range(d) if not durations.get((kind, s, None))
                   and not (kind == "B" and durations.get(("I", s, None)) and durations.get(("W", s, None)))]
        if missing:
            raise ValueError(f"{where}: no {kind} events for stage(s) {missing} of {d}; the profile is not of "
                             f"a {run.method} run with {run.stages} stages: profile it (python profile.py "
                             f"pipeline={run.method} stages={run.stages} ...) or pass the profile's stages=")
    latencies, negative = [], 0
    for step, w, r, start, end in recvs:
        sent = sends.get((step, r.peer, str(matching_send(r, w))))
        if sent is not None and end > start:
            if end < sent:  # the receive ended before its send began: the two clocks disagree
                negative += 1
                continue
            latencies.append(end - sent)
    if negative:
        log.warning("%s: %d of %d receive(s) that waited ended before their send started, so the ranks' clocks "
                    "disagree (per-rank exports from hosts whose clocks are not synchronized); they are left out "
                    "of the message latency (p2p_ns%s); synchronize the hosts' clocks (NTP/PTP) or profile on one "
                    "node for message latencies", where, negative, negative + len(latencies),
                    " = 0: none left" if not latencies else "")
    fwd = tuple(mean_ns(durations[("F", s, None)]) for s in range(d))
    sync = tuple(mean_ns(durations[("SYNC_GRAD", s, None)]) if durations.get(("SYNC_GRAD", s, None)) else 0
                 for s in range(d))

    # K-FAC: measured where recorded, else FLOPs at this stage's measured forward rate.
    partition = run.partition
    flops_fwd = [c * run.micro_batch_size for c in
                 stage_costs(layer_costs(run.bert, run.seq_len, run.max_predictions), partition)]
    rate = [flops_fwd[s] / fwd[s] if fwd[s] > 0 else 1.0 for s in range(d)]  # FLOPs per ns
    est = _kfac_flops(run.bert, run.encoder_layers, run.micro_batch_size * run.seq_len, run.preconditioner)

    def table(kind: str, name: str) -> tuple[tuple[int, ...], ...]:
        rows = []
        for s in range(d):
            guess = [x / rate[s] for x in est[name][s]]
            whole = durations.get((kind, s, None))
            row = []
            for layer in range(kfac_layers[s]):
                got = durations.get((kind, s, layer))
                if got:
                    row.append(mean_ns(got))
                elif whole:  # recorded for all layers at once: split like the estimate
                    row.append(round(mean_ns(whole) * guess[layer] / max(sum(guess), 1e-9)))
                else:
                    row.append(round(guess[layer]))
            rows.append(tuple(row))
        return tuple(rows)

    # Factor all-reduces: measured, else at the bandwidth the stage's gradient all-reduce achieved
    # (same members, same ring), else at the default bandwidth.
    factor_sync = []
    fallback = _factor_sync_ns(run.bert, run.encoder_layers, run.num_replicas, Hardware().allreduce)
    params = stage_parameters(run.bert, partition)
    for s in range(d):
        dims = kfac_linear_dims(run.bert, run.encoder_layers[s])
        row = []
        for layer in range(kfac_layers[s]):
            got = durations.get(("SYNC_FACTOR", s, layer)) or durations.get(("SYNC_FACTOR", s, None))
            i, o = dims[layer]
            if got:
                row.append(mean_ns(got))
            elif sync[s] > 0:
                row.append(round(sync[s] * (i * i + o * o) / params[s]))
            else:
                row.append(fallback[s][layer] if run.num_replicas > 1 and not durations.get(("SYNC_GRAD", s, None))
                           else 0)
        factor_sync.append(tuple(row))
    precond = tuple(mean_ns(durations[("PRECOND", s, None)]) if durations.get(("PRECOND", s, None))
                    else round(sum(est["precond"][s]) / rate[s]) for s in range(d))
    if not any(k[0] in ("CURV_A", "CURV_B", "INVERT") for k in durations):
        log.info("%s has no K-FAC events: K-FAC unit costs estimated from FLOPs at the measured "
                 "forward rate (%.3g FLOP/s)", where, statistics.mean(rate) * 1e9)
    compute = compute_cost_fields({(kind, s): mean_ns(durations[(kind, s, None)]) for kind in ("F", "B", "I", "W")
                                   for s in range(d) if durations.get((kind, s, None))}, d)
    return CostModel(
        forward_ns=fwd,
        backward_ns=tuple(compute["backward_ns"]),
        input_grad_ns=tuple(compute["input_grad_ns"]),
        weight_grad_ns=tuple(compute["weight_grad_ns"]),
        p2p_ns=round(statistics.median(latencies)) if latencies else 0,
        sync_ns=sync,
        step_ns=mean_ns(steps) if steps else 0,
        worker_step_ns=worker_step_costs(worker_steps),
        stage_step_ns=tuple(mean_ns(stage_steps[s]) if stage_steps.get(s) else 0 for s in range(d)),
        curv_a_ns=table("CURV_A", "curv_a"),
        curv_b_ns=table("CURV_B", "curv_b"),
        sync_factor_ns=tuple(factor_sync),
        invert_ns=table("INVERT", "invert"),
        precond_ns=precond,
    )
