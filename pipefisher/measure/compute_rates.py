"""The compute rates ``measure.collectives`` stores beside its collectives: per micro-batch size, the whole
model's forward + backward and its forward alone, K-FAC's per-micro-batch units on the model's Linear shapes,
Muon's Newton–Schulz on them, a tensor-parallel forward + backward, and one NVLAMB step over the whole model (what each is for: the docstring of
``pipefisher.measure.collectives``). Each function times on this process's device and threads; the caller takes
the slowest rank's figure."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["compute_rate", "kfac_rates", "measured_bert", "median_f_seconds", "median_fb_seconds", "median_seconds",
           "model_and_batch", "newton_schulz_rate", "optimizer_rate", "piece_seconds", "tp_seconds"]


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, budget_s: float,
                   collective: bool = False) -> float:
    """Median seconds of ``fn()`` (its result dropped) over at most ``repeats`` runs after two warm-ups, stopping
    once ``budget_s`` has passed after at least three timed runs; with ``collective`` every rank starts each run
    together and stops after the same count (rank 0 decides)."""
    times = []
    start = time.perf_counter()
    for i in range(repeats + 2):
        if collective:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:  # after two warm-ups
            times.append(time.perf_counter() - t0)
        done = i >= 4 and time.perf_counter() - start > budget_s
        if collective:
            stop = torch.tensor([1.0 if done else 0.0], device=device)
            dist.broadcast(stop, src=0)
            done = bool(stop.item())
        if done:
            break
    return statistics.median(times)


def measured_bert(model: str, vocab_size: int | None = None) -> Any:
    """The BERT preset ``model`` (``bert-mini``), with ``vocab_size`` where given (the run's own vocabulary)."""
    from dataclasses import replace

    from pipefisher.model.config import BertConfig

    bert = BertConfig.from_size(model.removeprefix("bert-"))
    return bert if vocab_size is None else replace(bert, vocab_size=vocab_size)


def model_and_batch(model: str, micro_batch_size: int, seq_len: int, max_predictions: int,
                     device: torch.device, vocab_size: int | None = None) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """(config, the whole model in train mode, one synthetic micro-batch) for the compute timings."""
    from pipefisher.data.batches import get_micro_batch
    from pipefisher.data.synthetic import SyntheticSource
    from pipefisher.model.bert import build_full_model

    bert = measured_bert(model, vocab_size)
    net = build_full_model(bert).to(device).train()
    source = SyntheticSource(seq_len, max_predictions, bert.vocab_size, seed=0)
    batch = {k: v.to(device) for k, v in get_micro_batch(source, 0, 0, 0, micro_batch_size=micro_batch_size,
                                                          num_micro_batches=1, dp_width=1).items()}
    return bert, net, batch


def median_fb_seconds(net: Any, batch: dict[str, torch.Tensor], device: torch.device, repeats: int,
                       budget_s: float, collective: bool = False) -> float:
    """Median seconds of ``net``'s forward + backward (:func:`median_seconds`)."""
    return median_seconds(lambda: net(None, batch).sum().backward(), device, repeats, budget_s, collective)


def median_f_seconds(net: Any, batch: dict[str, torch.Tensor], device: torch.device, repeats: int,
                      budget_s: float) -> float:
    """Median seconds of ``net``'s forward alone (building the graph a backward would use, as a pipeline's F
    does; :func:`median_seconds`)."""
    return median_seconds(lambda: net(None, batch).sum(), device, repeats, budget_s)


def compute_rate(model: str, micro_batch_size: int, seq_len: int, max_predictions: int, device: torch.device,
                  repeats: int, budget_s: float, vocab_size: int | None = None) -> tuple[float, float, float]:
    """(seconds of one forward + backward of the whole model on one micro-batch, seconds of its forward alone,
    the forward + backward's planner FLOPs)."""
    from pipefisher.model.partition import layer_costs

    bert, net, batch = model_and_batch(model, micro_batch_size, seq_len, max_predictions, device, vocab_size)
    flops = 3.0 * micro_batch_size * sum(layer_costs(bert, seq_len, max_predictions))
    fb = median_fb_seconds(net, batch, device, repeats, budget_s)
    return fb, median_f_seconds(net, batch, device, repeats, budget_s), flops


def piece_seconds(model: str, micro_batch_size: int, seq_len: int, max_predictions: int, device: torch.device,
                  repeats: int, budget_s: float, vocab_size: int | None = None) -> dict[str, dict[str, float]]:
    """Each piece a pipeline stage is made of, timed alone as a one-layer stage (``model.bert.BertStage``), the
    way a pipeline runs it: the embeddings from the batch, one encoder layer and the heads from a hidden state
    that needs its gradient (a stage's B computes its input's gradient). ``{piece: {"seconds_f", "seconds_fb",
    "flops_f"}}`` for ``planning.comm_costs.PIECES`` (``flops_f``: the planner's forward FLOPs of the piece on one
    micro-batch, ``model.partition.layer_costs``). A small stage's time is not its FLOPs at the whole model's rate: the
    embeddings have almost no FLOPs and take a millisecond, and the per-call overhead weighs more on one layer
    than on the model."""
    from pipefisher.model.bert import BertStage
    from pipefisher.model.partition import layer_costs
    from pipefisher.planning.comm_costs import PIECES

    bert, _, batch = model_and_batch(model, micro_batch_size, seq_len, max_predictions, device, vocab_size)
    flops = layer_costs(bert, seq_len, max_predictions)
    out = {}
    for piece, layer in zip(PIECES, (0, 1, bert.num_layers + 1)):
        stage = BertStage(bert, layer, layer).to(device).train()
        hidden = None if layer == 0 else torch.randn(micro_batch_size, seq_len, bert.hidden_size, device=device,
                                                    requires_grad=True)

        def forward() -> torch.Tensor:
            return stage(hidden, batch)

        def forward_backward() -> None:
            forward().sum().backward()

        out[piece] = {"seconds_f": median_seconds(forward, device, repeats, budget_s),
                      "seconds_fb": median_seconds(forward_backward, device, repeats, budget_s),
                      "flops_f": micro_batch_size * flops[layer]}
    return out


def kfac_rates(model: str, micro_batch_size: int, seq_len: int, device: torch.device, repeats: int,
                budget_s: float) -> dict[str, float]:
    """K-FAC's per-micro-batch units on one encoder layer's Linear shapes (T = micro_batch_size · seq_len
    rows), timed with the runtime's kernels: ``{"curvature_seconds", "curvature_flops_per_s",
    "precondition_seconds", "precondition_flops_per_s", "invert_seconds", "invert_flops_per_s"}`` (planner FLOPs:
    CURV_A + CURV_B = 2 T (in² + out²), PRECOND = 2 in out (in + out), INVERT = (in³ + out³) (2/3 + 1) per Linear:
    ``planning.costs`` [Note: FLOP estimates]; INVERT: the damped Cholesky inverse of both factors)."""
    from pipefisher.optim.kfac_factors import damped_inverse, grad_factor_sum, input_factor_sum, kron_precondition_
    from pipefisher.planning.costs import INVERT_FLOPS_PER_N3, kfac_linear_dims

    dims = kfac_linear_dims(measured_bert(model), 1)
    rows = micro_batch_size * seq_len
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, i, generator=gen).to(device) for i, _ in dims]
    gs = [torch.randn(rows, o, generator=gen).to(device) for _, o in dims]
    a_sum = [input_factor_sum(x, True) for x in xs]
    b_sum = [grad_factor_sum(g, 1.0) for g in gs]
    a_inv = [torch.eye(i + 1, device=device) + 1e-3 * a / rows for a, (i, _) in zip(a_sum, dims)]
    b_inv = [torch.eye(o, device=device) + 1e-3 * b / rows for b, (_, o) in zip(b_sum, dims)]
    w_grads = [torch.randn(o, i, generator=gen).to(device) for i, o in dims]
    b_grads = [torch.randn(o, generator=gen).to(device) for _, o in dims]

    def curvature() -> None:
        for x, g, a, b in zip(xs, gs, a_sum, b_sum):
            input_factor_sum(x, True, out=a)
            grad_factor_sum(g, 1.0, out=b)

    def precondition() -> None:
        for wg, bg, a, b in zip(w_grads, b_grads, a_inv, b_inv):
            kron_precondition_(wg, bg, a, b)
            wg.mul_(1e-3)  # keep the repeated in-place products finite
            bg.mul_(1e-3)

    def invert() -> None:
        for a, b in zip(a_sum, b_sum):
            damped_inverse(a, 1e-3 * rows)
            damped_inverse(b, 1e-3 * rows)

    out = {}
    for name, fn, flops in (("curvature", curvature, sum(2.0 * rows * (i * i + o * o) for i, o in dims)),
                            ("precondition", precondition, sum(2.0 * i * o * (i + o) for i, o in dims)),
                            ("invert", invert, sum((i ** 3 + o ** 3) * INVERT_FLOPS_PER_N3 for i, o in dims))):
        seconds = median_seconds(fn, device, repeats, budget_s)
        out[f"{name}_seconds"], out[f"{name}_flops_per_s"] = seconds, flops / seconds
    return out


def newton_schulz_rate(model: str, device: torch.device, repeats: int, budget_s: float) -> dict[str, Any]:
    """Muon's Newton–Schulz on one encoder layer's Linear weights, timed with the runtime's kernel
    (``optim.muon.newton_schulz``) in the precision ``optimizer.ns_dtype=auto`` picks on ``device``:
    ``{"dtype", "seconds", "flops", "flops_per_s"}`` (``optim.muon.ns_flops``, the planner's count). A stack of
    small products, in bf16 where the hardware has it: it runs at another rate than the model's forward and
    backward, which the search priced it by before (bench/studies/20-time-to-target-validation.md)."""
    from pipefisher.optim.muon import newton_schulz, ns_flops, resolve_ns_dtype
    from pipefisher.planning.costs import kfac_linear_dims

    dtype, _ = resolve_ns_dtype("auto", device)
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(o, i, generator=gen).to(device) for i, o in kfac_linear_dims(measured_bert(model), 1)]

    def orthogonalize() -> None:
        for m in mats:
            newton_schulz(m, (3.4445, -4.7750, 2.0315), 5, 1e-7, dtype)  # torch's Muon's coefficients and steps

    seconds = median_seconds(orthogonalize, device, repeats, budget_s)
    flops = float(sum(ns_flops(tuple(m.shape)) for m in mats))
    return {"dtype": str(dtype).removeprefix("torch."), "seconds": seconds, "flops": flops,
            "flops_per_s": flops / seconds}


def tp_seconds(model: str, micro_batch_size: int, seq_len: int, max_predictions: int, device: torch.device,
                repeats: int, budget_s: float, world: int, vocab_size: int | None = None) -> float:
    """Seconds of one forward + backward of the whole model on one micro-batch with its encoder
    layers split over all ``world`` processes (train.py's tensor parallel, ``runtime.tensor_parallel``):
    what the strategy search's time model sets its tp estimate against ([Note: the time model])."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipefisher.runtime.tensor_parallel import parallelize_stages

    _, net, batch = model_and_batch(model, micro_batch_size, seq_len, max_predictions, device, vocab_size)
    parallelize_stages({(0, 0): net}, {(0, 0): init_device_mesh(device.type, (world,), mesh_dim_names=("tp_measure",))})
    return median_fb_seconds(net, batch, device, repeats, budget_s, collective=True)


def optimizer_rate(model: str, device: torch.device, repeats: int, budget_s: float,
                    vocab_size: int | None = None) -> tuple[float, int]:
    """(seconds of one NVLAMB step over the whole model's parameters, the parameter count)."""
    from pipefisher.model.bert import build_full_model
    from pipefisher.optim.nvlamb import NVLAMB

    net = build_full_model(measured_bert(model, vocab_size)).to(device)
    params = [p for p in net.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = NVLAMB(params, lr=1e-3)
    return median_seconds(opt.step, device, repeats, budget_s), sum(p.numel() for p in params)
