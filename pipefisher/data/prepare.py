"""Text -> NVIDIA-format pretraining shards (``pipefisher-prepare``).

Why one module: it is one pipeline from text to shards that follows Google's ``create_pretraining_data.py``
step by step (tokenize, split documents into instances, mask, write shards), with its command line; each step
feeds the next (finetuning reuses only its tokenizer loading and special tokens).

Run as ``pipefisher-prepare --input wiki.txt --output-dir DIR ...`` or
``python -m pipefisher.data.prepare ...``.

Input is ``wikipedia.segmented.nltk.txt``-style text: one sentence per line, a blank line
between documents (each input file also starts a new document), or raw WikiText (see
[Note: raw WikiText], ``--input-format``; recognized by itself). The steps follow the published
description of Google's ``create_pretraining_data.py`` (BERT paper, appendix A.1 and the
repository README), re-implemented here:

1. WordPiece tokenization (``tokenizers``' ``BertWordPieceTokenizer``) with a given
   ``vocab.txt``, or one trained on the input. A trained vocabulary puts [PAD], [unused0..98],
   [UNK], [CLS], [SEP], [MASK] at ids 0..103 as bert-base-uncased does, and is written as
   ``vocab.txt`` beside the shards (a given one is copied there), where `Hdf5Source` finds it.
   A trained vocabulary is the same on every run ([Note: a deterministic WordPiece vocabulary]).
2. Documents are shuffled; each is read ``dupe_factor`` times (different masks and splits).
3. Per document, a target length is drawn: ``seq_len - 3``, or with ``short_seq_prob`` a
   uniform length in ``[2, seq_len - 3]``. Sentences are gathered until the target is reached;
   sentence A takes a random number of them, and sentence B is the rest (label 0), or, with
   p = 0.5 (always when only one sentence was gathered), text from a random position in another
   random document (label 1), in which case the unused sentences are put back. The pair is
   truncated to ``seq_len - 3`` tokens by removing tokens from the longer side, at its front or
   back at random, and laid out as ``[CLS] A [SEP] B [SEP]``.
4. Masking: ``min(P, max(1, round(len(tokens) * masked_lm_prob)))`` positions chosen at random
   among non-special tokens; each becomes [MASK] (80%), stays (10%), or becomes a random
   vocabulary id (10%).
5. All instances are shuffled and split into ``num_shards`` files with NVIDIA's fields and dtypes
   (`pipefisher.data.hdf5.NVIDIA_DTYPES`).

With ``--holdout-fraction F > 0``, a seeded choice of about F of the documents (at least one;
`pipefisher.data.heldout.split_documents`) is set aside before step 2 and made into held-out
shards in ``<output-dir>/heldout/`` (same vocabulary, S and P; read once, not ``dupe_factor``
times; a random sentence B is drawn from held-out documents only), so no document's text is on
both sides. `pipefisher.data.heldout.heldout_path` finds that folder from the training shards.

[Note: raw WikiText]
WikiText (Merity et al. 2016) is word-tokenized Wikipedia: `` = Title = `` starts an article,
`` = = Section = = `` (deeper: more ``=``) is a heading, each paragraph is one line, blank lines
separate everything. `wikitext_sentences` turns it into the layout above: each article is a
document, headings and titles are dropped (they are not sentences), paragraphs are split into
sentences after a stand-alone ``.``, ``?`` or ``!`` token (abbreviations such as ``H.`` or
``U.S.`` keep their dot attached in WikiText, so they do not split), number separators
``@-@ @,@ @.@`` are joined back (``3 @.@ 1`` -> ``3.1``) and ``<unk>`` becomes ``[UNK]``, which the
tokenizer maps to its unknown-token id (as ``< unk >`` it would be three easy tokens). A file is
taken as WikiText (``--input-format auto``) when its first non-blank line is a title line. The
conversion is written to a temporary file that both vocabulary training and tokenization read.

[Note: a deterministic WordPiece vocabulary]
``tokenizers``' WordPiece trainer (its BPE trainer underneath) is not deterministic: it gives each
continuing-subword token (``##e``) its id in the iteration order of a hash map whose seed differs from one
training to the next, and breaks ties between merges of equal count by those ids, so two trainings on the same
text give different vocabularies (huggingface/tokenizers#1794, fix proposed in #2066). Measured on WikiText-2
``train.txt`` at 8,192 tokens (tokenizers 0.23.3): three trainings in one process, three vocabularies, 222–245
tokens at other ids. Every study that trained "the same" vocabulary on another machine therefore trained on
other token ids (and where a tie fell at the cut-off, other tokens). Here the alphabet is read off a first
training (sorted by the trainer, deterministic) and a second training starts with every ``##c`` of it among
its special tokens, at fixed ids after BERT's: nothing is created in hash-map order, and the merges' ties break
the same way every time (``tests/test_data.py``). The tokenizer returned is read back from the saved
``vocab.txt``, so the ``##c`` tokens are ordinary vocabulary entries, as for every later reader.

Everything is seeded by ``--seed``. Every instance is held in memory until written (as in the
reference); for a full Wikipedia dump, split the text into parts and run this once per part with
its own ``--prefix`` and ``--seed`` into the same directory.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import logging
import random
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import h5py
import numpy as np
import tokenizers
from tokenizers import BertWordPieceTokenizer
from tqdm import tqdm

from pipefisher.data.batches import BERT_VOCAB_SIZE, DataError
from pipefisher.data.hdf5 import NVIDIA_DTYPES, SHARD_SUFFIXES
from pipefisher.data.heldout import HELDOUT_DIR, split_documents

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "INPUT_FORMATS",
    "check_text_file",
    "PrepareConfig",
    "PrepareResult",
    "create_instances",
    "load_tokenizer",
    "main",
    "prepare",
    "read_documents",
    "resolve_input_format",
    "wikitext_sentences",
    "write_shards",
]

log = logging.getLogger(__name__)

#: Special tokens in bert-base-uncased's id order: [PAD]=0, [unused0..98]=1..99, [UNK]=100,
#: [CLS]=101, [SEP]=102, [MASK]=103.
BERT_SPECIAL_TOKENS: tuple[str, ...] = (
    "[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"
)

Document = list[list[int]]  # sentences of token ids

#: ``--input-format`` choices: ``sentences`` (one per line, blank line between documents),
#: ``wikitext`` (raw WikiText, see [Note: raw WikiText]) or ``auto`` (decided per file).
INPUT_FORMATS: tuple[str, ...] = ("auto", "sentences", "wikitext")


@dataclass(frozen=True)
class PrepareConfig:
    """Settings of one preparation run (the CLI flags; see ``--help``)."""

    seq_len: int = 128
    max_predictions: int = 20
    dupe_factor: int = 5
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    num_shards: int = 1
    seed: int = 12345
    vocab_size: int = BERT_VOCAB_SIZE  # only when training a vocabulary
    lowercase: bool = True
    prefix: str = ""  # shard name prefix; "" means f"pretrain_s{seq_len}_p{max_predictions}"
    compression: str | None = "gzip"
    input_format: str = "auto"  # one of INPUT_FORMATS
    holdout_fraction: float = 0.0  # documents held out into heldout/ (0 = none)

    def __post_init__(self) -> None:
        checks = [
            ("seq_len", self.seq_len >= 5, "at least 5 ([CLS] A [SEP] B [SEP])"),
            ("max_predictions", self.max_predictions >= 1, "at least 1"),
            ("dupe_factor", self.dupe_factor >= 1, "at least 1"),
            ("num_shards", self.num_shards >= 1, "at least 1"),
            ("short_seq_prob", 0.0 <= self.short_seq_prob <= 1.0, "in [0, 1]"),
            ("masked_lm_prob", 0.0 < self.masked_lm_prob < 1.0, "in (0, 1)"),
            ("vocab_size", self.vocab_size > len(BERT_SPECIAL_TOKENS), "above 104"),
            ("compression", self.compression in (None, "gzip", "lzf"), "gzip, lzf or none"),
            ("input_format", self.input_format in INPUT_FORMATS, " or ".join(INPUT_FORMATS)),
            ("holdout_fraction", 0.0 <= self.holdout_fraction < 1.0,
             "in [0, 1), e.g. 0.05 (0 = no held-out split)"),
        ]
        for name, ok, want in checks:
            if not ok:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name}={getattr(self, name)!r} ({flag}): must be {want}")


@dataclass
class PrepareResult:
    """What a preparation run wrote."""

    shards: list[Path]
    vocab_path: Path
    num_documents: int  # documents in the training shards (held-out ones not included)
    num_instances: int
    vocab_size: int
    shard_sizes: list[int] = field(default_factory=list)
    heldout_shards: list[Path] = field(default_factory=list)  # in <output_dir>/heldout/
    num_heldout_documents: int = 0
    num_heldout_instances: int = 0


_TEXT_PROBE_BYTES = 1 << 20


def check_text_file(path: str | Path) -> None:
    """Refuse a file that is not UTF-8 text, naming it (the first MiB is looked at).

    Raises:
        DataError: the file holds NUL bytes or is not valid UTF-8 (a binary file, say an hdf5
            shard or an archive, given as ``--input``).
    """
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(_TEXT_PROBE_BYTES)
    fix = "give text files: one sentence per line, or raw WikiText (unpack an archive first)"
    if b"\0" in head:
        raise DataError(f"{path}: a binary file (it holds NUL bytes), not text (--input); {fix}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < _TEXT_PROBE_BYTES)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}) (--input); {fix}") from None


def load_tokenizer(
    vocab: str | Path | None,
    train_files: Sequence[str | Path] = (),
    *,
    vocab_size: int = BERT_VOCAB_SIZE,
    lowercase: bool = True,
) -> BertWordPieceTokenizer:
    """A WordPiece tokenizer from a ``vocab.txt``, or trained on text files.

    Args:
        vocab: path of a ``vocab.txt`` (one token per line); ``None`` trains one.
        train_files: text to train on when ``vocab`` is ``None``.
        vocab_size: target size of a trained vocabulary (the alphabet may add a few).
        lowercase: lowercase and strip accents (uncased BERT).

    Returns:
        The tokenizer; [CLS], [SEP], [MASK], [PAD] and [UNK] are in its vocabulary.

    Raises:
        DataError: the vocab file is missing or lacks a special token.
    """
    if vocab is not None:
        path = Path(vocab)
        if not path.is_file():
            raise DataError(f"{path}: vocab file not found (--vocab); give a vocab.txt or "
                            "leave --vocab out to train one on the input")
        tok = BertWordPieceTokenizer(str(path), lowercase=lowercase)
        missing = [t for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
                   if tok.token_to_id(t) is None]
        if missing:
            raise DataError(f"{path}: vocab lacks special tokens {missing}; use a BERT vocab.txt")
        return tok
    return _train_wordpiece([str(f) for f in train_files], vocab_size, lowercase)


CONTINUING_PREFIX = "##"  # WordPiece's continuing-subword prefix (BertWordPieceTokenizer's default)


def _train_wordpiece(files: list[str], vocab_size: int, lowercase: bool) -> BertWordPieceTokenizer:
    """A WordPiece vocabulary trained on ``files``, the same on every run ([Note: a deterministic WordPiece
    vocabulary]), as a tokenizer read back from its ``vocab.txt`` (what the shards' readers load)."""

    def train(extra: list[str]) -> BertWordPieceTokenizer:
        tok = BertWordPieceTokenizer(lowercase=lowercase)
        try:
            tok.train(files, vocab_size=vocab_size, min_frequency=2,
                      special_tokens=[*BERT_SPECIAL_TOKENS, *extra], show_progress=False)
        except Exception as e:  # the Rust trainer raises a bare Exception, e.g. past the probed first MiB
            if "UTF-8" not in str(e):
                raise
            raise DataError(f"{', '.join(files)}: not UTF-8 text ({e}); give text files (--input)") from None
        return tok

    # The first training's single-character tokens are the alphabet (the trainer sorts it: deterministic).
    alphabet = sorted(t for t in train([]).get_vocab() if len(t) == 1)
    tok = train([CONTINUING_PREFIX + c for c in alphabet])
    for i, t in enumerate(BERT_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, "trainer must keep the special tokens' order"
    with tempfile.TemporaryDirectory(prefix="pipefisher-vocab-") as tmp:
        tok.save_model(tmp)
        return BertWordPieceTokenizer(str(Path(tmp) / "vocab.txt"), lowercase=lowercase)


_WIKITEXT_JOINS = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."))
_SENTENCE_END = re.compile(r"(?<= [.?!]) (?=\S)")  # after a stand-alone . ? ! token


def _heading_level(line: str) -> int:
    """WikiText heading depth of a stripped line: 1 for `` = Title = ``, 2 for sections, 0 for text."""
    words = line.split(" ")
    level = 0
    while level < len(words) // 2 and words[level] == "=" and words[-1 - level] == "=":
        level += 1
    return level if len(words) > 2 * level else 0


def wikitext_sentences(lines: Iterable[str]) -> Iterator[str | None]:
    """Raw WikiText lines as sentences, ``None`` at each article's start (see [Note: raw WikiText]).

    Args:
        lines: the file's lines (with or without newlines).

    Returns:
        An iterator of sentences (stripped, non-empty) and ``None`` document boundaries.
    """
    for raw in lines:
        line = raw.strip()
        if not line:
            continue
        level = _heading_level(line)
        if level == 1:
            yield None
            continue
        if level > 1:
            continue
        line = " ".join("[UNK]" if w == "<unk>" else w for w in line.split())
        for old, new in _WIKITEXT_JOINS:
            line = line.replace(old, new)
        for sentence in _SENTENCE_END.split(line.strip()):
            if sentence.strip():
                yield sentence.strip()


def resolve_input_format(path: str | Path, input_format: str = "auto") -> str:
    """``sentences`` or ``wikitext`` for one file; ``auto`` looks at its first non-blank line.

    Raises:
        ValueError: an unknown ``input_format``.
    """
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input_format={input_format!r}: must be {' or '.join(INPUT_FORMATS)}")
    if input_format != "auto":
        return input_format
    with Path(path).open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return "wikitext" if _heading_level(line.strip()) == 1 else "sentences"
    return "sentences"


def _as_sentence_files(paths: Sequence[Path], input_format: str, tmp: Path) -> tuple[list[Path], list[str]]:
    """The inputs in the sentence-per-line layout (WikiText converted into ``tmp``) and each one's format."""
    out, formats = [], []
    for k, path in enumerate(paths):
        fmt = resolve_input_format(path, input_format)
        formats.append(fmt)
        if fmt == "sentences":
            out.append(path)
            continue
        converted = tmp / f"{k:03d}_{path.stem}.sentences.txt"
        with path.open(encoding="utf-8", errors="replace") as src, converted.open("w", encoding="utf-8") as dst:
            for sentence in wikitext_sentences(src):
                dst.write("\n" if sentence is None else sentence + "\n")
        log.info("%s: raw WikiText, converted to one sentence per line", path)
        out.append(converted)
    return out, formats


def _lines(paths: Sequence[Path]) -> Iterator[str | None]:
    """Stripped lines; ``None`` marks a document boundary (blank line or new file)."""
    for path in paths:
        yield None
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                yield line if line else None


def read_documents(
    paths: Sequence[str | Path],
    tokenizer: BertWordPieceTokenizer,
    *,
    progress: bool = False,
    chunk_lines: int = 10_000,
) -> list[Document]:
    """Tokenize documents (sentences of token ids, without special tokens).

    Args:
        paths: text files, one sentence per line, blank line between documents.
        tokenizer: from `load_tokenizer`.
        progress: show a tqdm bar over lines.
        chunk_lines: lines tokenized per ``encode_batch`` call.

    Returns:
        Non-empty documents of non-empty sentences.
    """
    documents: list[Document] = [[]]
    pending: list[str | None] = []

    def flush() -> None:
        texts = [s for s in pending if s is not None]
        encoded = iter(tokenizer.encode_batch(texts, add_special_tokens=False)) if texts else None
        for s in pending:
            if s is None:
                if documents[-1]:
                    documents.append([])
            else:
                assert encoded is not None
                ids = next(encoded).ids
                if ids:
                    documents[-1].append(ids)
        pending.clear()

    for line in tqdm(_lines([Path(p) for p in paths]), desc="tokenize", unit=" lines",
                     disable=not progress):
        pending.append(line)
        if len(pending) >= chunk_lines:
            flush()
    flush()
    return [d for d in documents if d]


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        assert len(longer) >= 1
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _mask(
    tokens: list[int], cfg: PrepareConfig, vocab_size: int, special: frozenset[int],
    mask_id: int, rng: random.Random,
) -> tuple[list[int], list[int], list[int]]:
    """BERT masking: (tokens with masks applied, sorted positions, original ids)."""
    candidates = [i for i, t in enumerate(tokens) if t not in special]
    rng.shuffle(candidates)
    num = min(cfg.max_predictions, max(1, int(round(len(tokens) * cfg.masked_lm_prob))))
    chosen = sorted(candidates[:num])
    out = list(tokens)
    for i in chosen:
        if rng.random() < 0.8:
            out[i] = mask_id
        elif rng.random() < 0.5:
            pass  # keep the original token
        else:
            out[i] = rng.randint(0, vocab_size - 1)
    return out, chosen, [tokens[i] for i in chosen]


def _instances_from_document(
    documents: Sequence[Document], doc_index: int, cfg: PrepareConfig, vocab_size: int,
    ids: dict[str, int], rng: random.Random,
) -> Iterator[np.ndarray]:
    """Packed instances (see `_pack`) from one document."""
    document = documents[doc_index]
    max_tokens = cfg.seq_len - 3
    target = max_tokens
    if rng.random() < cfg.short_seq_prob:
        target = rng.randint(2, max_tokens)
    special = frozenset((ids["[CLS]"], ids["[SEP]"]))
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            tokens_a = [t for s in chunk[:a_end] for t in s]
            tokens_b: list[int] = []
            is_random = len(chunk) == 1 or rng.random() < 0.5
            if is_random:
                target_b = target - len(tokens_a)
                other = doc_index
                for _ in range(10):  # another document, unless there is only one
                    other = rng.randint(0, len(documents) - 1)
                    if other != doc_index:
                        break
                rand_doc = documents[other]
                for sentence in rand_doc[rng.randint(0, len(rand_doc) - 1):]:
                    tokens_b.extend(sentence)
                    if len(tokens_b) >= target_b:
                        break
                i -= len(chunk) - a_end  # the unused sentences start the next instance
            else:
                tokens_b = [t for s in chunk[a_end:] for t in s]
            _truncate_pair(tokens_a, tokens_b, max_tokens, rng)
            tokens = [ids["[CLS]"], *tokens_a, ids["[SEP]"], *tokens_b, ids["[SEP]"]]
            segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
            masked, positions, labels = _mask(
                tokens, cfg, vocab_size, special, ids["[MASK]"], rng
            )
            yield _pack(masked, segments, positions, labels, is_random, cfg)
            chunk, length = [], 0
        i += 1


def _pack(
    tokens: list[int], segments: list[int], positions: list[int], labels: list[int],
    is_random: bool, cfg: PrepareConfig,
) -> np.ndarray:
    """One instance as an int32 row: ids (S), segments (S), positions (P), labels (P), nsp, n."""
    S, P = cfg.seq_len, cfg.max_predictions
    row = np.zeros(2 * S + 2 * P + 2, dtype=np.int32)
    row[: len(tokens)] = tokens
    row[S : S + len(segments)] = segments
    row[2 * S : 2 * S + len(positions)] = positions
    row[2 * S + P : 2 * S + P + len(labels)] = labels
    row[-2] = int(is_random)
    row[-1] = len(tokens)
    return row


def create_instances(
    documents: Sequence[Document],
    cfg: PrepareConfig,
    vocab_size: int,
    special_ids: dict[str, int],
    *,
    progress: bool = False,
) -> dict[str, np.ndarray]:
    """Pretraining instances from tokenized documents, shuffled, as NVIDIA-layout arrays.

    Args:
        documents: from `read_documents`; shuffled here (a copy) with ``cfg.seed``.
        cfg: lengths, probabilities, duplication and seed.
        vocab_size: random replacement ids are drawn from ``[0, vocab_size)``.
        special_ids: ids of ``"[CLS]"``, ``"[SEP]"`` and ``"[MASK]"``.
        progress: show a tqdm bar over documents.

    Returns:
        Field name -> array (N rows) with the dtypes of `NVIDIA_DTYPES`.
    """
    rng = random.Random(cfg.seed)
    docs = list(documents)
    rng.shuffle(docs)
    rows: list[np.ndarray] = []
    with tqdm(total=cfg.dupe_factor * len(docs), desc="instances", unit=" docs",
              disable=not progress) as bar:
        for _ in range(cfg.dupe_factor):
            for d in range(len(docs)):
                rows.extend(_instances_from_document(docs, d, cfg, vocab_size, special_ids, rng))
                bar.update()
    rng.shuffle(rows)
    S, P = cfg.seq_len, cfg.max_predictions
    packed = np.stack(rows) if rows else np.zeros((0, 2 * S + 2 * P + 2), dtype=np.int32)
    arrays = {
        "input_ids": packed[:, :S],
        "input_mask": np.arange(S)[None, :] < packed[:, -1:],
        "segment_ids": packed[:, S : 2 * S],
        "masked_lm_positions": packed[:, 2 * S : 2 * S + P],
        "masked_lm_ids": packed[:, 2 * S + P : 2 * S + 2 * P],
        "next_sentence_labels": packed[:, -2],
    }
    return {k: np.ascontiguousarray(a, dtype=NVIDIA_DTYPES[k]) for k, a in arrays.items()}


def write_shards(
    arrays: dict[str, np.ndarray],
    output_dir: str | Path,
    num_shards: int,
    *,
    prefix: str,
    compression: str | None = "gzip",
) -> list[Path]:
    """Split instances into ``num_shards`` contiguous, near-equal hdf5 files.

    Args:
        arrays: from `create_instances`.
        output_dir: created if missing.
        num_shards: files to write (at most one per instance).
        prefix: file names are ``{prefix}_{k:05d}.hdf5``.
        compression: h5py compression filter or ``None``.

    Returns:
        The written paths.
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(arrays["input_ids"])
    if num_shards > n:
        log.warning("only %d instances: writing %d shards, not %d", n, n, num_shards)
        num_shards = n
    bounds = np.linspace(0, n, num_shards + 1).astype(np.int64)
    paths = []
    for k in range(num_shards):
        path = out / f"{prefix}_{k:05d}.hdf5"
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        with h5py.File(path, "w") as f:
            for name, dtype in NVIDIA_DTYPES.items():
                f.create_dataset(name, data=arrays[name][lo:hi].astype(dtype, copy=False),
                                 compression=compression)
        paths.append(path)
    return paths


def prepare(
    inputs: Sequence[str | Path],
    output_dir: str | Path,
    cfg: PrepareConfig,
    *,
    vocab: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize text, create masked instances and write NVIDIA-format shards plus vocab.txt.

    Args:
        inputs: text files (one sentence per line, blank line between documents, or raw
            WikiText: ``cfg.input_format``).
        output_dir: where shards, ``vocab.txt`` and ``prepare.json`` (the settings) go; held-out
            shards (``cfg.holdout_fraction > 0``) and a copy of ``vocab.txt`` go to its ``heldout/``.
        cfg: settings.
        vocab: an existing ``vocab.txt``; ``None`` trains one of ``cfg.vocab_size`` on inputs.
        overwrite: allow an output directory that already holds shards.
        progress: tqdm bars.

    Returns:
        What was written.

    Raises:
        DataError: missing input, existing shards (``heldout/`` included) without ``overwrite``,
            no instances, or too few documents to hold some out.
    """
    paths = [Path(p) for p in inputs]
    for p in paths:
        if not p.is_file():
            raise DataError(f"{p}: input text file not found (--input)")
        check_text_file(p)
    out = Path(output_dir)
    held_dir = out / HELDOUT_DIR
    existing = _shard_names(out) + [f"{HELDOUT_DIR}/{n}" for n in _shard_names(held_dir)]
    if existing and not overwrite:
        raise DataError(f"{out}: already holds shards {existing[:3]}...; choose another "
                        "--output-dir or pass --overwrite")

    # Nothing is written to `out` until there are instances to write: a failed run (empty input,
    # say) leaves no vocab.txt that a later data=hdf5 run would take for the shards' (issue 16).
    with tempfile.TemporaryDirectory(prefix="pipefisher-prepare-") as tmp:
        texts, formats = _as_sentence_files(paths, cfg.input_format, Path(tmp))
        tokenizer = load_tokenizer(vocab, texts, vocab_size=cfg.vocab_size, lowercase=cfg.lowercase)
        vocab_size = tokenizer.get_vocab_size()
        documents = read_documents(texts, tokenizer, progress=progress)
    if not documents:
        raise DataError(f"{', '.join(map(str, paths))}: no sentences found; expected one sentence per line "
                        "(blank line between documents) or raw WikiText; nothing written")
    train_ids, held_ids = split_documents(len(documents), cfg.holdout_fraction, cfg.seed)
    special = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]")}
    arrays = create_instances([documents[d] for d in train_ids], cfg, vocab_size, special, progress=progress)
    num = len(arrays["input_ids"])
    if num == 0:
        raise DataError(f"{', '.join(map(str, paths))}: no instances created; nothing written")
    # Held-out documents are read once: repeated masks of one text add no new evaluation signal.
    held_arrays = create_instances([documents[d] for d in held_ids], replace(cfg, dupe_factor=1), vocab_size,
                                   special, progress=progress) if held_ids else None
    out.mkdir(parents=True, exist_ok=True)
    for name in existing:
        (out / name).unlink()
    if held_dir.is_dir():  # a stale split must not outlive an --overwrite
        (held_dir / "vocab.txt").unlink(missing_ok=True)
        if not any(held_dir.iterdir()):
            held_dir.rmdir()
    vocab_path = out / "vocab.txt"
    if vocab is None:
        tokenizer.save_model(str(out))
    elif Path(vocab).resolve() != vocab_path.resolve():
        shutil.copyfile(vocab, vocab_path)
    log.info("vocabulary: %d tokens (%s)", vocab_size, vocab_path)
    prefix = cfg.prefix or f"pretrain_s{cfg.seq_len}_p{cfg.max_predictions}"
    shards = write_shards(arrays, out, cfg.num_shards, prefix=prefix, compression=cfg.compression)
    result = PrepareResult(shards, vocab_path, len(train_ids), num, vocab_size, _sizes(num, len(shards)))
    if held_arrays is not None:
        num_held_shards = max(1, round(cfg.num_shards * cfg.holdout_fraction))
        result.heldout_shards = write_shards(held_arrays, held_dir, num_held_shards, prefix=prefix,
                                             compression=cfg.compression)
        shutil.copyfile(vocab_path, held_dir / "vocab.txt")
        result.num_heldout_documents = len(held_ids)
        result.num_heldout_instances = len(held_arrays["input_ids"])
    info = {"inputs": [str(p) for p in paths], "input_formats": formats,
            "vocab": str(vocab) if vocab else None,
            **asdict(cfg), "num_documents": len(train_ids), "num_instances": num,
            "vocab_size_actual": vocab_size, "vocab_sha256": hashlib.sha256(vocab_path.read_bytes()).hexdigest(),
            "tokenizers_version": tokenizers.__version__, "shards": [p.name for p in shards],
            "shard_sizes": result.shard_sizes, "num_heldout_documents": result.num_heldout_documents,
            "num_heldout_instances": result.num_heldout_instances,
            "heldout_shards": [f"{HELDOUT_DIR}/{p.name}" for p in result.heldout_shards],
            "heldout_shard_sizes": _sizes(result.num_heldout_instances, len(result.heldout_shards))}
    (out / "prepare.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("%d documents -> %d instances in %d shard(s) under %s", len(train_ids), num, len(shards), out)
    if held_ids:
        log.info("held out: %d documents -> %d instances in %d shard(s) under %s", len(held_ids),
                 result.num_heldout_instances, len(result.heldout_shards), held_dir)
    return result


def _shard_names(folder: Path) -> list[str]:
    return sorted(q.name for q in folder.glob("*") if q.suffix in SHARD_SUFFIXES) if folder.is_dir() else []


def _sizes(num: int, num_shards: int) -> list[int]:
    """Instances per shard as `write_shards` splits ``num`` of them."""
    return np.diff(np.linspace(0, num, num_shards + 1).astype(np.int64)).tolist() if num_shards else []


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none to show (required
    options, flags, and defaults of None or "" that the help text explains)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, "", False):
            return action.help or ""
        return super()._get_help_string(action) or ""


def _parser() -> argparse.ArgumentParser:
    d = PrepareConfig()
    p = argparse.ArgumentParser(
        prog="pipefisher-prepare",
        description="Make NVIDIA-format BERT pretraining hdf5 shards from sentence-per-line text "
                    "or raw WikiText.",
        formatter_class=_DefaultsHelpFormatter,
    )
    p.add_argument("--input", nargs="+", required=True,
                   help="text file(s): one sentence per line, blank line between documents, "
                        "or raw WikiText (see --input-format)")
    p.add_argument("--input-format", default=d.input_format, choices=INPUT_FORMATS,
                   help="sentences, wikitext (' = Title = ' starts an article; converted to one "
                        "sentence per line) or auto (wikitext when a file's first non-blank line "
                        "is a title line)")
    p.add_argument("--output-dir", required=True, help="directory for shards and vocab.txt")
    p.add_argument("--vocab", default=None, help="existing vocab.txt; None: train one on the input")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="size of a trained vocabulary (ignored with --vocab)")
    p.add_argument("--cased", action="store_true", help="keep case and accents")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="S (phase 1: 128, 2: 512)")
    p.add_argument("--max-predictions", type=int, default=d.max_predictions,
                   help="P (phase 1: 20, 2: 80)")
    p.add_argument("--dupe-factor", type=int, default=d.dupe_factor,
                   help="passes over the documents, each with new splits and masks")
    p.add_argument("--short-seq-prob", type=float, default=d.short_seq_prob,
                   help="probability of a shorter target length for a document")
    p.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob,
                   help="fraction of tokens masked (at most --max-predictions)")
    p.add_argument("--num-shards", type=int, default=d.num_shards, help="hdf5 files to write")
    p.add_argument("--holdout-fraction", type=float, default=d.holdout_fraction,
                   help="fraction of documents (at least one if > 0) written, read once, to held-out "
                        "shards in OUTPUT_DIR/heldout/ for evaluation (data.eval_path); 0: none")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds every random choice")
    p.add_argument("--prefix", default="",
                   help="shard file name prefix; empty: pretrain_s{seq-len}_p{max-predictions}")
    p.add_argument("--compression", default="gzip", choices=["gzip", "lzf", "none"],
                   help="hdf5 compression filter (NVIDIA's shards use gzip)")
    p.add_argument("--overwrite", action="store_true", help="replace shards in --output-dir")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point (``pipefisher-prepare``); returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.vocab is not None and args.vocab_size != BERT_VOCAB_SIZE:
        log.warning("--vocab-size %d has no effect with --vocab (the file sets the size)",
                    args.vocab_size)
    try:
        cfg = PrepareConfig(
            seq_len=args.seq_len, max_predictions=args.max_predictions,
            dupe_factor=args.dupe_factor, short_seq_prob=args.short_seq_prob,
            masked_lm_prob=args.masked_lm_prob, num_shards=args.num_shards, seed=args.seed,
            vocab_size=args.vocab_size, lowercase=not args.cased, prefix=args.prefix,
            compression=None if args.compression == "none" else args.compression,
            input_format=args.input_format, holdout_fraction=args.holdout_fraction,
        )
        result = prepare(args.input, args.output_dir, cfg, vocab=args.vocab,
                         overwrite=args.overwrite, progress=not args.no_progress)
    except ValueError as e:  # DataError included
        print(f"pipefisher-prepare: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.num_instances} instances from {result.num_documents} documents "
          f"into {len(result.shards)} shard(s) in {args.output_dir} "
          f"(vocab {result.vocab_size}: {result.vocab_path})")
    if result.heldout_shards:
        print(f"held out {result.num_heldout_instances} instances from {result.num_heldout_documents} "
              f"documents into {len(result.heldout_shards)} shard(s) in {result.heldout_shards[0].parent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
