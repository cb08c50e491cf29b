"""Examples -> model inputs (WordPiece, [CLS]/[SEP] layout, windows over long contexts) and
span logits -> answer texts.

Shape legend:
    N  sequences (features) of a split
    S  ``max_seq_len`` (tensors are padded to it; :func:`trim` cuts a batch to its longest row)

[Note: windows over long contexts] (BERT paper §4.2; Google's ``run_squad.py``)
A question's input is ``[CLS] question [SEP] context-window [SEP]``. A context longer than the
room left (``max_seq_len - len(question) - 3`` tokens) is covered by windows whose starts are
``doc_stride`` tokens apart, the last one ending at the context's end::

    context tokens  0 ........................................ n
    window 0        [---------- room ----------]
    window 1                 [---------- room ----------]          starts doc_stride apart
    window 2                          [---------- room ---------]  (stops once n is covered)

A token seen by several windows is scored only in the window where it has the most context on
its shorter side ("max context"), so each answer start is judged once. Training marks a window
that does not contain the whole answer (or a v2.0 question without answer) with start = end = 0,
the [CLS] position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tokenizers import BertWordPieceTokenizer
from torch import Tensor

from pipefisher.finetune.readers import ClassificationExample, SpanExample

__all__ = [
    "SpanFeatures",
    "decode_spans",
    "encode_classification",
    "encode_spans",
    "trim",
]


def _special_ids(tokenizer: BertWordPieceTokenizer) -> tuple[int, int, int]:
    ids = [tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")]
    if any(i is None for i in ids):
        raise ValueError("the vocabulary lacks [CLS], [SEP] or [PAD]; use a BERT vocab.txt")
    return ids[0], ids[1], ids[2]  # type: ignore[return-value]


def _pad_rows(rows: list[list[int]], length: int, value: int) -> Tensor:
    # int32 halves the memory of a large task (MNLI: 393k x 128 x 3); batches become int64 on the device.
    out = torch.full((len(rows), length), value, dtype=torch.int32)  # [N,S]
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


def _truncate_pair(a: list[int], b: list[int], max_tokens: int) -> None:
    """Drop tokens from the end of the longer side until both fit (``run_classifier.py``)."""
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop()


def encode_classification(
    examples: Sequence[ClassificationExample], tokenizer: BertWordPieceTokenizer, max_seq_len: int
) -> dict[str, Tensor]:
    """Tokenize sentences (pairs) as ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``.

    Args:
        examples: the examples.
        tokenizer: the WordPiece tokenizer of the pretraining vocabulary.
        max_seq_len: tokens per sequence; longer inputs lose tokens from the end of the longer side.

    Returns:
        ``input_ids``, ``segment_ids``, ``input_mask`` [N,S] (int32) and ``labels`` [N] (int64).
    """
    cls_id, sep_id, pad_id = _special_ids(tokenizer)
    encoded_a = tokenizer.encode_batch([e.text_a for e in examples], add_special_tokens=False)
    pairs = [e.text_b for e in examples if e.text_b is not None]
    encoded_b = iter(tokenizer.encode_batch(pairs, add_special_tokens=False)) if pairs else iter(())
    ids_rows, seg_rows = [], []
    for example, enc_a in zip(examples, encoded_a):
        a = list(enc_a.ids)
        if example.text_b is None:
            a = a[: max_seq_len - 2]
            ids, seg = [cls_id, *a, sep_id], [0] * (len(a) + 2)
        else:
            b = list(next(encoded_b).ids)
            _truncate_pair(a, b, max_seq_len - 3)
            ids = [cls_id, *a, sep_id, *b, sep_id]
            seg = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        ids_rows.append(ids)
        seg_rows.append(seg)
    input_ids = _pad_rows(ids_rows, max_seq_len, pad_id)
    return {
        "input_ids": input_ids,
        "segment_ids": _pad_rows(seg_rows, max_seq_len, 0),
        "input_mask": _pad_rows([[1] * len(r) for r in ids_rows], max_seq_len, 0),
        "labels": torch.tensor([e.label for e in examples], dtype=torch.long),
    }


@dataclass
class SpanFeatures:
    """Windows of span examples: tensors for the model and what decoding needs.

    ``tensors``: ``input_ids``, ``segment_ids``, ``input_mask`` [N,S] (int32), ``example_index`` [N],
    and, when built for training, ``start_positions`` / ``end_positions`` [N].
    Per window ``i``: ``context_start[i]`` is the position of its first context token in the
    sequence, ``token_offsets[i][j]`` the (start, end) characters in the example's context of
    its j-th context token, and ``max_context[i][j]`` whether this window is that token's
    max-context window.
    """

    tensors: dict[str, Tensor]
    context_start: list[int] = field(default_factory=list)
    token_offsets: list[list[tuple[int, int]]] = field(default_factory=list)
    max_context: list[list[bool]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.context_start)


def _windows(num_tokens: int, room: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of the windows over ``num_tokens`` context tokens (see [Note: windows])."""
    spans, start = [], 0
    while True:
        length = min(room, num_tokens - start)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, stride)


def _is_max_context(spans: list[tuple[int, int]], index: int, position: int) -> bool:
    """Whether window ``index`` gives token ``position`` the most context (ties: the earlier window)."""
    best, best_score = None, None
    for i, (start, length) in enumerate(spans):
        end = start + length - 1
        if not start <= position <= end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best, best_score = i, score
    return best == index


def encode_spans(
    examples: Sequence[SpanExample],
    tokenizer: BertWordPieceTokenizer,
    *,
    max_seq_len: int,
    max_query_len: int,
    doc_stride: int,
    training: bool,
) -> SpanFeatures:
    """Tokenize questions and contexts into windows (see [Note: windows over long contexts]).

    Args:
        examples: the questions.
        tokenizer: the WordPiece tokenizer of the pretraining vocabulary.
        max_seq_len: tokens per window sequence.
        max_query_len: question tokens kept.
        doc_stride: tokens between consecutive window starts (<= the context room).
        training: add ``start_positions`` / ``end_positions`` (first answer; [CLS] when the
            window misses it or there is none).

    Returns:
        The windows, in example order.
    """
    cls_id, sep_id, pad_id = _special_ids(tokenizer)
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)
    contexts = tokenizer.encode_batch([e.context for e in examples], add_special_tokens=False)
    features = SpanFeatures(tensors={})
    ids_rows: list[list[int]] = []
    seg_rows: list[list[int]] = []
    example_index: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    for index, (example, q_enc, c_enc) in enumerate(zip(examples, questions, contexts)):
        query = list(q_enc.ids)[:max_query_len]
        ctx_ids, offsets = list(c_enc.ids), [tuple(o) for o in c_enc.offsets]
        room = max_seq_len - len(query) - 3
        # Token span of the first gold answer, in context-token indices (inclusive).
        answer_tokens: tuple[int, int] | None = None
        if training and example.answers and not example.is_impossible:
            char_start = example.answer_starts[0]
            char_end = char_start + len(example.answers[0])
            inside = [j for j, (s, e) in enumerate(offsets) if s < char_end and e > char_start]
            if inside:
                answer_tokens = (inside[0], inside[-1])
        spans = _windows(len(ctx_ids), room, doc_stride)
        for w, (start, length) in enumerate(spans):
            head = [cls_id, *query, sep_id]
            ids_rows.append([*head, *ctx_ids[start:start + length], sep_id])
            seg_rows.append([0] * len(head) + [1] * (length + 1))
            example_index.append(index)
            features.context_start.append(len(head))
            features.token_offsets.append(offsets[start:start + length])
            features.max_context.append([_is_max_context(spans, w, start + j) for j in range(length)])
            if training:
                if answer_tokens is not None and start <= answer_tokens[0] and answer_tokens[1] < start + length:
                    starts.append(answer_tokens[0] - start + len(head))
                    ends.append(answer_tokens[1] - start + len(head))
                else:
                    starts.append(0)
                    ends.append(0)
    features.tensors = {
        "input_ids": _pad_rows(ids_rows, max_seq_len, pad_id),
        "segment_ids": _pad_rows(seg_rows, max_seq_len, 0),
        "input_mask": _pad_rows([[1] * len(r) for r in ids_rows], max_seq_len, 0),
        "example_index": torch.tensor(example_index, dtype=torch.long),
    }
    if training:
        features.tensors["start_positions"] = torch.tensor(starts, dtype=torch.long)
        features.tensors["end_positions"] = torch.tensor(ends, dtype=torch.long)
    return features


def trim(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Cut the [B,S] tensors of a batch to its longest row (padding beyond it is wasted work)."""
    length = int(batch["input_mask"].sum(dim=1).max())
    return {k: (v[:, :length] if v.dim() == 2 else v) for k, v in batch.items()}


def decode_spans(
    examples: Sequence[SpanExample],
    features: SpanFeatures,
    start_logits: Tensor,
    end_logits: Tensor,
    *,
    n_best: int = 20,
    max_answer_len: int = 30,
    version_2_with_negative: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> dict[str, str]:
    """Best answer text per question from the windows' start/end logits.

    A candidate is a (start, end) pair of context tokens of one window with end >= start, at
    most ``max_answer_len`` tokens, its start in its max-context window, both among the window's
    ``n_best`` highest logits; its score is start + end logit. The text is the context's
    characters from the start token's first to the end token's last. With v2.0, the answer is
    "" when the lowest [CLS] score over the windows beats the best candidate by more than
    ``null_score_diff_threshold``.

    Args:
        examples: the questions the features were built from.
        features: their windows.
        start_logits, end_logits: [N,S'] logits (S' >= each window's length), float.

    Returns:
        ``{question id: answer text}`` (the official evaluation's prediction format).
    """
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    example_index = features.tensors["example_index"].tolist()
    k = min(n_best, start_logits.size(1))
    top_starts = start_logits.topk(k, dim=1).indices.tolist()
    top_ends = end_logits.topk(k, dim=1).indices.tolist()
    start_rows, end_rows = start_logits.tolist(), end_logits.tolist()
    for i, ex in enumerate(example_index):
        null_score = start_rows[i][0] + end_rows[i][0]
        null[ex] = min(null.get(ex, null_score), null_score)
        first = features.context_start[i]
        offsets, max_context = features.token_offsets[i], features.max_context[i]
        for s in top_starts[i]:
            js = s - first
            if not 0 <= js < len(offsets) or not max_context[js]:
                continue
            for e in top_ends[i]:
                je = e - first
                if not js <= je < len(offsets) or je - js + 1 > max_answer_len:
                    continue
                score = start_rows[i][s] + end_rows[i][e]
                if ex not in best or score > best[ex][0]:
                    context = examples[ex].context
                    best[ex] = (score, context[offsets[js][0]:offsets[je][1]])
    predictions = {}
    for ex, example in enumerate(examples):
        score, text = best.get(ex, (float("-inf"), ""))
        if version_2_with_negative and null.get(ex, float("-inf")) - score > null_score_diff_threshold:
            text = ""
        predictions[example.qid] = text
    return predictions
