"""The schedule IR: immutable actions and per-worker ordered action lists.

A schedule holds *order* only; time belongs to the simulator (``pipefisher.simulate``) and to the
executor's timeline. Nothing here imports torch.

String form of an action (parses back with :meth:`Action.from_str`)::

    {stage}{KIND}{micro_batch}[@{pipe}][{>|<}{peer}][#{layer}]

    0F2        stage 0, forward, micro-batch 2 (pipe 0: the "down" pipeline)
    3B5@1      stage 3, backward, micro-batch 5, on pipe 1 (Chimera's "up" pipeline)
    1I4        stage 1, split backward: input gradient of micro-batch 4 (zero-bubble schedules)
    1W4        stage 1, split backward: the weight gradients of micro-batch 4, deferred
    1SEND_F2>2 stage 1 sends the activation of micro-batch 2 to worker 2
    2RECV_F2<1 stage 2 receives that activation from worker 1
    1SYNC_GRAD stage 1 all-reduces its gradients with its replicas (no micro-batch)
    STEP       optimizer step of every stage the worker holds (stage omitted); with per-stage
               steps (passes.per_stage_steps) what is left: the tied weight, the norm's check
    1STEP@1    per-stage optimizer step of stage 1 of pipe 1 (optimizer_placement=per_stage)
    1CURV_A3#2 K-FAC: A factor of the stage's Linear layer 2 from micro-batch 3
    2INVERT#0  K-FAC: damped inverses of both factors of stage 2's layer 0
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["ActionKind", "Action", "Placement", "Schedule"]


class ActionKind(str, Enum):
    """What an action does. ``SEND_*``/``RECV_*`` carry the peer worker."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients
    # Split backward (Zero Bubble, Qi et al. 2024; DESIGN.md "Split backward"). The paper calls the
    # input-gradient pass B; here B stays the full backward and the split halves take torch's
    # names: I computes the input gradient (on the critical path; it sends the activation
    # gradient upstream), W the deferred weight gradients of the same micro-batch, any time after
    # its I. I followed by W of the same micro-batch equals one B.
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"  # send an activation downstream (along the pipe's direction)
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # send an activation gradient upstream
    RECV_B = "RECV_B"
    SYNC_GRAD = "SYNC_GRAD"  # all-reduce a stage's gradients over its replicas (twin / data parallel)
    STEP = "STEP"  # optimizer step (of one stage replica when it has a stage: passes.per_stage_steps)
    # K-FAC work units (DESIGN.md, "K-FAC"); ``layer`` picks one Linear layer of the stage, or
    # None for all of them.
    CURV_A = "CURV_A"  # accumulate A = E[x xᵀ] from a micro-batch's captured inputs (after its F)
    CURV_B = "CURV_B"  # accumulate B = E[g gᵀ] from a micro-batch's output gradients (after its B)
    SYNC_FACTOR = "SYNC_FACTOR"  # all-reduce a stage's factors over its replicas, then average
    INVERT = "INVERT"  # damped inverses of both factors of a layer (one unit: damping needs both)
    PRECOND = "PRECOND"  # replace a stage's gradients by the preconditioned ones (before STEP)

    def __str__(self) -> str:
        return self.value

    @property
    def is_comm(self) -> bool:
        return self in _COMM

    @property
    def is_compute(self) -> bool:
        """Forward or (full or split) backward of a micro-batch: F, B, I or W."""
        return self in _COMPUTE

    @property
    def is_input_backward(self) -> bool:
        """The backward that produces the input gradient: B (full) or I (split). It consumes the
        ``RECV_B`` of its micro-batch and feeds the ``SEND_B``."""
        return self in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)

    @property
    def is_kfac(self) -> bool:
        """A K-FAC work unit."""
        return self in _KFAC


_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT,
                      ActionKind.BACKWARD_WEIGHT})
_COMM = frozenset({ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B})
_KFAC = frozenset({ActionKind.CURV_A, ActionKind.CURV_B, ActionKind.SYNC_FACTOR, ActionKind.INVERT,
                   ActionKind.PRECOND})
_NEEDS_MICRO_BATCH = _COMPUTE | {ActionKind.CURV_A, ActionKind.CURV_B}  # besides the sends and receives
_NEEDS_STAGE = frozenset({ActionKind.SYNC_FACTOR, ActionKind.INVERT, ActionKind.PRECOND})
# Longest names first so "SEND_F" is not read as "S" + ... and "F" does not shadow "SEND_F".
_KIND_ALTERNATIVES = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_ACTION_RE = re.compile(
    rf"^(?P<stage>\d+)?(?P<kind>{_KIND_ALTERNATIVES})(?P<mb>\d+)?(?:@(?P<pipe>\d+))?"
    rf"(?:(?P<dir>[<>])(?P<peer>\d+))?(?:#(?P<layer>\d+))?$"
)


@dataclass(frozen=True, order=True)
class Action:
    """One entry of a worker's ordered action list.

    Attributes:
        kind: what to do.
        stage: pipeline stage index in [0, D) the action works on (None for the worker's final
            ``STEP``; a stage ``STEP`` steps that stage replica alone).
        micro_batch: micro-batch index in [0, N) within the worker's data-parallel group, or None.
        pipe: which pipeline of the worker's group the stage belongs to (0 = down; Chimera's up
            pipeline is 1). Data flows from stage s to s+1 in every pipe; only the placement of
            stages on workers differs.
        peer: the other worker of a send/receive, else None.
        layer: for K-FAC units, the index of one Linear layer in the stage's K-FAC layer list
            (None: all of the stage's layers); None for every other kind.
    """

    kind: ActionKind
    stage: int | None = None
    micro_batch: int | None = None
    pipe: int = 0
    peer: int | None = None
    layer: int | None = None

    def __post_init__(self) -> None:
        # The planner and the simulator make millions of actions: one set lookup per rule (ActionKind's
        # properties are the same sets).
        kind = self.kind
        comm = kind in _COMM
        if comm and self.peer is None:
            raise ValueError(f"{kind} needs a peer worker")
        if not comm and self.peer is not None:
            raise ValueError(f"{kind} takes no peer")
        if (comm or kind in _NEEDS_MICRO_BATCH) and (self.stage is None or self.micro_batch is None):
            raise ValueError(f"{kind} needs a stage and a micro-batch")
        if self.layer is not None and kind not in _KFAC:
            raise ValueError(f"{kind} takes no layer")
        if kind in _NEEDS_STAGE and self.stage is None:
            raise ValueError(f"{kind} needs a stage")

    def __str__(self) -> str:
        s = "" if self.stage is None else str(self.stage)
        s += self.kind.value
        if self.micro_batch is not None:
            s += str(self.micro_batch)
        if self.pipe:
            s += f"@{self.pipe}"
        if self.peer is not None:
            s += (">" if self.kind in (ActionKind.SEND_F, ActionKind.SEND_B) else "<") + str(self.peer)
        if self.layer is not None:
            s += f"#{self.layer}"
        return s

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse the string form produced by ``str(action)``."""
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '0F2', '3B5@1', '1SEND_F2>2'")
        kind = ActionKind(m["kind"])
        return cls(
            kind=kind,
            stage=None if m["stage"] is None else int(m["stage"]),
            micro_batch=None if m["mb"] is None else int(m["mb"]),
            pipe=0 if m["pipe"] is None else int(m["pipe"]),
            peer=None if m["peer"] is None else int(m["peer"]),
            layer=None if m["layer"] is None else int(m["layer"]),
        )


@dataclass(frozen=True)
class Placement:
    """Where each stage replica lives.

    ``workers[(dp, pipe, stage)] = worker`` for data-parallel group ``dp`` in [0, W), pipe in
    [0, num_pipes) and stage in [0, D). GPipe/1F1B have one pipe; Chimera has two (down, up).
    """

    num_stages: int
    num_pipes: int
    dp_width: int
    workers: dict[tuple[int, int, int], int] = field(hash=False)

    @property
    def num_workers(self) -> int:
        return len(set(self.workers.values()))

    def worker_of(self, dp: int, pipe: int, stage: int) -> int:
        return self.workers[(dp, pipe, stage)]

    def stages_of(self, worker: int) -> list[tuple[int, int, int]]:
        """The (dp, pipe, stage) replicas held by ``worker``, sorted."""
        return sorted(k for k, w in self.workers.items() if w == worker)

    def replicas_of_stage(self, stage: int) -> list[int]:
        """All workers holding a replica of ``stage`` (twins and data-parallel copies), sorted."""
        return sorted({w for (_, _, s), w in self.workers.items() if s == stage})

    def dp_group_of(self, worker: int) -> int:
        """The data-parallel group index of ``worker``."""
        return self.stages_of(worker)[0][0]


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline schedule for one training step.

    Attributes:
        method: generator name (``"gpipe"``, ``"1f1b"``, ``"chimera"``, ``"interleaved"``).
        num_stages: D, the number of pipeline stages.
        num_micro_batches: N, micro-batches per step per data-parallel group.
        placement: which worker holds which stage replica.
        actions: per-worker ordered action lists, keyed by worker index in [0, num_workers).
        pipe_of_micro_batch: for each micro-batch j in [0, N), the pipe that carries it.
    """

    method: str
    num_stages: int
    num_micro_batches: int
    placement: Placement
    actions: dict[int, tuple[Action, ...]] = field(hash=False)
    pipe_of_micro_batch: tuple[int, ...] = ()

    @property
    def num_workers(self) -> int:
        return len(self.actions)

    @property
    def dp_width(self) -> int:
        return self.placement.dp_width

    def format_grid(self, mark: tuple[int, int] | None = None, compute_only: bool = True) -> str:
        """Step × worker grid of action strings; ``mark=(worker, index)`` brackets one cell."""
        cols = []
        for w in range(self.num_workers):
            acts = list(enumerate(self.actions[w]))
            if compute_only:
                acts = [(i, a) for i, a in acts if a.kind.is_compute or (mark and (w, i) == mark)]
            cells = [f"[{a}]" if mark is not None and (w, i) == mark else str(a) for i, a in acts]
            cols.append(cells)
        width = max([len(c) for col in cols for c in col] + [6])
        rows = ["step " + " ".join(f"W{w}".ljust(width) for w in range(self.num_workers))]
        for r in range(max((len(c) for c in cols), default=0)):
            cells = [(col[r] if r < len(col) else "").ljust(width) for col in cols]
            rows.append(f"{r:>4} " + " ".join(cells))
        return "\n".join(rows)
