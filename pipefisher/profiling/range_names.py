"""Map NVTX range names of other runtimes to our actions (config group ``ranges``, issue 25).

Our executor names each action's range by its string form (``0F2``, ``3B5@1``, ``STEP``; see
``pipefisher.schedules.ir``). Profiles of runs made with other code name them otherwise, e.g.
Megatron's zero-bubble fork: ``F{mb}.{chunk}.{seq}``, ``B…``, ``W…``, ``Optimizer``. A
:class:`RangeNames` map reads such names with regular expressions whose named groups say what
the name holds:

- ``kind`` (required): looked up in ``kinds`` (``{"B": "I", "Optimizer": "STEP"}``); text not
  there must itself be an action kind (``F``, ``B``, ``I``, ``W``, ``STEP``, …);
- ``mb``: the micro-batch; ``stage``: the model stage; ``chunk``: the model chunk on the worker
  (when there is no ``stage``); ``pipe``: the pipe (Chimera).

[Note: stages of mapped names]
A name without ``stage`` takes it from its worker ``w`` (of ``D`` workers, one pipeline) and
its chunk ``c`` (0 when absent): ``chunk_stages=interleaved`` gives ``c·D + w`` (Megatron's
virtual pipeline), ``chunk_stages=v`` gives ``w`` for chunk 0 and ``2D-1-w`` for chunk 1 (ZB-V).
Megatron's fork names a split input backward ``B`` and the combined backward (its ``BW`` node)
``B`` too, so a map's ``I`` with no ``W`` of its worker, stage and micro-batch before the next
``I`` of the same is read as a full backward ``B``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pipefisher.schedules.ir import Action, ActionKind

__all__ = ["CHUNK_STAGES", "GROUPS", "OURS", "MappedName", "RangeNames", "action_name", "compile_patterns",
           "match_name", "stage_of_chunk"]

GROUPS: frozenset[str] = frozenset({"kind", "mb", "stage", "chunk", "pipe"})
CHUNK_STAGES: tuple[str, ...] = ("interleaved", "v")
OURS = "ours"


@dataclass
class RangeNames:
    """How NVTX range names map to actions (config group ``ranges``; ``ours`` is the default)."""

    name: str = OURS  # the map's name, for messages
    patterns: list[str] = field(default_factory=list)  # regexes with named groups kind, mb, stage, chunk, pipe; empty = our action grammar
    kinds: dict[str, str] = field(default_factory=dict)  # text of a (?P<kind>...) group -> action kind (F, B, I, W, STEP, ...)
    chunk_stages: str = "interleaved"  # stage of chunk c on worker w of D when the name has none: interleaved (c*D + w) or v (chunk 1: 2D-1-w)

    def __post_init__(self) -> None:
        compile_patterns(self)


@dataclass(frozen=True)
class MappedName:
    """What a mapped name holds; the stage may wait for the worker ([Note: stages of mapped names])."""

    kind: str
    micro_batch: int | None
    stage: int | None
    chunk: int
    pipe: int


_MAPPABLE: tuple[str, ...] = tuple(k.value for k in ActionKind if not k.is_comm)  # a send/receive needs its peer


def _kind_of(text: str, names: RangeNames, index: int) -> str:
    kind = names.kinds.get(text, text)
    if kind not in _MAPPABLE:
        raise ValueError(f"ranges.patterns[{index}]: kind {text!r} -> {kind!r} is no action kind a name can map to; "
                         f"add {text}: <kind> to ranges.kinds, kind one of {', '.join(_MAPPABLE)}")
    return kind


def compile_patterns(names: RangeNames) -> list[re.Pattern[str]]:
    """The map's regular expressions, checked.

    Raises:
        ValueError: a pattern that does not compile, lacks the ``kind`` group or has a group
            other than kind, mb, stage, chunk and pipe; a ``kinds`` value that is no action kind;
            an unknown ``chunk_stages``.
    """
    if names.chunk_stages not in CHUNK_STAGES:
        raise ValueError(f"ranges.chunk_stages={names.chunk_stages!r}: choose interleaved (chunk c of worker w is "
                         f"stage c*D + w) or v (chunk 1 of worker w is stage 2D-1-w)")
    out = []
    for i, text in enumerate(names.patterns):
        try:
            pattern = re.compile(text)
        except re.error as exc:
            raise ValueError(f"ranges.patterns[{i}]={text!r}: not a regular expression ({exc})") from None
        groups = set(pattern.groupindex)
        if "kind" not in groups or groups - GROUPS:
            extra = ", ".join(sorted(groups - GROUPS))
            why = f"has group(s) {extra}" if extra else "has no (?P<kind>...) group"
            raise ValueError(f"ranges.patterns[{i}]={text!r}: {why}; name groups only kind (required), mb, stage, "
                             f"chunk and pipe, and leave other parts unnamed")
        out.append(pattern)
    for text, kind in names.kinds.items():
        if kind not in _MAPPABLE:
            raise ValueError(f"ranges.kinds.{text}={kind!r}: no action kind a name can map to; choose one of "
                             f"{', '.join(_MAPPABLE)}")
    return out


def match_name(text: str, names: RangeNames, patterns: list[re.Pattern[str]]) -> MappedName | None:
    """What ``text`` holds under the map, or None when no pattern matches it whole."""
    for i, pattern in enumerate(patterns):
        m = pattern.fullmatch(text)
        if m is None:
            continue
        groups = m.groupdict()

        def number(key: str) -> int | None:
            value = groups.get(key)
            return None if value is None else int(value)

        kind = _kind_of(m["kind"], names, i)
        if ActionKind(kind).is_compute and groups.get("mb") is None:
            raise ValueError(f"ranges.patterns[{i}]={pattern.pattern!r} reads {text!r} as {kind}, which needs a "
                             f"micro-batch: add a (?P<mb>...) group")
        return MappedName(kind, number("mb"), number("stage"), number("chunk") or 0, number("pipe") or 0)
    return None


def stage_of_chunk(chunk: int, worker: int, num_workers: int, rule: str) -> int:
    """The model stage of ``chunk`` on ``worker`` ([Note: stages of mapped names]).

    Raises:
        ValueError: ``rule=v`` with a chunk other than 0 or 1.
    """
    if rule == "v":
        if chunk not in (0, 1):
            raise ValueError(f"ranges.chunk_stages=v: chunk {chunk} on worker {worker}; a V schedule has chunks 0 "
                             f"and 1, so use chunk_stages=interleaved")
        return worker if chunk == 0 else 2 * num_workers - 1 - worker
    return chunk * num_workers + worker


def action_name(mapped: MappedName, worker: int, num_workers: int, rule: str) -> str:
    """Our string form of a mapped name on ``worker`` (e.g. ``2F3``, ``STEP``)."""
    kind = ActionKind(mapped.kind)
    if kind == ActionKind.STEP:
        return str(Action(kind=kind))
    stage = mapped.stage if mapped.stage is not None else stage_of_chunk(mapped.chunk, worker, num_workers, rule)
    return str(Action(kind=kind, stage=stage, micro_batch=mapped.micro_batch, pipe=mapped.pipe))
