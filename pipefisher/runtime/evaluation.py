"""Held-out evaluation through the run's own pipeline ([Note: held-out evaluation] in
``pipefisher.evaluation``).

Every worker walks its list of the forward-only schedule (``schedules.evaluation.forward_only``:
the training step's F, SEND_F and RECV_F in the same order, checked like every schedule) once per
pass; a pass covers N micro-batches of each of the W data-parallel groups, and ``eval.batches``
held-out micro-batches take ⌈batches / (N·W)⌉ passes. Held-out micro-batch ``p·N·W + r·N + j`` is
micro-batch j of group r in pass p; the last pass leaves out the actions of micro-batches past
``eval.batches`` on every worker alike (whole micro-batches go, so its sends and receives still
pair up). The stages holding the heads add up the evaluation sums, and one all-reduce gives
every worker the totals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipefisher.config import TrainConfig
from pipefisher.evaluation import eval_batch, eval_due, eval_figures, eval_source
from pipefisher.model import EVAL_SUMS
from pipefisher.runtime.device import autocast_context
from pipefisher.runtime.executor import CommSpec, StageKey, action_tag, post_recv
from pipefisher.schedules import forward_only
from pipefisher.schedules.ir import Action, ActionKind, Schedule

__all__ = ["PipelineEvaluator", "pass_actions", "pass_base", "run_forward_pass"]


def pass_base(schedule: Schedule, rank: int, pass_index: int) -> int:
    """The held-out index of worker ``rank``'s micro-batch 0 in pass ``pass_index``."""
    n = schedule.num_micro_batches
    return pass_index * n * schedule.dp_width + schedule.placement.dp_group_of(rank) * n


def pass_actions(schedule: Schedule, rank: int, total: int, base: int) -> list[Action]:
    """Worker ``rank``'s forward-only actions of the pass at ``base`` (:func:`pass_base`), without
    the micro-batches past ``total``."""
    return [a for a in schedule.actions[rank] if base + a.micro_batch < total]


def run_forward_pass(actions: Sequence[Action], schedule: Schedule, modules: dict[StageKey, nn.Module],
                     comm: CommSpec, get_batch: Callable[[int], dict[str, torch.Tensor]],
                     autocast: Callable[[], Any], eager_recv: bool,
                     peer_rank: Callable[[int], int] = lambda worker: worker) -> torch.Tensor:
    """Run one pass of forward-only ``actions`` (no grad; the modules in eval mode).

    ``peer_rank``: the process rank of a peer worker (under tp: the same tp index of that worker,
    ``runtime.tensor_parallel``).

    Returns:
        The [6] evaluation sums of the micro-batches whose heads are on this worker (zeros elsewhere).
    """
    recvs = {a: post_recv(a, comm, schedule, peer_rank(a.peer)) for a in actions
             if a.kind == ActionKind.RECV_F} if eager_recv else {}
    received: dict[tuple[int, int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int, int], torch.Tensor] = {}
    batches: dict[int, dict[str, torch.Tensor]] = {}
    sends: list[tuple[dist.Work, torch.Tensor]] = []
    sums = torch.zeros(len(EVAL_SUMS), dtype=torch.float64, device=comm.device)
    for a in actions:
        key = (a.pipe, a.stage, a.micro_batch)
        if a.kind == ActionKind.RECV_F:
            buf, work = recvs.pop(a) if a in recvs else post_recv(a, comm, schedule, peer_rank(a.peer))
            work.wait()
            received[key] = buf
        elif a.kind == ActionKind.FORWARD:
            x = received.pop(key, None)
            if x is None and (a.pipe, a.stage - 1) in modules:  # the previous stage is here (zb-v's turn)
                x = outputs.pop((a.pipe, a.stage - 1, a.micro_batch))
            if a.micro_batch not in batches:
                batches[a.micro_batch] = get_batch(a.micro_batch)
            with autocast():
                y = modules[(a.pipe, a.stage)].evaluate(x, batches[a.micro_batch])
            if y.dim() == 1:  # the heads' sums
                sums += y
            else:
                outputs[key] = y
        elif a.kind == ActionKind.SEND_F:
            y = outputs.pop(key).contiguous()
            sends.append((dist.isend(y, dst=peer_rank(a.peer), tag=action_tag(a, schedule)), y))
        else:  # pragma: no cover - forward_only keeps nothing else
            raise NotImplementedError(f"forward-only pass has no handler for {a}")
    for work, _ in sends:
        work.wait()
    return sums


class PipelineEvaluator:
    """A worker's part of held-out evaluation (every worker holds one; :meth:`evaluate` is a collective).

    Args:
        worker: the :class:`~pipefisher.runtime.pipeline_worker.PipelineWorker`.
    """

    def __init__(self, cfg: TrainConfig, worker: Any) -> None:
        self.cfg, self.worker = cfg, worker
        self.schedule = forward_only(worker.schedule)
        self.source = eval_source(cfg)
        per_pass = self.schedule.num_micro_batches * self.schedule.dp_width
        self.passes = -(-cfg.eval.batches // per_pass)
        self.comm = CommSpec((cfg.micro_batch_size, cfg.data.seq_len, cfg.model.hidden_size), torch.float32,
                             worker.device)  # real messages, also under comm_ablation
        self.eager_recv = dist.get_backend() != "nccl"

    def due(self, step: int) -> bool:
        """Whether the run evaluates after ``step``."""
        return eval_due(self.cfg, step)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the current weights on the held-out micro-batches; every worker gets the figures."""
        cfg, worker, s = self.cfg, self.worker, self.schedule
        start = time.perf_counter()
        modules = worker.modules
        for m in modules.values():
            m.eval()
        sums = torch.zeros(len(EVAL_SUMS), dtype=torch.float64, device=worker.device)
        try:
            with torch.no_grad():
                w, tp = worker.schedule_worker, cfg.tp  # a worker is tp processes: runtime.tensor_parallel
                for p in range(self.passes):
                    base = pass_base(s, w, p)
                    actions = pass_actions(s, w, cfg.eval.batches, base)
                    sums += run_forward_pass(actions, s, modules, self.comm,
                                             lambda j, base=base: eval_batch(self.source, cfg, base + j, worker.device),
                                             lambda: autocast_context(cfg, worker.device), self.eager_recv,
                                             lambda peer: peer * tp + worker.tp_index)
        finally:
            for m in modules.values():
                m.train()
        # Chimera's twins both hold the heads stage, each for its own pipe's micro-batches: a sum counts each once;
        # the tp ranks of a worker computed the same sums: tp index 0 alone adds them.
        if worker.tp_index != 0:
            sums.zero_()
        dist.all_reduce(sums)
        return eval_figures(sums, time.perf_counter() - start)
