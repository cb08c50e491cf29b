"""Built-in toy tasks: files generated from a seeded rule, in the formats real tasks use.

The generated files go through the same readers, tokenizer and model as GLUE and SQuAD, so a toy
run exercises the whole path without a download. Rules (``task.toy.generate``):

* ``keyword``: one sentence of toy words; label ``1`` iff it contains one of three keywords.
* ``pair_keyword``: a sentence pair; label ``1`` iff *both* sentences contain a keyword (the
  negatives have one in the first sentence only, the second only, or neither, so the model must
  tell the segments apart).
* ``squad``: a context of filler words with one ``<key> <value>`` piece; the question
  ``what follows <key> ?`` is answered by the value (one or two value words, sometimes after
  ``the``, in which case the gold answers are both ``the <value>`` and ``<value>``, as two
  annotators might give). Many contexts are longer than one window, which exercises the
  document stride.

Classes are balanced. Every classification task has two dev splits, MNLI-style: ``matched``
(the training distribution) and ``mismatched`` (longer sentences).
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pipefisher.data.prepare import BERT_SPECIAL_TOKENS

__all__ = ["ToyFiles", "toy_words", "write_toy_task", "write_toy_vocab"]

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_FUNCTION_WORDS = ("the", "a", "an", "what", "follows", "?", ".")
_NUM_KEYWORDS = 3


@dataclass(frozen=True)
class ToyFiles:
    """Where a generated toy task lives."""

    data_dir: Path
    vocab: Path
    train_file: str
    dev_files: dict[str, str]


def toy_words(num_words: int, seed: int) -> list[str]:
    """``num_words`` distinct lower-case consonant-vowel-consonant words, drawn with ``seed``."""
    pool = sorted({c1 + v + c2 for c1 in _CONSONANTS for v in _VOWELS for c2 in _CONSONANTS} - set(_FUNCTION_WORDS))
    if num_words > len(pool):
        raise ValueError(f"task.toy.num_words={num_words}: at most {len(pool)} toy words exist")
    return random.Random(seed).sample(pool, num_words)


def write_toy_vocab(path: Path, words: list[str]) -> Path:
    """A ``vocab.txt`` with BERT's special tokens at their usual ids, the function words and ``words``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*BERT_SPECIAL_TOKENS, *_FUNCTION_WORDS, *words]) + "\n", encoding="utf-8")
    return path


def _write_tsv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, delimiter="\t", quoting=csv.QUOTE_NONE, lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)


def _keyword_rows(rng: random.Random, words: list[str], n: int, lengths: tuple[int, int]) -> list[list[str]]:
    keywords, others = words[:_NUM_KEYWORDS], words[_NUM_KEYWORDS:]
    rows = []
    for i in range(n):
        label = i % 2
        sentence = [rng.choice(others) for _ in range(rng.randint(*lengths))]
        if label:
            sentence[rng.randrange(len(sentence))] = rng.choice(keywords)
        rows.append([" ".join(sentence), str(label)])
    rng.shuffle(rows)
    return rows


def _pair_rows(rng: random.Random, words: list[str], n: int, lengths: tuple[int, int]) -> list[list[str]]:
    keywords, others = words[:_NUM_KEYWORDS], words[_NUM_KEYWORDS:]
    rows = []
    for i in range(n):
        label = i % 2
        # Negatives: a keyword in A only, in B only, or in neither, equally often.
        has_a, has_b = (True, True) if label else [(True, False), (False, True), (False, False)][(i // 2) % 3]
        pair = []
        for has in (has_a, has_b):
            sentence = [rng.choice(others) for _ in range(rng.randint(*lengths))]
            if has:
                sentence[rng.randrange(len(sentence))] = rng.choice(keywords)
            pair.append(" ".join(sentence))
        rows.append([*pair, str(label)])
    rng.shuffle(rows)
    return rows


def _squad_article(rng: random.Random, words: list[str], n: int, lengths: tuple[int, int], prefix: str) -> dict:
    keys, values, fillers = words[:4], words[4:12], words[12:]
    paragraphs = []
    for i in range(n):
        tokens = [rng.choice(fillers) for _ in range(rng.randint(*lengths))]
        key = rng.choice(keys)
        answer = (["the"] if rng.random() < 0.3 else []) + rng.sample(values, rng.randint(1, 2))
        at = rng.randint(0, len(tokens))
        tokens[at:at] = [key, *answer]
        tokens.append(".")
        char_starts, position = [], 0
        for token in tokens:
            char_starts.append(position)
            position += len(token) + 1
        first, last = at + 1, at + 1 + len(answer)  # the answer's token range [first, last)
        answers = [{"text": " ".join(tokens[first:last]), "answer_start": char_starts[first]}]
        if tokens[first] == "the":  # a second annotator leaves the article out
            answers.append({"text": " ".join(tokens[first + 1:last]), "answer_start": char_starts[first + 1]})
        paragraphs.append({
            "context": " ".join(tokens),
            "qas": [{"id": f"{prefix}-{i}", "question": f"what follows {key} ?", "answers": answers}],
        })
    return {"title": f"toy-{prefix}", "paragraphs": paragraphs}


def write_toy_task(rule: str, out_dir: str | Path, *, num_train: int, num_dev: int, num_words: int,
                   seed: int) -> ToyFiles:
    """Generate a toy task's files (and its vocab) into ``out_dir``.

    Args:
        rule: ``keyword``, ``pair_keyword`` or ``squad`` (see the module docstring).
        out_dir: directory to write into (created).
        num_train: training examples.
        num_dev: examples per dev split.
        num_words: toy words in the vocabulary.
        seed: the data's seed; the same arguments write the same files.

    Returns:
        The data directory, vocab path and file names (``train.tsv``, ``dev_matched.tsv``,
        ``dev_mismatched.tsv``; or ``train.json``, ``dev.json`` for ``squad``).

    Raises:
        ValueError: unknown ``rule`` or too few words for it.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    minimum = {"keyword": _NUM_KEYWORDS + 2, "pair_keyword": _NUM_KEYWORDS + 2, "squad": 14}
    if rule not in minimum:
        raise ValueError(f"task.toy.generate={rule!r}: choose one of {', '.join(minimum)}")
    if num_words < minimum[rule]:
        raise ValueError(f"task.toy.num_words={num_words}: the {rule} rule needs at least {minimum[rule]}")
    words = toy_words(num_words, seed)
    vocab = write_toy_vocab(out / "vocab.txt", words)
    rng = random.Random(seed + 1)
    if rule == "squad":
        for name, n, lengths in (("train.json", num_train, (4, 40)), ("dev.json", num_dev, (4, 40))):
            article = _squad_article(rng, words, n, lengths, prefix=name.split(".")[0])
            (out / name).write_text(json.dumps({"version": "1.1", "data": [article]}, indent=1), encoding="utf-8")
        return ToyFiles(out, vocab, "train.json", {"dev": "dev.json"})
    if rule == "keyword":
        header, make = ["sentence", "label"], _keyword_rows
    else:
        header, make = ["sentence1", "sentence2", "label"], _pair_rows
    short, long = ((3, 10), (11, 20)) if rule == "keyword" else ((2, 6), (7, 12))
    _write_tsv(out / "train.tsv", header, make(rng, words, num_train, short))
    _write_tsv(out / "dev_matched.tsv", header, make(rng, words, num_dev, short))
    _write_tsv(out / "dev_mismatched.tsv", header, make(rng, words, num_dev, long))
    return ToyFiles(out, vocab, "train.tsv", {"matched": "dev_matched.tsv", "mismatched": "dev_mismatched.tsv"})
