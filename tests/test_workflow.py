"""A researcher's workflow (issue 24): pretrain -> <run>/final/ -> export -> transformers or
finetune.py; NVIDIA's two phases with ``init_from``.

The reference for the weights is transformers' own ``BertForPreTraining`` loaded from the export,
against our stages rebuilt from the checkpoint's worker shards (not through the merge that
``final/`` and the export use).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipefisher.atomic import current_umask
from pipefisher.config import ConfigError, TrainConfig
from pipefisher.export import export_weights
from pipefisher.finetune import finetune
from pipefisher.launch import run_training
from pipefisher.model import BertConfig, BertStage, build_full_model, load_hf_state_dict
from pipefisher.model.hf_format import WEIGHTS_FILE, read_model_folder, write_model_folder
from pipefisher.run_spec import bert_config
from pipefisher.runtime.build import build_stage_modules, schedule_for, stage_slices
from pipefisher.runtime.checkpoint import load_shard, verify_checkpoint, write_manifest, write_shard
from pipefisher.runtime.final_weights import write_final_weights
from pipefisher.runtime.init_weights import POSITION_EMBEDDINGS_NAME, load_initial_weights
from pipefisher.runtime.saved_weights import read_saved_weights
from tests.conftest import REPO, compose_train
from tests.dist_harness import start_workers
from tests.dist_harness import train_jobs
from tests.test_finetune import compose_finetune

transformers = pytest.importorskip("transformers")

# Every kind of run the weights must come out of: pipeline methods, data parallel, K-FAC.
RUNS = {
    "chimera-D2": ["pipeline=chimera", "stages=2"],
    "1f1b-D2-kfac": ["pipeline=1f1b", "stages=2", "optimizer=kfac"],
    "gpipe-dp2": ["stages=1", "data_parallel=2"],
    "zb-v-D2": ["pipeline=zb-v", "stages=2"],
}
STEPS = ["steps=2", "checkpoint.every_steps=2", "lr=1e-2"]


def _batch(vocab: int, seq: int = 32, pred: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, vocab, (3, seq), generator=g)
    mask = torch.ones(3, seq, dtype=torch.long)
    mask[1, seq - 7:] = 0  # padding in one sequence
    return {"input_ids": ids, "segment_ids": (torch.arange(seq) >= seq // 2).long().expand(3, -1).contiguous(),
            "input_mask": mask, "masked_lm_positions": torch.randint(1, seq - 8, (3, pred), generator=g),
            "masked_lm_ids": torch.randint(5, vocab, (3, pred), generator=g),
            "next_sentence_labels": torch.tensor([0, 1, 0])}


def _hf_logits(folder: Path, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """MLM logits at the masked positions and NSP logits of transformers' model loaded from ``folder``."""
    hf, info = transformers.BertForPreTraining.from_pretrained(folder, attn_implementation="eager",
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        out = hf.eval()(input_ids=batch["input_ids"], attention_mask=batch["input_mask"],
                        token_type_ids=batch["segment_ids"])
    index = batch["masked_lm_positions"].unsqueeze(-1).expand(-1, -1, out.prediction_logits.shape[-1])
    return out.prediction_logits.gather(1, index), out.seq_relationship_logits


def _shard_logits(cfg: TrainConfig, checkpoint: Path, batch: dict[str, torch.Tensor]):
    """Our logits from the checkpoint's shards: each stage rebuilt from a replica, run in order."""
    num_stages = cfg.stages * cfg.pipeline.num_virtual
    replicas: dict[int, dict] = {}
    for entry in verify_checkpoint(checkpoint)["shards"]:
        for key, state in load_shard(checkpoint, entry["rank"])["modules"].items():
            replicas.setdefault(int(key.split(".")[1]), state)
    hidden = None
    with torch.no_grad():
        for s, (first, last) in enumerate(stage_slices(cfg, num_stages)):
            stage = BertStage(bert_config(cfg), first, last).eval()
            stage.load_state_dict(replicas[s], strict=True)
            hidden = stage.encode(hidden, batch)
        return stage.logits(hidden, batch)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[TrainConfig, Path]]:
    """Two steps of each kind of run, with a checkpoint after the last and the default final/; all
    in one start of the tests' workers ([Note: forkserver] in tests/dist_harness: what comes out of
    a run is the claim here, not how train.py starts its processes)."""
    out = {name: (compose_train(overrides + STEPS), tmp_path_factory.mktemp(name)) for name, overrides in RUNS.items()}
    assert {cfg.num_workers for cfg, _ in out.values()} == {2}
    rendezvous = tmp_path_factory.mktemp("pg")
    start_workers(train_jobs, ([([cfg, cfg], str(folder), False, None) for cfg, folder in out.values()],
                               str(rendezvous)), 2)
    return out


# ---- final weights and export -------------------------------------------------------------------


def test_model_folder_loads_in_transformers_with_our_logits_and_the_usual_file_mode(tmp_path: Path) -> None:
    config = BertConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    model = build_full_model(config, seed=3).eval()
    with torch.no_grad():  # as after training: the biases and LayerNorms are no longer at their init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    folder = write_model_folder(tmp_path / "m", model.state_dict(), config, meta={"trained_steps": 7})
    batch = _batch(300)
    with torch.no_grad():
        mlm, nsp = model.logits(model.encode(None, batch), batch)
    hf_mlm, hf_nsp = _hf_logits(folder, batch)
    torch.testing.assert_close(hf_mlm, mlm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_nsp, nsp, rtol=1e-5, atol=1e-5)
    assert {p.name for p in tmp_path.iterdir()} == {"m"}  # no temporary folder left beside it
    assert {oct(p.stat().st_mode & 0o777) for p in folder.iterdir()} == {oct(0o666 & ~current_umask())}
    saved = read_model_folder(folder)
    assert saved.config == config and saved.meta == {"trained_steps": 7} and saved.vocab is None
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved.state_dict[name], tensor, rtol=0, atol=0, msg=name)


def test_a_folder_saved_by_transformers_reads_back_as_the_same_model(tmp_path: Path) -> None:
    config = BertConfig(vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    torch.manual_seed(4)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**config.hf_config_kwargs()))
    hf.save_pretrained(tmp_path / "hf")
    saved = read_model_folder(tmp_path / "hf")
    assert saved.config == config
    model = build_full_model(config).eval()
    load_hf_state_dict(model, saved.state_dict)
    batch = _batch(300)
    with torch.no_grad():
        mlm, nsp = model.logits(model.encode(None, batch), batch)
    hf_mlm, hf_nsp = _hf_logits(tmp_path / "hf", batch)
    torch.testing.assert_close(mlm, hf_mlm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nsp, hf_nsp, rtol=1e-5, atol=1e-5)


def test_the_vocab_beside_the_shards_goes_into_final_and_the_export(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "vocab.txt").write_text("".join(f"tok{i}\n" for i in range(512)))
    cfg = compose_train(["data=hdf5", f"data.path={data}", "steps=5"])
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    final = write_final_weights(cfg, [model.state_dict()], tmp_path / "run", step=4)
    assert (final / "vocab.txt").read_text() == (data / "vocab.txt").read_text()
    assert read_model_folder(final).meta["trained_steps"] == 5
    # From a checkpoint, the vocab comes from the manifest's data.path.
    shards = tmp_path / "run" / "checkpoints" / "step_4"
    shards.mkdir(parents=True)
    write_manifest(shards, 4, cfg, 1, [write_shard(shards, 0, {"modules": {"0.0": model.state_dict()}})])
    exported = export_weights(shards, tmp_path / "hf")
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", WEIGHTS_FILE, "vocab.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_export_of_every_kind_of_run_gives_transformers_our_logits(name: str, runs, tmp_path: Path) -> None:
    cfg, run = runs[name]
    checkpoint = run / "checkpoints" / "step_1"
    final = read_saved_weights(run)  # the run folder stands for its final/
    assert final.source == run / "final" and final.trained_steps == 2 and final.config == bert_config(cfg)
    from_checkpoint = read_saved_weights(checkpoint)
    assert set(final.state_dict) == set(from_checkpoint.state_dict)
    for key, tensor in final.state_dict.items():  # final/ holds the state after the last step
        torch.testing.assert_close(tensor, from_checkpoint.state_dict[key], rtol=0, atol=0, msg=key)

    folder = export_weights(run, tmp_path / "hf")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHTS_FILE]  # synthetic data: no vocab
    batch = _batch(cfg.model.vocab_size)
    mlm, nsp = _shard_logits(cfg, checkpoint, batch)
    hf_mlm, hf_nsp = _hf_logits(folder, batch)
    torch.testing.assert_close(hf_mlm, mlm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_nsp, nsp, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_export_py_from_a_checkpoint_and_a_bad_path_prints_one_line(runs, tmp_path: Path) -> None:
    _, run = runs["chimera-D2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "export"
    ok = subprocess.run([sys.executable, str(REPO / "export.py"), f"from={run / 'checkpoints' / 'step_1'}",
                         f"out={out}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "exported" in ok.stdout and (out / WEIGHTS_FILE).is_file()
    assert {p.name for p in tmp_path.iterdir()} == {"export"}  # Hydra wrote no outputs/ folder
    bad = subprocess.run([sys.executable, str(REPO / "export.py"), f"from={tmp_path / 'nope'}", f"out={out}2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [f"export.py: {tmp_path / 'nope'}: not a folder; give a run folder, "
                                               "its final/ folder, a checkpoint step_<n> folder or an export folder"]
    assert {p.name for p in tmp_path.iterdir()} == {"export"}


# ---- fine-tuning from our own pretraining --------------------------------------------------------


@pytest.mark.slow
def test_finetuning_from_our_chimera_checkpoint_loads_every_encoder_weight_and_learns(
        runs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, run = runs["chimera-D2"]
    checkpoint = run / "checkpoints" / "step_1"
    cfg = compose_finetune(["task=toy", "steps=100", "eval_every=50", "task.toy.num_train=2000",
                            "task.toy.num_dev=300", f"init.checkpoint=[{checkpoint}]"])
    with caplog.at_level(logging.INFO, logger="pipefisher.finetune.checkpoint"):
        result = finetune(cfg, tmp_path)
    saved = read_saved_weights(checkpoint).state_dict
    assert result.random_init == []
    assert set(result.init_encoder) == {k for k in saved if k.startswith("bert.")}
    for name, tensor in result.init_encoder.items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0, msg=name)
    assert f"took {len(result.init_encoder)} tensors, every encoder weight" in caplog.text
    assert "is the same for every input" not in caplog.text  # two steps: no collapse warning
    curve = [(r["step"], r["split"], round(r["accuracy"], 3)) for r in result.evals]
    assert all(r["accuracy"] >= 0.9 for r in result.final.values()), curve


# ---- two phases: init_from -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def phase1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phase 1 with a 32-row position table (NVIDIA allocates 512; a smaller table is extended)."""
    folder = tmp_path_factory.mktemp("phase1")
    run_training(compose_train(["steps=10", "model.max_position_embeddings=32", "data.seq_len=32"]), folder)
    return folder


def test_init_from_loads_every_weight_and_extends_the_position_table_with_fresh_rows(
        phase1: Path, caplog: pytest.LogCaptureFixture) -> None:
    learned = read_model_folder(phase1 / "final").state_dict
    cfg = compose_train([f"init_from={phase1}", "data.seq_len=64", "data.max_predictions=10", "stages=2"])
    for rank in range(2):
        modules = build_stage_modules(cfg, schedule_for(cfg), rank)
        fresh = {key: {k: v.clone() for k, v in m.state_dict().items()} for key, m in modules.items()}
        with caplog.at_level(logging.INFO, logger="pipefisher.runtime.init_weights"):
            load_initial_weights(cfg, modules, log_here=True)
        for key, stage in modules.items():
            for name, tensor in stage.state_dict().items():
                if name == POSITION_EMBEDDINGS_NAME:
                    assert tensor.shape == (512, cfg.model.hidden_size)
                    torch.testing.assert_close(tensor[:32], learned[name], rtol=0, atol=0)
                    torch.testing.assert_close(tensor[32:], fresh[key][name][32:], rtol=0, atol=0)
                else:
                    torch.testing.assert_close(tensor, learned[name], rtol=0, atol=0, msg=name)
    assert "position embeddings extended from 32 to 512 rows" in caplog.text
    assert "weights after 10 steps at seq_len 32" in caplog.text


def test_init_from_weights_of_another_model_is_refused_naming_the_field(phase1: Path) -> None:
    cfg = compose_train([f"init_from={phase1}", "model.hidden_size=64"])
    with pytest.raises(ConfigError, match=r"model.hidden_size=64, but the weights in .* have 128; use the model "
                                          r"they were trained with \(model.hidden_size=128\)"):
        load_initial_weights(cfg, build_stage_modules(cfg, schedule_for(cfg), 0))
    cfg = compose_train([f"init_from={phase1}", "model.max_position_embeddings=16", "data.seq_len=16"])
    with pytest.raises(ConfigError, match="the weights have 32 positions, model.max_position_embeddings=16; set "
                                          "model.max_position_embeddings=32"):
        load_initial_weights(cfg, build_stage_modules(cfg, schedule_for(cfg), 0))
    with pytest.raises(ConfigError, match="init_from='/no/such/run': no such folder"):
        compose_train(["init_from=/no/such/run"])
    empty = phase1.parent / "empty"
    empty.mkdir(exist_ok=True)
    cfg = compose_train([f"init_from={empty}"])
    with pytest.raises(ConfigError, match=f"init_from={empty}: {empty}: no final/ "):
        load_initial_weights(cfg, build_stage_modules(cfg, schedule_for(cfg), 0))


@pytest.mark.slow
def test_phase_two_run_starts_from_phase_one_and_save_final_false_saves_nothing(
        phase1: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = compose_train([f"init_from={phase1}", "data.seq_len=64", "data.max_predictions=10", "steps=1"])
    with caplog.at_level(logging.INFO, logger="pipefisher.runtime.init_weights"):
        assert run_training(cfg, tmp_path)["step"] == 0  # one worker: its log is this process's
    err = caplog.text
    assert f"init_from: weights after 10 steps at seq_len 32 from {phase1 / 'final'}" in err
    assert "position embeddings extended from 32 to 512 rows" in err
    phase2 = read_model_folder(tmp_path / "final")
    assert phase2.config.max_position_embeddings == 512 and phase2.meta["seq_len"] == 64
    run_training(compose_train(["steps=1", "save_final=false"]), tmp_path / "fresh")
    assert (tmp_path / "fresh" / "metrics.jsonl").is_file() and not (tmp_path / "fresh" / "final").exists()
