"""Per-schedule calibration of the search's step: the factor by which a schedule's compute actions run longer in
the executor than the pieces measured alone.

[Note: per-schedule executor factor]
The search prices a stage's F and B as the sum of its pieces timed alone (``measure.compute_rates``), plus the
executor's own time per action measured on GPipe (``measure.executor_overhead``). Both miss what depends on the
schedule: a schedule that keeps every worker computing at once (Chimera: each worker holds two stage replicas and
has almost no bubble) meets more contention for cores, memory bandwidth and caches than GPipe, whose warm-up and
cool-down leave workers idle. On two EPYC cores Chimera's F and B took 689 ms per worker and step against GPipe's
472 ms for the same work, and at D=4 on a 16-core Xeon its executor step was 1.25× its own simulation against
1.11–1.15× for GPipe and 1F1B (bench/studies/20-time-to-target-validation.md).

Where ``measure.collectives --executor-methods`` ran a schedule (``CommCosts.executor_steps``: NVLAMB, synthetic
data, the file's model, D = its processes), the search solves for the factor r ≥ 0 by which that schedule's F, B,
I and W must be scaled (before the per-action overhead is added) for the simulated step at the measured shape to
equal the measured step, and prices every candidate of that schedule at that D with the same r. What r absorbs is
whatever the measured step holds beyond the model: contention, and any mispricing of that step's STEP and
messages. It is not applied at another D, where the contention differs (no measurement there).

[Note: K-FAC unit factor]
K-FAC's units (CURV_A, CURV_B, INVERT, PRECOND) are priced from FLOP estimates (at the model's measured rate, or
at their own rates timed alone on one layer's shapes). In the executor they cost something else: F and B capture
the layers' inputs and output gradients for them, each unit is an action of its own per layer and micro-batch,
they share the cores with the pipeline, and a worker holding two replicas of a stage (Chimera) repeats the
per-step work. On the Zen 4 EPYC (bench/studies/20-time-to-target-validation.md), measured interleaved at D=2,
K-FAC every step cost NVLAMB's step + 60 ms on GPipe, 1F1B, interleaved and ZB-H1, + 88–94 ms on Chimera and
+ 105–110 ms on the V schedules, where the FLOP-rate pricing put + 86, 103 and 172 ms: one factor per schedule,
not one in all. Where ``measure.collectives --executor-kfac-methods`` ran a schedule with K-FAC every step and
NVLAMB taking turns (``CommCosts.kfac_executor_steps``), the search solves for the factor g by which every K-FAC
unit is scaled (:func:`scale_kfac_units`, after that schedule's executor factor and per-action overhead are
applied to its F, B, I and W) for the simulated extra over NVLAMB's step to equal the measured one, and prices
that schedule's K-FAC units by g at that D; other schedules and other D take GPipe's g (the per-unit costs it
carries, captures and actions, are not one schedule's). K-FAC with its Cholesky inverses only: EKFAC's eigh is
another kernel and stays unscaled.

[Note: Muon step factor]
Muon's STEP is priced as NVLAMB's element-wise step over its other parameters plus Newton–Schulz's FLOPs at the
model's measured rate (``planning.optimizer_costs``), while torch's Muon runs Newton–Schulz in bf16 where the CPU
has bf16 arithmetic (0.43–1.07× fp32's time on the Zen 4 EPYC, 22–47× on an AVX2-only EPYC: bench/studies/14).
On the Zen 4 EPYC's validations every Muon pair was over-priced by 4–11 % of its step over the common factor.
Where ``measure.collectives --executor-muon-methods`` ran a schedule with Muon and with NVLAMB taking turns
(``CommCosts.muon_executor_steps``), the search solves for the factor h by which the part of Muon's STEP beyond
NVLAMB's is scaled (:func:`scale_step_beyond`) for the simulated extra to equal the measured one, the schedule's
own at its D and GPipe's elsewhere, as for K-FAC's units. Measured on request only (the option's default is
none): on the Zen 4 EPYC Muon's extras over NVLAMB were 0–13 ms at D=2, N=8 (a few % of a step, within the
measurement's noise), and with them the search put Muon's median over the common factor at 0.99 (1.06 without)
but spread the schedules wider (zb-v's +0 ms clamps its factor to 0.25): 34 pairs within 10 % over the common
factor against 36 without (bench/studies/20-time-to-target-validation.md, run D).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pipefisher.simulate import CostModel

__all__ = ["FACTOR_RANGE", "scale_compute", "scale_kfac_units", "scale_step_beyond", "solve_factor"]

#: the factors the solver searches; a measured step outside what they reach is clamped to the nearer end
FACTOR_RANGE = (0.25, 4.0)


def scale_compute(cost: CostModel, factor: float) -> CostModel:
    """``cost`` with every F, B, I and W scaled by ``factor`` (STEP, messages and K-FAC's units unchanged)."""
    if factor == 1.0:
        return cost

    def s(xs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(max(0, round(x * factor)) for x in xs)

    return replace(cost, forward_ns=s(cost.forward_ns), backward_ns=s(cost.backward_ns),
                   input_grad_ns=s(cost.input_grad_ns), weight_grad_ns=s(cost.weight_grad_ns))


def scale_kfac_units(cost: CostModel, factor: float) -> CostModel:
    """``cost`` with K-FAC's CURV_A, CURV_B, INVERT and PRECOND scaled by ``factor`` (F, B, messages, factor syncs
    and STEP unchanged; [Note: K-FAC unit factor])."""
    if factor == 1.0:
        return cost

    def s(xs: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(max(0, round(x * factor)) for x in xs)

    return replace(cost, curv_a_ns=tuple(s(row) for row in cost.curv_a_ns),
                   curv_b_ns=tuple(s(row) for row in cost.curv_b_ns),
                   invert_ns=tuple(s(row) for row in cost.invert_ns), precond_ns=s(cost.precond_ns))


def scale_step_beyond(cost: CostModel, reference: CostModel, factor: float) -> CostModel:
    """``cost`` with the part of its STEP beyond ``reference``'s scaled by ``factor`` ([Note: Muon step factor]):
    ``reference.step_ns + factor × (cost.step_ns − reference.step_ns)``, never below 0."""
    if factor == 1.0:
        return cost
    return replace(cost, step_ns=max(0, round(reference.step_ns + factor * (cost.step_ns - reference.step_ns))))


def solve_factor(step_seconds: Callable[[float], float], measured_s: float, tol: float = 1e-4) -> float:
    """The factor r in :data:`FACTOR_RANGE` with ``step_seconds(r) == measured_s`` (bisection; ``step_seconds``
    is non-decreasing in r), clamped to the range's ends where the measured step lies outside what they reach.

    Raises:
        ValueError: ``measured_s`` is not positive.
    """
    if not measured_s > 0:
        raise ValueError(f"measured step {measured_s!r} s: a measured step is positive")
    lo, hi = FACTOR_RANGE
    if step_seconds(lo) >= measured_s:
        return lo
    if step_seconds(hi) <= measured_s:
        return hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if step_seconds(mid) < measured_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
