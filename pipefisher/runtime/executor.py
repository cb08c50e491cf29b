"""Execute one worker's action list for one training step with torch.distributed.

Why one module: most of it is :class:`WorkerExecutor`, whose per-action handlers share one step's state
(posted messages, saved activations, clock marks), and the message tags and specs beside it are its wire
format (held-out evaluation reuses them to speak the same protocol).

The executor decides nothing about order: it walks the list a schedule generator produced and
checked (``pipefisher.schedules``), and records what it did as timeline events.

[Note: communication]
Activations (F) and activation gradients (B) travel point to point with ``isend``/``irecv``; every
message has a fixed shape ``(micro_batch_size, seq_len, hidden)`` and a tag unique to
(direction, pipe, stage boundary, micro-batch), so messages of the two Chimera pipelines never
meet. On gloo every receive of the step is posted when the step starts (tags match them up, and
the wait is only paid where the data is consumed); on NCCL, which matches point-to-point messages
in issue order per pair of ranks and serializes a pair's sends behind its posted receives, a
receive is posted when its RECV action is reached. Sends are waited for at the end of the step.

Consecutive stages on one worker (zb-v's turn, where worker D−1 holds stages D−1 and D) exchange
nothing: the later stage's forward takes the earlier one's output, detached, and the earlier
stage's backward takes the later one's input gradient from memory.

[Note: split backward]
``I`` runs a micro-batch's backward with every ``nn.Linear`` weight-gradient product deferred
(``runtime.split_backward``, [Note: deferred weight gradients]); it produces the input gradient the
``SEND_B`` carries, as ``B`` does. ``W`` runs the deferred products into ``.grad``. SYNC_GRAD comes
after a replica's last B or W, so it all-reduces complete gradients.

[Note: gradient synchronization]
``SYNC_GRAD(stage, pipe)`` starts an asynchronous all-reduce (sum) of that stage's flattened
gradients over all its replicas (Chimera twin, data-parallel copies), as soon as the replica's last
backward is done; all handles are waited for at ``STEP``. The word-embedding weight of stage 0 and
the tied MLM-decoder weight of the last stage are left out of those all-reduces: at ``STEP`` every
worker adds up its local copies of the tied weight's gradient and all-reduces that sum over all
holders of either stage, so every copy receives the sum of every copy's gradient exactly once.
A K-FAC ``PRECOND(stage, pipe)`` first waits for that replica's all-reduce (K-FAC layers are
encoder Linear layers, never the tied weight); the global gradient norm is taken at ``STEP``,
after preconditioning.

[Note: dropout]
Each FORWARD runs under ``dropout_key(step, r * N + j)`` for micro-batch j of data-parallel replica
r (N micro-batches per replica): the index the sample has in the step's global batch, and the one
single-process training (``tests/reference.py``) gives it. Dropout masks are a function of that
key and the dropout site, not of this worker's RNG, so every method draws the single-process masks
(``pipefisher.model.rng``, [Note: randomness independent of placement]); recompute replays them.

[Note: waits are not compute]
DESIGN.md, "Bubble utilization": waiting is never busy. An action that consumes collectives first
waits for them, and that wait is an event of its own, just before the action's event, with the
action's name and the collective's kind (never in ``timeline.COMPUTE_KINDS``)::

    1PRECOND@1 SYNC_GRAD   this replica's gradient all-reduce (and copying its result back)
    1STEP@1    SYNC_GRAD   the same for a stage STEP (per-stage optimizer steps)
    0INVERT#3  SYNC_FACTOR its layer's factor all-reduce (KfacWork.wait_for_syncs; the fold of
                           the synced factors is K-FAC work and stays in INVERT; a replica that does
                           not own the layer waits and folds at the step's end: [Note: a non-owner
                           does not wait] in ``runtime.kfac_work``)
    STEP       SYNC_GRAD   sends, every gradient all-reduce, the tied weight's, the global norm

so the PRECOND, INVERT and STEP events cover their compute only. The names parse back with
``Action.from_str``; a reader tells a wait from the action by its kind (``timeline.is_wait``), and
the cost readers (``planning.costs.costs_from_profile``, ``runtime.step_metrics.measured_costs``) skip
waits: SYNC_GRAD / SYNC_FACTOR costs stay the means of the events that start the all-reduces,
and no unit is charged for its wait. A wait is recorded only when something was in flight. In an
nsys capture a wait's range is named by the collective's kind alone (``SYNC_GRAD``), since nsys
readers take the kind from the name; that name is stage-less, so no cost reads it either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.model.rng import dropout_key
from pipefisher.runtime.flat_all_reduce import FlatAllReduce
from pipefisher.runtime.kfac_work import KfacWork, StageKey
from pipefisher.runtime.sharding import ShardedStages, local
from pipefisher.runtime.split_backward import (WeightGradStore, accumulating, apply_weight_grads, deferring,
                                               enable_split_backward)
from pipefisher.runtime.step_clock import StepClock
from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.timeline import Event

__all__ = ["StageKey", "CommSpec", "StepResult", "WorkerExecutor", "action_tag", "message_tag", "post_recv",
           "sender_stage"]

# The collective each consuming action may wait for ([Note: waits are not compute]).
_WAITS_FOR = {ActionKind.PRECOND: ActionKind.SYNC_GRAD, ActionKind.INVERT: ActionKind.SYNC_FACTOR,
              ActionKind.STEP: ActionKind.SYNC_GRAD}


def message_tag(kind: ActionKind, pipe: int, sender_stage: int, micro_batch: int, num_stages: int, num_micro_batches: int) -> int:
    """Tag of a point-to-point message, identical on sender and receiver."""
    direction = 0 if kind in (ActionKind.SEND_F, ActionKind.RECV_F) else 1
    return ((pipe * num_stages + sender_stage) * num_micro_batches + micro_batch) * 2 + direction


def sender_stage(a: Action) -> int:
    if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
        return a.stage
    return a.stage - 1 if a.kind == ActionKind.RECV_F else a.stage + 1


def action_tag(a: Action, schedule: Schedule) -> int:
    """The tag of SEND/RECV action ``a`` of ``schedule`` (:func:`message_tag`)."""
    return message_tag(a.kind, a.pipe, sender_stage(a), a.micro_batch, schedule.num_stages, schedule.num_micro_batches)


def post_recv(a: Action, comm: CommSpec, schedule: Schedule, src: int | None = None) -> tuple[torch.Tensor, dist.Work]:
    """Post the receive of RECV action ``a``: the buffer its data lands in and the pending work.

    ``src``: the sender's process rank when it is not the schedule's worker ``a.peer`` (under tp)."""
    src = a.peer if src is None else src
    buf = torch.empty(comm.shape, dtype=comm.dtype, device=comm.device)
    if comm.ablate:  # receive one byte, compute on zeros of the real shape
        return buf.zero_(), dist.irecv(torch.empty(1, dtype=torch.uint8, device=comm.device),
                                       src=src, tag=action_tag(a, schedule))
    return buf, dist.irecv(buf, src=src, tag=action_tag(a, schedule))


@dataclass(frozen=True)
class CommSpec:
    """Shape and dtype of every activation message (and its gradient).

    ``ablate``: communication ablation (``comm_ablation=true``): every activation, activation
    gradient and gradient all-reduce becomes a 1-byte message, and receivers compute on zeros of
    the right shape, so a step's time splits into compute and communication. The loss and the
    parameters are then meaningless.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    ablate: bool = False

    def message(self, tensor: torch.Tensor) -> torch.Tensor:
        """What actually travels for ``tensor``: itself, or one byte under ablation."""
        return torch.zeros(1, dtype=torch.uint8, device=self.device) if self.ablate else tensor


@dataclass
class StepResult:
    """What one worker measured in one step."""

    loss_sum: torch.Tensor  # [2] sum of (mlm, nsp) losses of the micro-batches whose last stage is here
    num_losses: int  # how many micro-batch losses are in loss_sum
    events: list[Event] = field(default_factory=list)


@dataclass
class _StepState:
    """What one step of one worker holds between its actions; tensors keyed by (pipe, stage, micro-batch)."""

    step: int
    get_batch: Callable[[int], dict[str, torch.Tensor]]
    loss_sum: torch.Tensor  # [2] sum of (mlm, nsp) losses of the micro-batches whose heads are here
    num_losses: int = 0
    recvs: dict[Action, tuple[torch.Tensor, dist.Work]] = field(default_factory=dict)  # posted, not yet waited for
    received: dict[tuple[ActionKind, int, int, int], torch.Tensor] = field(default_factory=dict)  # keyed by kind too
    inputs: dict[tuple[int, int, int], torch.Tensor | None] = field(default_factory=dict)  # a forward's input
    outputs: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)  # until its backward
    grad_in: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)  # input gradients to send
    deferred: dict[tuple[int, int, int], WeightGradStore] = field(default_factory=dict)  # an I's, until its W
    batches: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # micro-batch -> batch
    sends: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    syncs: dict[StageKey, FlatAllReduce] = field(default_factory=dict)
    grad_norm: torch.Tensor | None = None  # from STEP's wait


class WorkerExecutor:
    """Runs one worker's actions of a :class:`Schedule` step by step.

    Args:
        schedule: the checked schedule (with communication, SYNC_GRAD and STEP actions), or the k
            phases of a K-FAC refresh cycle (step t runs phase t mod k).
        rank: this worker's index in the schedule (its global rank).
        modules: this worker's stage replicas, keyed by (pipe, stage). A stage holding the heads
            returns the ``[mlm, nsp]`` losses; others return the hidden state.
        comm: shape/dtype of activation messages.
        grad_groups: process group of each stage's replicas (None when the stage has one replica).
        tied: ``(params, group)``: this worker's local copies of the tied weight and the group of all
            holders of the first or last stage; None when no tied weight crosses workers.
        grad_norm: called at STEP after all gradients are synchronized: the global gradient norm
            (a collective over all workers).
        optimizer_step: then called with that norm to update the parameters (with per-stage steps:
            to confirm or redo them and step the rest, ``runtime.stage_steps``).
        stage_step: called with (pipe, stage) at a stage STEP (``schedules.passes.per_stage_steps``),
            after that replica's gradient all-reduce; None: the schedule has no stage STEPs.
        loss_scale: factor applied to each micro-batch loss before backward (1 / (N · W)).
        autocast: context factory wrapped around each forward.
        kfac: performs the K-FAC actions (None: the schedule has none).
        cuda_timing: on CUDA, ``events`` (CUDA events read at the end of the step; training) or
            ``sync`` (a stream synchronization after each action; profiles); see
            ``pipefisher.runtime.step_clock`` [Note: timing on a GPU]. Ignored on CPU.
        sdp: the FSDP2-sharded stage replicas (``sdp`` > 1; ``runtime.sharding``): gathered at step
            start or before each F/B (recorded as waits), reduce-scattered at SYNC_GRAD.
        tp: the tensor-parallel degree: process ``rank`` runs schedule worker ``rank // tp`` and
            exchanges activations with the same tp index of its peers ([Note: tp inside the
            pipeline], ``runtime.tensor_parallel``); events carry the process rank.
    """

    def __init__(
        self,
        schedule: Schedule | Sequence[Schedule],
        rank: int,
        modules: dict[StageKey, nn.Module],
        comm: CommSpec,
        grad_groups: dict[int, dist.ProcessGroup | None],
        tied: tuple[list[nn.Parameter], dist.ProcessGroup] | None,
        grad_norm: Callable[[], torch.Tensor],
        optimizer_step: Callable[[torch.Tensor], None],
        loss_scale: float,
        autocast: Callable[[], object],
        kfac: KfacWork | None = None,
        cuda_timing: str = "events",
        sdp: ShardedStages | None = None,
        tp: int = 1,
        stage_step: Callable[[StageKey], None] | None = None,
    ) -> None:
        self.clock = StepClock(cuda_timing if comm.device.type == "cuda" else "cpu")
        self.phases: list[Schedule] = [schedule] if isinstance(schedule, Schedule) else list(schedule)
        self.schedule = self.phases[0]
        self.rank = rank
        self.tp = tp
        self.worker = rank // tp  # this process's worker in the schedule
        self.kfac = kfac
        self.modules = modules
        self.comm = comm
        self.grad_groups = grad_groups
        self.tied = tied
        self.grad_norm = grad_norm
        self.optimizer_step = optimizer_step
        self.stage_step = stage_step
        self.loss_scale = loss_scale
        self.autocast = autocast
        self.sdp = sdp
        self.eager_recv = dist.get_backend() != "nccl"
        # This replica's micro-batch j is number offset + j of the global batch: [Note: dropout].
        self.micro_batch_offset = self.schedule.placement.dp_group_of(self.worker) * self.schedule.num_micro_batches
        tied_ids = {id(p) for p in tied[0]} if tied else set()
        # Parameters all-reduced at SYNC_GRAD, per local stage replica (tied weight excluded).
        self._sync_params = {
            key: [p for p in m.parameters() if p.requires_grad and id(p) not in tied_ids]
            for key, m in modules.items()
        }
        K = ActionKind
        self._handlers: dict[ActionKind, Callable[[Action, _StepState], None]] = {
            K.RECV_F: self._receive, K.RECV_B: self._receive, K.FORWARD: self._forward, K.SEND_F: self._send,
            K.BACKWARD: self._backward, K.BACKWARD_INPUT: self._backward, K.BACKWARD_WEIGHT: self._weight_gradients,
            K.SEND_B: self._send, K.SYNC_GRAD: self._sync_grad, K.STEP: self._step,
            **{kind: self._kfac_unit for kind in ActionKind if kind.is_kfac},
        }
        # Zero-bubble schedules split backwards into I and W ([Note: deferred weight gradients]); a
        # full B accumulates weight gradients as W does ([Note: a full backward accumulates in place]).
        enable_split_backward(modules.values())

    # -- communication -------------------------------------------------------------------------

    def _peer(self, a: Action) -> int:
        """The process rank of ``a``'s peer: the same tp index of the peer worker."""
        return a.peer * self.tp + self.rank % self.tp

    # -- the step ------------------------------------------------------------------------------

    def run_step(self, step: int, get_batch: Callable[[int], dict[str, torch.Tensor]]) -> StepResult:
        """Execute this worker's actions for one step.

        Args:
            step: the step index (recorded in events).
            get_batch: micro-batch index → batch (on the right device); every stage of a
                micro-batch gets the same batch.
        """
        clock = self.clock
        clock.start_step()
        cuda = self.comm.device.type == "cuda"
        phase = step % len(self.phases)
        actions = self.phases[phase].actions[self.worker]
        if self.kfac is not None:
            self.kfac.begin_step(actions, phase, step)
        st = _StepState(step, get_batch, torch.zeros(2, device=self.comm.device))
        if self.eager_recv:
            st.recvs = {a: post_recv(a, self.comm, self.schedule, self._peer(a)) for a in actions
                        if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B)}
        marks: list[tuple[str, str, object, object]] = []  # (name, kind, start, end): Events after the step
        if self.sdp is not None:  # FSDP's all-gathers are waits: [Note: sdp inside the pipeline]
            start = clock.mark()
            if self.sdp.begin_step():
                first = next((a for a in actions if a.kind.is_compute), actions[0])
                marks.append((str(first), ActionKind.SYNC_GRAD.value, start, clock.mark(settle=True)))
        for a in actions:
            start = clock.mark()
            k = a.kind
            if self.sdp is not None and k.is_compute and k != ActionKind.BACKWARD_WEIGHT \
                    and self.sdp.gather_for((a.pipe, a.stage)):
                start, waited_until = clock.mark(settle=True), start
                marks.append((str(a), ActionKind.SYNC_GRAD.value, waited_until, start))
            if k in _WAITS_FOR:  # the wait first, as an event of its own: [Note: waits are not compute]
                collective = _WAITS_FOR[k].value
                with self._nvtx(collective if cuda else None):
                    waited, st.grad_norm = self._wait_for_collectives(a, st.syncs, st.sends)
                if waited:
                    start, waited_until = clock.mark(settle=True), start
                    marks.append((str(a), collective, waited_until, start))
            if cuda:  # the same names in an nsys capture as in our timeline
                torch.cuda.nvtx.range_push(str(a))
            handler = self._handlers.get(k)
            if handler is None:  # pragma: no cover - kinds added to the IR must be handled here
                raise NotImplementedError(f"executor has no handler for {a}")
            handler(a, st)
            # A compute's, a unit's, STEP's or a receive's GPU time is its own: [Note: timing on a GPU].
            end = clock.mark(settle=k.is_compute or k.is_kfac or k in (ActionKind.STEP, ActionKind.RECV_F,
                                                                     ActionKind.RECV_B))
            if cuda:
                torch.cuda.nvtx.range_pop()
            marks.append((str(a), k.value, start, end))

        for work, _ in st.sends:
            work.wait()
        if self.kfac is not None:
            self.kfac.end_step()
        clock.finish()
        events = [Event(self.rank, name, kind, clock.ns(s0), clock.ns(s1), step) for name, kind, s0, s1 in marks]
        assert not st.outputs and not st.received and not st.deferred, \
            f"worker {self.rank}: step {step} left work behind"
        return StepResult(loss_sum=st.loss_sum, num_losses=st.num_losses, events=events)

    # -- one handler per action kind (self._handlers) -------------------------------------------

    def _receive(self, a: Action, st: _StepState) -> None:
        buf, work = st.recvs.pop(a) if a in st.recvs else post_recv(a, self.comm, self.schedule, self._peer(a))
        work.wait()
        st.received[(a.kind, a.pipe, a.stage, a.micro_batch)] = buf

    def _forward(self, a: Action, st: _StepState) -> None:
        key = (a.pipe, a.stage, a.micro_batch)
        module = self.modules[(a.pipe, a.stage)]
        x = st.received.pop((ActionKind.RECV_F, *key), None)
        if x is None and (a.pipe, a.stage - 1) in self.modules:  # the previous stage is here (zb-v's turn)
            x = st.outputs[(a.pipe, a.stage - 1, a.micro_batch)].detach()
        if x is not None:
            x.requires_grad_(True)
        if a.micro_batch not in st.batches:
            st.batches[a.micro_batch] = st.get_batch(a.micro_batch)
        with self.autocast(), self._capture(a), dropout_key(st.step, self.micro_batch_offset + a.micro_batch):
            y = module(x, st.batches[a.micro_batch])
        st.inputs[key] = x
        st.outputs[key] = y
        if y.dim() == 1:  # the heads' [mlm, nsp] losses
            st.loss_sum += y.detach().float()
            st.num_losses += 1

    def _send(self, a: Action, st: _StepState) -> None:
        key = (a.pipe, a.stage, a.micro_batch)
        tensor = st.outputs[key].detach() if a.kind == ActionKind.SEND_F else st.grad_in.pop(key)
        message = self.comm.message(tensor)
        st.sends.append((dist.isend(message, dst=self._peer(a), tag=action_tag(a, self.schedule)), message))

    def _backward(self, a: Action, st: _StepState) -> None:
        """B, or a split backward's I (weight gradients deferred to W: [Note: split backward])."""
        key = (a.pipe, a.stage, a.micro_batch)
        y = st.outputs.pop(key)
        split = deferring(st.deferred.setdefault(key, [])) if a.kind == ActionKind.BACKWARD_INPUT \
            else accumulating()
        with split:
            if y.dim() == 1:
                (y.float().sum() * self.loss_scale).backward()
            else:
                g = st.received.pop((ActionKind.RECV_B, *key), None)
                if g is None:  # the next stage is on this worker: its input gradient
                    g = st.grad_in.pop((a.pipe, a.stage + 1, a.micro_batch))
                torch.autograd.backward(y, g)
        x = st.inputs.pop(key)
        if x is not None:
            st.grad_in[key] = x.grad
        if not any(m == a.micro_batch for (_, _, m) in st.outputs):
            st.batches.pop(a.micro_batch, None)

    def _weight_gradients(self, a: Action, st: _StepState) -> None:
        apply_weight_grads(st.deferred.pop((a.pipe, a.stage, a.micro_batch)))

    def _sync_grad(self, a: Action, st: _StepState) -> None:
        if self.sdp is not None:  # the reduce-scatter over the sdp group, then the rest over data_parallel
            self.sdp.reduce((a.pipe, a.stage))
        group = self.grad_groups.get(a.stage)
        if group is None:
            return
        if self.comm.ablate:  # nothing is copied back
            st.syncs[(a.pipe, a.stage)] = FlatAllReduce.start_message(self.comm.message(None), group)
        else:
            grads = [_grad(p) for p in self._sync_params[(a.pipe, a.stage)]]
            st.syncs[(a.pipe, a.stage)] = FlatAllReduce.start(grads, group)

    def _kfac_unit(self, a: Action, st: _StepState) -> None:
        self.kfac.run(a)  # PRECOND and INVERT find their all-reduces done (waited for in run_step)

    def _step(self, a: Action, st: _StepState) -> None:
        if a.stage is None:
            self.optimizer_step(st.grad_norm)
        elif self.stage_step is None:  # pragma: no cover - the worker passes one with such a schedule
            raise ValueError(f"{a}: a stage STEP needs WorkerExecutor(stage_step=...)")
        else:
            self.stage_step((a.pipe, a.stage))

    def _capture(self, a: Action):
        return self.kfac.forward((a.pipe, a.stage), a.micro_batch) if self.kfac is not None else contextlib.nullcontext()

    @staticmethod
    def _nvtx(name: str | None):
        """An NVTX range called ``name`` around a block (no range when None)."""
        if name is None:
            return contextlib.nullcontext()
        return torch.cuda.nvtx.range(name)

    def _wait_for_collectives(self, a: Action, syncs: dict[StageKey, FlatAllReduce],
                              sends: list[tuple[dist.Work, torch.Tensor]]) -> tuple[bool, torch.Tensor | None]:
        """Wait for what PRECOND, INVERT or STEP ``a`` consumes from collectives ([Note: waits are
        not compute]).

        Returns:
            Whether anything was in flight, and for STEP the global gradient norm (a collective
            too, over all workers), else None.
        """
        if a.kind == ActionKind.PRECOND:
            return self._finish_grad_sync(syncs, (a.pipe, a.stage)), None  # this replica's gradients
        if a.kind == ActionKind.STEP and a.stage is not None:  # and its preconditioned ones from their owners
            waited = self._finish_grad_sync(syncs, (a.pipe, a.stage))
            return (self.kfac is not None and self.kfac.finish_exchanges((a.pipe, a.stage))) or waited, None
        if a.kind == ActionKind.INVERT:
            return self.kfac.wait_for_syncs(a), None
        for work, _ in sends:
            work.wait()
        sends.clear()
        self._finish_grad_sync(syncs)
        if self.kfac is not None:  # kfac_owners=replicas: [Note: K-FAC owners among replicas]
            self.kfac.finish_exchanges()
        return True, self.grad_norm()

    def _finish_grad_sync(self, syncs: dict[StageKey, FlatAllReduce],
                          key: StageKey | None = None) -> bool:
        """Wait for the pending gradient all-reduces (of one stage replica, or all) and copy back;
        after all of them, sum the tied weight's gradient over its holders.

        Returns:
            Whether an all-reduce was in flight.
        """
        waited = False
        for k in [key] if key is not None else list(syncs):
            if k in syncs:
                syncs.pop(k).finish()
                waited = True
        if key is not None:
            return waited
        return self.reduce_tied_grads() or waited

    def reduce_tied_grads(self) -> bool:
        """Give every local copy of the tied weight the sum of all holders' gradients ([Note: gradient
        synchronization]): this worker's copies summed into the first in place (no [V, H] temporaries:
        fresh pages on a CPU; one copy where the worker holds one), all-reduced over the holders, copied
        back. Also for other runtimes on these stages (``bench/``).

        Returns:
            Whether there was a tied weight to reduce.
        """
        if self.tied is None:
            return False
        params, group = self.tied
        if self.comm.ablate:
            dist.all_reduce(self.comm.message(None), group=group)
            return True
        total = _grad(params[0])
        for p in params[1:]:
            total.add_(_grad(p))
        dist.all_reduce(total, group=group)
        for p in params[1:]:
            _grad(p).copy_(total)
        return True


def _grad(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient (its local shard under sdp), created as zeros where this step did not reach
    ``p``: it still takes part in the all-reduce."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return local(p.grad)
