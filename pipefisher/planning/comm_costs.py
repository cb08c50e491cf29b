"""Communication costs for the strategy search: measured collectives, fitted as latency + bytes / bandwidth.

Entry points: :func:`fit_latency_bandwidth` (one op at one group size), :class:`CommCosts` (the
fitted table, read from the JSON that ``python -m pipefisher.measure.collectives`` writes, or the
analytic ring model of a :class:`~pipefisher.planning.costs.Hardware` when there is none).

[Note: what a message's bytes are]
As nccl-tests counts them, ``bytes`` is the size of the whole tensor, not of one rank's shard:

    all_reduce       the buffer every rank holds (in and out)
    all_gather       the gathered output (group size × one rank's shard)
    reduce_scatter   the input every rank holds (group size × the shard it receives)
    p2p              the message one rank sends to another (a send/recv pair, one way)

[Note: the fit]
For one op and group size, the measured (bytes, seconds) points are fitted with
``seconds = latency_s + bytes / bytes_per_s`` by least squares on the *relative* error (weights
1/seconds), so small messages (latency-bound) and large ones (bandwidth-bound) count alike; a
negative intercept is clamped to 0 and the slope refitted. A group size that was not measured is
extrapolated from the nearest measured one of that op under the ring algorithm: bytes moved per
rank scale with 2(g-1)/g (all_reduce) or (g-1)/g (all_gather, reduce_scatter), latency with the
g-1 ring steps. An op with no measurement at all falls back to the ring model at the
``Hardware``'s bandwidths with zero latency (what ``planning.costs`` assumes).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipefisher.planning.costs import Hardware

__all__ = ["COLLECTIVES_FORMAT", "OPS", "PIECES", "CommCosts", "ExecutorStep", "LinkFit", "collectives_json",
           "fit_latency_bandwidth"]

COLLECTIVES_FORMAT = "pipefisher-collectives/1"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")
PIECES = ("embeddings", "encoder_layer", "heads")  # pipeline layers 0, 1..L and L + 1: what a stage is made of


@dataclass(frozen=True)
class LinkFit:
    """``seconds = latency_s + bytes / bytes_per_s`` for one op at one group size."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> LinkFit:
    """Fit measured ``(bytes, seconds)`` points ([Note: the fit]).

    Args:
        points: at least two points with distinct byte counts; seconds > 0.

    Returns:
        The fitted latency (>= 0) and bandwidth (> 0; infinite-like 1e30 when the time does
        not grow with the size at all).

    Raises:
        ValueError: fewer than two distinct sizes, or a non-positive time.
    """
    pts = [(float(x), float(t)) for x, t in points]
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"fit needs at least two distinct message sizes, got {len(pts)} point(s)")
    if any(not t > 0 or x < 0 for x, t in pts):
        raise ValueError(f"fit needs bytes >= 0 and seconds > 0, got {pts}")
    # Minimize sum(((a + b x - t) / t)^2): normal equations in (a, b) with weights w = 1/t^2.
    sw = sum(1 / t**2 for _, t in pts)
    sx = sum(x / t**2 for x, t in pts)
    sxx = sum(x * x / t**2 for x, t in pts)
    st = sum(1 / t for _, t in pts)
    sxt = sum(x / t for x, t in pts)
    det = sw * sxx - sx * sx
    a = (st * sxx - sx * sxt) / det
    b = (sw * sxt - sx * st) / det
    if a < 0:  # clamp the latency and refit the slope alone
        a, b = 0.0, sxt / sxx
    if b <= 0:  # no growth with size: latency only
        a, b = st / sw, 0.0
    return LinkFit(a, 1.0 / b if b > 0 else 1e30)


def _ring_share(op: str, g: int) -> float:
    """Bytes each rank moves per byte of the whole tensor under a ring ([Note: the fit])."""
    if op == "all_reduce":
        return 2.0 * (g - 1) / g
    if op in ("all_gather", "reduce_scatter"):
        return (g - 1) / g
    return 1.0  # p2p


@dataclass(frozen=True)
class ExecutorStep:
    """One schedule's step as the executor ran it (``measure.executor_overhead.executor_steps``, or
    ``optimizer_executor_steps``): the shape it ran at (the file's ``compute.model`` and ``seq_len``) and the median
    measured step."""

    stages: int
    micro_batches: int
    micro_batch_size: int
    num_virtual: int
    step_seconds: float
    #: K-FAC's and Muon's runs (``compute.executor.kfac``, ``.muon``): its step less NVLAMB's, the two taking turns
    #: in the same processes
    extra_seconds: float | None = None


@dataclass(frozen=True)
class CommCosts:
    """Seconds of a collective of ``bytes`` ([Note: what a message's bytes are]) over a group.

    Attributes:
        fits: op -> group size -> fit (measured); may be empty.
        hardware: the ring model's bandwidths where nothing was measured.
        source: where the figures come from (a file, or ``analytic``), for messages.
        flops_per_s: micro-batch size -> the measured forward+backward FLOP rate (planner FLOPs), if any.
        memory_bytes_per_s: the optimizer step's measured rate at 28 bytes per parameter, if any.
        tp_seconds_fb: (tp, micro-batch size) -> measured seconds of one forward + backward of the
            whole ``compute_model`` with tensor parallel over tp processes, if any.
        compute_model: the measured BERT size and shape, ``(size, seq_len, max_predictions)``, if any.
        compute_vocab_size: the measured model's vocabulary where the file names it (``--vocab-size``), else
            None (the preset's).
        forward_share: micro-batch size -> the forward's share of a measured forward + backward (``seconds_f`` /
            ``seconds_fb``), if measured; the search splits a stage's F + B by it.
        kfac_flops_per_s: micro-batch size -> (curvature, preconditioning, inversion or None) FLOP rates of K-FAC's
            units measured on the model's Linear shapes, if any.
        piece_seconds: micro-batch size -> piece (``PIECES``) -> (seconds of its forward, of its forward + backward,
            its forward's planner FLOPs) measured alone, if any; the search prices a stage as the sum of its pieces
            at their own rates (``strategy_search.hybrid_costs``).
        action_overhead_s: the executor's own time per compute action (``compute.executor.overhead_per_action_s``,
            measured on a GPipe pipeline: ``measure.executor_overhead``), which the search adds to every F, B, I
            and W; 0 where not measured.
        executor_steps: schedule (``RunShape.method``) -> its step as the executor ran it at the file's model and
            ``processes`` stages (``compute.executor.methods``), if measured; the search scales that schedule's F, B,
            I and W at that D to match it (``planning.executor_calibration``).
        step_bookkeeping_s: rank 0's bookkeeping after each step in train.py (the timeline gathered and read:
            ``compute.executor.bookkeeping_seconds``, measured on the GPipe run), which train.py's ``step_time_s``
            includes and the search adds to every predicted step; 0 where not measured.
        kfac_executor_steps: schedule -> its step with K-FAC every step as the executor ran it
            (``compute.executor.kfac``), if measured; the search scales that schedule's K-FAC units by the factor
            that makes its simulated step (or extra over NVLAMB's) equal it, other schedules' by GPipe's
            (``planning.executor_calibration`` [Note: K-FAC unit factor]).
        muon_executor_steps: the same with Muon in K-FAC's place (``compute.executor.muon``); the search scales
            the part of Muon's STEP beyond NVLAMB's by the factor that makes its simulated extra equal the measured
            one ([Note: Muon step factor]).
        ns_flops_per_s: Muon's Newton–Schulz rate measured on the model's Linear weights in the precision
            ``optimizer.ns_dtype=auto`` picks there (``compute.newton_schulz.flops_per_s``), if any; the search prices
            the orthogonalization by it (``optimizer_costs.optimizer_step_seconds``), else at the FLOP rate.
        kfac_in_search: price CURV_A/CURV_B, PRECOND and (K-FAC's Cholesky) INVERT at those rates in the search
            (the file's ``compute.kfac_in_search``; off unless a file says so: on two idle validations it made the
            predicted steps worse, bench/studies/20-time-to-target-validation.md).
    """

    fits: Mapping[str, Mapping[int, LinkFit]] = field(default_factory=dict)
    hardware: Hardware = Hardware()
    source: str = "analytic"
    flops_per_s: Mapping[int, float] = field(default_factory=dict)
    memory_bytes_per_s: float | None = None
    tp_seconds_fb: Mapping[tuple[int, int], float] = field(default_factory=dict)
    compute_model: tuple[str, int, int] | None = None
    compute_vocab_size: int | None = None
    forward_share: Mapping[int, float] = field(default_factory=dict)
    kfac_flops_per_s: Mapping[int, tuple[float, float, float | None]] = field(default_factory=dict)
    kfac_in_search: bool = False
    piece_seconds: Mapping[int, Mapping[str, tuple[float, float, float]]] = field(default_factory=dict)
    action_overhead_s: float = 0.0
    executor_steps: Mapping[str, ExecutorStep] = field(default_factory=dict)
    step_bookkeeping_s: float = 0.0
    kfac_executor_steps: Mapping[str, ExecutorStep] = field(default_factory=dict)
    muon_executor_steps: Mapping[str, ExecutorStep] = field(default_factory=dict)
    ns_flops_per_s: float | None = None
    #: the search's solved scale per (schedule, hardware, split ratio): filled on first use, not part of equality,
    #: and new on every copy (``dataclasses.replace`` makes a fresh one: a changed term changes the factor)
    factor_cache: dict[Any, float] = field(default_factory=dict, init=False, compare=False, repr=False)

    def nearest(self, table: Mapping[int, Any], micro_batch_size: int) -> Any:
        """``table``'s entry at the measured micro-batch size nearest ``micro_batch_size`` (the larger on a
        tie); None for an empty table."""
        if not table:
            return None
        return table[min(table, key=lambda b: (abs(b - micro_batch_size), -b))]

    def hardware_for(self, micro_batch_size: int) -> Hardware:
        """``hardware`` with the measured compute rates where the file has them: the FLOP rate of the
        nearest measured micro-batch size (the larger on a tie), the optimizer step's bandwidth."""
        hw = self.hardware
        if self.flops_per_s:
            hw = replace(hw, flops_per_s=self.nearest(self.flops_per_s, micro_batch_size))
        if self.memory_bytes_per_s:
            hw = replace(hw, memory_bytes_per_s=self.memory_bytes_per_s)
        return hw

    def seconds(self, op: str, group: int, num_bytes: float) -> float:
        """Time of one ``op`` of ``num_bytes`` over ``group`` ranks (0 for a group of one)."""
        if op not in OPS:
            raise ValueError(f"op={op!r}: choose one of {', '.join(OPS)}")
        if group <= 1 or num_bytes <= 0 and op != "p2p":
            return 0.0
        measured = self.fits.get(op, {})
        if group in measured:
            return measured[group].seconds(num_bytes)
        if measured and op != "p2p":  # ring extrapolation from the nearest measured group size
            g0 = min(measured, key=lambda g: (abs(g - group), -g))
            fit = measured[g0]
            latency = fit.latency_s * (group - 1) / max(g0 - 1, 1)
            return latency + _ring_share(op, group) / _ring_share(op, g0) * num_bytes / fit.bytes_per_s
        if measured:  # p2p measured for another pair count: a pair is a pair
            return next(iter(measured.values())).seconds(num_bytes)
        bw = self.hardware.p2p_bytes_per_s if op == "p2p" else self.hardware.allreduce
        return _ring_share(op, group) * num_bytes / bw

    @classmethod
    def from_json(cls, path: str | Path, hardware: Hardware = Hardware()) -> CommCosts:
        """Read what ``python -m pipefisher.measure.collectives`` wrote.

        Raises:
            ValueError: the file is missing, not JSON, or lacks a field; the message names it and
                how to make one.
        """
        make = "write one with `python -m pipefisher.measure.collectives --out <file>`"
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"comm_costs={path}: cannot be read ({exc.strerror}); {make}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"comm_costs={path}: not JSON ({exc.msg}, line {exc.lineno}); {make}") from None
        if not isinstance(data, dict) or data.get("format") != COLLECTIVES_FORMAT:
            raise ValueError(f"comm_costs={path}: field format is {data.get('format') if isinstance(data, dict) else None!r}, "
                             f"not {COLLECTIVES_FORMAT!r}; {make}")
        fits: dict[str, dict[int, LinkFit]] = {}
        for op, groups in data.get("ops", {}).items():
            if op not in OPS:
                raise ValueError(f"comm_costs={path}: field ops.{op}: unknown op; the file holds {', '.join(OPS)}")
            for g, row in groups.items():
                try:
                    fit = LinkFit(float(row["latency_s"]), float(row["bytes_per_s"]))
                    size = int(g)
                except (KeyError, TypeError, ValueError):
                    raise ValueError(f"comm_costs={path}: field ops.{op}.{g} needs latency_s and bytes_per_s "
                                     f"(numbers) under an integer group size; {make}") from None
                if fit.latency_s < 0 or not fit.bytes_per_s > 0 or not math.isfinite(fit.latency_s):
                    raise ValueError(f"comm_costs={path}: field ops.{op}.{g}: latency_s must be >= 0 and "
                                     f"bytes_per_s > 0; {make}")
                fits.setdefault(op, {})[size] = fit
        compute = data.get("compute") or {}
        try:
            rates = {int(b): float(row["flops_per_s"]) for b, row in (compute.get("micro_batch") or {}).items()}
            step = compute.get("optimizer_step")
            memory = float(step["memory_bytes_per_s"]) if step else None
            tp = {(int(t), int(b)): float(row["seconds_fb"])
                  for t, rows in (compute.get("tensor_parallel") or {}).items() for b, row in rows.items()}
            shape = (str(compute["model"]), int(compute["seq_len"]), int(compute["max_predictions"])) \
                if compute.get("model") is not None else None
            vocab = int(compute["vocab_size"]) if compute.get("vocab_size") is not None else None
            share = {int(b): float(row["seconds_f"]) / float(row["seconds_fb"])
                     for b, row in (compute.get("micro_batch") or {}).items() if "seconds_f" in row}
            pieces = {int(b): {name: (float(p["seconds_f"]), float(p["seconds_fb"]), float(p["flops_f"]))
                               for name, p in row["pieces"].items()}
                      for b, row in (compute.get("micro_batch") or {}).items() if "pieces" in row}
            overhead = float((compute.get("executor") or {}).get("overhead_per_action_s", 0.0))
            bookkeeping = float((compute.get("executor") or {}).get("bookkeeping_seconds", 0.0))
            executor, kfac_executor, muon_executor = ({m: ExecutorStep(int(row["stages"]), int(row["micro_batches"]),
                                                        int(row["micro_batch_size"]), int(row.get("num_virtual", 1)),
                                                        float(row["step_seconds"]),
                                                        float(row["extra_seconds"]) if "extra_seconds" in row else None)
                                        for m, row in ((compute.get("executor") or {}).get(key) or {}).items()
                                        if "refused" not in row} for key in ("methods", "kfac", "muon"))
            kfac = {int(b): (float(row["curvature_flops_per_s"]), float(row["precondition_flops_per_s"]),
                             float(row["invert_flops_per_s"]) if "invert_flops_per_s" in row else None)
                    for b, row in (compute.get("kfac") or {}).items()}
            ns = float(compute["newton_schulz"]["flops_per_s"]) if compute.get("newton_schulz") else None
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            raise ValueError(f"comm_costs={path}: field compute needs model, seq_len, max_predictions, "
                             f"micro_batch.<size>.flops_per_s, optimizer_step.memory_bytes_per_s and, if present, "
                             f"tensor_parallel.<tp>.<size>.seconds_fb, micro_batch.<size>.seconds_f, "
                             f"micro_batch.<size>.pieces.<piece>.seconds_f / seconds_fb / flops_f, executor.overhead_per_action_s, "
                             f"executor.bookkeeping_seconds, executor.methods.<method> (and executor.kfac.<method>, executor.muon.<method>).stages / micro_batches / micro_batch_size / step_seconds and "
                             f"kfac.<size>.curvature_flops_per_s / precondition_flops_per_s / invert_flops_per_s, "
                             f"newton_schulz.flops_per_s (numbers); {make}") from None
        unit_rates = [x for unit in kfac.values() for x in unit if x is not None]
        if any(not r > 0 for r in [*rates.values(), *tp.values(), *unit_rates, *([ns] if ns is not None else [])]) \
                or (memory is not None and not memory > 0):
            raise ValueError(f"comm_costs={path}: field compute: rates and times must be positive; {make}")
        if any(not 0 < x < 1 for x in share.values()):
            raise ValueError(f"comm_costs={path}: field compute.micro_batch.<size>.seconds_f must be positive and "
                             f"below seconds_fb (a forward is part of a forward + backward); {make}")
        if not 0 <= bookkeeping < 10 or not math.isfinite(bookkeeping):
            raise ValueError(f"comm_costs={path}: field compute.executor.bookkeeping_seconds={bookkeeping}: seconds "
                             f"per step, >= 0 and below 10; {make}")
        if not 0 <= overhead < 1 or not math.isfinite(overhead):
            raise ValueError(f"comm_costs={path}: field compute.executor.overhead_per_action_s={overhead}: seconds per "
                             f"action, >= 0 and below 1; {make}")
        if any(not (e.step_seconds > 0 and math.isfinite(e.step_seconds)) or min(e.stages, e.micro_batches,
                                                                                   e.micro_batch_size) < 1
               or not math.isfinite(e.extra_seconds if e.extra_seconds is not None else 0.0)
               for e in [*executor.values(), *kfac_executor.values(), *muon_executor.values()]):
            raise ValueError(f"comm_costs={path}: field compute.executor.methods (or .kfac, .muon): each measured step needs "
                             f"step_seconds > 0 and stages, micro_batches, micro_batch_size >= 1; {make}")
        for b, row in pieces.items():
            unknown = sorted(set(row) - set(PIECES))
            if unknown or any(not 0 < f < fb or not flops >= 0 for f, fb, flops in row.values()):
                raise ValueError(f"comm_costs={path}: field compute.micro_batch.{b}.pieces: pieces are "
                                 f"{', '.join(PIECES)} (not {', '.join(unknown) or 'others'}), each with 0 < seconds_f "
                                 f"< seconds_fb and flops_f >= 0; {make}")
        return cls(fits, hardware, str(path), rates, memory, tp, shape, vocab, share, kfac,
                   bool(compute.get("kfac_in_search", False)), pieces, overhead, executor, bookkeeping, kfac_executor,
                   muon_executor, ns)

    def describe(self) -> str:
        """One line: the source and each measured op's group sizes."""
        if not self.fits:
            return (f"communication: ring model at {self.hardware.allreduce:.3g} B/s (collectives) and "
                    f"{self.hardware.p2p_bytes_per_s:.3g} B/s (p2p), no latency (no comm_costs file)")
        parts = []
        for op in OPS:
            for g, f in sorted(self.fits.get(op, {}).items()):
                parts.append(f"{op}@{g} {f.latency_s * 1e6:.0f} us + {f.bytes_per_s / 1e9:.2f} GB/s")
        text = f"communication measured ({self.source}): " + ", ".join(parts)
        if self.flops_per_s:
            text += "; compute measured: " + ", ".join(f"micro-batch {b}: {r / 1e9:.2f} GFLOP/s"
                                                       for b, r in sorted(self.flops_per_s.items()))
        if self.forward_share:
            text += "; forward share of forward+backward " + ", ".join(
                f"micro-batch {b}: {x:.2f}" for b, x in sorted(self.forward_share.items()))
        if self.piece_seconds:
            text += "; pieces forward+backward " + ", ".join(
                f"micro-batch {b}: " + " ".join(f"{name} {fb * 1e3:.2f} ms" for name, (_, fb, _) in row.items())
                for b, row in sorted(self.piece_seconds.items()))
        if self.action_overhead_s:
            text += f"; executor {self.action_overhead_s * 1e3:.2f} ms per compute action"
        if self.step_bookkeeping_s:
            text += f"; train.py bookkeeping {self.step_bookkeeping_s * 1e3:.1f} ms per step"
        if self.executor_steps:
            text += "; executor steps measured: " + ", ".join(
                f"{m} D={e.stages} N={e.micro_batches} {e.step_seconds * 1e3:.0f} ms"
                for m, e in self.executor_steps.items())
        if self.kfac_executor_steps:
            text += "; K-FAC every step in the executor: " + ", ".join(
                f"{m} D={e.stages} N={e.micro_batches} {e.step_seconds * 1e3:.0f} ms"
                + (f" (NVLAMB's + {e.extra_seconds * 1e3:.0f} ms)" if e.extra_seconds is not None else "")
                for m, e in self.kfac_executor_steps.items())
        if self.muon_executor_steps:
            text += "; Muon in the executor: " + ", ".join(
                f"{m} D={e.stages} N={e.micro_batches} {e.step_seconds * 1e3:.0f} ms"
                + (f" (NVLAMB's {e.extra_seconds * 1e3:+.0f} ms)" if e.extra_seconds is not None else "")
                for m, e in self.muon_executor_steps.items())
        if self.kfac_flops_per_s:
            units = [f"micro-batch {b}: curvature {c / 1e9:.2f}, preconditioning {p / 1e9:.2f}"
                     + (f", inversion {i / 1e9:.2f}" if i else "") + " GFLOP/s"
                     for b, (c, p, i) in sorted(self.kfac_flops_per_s.items())]
            priced = " (priced in the search)" if self.kfac_in_search else ""
            text += f"; K-FAC units{priced} " + ", ".join(units)
        if self.ns_flops_per_s:
            text += f"; Muon's Newton-Schulz {self.ns_flops_per_s / 1e9:.2f} GFLOP/s"
        if self.memory_bytes_per_s:
            text += f"; optimizer step {self.memory_bytes_per_s / 1e9:.2f} GB/s"
        if self.tp_seconds_fb:
            text += "; tensor parallel forward+backward " + ", ".join(
                f"tp={t} micro-batch {b}: {s * 1e3:.0f} ms" for (t, b), s in sorted(self.tp_seconds_fb.items()))
        return text


def collectives_json(backend: str, device: str, world_size: int, points: Mapping[str, Mapping[int, Sequence[tuple[float, float]]]],
                     **extra: Any) -> dict[str, Any]:
    """The JSON document of a measurement: the raw points and their fits per op and group size."""
    ops: dict[str, dict[str, Any]] = {}
    for op, groups in points.items():
        for g, pts in sorted(groups.items()):
            fit = fit_latency_bandwidth(pts)
            ops.setdefault(op, {})[str(g)] = {"latency_s": fit.latency_s, "bytes_per_s": fit.bytes_per_s,
                                              "points": [[x, t] for x, t in pts]}
    return {"format": COLLECTIVES_FORMAT, "backend": backend, "device": device, "world_size": world_size,
            **extra, "ops": ops}
