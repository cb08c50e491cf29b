"""Cross-field validation of a run's config: :func:`validate`, run once by ``TrainConfig.__post_init__``
(reached through ``OmegaConf.to_object``) before any worker process starts; each message names the field,
the value and the fix. The checks of one group each are in :mod:`pipefisher.config.checks`.

``cfg`` is a :class:`~pipefisher.config.schema.TrainConfig`, here by its fields, not imported:
``TrainConfig.__post_init__`` calls :func:`~pipefisher.config.validation.validate`, so the schema imports
the checks and they cannot import it back (tests/test_layering.py: no circles).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pipefisher.config.batch import resolve_batch
from pipefisher.config.checks import (_check_csv, _check_cluster, _validate_checkpoint, _validate_eval, _validate_sdp,
                                      _validate_tp)
from pipefisher.config.choices import (ADAMW_KERNELS, CHIMERA_STACKINGS, DATA_KINDS, FACTOR_DECAY_UNITS, FAULT_MODES, INVERSE_DTYPES,
                                       KFAC_OPTIMIZERS, KFAC_OWNERS, KFAC_UPDATES, NONFINITE_MODES, NS_DTYPES, NS_OWNERS,
                                       OPTIMIZER_PLACEMENTS, OPTIMIZERS, PIPELINE_METHODS, PRECISIONS,
                                       PRECONDITIONERS, PROMOTE_INVERSES, V_METHODS, WANDB_MODES, _check_choice, _fail)

log = logging.getLogger("pipefisher.config")  # the name the one-module config logged under (Hydra prints it)


def _check_kfac_intervals(o: Any) -> None:
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


def _check_ekfac(o: Any) -> None:
    """``optimizer.preconditioner`` and ekfac's moment settings (``pipefisher.optim.ekfac``)."""
    _check_choice("optimizer.preconditioner", o.preconditioner, PRECONDITIONERS)
    if o.preconditioner != "ekfac":
        if (o.ekfac_beta2, o.ekfac_eps) != (type(o).ekfac_beta2, type(o).ekfac_eps):  # type(o): the schema's defaults
            log.warning("optimizer.ekfac_beta2 / optimizer.ekfac_eps have no effect unless optimizer.preconditioner=ekfac")
        return
    if not 0.0 <= o.ekfac_beta2 < 1.0:
        _fail("optimizer.ekfac_beta2", o.ekfac_beta2, "a second-moment decay must lie in [0, 1), e.g. 0.999 (SOAP's)")
    if not 0.0 < o.ekfac_eps < float("inf"):
        _fail("optimizer.ekfac_eps", o.ekfac_eps, "must be > 0 (it keeps coordinates without gradient finite), "
              "e.g. optimizer.ekfac_eps=1e-8")
    if o.damping != type(o).damping:
        log.warning("optimizer.damping has no effect with optimizer.preconditioner=ekfac: damping does not change "
                    "an eigenbasis (ekfac_eps keeps the scaling finite)")


def _check_positive(cfg: Any, names: list[str]) -> None:
    for name in names:
        obj: Any = cfg
        for part in name.split("."):
            obj = getattr(obj, part)
        if obj < 1:
            _fail(name, obj, "must be at least 1")

def validate(cfg: Any) -> None:
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
    if not cfg.cluster.progress_every_s > 0:
        _fail("cluster.progress_every_s", cfg.cluster.progress_every_s,
              "seconds between a SLURM sweep's looks at its jobs; use a number > 0 (default 10)")
    if not cfg.cluster.stop_grace_s > 0:
        _fail("cluster.stop_grace_s", cfg.cluster.stop_grace_s,
              "seconds the workers get to finish their step after a stop signal; use a number > 0 (default 20)")
    if not cfg.cluster.lost_task_grace_s >= 0:
        _fail("cluster.lost_task_grace_s", cfg.cluster.lost_task_grace_s,
              "seconds a surviving SLURM task waits for a failed peer's result; use a number >= 0 (default 10)")
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
    if o.name != "muon" and o.muon_momentum != type(o).muon_momentum:
        log.warning("optimizer.muon_momentum has no effect unless optimizer=muon")
    _check_choice("optimizer.ns_dtype", o.ns_dtype, NS_DTYPES)
    if o.name != "muon" and o.ns_dtype != type(o).ns_dtype:
        log.warning("optimizer.ns_dtype has no effect unless optimizer=muon")
    _check_choice("optimizer.ns_owners", o.ns_owners, NS_OWNERS)
    if o.name != "muon" and o.ns_owners != type(o).ns_owners:
        log.warning("optimizer.ns_owners has no effect unless optimizer=muon")
    if o.name == "muon" and o.ns_owners == "pipeline" and (cfg.sdp > 1 or cfg.tp > 1):
        _fail("optimizer.ns_owners", o.ns_owners, f"needs sdp=1 and tp=1 (sdp={cfg.sdp}, tp={cfg.tp}: ShardedMuon "
              "already orthogonalizes each matrix once per mesh); use optimizer.ns_owners=holder")
    _check_choice("optimizer.kfac_owners", o.kfac_owners, KFAC_OWNERS)
    if o.name not in KFAC_OPTIMIZERS and o.kfac_owners != type(o).kfac_owners:
        log.warning("optimizer.kfac_owners has no effect unless optimizer is one of %s", ", ".join(KFAC_OPTIMIZERS))
    if o.name in KFAC_OPTIMIZERS and o.kfac_owners == "replicas" and (cfg.sdp > 1 or cfg.tp > 1):
        _fail("optimizer.kfac_owners", o.kfac_owners, f"needs sdp=1 and tp=1 (sdp={cfg.sdp}, tp={cfg.tp}); use "
              "optimizer.kfac_owners=holder")
    _check_adamw_kernel(cfg)
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


def _check_adamw_kernel(cfg: Any) -> None:
    """``optimizer.adamw_kernel``: a choice; only AdamW (optimizer=adamw, muon's half) reads it; ``fused`` needs
    torch's fused AdamW on the run's device (``torch.utils._foreach_utils``' list: cpu and cuda from torch 2.4)."""
    o = cfg.optimizer
    _check_choice("optimizer.adamw_kernel", o.adamw_kernel, ADAMW_KERNELS)
    if o.name not in ("adamw", "muon"):
        if o.adamw_kernel != type(o).adamw_kernel:
            log.warning("optimizer.adamw_kernel has no effect unless optimizer=adamw or muon")
        return
    if o.adamw_kernel != "fused":
        return
    import torch  # local: as the device check below
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    kinds = ["cpu", "cuda"] if cfg.device == "auto" else [cfg.device]  # auto: either, decided in the worker
    missing = [k for k in kinds if k not in _get_fused_kernels_supported_devices()]
    if missing:
        _fail("optimizer.adamw_kernel", "fused", f"torch {torch.__version__} has no fused AdamW for device "
              f"{'/'.join(missing)}; use optimizer.adamw_kernel=foreach (or auto)")


def _check_recompute_stages(cfg: Any, total_stages: int) -> None:
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
