"""Structured config schemas (registered in Hydra's ConfigStore) and cross-field validation.

Every YAML file under ``conf/`` extends one of these schemas through its defaults list, so a typo
or a wrong type fails at composition with Hydra's message. Checks that involve several fields
run once in :func:`validate` (reached from ``TrainConfig.__post_init__`` through
``OmegaConf.to_object``), before any worker process starts; each message names the field, the
value and the fix.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

__all__ = [
    "ConfigError",
    "ModelConfig",
    "PipelineConfig",
    "OptimizerConfig",
    "DataConfig",
    "ClusterConfig",
    "WandbConfig",
    "ProfileConfig",
    "FaultConfig",
    "CheckpointConfig",
    "EvalConfig",
    "HardwareConfig",
    "TrainConfig",
    "check_override_keys",
    "refuse_unknown_keys",
    "micro_batch_rule",
    "num_micro_batches_for",
    "schedule_method",
    "register_configs",
    "resolve_batch",
    "to_train_config",
    "validate",
]

log = logging.getLogger(__name__)

PIPELINE_METHODS = ("gpipe", "1f1b", "chimera", "interleaved", "zb-h1", "zb-v", "dualpipev", "v-half", "v-min",
                    "csv")  # csv: pipeline.csv, a torch schedule file
V_METHODS = ("zb-v", "dualpipev", "v-half", "v-min")  # two chunks per worker in a V (pipefisher.schedules.v_schedules)
CHIMERA_STACKINGS = ("direct", "doubling")  # pipeline.chimera_stacking (Chimera paper, Sec. 3.5)
FACTOR_DECAY_UNITS = ("step", "refresh")  # optimizer.factor_decay_per
PROMOTE_INVERSES = ("at_cycle_end", "when_ready")  # optimizer.promote_inverses (as pipefisher.schedules.kfac's)
OPTIMIZERS = ("nvlamb", "kfac", "pipefisher", "adamw", "muon")
KFAC_OPTIMIZERS = ("kfac", "pipefisher")  # the optimizers that run K-FAC work (preconditioners, a refresh plan)
PRECONDITIONERS = ("kfac", "ekfac")  # optimizer.preconditioner (as pipefisher.optim.PRECONDITIONERS)
DATA_KINDS = ("synthetic", "hdf5")
PRECISIONS = ("fp32", "bf16")
WANDB_MODES = ("offline", "online", "disabled")
FAULT_MODES = ("none", "raise", "kill", "stall", "nan", "nan_grad")
OPTIMIZER_PLACEMENTS = ("global", "per_stage")
NONFINITE_MODES = ("stop", "skip")
INVERSE_DTYPES = ("auto", "float32", "float64")
NS_DTYPES = ("auto", "bf16", "fp32")  # optimizer.ns_dtype (pipefisher.optim.muon.NS_DTYPES)
KFAC_UPDATES = ("lamb", "momentum")
RESUME_MODES = ("none", "auto")  # or a path to a checkpoint (step_<n>) or a checkpoint directory


class ConfigError(ValueError):
    """A configuration value or combination that cannot run; the message names the fix."""


@dataclass
class ModelConfig:
    """BERT size (DESIGN.md, "BERT sizes")."""

    name: str = "bert-tiny"  # label used in run names and tables
    num_layers: int = 2  # encoder layers L
    hidden_size: int = 128  # H
    num_heads: int = 2  # attention heads A; H must be divisible by A
    intermediate_size: Optional[int] = None  # FFN width; None means 4H
    vocab_size: int = 30522  # WordPiece vocabulary size
    max_position_embeddings: int = 512  # longest sequence the position table covers
    type_vocab_size: int = 2  # segment ids (sentence A / B)
    hidden_dropout: float = 0.1  # dropout on embeddings, attention output and FFN output
    attention_dropout: float = 0.1  # dropout on attention probabilities


@dataclass
class PipelineConfig:
    """Pipeline method; the stage count is the top-level key ``stages``."""

    method: str = "gpipe"  # one of gpipe, 1f1b, chimera, interleaved, zb-h1, zb-v, dualpipev, v-half, v-min, csv
    num_virtual: int = 1  # model chunks per worker (interleaved; zb-v, dualpipev, v-half, v-min: exactly 2)
    order_costs: Optional[list[float]] = None  # zb-v: relative [F, I, W] cost of a stage its list scheduler orders by (default equal)
    activation_memory: float = 1.0  # zb-v: activation bound as a multiple of 1F1B's peak (>= 1)
    layers_per_stage: Optional[list[int]] = None  # explicit encoder layers per stage; None = balance by cost
    csv: Optional[str] = None  # pipeline=csv: torch.distributed.pipelining compute-only CSV (_dump_csv); stages, num_virtual, N from the file
    chimera_stacking: str = "direct"  # chimera with N > D: direct (basic units concatenated) or doubling (forwards in pairs; N a multiple of 2 x stages, more activation memory)


@dataclass
class OptimizerConfig:
    """Optimizer; the base learning rate is the top-level key ``lr``."""

    name: str = "nvlamb"  # one of nvlamb, kfac, pipefisher, adamw (torch AdamW), muon (torch Muon on encoder matrices + AdamW)
    weight_decay: float = 0.01  # decoupled weight decay (none on bias and LayerNorm)
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    eps: float = 1e-6  # Adam epsilon
    max_grad_norm: float = 1.0  # global gradient-norm clip over all stages; <= 0 disables
    warmup_proportion: float = 0.1  # fraction of `steps` with linear warm-up
    poly_power: float = 0.5  # polynomial decay power after warm-up (NVIDIA phase 1)
    damping: float = 1e-3  # K-FAC damping λ (kfac, pipefisher)
    curvature_interval: int = 1  # kfac: refresh the factors every this many steps (pipefisher: the plan picks k)
    inverse_interval: int = 1  # kfac: recompute the inverses every this many steps, a multiple of curvature_interval (pipefisher: equal to it)
    factor_decay: float = 0.95  # K-FAC running-average decay of the factors (per step, or per refresh: factor_decay_per)
    factor_decay_per: str = "step"  # step: a refresh every k steps decays by factor_decay**k (the average spans the same steps at any k); refresh: by factor_decay
    deferred_inverse: bool = False  # kfac: use inverses from the next refresh cycle on, as pipefisher does
    promote_inverses: str = "at_cycle_end"  # deferred inverses (kfac with deferred_inverse or a schedule; pipefisher, whose group sets when_ready) in use from the next cycle (at_cycle_end, age <= 2k-1) or from the step after their INVERT (when_ready, age <= k + its phase lag)
    schedule: Optional[str] = None  # pipefisher: work-assignment JSON from schedule.py (kfac: run it on the critical path)
    inverse_dtype: str = "float32"  # K-FAC inversion precision: float32 (as ASDL), float64, or auto (float64 up to 1024 wide)
    curvature_micro_batches: int = 0  # K-FAC curvature from the first n micro-batches of each pipe per refresh; 0 = all
    curvature_placement: str = "after_capture"  # pipefisher planner: after_capture (after F / B or I) or beside_w (after the micro-batch's W; zero-bubble schedules)
    max_interval: int = 8  # pipefisher: the largest refresh interval k the planner tries
    max_staleness: Optional[int] = None  # pipefisher (its group sets 8): bound on the curvature age in steps (the plan's bound for promote_inverses <= it); None = no bound
    staleness_curve: Optional[str] = None  # pipefisher planner: JSON of steps multiplier per k measured by the convergence study (staleness_b<batch>.json); the planner then picks the k of least step time x multiplier; None = the smallest k whose bubbles hold the refresh
    kfac_update: str = "lamb"  # update of K-FAC layers: lamb (NVLAMB on the preconditioned gradient) or momentum (reference: no second moment)
    kfac_lr: Optional[float] = None  # kfac_update=momentum: peak lr of the K-FAC layers; None = lr
    kfac_max_grad_norm: float = 100.0  # kfac_update=momentum: clip of the K-FAC layers' preconditioned gradient norm; <= 0 disables
    clip_before_precondition: bool = True  # take the global-norm clip from the gradient before K-FAC preconditions it
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the Muon half (torch's default)
    ns_dtype: str = "auto"  # muon: Newton–Schulz precision: auto (bf16 where the device has bf16 arithmetic: CUDA capability >= 8.0, CPUs with avx512_bf16/amx_bf16; else fp32), bf16 (torch's Muon) or fp32
    preconditioner: str = "kfac"  # kfac, pipefisher: kfac (damped inverses of the factors) or ekfac (Adam in the factors' eigenbasis, SOAP's rule; optimizer=ekfac sets it)
    ekfac_beta2: float = 0.999  # preconditioner=ekfac: decay of the second moment in the eigenbasis
    ekfac_eps: float = 1e-8  # preconditioner=ekfac: added to the square root of that moment


@dataclass
class DataConfig:
    """Pretraining data: synthetic (built in, no download) or NVIDIA-format hdf5 shards."""

    kind: str = "synthetic"  # synthetic or hdf5
    path: Optional[str] = None  # hdf5: a shard file or a directory of shards
    seq_len: int = 128  # tokens per sequence S (phase 1: 128, phase 2: 512)
    max_predictions: int = 20  # masked positions per sequence P (phase 1: 20, phase 2: 80)
    num_samples: int = 1_000_000  # synthetic: samples per epoch (and in the held-out set)
    eval_path: Optional[str] = None  # hdf5: held-out shards (file or directory); None = <data.path>/heldout (prepare --holdout-fraction)


@dataclass
class ClusterConfig:
    """Where the workers run. ``cluster=slurm`` also switches Hydra's launcher to submitit."""

    name: str = "local"  # local or slurm
    master_addr: str = "127.0.0.1"  # local: rendezvous address of the worker processes
    master_port: int = 0  # local: rendezvous port; 0 picks a free one
    worker_timeout_s: float = 600.0  # a worker silent for this long ends the job
    requeue: bool = True  # slurm: on SIGUSR2 (preemption or time limit) checkpoint at the next step end and requeue
    nodes: int = 1  # slurm: nodes per run; the stages*data_parallel*sdp*tp processes (one SLURM task each) split evenly over them
    partition: Optional[str] = None  # slurm: partition (sbatch --partition); None = the cluster's default
    account: Optional[str] = None  # slurm: account charged (sbatch --account); None = the user's default


@dataclass
class WandbConfig:
    """Weights & Biases logging (rank 0 only). Offline by default; ``WANDB_MODE`` wins when set."""

    mode: str = "offline"  # offline, online or disabled
    project: str = "pipefisher"  # wandb project
    group: Optional[str] = None  # run group; None = the sweep directory's name


@dataclass
class ProfileConfig:
    """Timeline recording into ``profile.sqlite`` and a picture (``profile.py`` turns it on)."""

    enabled: bool = False  # write profile.sqlite, timeline.pdf/png in the run's output directory
    warmup_steps: int = 1  # steps left out of the profile (allocator and thread-pool warm-up)


@dataclass
class FaultConfig:
    """Inject a failure into one worker, to test that the job ends promptly (a testing aid)."""

    mode: str = "none"  # none, raise (exception), kill (SIGKILL itself), stall (sleep forever), nan (poison its outputs), nan_grad (one LayerNorm's gradient NaN, the loss finite)
    rank: int = 0  # which worker fails
    step: int = 0  # at the start of which step


@dataclass
class CheckpointConfig:
    """Periodic checkpoints for exact resume (``pipefisher.runtime.checkpoint``); ``resume`` is top-level."""

    every_steps: int = 0  # save every n steps (and after the last); folders count from step_0: 2 gives step_1, step_3, ...; 0 = off
    every_minutes: float = 0.0  # also save when this many minutes passed since the last save; 0 = off
    keep_last: int = 2  # complete checkpoints kept in `dir`, older ones deleted; 0 = keep all
    dir: Optional[str] = None  # where step_<n>/ folders go; None = <run output dir>/checkpoints
    on_stop_after_s: float = 60.0  # Ctrl-C/SIGTERM save the last step once the run trained this long (s); < 0 = only with every_* on

    @property
    def enabled(self) -> bool:
        """Whether this run writes checkpoints."""
        return self.every_steps > 0 or self.every_minutes > 0


@dataclass
class HardwareConfig:
    """What a run's FLOP rate is measured against (``mfu``)."""

    peak_tflops: Optional[float] = None  # peak TFLOP/s at the run's precision of one GPU (MFU counts one per worker) or of the CPU cores the run uses; None = the device table (GPU) or a matmul measurement (CPU)


@dataclass
class EvalConfig:
    """Held-out evaluation (``pipefisher.data.heldout``): the same batches at every evaluation."""

    every_steps: int = 0  # evaluate on held-out data every n steps and after the last step; 0 = off
    batches: int = 8  # held-out micro-batches per evaluation, each of micro_batch_size sequences (>= 1)


@dataclass
class TrainConfig:
    """One pretraining run. Top-level keys are the ones users type most."""

    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)

    stages: int = 1  # pipeline stages D (1 = single process)
    data_parallel: int = 1  # data-parallel width W (W pipelines, or W Chimera pairs)
    sdp: int = 1  # sharded data parallel (FSDP2) inside each data-parallel replica: sdp pipelines, each stage sharded over its sdp copies; world = stages x data_parallel x sdp
    sdp_reshard_after_forward: bool = False  # sdp>1: free the gathered weights after every forward (re-gather for its backward); false: one all-gather and one reduce-scatter per stage per step
    tp: int = 1  # tensor parallel (DTensor, Megatron-style) inside each pipeline worker: every encoder layer split over tp processes; world = stages x data_parallel x sdp x tp
    global_batch_size: Any = "auto"  # sequences per optimizer step over all micro-batches and replicas, or auto (resolve_batch)
    micro_batch_size: Any = "auto"  # sequences per micro-batch, or auto: global_batch_size / (num_micro_batches x data_parallel)
    num_micro_batches: Any = "auto"  # micro-batches per step N (an int), or auto (resolve_batch)
    steps: int = 100  # optimizer steps
    seed: int = 0  # seed of weights and data order
    lr: float = 1e-3  # peak learning rate
    precision: str = "fp32"  # fp32 or bf16 (autocast)
    recompute: bool = False  # recompute encoder-layer activations in the backward pass, in every model stage
    recompute_stages: Optional[list[int]] = None  # recompute in these model stages only (0 .. stages*pipeline.num_virtual-1), e.g. [0, 1]; null: as recompute says; not with recompute=true
    device: str = "auto"  # auto (cuda if available), cpu or cuda
    log_every: int = 10  # wandb, progress-bar loss and the simulated utilization every n steps (and the last); metrics.jsonl gets every step
    progress: bool = True  # show a progress bar on rank 0
    comm_ablation: bool = False  # 1-byte messages instead of activations/gradients/all-reduces (timing only: the loss is meaningless)
    on_nonfinite: str = "stop"  # NaN/inf in loss or gradients: stop (naming the step) or skip (drop that step's update)
    optimizer_placement: str = "global"  # global: one STEP per worker after a global barrier; per_stage: each stage steps once its gradients are final, checked against the global norm (docs/optimizer-placement.md)
    max_skipped_steps: int = 10  # on_nonfinite=skip: most skipped steps in a row; one more stops the run
    resume: str = "none"  # none, auto (latest complete checkpoint in checkpoint.dir, if any) or a checkpoint path
    init_from: Optional[str] = None  # start from these weights only (new optimizer and schedule): a run folder, its final/, a step_<n> checkpoint or an export; NVIDIA's phase 2
    save_final: bool = True  # write the trained weights to <run>/final/ (config.json, model.safetensors, vocab.txt: Hugging Face's layout)
    strategy: Optional[str] = None  # strategy.json of `schedule.py whatif=true`: sets stages, data_parallel, sdp, tp, pipeline, batch, recompute, optimizer and model before validation (explicit keys that disagree are refused); the run then logs predicted vs measured step time and memory

    def __post_init__(self) -> None:
        validate(self)

    @property
    def num_workers(self) -> int:
        """Worker processes the run needs (a pipeline worker is tp processes)."""
        return self.stages * self.data_parallel * self.sdp * self.tp

    def recomputes(self, stage: int) -> bool:
        """Whether model stage ``stage`` recomputes its encoder layers' activations in the backward
        (``recompute`` for every stage, or membership in ``recompute_stages``)."""
        return self.recompute or stage in (self.recompute_stages or ())

    @property
    def data_replicas(self) -> int:
        """Pipelines fed different data: data_parallel x sdp (sharded replicas see different data too)."""
        return self.data_parallel * self.sdp

    @property
    def micro_batches_per_pipe(self) -> int:
        """Micro-batches each pipe of a step carries: Chimera's two pipes (stages > 1) split them."""
        return self.num_micro_batches // (2 if self.pipeline.method == "chimera" and self.stages > 1 else 1)


def _fail(field_name: str, value: Any, fix: str) -> None:
    raise ConfigError(f"{field_name}={value!r}: {fix}")


def _check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        _fail(field_name, value, f"choose one of {', '.join(choices)}")


def _check_kfac_intervals(o: OptimizerConfig) -> None:
    """Factors every ``curvature_interval`` steps, inverses every ``inverse_interval`` steps: a
    multiple of it (kfac-pytorch's factor_update_steps / inv_update_steps), so that every inversion
    sees a fresh factor refresh; decoupled only for optimizer=kfac without a plan."""
    f, k = o.curvature_interval, o.inverse_interval
    if f < 1:
        _fail("optimizer.curvature_interval", f, "must be >= 1")
    if k < 1 or k % f:
        _fail("optimizer.inverse_interval", k, f"must be a multiple of optimizer.curvature_interval={f}")
    if k != f and (o.name != "kfac" or o.schedule):
        _fail("optimizer.inverse_interval", k, f"the {'plan' if o.schedule else 'pipefisher planner'} refreshes "
              f"factors and inverses together; decoupled intervals need optimizer=kfac without optimizer.schedule "
              f"(set it equal to optimizer.curvature_interval={f})")


def _check_ekfac(o: OptimizerConfig) -> None:
    """``optimizer.preconditioner`` and ekfac's moment settings (``pipefisher.optim.ekfac``)."""
    _check_choice("optimizer.preconditioner", o.preconditioner, PRECONDITIONERS)
    if o.preconditioner != "ekfac":
        if (o.ekfac_beta2, o.ekfac_eps) != (OptimizerConfig.ekfac_beta2, OptimizerConfig.ekfac_eps):
            log.warning("optimizer.ekfac_beta2 / optimizer.ekfac_eps have no effect unless optimizer.preconditioner=ekfac")
        return
    if not 0.0 <= o.ekfac_beta2 < 1.0:
        _fail("optimizer.ekfac_beta2", o.ekfac_beta2, "a second-moment decay must lie in [0, 1), e.g. 0.999 (SOAP's)")
    if not 0.0 < o.ekfac_eps < float("inf"):
        _fail("optimizer.ekfac_eps", o.ekfac_eps, "must be > 0 (it keeps coordinates without gradient finite), "
              "e.g. optimizer.ekfac_eps=1e-8")
    if o.damping != OptimizerConfig.damping:
        log.warning("optimizer.damping has no effect with optimizer.preconditioner=ekfac: damping does not change "
                    "an eigenbasis (ekfac_eps keeps the scaling finite)")


def _check_positive(cfg: TrainConfig, names: list[str]) -> None:
    for name in names:
        obj: Any = cfg
        for part in name.split("."):
            obj = getattr(obj, part)
        if obj < 1:
            _fail(name, obj, "must be at least 1")


def schedule_method(method: str, chimera_stacking: str = "direct") -> str:
    """The schedule generator a run uses (``pipefisher.schedules.GENERATORS``): the method, or
    ``chimera-doubling`` for pipeline=chimera with pipeline.chimera_stacking=doubling."""
    return "chimera-doubling" if method == "chimera" and chimera_stacking == "doubling" else method


def num_micro_batches_for(method: str, stages: int, chimera_stacking: str = "direct") -> int:
    """What ``num_micro_batches=auto`` means: the smallest N that every method accepts and that
    fills the pipeline, N = stages (one process and data parallelism alone: 1).

    GPipe and 1F1B run any N, but below D micro-batches a stage idles for more than half a step
    (bubble (D-1)/(N+D-1)); Chimera and interleaved 1F1B need a multiple of D, and D is the
    smallest (Chimera's bubble (D-2)/(2N+D-2)); the V schedules (zb-v, dualpipev, v-half, v-min) need N >= 2D, and Chimera with forward
    doubling a multiple of 2D.
    """
    _check_choice("pipeline.method", method, PIPELINE_METHODS)
    doubled = method in V_METHODS or schedule_method(method, chimera_stacking) == "chimera-doubling"
    return max(1, stages) * (2 if doubled else 1)


DEFAULT_GLOBAL_BATCH = 16  # global_batch_size=auto without a micro_batch_size: sequences per step


def _as_count(name: str, value: Any, what: str) -> int | None:
    """``auto`` -> None; a whole number (int or digit string) -> int; anything else fails naming ``name``."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    if isinstance(value, str) and value.strip().lstrip("+").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, value, f"give a whole number of {what}, or {name}=auto")
    return value


def micro_batch_rule(method: str, stages: int, chimera_stacking: str = "direct") -> tuple[int, str] | None:
    """What a method needs of N at ``stages`` > 1: (m, why) for "a multiple of m" or (-m, why) for "at least m"."""
    if stages < 2:
        return None
    if schedule_method(method, chimera_stacking) == "chimera-doubling":
        return 2 * stages, f"chimera with pipeline.chimera_stacking=doubling needs a multiple of 2 x stages = {2 * stages}"
    if method in ("chimera", "interleaved"):
        return stages, f"{method} needs a multiple of stages={stages}"
    if method in V_METHODS:
        return -2 * stages, f"{method} needs at least 2 x stages = {2 * stages} micro-batches to fill its V"
    return None


def _accepts(method: str, stages: int, n: int, chimera_stacking: str = "direct") -> bool:
    rule = micro_batch_rule(method, stages, chimera_stacking)
    if rule is None:
        return True
    m, _ = rule
    return n % m == 0 if m > 0 else n >= -m


def resolve_batch(cfg: TrainConfig) -> None:
    """Fix ``global_batch_size`` (G), ``micro_batch_size`` (m) and ``num_micro_batches`` (N), with
    G = m x N x data_parallel x sdp, replacing each ``auto``:

    - N=auto is the method's smallest N (``num_micro_batches_for``), except that given G and m it is
      G / (m x data_parallel);
    - m=auto is G / (N x data_parallel);
    - G=auto is m x N x data_parallel when m is given, else ``DEFAULT_GLOBAL_BATCH`` (16);

    here data_parallel stands for data_parallel x sdp: sharded replicas see different data too.

    So by default every method and stage count trains on the same 16 sequences per step (as
    Megatron's ``--global-batch-size`` fixes the batch and derives the micro-batch count).

    Raises:
        ConfigError: when the three cannot agree, naming the field and values that would.
    """
    w = cfg.data_parallel
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        _fail("data_parallel", w, "must be at least 1")
    if isinstance(cfg.sdp, bool) or not isinstance(cfg.sdp, int) or cfg.sdp < 1:
        _fail("sdp", cfg.sdp, "must be at least 1 (1 = no sharding)")
    w *= cfg.sdp  # sharded replicas see different data, as data-parallel ones do
    wn = "data_parallel" if cfg.sdp == 1 else "data_parallel x sdp"  # what w counts, in messages
    ws = str(w) if cfg.sdp == 1 else f"({cfg.data_parallel} x {cfg.sdp})"
    g = _as_count("global_batch_size", cfg.global_batch_size, "sequences per optimizer step")
    m = _as_count("micro_batch_size", cfg.micro_batch_size, "sequences per micro-batch")
    n = _as_count("num_micro_batches", cfg.num_micro_batches, "micro-batches per step")
    method, stages, stacking = cfg.pipeline.method, cfg.stages, cfg.pipeline.chimera_stacking
    for name, v in (("global_batch_size", g), ("micro_batch_size", m), ("num_micro_batches", n)):
        if v is not None and v < 1:
            _fail(name, v, "must be at least 1")
    derived_n = n is None and g is not None and m is not None
    if n is None:
        if derived_n:
            if g % (m * w):
                _fail("global_batch_size", g, f"must be a multiple of micro_batch_size x {wn} = {m * w}; "
                      f"use global_batch_size={max(1, g // (m * w)) * m * w} or micro_batch_size=auto")
            n = g // (m * w)
            if not _accepts(method, stages, n, stacking):
                _, why = micro_batch_rule(method, stages, stacking)  # type: ignore[misc]
                _fail("global_batch_size", g, f"gives num_micro_batches={n} micro-batches of micro_batch_size={m} "
                      f"x {wn}={w}, but {why}; use global_batch_size="
                      f"{_nearest_ok(method, stages, n, stacking) * m * w} "
                      f"or a smaller micro_batch_size")
        else:
            n = num_micro_batches_for(method, stages, stacking)
        if stages > 1:
            log.info("num_micro_batches=auto: %d for pipeline=%s with stages=%d", n, method, stages)
    if m is None:
        shown: Any = g if g is not None else f"auto ({DEFAULT_GLOBAL_BATCH})"
        g = DEFAULT_GLOBAL_BATCH if g is None else g
        if g % (n * w):
            _fail("global_batch_size", shown, f"must be a multiple of num_micro_batches x {wn} = {n} x {ws} "
                  f"= {n * w} to split into equal micro-batches; use global_batch_size={-(-g // (n * w)) * n * w} "
                  f"or give micro_batch_size")
        m = g // (n * w)
    elif g is None:
        g = m * n * w
    elif g != m * n * w:
        _fail("global_batch_size", g, f"disagrees with micro_batch_size x num_micro_batches x {wn} = "
              f"{m} x {n} x {ws} = {m * n * w}; set one of the three to auto (or global_batch_size={m * n * w})")
    cfg.global_batch_size, cfg.micro_batch_size, cfg.num_micro_batches = g, m, n


def _nearest_ok(method: str, stages: int, n: int, chimera_stacking: str = "direct") -> int:
    """The smallest micro-batch count >= n that ``method`` accepts at ``stages``."""
    k = max(1, n)
    while not _accepts(method, stages, k, chimera_stacking):
        k += 1
    return k


def _check_cluster(cfg: TrainConfig) -> None:
    """``cluster.nodes`` must be a positive divisor of the worker count, and more than one node needs SLURM."""
    nodes = cfg.cluster.nodes
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        _fail("cluster.nodes", nodes, "give a whole number of nodes >= 1")
    if nodes > 1 and cfg.cluster.name != "slurm":
        _fail("cluster.nodes", nodes, "runs on several nodes go through SLURM: add cluster=slurm and run with -m")
    if cfg.num_workers % nodes:
        divisors = [d for d in range(1, cfg.num_workers + 1) if cfg.num_workers % d == 0]
        _fail("cluster.nodes", nodes, f"stages*data_parallel*sdp*tp={cfg.num_workers} processes (one SLURM task each) must "
              f"split evenly over the nodes; use one of {divisors}")


def _check_csv(cfg: TrainConfig) -> None:
    """pipeline=csv: the file must be a torch compute-only CSV for ``stages`` ranks; fills
    num_virtual (stages per rank) and num_micro_batches=auto from it, and makes the path absolute."""
    p = cfg.pipeline
    if p.method != "csv":
        if p.csv is not None:
            _fail("pipeline.csv", p.csv, "is read by pipeline=csv only; add pipeline=csv or drop pipeline.csv")
        return
    if not p.csv or not os.path.isfile(p.csv):
        _fail("pipeline.csv", p.csv, "pipeline=csv needs an existing torch compute-only CSV (e.g. from _dump_csv "
              "or python -m pipefisher.torch_schedule export); give pipeline.csv=<file>")
    from pipefisher.schedules.torch_csv import csv_shape  # pure; no torch import

    try:
        with open(p.csv, encoding="utf-8") as f:
            ranks, num_stages, n = csv_shape(f.read())
    except ValueError as err:
        _fail("pipeline.csv", p.csv, f"is not a torch compute-only schedule: {err}")
    if cfg.stages != ranks:
        _fail("stages", cfg.stages, f"pipeline.csv={p.csv} schedules {ranks} ranks; use stages={ranks}")
    if num_stages % ranks:
        _fail("pipeline.csv", p.csv, f"places {num_stages} stages on {ranks} ranks; every rank must hold as many stages")
    if cfg.pipeline.num_virtual not in (1, num_stages // ranks):
        _fail("pipeline.num_virtual", cfg.pipeline.num_virtual,
              f"pipeline.csv={p.csv} holds {num_stages // ranks} stage(s) per rank; leave it unset")
    given = _as_count("num_micro_batches", cfg.num_micro_batches, "micro-batches per step")
    if given is not None and given != n:
        _fail("num_micro_batches", given, f"pipeline.csv={p.csv} schedules {n} micro-batches; use "
              f"num_micro_batches={n} (or auto)")
    p.csv, p.num_virtual, cfg.num_micro_batches = os.path.abspath(p.csv), num_stages // ranks, n


def validate(cfg: TrainConfig) -> None:
    """Cross-field checks of a run's configuration (the batch's ``auto`` values are resolved first: resolve_batch).

    Raises:
        ConfigError: naming the field, its value and the fix, for the first problem found.
    """
    _check_choice("pipeline.method", cfg.pipeline.method, PIPELINE_METHODS)
    _check_choice("pipeline.chimera_stacking", cfg.pipeline.chimera_stacking, CHIMERA_STACKINGS)
    _check_csv(cfg)
    resolve_batch(cfg)
    m = cfg.model
    _check_positive(
        cfg,
        ["stages", "data_parallel", "micro_batch_size", "num_micro_batches", "steps",
         "model.num_layers", "model.hidden_size", "model.num_heads", "pipeline.num_virtual",
         "data.seq_len", "data.max_predictions", "log_every"],
    )
    if m.hidden_size % m.num_heads:
        _fail("model.num_heads", m.num_heads,
              f"model.hidden_size={m.hidden_size} must be divisible by it; pick a divisor of {m.hidden_size}")
    if cfg.data.seq_len > m.max_position_embeddings:
        _fail("data.seq_len", cfg.data.seq_len,
              f"exceeds model.max_position_embeddings={m.max_position_embeddings}; use data.seq_len<={m.max_position_embeddings}")
    if cfg.data.max_predictions > cfg.data.seq_len:
        _fail("data.max_predictions", cfg.data.max_predictions, f"must not exceed data.seq_len={cfg.data.seq_len}")
    _check_choice("optimizer.name", cfg.optimizer.name, OPTIMIZERS)
    _check_choice("data.kind", cfg.data.kind, DATA_KINDS)
    _check_choice("precision", cfg.precision, PRECISIONS)
    _check_choice("wandb.mode", cfg.wandb.mode, WANDB_MODES)
    _check_choice("cluster.name", cfg.cluster.name, ("local", "slurm"))
    _check_cluster(cfg)
    _check_choice("device", cfg.device, ("auto", "cpu", "cuda"))
    _check_choice("fault.mode", cfg.fault.mode, FAULT_MODES)
    _check_choice("on_nonfinite", cfg.on_nonfinite, NONFINITE_MODES)
    _check_choice("optimizer_placement", cfg.optimizer_placement, OPTIMIZER_PLACEMENTS)
    _check_choice("optimizer.inverse_dtype", cfg.optimizer.inverse_dtype, INVERSE_DTYPES)
    if cfg.max_skipped_steps < 0:
        _fail("max_skipped_steps", cfg.max_skipped_steps, "must be >= 0 (skipped steps in a row tolerated before the run stops)")
    if cfg.profile.enabled and not 0 <= cfg.profile.warmup_steps < cfg.steps:
        _fail("profile.warmup_steps", cfg.profile.warmup_steps,
              f"must be below steps={cfg.steps} so that some steps are profiled; e.g. steps={cfg.profile.warmup_steps + 3}")
    if cfg.fault.mode != "none" and not 0 <= cfg.fault.rank < cfg.num_workers:
        _fail("fault.rank", cfg.fault.rank, f"must name a worker in [0, {cfg.num_workers})")
    if cfg.lr <= 0:
        _fail("lr", cfg.lr, "the learning rate must be positive, e.g. lr=1e-3")
    if not 0.0 <= cfg.optimizer.warmup_proportion < 1.0:
        _fail("optimizer.warmup_proportion", cfg.optimizer.warmup_proportion, "must lie in [0, 1)")
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(m, name)
        if not 0.0 <= p < 1.0:
            _fail(f"model.{name}", p, "a dropout probability must lie in [0, 1)")

    # Pipeline shape.
    total_stages = cfg.stages * cfg.pipeline.num_virtual
    if total_stages > m.num_layers + 2:
        what = "stages" if cfg.pipeline.num_virtual == 1 else "stages*pipeline.num_virtual"
        _fail(what, total_stages,
              f"exceeds model.num_layers={m.num_layers} + 2 (one encoder layer per stage, plus a stage for "
              f"the heads and one for the embeddings); use {what} <= {m.num_layers + 2} or a deeper model")
    method = cfg.pipeline.method
    if method == "interleaved" and cfg.stages == 1 and cfg.pipeline.num_virtual > 1:
        # A worker's virtual stages hand activations and gradients to each other only through the
        # pipeline's p2p, and with one stage per pipe there is no next worker (issue 16, item 6).
        _fail("pipeline.num_virtual", cfg.pipeline.num_virtual,
              "pipeline=interleaved with stages=1 has no worker to pass its virtual stages' activations to "
              "(pipeline=interleaved sets num_virtual=2); use stages>=2 with num_micro_batches a multiple of it, "
              "or pipeline.num_virtual=1 (or pipeline=1f1b) for data parallelism alone")
    if cfg.stages > 1 or cfg.data_replicas > 1:
        if method == "chimera":
            if cfg.stages % 2:
                _fail("stages", cfg.stages,
                      f"chimera needs an even number of stages; use stages={cfg.stages - 1 or 2} "
                      f"or stages={cfg.stages + 1}, or pipeline=1f1b")
            if cfg.num_micro_batches % cfg.stages:
                _fail("num_micro_batches", cfg.num_micro_batches,
                      f"chimera needs a multiple of stages={cfg.stages}; use num_micro_batches="
                      f"{max(cfg.stages, cfg.num_micro_batches // cfg.stages * cfg.stages)} (or auto)")
            unit = 2 * cfg.stages
            if cfg.pipeline.chimera_stacking == "doubling" and cfg.num_micro_batches % unit:
                _fail("num_micro_batches", cfg.num_micro_batches,
                      f"chimera with pipeline.chimera_stacking=doubling runs whole doubled units of 2 x stages = "
                      f"{unit} micro-batches; use num_micro_batches={max(unit, cfg.num_micro_batches // unit * unit)} "
                      f"(or auto), or pipeline.chimera_stacking=direct")
        if method == "interleaved":
            if cfg.pipeline.num_virtual < 2:
                log.warning("pipeline=interleaved with pipeline.num_virtual=1 is plain 1F1B")
            if cfg.num_micro_batches % cfg.stages:
                _fail("num_micro_batches", cfg.num_micro_batches,
                      f"interleaved needs a multiple of stages={cfg.stages}; use num_micro_batches="
                      f"{max(cfg.stages, cfg.num_micro_batches // cfg.stages * cfg.stages)} (or auto)")
    if method != "chimera" and cfg.pipeline.chimera_stacking != "direct":
        _fail("pipeline.chimera_stacking", cfg.pipeline.chimera_stacking,
              "only pipeline=chimera stacks basic units; leave it at direct for other methods")
    if method != "zb-v" and (cfg.pipeline.order_costs is not None or cfg.pipeline.activation_memory != 1.0):
        _fail("pipeline.order_costs" if cfg.pipeline.order_costs is not None else "pipeline.activation_memory",
              cfg.pipeline.order_costs if cfg.pipeline.order_costs is not None else cfg.pipeline.activation_memory,
              "only pipeline=zb-v orders its actions by a list scheduler; leave it unset for other methods")
    if method in V_METHODS:
        if cfg.pipeline.num_virtual != 2:
            _fail("pipeline.num_virtual", cfg.pipeline.num_virtual,
                  f"{method} places exactly 2 model chunks per worker (a V); use pipeline.num_virtual=2 "
                  f"(pipeline={method} sets it)")
        if cfg.num_micro_batches < 2 * cfg.stages:
            _fail("num_micro_batches", cfg.num_micro_batches,
                  f"{method} needs at least 2 x stages = {2 * cfg.stages} micro-batches to fill its V; use "
                  f"num_micro_batches={2 * cfg.stages} or more (or auto), or pipeline=zb-h1")
    if method == "zb-v":
        oc = cfg.pipeline.order_costs
        if oc is not None and (len(oc) != 3 or min(oc) <= 0):
            _fail("pipeline.order_costs", list(oc), "give three positive relative costs [F, I, W] of a stage, "
                  "e.g. [1.0,1.2,1.0] (bench/zero_bubble.py measures them), or leave it unset (equal)")
        if not cfg.pipeline.activation_memory >= 1.0:
            _fail("pipeline.activation_memory", cfg.pipeline.activation_memory,
                  "a multiple of 1F1B's activation peak, at least 1.0 (e.g. 1.5)")
    elif method not in ("interleaved", "csv", *V_METHODS) and cfg.pipeline.num_virtual != 1:
        _fail("pipeline.num_virtual", cfg.pipeline.num_virtual,
              "only pipeline=interleaved and the V schedules (zb-v, dualpipev, v-half, v-min) use virtual stages; "
              "set it to 1")
    _check_recompute_stages(cfg, total_stages)
    lps = cfg.pipeline.layers_per_stage
    if lps is not None:
        if len(lps) != total_stages or any(n < 1 for n in lps[1:-1]) or min(lps) < 0 or sum(lps) != m.num_layers:
            _fail("pipeline.layers_per_stage", list(lps),
                  f"needs {total_stages} counts, each >= 1 (the first and the last may be 0), summing to "
                  f"model.num_layers={m.num_layers}")

    o = cfg.optimizer
    if o.name in KFAC_OPTIMIZERS:
        if o.damping <= 0:
            _fail("optimizer.damping", o.damping, "K-FAC damping must be positive, e.g. optimizer.damping=1e-3")
        if not 0.0 <= o.factor_decay < 1.0:
            _fail("optimizer.factor_decay", o.factor_decay, "must lie in [0, 1); 0 uses only the latest refresh")
        _check_choice("optimizer.factor_decay_per", o.factor_decay_per, FACTOR_DECAY_UNITS)
        if o.curvature_micro_batches < 0 or o.curvature_micro_batches > cfg.num_micro_batches:
            _fail("optimizer.curvature_micro_batches", o.curvature_micro_batches,
                  f"must lie in [0, num_micro_batches={cfg.num_micro_batches}] (0 = every micro-batch)")
        per_pipe = cfg.micro_batches_per_pipe
        if o.curvature_micro_batches > per_pipe:
            _fail("optimizer.curvature_micro_batches", o.curvature_micro_batches,
                  f"chimera gives each of its two pipes {per_pipe} micro-batches; use at most {per_pipe}")
        if o.curvature_placement not in ("after_capture", "beside_w"):
            _fail("optimizer.curvature_placement", o.curvature_placement,
                  "use after_capture (curvature after its F / its B or I) or beside_w (after the micro-batch's W)")
        if o.max_interval < 1:
            _fail("optimizer.max_interval", o.max_interval, "the planner needs to try at least k=1")
        if o.max_staleness is not None and o.max_staleness < 1:
            _fail("optimizer.max_staleness", o.max_staleness,
                  "PipeFisher's inverses are at least 1 step old (2k-1 with k=1); use >= 1 or leave it unset")
        if o.staleness_curve is not None:
            if o.name != "pipefisher" or o.schedule:
                _fail("optimizer.staleness_curve", o.staleness_curve, "only the pipefisher planner weighs a staleness "
                      "curve (optimizer=pipefisher without optimizer.schedule); pass it to schedule.py for a plan file")
            from pipefisher.staleness_curve import load_staleness_curve  # json only

            try:
                curve = load_staleness_curve(o.staleness_curve)
            except ValueError as e:
                _fail("optimizer.staleness_curve", o.staleness_curve, str(e))
            if curve.promote_inverses != o.promote_inverses:
                _fail("optimizer.staleness_curve", o.staleness_curve, f"measured with promote_inverses="
                      f"{curve.promote_inverses}; set optimizer.promote_inverses={curve.promote_inverses} or measure "
                      f"a curve for {o.promote_inverses}")
        _check_choice("optimizer.kfac_update", o.kfac_update, KFAC_UPDATES)
        if o.kfac_lr is not None and o.kfac_lr <= 0:
            _fail("optimizer.kfac_lr", o.kfac_lr, "must be positive, or unset to use lr")
        if o.kfac_update != "momentum" and o.kfac_lr is not None:
            log.warning("optimizer.kfac_lr has no effect unless optimizer.kfac_update=momentum")
        _check_kfac_intervals(o)
        _check_ekfac(o)
        _check_choice("optimizer.promote_inverses", o.promote_inverses, PROMOTE_INVERSES)
        if o.promote_inverses != "at_cycle_end" and o.name == "kfac" and not o.deferred_inverse and not o.schedule:
            log.warning("optimizer.promote_inverses has no effect on optimizer=kfac without optimizer.deferred_inverse: "
                        "its inverses are used by the step that computes them")
    elif o.preconditioner != "kfac":
        _fail("optimizer.preconditioner", o.preconditioner, f"optimizer={o.name} preconditions nothing; use "
              f"optimizer=ekfac (critical path) or optimizer=pipefisher optimizer.preconditioner={o.preconditioner} "
              "(bubbles), or leave it at kfac")
    if o.schedule and not os.path.exists(o.schedule):
        _fail("optimizer.schedule", o.schedule, "no such file; write one with `python schedule.py from=profile.sqlite`")
    if o.name in ("nvlamb", "adamw", "muon") and o.schedule:
        log.warning("optimizer.schedule is only used by optimizer=pipefisher (and kfac, as its baseline)")
    if o.name in ("adamw", "muon"):
        for name, beta in (("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)):
            if not 0.0 <= beta < 1.0:
                _fail(name, beta, "an Adam moment decay must lie in [0, 1), e.g. 0.9 (beta1) or 0.999 (beta2)")
        if not o.eps >= 0.0:
            _fail("optimizer.eps", o.eps, "must be >= 0, e.g. optimizer.eps=1e-6")
        if not o.weight_decay >= 0.0:
            _fail("optimizer.weight_decay", o.weight_decay, "must be >= 0 (0 turns weight decay off)")
    if o.name == "muon" and not 0.0 <= o.muon_momentum < 1.0:
        _fail("optimizer.muon_momentum", o.muon_momentum, "must lie in [0, 1), e.g. 0.95 (torch's default)")
    if o.name != "muon" and o.muon_momentum != OptimizerConfig.muon_momentum:
        log.warning("optimizer.muon_momentum has no effect unless optimizer=muon")
    _check_choice("optimizer.ns_dtype", o.ns_dtype, NS_DTYPES)
    if o.name != "muon" and o.ns_dtype != OptimizerConfig.ns_dtype:
        log.warning("optimizer.ns_dtype has no effect unless optimizer=muon")
    _validate_checkpoint(cfg)
    _validate_sdp(cfg)
    _validate_tp(cfg)
    if cfg.strategy is not None and not os.path.isfile(cfg.strategy):
        _fail("strategy", cfg.strategy, "no such file; write one with `python schedule.py whatif=true ...` (strategy.json)")
    if cfg.data.kind == "hdf5":
        if not cfg.data.path:
            _fail("data.path", cfg.data.path, "data=hdf5 needs data.path=<shard file or directory>")
        if not os.path.exists(cfg.data.path):
            _fail("data.path", cfg.data.path, "no such file or directory; prepare shards with `python -m pipefisher.data.prepare`")
    _validate_eval(cfg)
    if cfg.hardware.peak_tflops is not None and not cfg.hardware.peak_tflops > 0:
        _fail("hardware.peak_tflops", cfg.hardware.peak_tflops,
              "a device's peak TFLOP/s must be positive (e.g. 989 for an H100 in bf16), or unset it")
    if cfg.stages == 1 and cfg.data_parallel == 1 and method != "gpipe":
        log.warning("pipeline=%s has no effect with stages=1 and data_parallel=1", method)
    if cfg.device == "cuda":
        import torch  # local: config must stay importable without touching CUDA at import time

        if not torch.cuda.is_available():
            _fail("device", "cuda", "no CUDA device is visible; use device=cpu or device=auto")


def _check_recompute_stages(cfg: TrainConfig, total_stages: int) -> None:
    """``recompute_stages``: distinct model-stage indices in range, beside ``recompute=false``, in a pipeline."""
    chosen = cfg.recompute_stages
    if chosen is None:
        return
    chosen = list(chosen)
    if cfg.recompute:
        _fail("recompute_stages", chosen, "recompute=true already recomputes every stage; set recompute=false to "
              "recompute only these stages, or recompute_stages=null")
    if total_stages == 1:
        _fail("recompute_stages", chosen, "a run of one model stage recomputes all or nothing: use recompute=true "
              "(or false) and recompute_stages=null")
    if not chosen or len(set(chosen)) != len(chosen) or any(s < 0 or s >= total_stages for s in chosen):
        _fail("recompute_stages", chosen, f"give distinct model-stage indices in 0..{total_stages - 1} "
              f"(stages*pipeline.num_virtual={total_stages}), e.g. recompute_stages=[0], or null for none")


def _validate_eval(cfg: TrainConfig) -> None:
    """Checks of ``eval.*`` and ``data.eval_path`` (held-out shards must exist before workers start)."""
    e, d = cfg.eval, cfg.data
    if e.every_steps < 0:
        _fail("eval.every_steps", e.every_steps, "must be >= 0 (0 turns held-out evaluation off)")
    if e.batches < 1:
        _fail("eval.batches", e.batches, "evaluate at least 1 held-out micro-batch, e.g. eval.batches=8")
    if d.eval_path is not None and d.kind != "hdf5":
        _fail("data.eval_path", d.eval_path, "synthetic data has its own held-out stream; unset data.eval_path, "
              "or use data=hdf5")
    if d.eval_path is not None and not e.every_steps:
        log.warning("data.eval_path has no effect with eval.every_steps=0; set eval.every_steps to evaluate")
    if d.kind != "hdf5" or not e.every_steps:
        return
    prepare = "python -m pipefisher.data.prepare ... --holdout-fraction 0.05"
    if d.eval_path is not None:
        if not os.path.exists(d.eval_path):
            _fail("data.eval_path", d.eval_path, f"no such file or directory; give held-out shards, or unset it "
                  f"to use the heldout/ folder beside data.path that `{prepare}` writes")
        return
    # Local import: pipefisher.data pulls in torch, which config does not need otherwise.
    from pipefisher.data.heldout import heldout_path

    if heldout_path(d.path) is None:
        _fail("data.eval_path", d.eval_path,
              f"eval.every_steps={e.every_steps} needs held-out shards, and data.path={d.path!r} has no heldout/ "
              f"folder beside it; set data.eval_path=<held-out shards>, or prepare the data again with "
              f"`{prepare}` (it writes <output-dir>/heldout/), or set eval.every_steps=0")


SDP_OPTIMIZERS = ("nvlamb", "adamw", "muon")  # the optimizers built for sharded (DTensor) weights
TP_OPTIMIZERS = ("nvlamb", "adamw", "muon")  # the optimizers built for tensor-parallel (DTensor) weights


def _validate_sdp(cfg: TrainConfig) -> None:
    """What sharded data parallel (``sdp`` > 1, FSDP2 inside the pipeline) runs today; each refusal
    names what would be needed (issue 27)."""
    k = cfg.sdp
    if k == 1:
        if cfg.sdp_reshard_after_forward:
            log.warning("sdp_reshard_after_forward has no effect with sdp=1")
        return
    if cfg.optimizer.name in KFAC_OPTIMIZERS:
        _fail("sdp", k, f"optimizer={cfg.optimizer.name} needs whole weights: K-FAC with sharded weights needs its "
              "factors and preconditioning sharded too (not built); use optimizer=nvlamb, adamw or muon, or sdp=1")
    if cfg.optimizer.name not in SDP_OPTIMIZERS:
        _fail("sdp", k, f"optimizer={cfg.optimizer.name} is not built for sharded weights yet; use optimizer="
              f"{' / '.join(SDP_OPTIMIZERS)} or sdp=1")
    if cfg.sdp_reshard_after_forward and cfg.pipeline.method in ("zb-h1", *V_METHODS):
        _fail("sdp_reshard_after_forward", True, f"pipeline={cfg.pipeline.method}'s deferred weight gradients (W) "
              "need the gathered weights after I; use sdp_reshard_after_forward=false")
    if cfg.eval.every_steps:
        _fail("eval.every_steps", cfg.eval.every_steps, f"held-out evaluation calls the stages outside FSDP's forward "
              f"hooks (not built for sdp={k}: the shards need gathering around it); use eval.every_steps=0 or sdp=1")
    if cfg.comm_ablation:
        _fail("comm_ablation", True, f"FSDP's all-gathers and reduce-scatters (sdp={k}) cannot be ablated; use sdp=1")


def _validate_tp(cfg: TrainConfig) -> None:
    """What tensor parallel (``tp`` > 1, DTensor inside each pipeline worker) runs today; each refusal
    names what would be needed (issue 27)."""
    k = cfg.tp
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        _fail("tp", k, "must be at least 1 (1 = no tensor parallelism)")
    if k == 1:
        return
    from pipefisher.model.config import tp_splits  # here: the model package imports torch

    m = cfg.model
    ffn = m.intermediate_size if m.intermediate_size is not None else 4 * m.hidden_size
    if not tp_splits(m.num_heads, ffn, k):
        ok = [d for d in range(2, max(m.num_heads, 1) + 1) if tp_splits(m.num_heads, ffn, d)]
        _fail("tp", k, f"must divide model.num_heads={m.num_heads} and the FFN width model.intermediate_size={ffn} "
              f"(each tp rank holds whole heads and an equal part of the FFN); use tp in {ok or [1]}")
    if cfg.optimizer.name in KFAC_OPTIMIZERS:
        _fail("tp", k, f"optimizer={cfg.optimizer.name} needs whole weights: K-FAC with tensor-parallel layers needs "
              "its factors sharded by the layers' split (A of a row-parallel layer, B of a column-parallel one) and "
              "its preconditioning on the shards (not built); use optimizer=nvlamb, adamw or muon, or tp=1")
    if cfg.optimizer.name not in TP_OPTIMIZERS:
        _fail("tp", k, f"optimizer={cfg.optimizer.name} is not built for tensor-parallel weights yet; use "
              f"optimizer={' / '.join(TP_OPTIMIZERS)} or tp=1")
    if cfg.precision != "fp32":
        _fail("precision", cfg.precision, f"tp={k} runs in fp32 only so far (autocast over DTensor layers is "
              "untested); use precision=fp32 or tp=1")
    if cfg.profile.enabled:
        _fail("profile.enabled", True, f"profiles map one process to one pipeline worker (not built for tp={k}); "
              "profile with tp=1")
    if cfg.comm_ablation:
        _fail("comm_ablation", True, f"the tensor-parallel all-reduces (tp={k}) cannot be ablated; use tp=1")


def _validate_checkpoint(cfg: TrainConfig) -> None:
    """Checks of ``checkpoint.*`` and ``resume``."""
    c = cfg.checkpoint
    if c.every_steps < 0:
        _fail("checkpoint.every_steps", c.every_steps, "must be >= 0 (0 turns step-based checkpoints off)")
    if not c.every_minutes >= 0:
        _fail("checkpoint.every_minutes", c.every_minutes, "must be >= 0 (0 turns time-based checkpoints off)")
    if c.keep_last < 0:
        _fail("checkpoint.keep_last", c.keep_last, "must be >= 0 (0 keeps every checkpoint)")
    if c.dir is not None and not str(c.dir).strip():
        _fail("checkpoint.dir", c.dir, "give a directory, or leave it unset for <run output dir>/checkpoints")
    if not cfg.resume:
        _fail("resume", cfg.resume, "use resume=none, resume=auto or resume=<checkpoint path>")
    if cfg.resume not in RESUME_MODES and not os.path.isdir(cfg.resume):
        _fail("resume", cfg.resume,
              "no such checkpoint; give a step_<n> directory holding manifest.json or a checkpoint directory, "
              "or use resume=auto (latest complete checkpoint in checkpoint.dir) or resume=none")
    if cfg.init_from is not None and not os.path.exists(cfg.init_from):
        _fail("init_from", cfg.init_from, "no such folder; give a run folder, its final/ folder, a step_<n> "
              "checkpoint or an export folder")
    if c.dir is not None and not c.enabled and cfg.resume != "auto" and c.on_stop_after_s < 0:
        log.warning("checkpoint.dir is set but has no effect: set checkpoint.every_steps, "
                    "checkpoint.every_minutes or checkpoint.on_stop_after_s>=0 to write checkpoints, "
                    "or resume=auto to read them")


def _schema_keys(schema: type, prefix: str = "", rename: Mapping[str, str] | None = None) -> list[str]:
    """Every dotted key of a dataclass schema, nested dataclasses included (``model``, ``model.name``, …)."""
    keys = []
    hints = get_type_hints(schema)
    for f in fields(schema):
        key = prefix + (rename or {}).get(f.name, f.name)
        keys.append(key)
        if is_dataclass(hints.get(f.name)):
            keys += _schema_keys(hints[f.name], key + ".", rename)
    return keys


def check_override_keys(args: Iterable[str], schema: type | None = None,
                        rename: Mapping[str, str] | None = None) -> None:
    """Refuse a command-line override whose key the schema lacks, naming the closest key.

    Hydra's own message for ``stagez=2`` suggests ``+stagez=2``, which adds a key nothing reads
    (and then fails on the structured config); the fix is almost always a typo (issue 16).
    Arguments that are not plain ``key=value`` changes (flags, ``+key``/``++key``/``~key``,
    ``group@package=…``, ``hydra.*`` and ``hydra/*``) are left to Hydra, and so is any key below
    a field that is not itself a schema (a list or a free-form value).

    Args:
        args: command-line arguments, as in ``sys.argv[1:]``.
        schema: the dataclass of the composed config (default :class:`TrainConfig`).
        rename: field name -> config key, where they differ (schedule.py's ``from_`` is ``from``).

    Raises:
        ConfigError: ``<key>=<value>: unknown key '<key>'; did you mean <closest>=<value>?``
    """
    schema = schema or TrainConfig
    keys = _schema_keys(schema, rename=rename)
    known = set(keys)
    args = list(args)
    _refuse_flag_style(args, known)
    _refuse_unknown_choices(args, schema, rename)
    leaves: dict[str, list[str]] = {}
    for key in keys:
        leaves.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if "@" in key or "/" in key or key == "hydra" or key.startswith("hydra."):
            continue
        parts = key.split(".")
        if not all(p.isidentifier() for p in parts):
            continue  # not a key Hydra would take either: leave its message to Hydra
        # The longest prefix that is a schema key decides: below a non-schema field anything goes.
        depth = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), 0)
        if depth == len(parts):
            continue
        parent = ".".join(parts[:depth])
        if depth and not any(k.startswith(parent + ".") for k in keys):
            continue  # below a leaf (a list or a free-form field)
        siblings = [k for k in keys if k.count(".") == depth and k.startswith(parent + "." if depth else "")]
        close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6) or \
            difflib.get_close_matches(key, keys, n=1, cutoff=0.75) or leaves.get(parts[-1], [])[:1]
        hint = f"; did you mean {close[0]}={value}?" if close else ""
        where = f"'{parent}' has" if depth else "the config has"
        raise ConfigError(f"{arg}: unknown key '{key}'{hint} ({where} no key '{parts[depth]}'; --help lists the keys)")


# Hydra's own command-line flags (``python train.py --help`` lists them): left to Hydra.
_HYDRA_FLAGS = {"help", "hydra-help", "version", "cfg", "resolve", "package", "run", "multirun", "shell-completion",
                "config-path", "config-name", "config-dir", "experimental-rerun", "info"}
_CONF_DIR = Path(__file__).resolve().parent / "conf"


def _refuse_flag_style(args: list[str], known: set[str]) -> None:
    """``--steps 30`` or ``--steps=30``: Hydra takes ``key=value``, and argparse's own error
    ("unrecognized arguments") does not say so (issue 40, item 5)."""
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg[2:].split("=", 1)[0] in _HYDRA_FLAGS:
            continue
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key not in known:
            continue
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = nxt if nxt is not None and not nxt.startswith("-") and "=" not in nxt else "<value>"
        shown = arg if eq or value == "<value>" else f"{arg} {value}"
        raise ConfigError(f"{shown}: options are key=value without dashes: write {key}={value}")


def _refuse_unknown_choices(args: list[str], schema: type, rename: Mapping[str, str] | None) -> None:
    """``optimizer=kfca``: name the group's options (its YAML files) before Hydra lists them with
    its internal ``*_schema`` entries (issue 40, item 5)."""
    hints = get_type_hints(schema)
    groups = {(rename or {}).get(f.name, f.name) for f in fields(schema)
              if is_dataclass(hints.get(f.name)) and (_CONF_DIR / (rename or {}).get(f.name, f.name)).is_dir()}
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        group, value = arg.split("=", 1)
        if group not in groups or not value or any(c in value for c in "()[]${}*?") or value == "null":
            continue  # a sweep function, an interpolation or a glob: Hydra's to expand
        options = sorted(p.stem for p in (_CONF_DIR / group).glob("*.yaml"))
        for choice in value.split(","):
            if choice not in options and choice != f"{group}_schema":  # the schema: refused after composition
                close = difflib.get_close_matches(choice, options, n=1, cutoff=0.5)
                hint = f"did you mean {group}={close[0]}? " if close else ""
                raise ConfigError(f"{arg}: no {group} '{choice}'; {hint}choose one of {', '.join(options)}")


def refuse_unknown_keys(args: Iterable[str], program: str, schema: type | None = None,
                        rename: Mapping[str, str] | None = None) -> None:
    """:func:`check_override_keys` for an entry point: an unknown key ends the process with
    ``<program>: <message>`` and status 1 (``HYDRA_FULL_ERROR=1``: the error with its traceback)."""
    try:
        check_override_keys(args, schema, rename)
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SystemExit(f"{program}: {err}") from None


def to_train_config(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """Turn a composed Hydra config into a validated :class:`TrainConfig` (runs :func:`validate`).

    Keys outside the schema's fields (``hydra``) are dropped.
    """
    if isinstance(cfg, TrainConfig):
        validate(cfg)
        return cfg
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, TrainConfig):
        raise ConfigError("the composed config is not a TrainConfig; compose it with config_name='config'")
    return obj


def register_configs() -> None:
    """Register the schemas so each YAML can extend its group's schema from its defaults list."""
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="pipeline", name="pipeline_schema", node=PipelineConfig)
    cs.store(group="optimizer", name="optimizer_schema", node=OptimizerConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
