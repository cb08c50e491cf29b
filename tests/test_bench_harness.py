"""``bench/_harness.py``'s rotated rounds (:func:`rotated`, :func:`timed_rotation`, :func:`timed_rounds`), which
the side-by-side benchmarks (v_gap, optimizer_placement, executor_overhead, vs_torch_pipelining, zero_bubble) time
their variants with: each round's order is the keys rotated by the round, the warm-up is not reported, every
rank's events come back on rank 0, and a step is timed on the slowest rank."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.runtime.teardown import release_process_group
from tests.conftest import load_bench

h = load_bench("_harness", "_harness")


class _Fake:
    """A stand-in worker: records the steps it ran; its step's events name rank, key and step."""

    def __init__(self, key: str, rank: int, sleep_s: float = 0.0) -> None:
        self.key, self.rank, self.sleep_s, self.steps = key, rank, sleep_s, []

    def train_step(self, step: int):
        self.steps.append(step)
        time.sleep(self.sleep_s)
        return [0.0], SimpleNamespace(events=[(self.rank, self.key, step)])


def test_rotated_gives_every_item_every_position() -> None:
    assert [h.rotated("ABC", r) for r in range(4)] == [list("ABC"), list("BCA"), list("CAB"), list("ABC")]
    assert h.rotated((1, 2), 5) == [2, 1]


def test_timed_rounds_one_rank_rotates_skips_the_warm_up_and_steps_every_worker_each_round(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        workers = {k: _Fake(k, 0, sleep_s=0.01 if k == "b" else 0.0) for k in ("a", "b", "c")}
        got = list(h.timed_rounds(workers, warmup=2, rounds=3))
        plain = list(h.timed_rotation({"p": lambda step: step * 10, "q": lambda step: -step}, warmup=1, rounds=1))
    finally:
        release_process_group()
    assert [k for k, _, _ in got] == [k for step in (2, 3, 4) for k in h.rotated(["a", "b", "c"], step)]
    assert all(events == [(0, k, step)] for (k, _, events), step in zip(got, [2] * 3 + [3] * 3 + [4] * 3))
    assert all(w.steps == [0, 1, 2, 3, 4] for w in workers.values())
    assert all(seconds >= 0.01 for k, seconds, _ in got if k == "b")
    # timed_rotation yields the warm-up too, with each runner's return value
    assert [(step, k, value) for step, k, _, value in plain] == [(0, "p", 0), (0, "q", 0), (1, "q", -1), (1, "p", 10)]


def test_timed_rotation_with_rounds_per_key_drops_a_runner_after_its_own_rounds(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        got = [(step, k) for step, k, _, _ in h.timed_rotation({"a": lambda s: s, "b": lambda s: s, "c": lambda s: s},
                                                               warmup=1, rounds={"a": 2, "b": 4, "c": 3})]
    finally:
        release_process_group()
    assert got == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b"),
                   (3, "c"), (3, "b"), (4, "b")]  # a runs 1 + 2 rounds, c 1 + 3, b 1 + 4; the rest still rotate


def _two_ranks(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        # Rank 1 is the slow one: rank 0's seconds must still include its 50 ms.
        workers = {k: _Fake(k, rank, sleep_s=0.05 if rank == 1 else 0.0) for k in ("x", "y")}
        got = list(h.timed_rounds(workers, warmup=1, rounds=2))
    finally:
        release_process_group()
    Path(out_dir, f"rank{rank}.txt").write_text(repr((got, {k: w.steps for k, w in workers.items()})))


@pytest.mark.slow
def test_timed_rounds_gathers_every_ranks_events_on_rank_0_and_times_the_slowest(tmp_path: Path) -> None:
    mp.spawn(_two_ranks, args=(str(tmp_path),), nprocs=2, join=True)
    got0, steps0 = eval((tmp_path / "rank0.txt").read_text())  # noqa: S307 (our own repr of tuples)
    got1, steps1 = eval((tmp_path / "rank1.txt").read_text())  # noqa: S307
    assert got1 == []
    assert steps0 == steps1 == {"x": [0, 1, 2], "y": [0, 1, 2]}
    assert [k for k, _, _ in got0] == ["y", "x", "x", "y"]  # rounds 1 and 2 of the rotation
    assert [sorted(events) for _, _, events in got0] == [[(0, k, s), (1, k, s)] for k, s in
                                                         [("y", 1), ("x", 1), ("x", 2), ("y", 2)]]
    assert all(seconds >= 0.05 for _, seconds, _ in got0)
