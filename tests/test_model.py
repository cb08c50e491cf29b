"""BERT model and partition: equivalence with transformers, stages vs full model, balancing."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from pipefisher.model import (
    BERT_SIZES,
    DECODER_WEIGHT_NAME,
    WORD_EMBEDDINGS_NAME,
    BertConfig,
    BertStage,
    build_full_model,
    layer_costs,
    load_hf_state_dict,
    merge_stage_state_dicts,
    partition_layers,
    stage_costs,
)
from pipefisher.model.partition import _bounds_from_counts

torch.set_num_threads(1)

VOCAB = 1000
SEQ = 16
PRED = 4


def _config(num_layers: int = 2, dropout: float = 0.0) -> BertConfig:
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        max_position_embeddings=64,
        hidden_dropout=dropout,
        attention_dropout=dropout,
    )


def _batch(batch_size: int = 3, seed: int = 1) -> dict[str, torch.Tensor]:
    """A micro-batch in NVIDIA's format with padding tokens and 0-padded masked slots."""
    g = torch.Generator().manual_seed(seed)
    lengths = [SEQ, SEQ - 5, SEQ - 9][:batch_size]
    input_ids = torch.randint(5, VOCAB, (batch_size, SEQ), generator=g)
    input_mask = torch.zeros(batch_size, SEQ, dtype=torch.long)
    segment_ids = torch.zeros(batch_size, SEQ, dtype=torch.long)
    positions = torch.zeros(batch_size, PRED, dtype=torch.long)
    ids = torch.zeros(batch_size, PRED, dtype=torch.long)
    num_real = [PRED, PRED - 1, PRED - 3][:batch_size]
    for b, (length, real) in enumerate(zip(lengths, num_real)):
        input_ids[b, length:] = 0
        input_mask[b, :length] = 1
        segment_ids[b, length // 2 : length] = 1
        chosen = torch.randperm(length - 1, generator=g)[:real].sort().values + 1
        positions[b, :real] = chosen
        ids[b, :real] = input_ids[b, chosen]
        input_ids[b, chosen] = 3  # [MASK]
    return {
        "input_ids": input_ids,
        "segment_ids": segment_ids,
        "input_mask": input_mask,
        "masked_lm_positions": positions,
        "masked_lm_ids": ids,
        "next_sentence_labels": torch.tensor([0, 1, 1][:batch_size]),
    }


def _hf_model(config: BertConfig) -> torch.nn.Module:
    """An independent reference: transformers' BertForPreTraining (only these tests need it)."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.BertConfig(**config.hf_config_kwargs(), attn_implementation="eager")
    torch.manual_seed(123)
    return transformers.BertForPreTraining(hf_config).eval()


def _hf_logits(hf, batch):
    with torch.no_grad():
        out = hf(
            input_ids=batch["input_ids"],
            attention_mask=batch["input_mask"],
            token_type_ids=batch["segment_ids"],
        )
    index = batch["masked_lm_positions"].unsqueeze(-1).expand(-1, -1, VOCAB)
    return out.prediction_logits.gather(1, index), out.seq_relationship_logits


# ---- equivalence with transformers ---------------------------------------------------------------


def test_full_model_matches_huggingface_logits_and_loss_with_padding():
    config = _config(num_layers=2)
    hf = _hf_model(config)
    model = build_full_model(config, seed=7).eval()
    load_hf_state_dict(model, hf.state_dict())
    batch = _batch()

    hf_mlm, hf_nsp = _hf_logits(hf, batch)
    with torch.no_grad():
        mlm, nsp = model.logits(model.encode(None, batch), batch)
        loss = model(None, batch)
    assert mlm.shape == (3, PRED, VOCAB) and nsp.shape == (3, 2)
    torch.testing.assert_close(mlm, hf_mlm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nsp, hf_nsp, atol=1e-5, rtol=1e-5)

    # Loss by hand from HF's logits: mean over real masked slots (ids != 0), mean NSP over B.
    real = batch["masked_lm_ids"] != 0
    expected_mlm = F.cross_entropy(hf_mlm[real], batch["masked_lm_ids"][real])
    expected_nsp = F.cross_entropy(hf_nsp, batch["next_sentence_labels"])
    assert loss.shape == (2,)
    torch.testing.assert_close(loss, torch.stack([expected_mlm, expected_nsp]), atol=1e-5, rtol=1e-5)


def test_load_hf_state_dict_accepts_single_names_of_tied_pairs_and_ignores_buffers():
    config = _config(num_layers=2)
    hf_state = dict(_hf_model(config).state_dict())
    del hf_state["cls.predictions.decoder.weight"]
    hf_state["cls.predictions.decoder.bias"] = hf_state.pop("cls.predictions.bias")
    hf_state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    last = BertStage(config, 3, 3)  # heads only: decoder falls back to the word embeddings
    load_hf_state_dict(last, hf_state)
    assert torch.equal(last.state_dict()[DECODER_WEIGHT_NAME], hf_state[WORD_EMBEDDINGS_NAME])
    assert torch.equal(last.cls.predictions.bias, hf_state["cls.predictions.decoder.bias"])

    del hf_state["bert.encoder.layer.1.output.dense.weight"]
    load_hf_state_dict(BertStage(config, 0, 1), hf_state)  # does not hold layer 1: fine
    with pytest.raises(KeyError, match=r"bert\.encoder\.layer\.1\.output\.dense\.weight"):
        load_hf_state_dict(BertStage(config, 2, 3), hf_state)


def test_merged_stage_state_dicts_load_strictly_into_huggingface():
    config = _config(num_layers=4)
    stages = [BertStage(config, *bounds, seed=3) for bounds in partition_layers(config, 3)]
    merged = merge_stage_state_dicts([s.state_dict() for s in stages])
    hf = _hf_model(config)
    hf.load_state_dict(merged, strict=True)
    full = build_full_model(config, seed=3).eval()
    batch = _batch()
    hf_mlm, hf_nsp = _hf_logits(hf, batch)
    with torch.no_grad():
        mlm, nsp = full.logits(full.encode(None, batch), batch)
    torch.testing.assert_close(mlm, hf_mlm, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nsp, hf_nsp, atol=1e-5, rtol=1e-5)

    with torch.no_grad():
        stages[-1].cls.predictions.decoder.weight.add_(1e-2)
    with pytest.raises(ValueError, match="gradient must be summed"):
        merge_stage_state_dicts([s.state_dict() for s in stages])
    with pytest.raises(ValueError, match="held by two stages"):
        merge_stage_state_dicts([stages[1].state_dict(), stages[1].state_dict()])


# ---- stages vs the full model --------------------------------------------------------------------


def _run_stages(stages, batch):
    """Forward and backward through stages chained by hand, as the pipeline runtime does."""
    inputs, outputs = [], []
    hidden = None
    for stage in stages:
        if hidden is not None:
            hidden = hidden.detach().requires_grad_(True)
        inputs.append(hidden)
        hidden = stage(hidden, batch)
        outputs.append(hidden)
    loss = outputs[-1]
    loss.sum().backward()
    for k in range(len(stages) - 2, -1, -1):
        outputs[k].backward(inputs[k + 1].grad)
    return loss.detach()


def test_independent_stages_match_full_model_weights_loss_and_gradients():
    config = _config(num_layers=4, dropout=0.1)
    bounds = partition_layers(config, 3, layers_per_stage=[1, 2, 1])
    assert bounds == [(0, 1), (2, 3), (4, 5)]
    stages = []
    for k, (first, last) in enumerate(bounds):
        torch.manual_seed(1000 + k)  # global RNG state must not matter
        stages.append(BertStage(config, first, last, seed=5).train())
    torch.manual_seed(99)
    full = build_full_model(config, seed=5).train()

    full_state = full.state_dict()
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            reference = full_state[WORD_EMBEDDINGS_NAME if name == DECODER_WEIGHT_NAME else name]
            assert torch.equal(tensor, reference), name

    batch = _batch()
    torch.manual_seed(0)  # same dropout draws: stages run the layers in the full model's order
    staged_loss = _run_stages(stages, batch)
    torch.manual_seed(0)
    full_loss = full(None, batch)
    full_loss.sum().backward()
    torch.testing.assert_close(staged_loss, full_loss.detach(), rtol=0, atol=0)

    staged_grads = {}
    for stage in stages:
        for name, param in stage.named_parameters():
            staged_grads[name] = param.grad
    tied = staged_grads.pop(WORD_EMBEDDINGS_NAME) + staged_grads.pop(DECODER_WEIGHT_NAME)
    full_grads = dict(full.named_parameters())
    torch.testing.assert_close(tied, full_grads.pop(WORD_EMBEDDINGS_NAME).grad, rtol=1e-6, atol=1e-7)
    assert staged_grads.keys() == full_grads.keys()
    for name, grad in staged_grads.items():
        torch.testing.assert_close(grad, full_grads[name].grad, rtol=1e-6, atol=1e-7, msg=name)


def test_stage_parameter_names_are_hf_names_disjoint_except_tied_weight():
    config = _config(num_layers=4)
    stages = [BertStage(config, *b) for b in partition_layers(config, 3, layers_per_stage=[1, 2, 1])]
    names = [set(n for n, _ in s.named_parameters()) for s in stages]
    for a, b in itertools.combinations(names, 2):
        assert not a & b
    full = build_full_model(config)
    full_names = set(n for n, _ in full.named_parameters())
    assert set().union(*names) == full_names | {DECODER_WEIGHT_NAME}
    assert "bert.encoder.layer.1.attention.self.query.weight" in names[1]
    assert "bert.encoder.layer.2.output.LayerNorm.bias" in names[1]
    hf_names = set(_hf_model(config).state_dict())
    assert set().union(*names) <= hf_names

    assert full.cls.predictions.decoder.weight is full.bert.embeddings.word_embeddings.weight
    assert full.tied_parameter_name is None
    assert [s.tied_parameter_name for s in stages] == [WORD_EMBEDDINGS_NAME, None, DECODER_WEIGHT_NAME]
    assert [(s.has_embeddings, s.has_heads) for s in stages] == [(True, False), (False, False), (False, True)]
    assert list(stages[1].encoder_layer_indices) == [1, 2]


def test_recompute_gives_same_loss_and_gradients_with_dropout(monkeypatch):
    import pipefisher.model.bert as bert_module

    calls = []
    real_checkpoint = bert_module.checkpoint

    def counting_checkpoint(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(bert_module, "checkpoint", counting_checkpoint)
    config = _config(num_layers=2, dropout=0.1)
    batch = _batch()
    results = []
    for recompute in (False, True):
        model = build_full_model(config, seed=2, recompute=recompute).train()
        torch.manual_seed(0)
        loss = model(None, batch)
        loss.sum().backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert calls == [False, False]  # one non-reentrant checkpoint per encoder layer
    with torch.no_grad():
        model(None, batch)  # no recompute without autograd
    assert len(calls) == 2
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-7, msg=name)


def test_mlm_loss_ignores_padding_slots_and_survives_a_batch_without_masks():
    config = _config(num_layers=1)
    model = build_full_model(config).eval()
    batch = _batch()
    with torch.no_grad():
        loss = model(None, batch)
        # Changing what a padding slot points at must not change the loss.
        moved = dict(batch, masked_lm_positions=batch["masked_lm_positions"].clone())
        moved["masked_lm_positions"][2, -1] = 5
        torch.testing.assert_close(model(None, moved), loss)
        empty = dict(batch, masked_lm_ids=torch.zeros_like(batch["masked_lm_ids"]))
        empty_loss = model(None, empty)
    assert empty_loss[0].item() == 0.0 and torch.isfinite(empty_loss).all()


def test_stage_errors_name_the_problem():
    config = _config(num_layers=2)
    with pytest.raises(ValueError, match="last_layer is inclusive"):
        BertStage(config, 2, 4)
    with pytest.raises(ValueError, match="last_layer is inclusive"):
        BertStage(config, 2, 1)
    middle = BertStage(config, 1, 2)
    with pytest.raises(ValueError, match="no embeddings"):
        middle(None, _batch())
    with pytest.raises(ValueError, match="no heads"):
        middle.logits(torch.zeros(3, SEQ, 32), _batch())


# ---- config --------------------------------------------------------------------------------------


def test_bert_sizes_and_config_validation():
    assert BERT_SIZES["mini"] == (4, 256, 4) and BERT_SIZES["large"] == (24, 1024, 16)
    base = BertConfig.from_size("base")
    assert (base.num_layers, base.hidden_size, base.num_heads, base.intermediate_size) == (12, 768, 12, 3072)
    assert base.vocab_size == 30522 and base.num_pipeline_layers == 14
    with pytest.raises(ValueError, match="not divisible by model.num_heads"):
        BertConfig(hidden_size=100, num_heads=3)
    with pytest.raises(ValueError, match="one of"):
        BertConfig.from_size("huge")


# ---- partition -----------------------------------------------------------------------------------


def test_layer_costs_follow_the_flop_formulas():
    config = BertConfig.from_size("mini")
    costs = layer_costs(config, seq_len=128, max_predictions=20)
    s, h, p, v = 128, 256, 20, 30522
    assert len(costs) == config.num_layers + 2
    assert costs[1] == 24 * s * h * h + 4 * s * s * h
    assert costs[-1] == 2 * p * h * h + 2 * p * h * v + 2 * h * h + 4 * h
    assert costs[0] < 0.01 * costs[1]


@pytest.mark.parametrize("size", ["mini", "base", "large"])
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_balanced_partition_minimizes_the_largest_stage(size, num_stages):
    config = BertConfig.from_size(size)
    costs = layer_costs(config, 128, 20)
    bounds = partition_layers(config, num_stages)
    assert len(bounds) == num_stages and bounds[0][0] == 0 and bounds[-1][1] == config.num_layers + 1
    for (_, last), (first, _) in zip(bounds, bounds[1:]):
        assert first == last + 1
    top = config.num_layers
    encoder_counts = [len(range(max(first, 1), min(last, top) + 1)) for first, last in bounds]
    assert min(encoder_counts) >= 1 and sum(encoder_counts) == config.num_layers
    best = min(
        max(stage_costs(costs, partition_layers(config, num_stages, layers_per_stage=counts)))
        for counts in _compositions(config.num_layers, num_stages)
    )
    assert max(stage_costs(costs, bounds)) == best


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield [b - a for a, b in zip(edges, edges[1:])]


def test_heavy_heads_shift_layers_away_from_the_last_stage():
    # Decoder at all S tokens (P = S) costs ~10 encoder layers of bert-mini: the last stage
    # then holds a single encoder layer.
    config = BertConfig.from_size("mini")
    assert partition_layers(config, 2, seq_len=128, max_predictions=128) == [(0, 3), (4, 5)]


def test_v_partition_balances_workers_not_stages():
    # zb-v: worker r holds stages r and 3-r. bert-mini's heads (masked-position decoder) cost about
    # 1.4 encoder layers, so the V gives worker 0 the embeddings, one layer and the heads.
    config = BertConfig.from_size("mini")
    costs = layer_costs(config)
    v = partition_layers(config, 4, v_shape=True)
    assert v == [(0, 0), (1, 1), (2, 3), (4, 5)]
    load = lambda p: max(stage_costs(costs, p)[r] + stage_costs(costs, p)[3 - r] for r in range(2))  # noqa: E731
    assert load(v) < load(partition_layers(config, 4))
    assert load(v) == min(load(_bounds_from_counts(c, 4)) for c in ([1, 1, 1, 1], [0, 1, 1, 2], [1, 1, 2, 0],
                                                                      [0, 2, 2, 0], [2, 1, 1, 0], [1, 2, 1, 0]))


def test_v_partition_search_runs_once_per_shape_and_its_answer_cannot_be_changed_by_a_caller():
    # The exhaustive V search (50,388 compositions for bert-base at 8 stages) is kept per (costs, stages): the
    # strategy search asks for each candidate's partition several times.
    from pipefisher.model.partition import _v_balanced_counts, _v_balanced_counts_of

    costs = layer_costs(BertConfig.from_size("base"))
    first = _v_balanced_counts(costs, 8)
    hits = _v_balanced_counts_of.cache_info().hits
    first[0] += 5  # a caller's copy
    again = _v_balanced_counts(costs, 8)
    assert _v_balanced_counts_of.cache_info().hits == hits + 1
    assert again[0] == first[0] - 5 and sum(again) == 12


def test_explicit_layers_per_stage_and_errors():
    config = BertConfig.from_size("mini")  # L = 4, pipeline layers 0..5
    assert partition_layers(config, 2, layers_per_stage=[1, 3]) == [(0, 1), (2, 5)]
    assert partition_layers(config, 4, layers_per_stage=[1, 1, 1, 1]) == [(0, 1), (2, 2), (3, 3), (4, 5)]
    with pytest.raises(ValueError, match=r"layers_per_stage=\[2, 1\].*summing to model.num_layers=4"):
        partition_layers(config, 2, layers_per_stage=[2, 1])
    assert partition_layers(config, 2, layers_per_stage=[4, 0]) == [(0, 4), (5, 5)]  # the heads alone
    with pytest.raises(ValueError, match="layers_per_stage.*0 allowed for the first and the last"):
        partition_layers(config, 3, layers_per_stage=[2, 0, 2])
    with pytest.raises(ValueError, match="layers_per_stage.*stages=3"):
        partition_layers(config, 3, layers_per_stage=[2, 2])
    # Beyond L stages the heads, then the embeddings, get stages of their own (zb-v on small models).
    assert partition_layers(config, 5) == [(0, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    assert partition_layers(config, 6) == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    with pytest.raises(ValueError, match=r"^stages=7 exceeds model.num_layers=4 \+ 2 .*use stages ≤ 6$"):
        partition_layers(config, 7)
    with pytest.raises(ValueError, match="stages=0"):
        partition_layers(config, 0)
