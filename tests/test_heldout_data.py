"""Held-out data: prepare's document-level split, the fixed held-out micro-batches, eval config checks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from pipefisher.config import ConfigError
from pipefisher.data import (
    BATCH_KEYS,
    HELDOUT_FIRST_ID,
    DataError,
    Hdf5Source,
    SyntheticSource,
    build_eval_source,
    build_source,
    check_batch,
    check_eval_batches,
    eval_micro_batch,
    get_micro_batch,
    heldout_path,
    num_eval_micro_batches,
    split_documents,
)
from pipefisher.data.prepare import BERT_SPECIAL_TOKENS, PrepareConfig, create_instances, load_tokenizer, main
from pipefisher.data.prepare import read_documents
from tests.conftest import compose_train

S, P, B = 32, 5, 4
NUM_DOCS, WORDS_PER_DOC, FRACTION, SEED = 40, 6, 0.2, 5
FIRST_WORD = len(BERT_SPECIAL_TOKENS)  # word ids follow the special tokens in our vocab.txt
SPECIAL_IDS = {0, 101, 102}  # [PAD], [CLS], [SEP]


def _word(doc: int, j: int) -> str:
    """A whole-word token owned by one document, so any token names its document."""
    return "".join("abcdefghijklmnopqrstuvwxyz"[int(c)] for c in f"{doc:03d}") + "qwertyuio"[j]


def _write_corpus(root: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    lines = []
    for d in range(NUM_DOCS):
        for _ in range(rng.randint(2, 7)):
            lines.append(" ".join(_word(d, rng.randrange(WORDS_PER_DOC)) for _ in range(rng.randint(3, 10))))
        lines.append("")
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    words = [_word(d, j) for d in range(NUM_DOCS) for j in range(WORDS_PER_DOC)]
    (root / "vocab.txt").write_text("\n".join([*BERT_SPECIAL_TOKENS, *words]) + "\n")
    return root / "corpus.txt", root / "vocab.txt"


def _prepare(root: Path, out: Path, *extra: str) -> int:
    corpus, vocab = root / "corpus.txt", root / "vocab.txt"
    return main(["--input", str(corpus), "--vocab", str(vocab), "--output-dir", str(out), "--seq-len", str(S),
                 "--max-predictions", str(P), "--dupe-factor", "3", "--num-shards", "2", "--seed", str(SEED),
                 "--compression", "none", "--no-progress", *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Training shards with a held-out split, made through the command line."""
    root = tmp_path_factory.mktemp("heldout")
    _write_corpus(root)
    assert _prepare(root, root / "shards", "--holdout-fraction", str(FRACTION)) == 0
    return root / "shards"


def _read(folder: Path) -> dict[str, np.ndarray]:
    """Every instance of a folder's shards, in storage order."""
    parts = []
    for path in sorted(folder.glob("*.hdf5")):
        with h5py.File(path, "r") as f:
            parts.append({k: f[k][()] for k in BATCH_KEYS})
    return {k: np.concatenate([p[k] for p in parts]) for k in BATCH_KEYS}


def _documents_of(arrays: dict[str, np.ndarray]) -> list[set[int]]:
    """Per instance, the documents its (unmasked) tokens come from."""
    ids = arrays["input_ids"].astype(np.int64).copy()
    for i in range(len(ids)):
        lm = arrays["masked_lm_ids"][i]
        ids[i, arrays["masked_lm_positions"][i][lm > 0]] = lm[lm > 0]
    return [{(int(t) - FIRST_WORD) // WORDS_PER_DOC for t in row if t not in SPECIAL_IDS} for row in ids]


# --- prepare --holdout-fraction --------------------------------------------------------------------


def test_holdout_split_puts_every_document_on_exactly_one_side(shards: Path) -> None:
    train_docs, held_docs = split_documents(NUM_DOCS, FRACTION, SEED)
    assert len(held_docs) == round(FRACTION * NUM_DOCS) and not set(train_docs) & set(held_docs)
    held = _documents_of(_read(shards / "heldout"))
    train = _documents_of(_read(shards))
    # Sentence B of a "random next sentence" instance is drawn from the same side's documents too.
    assert set().union(*held) == set(held_docs)
    assert set().union(*train) == set(train_docs)
    info = json.loads((shards / "prepare.json").read_text())
    assert (info["num_documents"], info["num_heldout_documents"]) == (len(train_docs), len(held_docs))
    assert info["num_heldout_instances"] == len(held) and info["num_instances"] == len(train)
    assert (shards / "heldout" / "vocab.txt").read_text() == (shards / "vocab.txt").read_text()


def test_heldout_documents_are_read_once_with_seeded_masks(shards: Path, tmp_path: Path) -> None:
    cfg = PrepareConfig(seq_len=S, max_predictions=P, dupe_factor=1, seed=SEED)
    tok = load_tokenizer(shards / "vocab.txt")
    docs = read_documents([shards.parent / "corpus.txt"], tok)
    _, held_docs = split_documents(len(docs), FRACTION, SEED)
    special = {t: tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]")}
    once = create_instances([docs[d] for d in held_docs], cfg, tok.get_vocab_size(), special)
    stored = _read(shards / "heldout")
    for k in BATCH_KEYS:
        assert np.array_equal(stored[k], once[k]), k
    assert _prepare(shards.parent, tmp_path / "again", "--holdout-fraction", str(FRACTION)) == 0
    for k in BATCH_KEYS:
        assert np.array_equal(_read(tmp_path / "again" / "heldout")[k], stored[k]), k


def test_prepare_reports_both_sides(shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert _prepare(shards.parent, tmp_path / "out", "--holdout-fraction", "0.1") == 0
    out = capsys.readouterr().out
    assert "from 36 documents" in out and "held out" in out and "from 4 documents" in out


@pytest.mark.parametrize("fraction", ["1", "-0.1", "1.5"])
def test_holdout_fraction_outside_0_1_is_refused_naming_the_flag(
        shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture, fraction: str) -> None:
    assert _prepare(shards.parent, tmp_path / "out", "--holdout-fraction", fraction) == 2
    assert "--holdout-fraction" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_split_documents_is_seeded_keeps_one_for_training_and_holds_at_least_one() -> None:
    assert split_documents(50, 0.1, 1) == split_documents(50, 0.1, 1) != split_documents(50, 0.1, 2)
    assert split_documents(50, 0.0, 1) == (list(range(50)), [])
    train, held = split_documents(3, 0.01, 0)
    assert len(held) == 1 and sorted(train + held) == [0, 1, 2]
    with pytest.raises(DataError, match="leaves none for training"):
        split_documents(1, 0.5, 0)
    with pytest.raises(ValueError, match="--holdout-fraction"):
        split_documents(10, 1.0, 0)


def test_overwrite_without_holdout_removes_a_stale_split(shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _prepare(shards.parent, out, "--holdout-fraction", "0.1") == 0
    assert _prepare(shards.parent, out) == 2, "held-out shards count as existing shards"
    assert _prepare(shards.parent, out, "--overwrite") == 0
    assert heldout_path(out) is None and not (out / "heldout").exists()


def test_heldout_path_finds_the_folder_beside_the_training_shards(shards: Path, tmp_path: Path) -> None:
    assert heldout_path(shards) == shards / "heldout"
    assert heldout_path(next(shards.glob("*.hdf5"))) == shards / "heldout"
    assert heldout_path(tmp_path) is None
    (tmp_path / "heldout").mkdir()
    assert heldout_path(tmp_path) is None, "an empty heldout/ holds no shards"


# --- held-out micro-batches --------------------------------------------------------------------------


def _eval_source(kind: str, shards: Path, seed: int, **kw: object):
    return build_eval_source(kind, path=str(shards), eval_path=None, seq_len=S, max_predictions=P,
                             vocab_size=FIRST_WORD + NUM_DOCS * WORDS_PER_DOC, seed=seed, num_samples=64, **kw)


@pytest.mark.parametrize("kind", ["hdf5", "synthetic"])
def test_eval_micro_batches_are_fixed_whatever_the_seed_or_history(kind: str, shards: Path) -> None:
    first = _eval_source(kind, shards, seed=0)
    other = _eval_source(kind, shards, seed=7)
    n = num_eval_micro_batches(first, B)
    assert n == len(first) // B >= 2
    eval_micro_batch(other, n - 1, B)  # a different history: caches must not matter
    for index in (1, 0, n - 1):
        x, y = eval_micro_batch(first, index, B), eval_micro_batch(other, index, B)
        assert list(x) == list(BATCH_KEYS)
        for k in BATCH_KEYS:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)
        check_batch(x, seq_len=S, max_predictions=P, vocab_size=first.vocab_size)
    assert not torch.equal(eval_micro_batch(first, 0, B)["input_ids"], eval_micro_batch(first, 1, B)["input_ids"])


def test_hdf5_eval_micro_batches_follow_storage_order(shards: Path) -> None:
    source = _eval_source("hdf5", shards, seed=3)
    stored = _read(shards / "heldout")
    assert len(source) == len(stored["input_ids"])
    for index in range(num_eval_micro_batches(source, B)):
        batch = eval_micro_batch(source, index, B)
        for k in BATCH_KEYS:
            assert np.array_equal(batch[k].numpy(), stored[k][index * B : (index + 1) * B]), (index, k)
    explicit = build_eval_source("hdf5", path=None, eval_path=str(shards / "heldout"), seq_len=S,
                                 max_predictions=P, vocab_size=source.vocab_size, seed=0, num_samples=1)
    torch.testing.assert_close(eval_micro_batch(explicit, 0, B), eval_micro_batch(source, 0, B), rtol=0, atol=0)


def test_stored_order_runs_through_the_shards_by_name_without_a_seed(shards: Path) -> None:
    stored = _read(shards)  # the training shards: two files
    for seed in (0, 1):
        source = Hdf5Source(shards, seed=seed, cache_shards=1)
        batch = source.get_stored_samples(range(len(source)))
        for k in BATCH_KEYS:
            assert np.array_equal(batch[k].numpy(), stored[k]), k
        with pytest.raises(ValueError, match="positions"):
            source.get_stored_samples([len(source)])


def test_synthetic_heldout_samples_are_the_training_language_but_never_training_samples() -> None:
    plan = dict(micro_batch_size=B, num_micro_batches=2, dp_width=1)
    held = build_eval_source("synthetic", path=None, eval_path=None, seq_len=S, max_predictions=P,
                             vocab_size=600, seed=0, num_samples=32)
    held_rows = {tuple(r) for i in range(8) for r in eval_micro_batch(held, i, B)["input_ids"].tolist()}
    assert len(held_rows) == 32
    for seed in (0, 7):
        train = build_source("synthetic", path=None, seq_len=S, max_predictions=P, vocab_size=600, seed=seed,
                             num_samples=40)
        assert np.array_equal(train._topic_tokens, held._topic_tokens), "the same language"
        # 30 steps x 8 samples: six epochs of the 40 training samples, every one of them seen.
        rows = {tuple(r) for step in range(30) for mb in range(2)
                for r in get_micro_batch(train, step, mb, 0, **plan)["input_ids"].tolist()}
        assert len(rows) == 40 and not rows & held_rows


def test_synthetic_training_ids_cannot_reach_the_heldout_range() -> None:
    with pytest.raises(ValueError, match="HELDOUT_FIRST_ID"):
        SyntheticSource(S, P, 600, seed=0, num_samples=HELDOUT_FIRST_ID + 1)
    with pytest.raises(ValueError, match="HELDOUT_FIRST_ID"):
        SyntheticSource(S, P, 600, seed=0, num_samples=10, first_sample_id=HELDOUT_FIRST_ID - 5)


def test_too_few_heldout_samples_name_eval_batches_and_what_the_set_holds(shards: Path) -> None:
    source = _eval_source("hdf5", shards, seed=0)
    n = num_eval_micro_batches(source, B)
    check_eval_batches(source, n, B)
    with pytest.raises(DataError, match=rf"eval.batches={n + 1}: .* holds {n} micro-batches of micro_batch_size={B}"):
        check_eval_batches(source, n + 1, B)
    with pytest.raises(DataError, match=rf"eval.batches={n + 1}"):
        eval_micro_batch(source, n, B)


def test_eval_source_errors_name_the_setting_and_the_fix(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.eval_path=<held-out shards>.*--holdout-fraction 0.05"):
        build_eval_source("hdf5", path=str(tmp_path), eval_path=None, seq_len=S, max_predictions=P,
                          vocab_size=400, seed=0, num_samples=1)
    with pytest.raises(DataError, match="data.eval_path.*no such file"):
        build_eval_source("hdf5", path=str(shards), eval_path=str(tmp_path / "nope"), seq_len=S,
                          max_predictions=P, vocab_size=400, seed=0, num_samples=1)
    with pytest.raises(DataError, match="synthetic data has its own held-out stream"):
        build_eval_source("synthetic", path=None, eval_path=str(shards), seq_len=S, max_predictions=P,
                          vocab_size=400, seed=0, num_samples=1)
    with pytest.raises(DataError, match=r"seq_len=32 \(width of 'input_ids'\).*seq_len=64"):
        build_eval_source("hdf5", path=str(shards), eval_path=None, seq_len=64, max_predictions=P,
                          vocab_size=400, seed=0, num_samples=1)


# --- config: eval.* and data.eval_path ---------------------------------------------------------------


def test_eval_is_off_by_default_and_composes() -> None:
    cfg = compose_train([])
    assert (cfg.eval.every_steps, cfg.eval.batches, cfg.data.eval_path) == (0, 8, None)
    cfg = compose_train(["eval.every_steps=5", "eval.batches=2"])
    assert (cfg.eval.every_steps, cfg.eval.batches) == (5, 2)


def test_hdf5_eval_finds_the_heldout_split_or_takes_an_explicit_path(shards: Path) -> None:
    cfg = compose_train(["data=hdf5", f"data.path={shards}", "eval.every_steps=10"])
    assert heldout_path(cfg.data.path) == shards / "heldout"
    cfg = compose_train(["data=hdf5", f"data.path={shards}", "eval.every_steps=10",
                         f"data.eval_path={shards / 'heldout'}"])
    assert cfg.data.eval_path == str(shards / "heldout")


@pytest.mark.parametrize("overrides,field,fix", [
    (["eval.every_steps=-1"], "eval.every_steps", ">= 0"),
    (["eval.batches=0"], "eval.batches", "at least 1"),
    (["data.eval_path=/tmp"], "data.eval_path", "synthetic data has its own held-out stream"),
    (["data=hdf5", "data.path={bare}", "eval.every_steps=10"], "data.eval_path",
     "data.eval_path=<held-out shards>"),
    (["data=hdf5", "data.path={bare}", "eval.every_steps=10"], "data.eval_path", "--holdout-fraction 0.05"),
    (["data=hdf5", "data.path={shards}", "eval.every_steps=10", "data.eval_path={bare}/nope"],
     "data.eval_path", "no such file"),
])
def test_eval_config_errors_name_the_field_and_the_fix(
        overrides: list[str], field: str, fix: str, shards: Path, tmp_path: Path) -> None:
    (tmp_path / "bare").mkdir()
    overrides = [o.format(bare=tmp_path / "bare", shards=shards) for o in overrides]
    with pytest.raises(ConfigError) as err:
        compose_train(overrides)
    assert field in str(err.value) and fix in str(err.value)
