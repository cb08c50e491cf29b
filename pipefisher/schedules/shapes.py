"""Shape helpers shared by the schedule generators (``generators``, ``zero_bubble``): checks of
the requested shape, one-pipe placements and per-group replication of per-position orders."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipefisher.schedules.ir import Action, Placement

__all__ = ["bidirectional_placement", "check_common", "check_v_shape", "linear_placement", "multiple_hint", "replicate"]


def check_common(num_stages: int, num_micro_batches: int, dp_width: int) -> None:
    """Refuse a shape that is not positive integers, naming the config field and the fix."""
    for name, value in (("stages", num_stages), ("num_micro_batches", num_micro_batches),
                        ("data_parallel", dp_width)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive integer; use {name}=1 or more")


def check_v_shape(method: str, num_stages: int, num_micro_batches: int, dp_width: int, num_virtual: int,
                  why: str = "micro-batches to fill its V", alternative: str = "") -> None:
    """:func:`check_common`, then what every V schedule (two chunks per worker) needs: num_virtual = 2
    and N >= 2D; ``why`` and ``alternative`` finish the message of the second."""
    check_common(num_stages, num_micro_batches, dp_width)
    if num_virtual != 2:
        raise ValueError(f"pipeline.num_virtual={num_virtual!r}: {method} places exactly 2 model chunks per "
                         f"worker; use pipeline.num_virtual=2 (what pipeline={method} sets)")
    if num_micro_batches < 2 * num_stages:
        raise ValueError(f"num_micro_batches={num_micro_batches}: {method} needs at least 2 x stages = "
                         f"{2 * num_stages} {why}; use num_micro_batches={2 * num_stages} or more{alternative}")


def multiple_hint(value: int, of: int) -> str:
    """The nearest multiples of ``of`` around ``value``, as config values for an error message."""
    lower = value // of * of
    upper = lower + of
    return f"num_micro_batches={lower} or {upper}" if lower >= of else f"num_micro_batches={upper}"


def linear_placement(num_stages: int, num_workers_per_group: int, dp_width: int,
                     position_of_stage: Callable[[int], int]) -> Placement:
    """One pipe; stage s of data-parallel group dp on worker ``dp * workers_per_group + position``."""
    workers = {
        (dp, 0, s): dp * num_workers_per_group + position_of_stage(s)
        for dp in range(dp_width)
        for s in range(num_stages)
    }
    return Placement(num_stages=num_stages, num_pipes=1, dp_width=dp_width, workers=workers)


def bidirectional_placement(num_stages: int, dp_width: int) -> Placement:
    """Chimera's two pipes: in data-parallel group dp, worker dp * D + r holds stage r of pipe 0
    (down) and stage D - 1 - r of pipe 1 (up)."""
    d = num_stages
    workers = {}
    for dp in range(dp_width):
        for r in range(d):
            workers[(dp, 0, r)] = dp * d + r
            workers[(dp, 1, d - 1 - r)] = dp * d + r
    return Placement(num_stages=d, num_pipes=2, dp_width=dp_width, workers=workers)


def replicate(orders: Sequence[Sequence[Action]], dp_width: int) -> dict[int, tuple[Action, ...]]:
    """Give every data-parallel group the same per-position orders (worker = dp * D + position)."""
    d = len(orders)
    return {dp * d + pos: tuple(order) for dp in range(dp_width) for pos, order in enumerate(orders)}
