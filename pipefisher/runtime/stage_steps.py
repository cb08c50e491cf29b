"""Per-stage optimizer steps with post-validation (``optimizer_placement=per_stage``, issue 36).

[Note: post-validation]
A stage STEP (``schedules.passes`` [Note: per-stage optimizer steps]) runs before the global
gradient norm is known: the clip factor c = max_norm / max(‖G‖, max_norm) and the finite check need
every stage's gradient. Following the Zero Bubble paper's optimizer post-validation (Qi et al., ICLR
2024, §4.3), a stage steps optimistically with c = 1 and the worker's final STEP, once it holds the
global norm (the same all-reduce, over the same gradients, as the global step), confirms or redoes:

- ‖G‖ finite and ‖G‖ ≤ max_norm (or clipping off): every norm at most max_norm gives the same
  clip factor, the one the optimistic step used (it passes a float32 norm of 0, the dtype of the
  pipeline's norm: the factor is max_norm / float32(max_norm), within an ulp of 1, the same for
  both), so the optimistic step *is* the global step of those parameters. Confirmed; the final STEP
  steps the rest (stages that deferred, the tied weight) with the norm.
- ‖G‖ > max_norm: each optimistically stepped stage is rolled back (its parameters, their
  optimizer state and, for the optimizers that clip ``.grad`` in place, AdamW and Muon, their
  gradients, restored from the copies taken just before its step) and everything steps again with
  the real norm, as the global step does.
- ‖G‖ not finite: rolled back, then ``on_nonfinite`` as the global step (stop, or skip the update).

A stage whose own gradient is already non-finite or has a norm above max_norm cannot step with
c = 1 (the global norm is at least its own) and defers its step to the final STEP instead: no
wasted work, no rollback. So does every stage while the previous step's global norm was above
max_norm: clipping comes in runs (early training), and a rollback costs the stage's step twice
(Muon's Newton–Schulz: 7 rollbacks in 10 steps made bert-tiny's 1f1b step 1.2× the global one's,
``bench/studies/16-optimizer-placement.md``); that norm is global, so every process decides alike. Without clipping and with ``on_nonfinite=stop`` nothing is ever rolled back
(a NaN ends the run), so no copies are kept. Under sdp/tp a stage's processes step together (their optimizer steps
hold collectives), and each sees only its shard's norm, so they never defer: every stage steps
optimistically there. The result equals the global step's bit for bit: the optimizers' updates are
per tensor (NVLAMB's foreach kernels, torch's AdamW and Muon), so stepping a stage's tensors apart
changes nothing. Under sdp > 2 a sharded trust ratio's all-reduce may sum its shards in
another order when its bucket holds other tensors; equality there is to rounding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pipefisher.optim.nvlamb import NVLAMB
from pipefisher.runtime.kfac_work import StageKey
from pipefisher.runtime.ns_spread import NsSpread
from pipefisher.runtime.ns_spread import only_grads as _only_grads
from pipefisher.runtime.sharding import local

__all__ = ["StageSteps"]

# parameter, its local data, its optimizer state, its local gradient (None: the optimizer leaves .grad alone)
_Saved = tuple[nn.Parameter, torch.Tensor, dict[str, Any] | None, torch.Tensor | None]


class StageSteps:
    """One worker's per-stage optimizer steps and their validation at the final STEP.

    Args:
        optimizer: the worker's optimizer (NVLAMB, GlobalNormAdamW or MuonAdamW): ``step(grad_norm=...)``.
        modules: the worker's stage replicas, keyed by (pipe, stage).
        tied: this worker's copies of the tied weight: stepped at the final STEP only (its gradient
            is summed over both ends of the pipeline there).
        max_grad_norm: the global clip threshold; ``<= 0`` or ``inf``: no clipping.
        may_defer: a stage whose own gradient forbids c = 1 defers to the final STEP (False under
            sdp/tp, where a stage's processes must step together).
        stop_on_nonfinite: ``on_nonfinite=stop``: a NaN/inf norm ends the run, so without clipping
            nothing is ever rolled back and the stage steps keep no copies.
        ns: ``optimizer.ns_owners=pipeline``: Muon's Newton–Schulz of a late worker's stage steps and
            of the final STEP's rest is left pending for the worker's :meth:`NsSpread.resolve`
            ([Note: NS owners across the pipeline]); None: each step orthogonalizes its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, modules: dict[StageKey, nn.Module],
                 tied: Iterable[nn.Parameter], max_grad_norm: float, may_defer: bool = True,
                 stop_on_nonfinite: bool = False, ns: NsSpread | None = None) -> None:
        self.optimizer = optimizer
        self.ns = ns
        tied_ids = {id(p) for p in tied}
        self.stage_params = {key: [p for p in m.parameters() if p.requires_grad and id(p) not in tied_ids]
                             for key, m in modules.items()}
        self.max_grad_norm = float(max_grad_norm)
        self.clips = 0.0 < self.max_grad_norm < math.inf
        self.may_defer = may_defer
        self.keeps_grads = isinstance(optimizer, NVLAMB)  # NVLAMB clips a copy; AdamW and Muon the .grad
        self.copies = self.clips or not stop_on_nonfinite  # a rollback may be needed
        self._stepped: dict[StageKey, list[nn.Parameter]] = {}
        self._saved: dict[StageKey, list[_Saved]] = {}
        self.deferred: set[StageKey] = set()
        self.rollbacks = 0  # stage replicas rolled back in the last step
        self.last_norm = 0.0  # the previous step's global norm: above max_norm, every stage defers

    def step_stage(self, key: StageKey) -> None:
        """The STEP of stage replica ``key``: optimistic (c = 1), keeping what a rollback needs, or
        deferred to the final STEP ([Note: post-validation])."""
        params = [p for p in self.stage_params[key] if p.grad is not None]
        if (self.clips and self.last_norm > self.max_grad_norm) or (self.may_defer and self._forbids_unit_clip(params)):
            self.deferred.add(key)
            return
        self._stepped[key] = params
        if self.copies:
            self._saved[key] = [(p, local(p).detach().clone(), _copy_state(self._state_of(p)),
                                 None if self.keeps_grads else local(p.grad).detach().clone()) for p in params]
        with _only_grads(self.optimizer, params), self._deferring(stage_step=True):
            # a float32 norm below max_norm: the clip factor of every such norm ([Note: post-validation])
            self.optimizer.step(grad_norm=torch.zeros((), dtype=torch.float32))

    def finish(self, grad_norm: torch.Tensor, nonfinite: Callable[[float], None]) -> None:
        """The final STEP's optimizer work: confirm or roll back the stage steps, step the rest.

        Args:
            grad_norm: the global gradient norm (all workers, as the global step computes it).
            nonfinite: called with the norm when it is not finite (``on_nonfinite``: raises or skips),
                after the rollback.
        """
        norm = float(grad_norm)
        every_stage_deferred = self.clips and self.last_norm > self.max_grad_norm  # the same on every rank
        self.last_norm = norm if math.isfinite(norm) else 0.0
        stepped = {id(p) for params in self._stepped.values() for p in params}
        confirmed = math.isfinite(norm) and (not self.clips or norm <= self.max_grad_norm)
        self.rollbacks = 0
        if not confirmed and self._stepped:
            if not self.copies:  # on_nonfinite=stop without clipping: the run ends here
                nonfinite(norm)
                raise AssertionError("on_nonfinite=stop returned on a non-finite norm")  # pragma: no cover
            self.rollbacks = len(self._stepped)
            self._roll_back()
            if self.ns is not None:  # their pending Newton–Schulz inputs went with them
                self.ns.discard(p for params in self._stepped.values() for p in params)
            stepped = set()
        self._stepped.clear()
        self._saved.clear()
        self.deferred.clear()
        if not math.isfinite(norm):
            if self.ns is not None:
                self.ns.clear()
            nonfinite(norm)
            return
        rest = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None and id(p) not in stepped]
        if self.ns is not None:  # [Note: NS owners across the pipeline]
            self.ns.step(self.optimizer, rest, grad_norm, everything=not confirmed or every_stage_deferred)
            return
        with _only_grads(self.optimizer, rest):
            self.optimizer.step(grad_norm=grad_norm)

    def _deferring(self, stage_step: bool = False) -> contextlib.AbstractContextManager:
        return self.ns.deferring(stage_step) if self.ns is not None else contextlib.nullcontext()

    def _forbids_unit_clip(self, params: list[nn.Parameter]) -> bool:
        """The stage's own gradient is not finite or its norm exceeds max_norm (so ‖G‖ does too)."""
        if not params:
            return False
        sq = torch.stack([local(p.grad).detach().double().pow(2).sum() for p in params]).sum()
        own = float(sq.sqrt())
        return not math.isfinite(own) or (self.clips and own > self.max_grad_norm)

    @torch.no_grad()
    def _roll_back(self) -> None:
        for saved in self._saved.values():
            for p, data, state, grad in saved:
                local(p).copy_(data)
                if grad is not None:
                    local(p.grad).copy_(grad)
                holder = self._state_holder(p)
                if state is None:
                    holder.pop(p, None)
                else:
                    holder[p] = state

    def _state_holder(self, p: nn.Parameter) -> dict:
        """The optimizer state dict that holds ``p``'s state (MuonAdamW keeps it in its inner optimizers)."""
        for inner in (getattr(self.optimizer, "muon", None), getattr(self.optimizer, "adamw", None)):
            if inner is not None and any(p is q for g in inner.param_groups for q in g["params"]):
                return inner.state
        return self.optimizer.state

    def _state_of(self, p: nn.Parameter) -> dict[str, Any] | None:
        holder = self._state_holder(p)
        return holder[p] if p in holder else None


def _copy_state(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of one parameter's optimizer state (tensors cloned), None when it has none yet."""
    if state is None:
        return None
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
