"""What stale curvature costs in steps: the measured staleness curve the PipeFisher planner weighs.

A refresh every k steps with deferred inverses applies curvature up to 2k − 1 steps old
(``promote_inverses=at_cycle_end``; up to k plus a phase lag with ``when_ready``). Bubbles make a
larger k cheaper per step; staleness can make it dearer in steps. The planner alone sees only the
first ([Note: choosing k] in :mod:`pipefisher.planning.assign`). A staleness curve gives the second:
``multiplier[k]`` = steps to a held-out target with a refresh every k steps (deferred as PipeFisher
defers) divided by steps with a refresh every step. With it the planner minimizes predicted time to
target, step time × multiplier, instead of taking the smallest k whose bubbles hold the refresh.

The file and its reader: :mod:`pipefisher.staleness_curve` ([Note: the staleness-curve file]).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipefisher.staleness_curve import StalenessCurve, load_staleness_curve

__all__ = ["StalenessCurve", "load_staleness_curve", "choose_interval"]


def choose_interval(step_ns: Mapping[int, float], curve: StalenessCurve) -> tuple[int, str]:
    """The k minimizing predicted time to target, ``step_ns[k] × curve.at(k)``, among the k the curve
    covers, and one sentence saying why (ties: the smaller k, the fresher curvature).

    Raises:
        ValueError: no k of ``step_ns`` lies within the curve.
    """
    scored = {k: t * m for k, t in step_ns.items() if (m := curve.at(k)) is not None}
    if not scored:
        raise ValueError(f"staleness curve covers k <= {curve.max_k}, but the planner tried only k in {sorted(step_ns)}")
    best = min(scored, key=lambda k: (scored[k], k))
    others = ", ".join(f"k={k}: {step_ns[k] / 1e6:.1f} ms × {curve.at(k):.3f}" for k in sorted(scored) if k != best)
    why = (f"k={best}: the least predicted time to target, step × steps multiplier of the staleness curve "
           f"({step_ns[best] / 1e6:.1f} ms × {curve.at(best):.3f}"
           + (f"; {others}" if others else "") + f"; curve from {curve.source or 'a file'})")
    return best, why
