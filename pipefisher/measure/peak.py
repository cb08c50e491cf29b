"""The peak FLOP/s a run's MFU is measured against: a published GPU peak, or a CPU measurement.

[Note: peak FLOP/s]
GPUs: NVIDIA's data-sheet peaks, **dense** (the "with sparsity" figures halved), in TFLOP/s:

    device (substring of        fp32    tf32    bf16     source
    torch.cuda.get_device_name)
    V100-PCIE                   14      —       112*     Tesla V100 PCIe data sheet
    V100 (SXM2)                 15.7    —       125*     Tesla V100 data sheet
    A100                        19.5    156     312      A100 Tensor Core GPU data sheet (SXM and PCIe)
    H100 PCIe                   51      378     756.5    H100 Tensor Core GPU data sheet
    H100 (SXM)                  67      494.7   989.4    H100 Tensor Core GPU data sheet
    H200                        67      494.7   989.4    H200 data sheet (the H100 SXM compute)

    * V100 has fp16 tensor cores only; bf16 is measured against that fp16 peak.

fp32 uses the tf32 peak when ``torch.backends.cuda.matmul.allow_tf32`` is on (matmuls then run on
tensor cores; torch ≥ 2.9: or ``torch.backends.cuda.matmul.fp32_precision == "tf32"``), else the
fp32 peak. The more specific names come first in the table.

CPUs: no table fits, so ``measure_cpu_peak`` times a square matmul in this process. A run's
workers are separate processes; its peak is measured for ``threads_total`` threads (the compute
threads of all its workers together, capped at ``os.cpu_count()``) in one process: the run's
cores doing the best dense matmul they can. Each run measures (about 0.5 s) and takes the best of
this and every earlier measurement, kept per (host, CPU model, threads,
dtype, torch version) in ``$PIPEFISHER_CACHE_DIR`` or ``$XDG_CACHE_HOME/pipefisher``
(default ``~/.cache/pipefisher``), file ``cpu_peak.json``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipefisher.atomic import write_text_atomic

__all__ = ["GPU_PEAK_TFLOPS", "Peak", "cache_dir", "measure_cpu_peak", "mfu", "resolve_peak", "run_peak", "tflops"]

log = logging.getLogger(__name__)

#: (name substring, {"fp32", "tf32", "bf16": dense TFLOP/s}), most specific first ([Note: peak FLOP/s]).
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("V100-PCIE", {"fp32": 14.0, "bf16": 112.0}),
    ("V100", {"fp32": 15.7, "bf16": 125.0}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5}),
    ("H100", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4}),
    ("H200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4}),
)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_CACHE_FILE = "cpu_peak.json"


@dataclass(frozen=True)
class Peak:
    """A peak rate and where it came from.

    Attributes:
        flops_per_s: peak FLOP/s of the run's hardware at its precision.
        source: e.g. ``"table: NVIDIA H100 80GB HBM3 (bf16)"``, ``"measured: 2 threads fp32
            matmul"`` or ``"hardware.peak_tflops"``.
    """

    flops_per_s: float
    source: str


def cache_dir() -> Path:
    """``$PIPEFISHER_CACHE_DIR``, else ``$XDG_CACHE_HOME/pipefisher``, else ``~/.cache/pipefisher``."""
    if os.environ.get("PIPEFISHER_CACHE_DIR"):
        return Path(os.environ["PIPEFISHER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipefisher"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _time_matmul(dtype: torch.dtype, size: int, seconds: float) -> float:
    """Best FLOP/s of ``size``-wide square matmuls repeated for about ``seconds`` (after a warm-up)."""
    g = torch.Generator().manual_seed(0)  # its own: a run's RNG streams must not move (exact resume)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: thread pool, packing buffers
    best = float("inf")
    start = time.perf_counter()
    for repeat in range(20):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
        if repeat >= 2 and time.perf_counter() - start > seconds:
            break
    return 2.0 * size**3 / best


def measure_cpu_peak(dtype: torch.dtype = torch.float32, threads: int | None = None,
                     seconds: float = 0.5, size: int = 1024) -> float:
    """Dense matmul FLOP/s of this CPU: measured now, and the best of this and every earlier
    measurement on this machine and setting (cached), since a shared machine only measures low.

    Args:
        dtype: matmul dtype (``torch.float32`` or ``torch.bfloat16``).
        threads: torch intra-op threads to measure with (restored after); None: the current count.
        seconds: rough time budget of the timed repeats (at least three are run).
        size: width of the square matrices.

    Returns:
        FLOP/s, the best of the repeats ([Note: peak FLOP/s]).
    """
    previous = torch.get_num_threads()
    threads = threads or previous
    key = "|".join([socket.gethostname(), _cpu_model(), f"threads={threads}", str(dtype), torch.__version__])
    path = cache_dir() / _CACHE_FILE
    try:
        cache: dict[str, float] = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    torch.set_num_threads(threads)
    try:
        now = _time_matmul(dtype, size, seconds)
    finally:
        torch.set_num_threads(previous)
    rate = max(now, float(cache.get(key, 0.0)))  # a busy machine measures low: keep the best seen
    log.info("CPU peak: %.1f GFLOP/s (%d threads, %s, %d-wide matmul; now %.1f)", rate / 1e9, threads, dtype,
             size, now / 1e9)
    if cache.get(key) == rate:
        return rate
    cache[key] = rate
    try:
        write_text_atomic(path, json.dumps(cache, indent=1, sort_keys=True))  # concurrent workers never read half a file
    except OSError as err:
        log.warning("could not cache the CPU peak in %s: %s", path, err)
    return rate


def _tf32_matmul() -> bool:
    """Whether fp32 CUDA matmuls may run as TF32 on tensor cores."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:
        # torch ≥ 2.9 raises when the legacy flag and ``fp32_precision`` were set inconsistently;
        # the kernels follow the new setting.
        return getattr(torch.backends.cuda.matmul, "fp32_precision", "ieee") == "tf32"


def resolve_peak(device: torch.device, precision: str, peak_tflops: float | None = None,
                 threads_total: int | None = None) -> Peak:
    """The peak a run on ``device`` at ``precision`` is measured against ([Note: peak FLOP/s]).

    Args:
        device: the run's device (``cuda`` or ``cpu``).
        precision: ``"fp32"`` or ``"bf16"``.
        peak_tflops: a user-given peak (``hardware.peak_tflops``); wins over table and measurement.
        threads_total: CPU: compute threads of all the run's workers (None: this process's count);
            capped at ``os.cpu_count()``.

    Returns:
        The peak and its source.

    Raises:
        ValueError: unknown precision, or a GPU not in the table and no ``peak_tflops``.
    """
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(_DTYPES)}")
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ValueError(f"hardware.peak_tflops={peak_tflops}: must be positive")
        return Peak(peak_tflops * 1e12, "hardware.peak_tflops")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for pattern, peaks in GPU_PEAK_TFLOPS:
            if pattern.lower() in name.lower():
                column = precision
                if precision == "fp32" and _tf32_matmul() and "tf32" in peaks:
                    column = "tf32"
                return Peak(peaks[column] * 1e12, f"table: {name} ({column})")
        raise ValueError(f"no published peak for GPU {name!r}: set hardware.peak_tflops "
                         f"(known: {[p for p, _ in GPU_PEAK_TFLOPS]})")
    if device.type != "cpu":
        raise ValueError(f"device={device}: peaks are known for cuda and cpu only; set hardware.peak_tflops")
    threads = min(threads_total or torch.get_num_threads(), os.cpu_count() or 1)
    rate = measure_cpu_peak(_DTYPES[precision], threads)
    return Peak(rate, f"measured: {threads} threads {precision} matmul")


def run_peak(one: Peak, device_type: str, num_workers: int) -> Peak:
    """The peak of a whole run from :func:`resolve_peak`'s: a GPU's is per device (one per worker);
    the CPU's was measured for all the run's threads already."""
    devices = num_workers if device_type == "cuda" else 1
    return one if devices == 1 else Peak(one.flops_per_s * devices, f"{one.source} x {devices} devices")


def tflops(model_flops_per_step: float, step_time_s: float) -> float:
    """Achieved model TFLOP/s: model FLOPs of a step ÷ its wall time ÷ 1e12."""
    if not step_time_s > 0:
        raise ValueError(f"step_time_s={step_time_s}: must be positive")
    return model_flops_per_step / step_time_s / 1e12


def mfu(model_flops_per_step: float, step_time_s: float, peak: Peak) -> float:
    """Model FLOPs utilization: achieved model FLOP/s ÷ ``peak.flops_per_s`` (a fraction, not %)."""
    return tflops(model_flops_per_step, step_time_s) * 1e12 / peak.flops_per_s
