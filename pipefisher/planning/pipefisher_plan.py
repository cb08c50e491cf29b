"""One PipeFisher planning path for the strategy search, ``whatif`` and train.py (issue 37, item 3).

Entry points: :class:`PlanOptions` (the planner's keys of ``optimizer=pipefisher``), :func:`pipefisher_defaults`
(those keys as train.py composes them), :func:`plan_for` (k, curvature ages and the plan), :func:`plan_from_file`
(a plan from ``assignment.json`` or from a strategy file's ``pipefisher`` block).

[Note: one planning path]
Before issue 37 the search and ``whatif`` called ``plan_pipefisher`` with the planner's own defaults (inverses
promoted at cycle end, no staleness bound) while train.py ran ``optimizer=pipefisher``'s (``when_ready``,
``max_staleness=8``): bert-base chimera pp=4, micro-batch 8 was ranked at k=8 (curvature up to 15 steps old) and
trained at k=5. Now every caller takes a :class:`PlanOptions` (from the run's optimizer config, or
:func:`pipefisher_defaults`, which reads ``conf/optimizer/pipefisher.yaml`` over ``OptimizerConfig``) and plans
through :func:`plan_for`; train.py and the search price the pipeline with the same cost model
(``strategy_search.pipeline_costs``), so for the same shape and hardware they plan the same k, ages and plan
(tested). A strategy file carries the plan itself, so ``train.py strategy=<file>`` runs what was ranked even when
the search priced measured collectives train.py cannot know.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipefisher.config import OptimizerConfig
from pipefisher.config.choices import KFAC_OWNERS
from pipefisher.planning.assign import plan_pipefisher
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import RunShape
from pipefisher.planning.owner_costs import with_owners
from pipefisher.planning.staleness import load_staleness_curve
from pipefisher.schedules import Schedule
from pipefisher.schedules.kfac import (PROMOTE_INVERSES, Assignment, assignment_from_json, curvature_age_bound,
                                       curvature_ages)
from pipefisher.simulate import CostModel

__all__ = ["PipeFisherPlan", "PlanOptions", "pipefisher_defaults", "plan_for", "plan_from_file"]

_CONF = Path(__file__).resolve().parent.parent / "conf" / "optimizer" / "pipefisher.yaml"
_PLACEMENTS = ("after_capture", "beside_w")


@dataclass(frozen=True)
class PlanOptions:
    """The planner's keys of train.py's ``optimizer`` group (same names; see ``config.OptimizerConfig``).

    The defaults are ``optimizer=pipefisher``'s as train.py composes them (:func:`pipefisher_defaults` reads
    them from its YAML; a test keeps the two equal).
    """

    max_interval: int = 8
    max_staleness: int | None = 8
    promote_inverses: str = "when_ready"
    curvature_micro_batches: int = 0
    curvature_placement: str = "after_capture"
    staleness_curve: str | None = None
    kfac_owners: str = "holder"

    def __post_init__(self) -> None:
        if isinstance(self.max_interval, bool) or not isinstance(self.max_interval, int) or self.max_interval < 1:
            raise ValueError(f"max_interval={self.max_interval!r}: an integer >= 1, e.g. 8")
        if self.max_staleness is not None and (isinstance(self.max_staleness, bool)
                                               or not isinstance(self.max_staleness, int) or self.max_staleness < 1):
            raise ValueError(f"max_staleness={self.max_staleness!r}: an integer >= 1, or null for no bound")
        if self.promote_inverses not in PROMOTE_INVERSES:
            raise ValueError(f"promote_inverses={self.promote_inverses!r}: use one of {', '.join(PROMOTE_INVERSES)}")
        if isinstance(self.curvature_micro_batches, bool) or not isinstance(self.curvature_micro_batches, int) \
                or self.curvature_micro_batches < 0:
            raise ValueError(f"curvature_micro_batches={self.curvature_micro_batches!r}: an integer >= 0 (0 = all)")
        if self.kfac_owners not in KFAC_OWNERS:
            raise ValueError(f"kfac_owners={self.kfac_owners!r}: use one of {', '.join(KFAC_OWNERS)}")
        if self.curvature_placement not in _PLACEMENTS:
            raise ValueError(f"curvature_placement={self.curvature_placement!r}: use one of {', '.join(_PLACEMENTS)}")

    @classmethod
    def from_optimizer(cls, optimizer: Any) -> PlanOptions:
        """The options of an optimizer config (``OptimizerConfig`` or anything with its attribute names;
        ``kfac_owners`` may be absent, as in schedule.py's config, which plans for ``holder``)."""
        return cls(**{f.name: getattr(optimizer, f.name) if f.name != "kfac_owners" else
                      getattr(optimizer, f.name, f.default) for f in fields(cls)})

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlanOptions:
        """From :meth:`to_dict`'s form; unknown keys raise ``ValueError`` naming them."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown planner option(s) {sorted(unknown)}; the options are "
                             f"{', '.join(f.name for f in fields(cls))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def overrides(self) -> dict[str, Any]:
        """train.py's keys (dotted) that reproduce these options."""
        return {f"optimizer.{k}": v for k, v in asdict(self).items()}


@functools.lru_cache(maxsize=1)
def pipefisher_defaults() -> PlanOptions:
    """``optimizer=pipefisher``'s planner keys as train.py composes them: ``OptimizerConfig``'s defaults with
    ``conf/optimizer/pipefisher.yaml`` over them."""
    raw = OmegaConf.load(_CONF)
    raw.pop("defaults", None)
    merged = OmegaConf.merge(OmegaConf.structured(OptimizerConfig), raw)
    return PlanOptions.from_optimizer(merged)


@dataclass(frozen=True)
class PipeFisherPlan:
    """A PipeFisher plan and what a run of it does to curvature freshness.

    Attributes:
        assignment: the checked plan (``Assignment``), what train.py executes.
        options: the planner options it was made with.
    """

    assignment: Assignment
    options: PlanOptions

    @property
    def k(self) -> int:
        """The refresh interval: steps per cycle."""
        return self.assignment.interval

    @property
    def age_bound(self) -> int:
        """The oldest curvature a step preconditions with under ``options.promote_inverses``."""
        return curvature_age_bound(self.assignment, self.options.promote_inverses)

    @property
    def ages(self) -> tuple[int, ...]:
        """Per model stage, the oldest curvature its layers precondition with (0 for a stage without K-FAC layers)."""
        worst = [0] * len(self.assignment.kfac_layers)
        for (_w, stage, _pipe, _layer), age in curvature_ages(self.assignment, self.options.promote_inverses).items():
            worst[stage] = max(worst[stage], age)
        return tuple(worst)

    def describe(self) -> str:
        bound = self.options.max_staleness
        return (f"k={self.k}, curvature age <= {self.age_bound} step(s) (per stage {list(self.ages)}; inverses "
                f"{self.options.promote_inverses}, max_staleness={'none' if bound is None else bound})"
                + (f", kfac_owners={self.options.kfac_owners}" if self.options.kfac_owners != "holder" else ""))


def plan_for(schedule: Schedule, cost: CostModel, kfac_layers: list[int] | tuple[int, ...],
             options: PlanOptions | None = None, run: RunShape | None = None,
             comm: CommCosts | None = None) -> PipeFisherPlan:
    """PipeFisher's plan of ``schedule`` under ``cost`` with ``options`` ([Note: one planning path]).

    Args:
        schedule: the pipeline's schedule without K-FAC units.
        cost: the cost model with K-FAC unit costs (``strategy_search.pipeline_costs``, or a profile's).
        kfac_layers: K-FAC layers per stage.
        options: the planner options; None: :func:`pipefisher_defaults` (train.py's ``optimizer=pipefisher``).
        run: the run's shape; needed with ``options.kfac_owners="replicas"``, whose layers' owners and
            exchange it prices (``planning.owner_costs`` [Note: pricing owners]).
        comm: the collective model the owners' exchange is priced by (the search's); None: from ``cost``.

    Returns:
        The plan with its k and curvature ages.

    Raises:
        ValueError: ``kfac_owners="replicas"`` without ``run``.
    """
    o = options or pipefisher_defaults()
    if o.kfac_owners == "replicas":
        if run is None:
            raise ValueError("plan_for: kfac_owners=replicas prices each layer on its owner; give the run's shape (run=)")
        cost = with_owners(cost, schedule, run, comm)
    staleness = load_staleness_curve(o.staleness_curve) if o.staleness_curve else None
    a = plan_pipefisher(schedule, cost, list(kfac_layers), max_interval=o.max_interval, max_staleness=o.max_staleness,
                        curvature_micro_batches=o.curvature_micro_batches, curvature_placement=o.curvature_placement,
                        promote=o.promote_inverses, staleness=staleness)
    return PipeFisherPlan(a, o)


def plan_from_file(path: str | Path) -> tuple[Assignment, dict[str, Any] | None]:
    """The plan in ``path`` (``schedules.kfac.assignment_from_json``: an ``assignment.json`` of schedule.py, or a
    strategy file's ``pipefisher.assignment``), and the strategy file's ``pipefisher`` block (None otherwise).

    Raises:
        ValueError: unreadable, not JSON, or a strategy file without a plan; the message names the field.
    """
    assignment = assignment_from_json(path)
    doc = json.loads(Path(path).read_text())
    block = doc.get("pipefisher") if str(doc.get("format", "")).startswith("pipefisher-strategy/") else None
    return assignment, block
