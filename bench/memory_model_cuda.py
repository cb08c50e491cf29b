"""The memory model against one GPU's caching allocator: ``bench/gpu_check.sh``'s memory-model-cuda check.

    python bench/memory_model_cuda.py                 # on a CUDA machine: bert-mini and bert-medium, ~30 s
    python bench/memory_model_cuda.py --device cpu    # the same plumbing on CPU (peak RSS beyond the baseline)

One process (``stages=1``, what ``train.py`` runs on one device: its worker, in this process), N=4
micro-batches of 8 x 128, fp32, NVLAMB, 4 steps per model. Per model: the planner's prediction
(``planning.memory`` for ``device=cuda``, one micro-batch in flight: ``reporting.prediction_inputs``)
against the run's own per-step peak (``metrics.jsonl``: ``max_memory_allocated`` since the step's
``reset_peak_memory_stats``), and ``max_memory_reserved`` over the last step (the caching allocator's
pool: what the GPU really gives up) with the model's ``cuda_reserved_bytes``; the CUDA context and
other memory outside the allocator from ``mem_get_info``. Prints one line
``PASS|FAIL <figures>``: PASS when every prediction is within 25 % of ``max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import _harness as h
from pipefisher.planning.memory import cuda_reserved_bytes, estimate_memory_per_worker
from pipefisher.runtime.reporting import prediction_inputs
from pipefisher.launch.local import launch_workers

MB = 1e6
TOLERANCE = 0.25


def measure(model: str, device: str) -> str | None:
    """One model's figures, or None when its prediction is off by more than the tolerance (then the text)."""
    cfg = h.compose([f"model={model}", f"device={device}", "stages=1", "num_micro_batches=4", "micro_batch_size=8",
                     "data.seq_len=128", "steps=4", "save_final=false"])
    cuda = device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as out:
        launch_workers(cfg, out)  # one worker: train.py's own path, in this process
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    peak = max(r["peak_memory_bytes"] - (r.get("memory_baseline_per_worker_bytes") or [0])[0] for r in rows)
    est = estimate_memory_per_worker(*prediction_inputs(cfg), "cuda" if cuda else "cpu")[0]
    ratio = est.total / peak
    text = f"{model}: predicted {est.total / MB:.0f} MB vs measured {peak / MB:.0f} MB ({ratio:.2f}x)"
    if cuda:
        reserved = torch.cuda.max_memory_reserved()
        free, total = torch.cuda.mem_get_info()
        outside = total - free - torch.cuda.memory_reserved()
        text += (f", max_memory_reserved {reserved / MB:.0f} MB ({reserved / peak:.2f}x allocated; model "
                 f"{cuda_reserved_bytes(est) / MB:.0f}), outside the allocator (context) {outside / MB:.0f} MB")
    return text if abs(ratio - 1) <= TOLERANCE else "!" + text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--models", default="bert-mini,bert-medium")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("memory_model_cuda: no CUDA device; run it on a GPU node, or with --device cpu")
    results = [measure(m, args.device) for m in args.models.split(",")]
    failed = [r for r in results if r.startswith("!")]
    shown = "; ".join(r.lstrip("!") for r in results)
    print(f"{'FAIL' if failed else 'PASS'} {shown} (tolerance {TOLERANCE:.0%}, stages=1, N=4 x 8 x 128, fp32, 4 steps)")


if __name__ == "__main__":
    h.main_guard(main)
