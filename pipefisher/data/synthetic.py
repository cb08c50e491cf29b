"""Synthetic BERT pretraining data with structure a model can learn, generated on the fly.

[Note: the synthetic language]
A fixed random "language" (seeded by ``language_seed``, not by the data seed, so two data seeds
draw different samples of the same language) has ``num_topics`` topics; each topic owns its own
``topic_vocab`` of the ``num_content`` content token ids (which start at ``CONTENT_START``, just
after [MASK]). A document picks a topic and runs a Markov chain over its tokens: from each token
the next is one of 4 fixed successors with probabilities 0.6 / 0.25 / 0.1 / 0.05, or (p = 0.1) any
token of the topic. So a masked token is well predicted by its neighbours (bigram), less well by
the topic alone, and a sentence B from another document (another topic, label 1) is told apart
from a continuation (label 0). Floors of the MLM loss on masked tokens with the defaults
(64 topics x 8 tokens): unigram over all 512 content ids ln 512 = 6.2 nats, topic unigram
ln 8 = 2.1 nats, given the left neighbour 1.15 nats; both neighbours do better still.

Small topics are deliberate: a model first sits on the unigram plateau (~6.0) and leaves it once
attention picks up the topic. With `pipefisher.model`'s bert-tiny (AdamW lr 1e-3, 30 warm-up
steps, batch 32, S=128, P=20) the MLM loss was 10.3 -> 3.0 in 300 steps with 64 x 8 (NSP loss
0.41), 10.3 -> 4.8 with 32 x 16; with 8 x 64 a small encoder stayed at ~6.0 for 300 steps.

Samples follow BERT's layout and masking ([CLS] A [SEP] B [SEP], short sequences with p = 0.1,
15% of tokens masked, at most P, 80% [MASK] / 10% random id / 10% kept; see DESIGN.md).

Sample ``r`` of epoch ``e`` is drawn from a Philox generator keyed by ``(seed, perm_e(r))``,
where ``perm_e`` is a seeded permutation of the ``num_samples`` sample ids: the set of samples is
fixed and every epoch visits it in a new order, like a real corpus. All randomness of a sample is
drawn as one (R, S) block of uniforms, so a batch is built with array operations (64 x 128 in
2-4 ms on one CPU core); the Markov chain is the one loop, over positions, vectorized over
the batch.

Sample ids are split in two ranges that never mix: ``[0, HELDOUT_FIRST_ID)`` for training
sources and ``[HELDOUT_FIRST_ID, 2**63)`` for held-out ones (``first_sample_id``;
`pipefisher.data.heldout`). A source's ids all lie in one range, so no training sample, of any
seed or epoch, shares its generator key with a held-out sample.

Shape legend: B samples, S sequence length, L = S - 3 content positions, P max predictions.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from pipefisher.data.batches import CLS_ID, MASK_ID, SEP_ID, stored_positions

__all__ = ["CONTENT_START", "HELDOUT_FIRST_ID", "SyntheticSource"]

#: First content token id (the one after [MASK]).
CONTENT_START = MASK_ID + 1
#: First sample id of the held-out range (see the module docstring); training ids lie below it.
HELDOUT_FIRST_ID = 2**62
_END_ID = 2**63  # ids are int64

_SUCCESSOR_PROBS = np.array([0.6, 0.25, 0.1, 0.05])
_SUCCESSOR_CDF = np.cumsum(_SUCCESSOR_PROBS)[:-1]  # searchsorted boundaries for 4 choices
_NOISE_PROB = 0.1
_MIN_SEQ_LEN = 8  # [CLS] A [SEP] B [SEP] plus room; also the width of the scalar row below

# Rows of a sample's (R, S) uniform block.
_A_CHOICE, _A_NOISE, _A_NOISE_TOK, _B_CHOICE, _B_NOISE, _B_NOISE_TOK = range(6)
_MASK_ORDER, _MASK_KIND, _MASK_RANDOM_TOK, _SCALARS = range(6, 10)
_NUM_ROWS = 10
# Columns of the scalar row.
_TOPIC, _OTHER_TOPIC, _A_START, _B_START, _SHORT, _TARGET_LEN, _SPLIT, _IS_RANDOM = range(8)


@lru_cache(maxsize=4)  # a batch may straddle an epoch boundary; a process may build the same data again
def _epoch_permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    """The order of the sample ids in ``epoch`` (read-only: shared by every source of this seed)."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    perm.setflags(write=False)
    return perm


class SyntheticSource:
    """Deterministic synthetic pretraining samples (a `PretrainingSource`).

    Args:
        seq_len: S, at least 8.
        max_predictions: P, masked positions per sequence at most.
        vocab_size: model vocabulary; must exceed ``CONTENT_START + topic_vocab``.
        seed: selects the samples and their order.
        num_samples: samples per epoch.
        num_topics: topics (hidden document states).
        topic_vocab: tokens per topic.
        num_content: content token ids in use (capped by the vocabulary).
        short_seq_prob: probability of a shorter, padded sequence.
        masked_lm_prob: fraction of tokens masked.
        language_seed: seeds the language (topics and successor tables).
        first_sample_id: the samples are ids ``first_sample_id + [0, num_samples)``, all below
            or all from `HELDOUT_FIRST_ID` (0: training data; held-out sources start there).

    Raises:
        ValueError: a size is out of range (the message names it).
    """

    def __init__(
        self,
        seq_len: int,
        max_predictions: int,
        vocab_size: int,
        seed: int,
        num_samples: int = 1_000_000,
        *,
        num_topics: int = 64,
        topic_vocab: int = 8,
        num_content: int = 512,
        short_seq_prob: float = 0.1,
        masked_lm_prob: float = 0.15,
        language_seed: int = 0,
        first_sample_id: int = 0,
    ) -> None:
        if seq_len < _MIN_SEQ_LEN:
            raise ValueError(f"seq_len={seq_len}: synthetic data needs at least {_MIN_SEQ_LEN}")
        if max_predictions < 1:
            raise ValueError(f"max_predictions={max_predictions}: must be at least 1")
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: must be at least 1")
        last_id = first_sample_id + num_samples - 1
        if first_sample_id < 0 or last_id >= _END_ID or (
            first_sample_id < HELDOUT_FIRST_ID <= last_id
        ):
            raise ValueError(
                f"sample ids [{first_sample_id}, {last_id}] (first_sample_id, num_samples): must lie "
                "all below HELDOUT_FIRST_ID=2**62 (training) or all in [2**62, 2**63) (held-out)"
            )
        if num_topics < 2:
            raise ValueError(f"num_topics={num_topics}: must be at least 2 (for sentence B)")
        if topic_vocab < 2:
            raise ValueError(f"topic_vocab={topic_vocab}: must be at least 2")
        if vocab_size < CONTENT_START + topic_vocab:
            raise ValueError(
                f"vocab_size={vocab_size}: synthetic data uses ids from {CONTENT_START}; "
                f"needs at least {CONTENT_START + topic_vocab} (or lower topic_vocab)"
            )
        if not 0.0 <= short_seq_prob <= 1.0 or not 0.0 < masked_lm_prob < 1.0:
            raise ValueError(
                f"short_seq_prob={short_seq_prob} must be in [0, 1] and "
                f"masked_lm_prob={masked_lm_prob} in (0, 1)"
            )
        self.seq_len = seq_len
        self.max_predictions = max_predictions
        self.vocab_size = vocab_size
        self.seed = seed
        self.num_samples = num_samples
        self.first_sample_id = first_sample_id
        self.short_seq_prob = short_seq_prob
        self.masked_lm_prob = masked_lm_prob

        num_content = min(num_content, vocab_size - CONTENT_START)
        rng = np.random.default_rng([language_seed, 0x5E7])
        # (T, V) content ids owned by each topic: disjoint while the content ids suffice, so a
        # topic can be read off any of its tokens (a bag-of-words model gets ln V nats).
        reps = -(-num_topics * topic_vocab // num_content)  # ceil
        pool = np.concatenate([rng.permutation(num_content) for _ in range(reps)])
        self._topic_tokens = (
            CONTENT_START + pool[: num_topics * topic_vocab].reshape(num_topics, topic_vocab)
        ).astype(np.int64)
        # (T, V, 4) successor local indices (within the topic) of each local token.
        self._successors = rng.integers(
            0, topic_vocab, size=(num_topics, topic_vocab, len(_SUCCESSOR_PROBS))
        )
        self._num_topics = num_topics
        self._topic_vocab = topic_vocab

    def __len__(self) -> int:
        return self.num_samples

    def _epoch_permutation(self, epoch: int) -> np.ndarray:
        return _epoch_permutation(self.seed % 2**63, epoch, self.num_samples)

    def _sample_ids(self, indices: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(indices, self.num_samples)
        ids = np.empty_like(indices)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            ids[sel] = self._epoch_permutation(int(epoch))[offsets[sel]]
        return ids + self.first_sample_id

    def _uniforms(self, sample_ids: np.ndarray) -> np.ndarray:
        # (B, R, S): one counter-based generator per sample, keyed by (seed, sample id).
        key0 = self.seed % 2**64
        return np.stack(
            [
                np.random.Generator(np.random.Philox(key=[key0, int(i)])).random(
                    (_NUM_ROWS, self.seq_len)
                )
                for i in sample_ids
            ]
        )

    def _chains(
        self,
        topics: np.ndarray,
        starts: np.ndarray,
        u_choice: np.ndarray,
        u_noise: np.ndarray,
        u_noise_tok: np.ndarray,
    ) -> np.ndarray:
        """(B, L) token ids of Markov chains, one per row: topic (B,), start (B,) local index,
        and (B, L) uniforms for the successor choice, the noise draw and the noise token."""
        rows, length = u_choice.shape
        choice = np.searchsorted(_SUCCESSOR_CDF, u_choice)  # (B, L) which successor
        noise = u_noise < _NOISE_PROB  # (B, L)
        noise_tok = (u_noise_tok * self._topic_vocab).astype(np.int64)  # (B, L)
        local = np.empty((rows, length), dtype=np.int64)
        local[:, 0] = starts
        succ = self._successors
        for t in range(1, length):
            local[:, t] = np.where(
                noise[:, t], noise_tok[:, t], succ[topics, local[:, t - 1], choice[:, t]]
            )
        return self._topic_tokens[topics[:, None], local]

    def get_samples(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples at global indices (index ``>= len(self)`` wraps into later epochs).

        Args:
            indices: non-negative global sample indices.

        Returns:
            A batch (see `pipefisher.data.batches.BATCH_KEYS`), all ``torch.long``.

        Raises:
            ValueError: a negative index.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and idx.min() < 0:
            raise ValueError(f"sample indices must be non-negative, got {int(idx.min())}")
        return self._generate(self._sample_ids(idx))

    def get_stored_samples(self, positions: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples in id order, without the epoch shuffle: position ``r`` is sample id
        ``first_sample_id + r`` (the fixed order held-out batches use).

        Args:
            positions: in ``[0, len(self))``.

        Returns:
            A batch (see `pipefisher.data.batches.BATCH_KEYS`), all ``torch.long``.

        Raises:
            ValueError: a position outside ``[0, len(self))``.
        """
        pos = stored_positions(positions, self.num_samples)
        return self._generate(pos + self.first_sample_id)

    def _generate(self, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """(B,) sample ids -> a batch; a pure function of (seed, language, sample id)."""
        S, P, V, T = self.seq_len, self.max_predictions, self._topic_vocab, self._num_topics
        B, L = sample_ids.size, S - 3
        u = self._uniforms(sample_ids) if B else np.zeros((0, _NUM_ROWS, S))
        sc = u[:, _SCALARS]  # (B, S), first 8 columns used

        # Sentence lengths as in BERT: a target length (short with short_seq_prob), A takes
        # 1..target-1 of it, B the rest; B continues A's document or (p=0.5) is another's.
        topic = (sc[:, _TOPIC] * T).astype(np.int64)
        other = (topic + 1 + (sc[:, _OTHER_TOPIC] * (T - 1)).astype(np.int64)) % T
        short = sc[:, _SHORT] < self.short_seq_prob
        target = np.where(short, 2 + (sc[:, _TARGET_LEN] * (L - 1)).astype(np.int64), L)
        len_a = 1 + (sc[:, _SPLIT] * (target - 1)).astype(np.int64)  # (B,) in [1, target-1]
        len_b = target - len_a
        is_random = sc[:, _IS_RANDOM] < 0.5

        chains = self._chains(  # (2B, L): rows [0, B) document of A, [B, 2B) random document
            np.concatenate([topic, other]),
            (np.concatenate([sc[:, _A_START], sc[:, _B_START]]) * V).astype(np.int64),
            np.concatenate([u[:, _A_CHOICE, :L], u[:, _B_CHOICE, :L]]),
            np.concatenate([u[:, _A_NOISE, :L], u[:, _B_NOISE, :L]]),
            np.concatenate([u[:, _A_NOISE_TOK, :L], u[:, _B_NOISE_TOK, :L]]),
        )
        doc, rand_doc = chains[:B], chains[B:]

        # Layout: pos 0 [CLS]; 1..len_a A = doc[pos-1]; len_a+1 [SEP]; then B, [SEP], padding.
        pos = np.arange(S)[None, :]  # (1, S)
        la, lb = len_a[:, None], len_b[:, None]
        sep_a, sep_b = la + 1, la + lb + 2
        in_a = (pos >= 1) & (pos <= la)
        in_b = (pos > sep_a) & (pos < sep_b)
        cont = np.take_along_axis(doc, np.clip(pos - 2, 0, L - 1).repeat(B, 0), 1)
        rand = np.take_along_axis(rand_doc, np.clip(pos - sep_a - 1, 0, L - 1), 1)
        a_tok = np.take_along_axis(doc, np.clip(pos - 1, 0, L - 1).repeat(B, 0), 1)
        b_tok = np.where(is_random[:, None], rand, cont)
        input_ids = np.where(in_a, a_tok, np.where(in_b, b_tok, 0))  # (B, S)
        input_ids[:, 0] = CLS_ID
        input_ids[pos == sep_a] = SEP_ID
        input_ids[pos == sep_b] = SEP_ID
        input_mask = (pos <= sep_b).astype(np.int64)
        segment_ids = ((pos > sep_a) & (pos <= sep_b)).astype(np.int64)

        # Masking as in BERT: round(15% of all tokens, specials included), at least 1, at
        # most P, chosen uniformly among non-special tokens, reported in position order.
        num_tokens = target + 3
        num_pred = np.minimum(
            np.minimum(P, target), np.maximum(1, np.round(num_tokens * self.masked_lm_prob))
        )
        keys = np.where(in_a | in_b, u[:, _MASK_ORDER], 2.0)  # (B, S) non-candidates last
        k = min(P, S)
        chosen = np.argsort(keys, axis=1, kind="stable")[:, :k]  # (B, k)
        valid = np.arange(k)[None, :] < num_pred[:, None]  # (B, k)
        chosen = np.sort(np.where(valid, chosen, S), axis=1)  # invalid sort last
        valid = chosen < S
        positions = np.zeros((B, P), dtype=np.int64)
        positions[:, :k] = np.where(valid, chosen, 0)
        rows = np.arange(B)[:, None]
        lm_ids = np.zeros((B, P), dtype=np.int64)
        lm_ids[:, :k] = np.where(valid, input_ids[rows, positions[:, :k]], 0)
        kind = u[:, _MASK_KIND, :k]  # (B, k): < 0.8 [MASK], < 0.9 keep, else random id
        random_tok = (u[:, _MASK_RANDOM_TOK, :k] * self.vocab_size).astype(np.int64)
        replacement = np.where(kind < 0.8, MASK_ID, np.where(kind < 0.9, lm_ids[:, :k], random_tok))
        masked_rows, masked_slots = np.nonzero(valid)
        input_ids[masked_rows, positions[masked_rows, masked_slots]] = replacement[
            masked_rows, masked_slots
        ]

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

        return {
            "input_ids": t(input_ids),
            "segment_ids": t(segment_ids),
            "input_mask": t(input_mask),
            "masked_lm_positions": t(positions),
            "masked_lm_ids": t(lm_ids),
            "next_sentence_labels": t(is_random),
        }
