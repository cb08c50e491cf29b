"""The convergence calibration: steps to a held-out loss per optimizer, relative to a reference optimizer
(issue 37, item 1). The strategy search multiplies it by the predicted step to rank by time to target.

Entry points: :func:`read_calibration` (checked; one ``CalibrationError`` line naming the field),
:func:`calibration_document` / :func:`write_calibration` (what ``bench/convergence.py --calibration-out``
writes), :class:`Calibration` (``steps_multiplier``, ``reference_steps``).

[Note: the calibration file] (``docs/time-to-target.md`` has an example)::

    format           "pipefisher-calibration/1"
    method           "budget": Wen et al. (arXiv 2509.02046): runs at several budgets, each with its own lr
                     schedule ending at its budget (lr tuned per budget); speed-up at a loss L = the budget the
                     reference needs for a final held-out loss L over the budget the optimizer needs
                     (interpolated in log budget). "fixed-schedule": steps to targets inside one schedule (the
                     ratios depend on where a target sits in it: issue 37)
    model            {"name", "num_layers", "hidden_size", "num_heads", "vocab_size"}: what ran
    batch            {"global_batch", "seq_len", "max_predictions"}
    data             {"train", "heldout"}: the texts (the held-out loss is the target's)
    seeds            [int, ...]: the seeds of every arm
    hardware         where the runs ran (steps do not depend on it; for the record)
    reference        the optimizer every speed-up is relative to (train.py's optimizer name)
    budgets          [int, ...]: the run lengths (the budget method's budgets; fixed-schedule: its one length)
    reference_steps  [{"loss", "steps"}, ...]: the reference's steps to each held-out loss, loss decreasing
    optimizers       [{"optimizer", "k", "promote_inverses", "max_staleness", "speedup": [{"loss", "value",
                     "low", "high"}, ...]}, ...]: per optimizer (K-FAC and PipeFisher per refresh interval k and
                     promotion rule), reference steps / its steps at each loss (> 1: fewer steps), the seed
                     interval [low, high] over seed pairs; loss decreasing
    provenance       how the file was made (command, runs)
    limits           what it does not cover (one model, one batch, targets, ...)

A speed-up is read at a loss by linear interpolation between its points and is undefined outside them (no
extrapolation). An entry for K-FAC or PipeFisher at interval k serves a plan at k; a plan at another k takes the
nearest larger k measured (staler curvature costs steps, not fewer), else it counts as not calibrated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipefisher.atomic import write_text_atomic
from pipefisher.config import OPTIMIZERS, PROMOTE_INVERSES, ConfigError

__all__ = ["CALIBRATION_FORMAT", "METHODS", "Calibration", "CalibrationError", "Speedup", "calibration_document",
           "parse_calibration", "read_calibration", "write_calibration"]

CALIBRATION_FORMAT = "pipefisher-calibration/1"
METHODS = ("budget", "fixed-schedule")
_K_OPTIMIZERS = ("kfac", "pipefisher")
_FIX = "fix it, or write the file with `python bench/convergence.py --calibration-from DIR... --calibration-out FILE`"


class CalibrationError(ConfigError):
    """A calibration file that cannot be used; the message names the file, the field and the fix."""


@dataclass(frozen=True)
class Speedup:
    """Reference steps over an optimizer's steps at one held-out loss, with the seed interval."""

    loss: float
    value: float
    low: float
    high: float


@dataclass(frozen=True)
class Entry:
    """One optimizer (at one refresh interval and promotion rule for K-FAC and PipeFisher)."""

    optimizer: str
    k: int | None
    promote_inverses: str | None
    max_staleness: int | None
    speedup: tuple[Speedup, ...]  # loss decreasing


def _interpolate(points: Sequence[tuple[float, float]], loss: float) -> float | None:
    """Linear interpolation of (loss, y) points at ``loss``; None outside their losses."""
    pts = sorted(points)
    if not pts or not pts[0][0] <= loss <= pts[-1][0]:
        return None
    for (l0, y0), (l1, y1) in zip(pts, pts[1:]):
        if l0 <= loss <= l1:
            return y0 if l1 == l0 else y0 + (y1 - y0) * (loss - l0) / (l1 - l0)
    return pts[0][1]


@dataclass(frozen=True)
class Calibration:
    """A checked calibration file ([Note: the calibration file])."""

    path: str
    method: str
    model: Mapping[str, Any]
    batch: Mapping[str, Any]
    data: Mapping[str, Any]
    seeds: tuple[int, ...]
    hardware: str
    reference: str
    budgets: tuple[int, ...]
    reference_curve: tuple[tuple[float, float], ...]  # (loss, steps), loss decreasing
    entries: tuple[Entry, ...]
    provenance: str
    limits: str

    @property
    def loss_range(self) -> tuple[float, float]:
        """(lowest, highest) held-out loss the reference's steps cover."""
        losses = [loss for loss, _ in self.reference_curve]
        return min(losses), max(losses)

    @property
    def default_target(self) -> float:
        """The hardest (lowest) loss the reference's steps cover."""
        return self.loss_range[0]

    def reference_steps(self, loss: float) -> float | None:
        """The reference's steps to ``loss`` (interpolated); None outside its losses."""
        return _interpolate(self.reference_curve, loss)

    def steps_to(self, loss: float, field: str = "target_loss") -> float:
        """:meth:`reference_steps`, refusing a loss outside the reference's range.

        Raises:
            CalibrationError: ``loss`` outside :attr:`loss_range`; the message names ``field`` (the key or flag
                the loss came from), the range and this file.
        """
        steps = self.reference_steps(loss)
        if steps is None:
            lo, hi = self.loss_range
            raise CalibrationError(f"{field}={loss:g}: the calibration's reference covers held-out losses "
                                   f"{lo:g} .. {hi:g}; give a target inside them ({self.path})")
        return steps

    def entry(self, optimizer: str, k: int | None = None, promote: str | None = None) -> Entry | None:
        """The entry serving ``optimizer`` (at refresh interval ``k``): the same k, else the nearest larger one;
        among equal k, the one measured under ``promote`` (then any)."""
        rows = [e for e in self.entries if e.optimizer == optimizer]
        if optimizer not in _K_OPTIMIZERS or not rows:
            return rows[0] if rows else None
        want = k or 1
        later = sorted((e for e in rows if (e.k or 1) >= want),
                       key=lambda e: (e.k or 1, promote is not None and e.promote_inverses != promote))
        return later[0] if later else None

    def steps_multiplier(self, optimizer: str, k: int | None, loss: float,
                         promote: str | None = None) -> tuple[float, float, float] | None:
        """(value, low, high) of ``optimizer``'s steps to ``loss`` over the reference's: 1 / speed-up, its seed
        interval inverted; None where the file has no entry for it or its points do not cover ``loss``."""
        if optimizer == self.reference:
            return 1.0, 1.0, 1.0
        e = self.entry(optimizer, k, promote)
        if e is None:
            return None
        value = _interpolate([(p.loss, p.value) for p in e.speedup], loss)
        if value is None:
            return None
        low = _interpolate([(p.loss, p.low) for p in e.speedup], loss)
        high = _interpolate([(p.loss, p.high) for p in e.speedup], loss)
        return 1.0 / value, 1.0 / high, 1.0 / low

    def describe(self) -> str:
        """One line: where the steps came from."""
        b = self.batch
        budgets = (f"budgets {', '.join(map(str, self.budgets))}" if self.method == "budget"
                   else f"one {self.budgets[0]}-step schedule")
        return (f"calibration {self.path}: {self.method} method ({budgets}), {self.model.get('name', '?')} "
                f"(L={self.model['num_layers']}, H={self.model['hidden_size']}), batch {b['global_batch']} x "
                f"{b['seq_len']} tokens, {len(self.seeds)} seed(s), reference {self.reference}, held-out "
                f"{self.data.get('heldout', '?')}")


# -- reading -------------------------------------------------------------------------------------


def _error(path: str, name: str, why: str) -> CalibrationError:
    return CalibrationError(f"calibration={path}: field {name} {why}; {_FIX}")


def _int(value: Any, path: str, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _error(path, name, f"is {value!r}, not an integer >= {minimum}")
    return value


def _positive(value: Any, path: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _error(path, name, f"is {value!r}, not a positive number")
    return float(value)


def _number(value: Any, path: str, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _error(path, name, f"is {value!r}, not a number")
    return float(value)


def _decreasing(losses: Sequence[float], path: str, name: str) -> None:
    if any(b >= a for a, b in zip(losses, losses[1:])):
        raise _error(path, name, f"has losses {list(losses)}, not strictly decreasing; list the points from the "
                     f"highest loss to the lowest")


def _entry(raw: Any, path: str, i: int) -> Entry:
    where = f"optimizers[{i}]"
    if not isinstance(raw, dict):
        raise _error(path, where, f"is {raw!r}, not an object")
    opt = raw.get("optimizer")
    if opt not in OPTIMIZERS:
        raise _error(path, f"{where}.optimizer", f"is {opt!r}; use one of {', '.join(OPTIMIZERS)}")
    k = raw.get("k")
    if k is not None or opt == "pipefisher":
        k = _int(k, path, f"{where}.k")
    if k is not None and opt not in _K_OPTIMIZERS:
        raise _error(path, f"{where}.k", f"is {k}, but {opt} has no refresh interval; drop it")
    promote = raw.get("promote_inverses")
    if promote is not None and promote not in PROMOTE_INVERSES:
        raise _error(path, f"{where}.promote_inverses", f"is {promote!r}; use one of {', '.join(PROMOTE_INVERSES)}")
    staleness = raw.get("max_staleness")
    if staleness is not None:
        _int(staleness, path, f"{where}.max_staleness")
    points = raw.get("speedup")
    if not isinstance(points, list) or not points:
        raise _error(path, f"{where}.speedup", "is missing or empty: give [{loss, value, low, high}, ...]")
    out = []
    for j, p in enumerate(points):
        at = f"{where}.speedup[{j}]"
        if not isinstance(p, dict):
            raise _error(path, at, f"is {p!r}, not an object")
        loss = _number(p.get("loss"), path, f"{at}.loss")
        value = _positive(p.get("value"), path, f"{at}.value")
        low = _positive(p.get("low", value), path, f"{at}.low")
        high = _positive(p.get("high", value), path, f"{at}.high")
        if not low <= value <= high:
            raise _error(path, at, f"has low={low:g}, value={value:g}, high={high:g}; need low <= value <= high")
        out.append(Speedup(loss, value, low, high))
    _decreasing([p.loss for p in out], path, f"{where}.speedup")
    return Entry(opt, k, promote, staleness, tuple(out))


def read_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file ([Note: the calibration file]).

    Raises:
        CalibrationError: unreadable, not JSON, a missing or bad field, two entries for one optimizer (and k);
            one line naming the file, the field and the fix.
    """
    p = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CalibrationError(f"calibration={p}: cannot be read ({exc.strerror}); {_FIX}") from None
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"calibration={p}: not JSON ({exc.msg}, line {exc.lineno}); {_FIX}") from None
    return parse_calibration(doc, p)


def parse_calibration(doc: Any, p: str) -> Calibration:
    """Check a calibration document read from ``p`` (:func:`read_calibration`'s checks and errors)."""
    if not isinstance(doc, dict) or doc.get("format") != CALIBRATION_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise _error(p, "format", f"is {got!r}, not {CALIBRATION_FORMAT!r}")
    if doc.get("method") not in METHODS:
        raise _error(p, "method", f"is {doc.get('method')!r}; use one of {', '.join(METHODS)}")
    for group, keys in (("model", ("num_layers", "hidden_size", "num_heads", "vocab_size")),
                        ("batch", ("global_batch", "seq_len", "max_predictions"))):
        if not isinstance(doc.get(group), dict):
            raise _error(p, group, f"is {doc.get(group)!r}, not an object with {', '.join(keys)}")
        for k in keys:
            _int(doc[group].get(k), p, f"{group}.{k}")
    if not isinstance(doc.get("data"), dict) or not doc["data"].get("heldout"):
        raise _error(p, "data", "needs {train, heldout}: the texts the runs trained on and were evaluated on")
    seeds = doc.get("seeds")
    if not isinstance(seeds, list) or not seeds:
        raise _error(p, "seeds", f"is {seeds!r}, not a non-empty list of seeds")
    for i, s in enumerate(seeds):
        _int(s, p, f"seeds[{i}]", minimum=0)
    for name in ("hardware", "provenance", "limits"):
        if not isinstance(doc.get(name), str) or not doc[name].strip():
            raise _error(p, name, f"is {doc.get(name)!r}: say it in words (where the runs ran, how the file was "
                         f"made, what it does not cover)")
    if doc.get("reference") not in OPTIMIZERS:
        raise _error(p, "reference", f"is {doc.get('reference')!r}; use one of {', '.join(OPTIMIZERS)}")
    budgets = doc.get("budgets")
    if not isinstance(budgets, list) or not budgets:
        raise _error(p, "budgets", f"is {budgets!r}, not a non-empty list of run lengths in steps")
    for i, b in enumerate(budgets):
        _int(b, p, f"budgets[{i}]")
    if doc["method"] == "budget" and len(budgets) < 2:
        raise _error(p, "budgets", f"is {budgets}: the budget method needs runs at two budgets or more")
    curve = doc.get("reference_steps")
    if not isinstance(curve, list) or not curve:
        raise _error(p, "reference_steps", "is missing or empty: give [{loss, steps}, ...]")
    ref = []
    for i, point in enumerate(curve):
        if not isinstance(point, dict):
            raise _error(p, f"reference_steps[{i}]", f"is {point!r}, not an object")
        ref.append((_number(point.get("loss"), p, f"reference_steps[{i}].loss"),
                    _positive(point.get("steps"), p, f"reference_steps[{i}].steps")))
    _decreasing([loss for loss, _ in ref], p, "reference_steps")
    raw = doc.get("optimizers")
    if not isinstance(raw, list):
        raise _error(p, "optimizers", f"is {raw!r}, not a list of per-optimizer entries")
    entries = tuple(_entry(e, p, i) for i, e in enumerate(raw))
    seen: dict[tuple[str, int | None, str | None], int] = {}
    for i, e in enumerate(entries):
        key = (e.optimizer, e.k, e.promote_inverses)
        if key in seen:
            raise _error(p, f"optimizers[{i}]", f"repeats optimizers[{seen[key]}] ({e.optimizer}, k={e.k}, "
                         f"promote_inverses={e.promote_inverses}); keep one")
        seen[key] = i
    return Calibration(p, doc["method"], dict(doc["model"]), dict(doc["batch"]), dict(doc["data"]), tuple(seeds),
                       doc["hardware"], doc["reference"], tuple(budgets), tuple(ref), entries, doc["provenance"],
                       doc["limits"])


# -- writing -------------------------------------------------------------------------------------


def calibration_document(*, method: str, model: Mapping[str, Any], batch: Mapping[str, Any],
                         data: Mapping[str, Any], seeds: Sequence[int], hardware: str, reference: str,
                         budgets: Sequence[int], reference_steps: Sequence[tuple[float, float]],
                         optimizers: Sequence[Mapping[str, Any]], provenance: str, limits: str) -> dict[str, Any]:
    """The JSON document ([Note: the calibration file]); ``reference_steps``: (loss, steps) pairs,
    ``optimizers``: entries as the file holds them (``speedup`` points as dicts)."""
    return {
        "format": CALIBRATION_FORMAT, "method": method, "model": dict(model), "batch": dict(batch),
        "data": dict(data), "seeds": list(seeds), "hardware": hardware, "reference": reference,
        "budgets": list(budgets),
        "reference_steps": [{"loss": round(loss, 5), "steps": round(steps, 1)}
                            for loss, steps in sorted(reference_steps, reverse=True)],
        "optimizers": [dict(e) for e in optimizers], "provenance": provenance, "limits": limits,
    }


def write_calibration(path: str | Path, doc: Mapping[str, Any]) -> Path:
    """Check ``doc`` (:func:`parse_calibration`) and write it atomically; returns the path."""
    parse_calibration(json.loads(json.dumps(doc)), str(path))
    return write_text_atomic(Path(path), json.dumps(doc, indent=1) + "\n")
