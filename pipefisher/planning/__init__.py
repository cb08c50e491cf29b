"""Planning: bubbles of a simulated pipeline → a K-FAC work assignment (PipeFisher), and what-if.

Entry points: :func:`plan_pipefisher` (K-FAC units into the bubbles, smallest refresh interval k),
:func:`compare_optimizers` (predicted step time and utilization of nvlamb, kfac and pipefisher),
:func:`estimate_costs` / :func:`costs_from_profile` (cost models with K-FAC unit costs),
:func:`find_bubbles`, :func:`estimate_memory` and :func:`what_if`; :func:`plan_for` with :class:`PlanOptions`
(PipeFisher's one planning path: train.py's ``optimizer=pipefisher`` defaults), :func:`read_calibration` (steps to a
held-out loss per optimizer) and :func:`rank_by_time_to_target` (issue 37). ``schedule.py`` runs
``pipefisher.planning.cli.schedule_main`` (not imported here: it registers Hydra configs).
"""

from pipefisher.planning.assign import PlanStats, plan_interval, plan_pipefisher
from pipefisher.planning.calibration import Calibration, read_calibration
from pipefisher.planning.bubbles import Bubble, TimelineSummary, find_bubbles, summarize_timeline
from pipefisher.planning.costs import (
    Hardware,
    RunShape,
    costs_from_profile,
    encoder_layers_per_stage,
    estimate_costs,
    estimate_run_costs,
    kfac_linear_dims,
    stage_parameters,
)
from pipefisher.planning.memory import MemoryEstimate, estimate_memory
from pipefisher.planning.pipefisher_plan import PipeFisherPlan, PlanOptions, pipefisher_defaults, plan_for
from pipefisher.planning.predict import Comparison, Prediction, compare_optimizers, predict_assignment, predict_schedule
from pipefisher.planning.time_to_target import rank_by_time_to_target
from pipefisher.planning.whatif import Candidate, format_candidates, what_if

__all__ = [
    "Bubble",
    "Calibration",
    "Candidate",
    "Comparison",
    "Hardware",
    "MemoryEstimate",
    "PipeFisherPlan",
    "PlanOptions",
    "PlanStats",
    "Prediction",
    "RunShape",
    "TimelineSummary",
    "compare_optimizers",
    "costs_from_profile",
    "encoder_layers_per_stage",
    "estimate_costs",
    "estimate_memory",
    "estimate_run_costs",
    "find_bubbles",
    "format_candidates",
    "kfac_linear_dims",
    "pipefisher_defaults",
    "plan_for",
    "plan_interval",
    "plan_pipefisher",
    "predict_assignment",
    "predict_schedule",
    "rank_by_time_to_target",
    "read_calibration",
    "stage_parameters",
    "summarize_timeline",
    "what_if",
]
