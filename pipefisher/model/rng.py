"""Dropout whose masks do not depend on where a micro-batch runs.

Entry points: ``dropout_key(step, micro_batch)`` (the context the trainer sets around a forward),
``KeyedDropout`` (the model's dropout module) and ``name_dropout_sites`` (gives each of a pipeline
layer's dropout modules its identity).

[Note: randomness independent of placement]
Issue 16, item 5; DESIGN.md "Randomness independent of placement". A dropout mask is drawn from a
generator re-seeded, for every call, by a hash of

    (seed, pipeline layer, dropout site within the layer, step, micro-batch index in the global batch)

and never from the process's global RNG. The first three are fixed when the stage is built
(``name_dropout_sites``); the last two come from the ``dropout_key`` context the trainer opens
around a micro-batch's forward: the tests' single-process reference (``tests/reference.py``) and the pipeline executor
(``pipefisher.runtime.executor``), which numbers a data-parallel replica's micro-batches from
``replica * num_micro_batches``, as the data does (``pipefisher.data.micro_batch_indices``). So a
sample meets the same masks whichever worker, stage split, pipe or replica runs it, and every
method gives the single-process loss with dropout on. This is the role Megatron-LM's CUDA RNG
tracker plays for tensor parallelism; here the key is the micro-batch instead of the rank.

Recompute (``torch.utils.checkpoint``) replays a layer in the backward pass, outside the forward's
``dropout_key`` context and, on CUDA, on autograd's own thread: ``BertStage`` hands the key to the
checkpointed function, which re-enters it (``replay_dropout_key``), so the replay draws the same
masks. Resume needs nothing saved: the key is a function of the step.

Outside a ``dropout_key`` context (fine-tuning, a bare ``model(...)`` call in tests), or on a
module that was never given a site, ``KeyedDropout`` is ``nn.Dropout``: it draws from the global RNG.

Under tensor parallelism a dropout may see only this rank's slice of the tensor the full model
would drop (attention probabilities over the local heads, ``runtime.tensor_parallel``): its
``shard = (dim, index, count)`` says so, and the mask is drawn at the full shape (``count`` times
the local size along ``dim``) and sliced to part ``index``, so every rank draws its part of the
single-process mask (issue 27; Megatron's RNG tracker instead forks a per-rank stream, which ties
the masks to the tp degree).

Cost per call: one 8-byte BLAKE2b hash and a ``manual_seed`` of a cached per-device, per-thread
generator, then ``torch.rand`` of the input's shape on the input's device (float32, whatever the
input's dtype, so bf16 autocast draws the same masks as fp32). Backward keeps the boolean mask
only, as ``nn.Dropout`` does.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DropoutKey", "KeyedDropout", "dropout_key", "current_dropout_key", "replay_dropout_key",
           "name_dropout_sites", "site_id"]

DropoutKey = tuple[int, int]
"""``(step, micro_batch)``: the optimizer step and the micro-batch's index in the global batch."""

_local = threading.local()  # .key: DropoutKey | None; .generators: {device: torch.Generator}


def _hash63(data: bytes) -> int:
    """A non-negative 63-bit integer from ``data`` (fits any torch generator's seed)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"pf-dropout").digest(), "little") >> 1


def site_id(seed: int, pipeline_layer: int, name: str) -> int:
    """Identity of one dropout site: the model seed, its pipeline layer and its name in that layer."""
    return _hash63(f"{seed}:{pipeline_layer}:{name}".encode())


def current_dropout_key() -> DropoutKey | None:
    """The key of the ``dropout_key`` context open on this thread (None outside one)."""
    return getattr(_local, "key", None)


def dropout_key(step: int, micro_batch: int) -> contextlib.AbstractContextManager[None]:
    """Draw every ``KeyedDropout`` mask inside the block from ``(step, micro_batch)``.

    Args:
        step: the optimizer step (from 0).
        micro_batch: the micro-batch's index in the step's global batch (data-parallel replica
            ``r`` of ``N`` micro-batches holds ``r * N .. r * N + N - 1``).
    """
    return replay_dropout_key((int(step), int(micro_batch)))


@contextlib.contextmanager
def replay_dropout_key(key: DropoutKey | None) -> Iterator[None]:
    """Re-enter a key taken with ``current_dropout_key`` (None: no key, the global RNG), e.g. in
    recompute's replay of a forward, which runs outside the forward's context."""
    previous = current_dropout_key()
    _local.key = key
    try:
        yield
    finally:
        _local.key = previous


def _generator(device: torch.device) -> torch.Generator:
    """This thread's reusable generator on ``device`` (re-seeded before every draw)."""
    generators = getattr(_local, "generators", None)
    if generators is None:
        generators = _local.generators = {}
    if device not in generators:
        generators[device] = torch.Generator(device=device)
    return generators[device]


def _keep_mask(shape: torch.Size, p: float, device: torch.device, seed: int) -> Tensor:
    """Boolean keep-mask of ``shape`` (each entry kept with probability 1 - p), a function of ``seed``."""
    generator = _generator(device)
    generator.manual_seed(seed)
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32) >= p


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` whose mask is a function of (site, step, micro-batch) inside ``dropout_key``.

    ``site`` is set by ``name_dropout_sites``; see [Note: randomness independent of placement].
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)
        self.site: int | None = None
        self.shard: tuple[int, int, int] | None = None  # (dim, index, count): x is part index of count along dim

    def forward(self, x: Tensor) -> Tensor:
        """Zero each entry of ``x`` with probability p and scale the rest by 1 / (1 - p) (training)."""
        if not self.training or self.p == 0.0:
            return x
        key = current_dropout_key()
        if key is None or self.site is None:
            return F.dropout(x, self.p, training=True)
        seed = _hash63(struct.pack("<3q", self.site, *key))
        if self.shard is None:
            keep = _keep_mask(x.shape, self.p, x.device, seed)
        else:  # this rank's slice of the full model's mask (tensor parallel)
            dim, index, count = self.shard
            full = list(x.shape)
            full[dim] *= count
            keep = _keep_mask(torch.Size(full), self.p, x.device, seed).narrow(dim, index * x.shape[dim], x.shape[dim])
        # x * keep / (1 - p) in one fused pass (aten's dropout kernel, differentiable: its backward
        # is the same op on the gradient), keeping only the boolean mask for backward.
        return torch.ops.aten.native_dropout_backward(x, keep, 1.0 / (1.0 - self.p))


def name_dropout_sites(module: nn.Module, seed: int, pipeline_layer: int) -> None:
    """Give every ``KeyedDropout`` in ``module`` (one pipeline layer) its site identity.

    The identity is (seed, pipeline layer, the dropout's name relative to ``module``), so it is the
    same whichever stage holds the layer.
    """
    for name, child in module.named_modules():
        if isinstance(child, KeyedDropout):
            child.site = site_id(seed, pipeline_layer, name)
