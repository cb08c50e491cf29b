"""A staleness-curve file: steps multiplier per K-FAC refresh interval k, as the convergence study
measures it. Read here (json only), below ``config`` (which checks ``optimizer.staleness_curve``) and
``planning`` (whose :mod:`pipefisher.planning.staleness` weighs it and re-exports these names).

[Note: the staleness-curve file]
JSON written by the convergence study (``bench/convergence_report.py``, one file per global batch)
or by hand::

    {"promote_inverses": "at_cycle_end", "multiplier": {"1": 1.0, "2": 0.998, "4": 1.003, "8": 1.155},
     "target": "H-0.3", "seeds": {"1": 3, "2": 1, "4": 1, "8": 1}, "source": "..."}

``multiplier`` is required, holds k = 1 (the reference, 1.0) and positive finite values; between two
measured k the multiplier is interpolated linearly, beyond the largest measured k no k is allowed
(the curve says nothing there). ``promote_inverses`` names the rule the curve was measured under;
a plan for another rule is refused, since the ages differ. The other keys are carried for the log.
A curve is measured on one model, data and batch: it transfers to another only as an assumption,
which the planner's log states.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StalenessCurve", "load_staleness_curve"]


@dataclass(frozen=True)
class StalenessCurve:
    """Steps multiplier per refresh interval k (k = 1 is 1.0), measured under ``promote_inverses``."""

    multiplier: Mapping[int, float]
    promote_inverses: str = "at_cycle_end"
    source: str = ""
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if 1 not in self.multiplier:
            raise ValueError("staleness curve: multiplier needs k=1 (the reference: a refresh every step)")
        for k, m in self.multiplier.items():
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"staleness curve: k={k!r} must be a positive integer")
            if not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
                raise ValueError(f"staleness curve: multiplier[{k}]={m!r} must be a positive finite number")
        if self.promote_inverses not in ("at_cycle_end", "when_ready"):
            raise ValueError(f"staleness curve: promote_inverses={self.promote_inverses!r}: at_cycle_end or when_ready")

    @property
    def max_k(self) -> int:
        return max(self.multiplier)

    def at(self, k: int) -> float | None:
        """The multiplier of interval ``k``: measured, else interpolated linearly between the nearest
        measured intervals; None beyond the largest measured k."""
        if k in self.multiplier:
            return float(self.multiplier[k])
        if k > self.max_k or k < 1:
            return None
        lo = max(x for x in self.multiplier if x < k)
        hi = min(x for x in self.multiplier if x > k)
        frac = (k - lo) / (hi - lo)
        return float(self.multiplier[lo] + frac * (self.multiplier[hi] - self.multiplier[lo]))


def load_staleness_curve(path: str | Path) -> StalenessCurve:
    """Read a staleness-curve file ([Note: the staleness-curve file]); ValueError naming the path and
    the problem for a missing file, bad JSON or bad values."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"staleness curve {path}: no such file (the convergence study writes "
                         f"staleness_b<batch>.json into its --out)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"staleness curve {path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("multiplier"), dict):
        raise ValueError(f'staleness curve {path}: needs an object with "multiplier": {{"1": 1.0, "2": ..., ...}}')
    try:
        mult = {int(k): v for k, v in raw["multiplier"].items()}
    except ValueError:
        raise ValueError(f"staleness curve {path}: multiplier keys must be intervals k (integers), got "
                         f"{sorted(raw['multiplier'])}") from None
    details = {k: v for k, v in raw.items() if k not in ("multiplier", "promote_inverses", "source")}
    try:
        return StalenessCurve(mult, raw.get("promote_inverses", "at_cycle_end"), str(raw.get("source", path)), details)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
