"""K-FAC work in the schedule IR: refresh-cycle assignments, their checks, and their JSON form.

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

and in every phase one PRECOND per stage replica after its SYNC_GRAD and before STEP.
``deferred=False`` (the kfac baseline) uses an inverse as soon as it exists, so each INVERT must
precede its replica's PRECOND in its phase (staleness 0 at refresh steps); ``deferred=True``
(PipeFisher) uses the inverses computed during cycle c from cycle c+1 on, so INVERT may follow
PRECOND and steps use inverses up to 2k-1 steps old. In the first cycle of a deferred run there
are no inverses yet: the runtime steps with the plain gradient until a layer's first inversion,
whose inverses it uses from the next step on (there is nothing older to keep).

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

__all__ = [
    "ASSIGNMENT_FORMAT",
    "LINEAR_NAMES",
    "LINEARS_PER_ENCODER_LAYER",
    "Assignment",
    "assignment_from_dict",
    "assignment_from_json",
    "assignment_to_dict",
    "assignment_to_json",
    "check_assignment",
    "critical_path_assignment",
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
    """

    interval: int
    phases: tuple[Schedule, ...]
    deferred: bool
    kfac_layers: tuple[int, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    curvature_micro_batches: int = 0

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
                             deferred: bool = False, curvature_micro_batches: int = 0) -> Assignment:
    """K-FAC with all of a refresh on the critical path (``optimizer=kfac``).

    Phase 0: the pipeline, then after each worker's flush (its last B and SYNC_GRADs), right
    before STEP: CURV_A and CURV_B of every micro-batch of every replica it holds, layer by layer;
    one SYNC_FACTOR per layer in one global (stage, layer) order, so workers sharing all-reduces
    issue them alike and nothing deadlocks; one INVERT per layer; then PRECOND per replica. Phases
    1..k-1: the pipeline plus PRECOND.

    Args:
        schedule: a complete schedule without K-FAC units (``build_schedule`` output).
        kfac_layers: K-FAC layers per stage (:func:`kfac_layer_counts`).
        interval: k >= 1, steps per refresh.
        deferred: whether the inverses are first used in the next cycle (see the module notes).
        curvature_micro_batches: curvature from the first n micro-batches of each pipe (0: all);
            see [Note: curvature from part of the batch].

    Returns:
        A checked assignment.
    """
    require_plain_schedule(schedule, kfac_layers)
    if not isinstance(interval, int) or interval < 1:
        raise ValueError(f"interval={interval!r}: the refresh interval is a positive number of steps")
    plain = with_preconditioning(schedule)
    refresh = {}
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
    phases = (replace(plain, actions=refresh),) + (plain,) * (interval - 1)
    out = Assignment(interval, phases, deferred, tuple(kfac_layers),
                     metadata={"planner": "critical_path"}, curvature_micro_batches=curvature_micro_batches)
    check_assignment(out)
    return out


# -- checks ------------------------------------------------------------------------------------


def _fail(a: Assignment, phase: int, message: str, mark: tuple[int, int] | None = None) -> NoReturn:
    s = a.phases[phase]
    raise ScheduleError(f"{s.method} K-FAC assignment (D={s.num_stages}, N={s.num_micro_batches}, "
                        f"interval {a.interval}), phase {phase}: {message}\n{s.format_grid(mark=mark)}")


def check_assignment(a: Assignment) -> None:
    """Check a K-FAC assignment: every phase, and the refresh cycle ([Note: refresh cycle]).

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
    first = a.phases[0]
    if len(a.kfac_layers) != first.num_stages:
        raise ScheduleError(f"assignment kfac_layers={list(a.kfac_layers)}: need one count per stage "
                            f"({first.num_stages})")
    base = strip_kfac(first).actions
    for p, phase in enumerate(a.phases):
        if (phase.method, phase.num_stages, phase.num_micro_batches, phase.placement,
                phase.pipe_of_micro_batch) != (first.method, first.num_stages, first.num_micro_batches,
                                               first.placement, first.pipe_of_micro_batch):
            _fail(a, p, "the phase is a different pipeline from phase 0 (method, D, N or placement)")
        if strip_kfac(phase).actions != base:
            w = next(w for w in base if strip_kfac(phase).actions.get(w) != base[w])
            mine = [(i, x) for i, x in enumerate(phase.actions.get(w, ())) if not x.kind.is_kfac]
            i = next((i for (i, x), y in zip(mine, base[w]) if x != y), mine[-1][0] if mine else 0)
            _fail(a, p, f"worker {w} runs different pipeline actions than in phase 0; phases differ "
                        f"only in K-FAC units", (w, i))
        try:
            check_schedule(phase, kfac=True)
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
            name = f"stage {stage} (pipe {pipe}) layer {layer} on worker {w}"
            curv_phases = set()
            for kind in (K.CURV_A, K.CURV_B):
                seen: dict[int, tuple[int, int]] = {}
                for p, i, j in got.get(kind, []):
                    if j in seen:
                        _fail(a, p, f"{kind} of micro-batch {j} for {name} runs twice in the cycle "
                                    f"(phases {seen[j][0]} and {p}); once per refresh", (w, i))
                    seen[j] = (p, i)
                    curv_phases.add(p)
                missing = [j for j in mbs if j not in seen]
                if missing:
                    _fail(a, 0, f"{name} never gets {kind} of micro-batch(es) {missing}; a refresh "
                                f"uses micro-batches {mbs} of the replica's pipe")
                extra = sorted(j for j in seen if j not in mbs)
                if extra:
                    p, i = seen[extra[0]]
                    _fail(a, p, f"{name} gets {kind} of micro-batch(es) {extra}, outside the refresh's "
                                f"micro-batches {mbs} (curvature_micro_batches={a.curvature_micro_batches})", (w, i))
            if len(curv_phases) > 1:
                p = max(curv_phases)
                i = min(i for kind in (K.CURV_A, K.CURV_B) for q, i, _ in got[kind] if q == p)
                _fail(a, p, f"curvature of {name} is split over phases {sorted(curv_phases)}; all of a "
                            f"layer's curvature runs in one step (captures do not outlive a step)", (w, i))
            p_curv = min(curv_phases, default=0)
            last = (p_curv, max((i for kind in (K.CURV_A, K.CURV_B) for q, i, _ in got.get(kind, []) if q == p_curv),
                                default=None))
            for kind, after, p_after in ((K.SYNC_FACTOR, "its curvature", p_curv), (K.INVERT, "its SYNC_FACTOR", None)):
                where = got.get(kind, [])
                if len(where) > 1:
                    _fail(a, where[1][0], f"{name} has {len(where)} {kind} in the cycle; exactly one per refresh",
                          (w, where[1][1]))
                if not where:
                    _fail(a, last[0], f"{name} has no {kind} in the cycle; exactly one per refresh, after "
                                      f"{after}", None if last[1] is None else (w, last[1]))
                if p_after is None:
                    p_after = got[K.SYNC_FACTOR][0][0]
                last = where[0][:2]
                p, i, _ = where[0]
                if p < p_after:
                    _fail(a, p, f"{kind} of {name} runs in phase {p}, before {after} (phase {p_after})",
                          (w, i))


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
        "phases": [{str(w): [str(x) for x in acts] for w, acts in sorted(phase.actions.items())}
                   for phase in a.phases],
        "metadata": dict(a.metadata),
    }


def assignment_to_json(a: Assignment, path: str | os.PathLike) -> Path:
    """Write ``a`` as JSON (atomically: a temporary file beside ``path``, then a rename).

    The file holds the format tag ``"pipefisher-assignment/1"``, the pipeline (method,
    num_stages = model stages, stages = workers per pipeline, num_virtual, num_micro_batches,
    dp_width), interval, deferred, kfac_layers, ``phases`` (per phase, per worker, the action
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
    options = {"num_virtual": num_virtual} if method == "interleaved" else {}
    if method != "interleaved" and num_virtual != 1:
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
                   metadata=dict(metadata) if isinstance(metadata, Mapping) else {}, curvature_micro_batches=subset)
    try:
        check_assignment(a)
    except ScheduleError as exc:
        raise ValueError(f"{source}: field 'phases' fails the assignment checks: {exc}\n"
                         f"fix: {_REGENERATE}") from None
    return a


def assignment_from_json(path: str | os.PathLike) -> Assignment:
    """Read and check an assignment written by :func:`assignment_to_json` (JSON, never pickle).

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
    return assignment_from_dict(data, source=str(path))
