"""Evaluation metrics: accuracy, and SQuAD's exact match and F1 with the official normalization.

[Note: SQuAD normalization] As in the official ``evaluate-v1.1.py`` / ``evaluate-v2.0.py``: lower
case, remove ASCII punctuation, remove the articles a / an / the (as whole words), collapse white
space. EM is 1 when the normalized strings are equal; F1 is the harmonic mean of the token-level
precision and recall of the normalized strings' bag of words. A question's score is the maximum
over its gold answers. A question without gold answers (SQuAD v2.0) is scored against "" only,
and, as in the v2.0 script, F1 against an empty string is 1 when both are empty, else 0.
EM and F1 are reported in percent, as the official scripts print them; accuracy as a fraction.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence

__all__ = ["accuracy", "exact_match_score", "f1_score", "normalize_answer", "squad_scores"]

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse white space (see [Note: SQuAD normalization])."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match_score(prediction: str, gold: str) -> float:
    """1.0 when the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token-level F1 of the normalized strings, in [0, 1]."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: Mapping[str, str], gold: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """Exact match and F1 over questions, in percent (max over each question's gold answers).

    Args:
        predictions: question id -> predicted text.
        gold: question id -> gold answer texts (empty for a v2.0 question without answer).

    Returns:
        ``{"exact_match", "f1", "num_questions", "num_missing"}``; a question without a
        prediction scores 0 (and counts in ``num_missing``).
    """
    if not gold:
        raise ValueError("squad_scores: no gold answers to score against")
    em = f1 = 0.0
    missing = 0
    for qid, answers in gold.items():
        answers = list(answers) or [""]
        if qid not in predictions:
            missing += 1
            continue
        prediction = predictions[qid]
        em += max(exact_match_score(prediction, a) for a in answers)
        f1 += max(f1_score(prediction, a) for a in answers)
    n = len(gold)
    return {"exact_match": 100.0 * em / n, "f1": 100.0 * f1 / n, "num_questions": n, "num_missing": missing}


def accuracy(predictions: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of ``predictions`` equal to ``labels`` (same length, at least one)."""
    if len(predictions) != len(labels) or not labels:
        raise ValueError(f"accuracy: {len(predictions)} predictions for {len(labels)} labels")
    return sum(int(p == y) for p, y in zip(predictions, labels)) / len(labels)
