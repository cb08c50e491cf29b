"""torch.distributed.pipelining's compute-only CSV format, both ways (issue 26, item 4).

References are independent of our code: torch's own writer (``_dump_csv``) and reader
(``_Action.from_str`` row by row, as ``_load_csv`` does; ``_validate_schedule`` for the stage → rank
mapping), torch's own schedule classes, torch's ``_PipelineScheduleRuntime`` with torch's
``PipelineStage``, and single-process training (a plain loop over the full model).
"""

from __future__ import annotations

import csv
import datetime
import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import _Action, _validate_schedule

from pipefisher.config import ConfigError
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.model.rng import dropout_key
from pipefisher.run_spec import bert_config, data_plan, data_source
from pipefisher.runtime.teardown import release_process_group
from pipefisher.schedules import GENERATORS, ScheduleError, build_schedule
from pipefisher.schedules.torch_csv import build_from_torch_csv, from_torch_csv, to_torch_csv
from pipefisher.torch_schedule import main as cli_main
from pipefisher.torch_schedule import torch_schedule_csv
from tests.conftest import compose_train
from tests.dist_harness import run_cases, start_workers

# Dropout on: both executors key its masks by (step, micro-batch), as the reference does.
MODEL = ["model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
         "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
         "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2", "lr=0.01"]
WORD = "bert.embeddings.word_embeddings.weight"
DECODER = "cls.predictions.decoder.weight"
SHAPES = [(2, 4), (4, 8), (4, 16)]


def _options(method: str) -> dict:
    return {"num_virtual": 2} if method in ("interleaved", "zb-v") else {}


def _torch_reads(text: str) -> dict[int, list[_Action]]:
    """What torch's ``_load_csv`` reads: one row per rank, ``_Action.from_str`` per cell, bubbles dropped."""
    rows = {r: [_Action.from_str(c) for c in row] for r, row in enumerate(csv.reader(io.StringIO(text)))}
    return {r: [a for a in acts if a is not None] for r, acts in rows.items()}


def _flat(actions: list[_Action]) -> list[str]:
    """torch's actions as strings, OVERLAP_F_B as its sub-actions in order (as its runtime runs them)."""
    return [str(s) for a in actions for s in (a.sub_actions or (a,)) if s.computation_type.value in "FBIW"]


def _computes(schedule, worker: int) -> list[str]:
    return [str(a) for a in schedule.actions[worker] if a.kind.is_compute]


# -- ours -> CSV -> ours, and torch's reader on ours ----------------------------------------------


@pytest.mark.parametrize("method", [m for m in GENERATORS if not m.startswith("chimera")])
@pytest.mark.parametrize("d,n", SHAPES, ids=[f"D{d}-N{n}" for d, n in SHAPES])
def test_round_trip_keeps_every_generators_compute_order_and_placement(method: str, d: int, n: int) -> None:
    ours = build_schedule(method, d, n, 2, **_options(method))
    text = to_torch_csv(ours)
    back = build_from_torch_csv(text, n, dp_width=2)
    assert back.placement.workers == ours.placement.workers
    assert back.num_stages == ours.num_stages and back.num_micro_batches == n
    for w in ours.actions:
        assert _computes(back, w) == _computes(ours, w)
    # torch's reader sees the same order and infers our placement of stages on ranks.
    read = _torch_reads(text)
    assert {r: [str(a) for a in acts] for r, acts in read.items()} == {r: _computes(ours, r) for r in range(d)}
    mapping = _validate_schedule(read, d, ours.num_stages, n)
    assert mapping == {s: ours.placement.worker_of(0, 0, s) for s in range(ours.num_stages)}


@pytest.mark.parametrize("method", ["chimera", "chimera-doubling"])
def test_chimera_cannot_be_exported_its_stages_live_on_two_workers(method: str) -> None:
    with pytest.raises(ValueError, match=f"{method}: torch's schedule format maps each stage to one rank and has no pipes"):
        to_torch_csv(build_schedule(method, 4, 8))


# -- torch's exports -> ours --------------------------------------------------------------------

TORCH_CLASSES = ["GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("name", TORCH_CLASSES)
@pytest.mark.parametrize("d,n", [(2, 4), (4, 8)], ids=["D2-N4", "D4-N8"])
def test_torch_schedules_pass_our_checker_with_torch_order(name: str, d: int, n: int) -> None:
    text = torch_schedule_csv(name, d, n)
    schedule = build_from_torch_csv(text)  # our checker, our passes, our checker again
    read = _torch_reads(text)
    for r in range(d):
        assert _computes(schedule, r) == _flat(read[r])
    assert schedule.num_micro_batches == n


def test_checker_rejects_torch_1f1b_export_read_from_csv() -> None:
    # torch 2.13's Schedule1F1B._get_pipeline_order gives the last rank F1..F4 (D=2, N=4); the same
    # rule as tests/test_zero_bubble.py::test_checker_rejects_torch_one_f_one_b_export_with_shifted_forwards,
    # here on torch's own export.
    text = torch_schedule_csv("1F1B", 2, 4)
    assert "1F4" in text.splitlines()[1].split(",")
    with pytest.raises(ScheduleError, match="1F4 on worker 1: micro-batch out of range"):
        build_from_torch_csv(text)


def test_reader_refuses_communication_and_a_stage_on_two_ranks() -> None:
    with pytest.raises(ValueError, match="rank 0, step 1: '0SEND_F0' is not a compute action"):
        from_torch_csv("0F0,0SEND_F0\n1F0\n")
    with pytest.raises(ValueError, match="stage 0 has actions on rank 0 and rank 1"):
        from_torch_csv("0F0,0B0\n0F1,0B1\n")


def test_cli_exports_checks_and_rejects(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "zbv.csv"
    assert cli_main(["export", "zb-v", "--stages", "2", "--micro-batches", "4", "--num-virtual", "2", "-o", str(out)]) == 0
    assert cli_main(["check", str(out)]) == 0
    assert "accepted: 2 workers, 4 stages, 4 micro-batches" in capsys.readouterr().out
    bad = tmp_path / "torch_1f1b.csv"
    assert cli_main(["torch", "1F1B", "--stages", "2", "--micro-batches", "4", "-o", str(bad)]) == 0
    assert cli_main(["check", str(bad)]) == 1
    assert "rejected by our checker" in capsys.readouterr().err
    assert cli_main(["export", "chimera", "--stages", "2", "--micro-batches", "4", "-o", str(out)]) == 1


# -- config ----------------------------------------------------------------------------------------


def test_config_takes_stages_per_rank_and_micro_batches_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "dpv.csv"
    path.write_text(torch_schedule_csv("DualPipeV", 2, 4))
    cfg = compose_train(MODEL + ["pipeline=csv", f"pipeline.csv={path}", "stages=2"])
    assert (cfg.pipeline.num_virtual, cfg.num_micro_batches, cfg.pipeline.csv) == (2, 4, str(path))
    for overrides, message in (
        ([], "pipeline.csv=None: pipeline=csv needs an existing torch compute-only CSV"),
        ([f"pipeline.csv={path}", "stages=4"], "stages=4: pipeline.csv=.* schedules 2 ranks; use stages=2"),
        ([f"pipeline.csv={path}", "stages=2", "num_micro_batches=8"],
         "num_micro_batches=8: pipeline.csv=.* schedules 4 micro-batches; use num_micro_batches=4"),
    ):
        with pytest.raises(ConfigError, match=message):
            compose_train(MODEL + ["pipeline=csv"] + overrides)
    with pytest.raises(ConfigError, match="pipeline.csv=.*is read by pipeline=csv only"):
        compose_train(MODEL + ["pipeline=1f1b", f"pipeline.csv={path}", "stages=2"])


# -- runs: against single-process training ---------------------------------------------------------


def _reference(cfg) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (MLM + NSP) and gradients of single-process training on the step's micro-batches."""
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    source, plan = data_source(cfg), data_plan(cfg)
    total, scale = 0.0, 1.0 / cfg.num_micro_batches
    for j in range(cfg.num_micro_batches):
        with dropout_key(0, j):
            losses = model(None, get_micro_batch(source, 0, j, 0, **plan))
        (losses.sum() * scale).backward()
        total += float(losses.sum().detach()) * scale
    return total, {n: p.grad for n, p in model.named_parameters()}


def _assert_matches(cfg, loss: float, grads: dict[str, torch.Tensor]) -> None:
    ref_loss, ref_grads = _reference(cfg)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    seen = set()
    for name, grad in grads.items():
        name = WORD if name == DECODER else name  # the tied weight: sum of both uses
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        seen.add(name)
    assert seen == set(ref_grads)


def _merged(results: dict[int, dict], key: str) -> dict[str, torch.Tensor]:
    return {k.split("/", 2)[2]: t for r in sorted(results) for k, t in results[r][key].items()}


TORCH_RUNS = ["DualPipeV", "InterleavedZeroBubble", "Interleaved1F1B"]


@pytest.mark.slow
def test_torch_exports_run_in_our_executor_with_single_process_losses(tmp_path: Path) -> None:
    cfgs = []
    for name in TORCH_RUNS:
        path = tmp_path / f"{name}.csv"
        with open(path, "w") as f:
            f.write(torch_schedule_csv(name, 2, 4))
        cfgs.append(compose_train(MODEL + ["pipeline=csv", f"pipeline.csv={path}", "stages=2", "steps=1"]))
    for name, cfg, results in zip(TORCH_RUNS, cfgs, run_cases([(c, 1) for c in cfgs], tmp_path)):
        loss = float(sum(results[0]["losses"][0]))
        _assert_matches(cfg, loss, _merged(results, "grads"))


class _MicroBatchStage(nn.Module):
    """A ``BertStage`` in torch's calling convention: one tensor in, one out. The micro-batch index
    comes as a keyword argument that torch's ``step`` splits into chunks of one, so the batch and the
    dropout key are right in any order of forwards."""

    def __init__(self, stage: nn.Module, worker) -> None:
        super().__init__()
        self.stage, self.worker = stage, worker

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        j = int(mb.item())
        with dropout_key(0, j):
            return self.stage(None if self.stage.has_embeddings else x, self.worker.get_batch(0, j))


def _torch_runtime_worker(rank: int, cases: list, out_dir: str) -> None:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pipefisher.runtime.worker import PipelineWorker

    torch.set_num_threads(1)
    for i, (cfg, csv_path) in enumerate(cases):
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg{i}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        try:
            worker = PipelineWorker(cfg, rank, 2, torch.device("cpu"))  # our stages, weights and data
            n, b, s, h = cfg.num_micro_batches, cfg.micro_batch_size, cfg.data.seq_len, cfg.model.hidden_size
            total = worker.schedule.num_stages
            stages = []
            for (_, index), module in sorted(worker.modules.items()):
                example_in = torch.zeros(1, 1) if index == 0 else torch.zeros(b, s, h, requires_grad=True)
                example_out = torch.zeros(2, requires_grad=True) if index == total - 1 else torch.zeros(b, s, h, requires_grad=True)
                stages.append(PipelineStage(_MicroBatchStage(module, worker), index, total, torch.device("cpu"),
                                            input_args=example_in, output_args=example_out))
            runtime = _PipelineScheduleRuntime(stages, n, loss_fn=lambda out, _t: out.float().sum() / n, scale_grads=False)
            runtime._load_csv(csv_path, format="compute_only")  # torch's reader and its own lowering passes
            losses: list[torch.Tensor] = []
            first = any(st.stage_index == 0 for st in stages)
            last = any(st.stage_index == total - 1 for st in stages)
            args = (torch.zeros(n, 1),) if first else ()
            extra = {"target": torch.zeros(n), "losses": losses} if last else {}
            runtime.step(*args, mb=torch.arange(n), **extra)
            params, grad = [], None
            if worker.executor.tied is not None:  # the tied weight gets the sum of both stages' gradients
                params, group = worker.executor.tied
                grad = torch.stack([p.grad for p in params]).sum(0)
                dist.all_reduce(grad, group=group)
            loss = torch.tensor([float(sum(x.detach() for x in losses))])
            dist.all_reduce(loss)
            grads = {f"{pipe}/{index}/{name}": (grad if any(p is q for q in params) else p.grad).clone()
                     for (pipe, index), m in worker.modules.items() for name, p in m.named_parameters()}
            torch.save({"loss": float(loss), "grads": grads}, Path(out_dir) / f"case{i}_rank{rank}.pt")
        finally:
            release_process_group()


OURS_IN_TORCH = ["1f1b", "interleaved", "zb-h1", "zb-v"]


@pytest.mark.slow
def test_our_schedules_run_in_torchs_runtime_with_single_process_losses(tmp_path: Path) -> None:
    cases = []
    for method in OURS_IN_TORCH:
        cfg = compose_train(MODEL + [f"pipeline={method}", "stages=2", "num_micro_batches=4", "steps=1"])
        path = tmp_path / f"{method}.csv"
        path.write_text(to_torch_csv(build_schedule(method, 2, 4, **_options(method))))
        cases.append((cfg, str(path)))
    start_workers(_torch_runtime_worker, (cases, str(tmp_path)), 2)
    for i, (cfg, _) in enumerate(cases):
        results = {r: torch.load(tmp_path / f"case{i}_rank{r}.pt", weights_only=True) for r in range(2)}
        assert results[0]["loss"] == results[1]["loss"]
        _assert_matches(cfg, results[0]["loss"], _merged(results, "grads"))
