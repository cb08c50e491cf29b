"""CUDA-path defects that a CPU can still catch (issue 25): who chooses a GPU, and when."""

from __future__ import annotations

import pytest
import torch

from pipefisher.runtime.build import kfac_assignment, schedule_for
from pipefisher.training import device_type
from tests.conftest import compose_train


@pytest.fixture
def four_gpus(monkeypatch):
    """A stand-in for a node with 4 GPUs that records every ``torch.cuda.set_device`` call."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(int(index)))
    return calls


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_planning_pipefishers_work_chooses_no_gpu(four_gpus, device) -> None:
    """Defect 1: ``kfac_assignment`` called ``resolve_device(cfg.device)`` without the local rank, which
    moved every worker to cuda:0 after it had chosen its own GPU."""
    cfg = compose_train(["optimizer=pipefisher", "stages=2", "num_micro_batches=4", f"device={device}"])
    assignment = kfac_assignment(cfg, schedule_for(cfg))
    assert assignment.interval >= 1
    assert four_gpus == []  # only the worker's own resolve_device(cfg.device, local_rank) may choose


def test_device_type_follows_the_device_setting(four_gpus, monkeypatch) -> None:
    assert device_type("cuda") == device_type("auto") == "cuda"
    assert device_type("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_type("auto") == "cpu"
    assert four_gpus == []
