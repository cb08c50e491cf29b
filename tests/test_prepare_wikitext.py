"""Raw WikiText in the data preparation (pipefisher.data.prepare): articles become documents of sentences."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipefisher.data.prepare import PrepareConfig, prepare, resolve_input_format, wikitext_sentences

# --- raw WikiText -> one sentence per line (pipefisher.data.prepare) -------------------------------

WIKITEXT = """
 = Homarus gammarus =

 Homarus gammarus is a species of <unk> lobster . It grows to 60 cm ( 24 in ) and 3 @.@ 1 kg . H. gammarus is blue ?

 = = Description = =

 The claws are red @-@ tipped , about 1 @,@ 000 of them .

 = = = Life = = =

 Males mature at a smaller size .
 = Second article =
 It has one sentence !
"""


def test_raw_wikitext_becomes_sentences_with_a_boundary_per_article() -> None:
    assert list(wikitext_sentences(WIKITEXT.splitlines(keepends=True))) == [
        None,
        "Homarus gammarus is a species of [UNK] lobster .",
        "It grows to 60 cm ( 24 in ) and 3.1 kg .",
        "H. gammarus is blue ?",
        "The claws are red-tipped , about 1,000 of them .",
        "Males mature at a smaller size .",
        None,
        "It has one sentence !",
    ]


def test_input_format_auto_detects_wikitext_by_its_title_line(tmp_path: Path) -> None:
    (tmp_path / "wiki.txt").write_text(WIKITEXT)
    (tmp_path / "sentences.txt").write_text("A first sentence .\nAnother one .\n\nA new document .\n")
    assert resolve_input_format(tmp_path / "wiki.txt") == "wikitext"
    assert resolve_input_format(tmp_path / "sentences.txt") == "sentences"
    assert resolve_input_format(tmp_path / "wiki.txt", "sentences") == "sentences"
    with pytest.raises(ValueError, match="input_format"):
        PrepareConfig(input_format="xml")


def test_prepare_reads_raw_wikitext_as_articles_of_sentences(tmp_path: Path) -> None:
    (tmp_path / "wiki.txt").write_text(WIKITEXT * 3)
    cfg = PrepareConfig(seq_len=32, max_predictions=4, dupe_factor=1, vocab_size=200)
    result = prepare([tmp_path / "wiki.txt"], tmp_path / "out", cfg, progress=False)
    assert result.num_documents == 6  # two articles, three times; headings dropped
    vocab = (tmp_path / "out" / "vocab.txt").read_text().split()
    assert "@" not in vocab and "description" not in vocab and "unk" not in vocab
    assert '"wikitext"' in (tmp_path / "out" / "prepare.json").read_text()
