"""Data: text -> shards -> batches, the shared batch plan, synthetic data, bad-data errors."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from tokenizers import BertWordPieceTokenizer

from pipefisher.data import (
    BATCH_KEYS,
    CLS_ID,
    MASK_ID,
    NVIDIA_DTYPES,
    SEP_ID,
    DataError,
    Hdf5Source,
    SyntheticSource,
    build_source,
    check_batch,
    get_micro_batch,
    micro_batch_indices,
)
from pipefisher.data.prepare import BERT_SPECIAL_TOKENS, load_tokenizer, main

S, P = 48, 8  # small phase-1-like shapes for the prepared corpus
WORDS = (
    "the a cat dog river mountain city music history science house garden people writer "
    "painter bridge castle village forest ocean runs jumps sings builds reads paints crosses "
    "visits green blue quiet ancient famous small large over under near beside"
).split()
PLAN = dict(micro_batch_size=4, num_micro_batches=2, dp_width=2)


def _write_corpus(path: Path, num_docs: int = 30, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(num_docs):
            for _ in range(rng.randint(1, 10)):
                words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
                f.write(" ".join(words).capitalize() + ".\n")
            f.write("\n")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards made the way a user makes them: through the command line entry point."""
    root = tmp_path_factory.mktemp("prepared")
    _write_corpus(root / "wiki.txt")
    out = root / "shards"
    argv = [
        "--input", str(root / "wiki.txt"), "--output-dir", str(out), "--vocab-size", "180",
        "--seq-len", str(S), "--max-predictions", str(P), "--dupe-factor", "3",
        "--num-shards", "3", "--seed", "7", "--no-progress",
    ]
    assert main(argv) == 0
    return out


def _doc_streams(corpus: Path, vocab: Path) -> list[str]:
    """Each document's token ids as one comma-joined string (for substring search)."""
    tok = BertWordPieceTokenizer(str(vocab), lowercase=True)
    docs, cur = [], []
    for line in corpus.read_text().splitlines() + [""]:
        if line.strip():
            cur.extend(tok.encode(line, add_special_tokens=False).ids)
        elif cur:
            docs.append("," + ",".join(map(str, cur)) + ",")
            cur = []
    return docs


# --- prepare -> hdf5 ----------------------------------------------------------------------------


def test_prepare_writes_nvidia_fields_dtypes_and_bert_special_ids(prepared: Path) -> None:
    shards = sorted(prepared.glob("*.hdf5"))
    assert len(shards) == 3
    total = 0
    for path in shards:
        with h5py.File(path, "r") as f:
            n = f["input_ids"].shape[0]
            total += n
            for key, dtype in NVIDIA_DTYPES.items():
                assert f[key].dtype == np.dtype(dtype), key
            assert f["input_ids"].shape == f["input_mask"].shape == f["segment_ids"].shape == (n, S)
            assert f["masked_lm_positions"].shape == f["masked_lm_ids"].shape == (n, P)
            assert f["next_sentence_labels"].shape == (n,)
    vocab = (prepared / "vocab.txt").read_text().splitlines()
    assert vocab[: len(BERT_SPECIAL_TOKENS)] == list(BERT_SPECIAL_TOKENS)
    assert (vocab[0], vocab[101], vocab[102], vocab[103]) == ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
    source = Hdf5Source(prepared, seed=0)  # vocab_size from the vocab.txt beside the shards
    assert len(source) == total and source.vocab_size == len(vocab)
    assert (source.seq_len, source.max_predictions) == (S, P)


def test_a_trained_vocabulary_is_the_same_on_every_training(tmp_path: Path) -> None:
    """[Note: a deterministic WordPiece vocabulary]: tokenizers' own trainer gives this text a different
    vocabulary (ids, and on tied merges tokens) nearly every time (10 of 10 trainings differed when written);
    ours gives one vocabulary, with BERT's special tokens first and every token a plain vocabulary entry."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrst") for _ in range(rng.randint(3, 8))) for _ in range(300)]
    text = tmp_path / "ties.txt"
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(200)) + "\n")

    def vocabulary() -> tuple[str, ...]:
        tok = load_tokenizer(None, [text], vocab_size=400)
        return tuple(t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]))

    trained = {vocabulary() for _ in range(8)}
    assert len(trained) == 1
    (vocab,) = trained
    assert vocab[: len(BERT_SPECIAL_TOKENS)] == BERT_SPECIAL_TOKENS
    assert len(vocab) == 400 and "##a" in vocab
    tok = load_tokenizer(None, [text], vocab_size=400)
    assert "##a" not in tok.encode("x ##a", add_special_tokens=False).tokens  # not an added special token


def test_prepared_instances_have_bert_layout_and_masks(prepared: Path) -> None:
    source = Hdf5Source(prepared, seed=0)
    b = {k: v.numpy() for k, v in source.get_samples(range(len(source))).items()}
    check_batch(source.get_samples(range(8)), seq_len=S, max_predictions=P,
                vocab_size=source.vocab_size)
    kinds = {"mask": 0, "kept": 0, "random": 0}
    for i in range(len(source)):
        ids, seg, mask = b["input_ids"][i], b["segment_ids"][i], b["input_mask"][i]
        n = int(mask.sum())
        assert (mask[:n] == 1).all() and (mask[n:] == 0).all()
        assert (ids[n:] == 0).all() and (seg[n:] == 0).all()
        sep_a = int((seg[:n] == 0).sum()) - 1  # [CLS] A [SEP] are segment 0, B [SEP] segment 1
        assert ids[0] == CLS_ID and ids[sep_a] == SEP_ID and ids[n - 1] == SEP_ID
        assert (seg[sep_a + 1 : n] == 1).all() and 1 <= sep_a < n - 2
        num = int((b["masked_lm_positions"][i] > 0).sum())
        assert num == min(P, max(1, round(n * 0.15)))
        pos, lm = b["masked_lm_positions"][i, :num], b["masked_lm_ids"][i]
        assert (np.diff(pos) > 0).all() and (b["masked_lm_positions"][i, num:] == 0).all()
        assert (lm[num:] == 0).all()
        assert not np.isin(pos, [0, sep_a, n - 1]).any(), "never mask [CLS]/[SEP]"
        for p, orig in zip(pos, lm[:num]):
            kind = "mask" if ids[p] == MASK_ID else "kept" if ids[p] == orig else "random"
            kinds[kind] += 1
    total = sum(kinds.values())
    assert 0.7 < kinds["mask"] / total < 0.9
    assert 0.03 < kinds["kept"] / total < 0.17 and 0.03 < kinds["random"] / total < 0.17
    assert 0.3 < b["next_sentence_labels"].mean() < 0.8


def test_prepared_tokens_round_trip_to_the_input_text(prepared: Path) -> None:
    """Unmasking gives back the input's tokens: A and B are runs of documents; for label 0 B
    follows A in A's document (directly, unless the pair was truncated to fit)."""
    docs = _doc_streams(prepared.parent / "wiki.txt", prepared / "vocab.txt")
    source = Hdf5Source(prepared, seed=0)
    b = {k: v.numpy() for k, v in source.get_samples(range(60)).items()}

    def run(tokens: np.ndarray) -> str:
        return "," + ",".join(map(str, tokens)) + ","

    for i in range(60):
        ids = b["input_ids"][i].copy()
        pos, lm = b["masked_lm_positions"][i], b["masked_lm_ids"][i]
        ids[pos[lm > 0]] = lm[lm > 0]
        n = int(b["input_mask"][i].sum())
        sep_a = int((b["segment_ids"][i, :n] == 0).sum()) - 1
        a, b_ = run(ids[1:sep_a]), run(ids[sep_a + 1 : n - 1])
        assert any(a in d for d in docs), f"sample {i}: A is not a run of any document"
        assert any(b_ in d for d in docs), f"sample {i}: B is not a run of any document"
        if b["next_sentence_labels"][i] == 0:
            if n < S:  # not truncated: B starts where A ends
                ab = run(np.concatenate([ids[1:sep_a], ids[sep_a + 1 : n - 1]]))
                assert any(ab in d for d in docs), f"sample {i}: B does not continue A"
            else:
                assert any(a in d and b_ in d[d.index(a) :] for d in docs), f"sample {i}"


def test_prepare_is_seeded(tmp_path: Path, prepared: Path) -> None:
    args = ["--input", str(prepared.parent / "wiki.txt"), "--vocab", str(prepared / "vocab.txt"),
            "--seq-len", str(S), "--max-predictions", str(P), "--dupe-factor", "1",
            "--no-progress", "--compression", "none"]
    outs = []
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        assert main([*args, "--output-dir", str(tmp_path / name), "--seed", seed]) == 0
        with h5py.File(next((tmp_path / name).glob("*.hdf5")), "r") as f:
            outs.append(f["input_ids"][()])
    assert np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])


def test_prepare_cli_reports_bad_input_and_existing_shards(tmp_path: Path,
                                                           prepared: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    assert main(["--input", str(tmp_path / "nope.txt"), "--output-dir", str(tmp_path)]) == 2
    assert "nope.txt" in capsys.readouterr().err
    args = ["--input", str(prepared.parent / "wiki.txt"), "--output-dir", str(prepared)]
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err


# --- the shared batch plan ----------------------------------------------------------------------


def test_micro_batch_indices_follow_the_plan_and_never_overlap() -> None:
    assert micro_batch_indices(0, 0, 0, **PLAN) == [0, 1, 2, 3]
    # base = ((step * dp_width + dp_rank) * num_micro_batches + micro_batch) * micro_batch_size
    assert micro_batch_indices(3, 1, 1, **PLAN)[0] == ((3 * 2 + 1) * 2 + 1) * 4
    seen = [i for step in range(3) for r in range(2) for m in range(2)
            for i in micro_batch_indices(step, m, r, **PLAN)]
    assert sorted(seen) == list(range(3 * 2 * 2 * 4))
    for bad in (dict(step=-1), dict(micro_batch=2), dict(dp_rank=2)):
        coords = dict(step=0, micro_batch=0, dp_rank=0) | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            micro_batch_indices(**coords, **PLAN)


@pytest.mark.parametrize("kind", ["synthetic", "hdf5"])
def test_two_stages_building_their_own_source_get_identical_micro_batches(
    kind: str, prepared: Path
) -> None:
    def build() -> object:  # as pipefisher.run_spec.data_source builds it: num_samples for either kind
        extra = {} if kind == "synthetic" else {"cache_shards": 1}
        return build_source(kind, path=str(prepared), seq_len=S, max_predictions=P,
                            vocab_size=180, seed=3, num_samples=50, **extra)

    first, last = build(), build()
    get_micro_batch(last, 5, 1, 0, **PLAN)  # different history: caches must not matter
    for step, mb, rank in ((0, 0, 0), (2, 1, 1), (7, 0, 1)):
        x = get_micro_batch(first, step, mb, rank, **PLAN)
        y = get_micro_batch(last, step, mb, rank, **PLAN)
        assert list(x) == list(BATCH_KEYS)
        for k in BATCH_KEYS:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)
        check_batch(x, seq_len=S, max_predictions=P, vocab_size=180)
    a = get_micro_batch(first, 0, 0, 0, **PLAN)["input_ids"]
    assert not torch.equal(a, get_micro_batch(first, 1, 0, 0, **PLAN)["input_ids"])
    assert not torch.equal(a, get_micro_batch(first, 0, 1, 0, **PLAN)["input_ids"])
    assert not torch.equal(a, get_micro_batch(first, 0, 0, 1, **PLAN)["input_ids"])
    other_seed = build_source(kind, path=str(prepared), seq_len=S, max_predictions=P,
                              vocab_size=180, seed=4)
    assert not torch.equal(a, get_micro_batch(other_seed, 0, 0, 0, **PLAN)["input_ids"])


def test_hdf5_epochs_visit_every_sample_once_in_a_new_order(prepared: Path) -> None:
    source = Hdf5Source(prepared, seed=0, cache_shards=1)
    n = len(source)
    where = [tuple(zip(*(a.tolist() for a in source.locate(range(e * n, (e + 1) * n)))))
             for e in range(2)]
    everything = {(s, r) for s, size in enumerate(source.shard_sizes) for r in range(size)}
    assert set(where[0]) == set(where[1]) == everything and len(set(where[0])) == n
    assert where[0] != where[1]
    # A sample index past the end wraps: same sample as its location says, in a later epoch.
    shard, row = source.locate([n + 5])
    with h5py.File(source.shards[int(shard[0])], "r") as f:
        expected = f["input_ids"][int(row[0])]
    assert np.array_equal(source.get_samples([n + 5])["input_ids"][0].numpy(), expected)


def test_synthetic_epochs_reorder_a_fixed_set_of_samples() -> None:
    source = SyntheticSource(16, 3, 200, seed=1, num_samples=10)
    rows = [[tuple(r) for r in source.get_samples(range(e * 10, e * 10 + 10))["input_ids"]
             .tolist()] for e in range(2)]
    assert sorted(rows[0]) == sorted(rows[1]) and rows[0] != rows[1]


# --- synthetic data -----------------------------------------------------------------------------


def test_synthetic_batches_follow_the_contract_and_bert_masking() -> None:
    seq, preds, vocab = 64, 10, 1000
    source = SyntheticSource(seq, preds, vocab, seed=0)
    b = source.get_samples(range(256))
    check_batch(b, seq_len=seq, max_predictions=preds, vocab_size=vocab)
    ids, seg, mask = b["input_ids"], b["segment_ids"], b["input_mask"]
    n = mask.sum(1)
    assert (ids[:, 0] == CLS_ID).all()
    assert (ids[torch.arange(256), n - 1] == SEP_ID).all()
    assert (n < seq).any() and (n == seq).float().mean() > 0.8, "~10% short sequences"
    sep_a = (seg * mask == 0).sum(1) - (seq - n) - 1
    assert (ids[torch.arange(256), sep_a] == SEP_ID).all()
    assert ((mask == 0) <= (ids == 0)).all() and ((mask == 0) <= (seg == 0)).all()
    num = (b["masked_lm_positions"] > 0).sum(1)
    assert torch.equal(num, torch.clamp(torch.round(n * 0.15), 1, preds).long())
    rows = torch.arange(256)[:, None].expand(-1, preds)
    at = ids[rows, b["masked_lm_positions"]][b["masked_lm_positions"] > 0]
    orig = b["masked_lm_ids"][b["masked_lm_positions"] > 0]
    assert 0.7 < (at == MASK_ID).float().mean() < 0.9
    assert 0.05 < (at == orig).float().mean() < 0.2
    assert (orig > MASK_ID).all(), "only content tokens are masked"
    assert 0.4 < b["next_sentence_labels"].float().mean() < 0.6


def test_synthetic_samples_depend_only_on_seed_and_index() -> None:
    a = SyntheticSource(32, 5, 500, seed=9).get_samples([3, 17, 1_000_123])
    b = SyntheticSource(32, 5, 500, seed=9).get_samples([1_000_123, 3])
    torch.testing.assert_close(a["input_ids"][[2, 0]], b["input_ids"], rtol=0, atol=0)
    c = SyntheticSource(32, 5, 500, seed=10).get_samples([3])
    assert not torch.equal(a["input_ids"][0], c["input_ids"][0])
    empty = SyntheticSource(32, 5, 500, seed=9).get_samples([])
    assert empty["input_ids"].shape == (0, 32) and empty["masked_lm_ids"].shape == (0, 5)


def test_synthetic_rejects_a_vocabulary_too_small_for_its_tokens() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        SyntheticSource(32, 5, 110, seed=0)


def test_build_source_rejects_unknown_kind_and_mismatched_shapes(prepared: Path) -> None:
    with pytest.raises(ValueError, match="'synthetic', 'hdf5'"):
        build_source("wiki", path=None, seq_len=S, max_predictions=P, vocab_size=180, seed=0)
    with pytest.raises(DataError, match="data.path"):
        build_source("hdf5", path=None, seq_len=S, max_predictions=P, vocab_size=180, seed=0)
    with pytest.raises(DataError, match=r"seq_len=48 \(width of 'input_ids'\).*seq_len=128"):
        build_source("hdf5", path=str(prepared), seq_len=128, max_predictions=P,
                     vocab_size=180, seed=0)


# --- bad data -----------------------------------------------------------------------------------


def _good(n: int = 4, seq: int = 8, preds: int = 2) -> dict[str, np.ndarray]:
    ids = np.full((n, seq), 5, dtype=np.int32)
    ids[:, 0], ids[:, -1] = CLS_ID, SEP_ID
    return {
        "input_ids": ids,
        "input_mask": np.ones((n, seq), np.int8),
        "segment_ids": np.zeros((n, seq), np.int8),
        "masked_lm_positions": np.tile(np.arange(1, preds + 1, dtype=np.int32), (n, 1)),
        "masked_lm_ids": np.full((n, preds), 5, np.int32),
        "next_sentence_labels": np.zeros(n, np.int8),
    }


def _write(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f.create_dataset(k, data=v)
    return path


def _without(key: str) -> dict[str, np.ndarray]:
    arrays = _good()
    del arrays[key]
    return arrays


def _with(key: str, value: np.ndarray) -> dict[str, np.ndarray]:
    return _good() | {key: value}


def _bad_value(key: str, where: tuple, value: int) -> dict[str, np.ndarray]:
    arrays = _good()
    arrays[key][where] = value
    return arrays


BAD_SHARDS = {
    "missing_dataset": (_without("segment_ids"), "segment_ids"),
    "float_dtype": (_with("input_mask", np.ones((4, 8), np.float32)), "input_mask"),
    "wrong_rank": (_with("masked_lm_ids", np.zeros(4, np.int32)), "masked_lm_ids"),
    "inconsistent_n": (_with("next_sentence_labels", np.zeros(3, np.int8)),
                       "next_sentence_labels"),
    "p_mismatch_within_file": (_with("masked_lm_ids", np.zeros((4, 3), np.int32)),
                               "masked_lm_ids"),
}
BAD_VALUES = {
    "token_id_too_large": (_bad_value("input_ids", (2, 3), 1000), "input_ids"),
    "negative_label_id": (_bad_value("masked_lm_ids", (1, 0), -1), "masked_lm_ids"),
    "position_past_seq_len": (_bad_value("masked_lm_positions", (3, 1), 8),
                              "masked_lm_positions"),
    "segment_not_0_or_1": (_bad_value("segment_ids", (0, 2), 2), "segment_ids"),
}


@pytest.mark.parametrize("case", sorted(BAD_SHARDS))
def test_malformed_shard_is_rejected_when_opened_naming_file_and_field(
    case: str, tmp_path: Path
) -> None:
    arrays, field = BAD_SHARDS[case]
    path = _write(tmp_path / "d" / "bad_shard.hdf5", arrays)
    with pytest.raises(DataError, match=f"bad_shard.hdf5.*'{field}'"):
        Hdf5Source(path.parent, seed=0, vocab_size=100)


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_out_of_range_values_are_rejected_when_loaded_naming_file_and_field(
    case: str, tmp_path: Path
) -> None:
    arrays, field = BAD_VALUES[case]
    path = _write(tmp_path / "bad_values.h5", arrays)
    source = Hdf5Source(path, seed=0, vocab_size=200)  # metadata is fine
    with pytest.raises(DataError, match=f"bad_values.h5: field '{field}'.*prepare"):
        source.get_samples([0])


def test_token_id_error_says_how_large_the_vocabulary_must_be(tmp_path: Path) -> None:
    path = _write(tmp_path / "big_vocab.hdf5", _bad_value("input_ids", (2, 3), 30000))
    with pytest.raises(DataError, match="vocab_size to at least 30001"):
        Hdf5Source(path, seed=0, vocab_size=200).check_all()


def test_shards_with_different_widths_are_rejected(tmp_path: Path) -> None:
    _write(tmp_path / "s" / "a.hdf5", _good())
    _write(tmp_path / "s" / "b.hdf5", _good(seq=16))
    with pytest.raises(DataError, match="b.hdf5: seq_len=16 \\(width of input_ids\\).*a.hdf5"):
        Hdf5Source(tmp_path / "s", seed=0)
    _write(tmp_path / "p" / "a.hdf5", _good())
    _write(tmp_path / "p" / "b.hdf5", _good(preds=3))
    with pytest.raises(DataError, match="b.hdf5: max_predictions=3 .*masked_lm_positions"):
        Hdf5Source(tmp_path / "p", seed=0)


def test_missing_path_empty_directory_and_non_hdf5_file_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere.*no such file"):
        Hdf5Source(tmp_path / "nowhere", seed=0)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no shards here")
    with pytest.raises(DataError, match="empty: directory holds no shards"):
        Hdf5Source(tmp_path / "empty", seed=0)
    (tmp_path / "junk.hdf5").write_text("not hdf5")
    with pytest.raises(DataError, match="junk.hdf5: not a readable HDF5 file"):
        Hdf5Source(tmp_path / "junk.hdf5", seed=0)


def test_unsigned_and_wider_integer_dtypes_are_accepted(tmp_path: Path) -> None:
    arrays = {k: v.astype(np.int64 if k.startswith("masked") else np.uint16)
              for k, v in _good().items()}
    source = Hdf5Source(_write(tmp_path / "wide.hdf5", arrays), seed=0, vocab_size=200)
    batch = source.get_samples(range(6))  # wraps past N=4
    check_batch(batch, seq_len=8, max_predictions=2, vocab_size=200)


def test_truncated_shard_is_rejected_naming_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "d" / "cut.hdf5", _good())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy or a download cut short
    with pytest.raises(DataError, match=r"cut.hdf5: not a readable HDF5 file \(.*truncated.*prepare the data again"):
        Hdf5Source(path.parent, seed=0, vocab_size=100)


def test_a_model_vocabulary_larger_than_the_shards_is_reported(prepared: Path, caplog) -> None:
    """Issue 16 item 7: model.vocab_size=30522 on shards prepared with a smaller WordPiece
    vocabulary trains rows nothing ever uses; the log says so and names the size to set."""
    used = len((prepared / "vocab.txt").read_text().splitlines())
    with caplog.at_level(logging.WARNING, logger="pipefisher.data.hdf5"):
        Hdf5Source(prepared, seed=0, vocab_size=used + 1000)
    assert f"set model.vocab_size={used}" in caplog.text and "1000 rows" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pipefisher.data.hdf5"):
        Hdf5Source(prepared, seed=0, vocab_size=used)
    assert "never used" not in caplog.text
