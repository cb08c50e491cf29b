"""Fine-tuning: toy tasks learn, EM/F1 match hand-computed values, checkpoints (ours, per stage, and
Hugging Face) load into the encoder, bad files are reported by file/line/field, finetune.py runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipefisher.config import ConfigError
from pipefisher.finetune import (
    FinetuneConfig,
    FinetuneDataError,
    SpanExample,
    decode_spans,
    encode_spans,
    exact_match_score,
    f1_score,
    finetune,
    normalize_answer,
    read_glue_tsv,
    read_squad_json,
    register_finetune_configs,
    squad_scores,
    to_finetune_config,
)
from pipefisher.finetune.encoding import _windows
from pipefisher.finetune.toy import toy_words, write_toy_vocab
from pipefisher.model import BertConfig, BertStage, merge_stage_state_dicts
from pipefisher.tracking import read_metrics
from pipefisher.runtime.checkpoint import write_manifest, write_shard
from tests.conftest import CONF_DIR, REPO, compose_train

QUIET = ["wandb.mode=disabled", "progress=false", "device=cpu", "save_model=false"]
# A smaller encoder than bert-tiny where the test is about plumbing, not learning.
NARROW = ["model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64"]


def compose_finetune(overrides: list[str]) -> FinetuneConfig:
    """The validated config of finetune.py with ``overrides`` (after the quiet CPU defaults)."""
    register_finetune_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_finetune_config(compose(config_name="finetune", overrides=QUIET + overrides))


# --------------------------------------------------------------------------------------------
# Learning on the toy tasks
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task, steps",
    [("toy", 100), ("toy_pair", 150)],
    ids=["single_sentence_keyword", "sentence_pair_both_keyword"],
)
@pytest.mark.slow
def test_toy_classification_reaches_high_accuracy(tmp_path: Path, task: str, steps: int) -> None:
    cfg = compose_finetune([f"task={task}", f"steps={steps}", "eval_every=50", "task.toy.num_train=2000",
                            "task.toy.num_dev=300"])
    result = finetune(cfg, tmp_path)
    curve = [(r["step"], r["split"], round(r["accuracy"], 3)) for r in result.evals]
    print(f"\n{task} (bert-tiny, random init, AdamW lr {cfg.lr}, batch {cfg.batch_size}): {curve}; "
          f"train {result.train['samples_per_s']:.0f} samples/s")
    assert set(result.final) == {"matched", "mismatched"}
    for split, record in result.final.items():
        assert record["accuracy"] >= 0.9, (split, curve)
    records = read_metrics(tmp_path)
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == len(result.evals) and {"samples_per_s", "sequences_per_s", "eval_time_s"} <= set(evals[0])
    assert sum(r["kind"] == "train" for r in records) == steps


@pytest.mark.slow
def test_toy_squad_runs_end_to_end_with_strided_windows(tmp_path: Path) -> None:
    cfg = compose_finetune(["task=toy_squad", "steps=40", "task.toy.num_train=300", "task.toy.num_dev=60",
                            *NARROW])
    result = finetune(cfg, tmp_path)
    final = result.final["dev"]
    print(f"\ntoy_squad after 40 steps: EM {final['exact_match']:.1f} F1 {final['f1']:.1f}, "
          f"{final['num_examples']} questions in {final['num_sequences']} windows")
    assert 0.0 <= final["exact_match"] <= final["f1"] <= 100.0
    assert final["num_sequences"] > final["num_examples"]  # long contexts take several windows
    predictions = json.loads((tmp_path / "predictions_dev.json").read_text())
    assert len(predictions) == 60


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def test_squad_normalization_drops_case_punctuation_articles_and_extra_space() -> None:
    assert normalize_answer("  The  Cat, sat!  ") == "cat sat"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Anne's banana") == "annes banana"  # articles only as whole words
    assert exact_match_score("the Eiffel Tower.", "Eiffel  tower") == 1.0
    assert exact_match_score("Eiffel", "Eiffel Tower") == 0.0


def test_f1_matches_hand_computed_values() -> None:
    assert f1_score("a red car", "the blue car") == pytest.approx(0.5)  # 1 of 2 tokens each side
    assert f1_score("car car", "car") == pytest.approx(2 / 3)  # p = 1/2, r = 1
    assert f1_score("in 1990", "1990") == pytest.approx(2 / 3)
    assert f1_score("Denver", "Broncos") == 0.0
    assert f1_score("the", "") == 1.0  # both normalize to empty (SQuAD v2.0 rule)
    assert f1_score("", "Broncos") == 0.0


def test_squad_scores_take_the_best_gold_answer_and_count_missing_predictions() -> None:
    gold = {
        "q1": ["Denver Broncos", "The Broncos"],
        "q2": ["Denver Broncos", "the Broncos"],
        "q3": ["1990", "the year 1990"],
        "q4": ["Santa Clara"],
    }
    predictions = {"q1": "Denver Broncos", "q2": "broncos!", "q3": "in 1990"}  # q4 missing
    scores = squad_scores(predictions, gold)
    assert scores["exact_match"] == pytest.approx(100 * 2 / 4)
    assert scores["f1"] == pytest.approx(100 * (1 + 1 + 2 / 3 + 0) / 4)  # q3: max(2/3, 1/2)
    assert scores["num_missing"] == 1
    v2 = squad_scores({"a": "", "b": "x"}, {"a": [], "b": []})  # unanswerable questions
    assert (v2["exact_match"], v2["f1"]) == (50.0, 50.0)


# --------------------------------------------------------------------------------------------
# Windows over long contexts
# --------------------------------------------------------------------------------------------


def test_windows_cover_the_context_with_the_stride() -> None:
    assert _windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert _windows(3, 4, 2) == [(0, 3)]
    assert _windows(0, 4, 2) == [(0, 0)]
    for n, room, stride in [(37, 8, 3), (50, 10, 10), (11, 5, 1)]:
        spans = _windows(n, room, stride)
        covered = {i for s, length in spans for i in range(s, s + length)}
        assert covered == set(range(n)) and spans[-1][0] + spans[-1][1] == n


def test_span_targets_and_decoding_recover_the_answer_across_windows(tmp_path: Path) -> None:
    from tokenizers import BertWordPieceTokenizer

    words = toy_words(30, seed=0)
    tokenizer = BertWordPieceTokenizer(str(write_toy_vocab(tmp_path / "vocab.txt", words)), lowercase=True)
    context = " ".join(words[:25]) + " ."
    answer = " ".join(words[17:19])
    example = SpanExample("q", f"what follows {words[16]} ?", context, (answer, answer.upper()),
                          (context.index(answer), context.index(answer)), False)
    feats = encode_spans([example], tokenizer, max_seq_len=16, max_query_len=5, doc_stride=4, training=True)
    assert len(feats) > 2  # 26 context tokens, 9 per window
    starts, ends = feats.tensors["start_positions"], feats.tensors["end_positions"]
    hits = [i for i in range(len(feats)) if starts[i] > 0]
    assert hits and all(starts[i] == ends[i] == 0 for i in range(len(feats)) if i not in hits)
    for i in hits:  # the target tokens spell the answer
        ids = feats.tensors["input_ids"][i, starts[i]:ends[i] + 1].tolist()
        assert tokenizer.decode(ids) == answer
    # Logits peaked on the answer in every window holding it decode to the answer's text. (Each
    # start token is scored only in its max-context window, so a peak elsewhere alone is ignored.)
    n, s = feats.tensors["input_ids"].shape
    start_logits, end_logits = torch.zeros(n, s), torch.zeros(n, s)
    for i in hits:
        start_logits[i, starts[i]], end_logits[i, ends[i]] = 5.0, 5.0
    mask = feats.tensors["input_mask"] == 0
    start_logits[mask] = end_logits[mask] = -1e4
    assert decode_spans([example], feats, start_logits, end_logits) == {"q": answer}
    # SQuAD v2.0: "" when the [CLS] score beats the best span by more than the threshold.
    start_logits[:, 0], end_logits[:, 0] = 6.0, 6.0  # null score 12 vs span score 10
    assert decode_spans([example], feats, start_logits, end_logits, version_2_with_negative=True) == {"q": ""}
    assert decode_spans([example], feats, start_logits, end_logits, version_2_with_negative=True,
                        null_score_diff_threshold=3.0) == {"q": answer}


# --------------------------------------------------------------------------------------------
# Readers: errors name file, line and field
# --------------------------------------------------------------------------------------------


def test_tsv_reader_reads_pairs_and_headerless_files(tmp_path: Path) -> None:
    pair = tmp_path / "dev_matched.tsv"
    pair.write_text('index\tsentence1\tsentence2\tgold_label\n0\tA "quoted" one\tB\tneutral\n1\tC\tD\tentailment\n')
    examples = read_glue_tsv(pair, ["sentence1", "sentence2"], "gold_label", ["contradiction", "entailment", "neutral"])
    assert [(e.text_a, e.text_b, e.label) for e in examples] == [('A "quoted" one', "B", 2), ("C", "D", 1)]
    cola = tmp_path / "cola.tsv"
    cola.write_text("gj04\t1\t\tThe sailors rode the breeze.\ngj04\t0\t*\tThe more books.\n")
    examples = read_glue_tsv(cola, ["3"], "1", ["0", "1"], has_header=False)
    assert [(e.text_a, e.label) for e in examples] == [("The sailors rode the breeze.", 1), ("The more books.", 0)]


def test_malformed_tsv_lines_name_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "train.tsv"
    path.write_text("sentence1\tsentence2\tlabel\nfine\tpair\t1\ntoo short\n")
    with pytest.raises(FinetuneDataError, match=rf"{path}:3: field 'sentence2' \(column 1\) is missing"):
        read_glue_tsv(path, ["sentence1", "sentence2"], "label", ["0", "1"])
    path.write_text("sentence\tlabel\nfine\t1\nbad\tmaybe\n")
    with pytest.raises(FinetuneDataError, match=rf"{path}:3: field 'label' .*'maybe'"):
        read_glue_tsv(path, ["sentence"], "label", ["0", "1"])
    with pytest.raises(FinetuneDataError, match=rf"{path}:1: text column 'premise' is not a column"):
        read_glue_tsv(path, ["premise"], "label", ["0", "1"])


def _squad_text(qas: list[dict], context: str = "Denver won in 1990.") -> str:
    data = {"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}
    return json.dumps(data, indent=2)


def test_squad_reader_reads_answers_and_v2_impossible_questions(tmp_path: Path) -> None:
    path = tmp_path / "dev.json"
    path.write_text(_squad_text([
        {"id": "a", "question": "Who?", "answers": [{"text": "Denver", "answer_start": 0},
                                                    {"text": "Denver", "answer_start": 0}]},
        {"id": "b", "question": "When?", "answers": [], "is_impossible": True},
    ]))
    examples = read_squad_json(path, version_2_with_negative=True)
    assert examples[0].answers == ("Denver", "Denver") and not examples[0].is_impossible
    assert examples[1].answers == () and examples[1].is_impossible
    with pytest.raises(FinetuneDataError, match="field 'answers' is empty.*version_2_with_negative"):
        read_squad_json(path)  # v1.1: every question needs an answer


def test_malformed_squad_json_names_file_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    text = _squad_text([
        {"id": "ok", "question": "Who?", "answers": [{"text": "Denver", "answer_start": 0}]},
        {"id": "broken", "answers": [{"text": "1990", "answer_start": 14}]},
    ])
    path.write_text(text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if '"broken"' in s) - 1  # the object's "{"
    with pytest.raises(FinetuneDataError, match=rf"{path}:{line}: field 'question' is missing \(article 0, paragraph 0, question 1\)"):
        read_squad_json(path)
    path.write_text(_squad_text([{"id": "x", "question": "Q", "answers": [{"text": "1990", "answer_start": "14"}]}]))
    with pytest.raises(FinetuneDataError, match=rf"{path}:\d+: field 'answer_start' must be int, got str"):
        read_squad_json(path)
    path.write_text('{"data": [\n  {"paragraphs": [}\n]}')
    with pytest.raises(FinetuneDataError, match=rf"{path}:2:\d+: not valid JSON"):
        read_squad_json(path)


@pytest.mark.parametrize("task", ["mnli", "squad_v1"])
def test_glue_and_squad_files_from_data_dir_run_with_a_given_vocab(tmp_path: Path, task: str) -> None:
    vocab = write_toy_vocab(tmp_path / "vocab.txt", ["denver", "won", "in", "lost", "who", "when", "1990"])
    data = tmp_path / task
    data.mkdir()
    if task == "mnli":
        rows = ["index\tsentence1\tsentence2\tgold_label"]
        rows += [f"{i}\tDenver won in 1990.\tWho lost?\t{['neutral', 'entailment', 'contradiction'][i % 3]}"
                 for i in range(12)]
        for name in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
            (data / name).write_text("\n".join(rows) + "\n")
    else:
        qas = [{"id": f"q{i}", "question": "When?", "answers": [{"text": "1990", "answer_start": 14}]} for i in range(6)]
        for name in ("train-v1.1.json", "dev-v1.1.json"):
            (data / name).write_text(_squad_text(qas))
    cfg = compose_finetune([f"task={task}", f"task.data_dir={data}", f"vocab={vocab}", "steps=2", "batch_size=4",
                            "task.max_seq_len=32", "task.max_query_len=8", "task.doc_stride=8", *NARROW])
    result = finetune(cfg, tmp_path / "run")
    assert set(result.final) == ({"matched", "mismatched"} if task == "mnli" else {"dev"})
    assert result.model.config.vocab_size == 104 + 7 + 7  # specials, function words, the words given


# --------------------------------------------------------------------------------------------
# Initial weights
# --------------------------------------------------------------------------------------------


def _tiny_bert(vocab_size: int) -> BertConfig:
    return BertConfig(vocab_size=vocab_size, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)


def test_finetuning_from_per_stage_checkpoints_loads_the_saved_encoder(tmp_path: Path) -> None:
    config = _tiny_bert(vocab_size=200)  # more rows than the toy vocabulary: taken from the checkpoint
    # A 2-stage pipeline's stages: embeddings + encoder layer 0 | encoder layer 1 + heads.
    stages = [BertStage(config, 0, 1, seed=7), BertStage(config, 2, 3, seed=7)]
    with torch.no_grad():  # as after pretraining: weights differ from any seed's init
        for stage in stages:
            for p in stage.parameters():
                p.add_(0.01 * torch.randn_like(p))
        stages[1].cls.predictions.decoder.weight.copy_(stages[0].bert.embeddings.word_embeddings.weight)
    files = []
    for i, stage in enumerate(stages):
        files.append(tmp_path / f"stage{i}.pt")
        torch.save(stage.state_dict(), files[-1])
    saved = merge_stage_state_dicts([s.state_dict() for s in stages])
    merged_file = tmp_path / "merged.pt"
    torch.save(saved, merged_file)

    # A pretraining checkpoint folder: Chimera-like worker shards, each with a replica of both pipes,
    # and the manifest that marks it complete.
    shards = tmp_path / "checkpoints" / "step_3"
    shards.mkdir(parents=True)
    sd0, sd1 = stages[0].state_dict(), stages[1].state_dict()
    infos = [write_shard(shards, 0, {"step": 3, "modules": {"0.0": sd0, "1.1": sd1}}),
             write_shard(shards, 1, {"step": 3, "modules": {"0.1": sd1, "1.0": sd0}})]
    pretraining = compose_train(["pipeline=chimera", "stages=2", "model.vocab_size=200", *NARROW], tiny=False)
    write_manifest(shards, 3, pretraining, 2, infos)
    shard_files = [str(shards / "worker_0.pt"), str(shards / "worker_1.pt")]

    for checkpoint in ([str(f) for f in files], [str(merged_file)], [str(shards)], shard_files):
        listed = ",".join(checkpoint)
        cfg = compose_finetune(["task=toy", "steps=3", "task.toy.num_train=64", "task.toy.num_dev=32", *NARROW,
                                f"init.checkpoint=[{listed}]"])
        result = finetune(cfg, tmp_path / f"run_{Path(checkpoint[-1]).stem}")
        assert result.random_init == []
        assert result.model.config.vocab_size == 200
        loaded = result.init_encoder
        assert set(loaded) == {k for k in saved if k.startswith("bert.")}
        for name, tensor in loaded.items():
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
        trained = result.model.encoder_state_dict()["bert.encoder.layer.1.output.dense.weight"]
        assert not torch.equal(trained, saved["bert.encoder.layer.1.output.dense.weight"])  # it trained


def test_mismatched_checkpoint_names_the_model_group(tmp_path: Path) -> None:
    stage = BertStage(_tiny_bert(vocab_size=200), 0, 3, seed=1)
    torch.save(stage.state_dict(), tmp_path / "full.pt")
    cfg = compose_finetune(["task=toy", "steps=1", "task.toy.num_train=32", "task.toy.num_dev=32",
                            "model.num_layers=3", *NARROW, f"init.checkpoint=[{tmp_path / 'full.pt'}]"])
    with pytest.raises(ConfigError, match="model.num_layers=3 but init.checkpoint has 2 encoder layers"):
        finetune(cfg, tmp_path / "run")
    half = BertStage(_tiny_bert(vocab_size=200), 2, 3, seed=1)
    torch.save(half.state_dict(), tmp_path / "half.pt")
    cfg = compose_finetune(["task=toy", "steps=1", "task.toy.num_train=32", "task.toy.num_dev=32", *NARROW,
                            f"init.checkpoint=[{tmp_path / 'half.pt'}]"])
    with pytest.raises(ConfigError, match="list every stage's file"):
        finetune(cfg, tmp_path / "run2")


def _mismatched_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """A renamed weight, and a model with another FFN width, each in a merged state-dict file."""
    renamed = dict(BertStage(_tiny_bert(vocab_size=200), 0, 3, seed=1).state_dict())
    renamed["bert.encoder.layer.0.attention.self.q.weight"] = renamed.pop("bert.encoder.layer.0.attention.self.query.weight")
    wider = BertConfig(vocab_size=200, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=96)
    files = {"renamed": tmp_path / "renamed.pt", "wider": tmp_path / "wider.pt"}
    torch.save(renamed, files["renamed"])
    torch.save(BertStage(wider, 0, 3, seed=1).state_dict(), files["wider"])
    return files


def test_checkpoint_that_does_not_fit_is_refused_in_one_line_naming_the_keys(tmp_path: Path) -> None:
    files = _mismatched_checkpoints(tmp_path)
    expected = {
        "renamed": "1 missing: bert.encoder.layer.0.attention.self.query.weight; 1 not in the model: "
                   "bert.encoder.layer.0.attention.self.q.weight; give a checkpoint of this model",
        "wider": "6 of another shape: bert.encoder.layer.0.intermediate.dense.weight (96, 32) (model (64, 32)), "
                 "bert.encoder.layer.0.intermediate.dense.bias (96,) (model (64,)), "
                 "bert.encoder.layer.0.output.dense.weight (32, 96) (model (32, 64)), "
                 "bert.encoder.layer.1.intermediate.dense.weight (96, 32) (model (64, 32)), ...",
    }
    for name, path in files.items():
        cfg = compose_finetune(["task=toy", "steps=1", "task.toy.num_train=32", "task.toy.num_dev=32", *NARROW,
                                f"init.checkpoint=[{path}]"])
        with pytest.raises(ConfigError) as info:
            finetune(cfg, tmp_path / f"run_{name}")
        message = str(info.value)
        assert message.startswith("init.checkpoint does not fit model (L=2, H=32, FFN 64): ") and "\n" not in message
        assert expected[name] in message, message


@pytest.mark.slow
def test_finetune_py_refuses_a_checkpoint_that_does_not_fit_without_a_traceback(tmp_path: Path) -> None:
    path = _mismatched_checkpoints(tmp_path)["renamed"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "finetune.py", "task.toy.num_train=64", "task.toy.num_dev=32", *NARROW,
                           f"init.checkpoint=[{path}]", f"hydra.run.dir={tmp_path / 'run'}", "progress=false",
                           "device=cpu"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("finetune.py: init.checkpoint does not fit model") and "1 missing: " in last


@pytest.mark.parametrize("kind", ["BertForPreTraining", "BertModel"])
def test_huggingface_state_dict_loads_and_matches_transformers(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    vocab = 160  # >= the toy vocabulary (151 tokens)
    config = _tiny_bert(vocab)
    hf_config = transformers.BertConfig(**config.hf_config_kwargs(), attn_implementation="eager")
    torch.manual_seed(3)
    hf = getattr(transformers, kind)(hf_config).eval()
    torch.save(hf.state_dict(), tmp_path / "hf.pt")
    cfg = compose_finetune(["task=toy", "steps=1", "task.toy.num_train=32", "task.toy.num_dev=32", *NARROW,
                            f"init.checkpoint=[{tmp_path / 'hf.pt'}]", "save_model=false"])
    result = finetune(cfg, tmp_path / "run")
    prefix = "bert." if kind == "BertForPreTraining" else ""
    hf_sd = hf.state_dict()
    for name, tensor in result.init_encoder.items():
        torch.testing.assert_close(tensor, hf_sd[prefix + name[len("bert."):]], rtol=0, atol=0, msg=name)
    # The loaded encoder computes what transformers computes.
    model = result.model
    model.stage.load_state_dict(result.init_encoder)
    model.eval()
    batch = {"input_ids": torch.randint(0, vocab, (2, 9)), "segment_ids": torch.zeros(2, 9, dtype=torch.long),
             "input_mask": torch.ones(2, 9, dtype=torch.long)}
    batch["input_mask"][1, 6:] = 0
    body = hf.bert if kind == "BertForPreTraining" else hf
    with torch.no_grad():
        ours = model.stage.encode(None, batch)
        theirs = body(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                      token_type_ids=batch["segment_ids"])
    keep = batch["input_mask"].bool()
    torch.testing.assert_close(ours[keep], theirs.last_hidden_state[keep], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.stage.bert.pooler(ours), theirs.pooler_output, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Optimizers and options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, min_accuracy",
    [
        (["optimizer.name=kfac", "lr=3e-3"], 0.9),
        (["optimizer.name=nvlamb", "lr=1e-1"], 0.9),  # LAMB's trust ratio: lr is relative to |w|
        (["recompute=true", "precision=bf16", "lr=3e-3"], 0.9),
        (["optimizer.name=kfac", "optimizer.kfac_base=nvlamb", "recompute=true", "lr=1e-1"], None),
    ],
    ids=["kfac_adamw", "nvlamb", "recompute_bf16", "kfac_nvlamb_recompute"],
)
@pytest.mark.slow
def test_optimizer_and_memory_options_train(tmp_path: Path, options: list[str], min_accuracy: float | None) -> None:
    cfg = compose_finetune(["task=toy", "steps=60", "task.toy.num_train=1920", "task.toy.num_dev=128",
                            *NARROW, *options])
    result = finetune(cfg, tmp_path)
    losses = [r["loss"] for r in read_metrics(tmp_path) if r["kind"] == "train"]
    print(f"\n{options}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, accuracy {result.main_metric:.3f} after 60 steps")
    assert len(losses) == 60 and all(loss is not None for loss in losses)  # None: a non-finite loss
    if min_accuracy is not None:
        assert result.main_metric >= min_accuracy


# --------------------------------------------------------------------------------------------
# Config and the command line
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_task_file_composes(tmp_path: Path) -> None:
    vocab = write_toy_vocab(tmp_path / "vocab.txt", ["x"])
    for task_file in sorted((CONF_DIR / "task").glob("*.yaml")):
        name = task_file.stem
        register_finetune_configs()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name="finetune", overrides=QUIET + [f"task={name}"])
        overrides = [f"task={name}"]
        if raw.task.toy.generate is None:  # a real task: give it (empty) files to find
            data = tmp_path / name
            data.mkdir()
            for rel in [raw.task.train_file, *raw.task.dev_files.values()]:
                (data / rel).touch()
            overrides += [f"task.data_dir={data}", f"vocab={vocab}"]
        cfg = compose_finetune(overrides)
        assert cfg.task.name == name and cfg.lr == cfg.task.lr and cfg.batch_size == cfg.task.batch_size
        assert cfg.task.dev_files == OmegaConf.load(task_file).dev_files  # the file's splits, no others


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["task=mnli"], "task.data_dir=None: task=mnli reads files"),
        (["task=toy_squad", "task.doc_stride=40"], "task.doc_stride=40: exceeds the context tokens per window"),
        (["optimizer.name=adam"], "optimizer.name='adam': choose one of adamw, nvlamb, kfac"),
        (["task.text_columns=[a,b,c]"], "task.text_columns="),
        (["init.checkpoint=[/nonexistent.pt]"], "/nonexistent.pt does not exist"),
    ],
)
def test_bad_settings_stop_with_the_field_and_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(Exception) as info:
        compose_finetune(overrides)
    assert message in str(info.value)


@pytest.mark.slow
def test_finetune_py_runs_the_default_toy_task_from_the_repo_root(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "finetune.py", "steps=20", "task.toy.num_train=640", "task.toy.num_dev=64",
            f"hydra.run.dir={tmp_path}", "progress=false", "device=cpu"]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "toy matched:" in proc.stdout and "sequences/s" in proc.stdout
    evals = [r for r in read_metrics(tmp_path) if r["kind"] == "eval"]
    assert {r["split"] for r in evals} == {"matched", "mismatched"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["samples_per_s"] > 0 for r in evals)
    assert (tmp_path / "finetuned.pt").is_file() and (tmp_path / ".hydra" / "config.yaml").is_file()
    bad = subprocess.run([*args[:2], "task=sst2", f"hydra.run.dir={tmp_path / 'bad'}"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "task.data_dir=None" in bad.stderr
