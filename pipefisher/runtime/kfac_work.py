"""K-FAC work units as the executor runs them: one preconditioner per stage replica of a worker.

The schedule decides when each unit runs (``pipefisher.schedules.kfac``: on the critical path
for ``optimizer=kfac``, in the bubbles for ``optimizer=pipefisher``); this module only performs a
unit when the executor reaches it.

[Note: refresh cycle and staleness]
Step t runs phase t mod k of the assignment. The refresh's curvature is captured and accumulated in
one phase (captured activations do not outlive a step); factor syncs and inversions may follow in
later phases. With ``deferred`` inverses (PipeFisher), inverses made during cycle c are put in use
at the first step of cycle c+1, so every step of a cycle is preconditioned with the same inverses,
whatever phase the inversion ran in; without (the kfac baseline), an inversion is used from the
PRECOND right after it. Before the first inverses exist, gradients pass through unpreconditioned.

[Note: asynchronous factor syncs]
A SYNC_FACTOR between data-parallel replicas starts its all-reduce and returns, as the simulator
models it (``pipefisher.simulate``); the INVERT of one of its layers waits for it, and so does the
end of the step (checkpoints are taken between steps, so no sync outlives its step; the simulator
lets one run across the step boundary).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from pipefisher.optim import KFACPreconditioner
from pipefisher.schedules.ir import Action, ActionKind

__all__ = ["KfacWork"]

log = logging.getLogger(__name__)

StageKey = tuple[int, int]  # (pipe, stage)


class KfacWork:
    """Performs CURV_A, CURV_B, SYNC_FACTOR, INVERT and PRECOND actions on one worker.

    Args:
        preconditioners: per local stage replica (pipe, stage), its K-FAC state; the action's
            ``layer`` indexes ``preconditioner.layer_names``.
        groups: process group of each stage's replicas (None: a single replica).
        deferred: inverses wait for the next refresh cycle (see [Note: refresh cycle and staleness]).
        ablate: communication ablation: factor all-reduces become 1-byte messages.
    """

    def __init__(self, preconditioners: dict[StageKey, KFACPreconditioner],
                 groups: dict[int, dist.ProcessGroup | None], deferred: bool, ablate: bool = False) -> None:
        self.pre = preconditioners
        self.ablate = ablate
        self.groups = groups
        self.deferred = deferred
        self._capturing: set[StageKey] = set()
        # Factor all-reduces in flight: (stage replica, layer names) -> (work, flat buffer, tensors, world).
        self._syncs: dict[tuple[StageKey, tuple[str, ...]], tuple[dist.Work, torch.Tensor, list[torch.Tensor], int]] = {}

    def _names(self, a: Action) -> list[str]:
        names = self.pre[(a.pipe, a.stage)].layer_names
        return names if a.layer is None else [names[a.layer]]

    def begin_step(self, actions: Sequence[Action], phase: int) -> None:
        """Capture on the stage replicas whose curvature this step computes; promote deferred
        inverses at the start of a cycle."""
        if self.deferred and phase == 0:
            for pre in self.pre.values():
                pre.promote_inverses()
        curvature: dict[StageKey, set[str]] = {}
        for a in actions:
            if a.kind in (ActionKind.CURV_A, ActionKind.CURV_B):
                curvature.setdefault((a.pipe, a.stage), set()).update(self._names(a))
        self._capturing = set(curvature)
        for key, pre in self.pre.items():  # capture only the layers whose curvature runs this step
            pre.set_capture(key in curvature, curvature.get(key))

    @contextlib.contextmanager
    def forward(self, key: StageKey, micro_batch: int) -> Iterator[None]:
        """Around a forward: file what the capture hooks record under ``micro_batch``."""
        pre = self.pre.get(key)
        if pre is None or key not in self._capturing:
            yield
            return
        with pre.micro_batch(micro_batch):
            yield

    def run(self, a: Action) -> None:
        """Perform one K-FAC action."""
        pre = self.pre[(a.pipe, a.stage)]
        k = a.kind
        if k == ActionKind.CURV_A:
            for name in self._names(a):
                pre.curvature_a(name, a.micro_batch)
        elif k == ActionKind.CURV_B:
            for name in self._names(a):
                pre.curvature_b(name, a.micro_batch)
        elif k == ActionKind.SYNC_FACTOR:
            key, names = (a.pipe, a.stage), self._names(a)
            group = self.groups.get(a.stage)
            if group is not None and self.ablate:
                dist.all_reduce(torch.zeros(1, dtype=torch.uint8), group=group)  # communication ablation
            elif group is not None:  # see [Note: asynchronous factor syncs]
                tensors = [t for name in names for t in pre.factor_tensors(name)]
                flat = torch._utils._flatten_dense_tensors(tensors)
                work = dist.all_reduce(flat, group=group, async_op=True)
                self._syncs[(key, tuple(names))] = (work, flat, tensors, dist.get_world_size(group))
                return
            self._fold(key, names, world=1)
        elif k == ActionKind.INVERT:
            key, names = (a.pipe, a.stage), self._names(a)
            for pending in [p for p in self._syncs if p[0] == key and set(p[1]) & set(names)]:
                self._finish_sync(*pending)
            for name in names:
                pre.invert(name, deferred=self.deferred)
        elif k == ActionKind.PRECOND:
            for name in self._names(a):
                pre.precondition(name)
        else:  # pragma: no cover - only K-FAC kinds are dispatched here
            raise ValueError(f"not a K-FAC action: {a}")

    def _finish_sync(self, key: StageKey, names: tuple[str, ...]) -> None:
        """Wait for a factor all-reduce started by SYNC_FACTOR and fold its result into the factors."""
        work, flat, tensors, world = self._syncs.pop((key, names))
        work.wait()
        for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
            t.copy_(synced)
        self._fold(key, list(names), world)

    def _fold(self, key: StageKey, names: list[str], world: int) -> None:
        """Average synced estimates over ``world`` replicas and fold them into the running factors."""
        pre = self.pre[key]
        for name in names:
            if world > 1:
                pre.finish_sync(name, world)
            self._drop_nonfinite(pre, name)
            pre.update_factors(name)

    @staticmethod
    def _drop_nonfinite(pre: KFACPreconditioner, name: str) -> None:
        """Keep NaN/inf curvature out of layer ``name``'s running factors.

        A step whose gradients are not finite is stopped or skipped at STEP (``on_nonfinite``);
        its curvature must not outlive it. The refresh's estimates are replaced by the running
        factors, so folding them in leaves the factors as they were (zeros when there are none
        yet: the inverses are then 1/λ·I). After a factor sync every replica holds the same
        estimates, so all replicas decide alike.
        """
        layer = pre.layer(name)
        estimates = pre.factor_tensors(name)
        if all(bool(torch.isfinite(t).all()) for t in estimates):
            return
        log.warning("K-FAC layer %s: non-finite curvature this refresh; the factors keep their previous values", name)
        for t, running in zip(estimates, (layer.a, layer.b)):
            t.copy_(running) if running is not None else t.zero_()

    def end_step(self) -> None:
        """Finish the factor syncs still in flight; close the capture window (raises if a capture
        was never consumed by curvature work)."""
        for pending in list(self._syncs):
            self._finish_sync(*pending)
        for key in self._capturing:
            self.pre[key].step_curvature_done()
        self._capturing = set()
