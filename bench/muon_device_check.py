"""Issue 36's device check with torch alone (no Hydra): ShardedMuon's sdp=2 step on bert-mini's Muon
shapes, one owner vs gather-everywhere, at ``ns_dtype=auto`` and ``fp32``, and on a CUDA GPU that
``auto`` picks bf16 and ``Muon(ns_dtype="bf16")`` equals ``torch.optim.Muon``.

    PYTHONPATH=$PWD python bench/muon_device_check.py        # ROUNDS=15 THREADS=8 (per worker) by default

``bench/muon_sharded.py --part sharded`` measures the same with the real bert-mini under
``fully_shard``; this script needs only ``pipefisher/hardware.py`` and ``pipefisher/optim/muon.py``
(it ran on a device machine whose Python has torch but not Hydra). Results: bench/studies/14-muon-precision.md.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipefisher.hardware import describe_hardware
from pipefisher.optim.muon import Muon, ShardedMuon, _apply, resolve_ns_dtype

MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
BERT_MINI = [(256, 256)] * 16 + [(1024, 256), (256, 1024)] * 4  # its 24 Muon matrices
ROUNDS = int(os.environ.get("ROUNDS", "15"))
THREADS = int(os.environ.get("THREADS", "8"))


def _worker(rank: int, ns_dtype: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo", init_method=f"file:///tmp/pg_{ns_dtype}_{os.getppid()}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    dtype, _ = resolve_ns_dtype(ns_dtype, "cpu")
    params = [torch.nn.Parameter(distribute_tensor(torch.randn(s), mesh, [Shard(0)])) for s in BERT_MINI]
    for p in params:
        p.grad = distribute_tensor(torch.randn(p.shape) * 1e-3, mesh, [Shard(0)])

    class Everywhere(Muon):  # main's ShardedMuon (812604d), its precision a parameter
        @torch.no_grad()
        def step(self) -> None:  # type: ignore[override]
            self.ns_runs = 0
            for p, update, group in self._updates():
                ortho = self._orthogonalize(update.full_tensor(), group)
                _apply(p, distribute_tensor(ortho, mesh, p.placements, src_data_rank=None), group)

    variants = {"owner": ShardedMuon(params, ns_dtype=dtype, **MUON), "everywhere": Everywhere(params, ns_dtype=dtype, **MUON)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for opt in variants.values():  # warm-up
        opt.step()
    for i in range(ROUNDS):
        for k in (list(variants) if i % 2 else list(variants)[::-1]):
            dist.barrier()
            start = time.perf_counter()
            variants[k].step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[k].append(elapsed.item())
    if rank == 0:
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        print(f"sdp=2 bert-mini Muon step, ns_dtype={ns_dtype} -> {dtype}; {describe_hardware('cpu')}; NS runs rank0 "
              f"owner {variants['owner'].ns_runs} everywhere {variants['everywhere'].ns_runs}; median ms of {ROUNDS}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in med.items()) + f"; owner/everywhere {med['owner'] / med['everywhere']:.3f}",
              flush=True)
    dist.destroy_process_group()


def _cuda_check() -> None:
    print(describe_hardware("cuda"), "| auto on cuda:", resolve_ns_dtype("auto", "cuda"),
          "| auto on cpu:", resolve_ns_dtype("auto", "cpu"))
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 6), (7, 6), (256, 256), (1024, 256)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    ours = [torch.nn.Parameter(w.cuda()) for w in weights]
    theirs = [torch.nn.Parameter(w.cuda()) for w in weights]
    opts = Muon(ours, ns_dtype="bf16", **MUON), torch.optim.Muon(theirs, **MUON)
    for step_grads in grads:
        for p, q, g in zip(ours, theirs, step_grads):
            p.grad, q.grad = g.cuda(), g.cuda()
        for opt in opts:
            opt.step()
    print("cuda: Muon(ns_dtype=bf16) == torch.optim.Muon after 3 steps:", all(torch.equal(p, q) for p, q in zip(ours, theirs)))


if __name__ == "__main__":
    for choice in ("auto", "fp32"):  # fork before CUDA is touched
        mp.start_processes(_worker, args=(choice,), nprocs=2, start_method="fork")
    if torch.cuda.is_available():
        _cuda_check()
