"""Muon's Newton–Schulz cost by precision, and ShardedMuon's step with one owner per matrix (issue 36).

    python bench/muon_sharded.py                      # both parts on this machine's CPU
    python bench/muon_sharded.py --part ns --device cuda --shapes 768x768,3072x768
    python bench/muon_sharded.py --part sharded --rounds 7 --with-bf16

Part ``ns``: one orthogonalization (torch's 5 quintic iterations) per matrix shape, bf16 against fp32,
taking turns (bf16, fp32, fp32, bf16, …), median ms; on a CPU with ``--threads`` intra-op threads
(default 1). The ``auto`` column is what ``optimizer.ns_dtype=auto`` picks on this device.

Part ``sharded``: bert-mini (4 layers, H=256: 24 Muon matrices, 16 of 256×256 and 8 of 1024×256)
sharded by ``fully_shard`` over 2 processes (``sdp=2``, gloo, ``cores // 2`` threads each), random
gradients; the Muon half's optimizer step (``ShardedMuon.step``, momentum to update) of

- ``owner``: today's :class:`~pipefisher.optim.muon.ShardedMuon`, each matrix orthogonalized once, by
  its owner (two all_to_all per step);
- ``everywhere``: main's ShardedMuon before issue 36 (commit 812604d), copied below: each matrix
  gathered whole (all-gather) and orthogonalized on both processes;

both in the NS precision ``optimizer.ns_dtype=auto`` picks here, side by side in the same processes
(turns rotated each round, ``bench/_harness.py`` [Note: measuring on a shared CPU]); ``--with-bf16``
adds ``everywhere`` in bf16, which is exactly what main ran (torch's NS), slow on CPUs without bf16
arithmetic. Step time is the slowest process's, after a barrier. The AdamW half is unchanged and
left out. Hardware in the header (``pipefisher.hardware.describe_hardware``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from _harness import caveat, launch, load, main_guard, median, table, timed_step
from pipefisher.hardware import describe_hardware
from pipefisher.optim.muon import Muon, ShardedMuon, _apply, _momentum_update, newton_schulz, resolve_ns_dtype

NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch's Muon: coefficients, steps, eps
MUON = dict(lr=1e-3, weight_decay=0.01, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _shape(text: str) -> tuple[int, int]:
    a, b = text.lower().split("x")
    return int(a), int(b)


def ns_table(shapes: list[tuple[int, int]], reps: int, device: torch.device) -> list[list[Any]]:
    """Median ms of one orthogonalization per shape in bf16 and fp32 (alternating), and the ratio."""
    auto = "bf16" if resolve_ns_dtype("auto", device)[0] == torch.bfloat16 else "fp32"
    rows = []
    for shape in shapes:
        g = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device)
        times: dict[str, list[float]] = {"bf16": [], "fp32": []}
        for name in ("bf16", "fp32"):  # warm-up (kernels, allocator)
            newton_schulz(g, *NS, DTYPES[name])
        for r in range(reps):
            for name in (("bf16", "fp32") if r % 2 == 0 else ("fp32", "bf16")):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                newton_schulz(g, *NS, DTYPES[name])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[name].append(time.perf_counter() - start)
        b, f = median(times["bf16"]) * 1e3, median(times["fp32"]) * 1e3
        rows.append([f"{shape[0]}x{shape[1]}", b, f, b / f, auto])
    return rows


class GatherEverywhereMuon(Muon):
    """main's ShardedMuon at 812604d (before issue 36), its NS precision a parameter: each weight's
    update gathered whole on every process of its mesh and orthogonalized there."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        from torch.distributed.tensor import DTensor, distribute_tensor

        self.ns_runs = 0
        for param, update, group in self._updates():
            whole = update.full_tensor() if isinstance(update, DTensor) else update
            ortho = self._orthogonalize(whole, group)
            if isinstance(param, DTensor):
                ortho = distribute_tensor(ortho, param.device_mesh, param.placements, src_data_rank=None)
            _apply(param, ortho, group)


def _bert_mini() -> torch.nn.Module:
    from pipefisher.model import BertConfig, build_full_model

    return build_full_model(BertConfig(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024), seed=0)


def _sharded_worker(rank: int, world: int, rounds: int, with_bf16: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from pipefisher.optim import is_muon_parameter

    model = _bert_mini()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    params = [p for n, p in model.named_parameters() if is_muon_parameter(n)]
    gen = torch.Generator().manual_seed(1 + rank)
    for p in params:
        local = p.to_local()
        p.grad = DTensor.from_local(torch.randn(local.shape, generator=gen) * 1e-3, p.device_mesh, p.placements,
                                    run_check=False, shape=p.shape, stride=p.stride())
    auto, _ = resolve_ns_dtype("auto", "cpu")
    name = "bf16" if auto == torch.bfloat16 else "fp32"
    variants = {f"owner ({name})": ShardedMuon(params, ns_dtype=auto, **MUON),
                f"everywhere ({name})": GatherEverywhereMuon(params, ns_dtype=auto, **MUON)}
    if with_bf16 and name != "bf16":
        variants["everywhere (bf16, main)"] = GatherEverywhereMuon(params, ns_dtype=torch.bfloat16, **MUON)
    for opt in variants.values():  # warm-up: buffers, process-group set-up
        opt.step()
    times: dict[str, list[float]] = {k: [] for k in variants}
    runs = {k: 0 for k in variants}
    order = list(variants)
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            seconds, _ = timed_step(variants[k].step)
            times[k].append(seconds)
            runs[k] = variants[k].ns_runs
    shapes = sorted({tuple(p.shape) for p in params})
    return {"times": times, "ns_runs": runs, "matrices": len(params), "shapes": shapes,
            "hardware": describe_hardware("cpu")}


def sharded_table(rounds: int, with_bf16: bool) -> tuple[list[list[Any]], dict[str, Any]]:
    results = launch(_sharded_worker, 2, rounds, with_bf16)
    r0 = results[0]["result"]
    base = next(k for k in r0["times"] if k.startswith("everywhere") and "main" not in k)
    rows = []
    for k, ts in r0["times"].items():
        runs = [res["result"]["ns_runs"][k] for res in results]
        rows.append([k, median(ts) * 1e3, median(ts) / median(r0["times"][base]), f"{runs[0]} + {runs[1]}", len(ts)])
    return rows, {"matrices": r0["matrices"], "shapes": r0["shapes"], "threads": results[0]["threads"],
                  "hardware": r0["hardware"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("ns", "sharded", "all"), default="all")
    parser.add_argument("--device", default="cpu", help="ns part: cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="ns part on a CPU: intra-op threads")
    parser.add_argument("--shapes", default="128x128,512x128,256x256,1024x256",
                        help="ns part: comma-separated AxB (bf16 on a CPU without bf16 arithmetic takes seconds each)")
    parser.add_argument("--reps", type=int, default=4, help="ns part: timed calls per shape and precision")
    parser.add_argument("--rounds", type=int, default=7, help="sharded part: timed steps per variant")
    parser.add_argument("--with-bf16", action="store_true", help="sharded part: add main's bf16 NS everywhere")
    args = parser.parse_args()
    if args.part in ("ns", "all"):
        device = torch.device(args.device)
        if device.type == "cpu":
            torch.set_num_threads(args.threads)
        print(f"# Newton-Schulz, one orthogonalization (5 iterations), bf16 vs fp32 on {device.type}\n"
              f"# {describe_hardware(device)}; {load()}\n"
              f"# {resolve_ns_dtype('auto', device)[1]}")
        rows = ns_table([_shape(s) for s in args.shapes.split(",")], args.reps, device)
        print(table(["shape", "bf16 ms", "fp32 ms", "bf16 / fp32", "auto picks"], rows), flush=True)
    if args.part in ("sharded", "all"):
        print(f"\n# ShardedMuon step (Muon half), bert-mini sdp=2 (gloo, 2 processes), {args.rounds} rounds\n"
              f"# {caveat(2)} {load()}", flush=True)
        rows, info = sharded_table(args.rounds, args.with_bf16)
        print(f"# {info['hardware']} (in each worker); {info['matrices']} matrices {info['shapes']}")
        print(table(["variant", "step ms (median)", "/ everywhere", "NS runs (rank 0 + 1)", "steps"], rows))


if __name__ == "__main__":
    main_guard(main)
