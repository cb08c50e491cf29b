"""A stand-in for a node of GPUs on a CPU-only machine (issue 25): fakes ``torch.cuda`` and records
every call with the device it targeted.

What it fakes, and what "targeted" means:

- ``torch.cuda``: ``is_available``, ``device_count``, ``set_device`` (changes the current device),
  ``current_device``, ``synchronize``, ``current_stream`` (a stream of the current device, or the
  given one), ``Event`` (recorded on the current stream's device), memory statistics, the CUDA
  generator's state, ``get_device_name`` and NVTX (no device);
- tensor placement: a ``TorchFunctionMode`` turns every ``device=cuda:i`` argument (factories,
  ``Tensor.to``, ``Module.to``) into the CPU and records ``i`` (``cuda`` without an index: the
  current device, as CUDA resolves it);
- ``torch.distributed``: ``init_process_group`` records the backend asked for and uses gloo (the
  tensors are on the CPU); the object collectives and ``barrier`` record the current device, which
  is the device NCCL runs them on.

A worker of local rank ``r`` on a healthy node touches only device ``r``: :meth:`FakeCuda.devices`
is then ``{r}``. The fake holds per process (a spawned worker installs its own).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = ["FakeCuda", "install"]

GPU_NAME = "NVIDIA H100 80GB HBM3"  # a name pipefisher.measure.peak knows


class FakeCuda:
    """The state of a node of ``count`` GPUs as one process sees it, and the calls it made.

    Attributes:
        count: number of devices.
        current: the current device (0 until ``set_device``, as in CUDA).
        calls: ``(what, device index)`` in call order.
        backends: the ``init_process_group`` backends asked for.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.current = 0
        self.calls: list[tuple[str, int]] = []
        self.backends: list[str] = []

    def index(self, device: Any = None) -> int:
        """The device index ``device`` means (None, ``"cuda"``: the current one); rejects bad ordinals."""
        if device is None:
            return self.current
        if isinstance(device, int):
            index = device
        else:
            device = device if isinstance(device, torch.device) else torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"stand-in CUDA call with a {device.type} device")
            index = self.current if device.index is None else device.index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (the stand-in has {self.count})")
        return index

    def touch(self, what: str, device: Any = None) -> int:
        """Record ``what`` on ``device`` (default: the current device); returns its index."""
        index = self.index(device)
        self.calls.append((what, index))
        return index

    def devices(self) -> set[int]:
        """Every device index a call targeted."""
        return {index for _, index in self.calls}

    def kinds(self) -> set[str]:
        """The names of the calls made."""
        return {what for what, _ in self.calls}

    def set_device(self, device: Any) -> None:
        self.current = self.touch("set_device", device)


class _Stream:
    def __init__(self, cuda: FakeCuda, index: int) -> None:
        self.cuda, self.device_index = cuda, index

    def synchronize(self) -> None:
        self.cuda.touch("stream.synchronize", self.device_index)


class _Event:
    """A timing event: ``record`` stamps the CPU clock on the current stream's device."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.ns = cuda, None

    def record(self, stream: _Stream | None = None) -> None:
        self.cuda.touch("event.record", None if stream is None else stream.device_index)
        self.ns = time.perf_counter_ns()

    def synchronize(self) -> None:
        self.cuda.touch("event.synchronize")

    def elapsed_time(self, end: "_Event") -> float:
        assert self.ns is not None and end.ns is not None, "elapsed_time of an event never recorded"
        return (end.ns - self.ns) / 1e6


def _as_device(x: Any) -> torch.device | None:
    if isinstance(x, torch.device):
        return x
    if isinstance(x, str):
        try:
            return torch.device(x)
        except RuntimeError:
            return None
    return None


class _CudaToCpu(TorchFunctionMode):
    """Place tensors meant for a CUDA device on the CPU, recording the device index."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.device:  # making a device object touches no device
            return func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", str(func))
        kwargs = dict(kwargs or {})
        device = _as_device(kwargs.get("device"))
        if device is not None and device.type == "cuda":
            self.cuda.touch(f"tensor:{name}", device)
            kwargs["device"] = torch.device("cpu")
        args = list(args)
        for i, a in enumerate(args):
            device = _as_device(a)
            if device is not None and device.type == "cuda":
                self.cuda.touch(f"tensor:{name}", device)
                args[i] = torch.device("cpu")
        return func(*args, **kwargs)


def _patch(obj: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    old = getattr(obj, name)
    setattr(obj, name, value)
    undo.append(lambda: setattr(obj, name, old))


def _cuda_functions(cuda: FakeCuda) -> dict[str, Any]:
    """Replacements for the ``torch.cuda`` functions pipefisher calls."""

    def recorded(what: str, result: Callable[[int], Any] = lambda index: None) -> Callable[..., Any]:
        def call(device: Any = None) -> Any:
            return result(cuda.touch(what, device))
        return call

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        cuda.touch("set_rng_state", device)

    return {
        "is_available": lambda: True,
        "device_count": lambda: cuda.count,
        "set_device": cuda.set_device,
        "current_device": lambda: cuda.current,
        "synchronize": recorded("synchronize"),
        "current_stream": lambda device=None: _Stream(cuda, cuda.index(device)),
        "Event": lambda enable_timing=False, **_: _Event(cuda),
        "memory_allocated": recorded("memory_allocated", lambda index: 0),
        "max_memory_allocated": recorded("max_memory_allocated", lambda index: 1 << 20),
        "reset_peak_memory_stats": recorded("reset_peak_memory_stats"),
        "get_rng_state": recorded("get_rng_state", lambda index: torch.full((16,), index, dtype=torch.uint8)),
        "set_rng_state": set_rng_state,
        "get_device_name": recorded("get_device_name", lambda index: GPU_NAME),
        "is_bf16_supported": lambda *a, **k: True,
    }


def _dist_functions(cuda: FakeCuda) -> dict[str, Any]:
    """Wrappers of ``torch.distributed``: gloo instead of NCCL; object collectives and barrier
    recorded on the current device (where NCCL runs them)."""
    real = {name: getattr(dist, name) for name in
            ("init_process_group", "gather_object", "all_gather_object", "broadcast_object_list", "barrier")}

    def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> Any:
        cuda.backends.append(str(backend))
        return real["init_process_group"]("gloo", *args, **kwargs)

    def recorded(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            cuda.touch(f"dist.{name}")
            return real[name](*args, **kwargs)
        return call

    return {"init_process_group": init_process_group,
            **{name: recorded(name) for name in real if name != "init_process_group"}}


@contextlib.contextmanager
def install(count: int = 4) -> Iterator[FakeCuda]:
    """Within the block this process sees ``count`` GPUs (see the module docstring)."""
    cuda = FakeCuda(count)
    undo: list[Callable[[], None]] = []
    try:
        for name, fn in _cuda_functions(cuda).items():
            _patch(torch.cuda, name, fn, undo)
        for name in ("range_push", "range_pop", "mark"):
            _patch(torch.cuda.nvtx, name, lambda *a, **k: None, undo)
        _patch(torch.cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext(), undo)
        for name, fn in _dist_functions(cuda).items():
            _patch(dist, name, fn, undo)

        def pin_memory(t: torch.Tensor, device: Any = None) -> torch.Tensor:  # page-locked by the current device's context
            cuda.touch("pin_memory", device)
            return t
        _patch(torch.Tensor, "pin_memory", pin_memory, undo)
        with _CudaToCpu(cuda):
            yield cuda
    finally:
        for restore in reversed(undo):
            restore()
