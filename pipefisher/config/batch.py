"""The batch rules: what ``global_batch_size``, ``micro_batch_size`` and ``num_micro_batches`` mean
together, what ``auto`` resolves to (:func:`resolve_batch`), and which micro-batch counts each pipeline
method accepts (:func:`micro_batch_rule`, :func:`num_micro_batches_for`).

``cfg`` is a :class:`~pipefisher.config.schema.TrainConfig`, here by its fields, not imported:
``TrainConfig.__post_init__`` calls :func:`~pipefisher.config.validation.validate`, which calls
:func:`resolve_batch`; the schema imports them and they cannot import it back (tests/test_layering.py: no circles).
"""

from __future__ import annotations

import logging
from typing import Any

from pipefisher.config.choices import PIPELINE_METHODS, V_METHODS, _check_choice, _fail

log = logging.getLogger("pipefisher.config")  # the name the one-module config logged under (Hydra prints it)


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


def resolve_batch(cfg: Any) -> None:
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
