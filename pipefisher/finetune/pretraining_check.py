"""Did the checkpoint's pretraining learn anything a fine-tune can use? (issue 40)

[Note: the unigram plateau]
A masked-LM first learns token frequencies: it predicts the same distribution (the unigram) at
every masked position, whatever the context, and its loss sits at the unigram cross-entropy until
attention starts to use the neighbours. A short pretraining on real text stops there: 300 chimera
steps of bert-tiny on WikiText-2 (issue 40) end at held-out MLM loss 7.04, where the training
shards' unigram gives 7.07 on the held-out masked tokens. Such an encoder is worse than a random
init for fine-tuning: the toy task stays at or near chance (0.50-0.85 after 250 steps from it,
1.00 after 50 from a random init), with the pretrained encoder layers (random layers under its
embeddings learn, its layers over random embeddings stay at 0.50), and neither a lower nor a higher
fine-tuning lr helps. Its [CLS] output still varies across inputs (relative spread 8e-2, above a
random init's 1.6e-2), so :func:`~pipefisher.finetune.checkpoint.cls_spread` cannot see it.

The MLM head says it directly. Over masked positions of the task's own sequences, with ``p_i`` the
head's prediction at position ``i`` and ``p̄`` their mean:

* frequency information = ``ln V - H(p̄)``: how far the predictions together are from uniform
  (0 at a random init, about 3.2 nats for the WikiText-2 run above);
* context information = ``H(p̄) - mean_i H(p_i)`` (the generalized Jensen-Shannon divergence, the
  information the position's context gives about its prediction): 0 when every position gets the
  same prediction; several nats for a trained BERT.

A checkpoint with frequency information but (almost) no context information learned only token
frequencies. Measured: WikiText-2 300 steps 3.25 / 0.0000 nats; synthetic data, 300 NVLAMB chimera
steps 4.19 / 0.028 (fine-tunes at chance); the README's 30 synthetic steps 0.13 / 0.0000 (close
to a random init; fine-tunes to 1.0).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from pipefisher.finetune.heads import FinetuneModel
from pipefisher.model import WORD_EMBEDDINGS_NAME
from pipefisher.model.bert import BertLMPredictionHead

__all__ = ["FREQUENCY_ONLY_MIN_NATS", "FREQUENCY_ONLY_RATIO", "MlmInformation", "mlm_information",
           "prediction_information", "warn_if_frequency_only"]

log = logging.getLogger(__name__)

#: Frequency information (nats) from which a checkpoint counts as pretrained at all (a random init
#: has about 0; the README's 30 synthetic steps 0.13).
FREQUENCY_ONLY_MIN_NATS = 0.5
#: Context information below this fraction of the frequency information: the predictions ignore
#: the context (measured 0.0000 and 0.0067 on checkpoints that fine-tune at chance).
FREQUENCY_ONLY_RATIO = 0.05
_MASK_FRACTION = 0.15


@dataclass(frozen=True)
class MlmInformation:
    """What the MLM head's predictions at masked positions carry (nats; see [Note: the unigram plateau])."""

    frequency_nats: float
    context_nats: float
    positions: int
    vocab_size: int

    @property
    def frequency_only(self) -> bool:
        """Token frequencies learned, context not."""
        return (self.frequency_nats >= FREQUENCY_ONLY_MIN_NATS
                and self.context_nats < FREQUENCY_ONLY_RATIO * self.frequency_nats)


def prediction_information(log_probs: Tensor) -> tuple[float, float]:
    """``(ln V - H(p̄), H(p̄) - mean H(p_i))`` of predictions ``log_probs`` [M,V] (natural log)."""
    logp = log_probs.double()
    p = logp.exp()  # [M,V]
    mean_entropy = float(-(p * logp).nan_to_num().sum(-1).mean())
    p_bar = p.mean(0)  # [V]
    h_bar = float(-(p_bar * p_bar.clamp_min(1e-300).log()).sum())
    return math.log(logp.size(-1)) - h_bar, max(0.0, h_bar - mean_entropy)


def _mlm_head(model: FinetuneModel, state_dict: Mapping[str, Tensor]) -> BertLMPredictionHead | None:
    """The checkpoint's MLM head (decoder tied to the word embeddings unless saved), or None without one."""
    prefix = "cls.predictions."
    wanted = ("transform.dense.weight", "transform.dense.bias", "transform.LayerNorm.weight",
              "transform.LayerNorm.bias")
    if not all(prefix + k in state_dict for k in wanted):
        return None
    with torch.random.fork_rng(devices=[]):  # its init must not move the run's RNG (dropout, head init)
        head = BertLMPredictionHead(model.config)
    own = {k: state_dict[prefix + k] for k in wanted}
    own["decoder.weight"] = state_dict.get(prefix + "decoder.weight", state_dict[WORD_EMBEDDINGS_NAME])
    own["bias"] = state_dict.get(prefix + "bias", state_dict.get(prefix + "decoder.bias", torch.zeros(
        model.config.vocab_size)))
    if any(tuple(v.shape) != tuple(head.state_dict()[k].shape) for k, v in own.items()):
        return None
    head.load_state_dict(own)
    return head


@torch.no_grad()
def mlm_information(model: FinetuneModel, state_dict: Mapping[str, Tensor], batch: Mapping[str, Tensor],
                    mask_id: int, special_ids: tuple[int, ...], seed: int = 0) -> MlmInformation | None:
    """The checkpoint's frequency and context information on ``batch`` (eval mode, no dropout).

    Args:
        model: the fine-tuning model with the checkpoint's encoder loaded.
        state_dict: the checkpoint (its ``cls.predictions.*`` MLM head is read).
        batch: ``input_ids``, ``segment_ids``, ``input_mask`` [B,S] of the task's sequences.
        mask_id: the tokenizer's [MASK] id.
        special_ids: ids never masked ([CLS], [SEP], [PAD]).
        seed: seed of the choice of masked positions (15% of the others, at least one a sequence).

    Returns:
        The information, or None when the checkpoint has no MLM head (a ``BertModel`` export).
    """
    head = _mlm_head(model, state_dict)
    if head is None:
        return None
    ids = batch["input_ids"].long()  # [B,S]
    maskable = batch["input_mask"].bool() & ~torch.isin(ids, torch.tensor(special_ids))  # [B,S]
    scores = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)).masked_fill(~maskable, 2.0)
    chosen = (scores < _MASK_FRACTION) | ((scores == scores.min(1, keepdim=True).values) & maskable)  # [B,S]
    if not chosen.any():
        return None
    was_training = model.training
    model.eval()
    try:
        hidden = model.stage.encode(None, {**batch, "input_ids": ids.masked_fill(chosen, mask_id)})  # [B,S,H]
    finally:
        model.train(was_training)
    log_probs = head(hidden[chosen].float()).log_softmax(-1)  # [M,V]
    frequency, context = prediction_information(log_probs)
    return MlmInformation(frequency, context, int(chosen.sum()), log_probs.size(-1))


def warn_if_frequency_only(info: MlmInformation | None) -> bool:
    """Say in one line when the checkpoint learned only token frequencies; returns whether it did."""
    if info is None or not info.frequency_only:
        return False
    log.warning("init.checkpoint learned only token frequencies (a pretraining still at the unigram plateau, e.g. a "
                "short run on real text): its MLM predictions are the same in every context (%.4f nats of context "
                "information vs %.2f of token frequency over %d masked positions of the training sequences), so "
                "fine-tuning from it is likely to stay at chance; pretrain longer, until the held-out MLM loss falls "
                "below the unigram cross-entropy, or fine-tune from a random init",
                info.context_nats, info.frequency_nats, info.positions)
    return True
