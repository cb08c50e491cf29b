"""One worker's training state as plain tensors and primitives, and its exact restoration.

What :mod:`pipefisher.runtime.checkpoint` writes into a worker's shard, and reads back with
``torch.load(weights_only=True)``: nothing here needs unpickling of arbitrary objects.

[Note: what makes resume exact]
A step's result depends on the parameters, the optimizer's moments and step counts, the learning
rate (a function of the scheduler's step count and the config), the K-FAC state, the micro-batches
and the dropout masks. The micro-batches are a pure function of (seed, step) (``pipefisher.data``),
so the data position is the step index itself; so are the masks, keyed by (seed, step, micro-batch,
dropout site) in ``pipefisher.model.rng``. Everything else is saved:

- every stage replica's ``state_dict`` (parameters and buffers, Hugging Face names);
- the optimizer's ``state_dict`` and the scheduler's step count (the rates are recomputed from
  this run's config, see :func:`load_optimizer_state`);
- per K-FAC preconditioner its ``state_dict`` (factors, inverses in use, damping) *and* what a
  PipeFisher refresh cycle carries across step boundaries, which that ``state_dict`` leaves out:
  the deferred (``pending``) inverses waiting for the next cycle, and a refresh's factor sums
  (``acc_a``/``acc_b`` with their row counts) captured in one phase and synchronized or folded in
  during a later phase;
- the worker's random-number generators (torch CPU, the worker's CUDA device, Python's
  ``random`` and numpy's legacy global generator), each as tensors, for any other random draw
  (the model's dropout no longer draws from them).
Captured activations never outlive a step, so a checkpoint taken between steps holds no capture.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipefisher.optim import KFACPreconditioner

__all__ = [
    "capture_rng_state",
    "restore_rng_state",
    "kfac_state",
    "load_kfac_state",
    "optimizer_state",
    "load_optimizer_state",
    "load_module_states",
    "module_key",
    "to_cpu",
]

log = logging.getLogger(__name__)


def module_key(pipe: int, stage: int) -> str:
    """Shard key of the stage replica (pipe, stage): ``"<pipe>.<stage>"``."""
    return f"{pipe}.{stage}"


def to_cpu(obj: Any) -> Any:
    """A copy of a nest of dicts, lists and tuples with every tensor detached and on the CPU (a
    DTensor only detached: ``torch.distributed.checkpoint`` writes it from its device)."""
    if isinstance(obj, DTensor):
        return obj.detach()
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


# -- random-number generators ------------------------------------------------------------------


def capture_rng_state(device: torch.device) -> dict[str, Any]:
    """This process's generator states as tensors and numbers (loadable with ``weights_only``).

    Args:
        device: the worker's device; its CUDA generator is saved when it is a CUDA device.
    """
    version, py_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python_version": int(version),
        "python_state": torch.tensor(py_state, dtype=torch.int64),  # [625] words < 2**32
        "python_gauss": torch.tensor([] if gauss is None else [gauss], dtype=torch.float64),
        "numpy_name": str(name),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),  # [624]
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
    }
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Put back what :func:`capture_rng_state` saved.

    A checkpoint moved between CPU and CUDA loads, with a warning: the generator it lacks keeps
    its seed (the model's dropout masks are keyed, not drawn from it, and do not change).
    """
    torch.set_rng_state(state["torch_cpu"])
    gauss = state["python_gauss"]
    random.setstate((int(state["python_version"]), tuple(int(v) for v in state["python_state"].tolist()),
                     float(gauss[0]) if gauss.numel() else None))
    np.random.set_state((state["numpy_name"], state["numpy_keys"].numpy().astype(np.uint32), int(state["numpy_pos"]),
                         int(state["numpy_has_gauss"]), float(state["numpy_gauss"])))
    if device.type == "cuda":
        if "torch_cuda" in state:
            torch.cuda.set_rng_state(state["torch_cuda"], device)
        else:
            log.warning("checkpoint has no CUDA generator state (written on the CPU); random draws on %s "
                        "other than the model's keyed dropout will not repeat the interrupted run's", device)
    elif "torch_cuda" in state:
        log.warning("checkpoint was written on CUDA; its CUDA generator state is not used on the CPU, "
                    "so random draws other than the model's keyed dropout differ from the interrupted run")


# -- K-FAC ---------------------------------------------------------------------------------------


def _optional(t: Tensor | None) -> Tensor:
    """A tensor, or an empty tensor standing for None (the shard holds tensors only)."""
    return torch.empty(0) if t is None else t.detach().clone()


def kfac_state(pre: KFACPreconditioner) -> dict[str, Any]:
    """A preconditioner's ``state_dict`` plus what a refresh cycle carries between steps.

    Returns:
        ``{"state": pre.state_dict(), "extra": {layer: {...}}}``; see
        [Note: what makes resume exact].
    """
    extra: dict[str, dict[str, Any]] = {}
    for name in pre.layer_names:
        layer = pre.layer(name)
        if layer.xs or layer.gs:
            raise RuntimeError(f"K-FAC layer {name!r} holds captured activations: checkpoint between steps only")
        pending = layer.pending
        extra[name] = {
            "pending_a_inv": _optional(pending[0] if pending else None),
            "pending_b_inv": _optional(pending[1] if pending else None),
            "pending_damping": torch.tensor(pending[2] if pending else (0.0, 0.0), dtype=torch.float64),
            "has_pending": pending is not None,
            "acc_a": _optional(layer.acc_a),
            "acc_b": _optional(layer.acc_b),
            "rows_a": int(layer.rows_a),
            "rows_b": int(layer.rows_b),
            "normalized": bool(layer.normalized),
        }
    return {"state": pre.state_dict(), "extra": extra}


def load_kfac_state(pre: KFACPreconditioner, saved: Mapping[str, Any]) -> None:
    """Restore :func:`kfac_state` output into ``pre`` (tensors moved to each layer's device and dtype).

    Raises:
        ValueError: the saved layers are not this preconditioner's layers.
    """
    extra = saved["extra"]
    if set(extra) != set(pre.layer_names):
        raise ValueError(f"K-FAC state for layers {sorted(extra)} does not fit this stage's layers {pre.layer_names}")
    pre.load_state_dict(saved["state"])  # clears captures and this refresh's sums: set them below
    for name in pre.layer_names:
        layer, e = pre.layer(name), extra[name]
        device = layer.module.weight.device

        def put(t: Tensor) -> Tensor | None:
            return t.to(device, layer.factor_dtype).clone() if t.numel() else None

        if e["has_pending"]:
            lam = e["pending_damping"].tolist()
            layer.pending = (put(e["pending_a_inv"]), put(e["pending_b_inv"]), (float(lam[0]), float(lam[1])))
        else:
            layer.pending = None
        layer.acc_a, layer.acc_b = put(e["acc_a"]), put(e["acc_b"])
        layer.rows_a, layer.rows_b = int(e["rows_a"]), int(e["rows_b"])
        layer.normalized = bool(e["normalized"])


# -- optimizer and learning-rate schedule --------------------------------------------------------


def optimizer_state(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
    """The optimizer's ``state_dict`` and the scheduler's (both plain tensors and numbers)."""
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}


def load_optimizer_state(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                         saved: Mapping[str, Any]) -> None:
    """Restore the optimizer's moments and step counts and the scheduler's position.

    The hyper-parameters (each group's options, the schedule's peak rate, warm-up and length) stay
    those of this run's config, and the current rate is recomputed from them at the restored
    position: resuming with an unchanged config gives the interrupted run's rates exactly, and a
    changed ``steps`` or ``lr`` takes effect instead of being overwritten by the checkpoint's.
    """
    options = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved["optimizer"])
    for group, opts in zip(optimizer.param_groups, options):
        group.update(opts)
    sched = dict(saved["scheduler"])
    sched["lr_lambdas"] = [None] * len(sched.get("lr_lambdas", []))  # keep this run's schedule
    for key in ("base_lrs", "_last_lr"):
        sched.pop(key, None)
    scheduler.load_state_dict(sched)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:  # pragma: no cover - every run builds a LambdaLR (training.make_optimizer)
        raise TypeError(f"cannot restore a {type(scheduler).__name__}: expected torch.optim.lr_scheduler.LambdaLR")
    rates = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, lambdas)]
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = list(rates)  # what get_last_lr() reports, as after scheduler.step()


def load_module_states(modules: Mapping[tuple[int, int], nn.Module], saved: Mapping[str, Any]) -> None:
    """Load every stage replica's ``state_dict`` (strict: keys and shapes must match).

    Raises:
        ValueError: the shard holds other stage replicas than this worker.
    """
    wanted = {module_key(*k) for k in modules}
    if set(saved) != wanted:
        raise ValueError(f"checkpoint shard holds stage replicas {sorted(saved)}, this worker holds {sorted(wanted)}")
    for (pipe, stage), m in modules.items():
        m.load_state_dict(saved[module_key(pipe, stage)], strict=True)
