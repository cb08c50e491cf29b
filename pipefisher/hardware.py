"""What this machine computes with: CPU model and instruction-set flags, GPU name, bf16 arithmetic.

Entry points: :func:`describe_hardware` (one line for a benchmark's header: every figure states the
hardware it was measured on, issue 36) and :func:`bf16_arithmetic` (whether matrix products in
bfloat16 run on bf16 instructions here; Muon's Newton–Schulz precision follows it,
``pipefisher.optim.muon``).

[Note: bf16 arithmetic]
torch computes a bf16 matrix product on a CPU with bf16 instructions only where the CPU has them:
AVX-512-BF16 (``avx512_bf16``: Intel Cooper Lake and later, AMD Zen 4 and later) or AMX
(``amx_bf16``: Intel Sapphire Rapids and later). Elsewhere (e.g. an AMD EPYC with AVX2 only) each
element is widened to fp32 and rounded back, and one Newton–Schulz orthogonalization of a 256×256
matrix took 575 ms in bf16 against 40 ms in fp32 (issue 36; ``bench/muon_sharded.py`` measures it
per shape). CUDA GPUs have bf16 tensor cores from compute capability 8.0 (Ampere) on.
This module sits at the bottom of the package (no ``pipefisher`` imports), so ``optim`` may use it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

__all__ = ["CPU_FLAGS", "bf16_arithmetic", "cpu_flags", "cpu_model", "describe_hardware", "parse_cpuinfo"]

#: The CPU flags a benchmark header reports: vector width and bf16 arithmetic ([Note: bf16 arithmetic]).
CPU_FLAGS: tuple[str, ...] = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO = Path("/proc/cpuinfo")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags in ``/proc/cpuinfo`` text.

    Returns:
        ``(model, flags)``; the model is "" and the flags empty where the text lacks them (the
        flags come from ``flags`` on x86, ``Features`` on ARM).
    """
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        return parse_cpuinfo(_CPUINFO.read_text())
    except OSError:
        return "", frozenset()


def cpu_model() -> str:
    """This machine's CPU model (``/proc/cpuinfo``, else the platform's processor or machine name)."""
    return _cpuinfo()[0] or platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (``/proc/cpuinfo``); without that file, the bf16 ones torch's
    own CPU probe reports."""
    flags = _cpuinfo()[1]
    if not flags and getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags = frozenset({"avx512_bf16"})
    return flags


def bf16_arithmetic(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` multiplies bf16 matrices with bf16 instructions ([Note: bf16 arithmetic]).

    Returns:
        ``(yes, why)``, ``why`` naming the device and the deciding feature, e.g.
        ``"CPU AMD EPYC without avx512_bf16/amx"`` or ``"GPU NVIDIA H100 80GB HBM3, compute capability 9.0"``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return (major, minor) >= (8, 0), f"GPU {name}, compute capability {major}.{minor}" + (
            "" if major >= 8 else " < 8.0")
    if device.type != "cpu":
        return False, f"device {device.type}: bf16 arithmetic not checked"
    have = [f for f in _BF16_FLAGS if f in cpu_flags()]
    if have:
        return True, f"CPU {cpu_model()} with {'/'.join(have)}"
    return False, f"CPU {cpu_model()} without avx512_bf16/amx"


def describe_hardware(device: torch.device | str | None = None) -> str:
    """One line naming what a figure was measured on: CPU model, cores and :data:`CPU_FLAGS`, torch's
    intra-op threads and version, and the GPU when ``device`` is CUDA (default: CUDA when available).

    Example: ``CPU AMD EPYC (2 cores; avx2 yes, avx512f no, avx512_bf16 no, amx_bf16 no), 2 torch
    threads, torch 2.13.0``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    flags = cpu_flags()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    marks = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in CPU_FLAGS) if flags else "flags unknown"
    line = f"CPU {cpu_model()} ({cores} cores; {marks}), {torch.get_num_threads()} torch threads, torch {torch.__version__}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        line += f", GPU {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}, CUDA {torch.version.cuda})"
    return line
