"""The config schema of ``schedule.py`` (registered in Hydra's ConfigStore as ``schedule_schema``).

It reuses train.py's ``model``, ``pipeline`` and ``data`` groups and top-level keys (``stages``,
``num_micro_batches``, ``micro_batch_size``, ``data_parallel``, ``recompute``, ``precision``), so
a run's overrides plan that run. ``from`` (the profile to plan from) is a Python keyword, so the
dataclass field is ``from_`` and the stored schema node names the key ``from`` (a typed
``DictConfig`` built from the dataclass: a typo or a wrong type still fails at composition).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.nodes import AnyNode, BooleanNode, FloatNode, IntegerNode, StringNode

from pipefisher.config import ConfigError, DataConfig, ModelConfig, PipelineConfig, register_configs
from pipefisher.planning.calibration import read_calibration
from pipefisher.profiling.range_names import RangeNames
from pipefisher.planning.staleness import load_staleness_curve

__all__ = ["ScheduleConfig", "WhatIfConfig", "register_schedule_configs", "schedule_schema_node",
           "to_schedule_config"]


@dataclass
class WhatIfConfig:
    """The search space of ``whatif=true``."""

    methods: list[str] = field(default_factory=lambda: ["gpipe", "1f1b", "chimera", "chimera-doubling", "interleaved",
                                                        "zb-h1", "zb-v", "dualpipev", "v-half", "v-min"])  # schedules (chimera-doubling: pipeline.chimera_stacking=doubling)
    micro_batch_sizes: list[int] = field(default_factory=lambda: [4, 8, 16, 32])  # sequences per micro-batch
    optimizers: list[str] = field(default_factory=lambda: ["nvlamb", "adamw", "muon", "kfac", "pipefisher"])  # optimizers to compare (AdamW and Muon: planning.optimizer_costs)
    recompute: list[bool] = field(default_factory=lambda: [False, True])  # recomputation settings to try
    sdp: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # sharded data parallel (FSDP2) degrees to try
    tp: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # tensor parallel degrees to try (tp must divide the heads)
    num_virtual: int = 2  # model chunks per worker for interleaved
    kfac_owners: list[str] = field(default_factory=lambda: ["holder"])  # PipeFisher's optimizer.kfac_owners to try: [holder, replicas] also ranks each layer inverted once among a stage's replicas (Chimera's twins, data-parallel copies; priced by planning.owner_costs)
    split_backward_ratio: float = 1.0  # (I+W)/B of zb-h1 and zb-v: a split backward's cost over a full one (0.96 bert-mini, 1.00 bert-medium measured in the pipeline, bench/README.md §8)
    top: int = 20  # lines of the printed ranking (and of the exclusions)


@dataclass
class ScheduleConfig:
    """What ``schedule.py`` plans: from a profile (``from=``), from estimates, or a what-if search."""

    from_: Optional[str] = None  # key `from`: profile.sqlite, an nsys export, or per-rank exports as a glob or comma list; None = estimate
    model: ModelConfig = field(default_factory=ModelConfig)  # the model (group `model`)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # the pipeline method (group `pipeline`)
    data: DataConfig = field(default_factory=DataConfig)  # sequence shape: data.seq_len, data.max_predictions
    stages: int = 4  # pipeline stages D (workers per pipeline)
    data_parallel: int = 1  # data-parallel width W
    micro_batch_size: int = 32  # sequences per micro-batch
    num_micro_batches: int = 8  # micro-batches per step N
    recompute: bool = False  # activation recomputation (B costs 3F; less activation memory)
    precision: str = "fp32"  # fp32 or bf16: bytes of activations and messages
    flops_per_s: float = 1.0e14  # sustained FLOP/s of one device (A100/H100-class TF32 ~ 1e14)
    p2p_bytes_per_s: float = 5.0e10  # stage-to-stage bandwidth in bytes/s (NVLink-class)
    allreduce_bytes_per_s: Optional[float] = None  # all-reduce bandwidth; None = p2p_bytes_per_s
    memory_bytes_per_s: float = 1.5e12  # device memory bandwidth (optimizer step)
    max_interval: int = 8  # largest K-FAC refresh interval k PipeFisher may choose
    max_staleness: Optional[int] = 8  # bound on the curvature age (the plan's bound under promote_inverses <= it), as optimizer=pipefisher's default; None = no bound
    staleness_curve: Optional[str] = None  # JSON of steps multiplier per k (the convergence study's staleness_b<batch>.json): pick the k of least step time x multiplier; None = the smallest k whose bubbles hold the refresh
    promote_inverses: str = "when_ready"  # when train.py's runtime uses deferred inverses: when_ready (the step after their INVERT; optimizer=pipefisher's default) or at_cycle_end (age <= 2k-1)
    curvature_micro_batches: int = 0  # K-FAC curvature from the first n micro-batches of each pipe; 0 = all
    curvature_placement: str = "after_capture"  # after_capture (after F / B or I) or beside_w (after the micro-batch's W; zero-bubble schedules)
    kfac_interval: int = 1  # refresh interval of the kfac (critical path) baseline in the summary
    preconditioner: str = "kfac"  # kfac (Cholesky inverses) or ekfac (eigenbases): what INVERT and PRECOND cost when estimated; a profile's run config and events take precedence
    gpu: str = "auto"  # profile times: auto = kernel time when the profile has CUDA kernels (nsys --trace=cuda); true; false = CPU ranges
    warmup_steps: int = 1  # steps dropped from the start of an nsys export (profile.py's own profiles dropped theirs already)
    ranges: RangeNames = field(default_factory=RangeNames)  # how an nsys export's range names map to actions (group `ranges`: ours, megatron_zb)
    plot: bool = True  # write the predicted timeline (timeline.pdf/png)
    whatif: bool = False  # rank configurations instead of planning one
    devices: int = 16  # whatif: devices to use
    memory_gb: float = 40.0  # whatif: memory per device in GB
    memory_device: str = "cuda"  # whatif: whose peak the memory model predicts: cuda (max_memory_allocated) or cpu (peak RSS beyond the interpreter's, glibc's retention included: bench/studies/15-memory-model.md)
    global_batch: int = 256  # whatif: sequences per optimizer step
    comm_costs: Optional[str] = None  # whatif: collectives.json of `python -m pipefisher.measure.collectives` (measured communication, and compute rates when it has them); None = the ring model at the *_bytes_per_s keys
    search: WhatIfConfig = field(default_factory=WhatIfConfig)  # whatif: the search space
    calibration: Optional[str] = None  # whatif: convergence calibration JSON (steps to a held-out loss per optimizer, planning.calibration; bench/convergence.py --calibration-out writes one): rank by time to target = steps x predicted step; None = by throughput
    target_loss: Optional[float] = None  # whatif: the held-out loss of the time to target; None = the calibration's hardest (lowest) loss

    def __post_init__(self) -> None:
        for name in ("stages", "data_parallel", "micro_batch_size", "num_micro_batches", "max_interval",
                     "kfac_interval", "devices", "global_batch"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}={value!r}: must be at least 1")
        for name in ("flops_per_s", "p2p_bytes_per_s", "memory_bytes_per_s", "memory_gb"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name}={value!r}: must be positive")
        if self.memory_device not in ("cuda", "cpu"):
            raise ConfigError(f"memory_device={self.memory_device!r}: use cuda or cpu")
        if self.allreduce_bytes_per_s is not None and not self.allreduce_bytes_per_s > 0:
            raise ConfigError(f"allreduce_bytes_per_s={self.allreduce_bytes_per_s!r}: must be positive, or null")
        if self.max_staleness is not None and self.max_staleness < 1:
            raise ConfigError(f"max_staleness={self.max_staleness!r}: must be >= 1 (2k-1 with k=1), or null")
        if self.curvature_placement not in ("after_capture", "beside_w"):
            raise ConfigError(f"curvature_placement={self.curvature_placement!r}: use after_capture (curvature "
                              f"after its F / its B or I) or beside_w (after the micro-batch's W)")
        if self.preconditioner not in ("kfac", "ekfac"):
            raise ConfigError(f"preconditioner={self.preconditioner!r}: use kfac or ekfac (optimizer=ekfac's "
                              f"eigenbases)")
        if self.promote_inverses not in ("at_cycle_end", "when_ready"):
            raise ConfigError(f"promote_inverses={self.promote_inverses!r}: use at_cycle_end or when_ready")
        if self.curvature_micro_batches < 0:
            raise ConfigError(f"curvature_micro_batches={self.curvature_micro_batches!r}: must be >= 0 (0 = all)")
        if self.staleness_curve is not None:
            try:
                curve = load_staleness_curve(self.staleness_curve)
            except ValueError as e:
                raise ConfigError(f"staleness_curve={self.staleness_curve!r}: {e}") from None
            if curve.promote_inverses != self.promote_inverses:
                raise ConfigError(f"staleness_curve={self.staleness_curve!r}: measured with promote_inverses="
                                  f"{curve.promote_inverses}; set promote_inverses={curve.promote_inverses} or measure "
                                  f"a curve for {self.promote_inverses}")
        if self.target_loss is not None and self.calibration is None:
            raise ConfigError(f"target_loss={self.target_loss!r} has no steps to price without calibration=<file>; "
                              f"give one (bench/convergence.py --calibration-out writes it), or drop target_loss")
        if self.calibration is not None:
            cal = read_calibration(self.calibration)
            if self.target_loss is not None:
                cal.steps_to(self.target_loss)  # a CalibrationError (a ConfigError) names the range and the file
        if str(self.gpu).lower() not in ("auto", "true", "false"):
            raise ConfigError(f"gpu={self.gpu!r}: choose auto (kernel time when the profile has CUDA kernels), "
                              f"true or false")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps!r}: must be >= 0")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision={self.precision!r}: choose fp32 or bf16")


_NODE_TYPES = {int: IntegerNode, float: FloatNode, bool: BooleanNode, str: StringNode}


def _node(tp: Any, value: Any) -> Any:
    optional = get_origin(tp) is Union and type(None) in get_args(tp)
    inner = next((t for t in get_args(tp) if t is not type(None)), tp) if optional else tp
    if dataclasses.is_dataclass(inner):
        return OmegaConf.structured(value)
    if get_origin(inner) is list:
        return ListConfig(value, element_type=get_args(inner)[0])
    return _NODE_TYPES.get(inner, AnyNode)(value, is_optional=optional)


def schedule_schema_node() -> DictConfig:
    """The typed schema of :class:`ScheduleConfig` with ``from_`` named ``from``."""
    hints = get_type_hints(ScheduleConfig)
    default = ScheduleConfig()
    return OmegaConf.create({("from" if f.name == "from_" else f.name): _node(hints[f.name], getattr(default, f.name))
                             for f in dataclasses.fields(ScheduleConfig)})


def register_schedule_configs() -> None:
    """Register ``schedule_schema``, the ``ranges`` group's schema, and train.py's group schemas,
    which its defaults use."""
    register_configs()
    ConfigStore.instance().store(group="ranges", name="ranges_schema", node=RangeNames)
    ConfigStore.instance().store(name="schedule_schema", node=schedule_schema_node())


def to_schedule_config(cfg: DictConfig) -> ScheduleConfig:
    """A validated :class:`ScheduleConfig` from the composed config (``hydra`` keys dropped)."""
    data = OmegaConf.to_container(cfg, resolve=True)
    data.pop("hydra", None)
    data["from_"] = data.pop("from", None)
    data["model"] = ModelConfig(**data["model"])
    data["pipeline"] = PipelineConfig(**data["pipeline"])
    data["data"] = DataConfig(**data["data"])
    data["search"] = WhatIfConfig(**data["search"])
    data["ranges"] = RangeNames(**data["ranges"])
    return ScheduleConfig(**data)
