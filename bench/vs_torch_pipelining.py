"""Our executor against torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B, same BERT stages.

    python bench/vs_torch_pipelining.py            # bert-mini, D=2 and D=4, N=8, B=4: ~2.5-3.5 min on 2 cores
    python bench/vs_torch_pipelining.py --quick    # fewer repeats, B=2: ~30 s

Both sides run the same step on the same worker processes: forward and backward of N micro-batches
through the stages ``partition_layers`` gives, the tied word-embedding/decoder gradient summed over
the first and last stage, the global gradient norm, and an NVLAMB update (``make_optimizer``: the
same optimizer and LR schedule as ``train.py``). Dropout is off so that the two sides' losses can be
compared step by step: identical losses mean identical work.

[Note: one BERT stage, two calling conventions]
``BertStage.forward(hidden, batch)`` takes the whole micro-batch dict, because every stage needs the
attention mask and the last stage the labels. torch's ``PipelineStage`` passes tensors only, and
only from stage to stage. So each stage is wrapped in a module taking and returning one tensor,
and the micro-batch reaches it through a feed set before the step: the k-th forward call of a step
on a stage is micro-batch k, which holds for GPipe and 1F1B (each stage runs its forwards in
micro-batch order). The feed calls ``PipelineWorker.get_batch`` exactly as our executor does (once
per micro-batch and stage, at its forward). Stage 0 gets a dummy ``(N, 1)`` root argument that
torch splits into micro-batches; the last stage's ``[mlm, nsp]`` output goes through
``loss_fn = sum × 1/N`` with ``scale_grads=False``, the loss scale our executor applies.
Metadata is given statically (``input_args``/``output_args``), so torch runs no shape inference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import _harness as h
from pipefisher.config import TrainConfig
from pipefisher.runtime.split_backward import disable_split_backward
from pipefisher.runtime.worker import PipelineWorker

VARIANTS = ("ours-gpipe", "torch-gpipe", "ours-1f1b", "torch-1f1b")
# Phases of a step on one worker: F/B and point-to-point until every gradient of the step exists;
# tied-weight gradient sum and global-norm all-reduce; NVLAMB update, LR step and zero_grad; the
# loss all-reduce and anything after.
_PHASES = ("pipeline", "grad sync + norm", "update", "rest")
_TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _TorchPipeline:
    """One worker's side of a torch.distributed.pipelining run of our stages.

    A :class:`PipelineWorker` (its executor unused) holds the stage, optimizer, LR schedule, data
    and tied-weight group, so both sides start from identical weights and see identical batches.
    """

    def __init__(self, cfg: TrainConfig, rank: int, world: int, method: str) -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
        # torch's own runtime on plain layers: our executor's deferrable ones would make torch's I compute W too
        disable_split_backward(self.worker.modules.values())
        self.feed = h.BatchFeed(self.worker)
        stage = self.worker.modules[(0, rank)]
        n, b, s, hid = cfg.num_micro_batches, cfg.micro_batch_size, cfg.data.seq_len, cfg.model.hidden_size
        # Static metadata: what requires grad here is what gets a gradient sent back.
        example_in = torch.zeros(1, 1) if rank == 0 else torch.zeros(b, s, hid, requires_grad=True)
        example_out = torch.zeros(2, requires_grad=True) if rank == world - 1 else torch.zeros(b, s, hid, requires_grad=True)
        self.pipe_stage = PipelineStage(h.TensorStage(stage, self.feed), rank, world, torch.device("cpu"),
                                        input_args=example_in, output_args=example_out)
        scale = 1.0 / n
        self.schedule = _TORCH_SCHEDULES[method](
            self.pipe_stage, n, loss_fn=lambda out, _target: out.float().sum() * scale, scale_grads=False)
        self.root = torch.zeros(n, 1)
        self.target = torch.zeros(n)

    def train_step(self, step: int) -> tuple[list[float], dict[str, float]]:
        """One step; returns the [mlm, nsp] loss and this worker's phases (ms, see ``_PHASES``)."""
        w, n = self.worker, self.cfg.num_micro_batches
        t0 = time.perf_counter_ns()
        self.feed.start(step)
        loss_sum = torch.zeros(2)
        if self.rank == 0:
            self.schedule.step(self.root)
        elif self.rank == self.world - 1:
            out = self.schedule.step(target=self.target)
            loss_sum = out.detach().float().reshape(n, 2).sum(0)
        else:
            self.schedule.step()
        t1 = time.perf_counter_ns()
        w.executor.reduce_tied_grads()  # the word-embedding and decoder copies get the sum of both gradients
        norm = w.global_grad_norm()
        t2 = time.perf_counter_ns()
        w.optimizer.step(grad_norm=norm)
        w.scheduler.step()
        w.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter_ns()
        dist.all_reduce(loss_sum)
        losses = (loss_sum / n).tolist()
        t4 = time.perf_counter_ns()
        return losses, _phases(t0, t1, t2, t3, t4)


def _phases(*marks: int) -> dict[str, float]:
    return {name: (b - a) / 1e6 for name, a, b in zip(_PHASES, marks, marks[1:])}


def _ours_step(worker: PipelineWorker, step: int) -> tuple[list[float], dict[str, float]]:
    """Our step, cut into the same phases from the executor's events: the pipeline runs until STEP
    starts waiting for gradient synchronization (STEP's wait: name ``STEP``, kind ``SYNC_GRAD``;
    executor [Note: waits are not compute]), then the tied-weight
    sum and global norm, the update (the ``STEP`` event), and the rest (the loss all-reduce)."""
    t0 = time.perf_counter_ns()
    losses, result = worker.train_step(step)
    t4 = time.perf_counter_ns()
    wait = next(e for e in result.events if e.name == "STEP" and e.kind == "SYNC_GRAD")
    update = next(e for e in result.events if e.kind == "STEP")
    return losses, _phases(t0, wait.start_ns, wait.end_ns, update.end_ns, t4)


def _run(rank: int, world: int, overrides: list[str], warmup: int, repeats: int, variants: tuple[str, ...]) -> dict:
    runners = {}
    for variant in variants:
        side, method = variant.split("-")
        cfg = h.compose(overrides + [f"pipeline={method}"])
        if side == "ours":
            worker = PipelineWorker(cfg, rank, world, torch.device("cpu"))
            runners[variant] = lambda step, w=worker: _ours_step(w, step)
        else:
            runners[variant] = _TorchPipeline(cfg, rank, world, method).train_step
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses: dict[str, list[list[float]]] = {v: [] for v in variants}
    phases: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for step, variant, seconds, (loss, phase) in h.timed_rotation(runners, warmup, repeats):
        losses[variant].append(loss)
        if step >= warmup:
            times[variant].append(seconds)
            phases[variant].append(phase)
    return {"times": times, "losses": losses, "phases": phases}


def main() -> None:
    load_before = h.load()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and B=2 (about 30 s)")
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--stages", default="2,4", help="comma-separated D values")
    parser.add_argument("--micro-batches", type=int, default=8, help="N")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="B (default 4, --quick 2)")
    parser.add_argument("--repeats", type=int, default=None, help="measured steps per variant (default 16, --quick 4)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of the variants (e.g. one of them, to profile it with py-spy)")
    args = parser.parse_args()
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    b = args.micro_batch_size or (2 if args.quick else 4)
    repeats = args.repeats or (4 if args.quick else 16)
    warmup = 1 if args.quick else 2
    rows, phase_rows, notes = [], [], []
    for d in [int(x) for x in args.stages.split(",")]:
        overrides = [f"model={args.model}", f"stages={d}", f"num_micro_batches={args.micro_batches}",
                     f"micro_batch_size={b}", f"steps={warmup + repeats}", "model.hidden_dropout=0.0",
                     "model.attention_dropout=0.0", "optimizer=nvlamb"]
        results = [r["result"] for r in h.launch(_run, d, overrides, warmup, repeats, variants)]
        out = results[0]
        for variant in variants:  # median over steps of each phase, then mean over workers
            per_rank = [{k: h.median([p[k] for p in r["phases"][variant]]) for k in _PHASES} for r in results]
            phase_rows.append([d, variant] + [statistics.fmean(x[k] for x in per_rank) for k in _PHASES])
        for method in ("gpipe", "1f1b"):
            if f"ours-{method}" not in variants or f"torch-{method}" not in variants:
                continue
            ours, theirs = out["times"][f"ours-{method}"], out["times"][f"torch-{method}"]
            ratios = [a / t for a, t in zip(ours, theirs)]  # pairs measured back to back
            dloss = max(abs(x - y) for lo, lt in zip(out["losses"][f"ours-{method}"], out["losses"][f"torch-{method}"])
                        for x, y in zip(lo, lt))
            rows.append([d, method, 1e3 * h.median(ours), 1e3 * h.median(theirs),
                         h.median(ours) / h.median(theirs), h.median(ratios),
                         f"{min(ratios):.2f}-{max(ratios):.2f}", 1e3 * min(ours), 1e3 * min(theirs),
                         min(ours) / min(theirs), f"{dloss:.1e}"])
        notes.append(f"D={d}: {h.caveat(d)}")
    print(f"{args.model}, N={args.micro_batches}, B={b}, seq 128, fp32, NVLAMB, dropout 0, "
          f"{repeats} measured steps per variant after {warmup} warm-up, interleaved; gloo on CPU")
    print(h.table(["D", "schedule", "ours ms", "torch ms", "ours/torch", "paired ratio", "paired range",
                   "ours min ms", "torch min ms", "ours/torch (min)", "max abs Δloss"], rows))
    print("ms: median step time; paired ratio: median over rounds of ours/torch measured back to back; "
          "min: the least disturbed step of each (robust to other jobs on the machine)")
    print()
    print("Where a step's time goes (ms per worker: median over steps, mean over workers)")
    print(h.table(["D", "variant", *_PHASES], phase_rows))
    for line in notes:
        print(line)
    print(f"Machine: {load_before} before, {h.load()} after (other jobs on the machine count too).")


if __name__ == "__main__":
    h.main_guard(main)
