"""Tensor parallel inside the pipeline (``tp`` > 1): each encoder layer of a stage split Megatron-style
over the ``tp`` processes of one pipeline worker, with torch's DTensor ``parallelize_module``.

Entry points: :func:`tp_group` (every rank creates every group, in one order), :func:`stage_meshes`,
:func:`parallelize_stages` (splits the modules in place), :func:`is_tp_sharded` and the rank
arithmetic :func:`schedule_worker`, :func:`tp_index`, :func:`process_rank`.

[Note: tp inside the pipeline]
The schedule is built for ``stages x data_parallel x sdp`` workers, as without tp; each worker is ``tp``
processes with adjacent ranks (tp innermost, as Megatron places it, so a tp group stays on one node)::

    process rank r  =  worker w * tp + tp index i        (w = r // tp, i = r % tp)

All ``tp`` processes of a worker run the worker's action list. Activations between stages are
replicated over the tp ranks (every RowwiseParallel output is all-reduced), so tp index ``i`` of a
stage sends to and receives from tp index ``i`` of the next one: ``tp`` parallel copies of each
message, none of them shared. Data-parallel gradient groups, the tied weight's group and the sdp
groups are built per tp index in the same way (``runtime.build.new_groups``,
``runtime.sharding.sdp_groups``). With ``sdp`` > 1 each stage replica gets a 2-D (sdp, tp) mesh
(FSDP2 needs the tp mesh of a DTensor parameter and its own to share one root mesh): the layers are
split on its tp dimension first, then ``fully_shard`` shards every parameter on its sdp dimension
(a column-parallel weight becomes ``(_StridedShard(0), Shard(0))``).

Within a stage only the encoder layers are split: q, k, v and the FFN's first Linear by output
features (``ColwiseParallel``: weight and bias ``Shard(0)``), the attention output and the FFN's
second Linear by input features (``RowwiseParallel``: weight ``Shard(1)``, bias ``Replicate``; its
output all-reduced). Attention runs on local tensors (``use_local_output=True``) over this rank's
``num_heads / tp`` heads: ``scaled_dot_product_attention`` has no CPU backward sharding rule, and the
model's own attention needs none. Embeddings, LayerNorms and the heads stay whole on every tp rank
and get the same gradient on each (their inputs and output gradients are replicated), so nothing
is synchronized over tp after a backward. Issue 27's traps and where they are handled:

- The attention-probability dropout sees the local heads only: its ``KeyedDropout.shard`` makes it
  draw the full-shape mask and take this rank's slice (``model.rng``), so the masks stay those of
  single-process training. The other dropouts act on replicated tensors and draw whole masks.
- The global gradient norm counts a sharded gradient's local part on every tp rank and a
  replicated one (plain tensors, ``Replicate`` DTensors) on tp index 0 only
  (``runtime.build.norm_params``); NVLAMB's trust-ratio norms sum squares over the mesh dimensions
  a DTensor is sharded on, not over replicated ones (``optim.nvlamb``).
- The loss of the last stage is computed by every tp rank: only tp index 0 adds it to the step's
  loss all-reduce; the loss scale stays 1/(N·data_parallel·sdp).
- The tied embedding/decoder weight is never split: its copies are summed per tp index as before.
"""

from __future__ import annotations

import datetime
import itertools

import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from pipefisher.model import BertStage
from pipefisher.model.rng import KeyedDropout
from pipefisher.runtime.kfac_work import StageKey
from pipefisher.schedules.ir import Schedule

__all__ = ["tp_plan", "tp_group", "stage_meshes", "parallelize_stages", "is_tp_sharded", "schedule_worker",
           "tp_index", "process_rank"]

# A process-unique mesh dimension name per module: DeviceMesh equality ignores process groups (see
# runtime.sharding's _MESH_IDS), and Chimera's two replicas on one worker get a mesh each.
_MESH_IDS = itertools.count()


def tp_plan() -> dict[str, ColwiseParallel | RowwiseParallel]:
    """The plan of one encoder layer (``BertLayer``), by submodule name ([Note: tp inside the pipeline])."""
    return {
        "attention.self.query": ColwiseParallel(),
        "attention.self.key": ColwiseParallel(),
        "attention.self.value": ColwiseParallel(),
        "attention.output.dense": RowwiseParallel(),
        "intermediate.dense": ColwiseParallel(),
        "output.dense": RowwiseParallel(),
    }


def schedule_worker(rank: int, tp: int) -> int:
    """The schedule's worker that process ``rank`` is part of."""
    return rank // tp


def tp_index(rank: int, tp: int) -> int:
    """Which part of its worker's split layers process ``rank`` holds (0 .. tp-1)."""
    return rank % tp


def process_rank(worker: int, index: int, tp: int) -> int:
    """The process rank of tp index ``index`` of schedule worker ``worker``."""
    return worker * tp + index


def tp_group(num_workers: int, tp: int, rank: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The group of the ``tp`` processes of ``rank``'s worker (one group per worker; every rank
    creates all of them in one order, since ``new_group`` is a collective over the world)."""
    mine = None
    for w in range(num_workers):
        ranks = [process_rank(w, i, tp) for i in range(tp)]
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None, (rank, num_workers, tp)
    return mine


def stage_meshes(schedule: Schedule, rank: int, tp: int, group: dist.ProcessGroup, sdp: int,
                 sdp_groups: dict[StageKey, dist.ProcessGroup], device_type: str) -> dict[StageKey, DeviceMesh]:
    """The mesh of each of ``rank``'s stage replicas: 1-D over its worker's tp ``group``, or with
    ``sdp`` > 1 2-D (sdp, tp) over the replica's sdp group (``runtime.sharding.sdp_groups``, per tp
    index) and the tp group, as FSDP2 over tensor-parallel layers needs (one root mesh).

    Dimension names are unique in the process (``_MESH_IDS``); the tp dimension's starts with "tp".
    """
    worker = schedule_worker(rank, tp)
    meshes: dict[StageKey, DeviceMesh] = {}
    for g, pipe, stage in schedule.placement.stages_of(worker):
        n = next(_MESH_IDS)
        if sdp == 1:
            meshes[(pipe, stage)] = DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"tp{n}",))
            continue
        block = g // sdp
        copies = sorted(schedule.placement.worker_of(block * sdp + i, pipe, stage) for i in range(sdp))
        ranks = [[process_rank(w, i, tp) for i in range(tp)] for w in copies]  # [sdp, tp]
        meshes[(pipe, stage)] = DeviceMesh.from_group([sdp_groups[(pipe, stage)], group], device_type,
                                                      mesh=ranks, mesh_dim_names=(f"sdp-of-tp{n}", f"tp{n}"))
    return meshes


def parallelize_stages(modules: dict[StageKey, BertStage], meshes: dict[StageKey, DeviceMesh]) -> None:
    """Split every encoder layer of every stage replica over its mesh's tp dimension in place
    (``tp_plan``).

    The split layers' Linear weights become DTensors; the attention dropouts draw their slice of
    the full mask.

    Raises:
        ValueError: the heads or the FFN width do not divide over the tp ranks (config checks this
            before workers start).
    """
    for key in sorted(modules):
        stage = modules[key]
        mesh = meshes[key]
        tp_mesh = mesh[mesh.mesh_dim_names[-1]] if mesh.ndim > 1 else mesh
        tp, index = tp_mesh.size(), tp_mesh.get_local_rank()
        heads, ffn = stage.config.num_heads, stage.config.intermediate_size
        if heads % tp or ffn % tp:
            raise ValueError(f"tp={tp} must divide num_heads={heads} and intermediate_size={ffn}")
        for layer in stage.bert.encoder.layer.values():
            parallelize_module(layer, tp_mesh, tp_plan())
            dropout = layer.attention.self.dropout
            assert isinstance(dropout, KeyedDropout)
            dropout.shard = (1, index, tp)  # probabilities [B, A/tp, S, S]: the local heads


def is_tp_sharded(t: Tensor) -> bool:
    """Whether ``t`` (a parameter or gradient) is split over tp ranks: a DTensor sharded on a mesh
    dimension named tp*; plain tensors, ``Replicate`` DTensors and FSDP's shards alone (sdp) are
    whole on every tp rank of a worker."""
    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return any(name.startswith("tp") and not (p.is_replicate() or p.is_partial())
               for name, p in zip(names, t.placements))
