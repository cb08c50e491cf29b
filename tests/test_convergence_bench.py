"""bench/convergence.py's pure parts (no training run), and raw WikiText in the data preparation."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from pipefisher.data.prepare import PrepareConfig, prepare, resolve_input_format, wikitext_sentences

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def cv():
    """bench/convergence.py as a module (it imports bench/_harness.py by name, as when run as a script)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("bench_convergence", BENCH / "convergence.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


# --- smoothing and time to target -----------------------------------------------------------------

def test_smoothing_is_a_trailing_mean_over_the_window(cv) -> None:
    assert cv.smooth([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert cv.smooth([3.0, 1.0, 2.0], 10) == [3.0, 2.0, 2.0]  # fewer values at the start
    assert math.isnan(cv.smooth([1.0, math.nan, 1.0], 2)[2])
    with pytest.raises(ValueError, match="window"):
        cv.smooth([1.0], 0)


def test_steps_and_seconds_to_target_count_up_to_the_first_step_at_or_below_it(cv) -> None:
    smoothed = [9.0, 7.0, 6.5, 6.0, 6.4]
    assert cv.steps_to_target(smoothed, 6.5) == 3
    assert cv.steps_to_target(smoothed, 6.0) == 4
    assert cv.steps_to_target(smoothed, 5.9) is None
    assert cv.seconds_to([1.0, 0.5, 0.25, 2.0], 3) == 1.75
    assert cv.seconds_to([1.0], None) is None


def _records(mlm: list[float], step_s: list[float]) -> list[dict]:
    return [{"step": i, "mlm_loss": m, "step_time_s": t} for i, (m, t) in enumerate(zip(mlm, step_s))]


def test_summary_gives_steps_measured_and_estimated_seconds_per_target(cv) -> None:
    s = cv.summarize(_records([8.0, 6.0, 4.0, 4.0], [1.0, 2.0, 1.0, 1.0]), {"a": 5.0, "b": 1.0, "c": None}, 2)
    assert s["final_mlm"] == 4.0 and s["steps"] == 4
    assert s["median_step_s"] == 1.0 and s["mean_step_s"] == 1.25 and s["sum_step_s"] == 5.0
    assert s["targets"]["a"] == {"target": 5.0, "steps": 3, "seconds": 4.0, "seconds_est": 3.0}  # smoothed: 8 7 5 4
    assert s["targets"]["b"]["steps"] is None and s["targets"]["b"]["seconds"] is None
    assert s["targets"]["c"]["steps"] is None


def test_nvlamb_target_is_its_final_smoothed_loss_and_nvlamb_reaches_it(cv) -> None:
    nvlamb = _records([9.0, 7.0, 6.0, 5.0, 5.2], [1.0] * 5)
    target = cv.summarize(nvlamb, {}, 2)["final_mlm"]
    assert target == pytest.approx(5.1)
    assert cv.summarize(nvlamb, {"nvlamb": target}, 2)["targets"]["nvlamb"]["steps"] == 5


def test_ratios_use_steps_times_typical_step_against_nvlamb_and_the_best_kfac(cv) -> None:
    targets = {"t": 5.0}
    summaries = {
        "nvlamb": cv.summarize(_records([9, 7, 6, 5, 5], [1.0] * 5), targets, 1),  # 4 steps x 1 s
        "kfac-k1": cv.summarize(_records([9, 5, 5, 5, 5], [3.0] * 5), targets, 1),  # 2 steps x 3 s = 6
        "kfac-k8": cv.summarize(_records([9, 6, 5, 5, 5], [1.5] * 5), targets, 1),  # 3 x 1.5 = 4.5 (best)
        "pipefisher": cv.summarize(_records([9, 6, 5, 5, 5], [1.0, 1.0, 9.0, 1.0, 1.0]), targets, 1),  # 3 x 1
        "slow": cv.summarize(_records([9, 9, 9, 9, 9], [1.0] * 5), targets, 1),
    }
    assert cv.best_kfac(summaries, "t") == "kfac-k8"
    r = cv.ratios(summaries, "t")
    assert r["pipefisher"]["time_x_nvlamb"] == pytest.approx(0.75)  # the 9 s step does not count
    assert r["pipefisher"]["time_x_best_kfac"] == pytest.approx(3.0 / 4.5)
    assert r["kfac-k1"]["steps_x_nvlamb"] == pytest.approx(0.5)
    assert r["nvlamb"]["time_x_nvlamb"] == 1.0
    assert r["slow"]["time_x_nvlamb"] is None and r["slow"]["best_kfac"] == "kfac-k8"
    assert cv.ratios({"nvlamb": summaries["nvlamb"]}, "t")["nvlamb"]["time_x_best_kfac"] is None


def test_lr_pick_takes_the_lowest_final_loss_and_never_a_diverged_run(cv) -> None:
    assert cv.pick_lr({5e-3: 6.1, 1e-2: 5.9, 2e-2: math.nan, 4e-2: None}) == 1e-2
    assert cv.pick_lr({1e-2: math.nan}) is None


# --- unigram entropy ------------------------------------------------------------------------------

def test_unigram_entropy_of_labels_ignores_padding(cv) -> None:
    labels = np.array([[5, 5, 7, 0], [7, 9, 9, 0]])  # 0 = padding
    p = np.array([2, 2, 2]) / 6
    assert cv.unigram_entropy(labels) == pytest.approx(float(-(p * np.log(p)).sum()))
    assert cv.unigram_entropy(np.array([3, 3, 3])) == 0.0
    valid = np.array([True, True, False])
    assert cv.unigram_entropy(np.array([4, 6, 6]), valid) == pytest.approx(math.log(2))


def test_unigram_entropy_of_shards_reads_masked_labels_where_positions_are_set(cv, tmp_path: Path) -> None:
    for k, (ids, pos) in enumerate([([[10, 11, 0]], [[1, 2, 0]]), ([[10, 12, 0], [13, 0, 0]], [[3, 4, 0], [1, 0, 0]])]):
        with h5py.File(tmp_path / f"s_{k}.hdf5", "w") as f:
            f["masked_lm_ids"] = np.array(ids, dtype=np.int32)
            f["masked_lm_positions"] = np.array(pos, dtype=np.int32)
    p = np.array([2, 1, 1, 1]) / 5  # 10 twice; 11, 12, 13 once
    assert cv.shards_unigram_entropy(sorted(tmp_path.glob("*.hdf5"))) == pytest.approx(float(-(p * np.log(p)).sum()))


# --- command line ---------------------------------------------------------------------------------

def test_extra_and_lr_arguments_parse_per_arm_and_family(cv) -> None:
    assert cv.parse_extra(["pipefisher:optimizer.curvature_micro_batches=1", "kfac:optimizer.kfac_update=momentum",
                           "pipefisher:optimizer.max_staleness=4"]) == {
        "pipefisher": ["optimizer.curvature_micro_batches=1", "optimizer.max_staleness=4"],
        "kfac": ["optimizer.kfac_update=momentum"]}
    for bad in ("pipefisher", "pipefisher:lr", ":lr=1"):
        with pytest.raises(ValueError, match="ARM:key=value"):
            cv.parse_extra([bad])
    assert cv.parse_lrs(["kfac=1e-2", "pipefisher=2e-2", "5e-3"]) == {"kfac": 1e-2, "pipefisher": 2e-2, "*": 5e-3}
    with pytest.raises(ValueError, match="ARM=value"):
        cv.parse_lrs(["kfac=fast"])


def test_arm_table_expands_kfac_per_interval_and_appends_extras(cv) -> None:
    args = cv.parse_args(["--kfac-intervals", "1,8", "--staleness", "2", "--extra", "kfac:optimizer.damping=1e-2",
                          "--extra", "kfac-k8:optimizer.factor_decay=0.9", "--lr", "kfac-k8=3e-3", "--lr", "kfac=1e-2"])
    arms = cv.arm_table(args)
    assert list(arms) == ["nvlamb", "kfac-k1", "kfac-k8", "pipefisher"]
    assert arms["kfac-k8"] == ["optimizer=kfac", "optimizer.curvature_interval=8", "optimizer.inverse_interval=8",
                               "optimizer.damping=1e-2", "optimizer.factor_decay=0.9"]
    assert arms["nvlamb"] == ["optimizer=nvlamb"]
    assert cv.stale_table(args) == {"stale-k2": ["optimizer=kfac", "optimizer.curvature_interval=2",
                                                 "optimizer.inverse_interval=2", "optimizer.deferred_inverse=true"]}
    assert cv.fixed_lr(args, "kfac-k8") == 3e-3 and cv.fixed_lr(args, "kfac-k1") == 1e-2
    assert cv.fixed_lr(args, "pipefisher") is None


def test_quick_defaults_yield_to_explicit_flags(cv) -> None:
    quick = cv.parse_args(["--quick"])
    assert (quick.model, quick.pipelines, quick.kfac_intervals, quick.lr_sweep) == ("bert-tiny", ["1f1b"], [1], [])
    assert cv.parse_args(["--quick", "--steps", "7"]).steps == 7
    full = cv.parse_args([])
    assert (full.model, full.pipelines) == ("bert-mini", ["1f1b", "chimera"])
    with pytest.raises(ValueError, match="unknown"):
        cv.parse_args(["--arms", "adam"])


def test_run_command_resumes_in_chunks_in_its_own_directory(cv, tmp_path: Path) -> None:
    job = cv.Job("main", "chimera", "pipefisher", ["optimizer=pipefisher"], 0.01, 60, tmp_path / "pf")
    cmd = job.command(["model=bert-tiny"], chunk=20, resume=True)
    assert cmd[1:5] == ["train.py", "model=bert-tiny", "pipeline=chimera", "steps=60"]
    assert {"optimizer=pipefisher", "lr=0.01", "checkpoint.every_steps=20", "resume=auto"} <= set(cmd)
    assert cmd[-1] == f"hydra.run.dir={tmp_path / 'pf'}"
    assert "resume=auto" not in job.command([], chunk=20)  # the first turn starts afresh
    assert not any(c.startswith(("checkpoint.", "resume")) for c in job.command([], chunk=0))


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


def test_variants_copy_an_arm_with_overrides_and_keep_their_family(cv) -> None:
    args = cv.parse_args(["--kfac-intervals", "1", "--extra", "pipefisher:optimizer.max_staleness=7",
                          "--variant", "pipefisher-clipafter=pipefisher:optimizer.clip_before_precondition=false",
                          "--variant", "kfac-mom=kfac-k1:optimizer.kfac_update=momentum,optimizer.kfac_lr=1e-3",
                          "--lr", "pipefisher=3e-2"])
    arms = cv.arm_table(args)
    assert list(arms) == ["nvlamb", "kfac-k1", "pipefisher", "pipefisher-clipafter", "kfac-mom"]
    assert arms["pipefisher-clipafter"] == ["optimizer=pipefisher", "optimizer.max_staleness=7",
                                            "optimizer.clip_before_precondition=false"]
    assert arms["kfac-mom"][-2:] == ["optimizer.kfac_update=momentum", "optimizer.kfac_lr=1e-3"]
    assert cv.fixed_lr(args, "pipefisher-clipafter") == 3e-2  # the family's lr
    for bad in ("x=pipefisher", "x=pipefisher:lr", "=pipefisher:a=1", "x:a=1"):
        with pytest.raises(ValueError, match="NAME=ARM:key=value"):
            cv.parse_args(["--variant", bad])
    with pytest.raises(ValueError, match="no arm adam"):
        cv.arm_table(cv.parse_args(["--variant", "x=adam:a=1"]))
    with pytest.raises(ValueError, match="an arm already"):
        cv.arm_table(cv.parse_args(["--variant", "nvlamb=pipefisher:a=1"]))


def test_typical_step_time_takes_medians_per_refresh_phase_and_averages_them(cv) -> None:
    # critical-path K-FAC refreshing every 2 steps: phase 0 costs 3 s, phase 1 costs 1 s, one burst of load
    records = [{"step": i, "kfac_phase": i % 2, "step_time_s": t}
               for i, t in enumerate([3.0, 1.0, 3.0, 1.0, 30.0, 1.0, 3.0, 1.0])]
    assert cv.typical_step_s(records) == pytest.approx(2.0)  # a plain median (1.0) would drop the refresh
    assert cv.typical_step_s(_records([1.0] * 3, [1.0, 5.0, 1.0])) == 1.0  # no phases: the median
    assert math.isnan(cv.typical_step_s([]))
    s = cv.summarize(_records([8.0, 6.0, 4.0], [1.0, 1.0, 1.0]), {"a": 5.0}, 1, step_s=0.5)  # --retime's figure
    assert s["typical_step_s"] == 0.5 and s["targets"]["a"]["seconds_est"] == 1.5 and s["targets"]["a"]["seconds"] == 3.0


def test_continue_picks_up_a_run_after_its_last_complete_chunk_checkpoint(cv, tmp_path: Path) -> None:
    def job(name: str, logged: int, saved: list[int], manifest: bool = True):
        j = cv.Job("main", "1f1b", name, ["optimizer=nvlamb"], None, 40, tmp_path / name)
        (j.run_dir / "checkpoints").mkdir(parents=True)
        (j.run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {i}, "mlm_loss": 1.0}}\n' for i in range(logged)))
        for n in saved:
            (j.run_dir / "checkpoints" / f"step_{n}").mkdir()
            if manifest:
                (j.run_dir / "checkpoints" / f"step_{n}" / "manifest.json").write_text("{}")
        return j

    ok = job("a", 23, [9, 19])
    cv.pick_up(ok)
    assert (ok.done_steps, ok.chunks) == (20, 1)  # resumes with resume=auto from step_19
    assert "resume=auto" in ok.command([], 10, resume=ok.chunks > 0)
    partial = job("b", 12, [9], manifest=False)  # no complete checkpoint: starts over, old files gone
    cv.pick_up(partial)
    assert (partial.done_steps, partial.chunks) == (0, 0) and not partial.run_dir.exists()


def test_rounds_rotate_the_runs_and_the_sweep_has_one_folder_per_arm_and_lr(cv, tmp_path: Path) -> None:
    assert [cv.rotated("abc", r) for r in range(4)] == [list("abc"), list("bca"), list("cab"), list("abc")]
    assert cv.sweep_dir(tmp_path, "1f1b", "kfac-k1", 0.01) == tmp_path / "sweep" / "1f1b" / "kfac-k1" / "lr0.01"


def test_batch_noise_is_the_second_half_minus_a_centred_mean(cv) -> None:
    values = [5.0, 5.0, 5.0, 5.0, 6.0, 4.0, 6.0, 4.0]
    # the second half is values[4:]; each minus the mean of values[i-1], values[i]
    assert cv.batch_noise(values, 2) == [0.5, -1.0, 1.0, -1.0]
