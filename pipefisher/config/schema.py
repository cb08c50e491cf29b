"""The structured config schemas registered in Hydra's ConfigStore (:func:`register_configs`), and
:func:`to_train_config`, which turns a composed config into a validated :class:`TrainConfig`.

Every YAML file under ``conf/`` extends one of these schemas through its defaults list, so a typo
or a wrong type fails at composition with Hydra's message; the choice-valued fields' name lists are
in :mod:`pipefisher.config.choices`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipefisher.config.choices import ConfigError
from pipefisher.config.validation import validate


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
    ns_owners: str = "holder"  # muon: who runs a matrix's Newton–Schulz: holder (the worker that steps it) or pipeline (spread over all workers at the final STEP, balanced by NS FLOPs; sdp=1, tp=1; docs/optimizer-placement.md)
    kfac_owners: str = "holder"  # kfac, pipefisher, ekfac: who inverts and preconditions a layer that several replicas hold (Chimera's twins, data-parallel copies): holder (every replica) or replicas (one owner per layer, balanced by cost; the others receive its preconditioned gradient; sdp=1, tp=1; docs/optimizer-placement.md)
    adamw_kernel: str = "auto"  # adamw, and muon's AdamW half: torch's AdamW kernel: auto (torch's choice: a per-tensor loop on CPU, foreach on CUDA), foreach, or fused (one kernel per device and dtype; rounds differently, ~1e-6 relative; docs/optimizers.md)
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
    stop_grace_s: float = 20.0  # local workers: after SIGINT/SIGTERM, how long they get to finish the step (and save) before they are killed; three longest steps when longer
    progress_every_s: float = 10.0  # slurm: how often a sweep's launcher reads its jobs' states (squeue, without accounting) and, while only steps advance, says its progress
    lost_task_grace_s: float = 10.0  # slurm: after a peer failed, how long a surviving task waits for the others' own results before it files "ended without a result" for those that left none
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
    cpu_flush_denormal: bool = True  # on CPU, flush subnormal floats to zero (torch.set_flush_denormal): once attention's smallest probabilities turn subnormal, x86 arithmetic on them slowed every step by about a third (docs/measuring.md)
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
