"""Muon's orthogonalization in a precision that follows the hardware, and Muon over sharded weights
with one owner per matrix.

Entry points: :func:`resolve_ns_dtype` (``optimizer.ns_dtype`` → a dtype and the start-up line),
:func:`newton_schulz`, :class:`Muon` (``torch.optim.Muon`` with ``ns_dtype``) and :class:`ShardedMuon`
(the same for DTensor weights: ``sdp``, ``tp``), :func:`assign_owners`.

[Note: Newton–Schulz precision]
torch's Muon (2.13) runs Newton–Schulz in bf16. That is fast where matrix products have bf16
instructions (CUDA capability >= 8.0; CPUs with AVX-512-BF16 or AMX) and 7–15× slower than fp32
where they do not (an AVX2-only AMD EPYC: 38 vs 5 ms at 128×128, 575 vs 40 ms at 256×256, issue 36),
which made Muon's step 2.9× NVLAMB's there against 1.067× on another CPU. So ``ns_dtype="auto"``
picks bf16 where :func:`pipefisher.hardware.bf16_arithmetic` finds bf16 instructions and fp32
elsewhere; ``bf16`` / ``fp32`` force one. The choice is read from the hardware, not timed: a run's
numerics must not depend on a noisy measurement (``bench/muon_sharded.py`` measures it). In bf16
:func:`newton_schulz` *is* torch's ``_zeropower_via_newtonschulz``, so :class:`Muon` then equals
``torch.optim.Muon`` bit for bit; in fp32 it is the same iteration with every operation in fp32.

[Note: one owner per matrix]
Under ``sdp`` (FSDP2) or ``tp`` a weight is a DTensor and each process of its mesh holds a part, but
Newton–Schulz orthogonalizes the whole matrix (NS of the parts is not the parts of NS). Gathering
each matrix on every process and orthogonalizing it there repeats the same work n times. As
Megatron-LM's layer-sharded Muon (#6676) and torchtitan's DistributedMuon do, :class:`ShardedMuon`
gives each matrix one owner (:func:`assign_owners`: the largest NS cost first, each to the least
loaded process) and per mesh and step runs two ``all_to_all_single`` exchanges::

    every process: momentum on its parts ──all_to_all──► owner: whole matrices ──NS once──►
    ──all_to_all──► every process: its parts of the result ──► decay and update on its parts

The parts travel in the NS precision (the iteration's first operation is that cast, elementwise, so
casting the parts first is exact). The owner orthogonalizes the same bits one process would, so
the update equals single-process Muon's up to the rounding of the gradients themselves (summed in
another order by the reduce-scatter). Cost per step: each matrix crosses the network twice, once
in each direction, and is orthogonalized once per mesh instead of once per process.
Weights whose layout is not one ``Shard`` on a 1-D mesh (FSDP2 over tensor-parallel parts: a 2-D
mesh with strided shards) and replicated ones keep the former way: gathered whole
(``full_tensor()``) and orthogonalized on every process.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from pipefisher.hardware import bf16_arithmetic
from pipefisher.optim.nvlamb import _closure_loss

try:  # torch >= 2.9: Muon's own Newton–Schulz and lr rule
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
except ImportError:  # MuonAdamW refuses to build on such a torch
    _adjust_lr = _zeropower_via_newtonschulz = None
_MUON_BASE: type[torch.optim.Optimizer] = getattr(torch.optim, "Muon", torch.optim.Optimizer)

__all__ = ["NS_DTYPES", "Muon", "ShardedMuon", "assign_owners", "newton_schulz", "ns_flops", "resolve_ns_dtype"]

#: ``optimizer.ns_dtype`` values; ``auto``: bf16 where the hardware has bf16 arithmetic, else fp32.
NS_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_ns_dtype(choice: str, device: torch.device | str) -> tuple[torch.dtype, str]:
    """The Newton–Schulz precision for ``optimizer.ns_dtype=choice`` on ``device`` ([Note: Newton–Schulz precision]).

    Returns:
        ``(dtype, line)``; the line is what the run logs at start-up, e.g.
        ``"muon: Newton-Schulz in fp32 (CPU AMD EPYC without avx512_bf16/amx)"``.

    Raises:
        ValueError: ``choice`` is not one of :data:`NS_DTYPES`.
    """
    if choice not in NS_DTYPES:
        raise ValueError(f"optimizer.ns_dtype={choice!r}: choose one of {', '.join(NS_DTYPES)}")
    fast, why = bf16_arithmetic(device)
    if choice == "auto":
        name = "bf16" if fast else "fp32"
        return NS_DTYPES[name], f"muon: Newton-Schulz in {name} ({why})"  # type: ignore[return-value]
    return NS_DTYPES[choice], f"muon: Newton-Schulz in {choice} (optimizer.ns_dtype={choice}; {why})"  # type: ignore[return-value]


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """FLOPs of ``steps`` Newton–Schulz iterations on an (A, B) matrix: per iteration X Xᵀ (2m²n),
    the quadratic in the Gram matrix (2m³) and its product with X (2m²n), m = min(A, B), n = max(A, B)."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


def newton_schulz(update: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """Orthogonalize an (A, B) matrix as torch's Muon does, in ``dtype``.

    bf16 is torch's own ``_zeropower_via_newtonschulz``; any other dtype runs the same operations in
    that dtype (the input is copied, never changed).

    Returns:
        The (A, B) result in ``dtype``.
    """
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    if update.ndim != 2:
        raise ValueError(f"newton_schulz: a tensor of shape {tuple(update.shape)}; Muon takes 2-D matrices only")
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.to(dtype, copy=True)
    if tall:
        x = x.T  # (m, n), m <= n: the Gram matrix is the small one
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.T  # (m, m)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·A + c·A²
        x = torch.addmm(x, poly, x, beta=a)  # a·X + (b·A + c·A²)·X
    return x.T if tall else x


def _ns_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if NS_DTYPES.get(value) is None:
        raise ValueError(f"Muon: ns_dtype={value!r}; use a torch dtype or one of bf16, fp32 "
                         "(resolve auto with resolve_ns_dtype)")
    return NS_DTYPES[value]  # type: ignore[return-value]


def _momentum_update(grad: Tensor, buf: Tensor, group: dict[str, Any]) -> Tensor:
    """torch's momentum step: the buffer moves toward the gradient; the (Nesterov) update (A, B)."""
    if grad.ndim != 2:
        raise ValueError(f"Muon: a gradient of shape {tuple(grad.shape)}; Muon takes 2-D weights only")
    momentum = group["momentum"]
    buf.lerp_(grad, 1 - momentum)  # elementwise: on the local parts of a DTensor
    return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _apply(param: Tensor, ortho: Tensor, group: dict[str, Any]) -> None:
    """torch's decoupled decay and update, scaled by ``_adjust_lr`` of the whole shape."""
    lr = group["lr"]
    lr = lr.item() if isinstance(lr, Tensor) else lr
    param.mul_(1 - lr * group["weight_decay"])
    param.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


class Muon(_MUON_BASE):  # type: ignore[misc, valid-type]
    """``torch.optim.Muon`` (same arguments, state and ``state_dict``) whose Newton–Schulz runs in
    ``ns_dtype`` ([Note: Newton–Schulz precision]); with ``ns_dtype=torch.bfloat16`` (the default)
    it steps exactly as torch's.

    Args:
        params, **kwargs: torch's Muon's.
        ns_dtype: the orthogonalization's precision (a dtype, ``"bf16"`` or ``"fp32"``); an attribute
            of the optimizer, not of its groups, so a checkpoint does not carry one machine's choice
            to another.

    Attributes:
        ns_runs: orthogonalizations this process ran in its last step.
        pending: while :meth:`collecting` is active, the (parameter, momentum update, group) of
            each parameter stepped, left for someone else to orthogonalize; else None.
    """

    def __init__(self, params: Any, *, ns_dtype: torch.dtype | str = torch.bfloat16, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype = _ns_dtype(ns_dtype)
        self.ns_runs = 0
        self.pending: list[tuple[Tensor, Tensor, dict[str, Any]]] | None = None

    def _orthogonalize(self, update: Tensor, group: dict[str, Any]) -> Tensor:
        self.ns_runs += 1
        return self.orthogonalize(update, group)

    @torch.no_grad()
    def orthogonalize(self, update: Tensor, group: dict[str, Any]) -> Tensor:
        """Newton–Schulz of one momentum update with ``group``'s settings, in ``ns_dtype`` (the same
        call :meth:`step` makes; not counted in ``ns_runs``)."""
        return newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

    @staticmethod
    @torch.no_grad()
    def apply(param: Tensor, ortho: Tensor, group: dict[str, Any]) -> None:
        """Decay and update ``param`` with its orthogonalized update (what :meth:`step` does after NS)."""
        _apply(param, ortho, group)

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[tuple[Tensor, Tensor, dict[str, Any]]]]:
        """While active, :meth:`step` moves the momentum and leaves each parameter's update in the
        yielded list, not orthogonalized and not applied (``runtime.ns_spread``: someone else runs
        the Newton–Schulz; :meth:`apply` then finishes the step). Calls may nest; the outer list
        gets everything."""
        if self.pending is not None:
            yield self.pending
            return
        self.pending = []
        try:
            yield self.pending
        finally:
            self.pending = None

    def _updates(self) -> list[tuple[Tensor, Tensor, dict[str, Any]]]:
        """(parameter, momentum update, group) of every parameter with a gradient, buffers stepped."""
        out = []
        for group in self.param_groups:
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)  # torch's: zero buffers like the gradient
            out += [(p, _momentum_update(g, b, group), group) for p, g, b in zip(params, grads, bufs)]
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        """One Muon step of every parameter with a gradient."""
        loss = _closure_loss(closure)
        self.ns_runs = 0
        for group in self.param_groups:  # torch's order: per parameter, momentum, NS, update
            params: list[Tensor] = []
            grads: list[Tensor] = []
            bufs: list[Tensor] = []
            self._init_group(group, params, grads, bufs)
            for p, g, b in zip(params, grads, bufs):
                update = _momentum_update(g, b, group)
                if self.pending is not None:  # collecting: orthogonalized elsewhere (runtime.ns_spread)
                    self.pending.append((p, update, group))
                else:
                    _apply(p, self._orthogonalize(update, group), group)
        return loss


class ShardedMuon(Muon):
    """:class:`Muon` for weights that are DTensors (FSDP2 shards under ``sdp``, tensor-parallel parts
    under ``tp``): each matrix orthogonalized once per mesh, by its owner ([Note: one owner per
    matrix]). Plain tensors step as in :class:`Muon`.

    Every process of a weight's mesh must step together, with the same parameters in the same order
    (the exchanges are collectives over the mesh).
    """

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:  # type: ignore[override]
        """One Muon step of every parameter with a gradient (collectives over each DTensor's mesh)."""
        if self.pending is not None:
            raise ValueError("ShardedMuon: its Newton-Schulz already has one owner per matrix in each mesh; "
                             "optimizer.ns_owners=pipeline needs sdp=1 and tp=1")
        loss = _closure_loss(closure)
        self.ns_runs = 0
        items = self._updates()
        orthos: list[Tensor | None] = [None] * len(items)
        meshes: dict[int, list[int]] = {}  # id(mesh) -> item indices; meshes in order of first appearance
        for i, (_, update, group) in enumerate(items):
            if isinstance(update, DTensor):
                meshes.setdefault(id(update.device_mesh), []).append(i)
            else:
                orthos[i] = self._orthogonalize(update, group)
        for indices in meshes.values():
            owned = [i for i in indices if _one_shard(items[i][1])]
            for i in [i for i in indices if i not in owned]:  # other layouts: gathered whole, NS everywhere
                update, group = items[i][1], items[i][2]
                ortho = self._orthogonalize(update.full_tensor(), group)
                orthos[i] = distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
            if owned:
                results = self._owner_orthogonalize([items[i][1] for i in owned], [items[i][2] for i in owned])
                for i, ortho in zip(owned, results):
                    orthos[i] = ortho
        for (param, _, group), ortho in zip(items, orthos):
            _apply(param, ortho, group)
        return loss

    def _owner_orthogonalize(self, updates: list[DTensor], groups: list[dict[str, Any]]) -> list[DTensor]:
        """Each (A, B) update (one ``Shard`` on the same 1-D mesh) orthogonalized by one owner: parts
        to the owners, NS there, parts of the results back (two ``all_to_all_single``)."""
        mesh = updates[0].device_mesh
        ranks, me = mesh.size(), mesh.get_local_rank()
        pg = mesh.get_group()
        shapes = [tuple(u.shape) for u in updates]
        dims = [u.placements[0].dim for u in updates]
        owners = assign_owners(shapes, ranks)
        dtype = self.ns_dtype
        local = [u.to_local().to(dtype) for u in updates]  # NS's first operation is this cast: exact
        send, send_splits, recv_splits = _pack_to_owners(local, shapes, dims, owners, me, ranks)
        received = _exchange(send, send_splits, recv_splits, pg)
        wholes = _unpack_at_owner(received, shapes, dims, owners, me, ranks)
        results = {i: self._orthogonalize(whole, groups[i]) for i, whole in wholes.items()}
        send, send_splits, recv_splits = _pack_from_owner(results, shapes, dims, owners, me, ranks, dtype,
                                                          local[0].device)
        received = _exchange(send, send_splits, recv_splits, pg)
        parts = _unpack_parts(received, shapes, dims, owners, me, ranks)
        return [DTensor.from_local(part, mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride())
                for part, u in zip(parts, updates)]


def _one_shard(t: DTensor) -> bool:
    """Whether ``t`` lies on a 1-D mesh of several processes, split on one dimension (``Shard``)."""
    return (t.device_mesh.ndim == 1 and t.device_mesh.size() > 1 and len(t.placements) == 1
            and type(t.placements[0]) is Shard)


def assign_owners(shapes: Sequence[Sequence[int]], ranks: int) -> list[int]:
    """An owner (0..ranks-1) per matrix that balances Newton–Schulz work: the largest :func:`ns_flops`
    first (ties: lower index), each to the process with the least work so far (ties: lower rank).
    A pure function of the shapes, so every process computes the same owners."""
    load = [0] * ranks
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i]), i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += ns_flops(shapes[i])
    return owners


def _part_sizes(length: int, ranks: int) -> list[int]:
    """Rows of each process's part of a dimension of ``length`` split over ``ranks`` (DTensor's and
    FSDP2's ``torch.chunk`` rule: parts of ceil(length / ranks), the last ones shorter or empty)."""
    size = math.ceil(length / ranks)
    return [max(0, min(size, length - r * size)) for r in range(ranks)]


def _part_shape(shape: Sequence[int], dim: int, rank: int, ranks: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = _part_sizes(shape[dim], ranks)[rank]
    return tuple(out)


def _part_numel(shape: Sequence[int], dim: int, rank: int, ranks: int) -> int:
    return math.prod(_part_shape(shape, dim, rank, ranks))


def _pack_to_owners(local: list[Tensor], shapes: list[tuple[int, ...]], dims: list[int], owners: list[int],
                    me: int, ranks: int) -> tuple[Tensor, list[int], list[int]]:
    """This process's parts, grouped by owner (matrices in index order), flat.

    Returns:
        ``(buffer, send_splits, recv_splits)`` for ``all_to_all_single``: elements to each process
        and from each process (the parts of the matrices this one owns).
    """
    for i, part in enumerate(local):
        assert tuple(part.shape) == _part_shape(shapes[i], dims[i], me, ranks), (i, part.shape, shapes[i])
    send = [[local[i].reshape(-1) for i in range(len(local)) if owners[i] == r] for r in range(ranks)]
    send_splits = [sum(t.numel() for t in ts) for ts in send]
    mine = [i for i in range(len(shapes)) if owners[i] == me]
    recv_splits = [sum(_part_numel(shapes[i], dims[i], r, ranks) for i in mine) for r in range(ranks)]
    flat = [t for ts in send for t in ts]
    buffer = torch.cat(flat) if flat else local[0].new_empty(0)
    return buffer, send_splits, recv_splits


def _unpack_at_owner(received: Tensor, shapes: list[tuple[int, ...]], dims: list[int], owners: list[int],
                     me: int, ranks: int) -> dict[int, Tensor]:
    """The whole matrices this process owns, from the parts every process sent (source rank order)."""
    mine = [i for i in range(len(shapes)) if owners[i] == me]
    parts: dict[int, list[Tensor]] = {i: [] for i in mine}
    offset = 0
    for r in range(ranks):
        for i in mine:
            shape = _part_shape(shapes[i], dims[i], r, ranks)
            n = math.prod(shape)
            parts[i].append(received[offset:offset + n].view(shape))
            offset += n
    assert offset == received.numel()
    return {i: torch.cat(parts[i], dim=dims[i]) for i in mine}


def _pack_from_owner(results: dict[int, Tensor], shapes: list[tuple[int, ...]], dims: list[int],
                     owners: list[int], me: int, ranks: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[Tensor, list[int], list[int]]:
    """Each process's parts of the results this one owns, grouped by process, flat.

    Returns:
        ``(buffer, send_splits, recv_splits)`` for ``all_to_all_single``.
    """
    mine = sorted(results)
    send: list[Tensor] = []
    send_splits = []
    for r in range(ranks):
        n = 0
        for i in mine:
            sizes = _part_sizes(shapes[i][dims[i]], ranks)
            part = results[i].narrow(dims[i], sum(sizes[:r]), sizes[r])
            send.append(part.reshape(-1).to(dtype))
            n += part.numel()
        send_splits.append(n)
    recv_splits = [sum(_part_numel(shapes[i], dims[i], me, ranks) for i in range(len(shapes)) if owners[i] == r)
                   for r in range(ranks)]
    buffer = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)  # owns nothing: sends nothing
    return buffer, send_splits, recv_splits


def _unpack_parts(received: Tensor, shapes: list[tuple[int, ...]], dims: list[int], owners: list[int], me: int,
                  ranks: int) -> list[Tensor]:
    """This process's part of every result, from the owners' buffers (source rank order)."""
    parts: list[Tensor | None] = [None] * len(shapes)
    offset = 0
    for r in range(ranks):
        for i in (i for i in range(len(shapes)) if owners[i] == r):
            shape = _part_shape(shapes[i], dims[i], me, ranks)
            n = math.prod(shape)
            parts[i] = received[offset:offset + n].view(shape)
            offset += n
    assert offset == received.numel()
    return parts  # type: ignore[return-value]


def _exchange(send: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """``all_to_all_single`` with uneven splits: element counts to and from each process of ``group``."""
    received = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=group)
    return received
