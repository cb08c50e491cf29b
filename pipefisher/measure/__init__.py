"""Measuring a run: model FLOPs, the peak FLOP/s behind MFU, and peak memory per step.

Entry points: :func:`train_step_flops` (PaLM's model FLOPs of a step), :func:`resolve_peak` and
:func:`mfu` (published GPU peak or measured CPU peak), :func:`describe_hardware` (the line every
figure names its hardware by; ``pipefisher.hardware``), :class:`PeakMemory` (this process's peak
per step) beside :func:`predicted_peak_bytes` (the planner's prediction per worker).
DESIGN.md, "Measuring a run".
"""

from pipefisher.hardware import describe_hardware
from pipefisher.measure.flops import forward_flops, train_step_flops
from pipefisher.measure.memory import PeakMemory, current_bytes, predicted_peak_bytes
from pipefisher.measure.peak import (GPU_PEAK_TFLOPS, Peak, cache_dir, measure_cpu_peak, mfu, resolve_peak, run_peak,
                                     tflops)

__all__ = [
    "GPU_PEAK_TFLOPS",
    "Peak",
    "PeakMemory",
    "cache_dir",
    "current_bytes",
    "describe_hardware",
    "forward_flops",
    "measure_cpu_peak",
    "mfu",
    "predicted_peak_bytes",
    "resolve_peak",
    "run_peak",
    "tflops",
    "train_step_flops",
]
