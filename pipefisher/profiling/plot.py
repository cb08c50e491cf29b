"""Timeline pictures (PDF and PNG) and the utilization table of a list of events.

The picture has one row per worker, worker 0 on top. Each row has two lanes::

    W0  83% |[ F0 ][ F1 ]      [ B0 ][ STEP ]     compute lane: F, B, K-FAC work, optimizer step
            |////      ///////        ////        comm lane (hatched): SEND/RECV waits, syncs

so an asynchronous all-reduce that overlaps compute stays visible, and empty space in the compute
lane is a bubble. Dashed vertical lines mark where each worker's next step begins.

Drawing uses one ``broken_barh`` per (worker, kind), so a few thousand events draw in well under a
second. matplotlib is used through ``Figure`` directly (Agg canvas): no pyplot state, no backend
switch for the caller.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path


from pipefisher.profiling.nsys import parse_action_name
from pipefisher.profiling.utilization import host_spans_ns, utilization_per_host
from pipefisher.timeline import Event, busy_ns

__all__ = ["KIND_COLORS", "OVERSUBSCRIBED_NOTE", "plot_timeline", "utilization_table"]

log = logging.getLogger(__name__)

# One hue per kind. F and B are the pipeline's own work; the K-FAC kinds get hues of their own so
# the PipeFisher picture tells curvature, inversion and preconditioning apart; communication
# kinds are light and hatched.
KIND_COLORS: dict[str, str] = {
    "F": "#1f77b4",  # blue
    "B": "#ff7f0e",  # orange
    "CURV_A": "#9467bd",  # purple
    "CURV_B": "#e377c2",  # pink
    "INVERT": "#d62728",  # red
    "PRECOND": "#bcbd22",  # olive
    "STEP": "#7f7f7f",  # grey
    "SEND_F": "#aec7e8",
    "RECV_F": "#aec7e8",
    "SEND_B": "#ffbb78",
    "RECV_B": "#ffbb78",
    "SYNC_GRAD": "#98df8a",  # light green
    "SYNC_FACTOR": "#9edae5",  # light cyan
}
_FALLBACK_COLORS = ("#8c564b", "#17becf", "#2ca02c", "#c49c94", "#dbdb8d", "#c5b0d5")
_COMM_PREFIXES = ("SEND_", "RECV_", "SYNC_")
_LABELLED_KINDS = frozenset({"F", "B"})

OVERSUBSCRIBED_NOTE = ("more workers than CPU cores: one worker's bubble is another's compute, so "
                       "these CPU utilization figures do not carry over to a cluster")

# Row geometry in data units (row w spans [w - 0.5, w + 0.5]; the y axis is inverted).
_COMPUTE_LANE = (-0.42, 0.60)  # offset from the row centre, height
_COMM_LANE = (0.20, 0.22)
_LABEL_FONT_PT = 7.0


def _is_comm(kind: str) -> bool:
    return kind.startswith(_COMM_PREFIXES)


def _time_unit(span_ns: int) -> tuple[str, float]:
    """A readable unit for a time span: (name, ns per unit)."""
    for name, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if span_ns >= 10 * scale:
            return name, scale
    return "ns", 1.0


def _fmt_ns(ns: float) -> str:
    unit, scale = _time_unit(int(ns))
    return f"{ns / scale:.1f} {unit}"


def _kind_order(kinds: set[str]) -> list[str]:
    known = [k for k in KIND_COLORS if k in kinds]
    return known + sorted(kinds - set(KIND_COLORS))


def _colors_for(kinds: list[str]) -> dict[str, str]:
    unknown = [k for k in kinds if k not in KIND_COLORS]
    colors = {k: KIND_COLORS[k] for k in kinds if k in KIND_COLORS}
    colors.update({k: _FALLBACK_COLORS[i % len(_FALLBACK_COLORS)] for i, k in enumerate(unknown)})
    return colors


def _num_workers(events: Sequence[Event], num_workers: int | None) -> int:
    seen = max(e.worker for e in events) + 1
    if num_workers is not None and num_workers < seen:
        raise ValueError(f"num_workers={num_workers} but the events include worker {seen - 1}; "
                         f"pass num_workers >= {seen} or leave it None")
    return seen if num_workers is None else num_workers


def _stem_path(out_path_stem: str | Path, suffix: str) -> Path:
    stem = Path(out_path_stem)
    if stem.suffix.lower() in (".pdf", ".png"):
        stem = stem.with_suffix("")
    return stem.with_name(stem.name + suffix)


def plot_timeline(events: Sequence[Event], out_path_stem: str | Path, *, title: str | None = None,
                  num_workers: int | None = None, oversubscribed: bool = False,
                  hosts: Mapping[int, str] | None = None) -> list[Path]:
    """Draw a timeline of ``events`` and save it as ``{stem}.pdf`` and ``{stem}.png``.

    Args:
        events: the events of all workers (simulated or recorded).
        out_path_stem: output path without extension (a ``.pdf``/``.png`` suffix is dropped);
            parent directories are created.
        title: first title line; the second states the overall bubble utilization.
        num_workers: rows to draw (defaults to the highest worker seen + 1); workers without
            events show as empty rows with 0% utilization.
        oversubscribed: the run had more workers than CPU cores; adds :data:`OVERSUBSCRIBED_NOTE`.
        hosts: ``{worker: host}``: utilization is measured on each host's own clock
            (``pipefisher.profiling.utilization``); None: one clock.

    Returns:
        ``[pdf_path, png_path]``.

    Raises:
        ValueError: no events, or ``num_workers`` smaller than the workers seen.
    """
    if not events:
        raise ValueError("no events to plot; simulate or profile at least one step first")
    n_workers = _num_workers(events, num_workers)
    t0 = min(e.start_ns for e in events)
    span = max(e.end_ns for e in events) - t0
    unit, scale = _time_unit(span)
    util = utilization_per_host(events, n_workers, hosts)
    overall = sum(util.values()) / len(util) if util else 0.0

    # matplotlib is imported here, not at the top: every worker imports this package, few draw.
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig = Figure(figsize=(12.0, max(2.6, 1.3 + 0.55 * n_workers)))
    ax = fig.add_subplot()
    by_row_kind: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        by_row_kind[(e.worker, e.kind)].append(((e.start_ns - t0) / scale, e.duration_ns / scale))
    colors = _colors_for(_kind_order({e.kind for e in events}))
    for (w, kind), ranges in by_row_kind.items():
        offset, height = _COMM_LANE if _is_comm(kind) else _COMPUTE_LANE
        style = dict(hatch="////", edgecolor="#555555", linewidth=0.3) if _is_comm(kind) \
            else dict(edgecolor="white", linewidth=0.5)
        ax.broken_barh(ranges, (w + offset, height), facecolors=colors[kind], **style)

    # Micro-batch numbers inside F/B boxes wide enough to hold them (widths in points).
    ax_width_pt = fig.get_figwidth() * ax.get_position().width * 72.0
    pt_per_ns = ax_width_pt / span if span > 0 else 0.0
    lane_mid = _COMPUTE_LANE[0] + _COMPUTE_LANE[1] / 2
    for e in events:
        if e.kind not in _LABELLED_KINDS:
            continue
        parsed = parse_action_name(e.name)
        if parsed is None or parsed[1] is None:
            continue
        label = str(parsed[1])
        if e.duration_ns * pt_per_ns < (0.65 * len(label) + 0.6) * _LABEL_FONT_PT:
            continue
        ax.text((e.start_ns - t0 + e.duration_ns / 2) / scale, e.worker + lane_mid, label,
                ha="center", va="center", fontsize=_LABEL_FONT_PT, color="white", clip_on=True)

    # Step boundaries: where each worker starts its next step.
    step_start: dict[tuple[int, int], int] = {}
    for e in events:
        key = (e.worker, e.step)
        step_start[key] = min(step_start.get(key, e.start_ns), e.start_ns)
    first_step = {w: min(s for (ww, s) in step_start if ww == w) for w, _ in step_start}
    bounds = [((t - t0) / scale, w) for (w, s), t in step_start.items() if s > first_step[w]]
    if bounds:
        ax.vlines([x for x, _ in bounds], [w - 0.5 for _, w in bounds], [w + 0.5 for _, w in bounds],
                  colors="black", linestyles="--", linewidth=0.9, zorder=3)

    ax.set_xlim(0, span / scale if span > 0 else 1.0)
    ax.set_ylim(n_workers - 0.5, -0.5)  # worker 0 on top
    ax.set_yticks(range(n_workers))
    ax.set_yticklabels([f"W{w}  {util.get(w, 0.0):.0%}" for w in range(n_workers)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("worker  (utilization)")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    steps = len({e.step for e in events})
    stats = (f"bubble utilization {overall:.1%} over {n_workers} workers, "
             f"{steps} step{'s' if steps != 1 else ''}, wall {_fmt_ns(span)}")
    lines = ([title] if title else []) + [stats] + (["note: " + OVERSUBSCRIBED_NOTE]
                                                    if oversubscribed else [])
    ax.set_title("\n".join(lines), fontsize=10)

    handles = []
    for kind in colors:
        comm = _is_comm(kind)
        handles.append(Patch(facecolor=colors[kind], edgecolor="#555555" if comm else "none",
                             hatch="////" if comm else None, label=kind))
    if bounds:
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=0.9, label="next step"))
    ax_height_in = fig.get_figheight() * ax.get_position().height
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / ax_height_in),
              ncol=min(len(handles), 12), frameon=False, fontsize=8)  # below the x label

    paths = [_stem_path(out_path_stem, ".pdf"), _stem_path(out_path_stem, ".png")]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for p in paths:
        fig.savefig(p, dpi=150, bbox_inches="tight")
    log.info("wrote timeline of %d events (%d workers) to %s", len(events), n_workers,
             ", ".join(map(str, paths)))
    return paths


def utilization_table(events: Sequence[Event], num_workers: int | None = None, *,
                      oversubscribed: bool = False, hosts: Mapping[int, str] | None = None) -> str:
    """Per-worker busy time and utilization and the overall bubble utilization, as text.

    Busy time is the union of compute intervals (``timeline.COMPUTE_KINDS``) over the wall time
    spanned by the events of the worker's host, on that host's clock (DESIGN.md, "Bubble
    utilization"; ``pipefisher.profiling.utilization``).

    Args:
        events: the events of all workers.
        num_workers: workers to list (defaults to those seen).
        oversubscribed: the run had more workers than CPU cores; appends :data:`OVERSUBSCRIBED_NOTE`.
        hosts: ``{worker: host}``; None: all workers on one clock.

    Returns:
        A few lines, e.g.::

            worker       busy   utilization
            W0        24.0 µs         75.0%
            W1        24.0 µs         75.0%
            overall bubble utilization 75.0% (2 workers, wall 32.0 µs, 1 step)
    """
    if not events:
        return "no events: nothing to measure"
    n_workers = _num_workers(events, num_workers) if num_workers is not None else None
    util = utilization_per_host(events, n_workers, hosts)
    busy = busy_ns(events)
    wall = max(host_spans_ns(events, hosts).values())
    rows = [f"{'worker':<8}{'busy':>12}{'utilization':>14}"]
    rows += [f"{'W' + str(w):<8}{_fmt_ns(busy.get(w, 0)):>12}{u:>14.1%}" for w, u in util.items()]
    steps = len({e.step for e in events})
    overall = sum(util.values()) / len(util) if util else 0.0
    per_host = f", {len(set(hosts.values()))} hosts, each on its own clock" if hosts and len(set(hosts.values())) > 1 else ""
    rows.append(f"overall bubble utilization {overall:.1%} "
                f"({len(util)} workers{per_host}, wall {_fmt_ns(wall)}, {steps} step{'s' if steps != 1 else ''})")
    if oversubscribed:
        rows.append("note: " + OVERSUBSCRIBED_NOTE)
    return "\n".join(rows)
