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
PRECOND right after it. Before the first inverses exist, gradients pass through unpreconditioned;
a layer's first deferred inverses are used from the next step on (nothing older exists), so K-FAC
acts within its first cycle, whichever phase the first inversion ran in. With
``promote="when_ready"`` every deferred inverse is put in use at the start of the step after its
INVERT (``optimizer.promote_inverses``). So the curvature in use is at most 2k − 1 steps old with
deferral (k + p_i − p_c when ready), k − 1 without (``metrics.jsonl``'s ``curvature_age``;
``pipefisher.schedules.kfac.curvature_age_bound`` gives the exact bound of a plan).

[Note: asynchronous factor syncs]
A SYNC_FACTOR between data-parallel replicas starts its all-reduce and returns, as the simulator
models it (``pipefisher.simulate``); the INVERT of one of its layers waits for it, and so does the
end of the step (checkpoints are taken between steps, so no sync outlives its step; the simulator
lets one run across the step boundary).

[Note: a non-owner does not wait]
Under ``optimizer.kfac_owners=replicas`` a replica's INVERT of a layer it does not own inverts nothing, so it
does not wait for that layer's factor all-reduce either: the all-reduce was started at SYNC_FACTOR (the owner's
sum needs this replica's part, and gloo and NCCL progress it without this process waiting), and :meth:`end_step`
waits for it and folds the result into this replica's running factors, as the INVERT did before (the factors stay
equal on every replica, so a checkpoint holds the same factors either way). That wait and fold, after the
step's last action, are no event of the timeline (like any sync :meth:`end_step` finishes): the step's wall time
holds them, utilization counts them idle. Nothing between the INVERT and the end of the step reads or writes a
non-owned layer's factors: the layer's PRECOND is the owner's, the next capture of it is a later step's. The
simulator models the same (``simulate``: a non-owner's INVERT costs 0 and waits for nothing), as the planner
prices it. Measured (bench/studies/16-optimizer-placement.md): the factor all-reduce waits that remain are the
owners' own, and the step is not separated from the old code's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from pipefisher.optim import KFACPreconditioner
from pipefisher.optim.owners import exchange_gathers
from pipefisher.runtime.flat_all_gather import FlatAllGather
from pipefisher.runtime.flat_all_reduce import FlatAllReduce
from pipefisher.runtime.kfac_owners import layer_owners
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
        promote: when deferred inverses are put in use: ``at_cycle_end`` (the next cycle's first
            step) or ``when_ready`` (the step after their INVERT).
        owned: ``optimizer.kfac_owners=replicas``: per stage replica with a group, the layers it inverts and
            preconditions (``runtime.kfac_owners.owned_layers``; [Note: K-FAC owners among replicas]); None:
            every replica does all its layers.
    """

    def __init__(self, preconditioners: dict[StageKey, KFACPreconditioner],
                 groups: dict[int, dist.ProcessGroup | None], deferred: bool, ablate: bool = False,
                 promote: str = "at_cycle_end", owned: dict[StageKey, frozenset[str]] | None = None) -> None:
        if promote not in ("at_cycle_end", "when_ready"):
            raise ValueError(f"promote={promote!r}: use at_cycle_end or when_ready")
        self.pre = preconditioners
        self.ablate = ablate
        self.groups = groups
        self.deferred = deferred
        self.promote = promote
        self._capturing: set[StageKey] = set()
        self._capture_micro_batches: dict[StageKey, set[int]] = {}
        self.step: int | None = None  # the step running (its captures are stamped with it)
        self._used_age: int | None = None  # oldest curvature this step's PRECONDs used (steps)
        self._capture_step: dict[tuple[StageKey, str], int | None] = {}  # (replica, layer) -> step captured
        # Factor all-reduces in flight: (stage replica, layer names) -> (the all-reduce, its group's size).
        self._syncs: dict[tuple[StageKey, tuple[str, ...]], tuple[FlatAllReduce, int]] = {}
        self.owned = owned or {}
        # Preconditioned-gradient exchanges in flight (kfac_owners=replicas): replica -> [(the all-gather or
        # all-reduce of each member's gradients and [preconditioned, age + 1] tensor, per member (its layers, that
        # tensor), raw norms of the layers owned elsewhere)].
        self._exchanges: dict[StageKey, list[tuple[FlatAllGather | FlatAllReduce, list[tuple[list[str], torch.Tensor]],
                                                   dict[str, torch.Tensor]]]] = {}
        self.inverted = 0  # layers inverted here, over the run (tests, benchmarks)
        self.preconditioned = 0  # layers preconditioned here (with inverses in use), over the run

    def _names(self, a: Action) -> list[str]:
        names = self.pre[(a.pipe, a.stage)].layer_names
        return names if a.layer is None else [names[a.layer]]

    def begin_step(self, actions: Sequence[Action], phase: int, step: int | None = None) -> None:
        """Capture on the stage replicas whose curvature this step computes (only the layers and
        micro-batches it has curvature units for); promote deferred inverses at the start of a cycle
        (a layer's first inverses, and all of them with ``promote="when_ready"``, at the start of
        the next step).

        ``step`` is recorded as the capture step of this step's curvature (``curvature_age``).
        """
        if self.deferred:  # a cycle's inverses from the next cycle on; a layer's first ones at once
            first_only = phase != 0 and self.promote == "at_cycle_end"
            for pre in self.pre.values():
                pre.promote_inverses(first_only=first_only)
        self.step = step
        self._used_age = None
        curvature: dict[StageKey, set[str]] = {}
        micro_batches: dict[StageKey, set[int]] = {}
        for a in actions:
            if a.kind in (ActionKind.CURV_A, ActionKind.CURV_B):
                curvature.setdefault((a.pipe, a.stage), set()).update(self._names(a))
                micro_batches.setdefault((a.pipe, a.stage), set()).add(a.micro_batch)
        self._capturing = set(curvature)
        self._capture_micro_batches = micro_batches
        for key, pre in self.pre.items():  # capture only the layers whose curvature runs this step
            pre.forget_raw_norms()
            pre.set_capture(key in curvature, curvature.get(key))

    @contextlib.contextmanager
    def forward(self, key: StageKey, micro_batch: int) -> Iterator[None]:
        """Around a forward: file what the capture hooks record under ``micro_batch`` (when this
        step computes curvature from that micro-batch)."""
        pre = self.pre.get(key)
        if pre is None or key not in self._capturing or micro_batch not in self._capture_micro_batches[key]:
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
                self._capture_step[((a.pipe, a.stage), name)] = self.step
        elif k == ActionKind.CURV_B:
            for name in self._names(a):
                pre.curvature_b(name, a.micro_batch)
        elif k == ActionKind.SYNC_FACTOR:
            key, names = (a.pipe, a.stage), self._names(a)
            group = self.groups.get(a.stage)
            if group is not None and self.ablate:  # communication ablation: one byte on the comm device
                # (the layers' device: NCCL rejects a CPU tensor; issue 15)
                device = pre.layer(names[0]).module.weight.device if names else torch.device("cpu")
                dist.all_reduce(torch.zeros(1, dtype=torch.uint8, device=device), group=group)
            elif group is not None:  # see [Note: asynchronous factor syncs]
                tensors = [t for name in names for t in pre.factor_tensors(name)]
                self._syncs[(key, tuple(names))] = (FlatAllReduce.start(tensors, group), dist.get_world_size(group))
                return
            self._fold(key, names, world=1)
        elif k == ActionKind.INVERT:  # the executor has waited for its syncs (wait_for_syncs)
            for pending in self._pending_syncs(a):
                self._finish_sync(*pending)
            owned = self.owned.get((a.pipe, a.stage))
            for name in self._names(a):
                if owned is None or name in owned:
                    pre.invert(name, deferred=self.deferred)
                    self.inverted += 1
        elif k == ActionKind.PRECOND:
            key, owned = (a.pipe, a.stage), self.owned.get((a.pipe, a.stage))
            names = self._names(a)
            ages: dict[str, int | None] = {}  # the layers preconditioned here: the age of the curvature used
            for name in names:
                if owned is not None and name not in owned:
                    continue  # its owner's gradient arrives by _start_exchange
                if pre.precondition(name):
                    self.preconditioned += 1
                    used = pre.layer(name).inverse_step
                    ages[name] = None if used is None or self.step is None else self.step - used
                    self._note_age(ages[name])
            if owned is not None and names:  # a stage without K-FAC layers has nothing to exchange (on every replica)
                self._start_exchange(key, pre, names, owned, ages)
        else:  # pragma: no cover - only K-FAC kinds are dispatched here
            raise ValueError(f"not a K-FAC action: {a}")

    def _note_age(self, age: int | None) -> None:
        if age is not None:
            self._used_age = age if self._used_age is None else max(self._used_age, age)

    def _start_exchange(self, key: StageKey, pre: KFACPreconditioner, names: list[str], owned: frozenset[str],
                        ages: dict[str, int | None]) -> None:
        """Every replica's ``names`` gradients from their owners ([Note: K-FAC owners among replicas]): the layers
        owned elsewhere have their gradient's norm recorded (the clip reads it), and one collective over the
        stage's group carries each member's own layers and, per layer, whether it preconditioned it and with
        curvature how old (``ages``): an all-gather of each member's piece, or where that moves more bytes
        (``optim.owners.exchange_gathers``) an all-reduce of all of them with the others' values zeroed;
        :meth:`finish_exchanges` copies them in."""
        group = self.groups[key[1]]
        world, me = dist.get_world_size(group), dist.get_rank(group)
        owner = layer_owners(pre, world)
        if {n for n in names if owner[n] == me} != {n for n in names if n in owned}:
            raise RuntimeError(f"kfac_owners=replicas: stage replica {key}'s owned layers {sorted(owned)} are not "
                               f"the plan's for member {me} of {world}")
        pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]  # per member: its layers' gradients, its meta
        raw: dict[str, torch.Tensor] = {}
        for name in names:
            layer = pre.layer(name)
            if name not in owned:
                raw[name] = layer.grad_sq()  # also creates a missing bias gradient, as the owner's PRECOND does
            for p in (layer.module.weight, layer.module.bias):
                if p is None:
                    continue
                if p.grad is None:  # as the gradient all-reduce does: every replica packs every tensor
                    p.grad = torch.zeros_like(p)
                pieces[owner[name]].append(p.grad)
        gather = exchange_gathers([sum(t.numel() for t in piece) for piece in pieces])
        if not gather:  # a sum in which only the owner's values are not zero: x + 0 = x exactly
            for r, piece in enumerate(pieces):
                for t in piece if r != me else ():
                    t.zero_()
        ref = next(t for piece in pieces for t in piece)
        metas: list[tuple[list[str], torch.Tensor]] = []
        for r in range(world):  # per member, [preconditioned, age + 1 (0: none)] of each layer it owns
            theirs = [n for n in names if owner[n] == r]
            meta = torch.zeros(2 * len(theirs), dtype=ref.dtype, device=ref.device)
            if r == me:
                for i, name in enumerate(theirs):
                    if name in ages:
                        age = ages[name]
                        meta[2 * i], meta[2 * i + 1] = 1.0, 0.0 if age is None else age + 1.0
            pieces[r].append(meta)
            metas.append((theirs, meta))
        exchange = (FlatAllGather.start(pieces, group) if gather else
                    FlatAllReduce.start([t for piece in pieces for t in piece], group))
        self._exchanges.setdefault(key, []).append((exchange, metas, raw))

    def finish_exchanges(self, key: StageKey | None = None) -> bool:
        """Wait for the preconditioned-gradient exchanges of one stage replica (or all), which copy the owners'
        gradients in; a layer owned elsewhere and preconditioned there keeps the norm recorded before (as
        ``precondition`` keeps it). The executor calls this before a STEP reads the gradients ([Note: waits are
        not compute]).

        Returns:
            Whether one was in flight.
        """
        keys = [key] if key is not None else list(self._exchanges)
        waited = False
        for k in keys:
            pre = self.pre[k]
            for exchange, metas, raw in self._exchanges.pop(k, []):
                exchange.finish()
                waited = True
                for theirs, meta in metas:
                    values = meta.tolist()
                    for i, name in enumerate(theirs):
                        if name in raw and values[2 * i] > 0.5:  # owned elsewhere, preconditioned there
                            pre.layer(name).raw_grad_sq = raw[name]
                            self._note_age(None if values[2 * i + 1] < 0.5 else round(values[2 * i + 1]) - 1)
        return waited

    def _pending_syncs(self, a: Action) -> list[tuple[StageKey, tuple[str, ...]]]:
        """The factor all-reduces in flight that INVERT ``a`` needs: those of its layers, and under
        ``kfac_owners=replicas`` only of the layers this replica owns ([Note: a non-owner does not wait]);
        :meth:`end_step` finishes the others."""
        key, names = (a.pipe, a.stage), set(self._names(a))
        owned = self.owned.get(key)
        if owned is not None:
            names &= owned
        return [p for p in self._syncs if p[0] == key and names.intersection(p[1])]

    def wait_for_syncs(self, a: Action) -> bool:
        """Wait for the factor all-reduces INVERT ``a`` needs, and nothing else: the executor times
        this wait as its own non-busy event, apart from the INVERT (``runtime.executor``
        [Note: waits are not compute]); :meth:`run` then folds the results in and inverts.

        Returns:
            Whether one was in flight.
        """
        pending = self._pending_syncs(a)
        for p in pending:
            self._syncs[p][0].wait()
        return bool(pending)

    def _finish_sync(self, key: StageKey, names: tuple[str, ...]) -> None:
        """Wait for a factor all-reduce started by SYNC_FACTOR (if :meth:`wait_for_syncs` has not)
        and fold its result into the factors."""
        reduce, world = self._syncs.pop((key, names))
        reduce.finish()
        self._fold(key, list(names), world)

    def _fold(self, key: StageKey, names: list[str], world: int) -> None:
        """Average synced estimates over ``world`` replicas and fold them into the running factors."""
        pre = self.pre[key]
        for name in names:
            if world > 1:
                pre.finish_sync(name, world)
            dropped = self._drop_nonfinite(pre, name)
            pre.update_factors(name, None if dropped else self._capture_step.pop((key, name), None))

    @staticmethod
    def _drop_nonfinite(pre: KFACPreconditioner, name: str) -> bool:
        """Keep NaN/inf curvature out of layer ``name``'s running factors.

        A step whose gradients are not finite is stopped or skipped at STEP (``on_nonfinite``);
        its curvature must not outlive it. The refresh's estimates are replaced by the running
        factors, so folding them in leaves the factors as they were (zeros when there are none
        yet: the inverses are then 1/λ·I). After a factor sync every replica holds the same
        estimates, so all replicas decide alike.
        """
        layer = pre.layer(name)
        estimates = pre.factor_tensors(name)
        if bool(torch.stack([torch.isfinite(t).all() for t in estimates]).all()):  # one sync for both factors
            return False
        log.warning("K-FAC layer %s: non-finite curvature this refresh; the factors keep their previous values", name)
        for t, running in zip(estimates, (layer.a, layer.b)):
            t.copy_(running) if running is not None else t.zero_()
        return True

    def curvature_age(self) -> int | None:
        """Steps between this step and the capture of the oldest curvature its PRECONDs used
        (maximum over this worker's layers; None when no gradient was preconditioned)."""
        return self._used_age

    def raw_grad_sq(self) -> dict[int, torch.Tensor]:
        """``{id(param): ‖grad‖²}`` as it was before this step's preconditioning (see
        ``KFACPreconditioner.raw_grad_sq``), over this worker's stage replicas."""
        return {k: v for pre in self.pre.values() for k, v in pre.raw_grad_sq().items()}

    def parameter_ids(self) -> set[int]:
        """``id`` of the parameters of every K-FAC layer this worker holds."""
        return {i for pre in self.pre.values() for i in pre.parameter_ids()}

    def end_step(self) -> None:
        """Finish the factor syncs still in flight; close the capture window (raises if a capture
        was never consumed by curvature work)."""
        for pending in list(self._syncs):
            self._finish_sync(*pending)
        self.finish_exchanges()
        for key in self._capturing:
            self.pre[key].step_curvature_done()
        self._capturing = set()
