"""The cheaper split backward (issue 26, item 6): W adds its products into an existing ``.grad``
inside the GEMM, and the embedding lookups' weight gradients are deferred to W (``index_add_``
into ``.grad``), [Note: deferred embedding gradients] in ``runtime.split_backward``. Both must give
a plain backward's gradients, for a step's first micro-batch (``.grad`` None) and the ones after it
(accumulating), in fp32 and under bf16 autocast. Numerics only: the cost is measured by
``bench/split_backward.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipefisher.data.synthetic import SyntheticSource
from pipefisher.model import BertConfig, BertStage
from pipefisher.runtime.split_backward import (accumulating, apply_weight_grads, deferring, disable_split_backward,
                                               enable_split_backward)

CONFIG = BertConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=600, hidden_dropout=0.0,
                    attention_dropout=0.0)
# (first, last) pipeline layer: stage 0 of a 2-stage split (its own word embeddings) and the whole
# model (word embeddings tied to the MLM decoder: one .grad gets a lookup's rows and a product).
STAGES = {"first-stage": (0, 1), "whole-model": (0, 3)}


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    source = SyntheticSource(seq_len=16, max_predictions=3, vocab_size=CONFIG.vocab_size, seed=0)
    return [source.get_samples(range(4 * j, 4 * j + 4)) for j in range(n)]


def _backward_of(stage: BertStage, batch: dict[str, torch.Tensor], precision: str) -> None:
    """Forward (bf16 autocast or fp32) and backward of one micro-batch; a fixed upstream gradient
    where the stage has no heads."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        y = stage(None, batch)
    if y.dim() == 1:
        y.float().sum().backward()
    else:
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype)
        torch.autograd.backward(y, g)


def _assert_same_grads(split: nn.Module, plain: nn.Module) -> None:
    for (name, p), (_, q) in zip(plain.named_parameters(), split.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", sorted(STAGES))
def test_w_adds_into_existing_grads_what_a_plain_backward_adds(stage: str, precision: str) -> None:
    # micro-batch 0 by a full backward through the deferrable layers (a merged B, .grad None before),
    # then micro-batches 1 and 2 as I, I, W, W: both Ws accumulate into existing gradients.
    plain = BertStage(CONFIG, *STAGES[stage], seed=3)
    split = copy.deepcopy(plain)
    enable_split_backward([split])
    batches = _batches(3)
    _backward_of(plain, batches[0], precision)
    _backward_of(split, batches[0], precision)
    _assert_same_grads(split, plain)  # the full backward through the deferrable functions is a plain one
    stores = []
    for b in batches[1:]:
        _backward_of(plain, b, precision)
        with deferring([]) as store:
            _backward_of(split, b, precision)
        stores.append(store)
    for store in stores:
        apply_weight_grads(store)
        assert not store
    _assert_same_grads(split, plain)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_embedding_weight_gradients_wait_for_w(precision: str) -> None:
    plain = BertStage(CONFIG, 0, 1, seed=3)
    split = copy.deepcopy(plain)
    enable_split_backward([split])
    batch = _batches(1)[0]
    _backward_of(plain, batch, precision)
    with deferring([]) as store:
        _backward_of(split, batch, precision)
    embeddings = split.bert.embeddings
    tables = [embeddings.word_embeddings.weight, embeddings.position_embeddings.weight,
              embeddings.token_type_embeddings.weight]
    assert all(t.grad is None for t in tables)  # filed, not computed
    filed = [(param, g, ids) for param, g, ids in store if not ids.is_floating_point()]
    assert {id(param) for param, _, _ in filed} == {id(t) for t in tables}
    s = batch["input_ids"].shape[1]
    for param, g, ids in filed:  # the lookup's output gradient and ids, [T, H] and [T]: no dense [V, H]
        assert g.shape == (ids.numel(), CONFIG.hidden_size) and ids.dim() == 1
        assert ids.numel() == (s if param is embeddings.position_embeddings.weight else batch["input_ids"].numel())
    assert embeddings.LayerNorm.weight.grad is not None  # not a lookup: computed in I
    apply_weight_grads(store)
    _assert_same_grads(split, plain)


def test_lookups_with_options_keep_their_own_backward() -> None:
    # padding_idx, max_norm, scale_grad_by_freq and sparse change the backward: those stay nn.Embedding's.
    kept = [nn.Embedding(10, 4, padding_idx=0), nn.Embedding(10, 4, max_norm=1.0),
            nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Embedding(10, 4, sparse=True)]
    assert enable_split_backward(kept) == 0
    assert enable_split_backward([nn.Embedding(10, 4), nn.Linear(4, 4)]) == 2


def test_a_full_backward_accumulating_in_place_equals_autograds() -> None:
    """[Note: a full backward accumulates in place]: B under ``accumulating`` leaves the gradients
    plain autograd leaves (two micro-batches, so the second adds into existing ``.grad``); undone,
    the layers are plain again."""
    plain = BertStage(CONFIG, 0, CONFIG.num_layers + 1, seed=0)
    fused = copy.deepcopy(plain)
    enable_split_backward([fused])
    for batch in _batches(2):
        (plain(None, batch).sum()).backward()
        with accumulating():
            (fused(None, batch).sum()).backward()
    for (name, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert disable_split_backward([fused]) > 0
    assert all("forward" not in m.__dict__ for m in fused.modules())  # nn.Linear's own forward again
