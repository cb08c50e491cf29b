"""What ekfac's units cost against K-FAC's on one core: the refresh's last unit (INVERT: Cholesky
inverses vs eigenbases) and the per-step PRECOND, summed over a model's encoder Linear layers.

    python bench/ekfac_costs.py                       # bert-tiny, vocab 8192, 32 x 64 tokens (the study's)
    python bench/ekfac_costs.py --model bert-mini --reps 5

Factors come from one real forward/backward of the model on synthetic tokens; both preconditioners
get the same factors and gradient; each rep times K-FAC then ekfac (paired), and the medians over reps
are printed. One thread (``torch.set_num_threads(1)``), as each study run is pinned to one core.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import _harness as h
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.optim import EKFACPreconditioner, KFACPreconditioner
from pipefisher.run_spec import bert_config, data_plan, data_source


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bert-tiny")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = h.compose([f"model={args.model}", f"model.vocab_size={args.vocab_size}", f"micro_batch_size={args.batch}",
                         "num_micro_batches=1", f"data.seq_len={args.seq_len}", "data.max_predictions=10"])
    model = build_full_model(bert_config(cfg), seed=0)
    pres = {"kfac": KFACPreconditioner(model), "ekfac": EKFACPreconditioner(model)}
    source, plan = data_source(cfg), data_plan(cfg)
    for pre in pres.values():
        pre.on_step_start(0)
    with pres["kfac"].micro_batch(0), pres["ekfac"].micro_batch(0):
        losses = model(None, get_micro_batch(source, 0, 0, 0, **plan))
    losses.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for pre in pres.values():
        pre.curvature_all()
        pre.update_all(0)
        pre.step_curvature_done()

    def restore() -> None:
        for n, p in model.named_parameters():
            if n in grads:
                p.grad.copy_(grads[n])

    times: dict[str, dict[str, list[float]]] = {k: {"invert": [], "precond": []} for k in pres}
    for _ in range(args.reps):
        for name, pre in pres.items():
            times[name]["invert"].append(_timed(pre.invert_all))
            restore()
            times[name]["precond"].append(_timed(pre.precondition_all))
    dims = sorted({tuple(pres["kfac"].layer(n).dims) for n in pres["kfac"].layer_names})
    print(f"{args.model}, {len(pres['kfac'].layer_names)} encoder Linear layers, factor sizes (A, B): {dims}; "
          f"{args.batch} x {args.seq_len} tokens; 1 thread; median of {args.reps} paired reps")
    for unit in ("invert", "precond"):
        k, e = (statistics.median(times[n][unit]) for n in ("kfac", "ekfac"))
        what = "INVERT (Cholesky inverses | eigenbases)" if unit == "invert" else "PRECOND (every step)"
        print(f"  {what}: kfac {k * 1e3:.1f} ms, ekfac {e * 1e3:.1f} ms, ratio {e / k:.2f}")


if __name__ == "__main__":
    main()
