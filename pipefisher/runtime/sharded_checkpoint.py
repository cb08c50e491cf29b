"""Checkpoints of sharded stage replicas (``sdp`` > 1, ``tp`` > 1) with ``torch.distributed.checkpoint``.

Entry points: :func:`checkpoint_groups` (which processes write a stage replica together),
:class:`ShardedCheckpointer` (split a worker's state, write and read its DCP folders) and
:func:`read_whole` (one DCP folder's tensors whole, in one process: export, ``init_from``, fine-tuning).

[Note: sharded checkpoint layout]
A sharded worker's parameters and optimizer moments are DTensors (FSDP2's shards, tensor-parallel
parts); each process holds a piece. They go into one DCP folder per stage replica, written by the
processes that share it (its sdp group, its tp group, or with both the sdp x tp processes), beside
the files of [Note: checkpoint layout] in ``pipefisher.runtime.checkpoint``::

    step_<n>/
      worker_<r>.pt                  as for unsharded runs (step, scheduler, generators, the optimizer's
                                     step counts and groups), less every tensor of the stage replicas
                                     and of the optimizer's state: those hold IN_DCP instead
      sharded_<pipe>.<stage>/        dcp.save of {"model.<name>": ..., "optimizer.<name>.<key>": ...}
        .metadata, __<i>_0.distcp
      manifest.json                  lists every DCP file with its size and sha256 ("files")

Only the replicas of data-parallel block 0 write (the other blocks hold the same values and read
block 0's folder, each over its own group: DCP plans reads by global offsets, not by writer).
Writes stay atomic: a group writes into ``.sharded_<pipe>.<stage>.tmp``, its coordinator renames it
into place once every member wrote (``dcp.save`` returns on the coordinator after gathering every
member's result) and hashes the files for the manifest, which rank 0 writes last. A run killed
mid-write leaves no manifest, and a damaged DCP file fails the manifest's hash: ``resume=auto``
skips both (``checkpoint.find_latest``).

DCP reads ``.metadata`` with ``pickle``; :class:`_SafeReader` reads it with an unpickler that admits
DCP's own metadata classes and a few torch values only (nothing unsafe is unpickled, DESIGN.md);
tensors are read with ``weights_only=True`` by DCP itself. Only tensors go into DCP (non-tensor
values would be read back with ``weights_only=False``).

Outside a run (``export.py``, ``train.py init_from=``, ``finetune.py init.checkpoint=``),
:func:`read_whole` reads a folder's tensors whole in one process without a process group: templates
of the full sizes DCP's metadata records, loaded with ``no_dist=True`` (DCP assembles the pieces by
their global offsets, whichever sdp/tp layout wrote them); ``runtime.saved_weights`` puts them where
the ``.pt`` shards hold IN_DCP (issue 38).

Why not ``get_optimizer_state_dict``: one optimizer here spans every stage replica of a worker
(Chimera's two, each sharded over its own group), while DCP's helpers map an optimizer onto one
module, and on a fresh optimizer they initialize its state by a step with zero gradients, which
NVLAMB (global-norm clip, trust ratio) would not take as a no-op. The state here is keyed by
parameter name, as those helpers key it.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh

from pipefisher.atomic import fsync_path
from pipefisher.runtime.checkpoint_io import CheckpointError, ShardInfo, file_info
from pipefisher.runtime.kfac_work import StageKey
from pipefisher.runtime.state import module_key

__all__ = ["IN_DCP", "ShardedCheckpointer", "checkpoint_groups", "dcp_folder", "read_whole"]

log = logging.getLogger("pipefisher.runtime.checkpoint")

#: What a worker's ``.pt`` shard holds in place of a tensor written to DCP.
IN_DCP = "<torch.distributed.checkpoint>"


def dcp_folder(key: StageKey) -> str:
    """The DCP folder of stage replica (pipe, stage) inside a ``step_<n>`` folder."""
    return f"sharded_{module_key(*key)}"


def checkpoint_groups(keys: list[StageKey], sdp_groups: Mapping[StageKey, dist.ProcessGroup],
                      tp_group: dist.ProcessGroup | None, meshes: Mapping[StageKey, DeviceMesh],
                      timeout: datetime.timedelta) -> dict[StageKey, dist.ProcessGroup]:
    """The group of processes that hold a piece of each stage replica: its sdp group, its tp group,
    or with both a new group over its (sdp, tp) mesh (created by those processes only, in sorted order)."""
    groups: dict[StageKey, dist.ProcessGroup] = {}
    for key in sorted(keys):
        mesh = meshes.get(key)
        if mesh is not None and mesh.ndim > 1:
            ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
            groups[key] = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        elif key in sdp_groups:
            groups[key] = sdp_groups[key]
        else:
            assert tp_group is not None, key
            groups[key] = tp_group
    return groups


class _SafeUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes and the torch values they hold; refuses anything else."""

    _ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" or (module, name) in self._ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


class _SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with ``.metadata`` read by :class:`_SafeUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        try:
            metadata = _SafeUnpickler(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, AttributeError, EOFError) as err:
            raise CheckpointError(f"{path}: unreadable DCP metadata ({err})") from None
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_whole(folder: Path, prefix: str = "") -> dict[str, Tensor]:
    """The tensors of one DCP folder whose keys start with ``prefix``, each whole (its pieces from
    every process that wrote it put together), on the CPU; no process group is needed or used.

    Raises:
        CheckpointError: the folder's metadata is missing or unreadable, or it holds no such tensor.
    """
    try:
        metadata = _SafeReader(folder).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no DCP metadata (.metadata)") from None
    entries = {k: m for k, m in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    if not entries:
        raise CheckpointError(f"{folder}: holds no {prefix}* tensors (keys {sorted(metadata.state_dict_metadata)[:4]})")
    odd = sorted(k for k, m in entries.items() if not isinstance(m, TensorStorageMetadata))
    if odd:  # this project writes tensors only ([Note: sharded checkpoint layout])
        raise CheckpointError(f"{folder}: {odd[0]} is not a tensor; not a checkpoint this project wrote")
    whole = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in entries.items()}
    with warnings.catch_warnings():  # DCP warns that it loads in one process even when asked to (no_dist)
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
        dcp.load(whole, storage_reader=_SafeReader(folder), no_dist=True)  # in place, by global offsets
    return whole


class ShardedCheckpointer:
    """Writes and reads the DCP part of one worker's checkpoint ([Note: sharded checkpoint layout]).

    Args:
        modules: the worker's stage replicas, keyed (pipe, stage), already sharded or split.
        optimizer: the worker's optimizer over all of them.
        groups: per replica, the processes holding its pieces (:func:`checkpoint_groups`).
        writes: the replicas this worker writes (those of data-parallel block 0).
    """

    def __init__(self, modules: Mapping[StageKey, nn.Module], optimizer: torch.optim.Optimizer,
                 groups: Mapping[StageKey, dist.ProcessGroup], writes: set[StageKey]) -> None:
        self.modules, self.optimizer, self.groups, self.writes = modules, optimizer, groups, writes
        names = {id(p): (key, name) for key, m in modules.items() for name, p in m.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        # optimizer.state_dict() numbers the parameters in this order
        self._index: list[tuple[StageKey, str, Tensor]] = [(*names[id(p)], p) for p in params]

    # -- saving ------------------------------------------------------------------------------------

    def split(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[StageKey, dict[str, Tensor]]]:
        """A worker's :meth:`~pipefisher.runtime.pipeline_worker.PipelineWorker.state_dict` without
        its replicas' tensors and optimizer tensor states (for its ``.pt`` shard), and those tensors
        per replica, keyed ``model.<name>`` and ``optimizer.<name>.<key>`` (for DCP)."""
        tensors: dict[StageKey, dict[str, Tensor]] = {key: {} for key in self.modules}
        modules = {}
        for key in self.modules:
            saved = state["modules"][module_key(*key)]
            tensors[key].update({f"model.{n}": t for n, t in saved.items()})
            modules[module_key(*key)] = {n: IN_DCP for n in saved}
        optim = dict(state["optimizer"])
        per_param = {}
        for index, entry in optim["state"].items():
            key, name, param = self._index[index]
            kept = {}
            for k, v in entry.items():
                # Moments shaped like their parameter go to DCP (sharded as it is); other tensors (AdamW's
                # 0-d step count) stay in the .pt shard: :meth:`merge` reads DCP into parameter-shaped templates.
                if isinstance(v, Tensor) and v.shape == param.shape:
                    tensors[key][f"optimizer.{name}.{k}"] = v
                    kept[k] = IN_DCP
                else:
                    kept[k] = v
            per_param[index] = kept
        optim["state"] = per_param
        return {**state, "modules": modules, "optimizer": optim}, tensors

    def save(self, folder: Path, tensors: Mapping[StageKey, Mapping[str, Tensor]]) -> list[ShardInfo]:
        """Write each replica this worker writes into ``folder/sharded_<pipe>.<stage>`` (a collective
        over each replica's group, in sorted order).

        Returns:
            The files this process renamed into place (as a group's coordinator), for the manifest.
        """
        written: list[ShardInfo] = []
        for key in sorted(self.writes):
            group = self.groups[key]
            final = folder / dcp_folder(key)
            tmp = folder / f".{final.name}.tmp"
            coordinator = dist.get_rank(group) == 0
            if coordinator:  # a run killed while writing it left one
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            dist.barrier(group=group)
            dcp.save(dict(tensors[key]), storage_writer=dcp.FileSystemWriter(tmp), process_group=group)
            if coordinator:  # every member's write is done: dcp.save gathered their results
                shutil.rmtree(final, ignore_errors=True)  # the same step saved again after a resume
                os.replace(tmp, final)
                fsync_path(folder)
                written += [file_info(folder, f"{final.name}/{p.name}") for p in sorted(final.iterdir())]
        return written

    # -- loading -----------------------------------------------------------------------------------

    def merge(self, folder: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Read every replica of this worker from ``folder``'s DCP folders (a collective over each
        replica's group, in sorted order) into ``state`` (a ``.pt`` shard written by :meth:`split`).

        Returns:
            ``state`` with its replicas' tensors and optimizer tensor states in place (DTensors
            sharded as this worker's), ready for ``PipelineWorker.load_state_dict``.

        Raises:
            CheckpointError: a DCP folder is missing, or does not hold what the shard names.
        """
        modules = {}
        optim = dict(state["optimizer"])
        optim["state"] = {i: dict(entry) for i, entry in optim["state"].items()}
        for key in sorted(self.modules):
            source = folder / dcp_folder(key)
            own = self.modules[key].state_dict()
            template = {f"model.{n}": torch.zeros_like(t.detach()) for n, t in own.items()}
            wanted = []  # (parameter index, state key): the optimizer tensors of this replica
            for index, entry in optim["state"].items():
                k_, name, p = self._index[index]
                if k_ == key:
                    for k, v in entry.items():
                        if isinstance(v, str) and v == IN_DCP:
                            template[f"optimizer.{name}.{k}"] = torch.zeros_like(p.detach())
                            wanted.append((index, k, name))
            if not source.is_dir():
                raise CheckpointError(f"checkpoint {folder}: no {source.name}/ (the DCP folder of stage replica "
                                      f"{module_key(*key)}); it was written by another kind of run (sdp/tp)")
            dcp.load(template, storage_reader=_SafeReader(source), process_group=self.groups[key])
            modules[module_key(*key)] = {n: template[f"model.{n}"] for n in own}
            for index, k, name in wanted:
                optim["state"][index][k] = template[f"optimizer.{name}.{k}"]
        return {**state, "modules": modules, "optimizer": optim}
