"""Checks of one config group or feature each (``cluster``, ``pipeline.csv``, ``eval``, ``sdp``, ``tp``,
``checkpoint``), called by :func:`~pipefisher.config.validation.validate` in its order.

``cfg`` is a :class:`~pipefisher.config.schema.TrainConfig`, here by its fields, not imported:
``TrainConfig.__post_init__`` calls :func:`~pipefisher.config.validation.validate`, so the schema imports
the checks and they cannot import it back (tests/test_layering.py: no circles).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pipefisher.config.batch import _as_count
from pipefisher.config.choices import KFAC_OPTIMIZERS, RESUME_MODES, SDP_OPTIMIZERS, TP_OPTIMIZERS, V_METHODS, _fail

log = logging.getLogger("pipefisher.config")  # the name the one-module config logged under (Hydra prints it)


def _check_cluster(cfg: Any) -> None:
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


def _check_csv(cfg: Any) -> None:
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

def _validate_eval(cfg: Any) -> None:
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


def _validate_sdp(cfg: Any) -> None:
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


def _validate_tp(cfg: Any) -> None:
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


def _validate_checkpoint(cfg: Any) -> None:
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
