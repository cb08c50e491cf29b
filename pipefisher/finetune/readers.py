"""Readers of fine-tuning data: GLUE-format TSV (classification) and SQuAD-format JSON (spans).

Both check every field they use and stop at the first bad one with a :class:`FinetuneDataError`
naming the file, the line and the field, so a broken download fails before training starts.

[Note: GLUE TSV] The GLUE files are tab-separated without quoting (a ``"`` is an ordinary
character), as the reference ``run_classifier.py`` reads them (``csv.QUOTE_NONE``). Columns are
chosen by header name or by 0-based index (CoLA's files have no header: label column 1,
sentence column 3). MNLI's dev sets come as two files (matched, mismatched): each is one split.

[Note: JSON line numbers] JSON has no lines of its own, so a SQuAD file is parsed once with the
fast C parser; only when a field check fails is it parsed again with the pure-Python scanner,
recording where each object starts, to name the line of the offending object.
"""

from __future__ import annotations

import csv
import json
import json.decoder
import json.scanner
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipefisher.data.batches import DataError

__all__ = [
    "ClassificationExample",
    "FinetuneDataError",
    "SpanExample",
    "read_glue_tsv",
    "read_squad_json",
]

log = logging.getLogger(__name__)


class FinetuneDataError(DataError):
    """A fine-tuning data file that cannot be used; the message names file, line and field."""


@dataclass(frozen=True)
class ClassificationExample:
    """One sentence (``text_b`` is None) or sentence pair with its class index."""

    guid: str  # "<file name>:<line>"
    text_a: str
    text_b: str | None
    label: int


@dataclass(frozen=True)
class SpanExample:
    """One SQuAD question. Answers are the gold texts (several in dev sets); empty when impossible."""

    qid: str
    question: str
    context: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]  # character offsets into ``context``, one per answer
    is_impossible: bool = False


# --------------------------------------------------------------------------------------------
# GLUE TSV
# --------------------------------------------------------------------------------------------


def _column_index(path: Path, header: list[str] | None, column: str, role: str) -> int:
    """0-based index of ``column`` (a header name, or a 0-based index as digits)."""
    if header is not None and column in header:
        return header.index(column)
    if str(column).isdigit():
        return int(column)
    names = ", ".join(header or [])
    raise FinetuneDataError(
        f"{path}:1: {role} '{column}' is not a column of the header ({names}); "
        f"name one of those or give a 0-based index"
    )


def read_glue_tsv(
    path: str | Path,
    text_columns: Sequence[str],
    label_column: str,
    labels: Sequence[str],
    *,
    has_header: bool = True,
    max_examples: int | None = None,
) -> list[ClassificationExample]:
    """Read a GLUE-format TSV file.

    Args:
        path: the ``.tsv`` file.
        text_columns: one (single sentence) or two (pair) columns, by header name or 0-based index.
        label_column: the label's column, by header name or 0-based index.
        labels: the label strings; a row's class is the index of its label here.
        has_header: the first line holds column names (skipped as data).
        max_examples: stop after this many examples (None: all).

    Returns:
        The examples in file order.

    Raises:
        FinetuneDataError: ``path:line: field 'name' (column i) ...`` for a missing file, a row
            too short for a column, or a label outside ``labels``.
    """
    path = Path(path)
    if not path.is_file():
        raise FinetuneDataError(f"{path}: no such file (task.data_dir / task.train_file / task.dev_files)")
    label_ids = {label: i for i, label in enumerate(labels)}
    examples: list[ClassificationExample] = []
    with path.open(encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header: list[str] | None = None
        if has_header:
            header = next(rows, None)
            if header is None:
                raise FinetuneDataError(f"{path}:1: the file is empty; expected a header line")
            header = [h.strip() for h in header]
        fields = [(c, _column_index(path, header, c, "text column")) for c in text_columns]
        fields.append((label_column, _column_index(path, header, label_column, "label column")))
        for row in rows:
            line = rows.line_num
            if not row or all(not cell.strip() for cell in row):
                continue  # blank line
            values = []
            for name, index in fields:
                if index >= len(row):
                    raise FinetuneDataError(
                        f"{path}:{line}: field '{name}' (column {index}) is missing: the line has "
                        f"{len(row)} tab-separated field(s); check the delimiter and task.text_columns/label_column"
                    )
                values.append(row[index])
            label_text = values[-1].strip()
            if label_text not in label_ids:
                raise FinetuneDataError(
                    f"{path}:{line}: field '{label_column}' (column {fields[-1][1]}) has label "
                    f"{label_text!r}, not one of {list(labels)} (task.labels)"
                )
            examples.append(ClassificationExample(
                guid=f"{path.name}:{line}",
                text_a=values[0],
                text_b=values[1] if len(text_columns) == 2 else None,
                label=label_ids[label_text],
            ))
            if max_examples is not None and len(examples) >= max_examples:
                break
    if not examples:
        raise FinetuneDataError(f"{path}: no examples (only a header or blank lines)")
    return examples


# --------------------------------------------------------------------------------------------
# SQuAD JSON
# --------------------------------------------------------------------------------------------


class _Located(dict):
    """A JSON object that remembers the character offset where it starts."""

    offset: int = -1


def _locating_loads(text: str) -> Any:
    """``json.loads`` with the pure-Python scanner, tagging each object with its start offset."""
    decoder = json.JSONDecoder()

    def parse_object(s_and_end: tuple[str, int], *args: Any) -> tuple[dict, int]:
        start = s_and_end[1] - 1
        obj, end = json.decoder.JSONObject(s_and_end, *args)
        located = _Located(obj)
        located.offset = start
        return located, end

    decoder.parse_object = parse_object  # type: ignore[assignment]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder.decode(text)


def _field(obj: Any, key: str, kind: type | tuple[type, ...], where: str, fail: Callable[[Any, str], None]) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        fail(obj, f"field '{key}' is missing ({where})")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        fail(obj, f"field '{key}' must be {names}, got {type(value).__name__} ({where})")
    return value


def _squad_examples(
    data: Any, path: Path, fail: Callable[[Any, str], None], version_2_with_negative: bool, training: bool,
    max_examples: int | None,
) -> list[SpanExample]:
    examples: list[SpanExample] = []
    articles = _field(data, "data", list, "top level", fail)
    for a, article in enumerate(articles):
        paragraphs = _field(article, "paragraphs", list, f"article {a}", fail)
        for p, paragraph in enumerate(paragraphs):
            where = f"article {a}, paragraph {p}"
            context = _field(paragraph, "context", str, where, fail)
            for q, qa in enumerate(_field(paragraph, "qas", list, where, fail)):
                where_q = f"{where}, question {q}"
                qid = str(_field(qa, "id", (str, int), where_q, fail))
                question = _field(qa, "question", str, where_q, fail)
                impossible = bool(version_2_with_negative and qa.get("is_impossible", False))
                if version_2_with_negative and "is_impossible" in qa and not isinstance(qa["is_impossible"], bool):
                    fail(qa, f"field 'is_impossible' must be true or false ({where_q})")
                raw_answers = _field(qa, "answers", list, where_q, fail)
                texts: list[str] = []
                starts: list[int] = []
                if not impossible:
                    for k, answer in enumerate(raw_answers):
                        where_a = f"{where_q}, answer {k}"
                        text = _field(answer, "text", str, where_a, fail)
                        start = _field(answer, "answer_start", int, where_a, fail)
                        if not 0 <= start <= len(context) - len(text):
                            fail(answer, f"field 'answer_start'={start} lies outside the context of "
                                         f"{len(context)} characters ({where_a})")
                        texts.append(text)
                        starts.append(start)
                    if not texts:
                        fail(qa, f"field 'answers' is empty but the question is not marked is_impossible "
                                 f"({where_q}); for SQuAD v2.0 set task.version_2_with_negative=true")
                if training and texts and context[starts[0]:starts[0] + len(texts[0])] != texts[0]:
                    # The reference skips these too (run_squad.py: "Could not find answer").
                    log.warning("%s: question %s: answer %r is not at its answer_start; skipped", path, qid, texts[0])
                    continue
                examples.append(SpanExample(qid, question, context, tuple(texts), tuple(starts), impossible))
                if max_examples is not None and len(examples) >= max_examples:
                    return examples
    return examples


def read_squad_json(
    path: str | Path,
    *,
    version_2_with_negative: bool = False,
    training: bool = False,
    max_examples: int | None = None,
) -> list[SpanExample]:
    """Read a SQuAD v1.1 (or v2.0) JSON file.

    Args:
        path: the ``.json`` file: ``{"data": [{"paragraphs": [{"context", "qas": [{"id",
            "question", "answers": [{"text", "answer_start"}], "is_impossible"?}]}]}]}``.
        version_2_with_negative: honour ``is_impossible`` (SQuAD v2.0); otherwise every
            question must have an answer.
        training: skip (with a warning) questions whose first answer is not found at its
            ``answer_start``, as the reference does.
        max_examples: stop after this many questions (None: all).

    Returns:
        One example per question, in file order.

    Raises:
        FinetuneDataError: ``path:line: field 'name' ...`` for invalid JSON, a missing or
            mistyped field, or an answer offset outside its context.
    """
    path = Path(path)
    if not path.is_file():
        raise FinetuneDataError(f"{path}: no such file (task.data_dir / task.train_file / task.dev_files)")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise FinetuneDataError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None

    def fail_fast(obj: Any, message: str) -> None:
        raise _FieldProblem(message)

    try:
        examples = _squad_examples(data, path, fail_fast, version_2_with_negative, training, max_examples)
    except _FieldProblem:
        # Parse again, slowly, keeping object offsets, to name the line (see [Note: JSON line numbers]).
        located = _locating_loads(text)

        def fail_located(obj: Any, message: str) -> None:
            offset = getattr(obj, "offset", -1)
            line = text.count("\n", 0, offset) + 1 if offset >= 0 else 1
            raise FinetuneDataError(f"{path}:{line}: {message}")

        _squad_examples(located, path, fail_located, version_2_with_negative, training, max_examples)
        raise AssertionError("the located parse must fail where the fast one did")  # pragma: no cover
    if not examples:
        raise FinetuneDataError(f"{path}: no questions found under data[*].paragraphs[*].qas")
    return examples


class _FieldProblem(Exception):
    """Internal: a field check failed in the fast parse."""
