"""cpu_flush_denormal: a CPU worker flushes subnormal floats to zero ([Note: subnormals on CPU] in
pipefisher/runtime/device.py), as the config says, and a CUDA device is left alone."""

from __future__ import annotations

import torch

from pipefisher.runtime.device import set_flush_denormal

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def _product() -> float:
    return float(torch.tensor([SUBNORMAL]) * torch.tensor([1.0]))


def test_a_cpu_process_flushes_subnormals_as_the_config_says(make_cfg):
    try:
        assert make_cfg().cpu_flush_denormal  # the default
        assert set_flush_denormal(True, torch.device("cpu"))
        assert _product() == 0.0  # flushed
        assert not set_flush_denormal(False, torch.device("cpu"))
        assert _product() > 0.0  # IEEE subnormal kept
        # a CUDA device: nothing is set (the CPU setting of this process stays as it was)
        assert not set_flush_denormal(True, torch.device("cuda", 0))
        assert _product() > 0.0
    finally:
        torch.set_flush_denormal(False)  # torch's default for the rest of this process


def test_a_pipeline_worker_sets_it_when_built(make_cfg, tmp_path):
    """Building a PipelineWorker, which every run (train.py's one-process run included), benchmark and measurement
    does, sets it from the worker's config."""
    import torch.distributed as dist

    from pipefisher.runtime.pipeline_worker import PipelineWorker

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.set_flush_denormal(False)
        PipelineWorker(make_cfg("stages=1", "device=cpu"), 0, 1, torch.device("cpu"))
        assert _product() == 0.0
        PipelineWorker(make_cfg("stages=1", "device=cpu", "cpu_flush_denormal=false"), 0, 1, torch.device("cpu"))
        assert _product() > 0.0
    finally:
        torch.set_flush_denormal(False)
        if own_group:
            dist.destroy_process_group()


def test_finetune_sets_it_from_its_own_config(tmp_path):
    """finetune.py trains on CPU too: its run sets the same flag from its own cpu_flush_denormal."""
    from pipefisher.finetune.loop import finetune
    from tests.test_finetune import NARROW, compose_finetune

    try:
        for flush, subnormal_kept in ((True, False), (False, True)):
            torch.set_flush_denormal(not flush)
            cfg = compose_finetune(["task=toy", "steps=1", "eval_every=null", "task.toy.num_train=8",
                                    "task.toy.num_dev=8", f"cpu_flush_denormal={str(flush).lower()}", *NARROW])
            finetune(cfg, tmp_path / str(flush))
            assert (_product() > 0.0) == subnormal_kept
    finally:
        torch.set_flush_denormal(False)
