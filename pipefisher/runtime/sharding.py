"""Sharded data parallel inside the pipeline (``sdp`` > 1): each stage replica wrapped with torch's
FSDP2 (``fully_shard``) over the copies of that replica in the ``sdp`` pipelines that shard together.

Entry points: :func:`sdp_groups` (every rank creates every group, in one order), :func:`shard_stages`
(wraps the modules and returns the :class:`ShardedStages` the executor drives), :func:`local` and
:func:`full_state_dict`.

[Note: sdp inside the pipeline]
The schedule is built with ``data_parallel x sdp`` data-parallel replicas (each its own micro-batches,
loss scale 1/(N·data_parallel·sdp)); replica ``g`` is data-parallel block ``g // sdp`` and sdp index
``g % sdp``. The copies of a stage replica in one block run the same action list, so they shard it
together: one process group per (block, pipe, stage), one FSDP unit per stage module. Issue 27's traps:

- gloo has no ``PREMUL_SUM``: every FSDP module gets ``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)`` (neither recurses); the loss scale stays ours.
- Gradient sync is off on every backward; ``SYNC_GRAD`` (after the replica's last B *or W*) runs FSDP's
  post-backward by hand (as torch's ``PipelineStage.perform_reduce_grad``): one reduce-scatter, then
  the executor all-reduces the local shards over the other blocks (``data_parallel``) and the tied
  weight's shards over the holders with the same sdp index (stage 0 and the last stage shard it alike:
  dim 0 over groups of one size).
- ``reshard_after_forward=False`` (default): :meth:`ShardedStages.begin_step` gathers every module in
  one fixed order at step start, recorded as a wait, so F and B hold compute only; Chimera's two
  replicas per worker then never interleave their collectives. With ``True`` each F and B first
  gathers its module explicitly (a wait too) and the backward frees it again.
- New groups do not inherit ``init_process_group``'s timeout: it is passed.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from pipefisher.runtime.kfac_work import StageKey
from pipefisher.schedules.ir import Schedule

__all__ = ["ShardedStages", "sdp_groups", "shard_stages", "local", "full_state_dict", "sdp_index", "dp_block"]


# DeviceMesh equality ignores process groups: two meshes over the same ranks (Chimera's two replicas
# on one worker; a later run in the same process) would share DTensor's cached plans and with them
# one group. A dimension name unique in the process keeps each module's mesh its own.
_MESH_IDS = itertools.count()


def sdp_index(dp_group: int, sdp: int) -> int:
    """Which shard a data-parallel replica ``dp_group`` of the schedule holds ([Note: sdp inside the pipeline])."""
    return dp_group % sdp


def dp_block(dp_group: int, sdp: int) -> int:
    """The block of ``sdp`` replicas that shard together, that replica ``dp_group`` belongs to."""
    return dp_group // sdp


def sdp_groups(schedule: Schedule, sdp: int, rank: int, timeout: datetime.timedelta,
               tp: int = 1) -> dict[StageKey, dist.ProcessGroup]:
    """One process group per (block, pipe, stage): the ``sdp`` workers sharding that stage replica
    (with ``tp`` > 1 one per tp index, over the processes of that index: ``runtime.tensor_parallel``).

    Every rank creates every group in one order (``new_group`` is a collective over the world).

    Returns:
        The groups of ``rank``'s stage replicas, keyed by (pipe, stage).
    """
    placement = schedule.placement
    by_replica: dict[tuple[int, int, int], list[int]] = {}
    for (g, pipe, stage), worker in sorted(placement.workers.items()):
        by_replica.setdefault((dp_block(g, sdp), pipe, stage), []).append(worker)
    mine: dict[StageKey, dist.ProcessGroup] = {}
    for t in range(tp):
        for (_block, pipe, stage), workers in sorted(by_replica.items()):
            ranks = sorted(w * tp + t for w in workers)
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[(pipe, stage)] = group
    return mine


class ShardedStages:
    """The FSDP2-wrapped stage replicas of one worker, driven by the executor at fixed points."""

    def __init__(self, modules: dict[StageKey, nn.Module], reshard_after_forward: bool) -> None:
        self.modules = modules
        self.reshard_after_forward = reshard_after_forward

    def _fsdp(self, key: StageKey) -> FSDPModule:
        m = self.modules[key]
        assert isinstance(m, FSDPModule), key
        return m

    def begin_step(self) -> bool:
        """Gradient sync off for every backward of the step; with reshard_after_forward=False also
        gather every module's weights now, in one fixed order (a collective wait, not compute).
        Returns whether anything was gathered."""
        for key in sorted(self.modules):
            m = self._fsdp(key)
            m.set_requires_gradient_sync(False)
            m.set_is_last_backward(False)
            m.set_reshard_after_backward(self.reshard_after_forward)
            if not self.reshard_after_forward:
                m.unshard()
        return not self.reshard_after_forward

    def gather_for(self, key: StageKey) -> bool:
        """Before an F or B of replica ``key`` with reshard_after_forward=True: gather its weights
        (FSDP's own hook then finds them gathered). Returns whether anything was gathered."""
        if not self.reshard_after_forward or key not in self.modules:
            return False
        self._fsdp(key).unshard()
        return True

    def reduce(self, key: StageKey) -> None:
        """After replica ``key``'s last B or W: FSDP's post-backward by hand (the reduce-scatter of
        the step's accumulated gradients into the local shards), then free the gathered weights."""
        m = self._fsdp(key)
        m.set_is_last_backward(True)
        m.set_reshard_after_backward(True)
        m.set_requires_gradient_sync(True)
        state = fully_shard.state(m)  # type: ignore[attr-defined]
        for s in state._state_ctx.all_states:
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        m.set_requires_gradient_sync(False)


def shard_stages(modules: dict[StageKey, nn.Module], groups: dict[StageKey, dist.ProcessGroup],
                 reshard_after_forward: bool, device_type: str,
                 meshes: dict[StageKey, DeviceMesh] | None = None) -> ShardedStages:
    """Wrap each stage replica with ``fully_shard`` on its sdp group, in place (the module's class
    becomes its FSDP subclass; parameters become DTensors sharded on dim 0).

    ``meshes``: under tensor parallel, each replica's 2-D (sdp, tp) mesh, whose tp dimension its
    layers were split on (``runtime.tensor_parallel.stage_meshes``); FSDP shards on its first.

    Every FSDP module gets a divide factor of 1 and sum reductions: gloo has no PREMUL_SUM, and
    the loss is already scaled by 1/(N·replicas).
    """
    for key in sorted(modules):
        if meshes:
            mesh = meshes[key][meshes[key].mesh_dim_names[0]]
        else:
            mesh = DeviceMesh.from_group(groups[key], device_type, mesh_dim_names=(f"sdp{next(_MESH_IDS)}",))
        fully_shard(modules[key], mesh=mesh, reshard_after_forward=reshard_after_forward)
        for sub in modules[key].modules():
            if isinstance(sub, FSDPModule):  # neither setting recurses: issue 27
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)
    return ShardedStages(modules, reshard_after_forward)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor); writes to it change ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor gathered whole (a collective over its mesh:
    every rank sharding the module calls it)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}

