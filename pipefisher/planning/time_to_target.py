"""Rank strategies by predicted time to a held-out target: steps (the calibration) × predicted step (the
simulator, under the memory budget) (issue 37, item 2; DESIGN.md "Time to target = steps × step cost").

Entry points: :func:`rank_by_time_to_target` (the ranking and its notes), :func:`time_lines` (the table: the
throughput rank beside the time-to-target rank).

Trajectories do not depend on placement (every method equals one process, tested), so an optimizer's steps to a
target are the calibration's for every layout and schedule: reference steps to the target × the optimizer's
steps multiplier (PipeFisher's at its plan's k). An optimizer the calibration lacks, or whose points do not reach
the target, keeps the reference's steps: it is ranked by throughput alone, and a note says so in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pipefisher.planning.calibration import Calibration

__all__ = ["rank_by_time_to_target", "time_lines"]


def rank_by_time_to_target(ranked: Sequence[Any], calibration: Calibration | None,
                           target_loss: float | None = None, *, model: Any = None,
                           global_batch: int | None = None, promote: str | None = "when_ready"
                           ) -> tuple[list[Any], list[str]]:
    """The feasible strategies with their throughput rank and, with a calibration, their time to target and its
    rank, best time first; and the notes to print beside the table.

    Args:
        ranked: feasible strategies (``samples_per_s``, ``step_time_s``, ``optimizer``, ``interval``); any order.
        calibration: the steps per optimizer, or None: rank by throughput alone.
        target_loss: the held-out loss; None: the calibration's hardest (``default_target``).
        model: the searched model (``num_layers``, ``hidden_size``), for the note when the calibration's differs.
        global_batch: the searched global batch, likewise.
        promote: PipeFisher's promotion rule in the plans (its entries measured under it are preferred).

    Returns:
        (strategies, notes): with ``throughput_rank`` set, and with a calibration ``steps_multiplier``,
        ``steps_low``, ``steps_high``, ``time_to_target_s`` and ``time_rank``.

    Raises:
        ValueError: ``target_loss`` outside the losses the calibration's reference covers (names the range).
    """
    by_speed = sorted(ranked, key=lambda c: -c.samples_per_s)
    out = [replace(c, throughput_rank=i) for i, c in enumerate(by_speed, 1)]
    if calibration is None:
        return out, ["no calibration: ranked by throughput alone (give calibration=<file> to rank by time to target)"]
    loss = calibration.default_target if target_loss is None else target_loss
    ref_steps = calibration.steps_to(loss)
    missing: set[str] = set()
    timed = []
    for c in out:
        m = calibration.steps_multiplier(c.optimizer, c.interval, loss, promote)
        if m is None:
            missing.add(c.optimizer if c.optimizer not in ("kfac", "pipefisher") else f"{c.optimizer} k={c.interval}")
            timed.append(replace(c, time_to_target_s=ref_steps * c.step_time_s))
        else:
            timed.append(replace(c, steps_multiplier=m[0], steps_low=m[1], steps_high=m[2],
                                 time_to_target_s=ref_steps * m[0] * c.step_time_s))
    timed.sort(key=lambda c: (c.time_to_target_s, c.throughput_rank))
    timed = [replace(c, time_rank=i) for i, c in enumerate(timed, 1)]
    notes = [f"time to target = steps to held-out loss {loss:g} ({calibration.reference}: {ref_steps:.0f} steps) x "
             f"steps multiplier x predicted step; {calibration.describe()}"]
    if missing:
        notes.append(f"{', '.join(sorted(missing))}: not in the calibration at loss {loss:g}: ranked by throughput "
                     f"alone ({calibration.reference}'s steps), marked *")
    if calibration.method != "budget":
        notes.append(f"the calibration's method is {calibration.method}: its ratios depend on where the target sits "
                     f"in its one schedule (issue 37); read its limits before trusting the order")
    if model is not None and (model.num_layers, model.hidden_size) != (calibration.model["num_layers"],
                                                                       calibration.model["hidden_size"]):
        notes.append(f"steps measured on {calibration.model.get('name', 'another model')} (L={calibration.model['num_layers']}, "
                     f"H={calibration.model['hidden_size']}), applied to L={model.num_layers}, H={model.hidden_size}: "
                     f"they transfer only as far as the optimizers' relative steps do (DESIGN.md)")
    if global_batch is not None and global_batch != calibration.batch["global_batch"]:
        notes.append(f"steps measured at global batch {calibration.batch['global_batch']}, ranked at {global_batch}")
    return timed, notes


def time_lines(ranked: Sequence[Any], top: int, noun: str, plural: str) -> list[str]:
    """Header and one line per strategy (at most ``top``): time-to-target rank beside throughput rank."""
    lines = [f"{'time#':>5}  {'tput#':>5}  {'to target':>10}  {'steps x':>14}  {'samples/s':>10}  {'step ms':>9}  "
             f"{'util':>6}  {'k':>2}  {'age':>3}  {'mem GB':>7}  {noun}"]
    for c in ranked[:top]:
        if c.steps_multiplier is None:
            steps = f"{'1.00*':>14}"
        else:
            steps = f"{c.steps_multiplier:.2f} [{c.steps_low:.2f}-{c.steps_high:.2f}]"
        age = "-" if c.curvature_age is None else str(c.curvature_age)
        lines.append(f"{c.time_rank:>5}  {c.throughput_rank:>5}  {_duration(c.time_to_target_s):>10}  {steps:>14}  "
                     f"{c.samples_per_s:>10.1f}  {c.step_time_s * 1e3:>9.2f}  {c.utilization:>6.1%}  {c.interval:>2}  "
                     f"{age:>3}  {c.memory_gb:>7.2f}  {c.label}")
    if len(ranked) > top:
        lines.append(f"      … {len(ranked) - top} more feasible {plural}")
    if not ranked:
        lines.append(f"      no {noun} fits: raise memory_gb or devices, or lower the batch")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.2f} min"
    return f"{seconds / 3600:.3g} h"
