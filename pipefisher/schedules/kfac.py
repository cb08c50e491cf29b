"""K-FAC work in the schedule IR: refresh-cycle assignments, their checks, and their JSON form.

Why one module: the :class:`Assignment` type, its checks and its JSON form define one file format: the reader
checks what it reads with the same checks, and the writer writes only what they accept.

An :class:`Assignment` says which K-FAC work units (``CURV_A``, ``CURV_B``, ``SYNC_FACTOR``,
``INVERT``, ``PRECOND``; see ``pipefisher.schedules.ir``) each worker runs, where in its action
list, over a refresh cycle of k steps: step t runs ``phases[t % k]``, a complete schedule (the
pipeline's own actions plus K-FAC units). Two producers:

- :func:`critical_path_assignment` (``optimizer=kfac``): all of a refresh after the flush of
  phase 0, on the critical path;
- ``pipefisher.planning.plan_pipefisher`` (``optimizer=pipefisher``): the units in the bubbles.

The runtime executes the phases; ``schedule.py`` writes them with :func:`assignment_to_json` and
``train.py optimizer=pipefisher optimizer.schedule=<file>`` reads them with
:func:`assignment_from_json`. Nothing here imports torch.

[Note: refresh cycle]
Over one cycle, for every stage replica (dp, pipe, stage) and each of its K-FAC layers l::

    CURV_A(mb)/CURV_B(mb) for every micro-batch mb of the replica's pipe, all in ONE phase p_c
        (a capture lives within one step: the forward and backward that fill it)
    SYNC_FACTOR(l) once, in a phase >= p_c (after the curvature when in p_c); every replica of the
        stage issues it in the same phase (a collective; same members as SYNC_GRAD)
    INVERT(l) once, in a phase >= that of its SYNC_FACTOR (after it when in the same phase)

With ``factor_interval`` f < k (``optimizer=kfac``: factors every f steps, inverses every k, a
multiple of f; kfac-pytorch's ``factor_update_steps`` / ``inv_update_steps``) a cycle holds k / f
factor refreshes: the curvature of refresh i in one phase, its SYNC_FACTOR after it and before the
curvature of refresh i + 1; the INVERT after at least one SYNC_FACTOR inverts the factors as they
stand then (the running average up to the latest refresh synced before it).

and in every phase one PRECOND per stage replica after its SYNC_GRAD and before STEP.
``deferred=False`` (the kfac baseline) uses an inverse as soon as it exists, so each INVERT must
precede its replica's PRECOND in its phase (staleness 0 at refresh steps); ``deferred=True``
(PipeFisher) uses the inverses computed during cycle c from cycle c+1 on, so INVERT may follow
PRECOND and steps use inverses up to 2k-1 steps old. In the first cycle of a deferred run there
are no inverses yet: the runtime steps with the plain gradient until a layer's first inversion,
whose inverses it uses from the next step on (there is nothing older to keep).

[Note: promoting deferred inverses]
``optimizer.promote_inverses`` says when deferred inverses are put in use (a runtime rule, not
part of the plan). ``at_cycle_end`` (PipeFisher's): from the first step of the next cycle, so a
layer whose curvature runs in phase p_c is preconditioned with curvature up to 2k − 1 − p_c steps
old. ``when_ready``: from the step after its INVERT ran (phase p_i), up to k + p_i − p_c steps old:
k when the INVERT runs in the curvature's step, never more than ``at_cycle_end``. Fresh inverses
(``deferred=False``) are used by the PRECOND after the INVERT: up to k − 1 + p_i − p_c.
:func:`curvature_age_bound` gives the exact bound of an assignment, the maximum over its layers.

[Note: K-FAC layers of a stage]
A stage's K-FAC layers are its encoder Linear layers in order: for each encoder layer it holds,
``LINEAR_NAMES`` (query, key, value, attention output, intermediate, output), with (in, out)
dims (H, H) ×4, (H, 4H), (4H, H). ``#l`` in an action names the l-th of them; no ``#`` means all.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from pipefisher.atomic import write_text_atomic
from pipefisher.schedules.checks import ScheduleError, check_schedule
from pipefisher.schedules.generators import get_generator
from pipefisher.schedules.ir import Action, ActionKind, Schedule
from pipefisher.schedules.v_schedules import V_METHODS

__all__ = [
    "ASSIGNMENT_FORMAT",
    "LINEAR_NAMES",
    "LINEARS_PER_ENCODER_LAYER",
    "Assignment",
    "assignment_from_dict",
    "assignment_from_json",
    "assignment_to_dict",
    "assignment_to_json",
    "PROMOTE_INVERSES",
    "check_assignment",
    "critical_path_assignment",
    "curvature_age_bound",
    "curvature_ages",
    "refresh_micro_batches",
    "kfac_layer_counts",
    "require_plain_schedule",
    "strip_kfac",
    "with_preconditioning",
]

K = ActionKind

ASSIGNMENT_FORMAT = "pipefisher-assignment/1"
LINEAR_NAMES: tuple[str, ...] = ("attention.self.query", "attention.self.key", "attention.self.value",
                                 "attention.output.dense", "intermediate.dense", "output.dense")
LINEARS_PER_ENCODER_LAYER = len(LINEAR_NAMES)
#: When deferred inverses are put in use ([Note: promoting deferred inverses]).
PROMOTE_INVERSES: tuple[str, ...] = ("at_cycle_end", "when_ready")


@dataclass(frozen=True)
class Assignment:
    """K-FAC work over a refresh cycle of ``interval`` steps: step t runs ``phases[t % interval]``.

    Attributes:
        interval: k, steps per refresh cycle.
        phases: ``len == interval``; each a complete checked schedule (base + K-FAC actions).
        deferred: True: inverses computed during cycle c are used from cycle c+1 on (PipeFisher);
            False: used as soon as computed (kfac baseline, staleness 0 at refresh steps).
        kfac_layers: K-FAC layers per stage (``len == num_stages``); empty: inferred from the
            phases (highest layer index + 1 per stage).
        metadata: free-form JSON-able facts (predicted utilization, costs, ...), kept in the JSON.
        curvature_micro_batches: a refresh's curvature comes from the first n micro-batches of
            each pipe (0: all of them); see [Note: curvature from part of the batch].
        factor_interval: f, steps between factor refreshes, dividing ``interval`` (the inversion
            interval); 0: one factor refresh per cycle (f = k). See [Note: refresh cycle].
    """

    interval: int
    phases: tuple[Schedule, ...]
    deferred: bool
    kfac_layers: tuple[int, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    curvature_micro_batches: int = 0
    factor_interval: int = 0

    @property
    def factor_every(self) -> int:
        """Steps between factor refreshes (``factor_interval``, or ``interval`` when 0)."""
        return self.factor_interval or self.interval

    @property
    def refreshes_per_cycle(self) -> int:
        """Factor refreshes per cycle: ``interval // factor_every``."""
        return self.interval // self.factor_every

    def __post_init__(self) -> None:
        object.__setattr__(self, "phases", tuple(self.phases))
        if not self.kfac_layers and self.phases:
            object.__setattr__(self, "kfac_layers", _infer_layers(self.phases))
        object.__setattr__(self, "kfac_layers", tuple(self.kfac_layers))

    @property
    def schedule(self) -> Schedule:
        """The pipeline's own schedule (phase 0 without K-FAC units)."""
        return strip_kfac(self.phases[0])

    def phase_of_step(self, step: int) -> Schedule:
        """The schedule step ``step`` runs."""
        return self.phases[step % self.interval]

    def capture_layers(self, phase: int, worker: int) -> dict[tuple[int, int], tuple[int, ...]]:
        """Layers whose curvature ``worker`` computes in ``phase``: ``{(stage, pipe): layers}``.

        The runtime captures layer inputs and output gradients of exactly these layers in steps
        running that phase (a None-layer unit means all of the stage's layers).
        """
        out: dict[tuple[int, int], set[int]] = defaultdict(set)
        for a in self.phases[phase].actions[worker]:
            if a.kind in (K.CURV_A, K.CURV_B):
                out[(a.stage, a.pipe)].update(_expand(a.layer, self.kfac_layers[a.stage]))
        return {key: tuple(sorted(v)) for key, v in sorted(out.items())}


def _infer_layers(phases: Sequence[Schedule]) -> tuple[int, ...]:
    counts = [0] * phases[0].num_stages
    for phase in phases:
        for acts in phase.actions.values():
            for a in acts:
                if a.kind.is_kfac and a.stage is not None and 0 <= a.stage < len(counts):
                    counts[a.stage] = max(counts[a.stage], 1 if a.layer is None else a.layer + 1)
    return tuple(counts)


def _expand(layer: int | None, count: int) -> range:
    return range(count) if layer is None else range(layer, layer + 1)


def kfac_layer_counts(schedule: Schedule, layers_per_stage: Sequence[int]) -> list[int]:
    """K-FAC layers of each stage: 6 Linear layers per encoder layer it holds.

    Args:
        schedule: the pipeline schedule (``num_stages`` model stages; D·v for interleaved).
        layers_per_stage: encoder layers per model stage, ``len == schedule.num_stages``.

    Raises:
        ValueError: wrong length or a negative count.
    """
    counts = list(layers_per_stage)
    if len(counts) != schedule.num_stages or any(not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"layers_per_stage={counts}: need {schedule.num_stages} non-negative encoder-layer "
                         f"counts, one per stage of the {schedule.method} schedule")
    return [LINEARS_PER_ENCODER_LAYER * c for c in counts]


def strip_kfac(schedule: Schedule) -> Schedule:
    """``schedule`` without its K-FAC units."""
    return replace(schedule, actions={w: tuple(a for a in acts if not a.kind.is_kfac)
                                      for w, acts in schedule.actions.items()})


def _replicas(schedule: Schedule, worker: int) -> list[tuple[int, int]]:
    """(stage, pipe) of the replicas ``worker`` holds, by stage."""
    return sorted((s, p) for (_, p, s) in schedule.placement.stages_of(worker))


def _micro_batches(schedule: Schedule, pipe: int) -> list[int]:
    return [j for j, p in enumerate(schedule.pipe_of_micro_batch) if p == pipe]


def refresh_micro_batches(schedule: Schedule, pipe: int, count: int = 0) -> list[int]:
    """The micro-batches of ``pipe`` a refresh takes its curvature from: the first ``count`` of
    them (all when ``count`` is 0 or more than the pipe has).

    [Note: curvature from part of the batch]
    Capturing and multiplying out A and B for every token of every micro-batch costs about 2/3 of
    the K-FAC layers' forward + backward (DESIGN.md), more than a step's bubbles hold. K-FAC
    libraries estimate the factors from part of the batch (KAISA, kfac-pytorch); here a refresh
    uses the first n micro-batches of each pipe (``optimizer.curvature_micro_batches``), so the
    curvature work and the captured activations shrink by n/N. The factors are then means over
    those rows (and over the replicas, which all use the same n); the running average over
    refreshes still sees many batches.
    """
    mbs = _micro_batches(schedule, pipe)
    return mbs[:count] if count > 0 else mbs


def require_plain_schedule(schedule: Schedule, kfac_layers: Sequence[int]) -> None:
    """Raise ValueError unless ``schedule`` is complete, has no K-FAC units, and ``kfac_layers``
    gives a count per stage: what the assignment builders start from."""
    if any(a.kind.is_kfac for acts in schedule.actions.values() for a in acts):
        raise ValueError("the schedule already has K-FAC units; pass the pipeline's own schedule "
                         "(build_schedule output, or strip_kfac(...))")
    if any(not acts or acts[-1].kind != K.STEP for acts in schedule.actions.values()):
        raise ValueError("the schedule is not complete (no final STEP); build it with build_schedule")
    if len(kfac_layers) != schedule.num_stages or any(c < 0 for c in kfac_layers):
        raise ValueError(f"kfac_layers={list(kfac_layers)}: need {schedule.num_stages} non-negative "
                         f"counts (kfac_layer_counts gives them)")


def with_preconditioning(schedule: Schedule) -> Schedule:
    """``schedule`` with one PRECOND per stage replica right before each worker's STEP.

    The order of a worker's PRECONDs follows its SYNC_GRADs, so the replica whose all-reduce was
    issued first is preconditioned first.
    """
    actions = {}
    for w, acts in schedule.actions.items():
        order = [(a.stage, a.pipe) for a in acts if a.kind == K.SYNC_GRAD]
        order += [r for r in _replicas(schedule, w) if r not in order]
        pre = [Action(K.PRECOND, s, None, p) for s, p in order]
        actions[w] = acts[:-1] + tuple(pre) + acts[-1:]
    return replace(schedule, actions=actions)


def critical_path_assignment(schedule: Schedule, kfac_layers: Sequence[int], interval: int, *,
                             deferred: bool = False, curvature_micro_batches: int = 0,
                             factor_interval: int = 0) -> Assignment:
    """K-FAC with all of a refresh on the critical path (``optimizer=kfac``).

    Phase 0: the pipeline, then after each worker's flush (its last B and SYNC_GRADs), right
    before STEP: CURV_A and CURV_B of every micro-batch of every replica it holds, layer by layer;
    one SYNC_FACTOR per layer in one global (stage, layer) order, so workers sharing all-reduces
    issue them alike and nothing deadlocks; one INVERT per layer; then PRECOND per replica. Phases
    1..k-1: the pipeline plus PRECOND, and, every ``factor_interval`` phases, the curvature and
    SYNC_FACTORs of phase 0 without its INVERTs (factors more often than inverses).

    Args:
        schedule: a complete schedule without K-FAC units (``build_schedule`` output).
        kfac_layers: K-FAC layers per stage (:func:`kfac_layer_counts`).
        interval: k >= 1, steps per inversion (and per refresh cycle).
        deferred: whether the inverses are first used in the next cycle (see the module notes).
        curvature_micro_batches: curvature from the first n micro-batches of each pipe (0: all);
            see [Note: curvature from part of the batch].
        factor_interval: f, steps per factor refresh, dividing k (0: f = k).

    Returns:
        A checked assignment.

    Raises:
        ValueError: k < 1, or f not a divisor of k.
    """
    require_plain_schedule(schedule, kfac_layers)
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval={interval!r}: the refresh interval is a positive number of steps")
    if not isinstance(factor_interval, int) or factor_interval < 0 or (factor_interval and interval % factor_interval):
        raise ValueError(f"factor_interval={factor_interval!r}: must divide the inverse interval {interval} (0: equal to it)")
    plain = with_preconditioning(schedule)
    refresh, factors_only = _critical_path_refresh(schedule, plain, kfac_layers, curvature_micro_batches)
    every = factor_interval or interval
    phases = tuple(replace(plain, actions=refresh) if p == 0 else replace(plain, actions=factors_only)
                   if p % every == 0 else plain for p in range(interval))
    out = Assignment(interval, phases, deferred, tuple(kfac_layers), metadata={"planner": "critical_path"},
                     curvature_micro_batches=curvature_micro_batches,
                     factor_interval=0 if every == interval else every)
    check_assignment(out)
    return out


def _critical_path_refresh(schedule: Schedule, plain: Schedule, kfac_layers: Sequence[int],
                           curvature_micro_batches: int) -> tuple[dict[int, tuple[Action, ...]], dict[int, tuple[Action, ...]]]:
    """Per worker, ``plain``'s actions with a whole refresh before the first PRECOND: with its
    INVERTs, and without (a factor refresh only)."""
    refresh, factors_only = {}, {}
    for w, acts in plain.actions.items():
        replicas = _replicas(schedule, w)
        curv, syncs, inverts = [], [], []
        for s, p in replicas:
            mbs = refresh_micro_batches(schedule, p, curvature_micro_batches)
            for layer in range(kfac_layers[s]):
                curv += [Action(K.CURV_A, s, j, p, layer=layer) for j in mbs]
                curv += [Action(K.CURV_B, s, j, p, layer=layer) for j in mbs]
                syncs.append(Action(K.SYNC_FACTOR, s, None, p, layer=layer))
                inverts.append(Action(K.INVERT, s, None, p, layer=layer))
        syncs.sort(key=lambda a: (a.stage, a.layer))
        inverts.sort(key=lambda a: (a.stage, a.layer))
        first_precond = next(i for i, a in enumerate(acts) if a.kind == K.PRECOND)
        refresh[w] = acts[:first_precond] + tuple(curv + syncs + inverts) + acts[first_precond:]
        factors_only[w] = acts[:first_precond] + tuple(curv + syncs) + acts[first_precond:]
    return refresh, factors_only


# -- checks ------------------------------------------------------------------------------------


def _fail(a: Assignment, phase: int, message: str, mark: tuple[int, int] | None = None) -> NoReturn:
    s = a.phases[phase]
    raise ScheduleError(f"{s.method} K-FAC assignment (D={s.num_stages}, N={s.num_micro_batches}, "
                        f"interval {a.interval}), phase {phase}: {message}\n{s.format_grid(mark=mark)}")


def check_assignment(a: Assignment, *, exchanges: bool = False) -> None:
    """Check a K-FAC assignment: every phase, and the refresh cycle ([Note: refresh cycle]).

    ``exchanges``: PRECOND starts the owners' exchange (``optimizer.kfac_owners=replicas``), see
    ``check_schedule``.

    Each phase must pass ``check_schedule(phase, kfac=True)`` (K-FAC units after their forward or
    backward on the same worker, syncs after curvature, inversions after syncs, PRECOND once per
    replica after its SYNC_GRAD and before STEP, collectives in one order, no deadlock) and run
    the same pipeline actions as phase 0.

    Raises:
        ScheduleError: the first violation, with the failing phase's grid and cell marked.
    """
    if not isinstance(a.interval, int) or a.interval < 1 or len(a.phases) != a.interval:
        raise ScheduleError(f"assignment interval={a.interval!r} with {len(a.phases)} phases; "
                            f"need interval >= 1 and one phase per step of the cycle")
    if not isinstance(a.factor_interval, int) or a.factor_interval < 0 or \
            (a.factor_interval and a.interval % a.factor_interval):
        raise ScheduleError(f"assignment factor_interval={a.factor_interval!r} must divide interval={a.interval} "
                            f"(0: one factor refresh per cycle)")
    first = a.phases[0]
    if len(a.kfac_layers) != first.num_stages:
        raise ScheduleError(f"assignment kfac_layers={list(a.kfac_layers)}: need one count per stage "
                            f"({first.num_stages})")
    def pipeline_of(phase: Schedule) -> dict[int, tuple[Action, ...]]:
        """The phase's pipeline actions: no K-FAC units, and no stage STEPs, which follow their
        replica's last unit (``passes.per_stage_steps``) and so sit where each phase's units end."""
        return {w: tuple(x for x in acts if not (x.kind == K.STEP and x.stage is not None))
                for w, acts in strip_kfac(phase).actions.items()}

    base = pipeline_of(first)
    for p, phase in enumerate(a.phases):
        if (phase.method, phase.num_stages, phase.num_micro_batches, phase.placement,
                phase.pipe_of_micro_batch) != (first.method, first.num_stages, first.num_micro_batches,
                                               first.placement, first.pipe_of_micro_batch):
            _fail(a, p, "the phase is a different pipeline from phase 0 (method, D, N or placement)")
        if pipeline_of(phase) != base:
            w = next(w for w in base if pipeline_of(phase).get(w) != base[w])
            mine = [(i, x) for i, x in enumerate(phase.actions.get(w, ())) if not x.kind.is_kfac]
            i = next((i for (i, x), y in zip(mine, base[w]) if x != y), mine[-1][0] if mine else 0)
            _fail(a, p, f"worker {w} runs different pipeline actions than in phase 0; phases differ "
                        f"only in K-FAC units", (w, i))
        try:
            check_schedule(phase, kfac=True, exchanges=exchanges)
        except ScheduleError as exc:
            raise ScheduleError(f"K-FAC assignment (interval {a.interval}), phase {p}: {exc}") from None
    _check_cycle(a)


def _check_cycle(a: Assignment) -> None:
    first = a.phases[0]
    # (worker, stage, pipe, layer) -> kind -> list of (phase, index, micro-batch)
    units: dict[tuple[int, int, int, int], dict[ActionKind, list[tuple[int, int, int | None]]]] = \
        defaultdict(lambda: defaultdict(list))
    for p, phase in enumerate(a.phases):
        for w, acts in phase.actions.items():
            precond_at = {(x.stage, x.pipe): i for i, x in enumerate(acts) if x.kind == K.PRECOND}
            for i, x in enumerate(acts):
                if not x.kind.is_kfac or x.kind == K.PRECOND:
                    continue
                count = a.kfac_layers[x.stage]
                if x.layer is not None and x.layer >= count:
                    _fail(a, p, f"{x} on worker {w}: stage {x.stage} has {count} K-FAC layers "
                                f"(0..{count - 1})", (w, i))
                if x.kind == K.INVERT and not a.deferred and precond_at.get((x.stage, x.pipe), -1) < i:
                    _fail(a, p, f"{x} on worker {w} comes after the replica's PRECOND; without deferred "
                                f"inverses a refresh is used in the step that computes it", (w, i))
                for layer in _expand(x.layer, count):
                    units[(w, x.stage, x.pipe, layer)][x.kind].append((p, i, x.micro_batch))
    for (dp, pipe, stage), w in sorted(first.placement.workers.items()):
        mbs = refresh_micro_batches(first, pipe, a.curvature_micro_batches)
        for layer in range(a.kfac_layers[stage]):
            got = units.get((w, stage, pipe, layer), {})
            _check_layer_cycle(a, w, got, mbs, f"stage {stage} (pipe {pipe}) layer {layer} on worker {w}")


Unit = tuple[int, int, int | None]  # (phase, index in the worker's list, micro-batch)


def _check_layer_cycle(a: Assignment, w: int, got: Mapping[ActionKind, list[Unit]], mbs: list[int],
                       name: str) -> None:
    """One layer's refreshes over the cycle ([Note: refresh cycle]): ``refreshes_per_cycle``
    curvature phases, each with every refresh micro-batch once; a SYNC_FACTOR after each refresh's
    curvature and before the next one's; one INVERT after a SYNC_FACTOR."""
    r = a.refreshes_per_cycle
    curv = _check_curvature(a, w, got, mbs, name)
    at = [[(p, i) for kind in (K.CURV_A, K.CURV_B) for p, i, _ in got.get(kind, []) if p == q] for q in curv]
    starts, ends = [min(x) for x in at], [max(x) for x in at]  # (phase, index): each refresh's first / last unit
    syncs = sorted((p, i) for p, i, _ in got.get(K.SYNC_FACTOR, []))
    inverts = sorted((p, i) for p, i, _ in got.get(K.INVERT, []))
    last = ends[0] if ends else (0, None)
    for kind, where, wanted in ((K.SYNC_FACTOR, syncs, r), (K.INVERT, inverts, 1)):
        per = "refresh" if kind == K.SYNC_FACTOR else "cycle"
        if len(where) > wanted:
            _fail(a, where[wanted][0], f"{name} has {len(where)} {kind} in the cycle; exactly {wanted} per "
                                       f"{per}", (w, where[wanted][1]))
        if len(where) < wanted:
            after = "its curvature" if kind == K.SYNC_FACTOR else "its SYNC_FACTOR"
            _fail(a, last[0], f"{name} has {'no' if not where else len(where)} {kind} in the cycle; exactly "
                              f"{'one' if wanted == 1 else wanted} per {per}, after {after}",
                  None if last[1] is None else (w, last[1]))
        last = where[-1]
    for j, (p, i) in enumerate(syncs):
        if p < curv[j]:
            _fail(a, p, f"SYNC_FACTOR of {name} runs in phase {p}, before its curvature (phase {curv[j]})", (w, i))
        if j + 1 < r and (p, i) > starts[j + 1]:
            _fail(a, p, f"SYNC_FACTOR of {name} runs after the curvature of the next factor refresh "
                        f"(phase {curv[j + 1]}); each refresh is folded in before the next one's", (w, i))
    p, i = inverts[0]
    if p < syncs[0][0]:
        _fail(a, p, f"INVERT of {name} runs in phase {p}, before its SYNC_FACTOR (phase {syncs[0][0]})", (w, i))


def _check_curvature(a: Assignment, w: int, got: Mapping[ActionKind, list[Unit]], mbs: list[int],
                     name: str) -> list[int]:
    """The phases holding the layer's curvature, checked: ``refreshes_per_cycle`` of them, each
    with CURV_A and CURV_B of every refresh micro-batch once."""
    r = a.refreshes_per_cycle
    per_phase: dict[ActionKind, dict[int, dict[int, int]]] = {}  # kind -> phase -> micro-batch -> index
    for kind in (K.CURV_A, K.CURV_B):
        seen = per_phase.setdefault(kind, defaultdict(dict))
        for p, i, j in got.get(kind, []):
            if j in seen[p]:
                _fail(a, p, f"{kind} of micro-batch {j} for {name} runs twice in phase {p}; once per refresh",
                      (w, i))
            seen[p][j] = i
    phases = sorted({p for kind in per_phase for p in per_phase[kind]})
    if len(phases) > r:
        p = phases[r] if r > 1 else max(phases)
        i = min(i for kind in per_phase for i in per_phase[kind].get(p, {}).values())
        what = "all of a layer's curvature runs in one step" if r == 1 else             f"{r} factor refreshes per cycle (factor_interval={a.factor_every}), each in one step"
        _fail(a, p, f"curvature of {name} is split over phases {phases}; {what} (captures do not outlive a step)",
              (w, i))
    for kind in (K.CURV_A, K.CURV_B):
        for p in phases or [0]:
            seen = per_phase[kind].get(p, {})
            missing = [j for j in mbs if j not in seen]
            if missing:
                _fail(a, p, f"{name} never gets {kind} of micro-batch(es) {missing}; a refresh "
                            f"uses micro-batches {mbs} of the replica's pipe")
            extra = sorted(j for j in seen if j not in mbs)
            if extra:
                _fail(a, p, f"{name} gets {kind} of micro-batch(es) {extra}, outside the refresh's "
                            f"micro-batches {mbs} (curvature_micro_batches={a.curvature_micro_batches})",
                      (w, seen[extra[0]]))
    if len(phases) < r:
        _fail(a, phases[-1] if phases else 0, f"{name} has curvature in {len(phases)} phase(s) of the cycle; factors every "
                             f"{a.factor_every} steps need {r}")
    return phases


def curvature_age_bound(a: Assignment, promote: str = "at_cycle_end") -> int:
    """The oldest curvature any step of a run of ``a`` preconditions with, in steps, once its
    first cycle is over ([Note: promoting deferred inverses]): the maximum over layers of
    :func:`curvature_ages`. 0 for an assignment with no K-FAC layer.

    Raises:
        ValueError: ``promote`` is not one of :data:`PROMOTE_INVERSES`.
    """
    return max(curvature_ages(a, promote).values(), default=0)


def curvature_ages(a: Assignment, promote: str = "at_cycle_end") -> dict[tuple[int, int, int, int], int]:
    """The oldest curvature each layer preconditions with, in steps, once the first cycle is over:
    k − 1 + p_i − p_c (fresh), 2k − 1 − p_c (deferred, ``at_cycle_end``) or k + p_i − p_c
    (deferred, ``when_ready``), where p_c is the phase of the curvature the layer's INVERT (phase
    p_i) inverts: that of the last SYNC_FACTOR before it.

    Returns:
        (worker, stage, pipe, layer) -> age in steps, for every K-FAC layer of every stage replica.

    Raises:
        ValueError: ``promote`` is not one of :data:`PROMOTE_INVERSES`.
    """
    if promote not in PROMOTE_INVERSES:
        raise ValueError(f"promote={promote!r}: use one of {', '.join(PROMOTE_INVERSES)}")
    k, out = a.interval, {}
    for key, (p_c, p_i) in _curvature_and_inverse_phases_by_layer(a).items():
        if not a.deferred:
            out[key] = k - 1 + p_i - p_c
        else:
            out[key] = 2 * k - 1 - p_c if promote == "at_cycle_end" else k + p_i - p_c
    return out


def _curvature_and_inverse_phases(a: Assignment) -> list[tuple[int, int]]:
    """(p_c, p_i) of every layer of every stage replica: the phase of the curvature its INVERT
    inverts (that of the last SYNC_FACTOR before the INVERT) and the phase of the INVERT."""
    return list(_curvature_and_inverse_phases_by_layer(a).values())


def _curvature_and_inverse_phases_by_layer(a: Assignment) -> dict[tuple[int, int, int, int], tuple[int, int]]:
    """:func:`_curvature_and_inverse_phases` keyed by (worker, stage, pipe, layer)."""
    # (worker, stage, pipe, layer) -> sorted curvature phases, (phase, index) of syncs and of the INVERT
    curv: dict[tuple[int, int, int, int], set[int]] = defaultdict(set)
    syncs: dict[tuple[int, int, int, int], list[tuple[int, int]]] = defaultdict(list)
    inverts: dict[tuple[int, int, int, int], tuple[int, int]] = {}
    for p, phase in enumerate(a.phases):
        for w, acts in phase.actions.items():
            for i, x in enumerate(acts):
                if x.kind not in (K.CURV_A, K.CURV_B, K.SYNC_FACTOR, K.INVERT):
                    continue
                for layer in _expand(x.layer, a.kfac_layers[x.stage]):
                    key = (w, x.stage, x.pipe, layer)
                    if x.kind == K.SYNC_FACTOR:
                        syncs[key].append((p, i))
                    elif x.kind == K.INVERT:
                        inverts[key] = (p, i)
                    else:
                        curv[key].add(p)
    out = {}
    for key, at in sorted(inverts.items()):
        before = [s for s in sorted(syncs[key]) if s < at]
        out[key] = (sorted(curv[key])[len(before) - 1], at[0])
    return out


# -- JSON --------------------------------------------------------------------------------------


def assignment_to_dict(a: Assignment) -> dict[str, Any]:
    """The JSON-able form of ``a`` (see :func:`assignment_to_json`)."""
    s = a.phases[0]
    workers_per_pipe = s.num_workers // s.dp_width
    return {
        "format": ASSIGNMENT_FORMAT,
        "method": s.method,
        "num_stages": s.num_stages,
        "stages": workers_per_pipe,
        "num_virtual": s.num_stages // workers_per_pipe,
        "num_micro_batches": s.num_micro_batches,
        "dp_width": s.dp_width,
        "interval": a.interval,
        "deferred": a.deferred,
        "kfac_layers": list(a.kfac_layers),
        "curvature_micro_batches": a.curvature_micro_batches,
        "factor_interval": a.factor_interval,
        "phases": [{str(w): [str(x) for x in acts] for w, acts in sorted(phase.actions.items())}
                   for phase in a.phases],
        "metadata": dict(a.metadata),
    }


def assignment_to_json(a: Assignment, path: str | os.PathLike) -> Path:
    """Write ``a`` as JSON (atomically: a temporary file beside ``path``, then a rename).

    The file holds the format tag ``"pipefisher-assignment/1"``, the pipeline (method,
    num_stages = model stages, stages = workers per pipeline, num_virtual, num_micro_batches,
    dp_width), interval, deferred, kfac_layers, factor_interval, ``phases`` (per phase, per worker, the action
    strings) and ``metadata``.

    Returns:
        The path written.

    Raises:
        ValueError: the metadata is not JSON-serializable.
    """
    path = Path(path)
    data = assignment_to_dict(a)
    try:
        text = json.dumps(data, indent=1, sort_keys=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"assignment metadata cannot be written as JSON ({exc}); keep it to numbers, "
                         f"strings, lists and dicts") from exc
    return write_text_atomic(path, text + "\n")


_REGENERATE = "regenerate it with `python schedule.py` (from=<profile.sqlite> or model/pipeline keys)"


def _field(data: Mapping[str, Any], name: str, kind: type | tuple[type, ...], source: str) -> Any:
    if name not in data:
        raise ValueError(f"{source}: field {name!r} is missing; {_REGENERATE}")
    value = data[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{source}: field {name!r} = {value!r} has the wrong type; {_REGENERATE}")
    return value


def assignment_from_dict(data: Mapping[str, Any], source: str = "assignment") -> Assignment:
    """Rebuild and check an assignment from its JSON-able form.

    Args:
        data: what :func:`assignment_to_dict` returned.
        source: how to name the input in error messages (the file name).

    Raises:
        ValueError: naming ``source``, the field and the fix, when a field is missing or wrong, or
            the phases fail :func:`check_assignment`.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a JSON object; {_REGENERATE}")
    fmt = data.get("format")
    if fmt != ASSIGNMENT_FORMAT:
        raise ValueError(f"{source}: field 'format' is {fmt!r}, expected {ASSIGNMENT_FORMAT!r}: not a "
                         f"pipefisher assignment, or another version; {_REGENERATE}")
    method = _field(data, "method", str, source)
    stages = _field(data, "stages", int, source)
    num_virtual = _field(data, "num_virtual", int, source)
    n = _field(data, "num_micro_batches", int, source)
    dp = _field(data, "dp_width", int, source)
    interval = _field(data, "interval", int, source)
    deferred = _field(data, "deferred", bool, source)
    layers = _field(data, "kfac_layers", list, source)
    phases_data = _field(data, "phases", list, source)
    metadata = data.get("metadata", {})
    subset = data.get("curvature_micro_batches", 0)
    if not isinstance(subset, int) or isinstance(subset, bool) or subset < 0:
        raise ValueError(f"{source}: field 'curvature_micro_batches' = {subset!r} must be an integer >= 0; {_REGENERATE}")
    factor_interval = data.get("factor_interval", 0)
    if not isinstance(factor_interval, int) or isinstance(factor_interval, bool) or factor_interval < 0:
        raise ValueError(f"{source}: field 'factor_interval' = {factor_interval!r} must be an integer >= 0; {_REGENERATE}")
    chunked = method == "interleaved" or method in V_METHODS  # the V schedules: exactly 2, their generators check
    options = {"num_virtual": num_virtual} if chunked else {}
    if not chunked and num_virtual != 1:
        raise ValueError(f"{source}: field 'num_virtual' = {num_virtual} but method {method!r} has one "
                         f"chunk per worker; {_REGENERATE}")
    try:
        base = get_generator(method)(stages, n, dp, **options)
    except ValueError as exc:
        raise ValueError(f"{source}: fields method/stages/num_micro_batches/dp_width do not describe a "
                         f"pipeline ({exc}); {_REGENERATE}") from None
    if data.get("num_stages", base.num_stages) != base.num_stages:
        raise ValueError(f"{source}: field 'num_stages' = {data.get('num_stages')} but {method} with "
                         f"stages={stages}, num_virtual={num_virtual} has {base.num_stages}; {_REGENERATE}")
    if len(layers) != base.num_stages or any(not isinstance(c, int) or isinstance(c, bool) or c < 0
                                             for c in layers):
        raise ValueError(f"{source}: field 'kfac_layers' = {layers} needs {base.num_stages} non-negative "
                         f"integers; {_REGENERATE}")
    if interval < 1 or len(phases_data) != interval:
        raise ValueError(f"{source}: field 'phases' has {len(phases_data)} entries but 'interval' is "
                         f"{interval}; one phase per step of the cycle; {_REGENERATE}")
    workers = sorted(base.actions)
    phases = []
    for p, per_worker in enumerate(phases_data):
        if not isinstance(per_worker, Mapping) or sorted(per_worker) != sorted(map(str, workers)):
            got = sorted(per_worker) if isinstance(per_worker, Mapping) else type(per_worker).__name__
            raise ValueError(f"{source}: field 'phases[{p}]' must map every worker {workers} (as strings) "
                             f"to its action list, got {got}; {_REGENERATE}")
        actions = {}
        for w in workers:
            texts = per_worker[str(w)]
            if not isinstance(texts, list):
                raise ValueError(f"{source}: field 'phases[{p}][\"{w}\"]' is not a list of action strings")
            try:
                actions[w] = tuple(Action.from_str(t) for t in texts)
            except (ValueError, TypeError, AttributeError) as exc:
                raise ValueError(f"{source}: field 'phases[{p}][\"{w}\"]': {exc}; {_REGENERATE}") from None
        phases.append(replace(base, actions=actions))
    a = Assignment(interval, tuple(phases), deferred, tuple(layers),
                   metadata=dict(metadata) if isinstance(metadata, Mapping) else {}, curvature_micro_batches=subset,
                   factor_interval=factor_interval)
    try:
        check_assignment(a)
    except ScheduleError as exc:
        raise ValueError(f"{source}: field 'phases' fails the assignment checks: {exc}\n"
                         f"fix: {_REGENERATE}") from None
    return a


def assignment_from_json(path: str | os.PathLike) -> Assignment:
    """Read and check an assignment written by :func:`assignment_to_json` (JSON, never pickle), or the plan a
    strategy file of the search carries (its ``pipefisher.assignment``, ``planning.strategy_file``).

    Raises:
        ValueError: the file is missing or not JSON, or a field is wrong; the message names the
            file, the field and the fix.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such assignment file; write one with `python schedule.py` "
                         f"(optimizer.schedule=<path to assignment.json>)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc}); {_REGENERATE}") from None
    if isinstance(data, dict) and str(data.get("format", "")).startswith("pipefisher-strategy/"):
        block = data.get("pipefisher")
        if not isinstance(block, dict) or not isinstance(block.get("assignment"), dict):
            raise ValueError(f"{path}: field pipefisher.assignment is missing (a strategy file for optimizer="
                             f"{data.get('optimizer')!r}); search again with optimizer pipefisher")
        return assignment_from_dict(block["assignment"], source=f"{path}: pipefisher.assignment")
    return assignment_from_dict(data, source=str(path))
