"""Run pipeline workers for tests: one start of up to 8 processes runs many configurations in turn.

Starting processes costs seconds each on 2 cores, so the tests start ``max_world`` processes once;
every process walks the list of cases, joins those whose world includes its rank (a fresh gloo
group per case, rendezvous through a file), and saves what the test needs with ``torch.save``.

[Note: forkserver]
Every test that starts worker processes itself (:func:`start_workers`) starts them with the
``forkserver`` method: one server process per pytest process (per xdist worker) imports torch and the runtime once
(:data:`PRELOAD`) without running any operation (OpenMP's thread pool would not survive the fork),
and each worker is forked from it, so a worker starts in a fraction of a second where a ``spawn``ed
one imports torch again (2 workers: 27–54 s by spawn against 0.2–0.8 s from the warm server on this
2-core machine under load 7, 21 s for the server's first start). The workers' code and numerics are
those of a spawned worker: no pytest state is inherited (as it would be by ``fork``), the parent's working directory and ``sys.path``; only the environment is the
server's, taken when it started (no test changes the environment its workers read). The launcher
``train.py`` uses (``launch/local.py``) keeps ``spawn``: a forkserver's children would take the server's
signal dispositions, not the ones the launcher sets for its workers (``interrupts_ignored_by_children``).
The server also imports ``torch._dynamo``, which the first optimizer a worker builds imports otherwise
(``torch.optim.Optimizer``: 0.7–0.9 s of CPU in each worker of each start).

[Note: frozen imports]
A worker calls :func:`gc.freeze` first, so the objects it got from the server (every imported module,
about 350k objects) sit in the collector's permanent generation. ``release_process_group`` collects
reference cycles after each case ([Note: free cycles before destroying the process group]); a full
collection over those imports costs 0.17 s of CPU (0.55 s of wall under load 10) a case per process,
about a quarter of test_optimizer_placement's CPU time (100 cases on 2 processes). The cycles it must
free (the executor and its worker, DTensor's meshes) are made after the freeze, so they are collected
as before.
"""

from __future__ import annotations

import datetime
import gc
import logging
from collections.abc import Callable
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from pipefisher.config import TrainConfig
from pipefisher.runtime.teardown import release_process_group
from pipefisher.runtime.worker import PipelineWorker, train_worker
from pipefisher.timeline import is_wait


#: The start method of the tests' own workers, and what the server imports before forking them.
START_METHOD = "forkserver"
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.tensor", "pipefisher.runtime.worker", "tests.dist_harness"]
mp.set_forkserver_preload(PRELOAD)


def start_workers(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` worker processes and wait for them ([Note: forkserver]);
    a worker's exception is raised here with its traceback (``torch.multiprocessing``)."""
    mp.start_processes(_frozen, args=(fn, *args), nprocs=nprocs, join=True, start_method=START_METHOD)


def _frozen(rank: int, fn: Callable[..., None], *args: object) -> None:
    """``fn(rank, *args)`` with the server's objects out of the collector's way ([Note: frozen imports])."""
    gc.freeze()
    fn(rank, *args)


def _worker(rank: int, cases: list[tuple[TrainConfig, int]], out_dir: str) -> None:
    torch.set_num_threads(1)
    for i, (cfg, steps) in enumerate(cases):
        world = cfg.num_workers
        if rank >= world:
            continue
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg{i}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        try:
            worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
            first_grads: dict[str, torch.Tensor] = {}

            def capture(w: PipelineWorker = worker, out: dict = first_grads) -> None:
                if not out:
                    for (pipe, stage), m in w.modules.items():
                        for name, p in m.named_parameters():
                            out[f"{pipe}/{stage}/{name}"] = _whole(p.grad).detach().clone()

            worker.before_optimizer_step.append(capture)
            losses, factors, events, rollbacks, ns = [], {}, [], [], []
            for step in range(steps):
                loss, result = worker.train_step(step)
                losses.append(loss)
                rollbacks.append(worker.rollbacks)
                if worker.ns_spread is not None:  # optimizer.ns_owners=pipeline: NS run here, of which for others
                    ns.append((worker.ns_spread.ns_runs, worker.ns_spread.received))
                if step == 0:  # the first step's timeline: (name, kind, is a wait)
                    events = [(e.name, e.kind, is_wait(e)) for e in result.events]
                if step == 0 and worker.kfac is not None:  # K-FAC factors after the first refresh
                    for (pipe, stage), pre in worker.kfac.pre.items():
                        for name in pre.layer_names:
                            layer = pre.layer(name)
                            if layer.a is None:  # PipeFisher: factors of this refresh not synced yet
                                continue
                            factors[f"{pipe}/{stage}/{name}/A"] = layer.a.clone()
                            factors[f"{pipe}/{stage}/{name}/B"] = layer.b.clone()
            params = {f"{pipe}/{stage}/{name}": _whole(p).detach().clone()
                      for (pipe, stage), m in worker.modules.items() for name, p in m.named_parameters()}
            torch.save({"losses": losses, "grads": first_grads, "params": params, "factors": factors,
                        "events": events, "rollbacks": rollbacks, "ns": ns,
                        "kfac_work": None if worker.kfac is None else (worker.kfac.inverted, worker.kfac.preconditioned),
                        "curvature_age": worker.kfac.curvature_age() if worker.kfac is not None else None},
                       Path(out_dir) / f"case{i}_rank{rank}.pt")
        finally:
            release_process_group()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded (sdp) tensor gathered whole (a collective over its shards' group), else ``t``."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_cases(cases: list[tuple[TrainConfig, int]], out_dir: Path) -> list[dict[int, dict]]:
    """Run each (config, steps) case on its ``stages × data_parallel × sdp`` workers.

    Returns:
        Per case, rank → {"losses": per-step [mlm, nsp], "grads": first step's synchronized
        (and, with K-FAC, preconditioned) gradients, "params": parameters after the last step,
        "factors": K-FAC factors after the first step ("pipe/stage/name/A|B")}, keyed
        "pipe/stage/name", "events": the first step's timeline as (name, kind, is a wait), and
        "rollbacks": per step, the stage steps rolled back over all workers (``optimizer_placement=per_stage``),
        "ns": per step, (NS runs on this rank, of which for matrices it does not hold) with
        ``optimizer.ns_owners=pipeline`` (else empty), "kfac_work": (layers inverted, layers preconditioned on
        this rank over the run) with K-FAC (else None), "curvature_age": the last step's (K-FAC).
    """
    max_world = max(cfg.num_workers for cfg, _ in cases)
    start_workers(_worker, (cases, str(out_dir)), max_world)
    return [
        {r: torch.load(out_dir / f"case{i}_rank{r}.pt", weights_only=True) for r in range(cfg.num_workers)}
        for i, (cfg, _) in enumerate(cases)
    ]


Job = tuple[list[TrainConfig], str, bool, Any]  # (one config per rank, out_dir, stops with the fault, before)


def train_jobs(rank: int, jobs: list[Job], rendezvous: str) -> None:
    """Each job on its workers (one per config) in turn, as ``train.py`` runs it (``train_worker``), in one
    start of the workers; a job marked to stop with the injected fault (``fault.mode=raise``) must; ``before(out_dir)``, where
    given, runs on rank 0 first (the others wait at the job's rendezvous)."""
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[worker {rank}] %(levelname)s %(name)s: %(message)s")
    for i, (cfgs, out_dir, interrupted, before) in enumerate(jobs):
        if rank == 0 and before is not None:
            before(out_dir)  # the others wait: only rank 0 reads the checkpoint folder before agreeing
        world = len(cfgs)
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/pg{i}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        try:
            train_worker(cfgs[rank], rank, world, torch.device("cpu"), out_dir)
            assert not interrupted, f"job {i} should have stopped with the injected fault"
        except RuntimeError as err:
            if not (interrupted and "injected fault" in str(err)):
                raise
        finally:
            release_process_group()
