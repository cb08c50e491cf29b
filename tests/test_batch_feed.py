"""BatchFeed: on CUDA the micro-batches a worker read last step are copied from pinned memory at the
step's start, before any action is timed; the first step and CPU runs read when asked (issue 25)."""

from __future__ import annotations

import torch

from pipefisher.runtime.batch_feed import BatchFeed


def _recording_read(calls: list[tuple[int, int]]):
    def read(step: int, mb: int) -> dict[str, torch.Tensor]:
        calls.append((step, mb))
        return {"input_ids": torch.full((2, 3), 100 * step + mb), "labels": torch.arange(3) + mb}
    return read


def test_on_cpu_batches_are_read_when_asked_and_never_ahead() -> None:
    calls: list[tuple[int, int]] = []
    feed = BatchFeed(_recording_read(calls), torch.device("cpu"))
    assert not feed.prefetch
    for step in range(2):
        feed.start_step(step)
        assert calls == [(s, mb) for s in range(step) for mb in (1, 0)]  # nothing read at the start
        assert feed.get(step, 1)["input_ids"][0, 0] == 100 * step + 1
        feed.get(step, 0)


def test_cuda_reads_last_step_s_micro_batches_at_the_start_pinned_and_hands_them_out() -> None:
    calls: list[tuple[int, int]] = []
    pinned: list[torch.Tensor] = []
    feed = BatchFeed(_recording_read(calls), torch.device("cpu"), prefetch=True,
                     pin=lambda t: pinned.append(t) or t)
    assert BatchFeed(_recording_read([]), torch.device("cuda")).prefetch  # the default on CUDA
    feed.start_step(0)
    assert calls == [] and feed.prefetched == []  # the first step cannot know
    feed.get(0, 2)
    feed.get(0, 0)
    assert calls == [(0, 2), (0, 0)] and pinned == []  # read when asked: not pinned
    feed.start_step(1)
    assert calls[2:] == [(1, 2), (1, 0)] and feed.prefetched == [0, 2]
    assert len(pinned) == 4  # both tensors of both micro-batches went through pinned memory
    got = feed.get(1, 0)
    assert torch.equal(got["input_ids"], torch.full((2, 3), 100)) and torch.equal(got["labels"], torch.arange(3))
    assert calls[4:] == [] and feed.prefetched == [2]  # handed out, not read again
    feed.get(1, 5)  # one this worker did not read last step: read now
    assert calls[4:] == [(1, 5)]
    feed.start_step(2)  # the unused prefetched micro-batch 2 is dropped; this step reads what step 1 asked for
    assert calls[5:] == [(2, 0), (2, 5)] and feed.prefetched == [0, 5]
