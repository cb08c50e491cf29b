"""Split backward against a full one on one BERT stage: (I+W)/B, and where the difference goes.

    python bench/split_backward.py                          # bert-mini, stages 0 and 1 of D=2, B=4, 40 rounds
    python bench/split_backward.py --model bert-medium      # the same for bert-medium
    python bench/split_backward.py --stage encoder          # the encoder layers alone (no embeddings, no heads)
    python bench/split_backward.py --repeats 10 --no-profile   # a quick look

One process, one intra-op thread (what each of two pipeline workers gets on two cores, DESIGN.md
"Conventions"). The stage is the module the pipeline runs: ``runtime.build.build_stage_modules``
of a 2-stage zb-h1 run (``--stage 0`` / ``--stage 1``), or ``BertStage`` over the encoder layers
(``--stage encoder``). Two copies with the same weights: ``plain`` keeps ``nn.Linear``'s own
backward (autograd's, what every schedule's B ran before the executor accumulated in place),
``split`` has ``enable_split_backward`` (what every schedule runs now). Every round times, on the
same micro-batch and upstream gradient, after an untimed forward each:

- ``B``: a full backward of ``plain`` (autograd's, cost 1 in the ``/B`` ratios);
- ``Bd``: a full backward of ``split`` outside ``deferring`` and ``accumulating`` (autograd's own
  weight gradients through the deferrable layers);
- ``Ba``: a full backward of ``split`` under ``accumulating``: what every schedule's B runs since
  ``executor`` adds weight gradients in place ([Note: a full backward accumulates in place]), so
  ``(I+W)/Ba`` is the split's cost against the B it replaces;
- ``I`` then ``W``: the split backward of ``split`` (``executor._backward`` under ``deferring``,
  then ``apply_weight_grads``), timed separately.

The order of the variants rotates every round and the ratios are paired per round ([Note:
measuring on a shared CPU] in ``_harness``): the table gives their median and range. Gradients
accumulate across rounds as over a step's micro-batches (every ``.grad`` exists after the
warm-up), so the B side pays autograd's accumulation and the W side its own. Minor page faults
(``ru_minflt``) per action show fresh memory being touched.

The profile (``torch.profiler``, CPU, a few rounds of each after the timing) lists the ops whose
self time differs most between B and I+W, per backward.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

import _harness as h
from pipefisher.data.synthetic import SyntheticSource
from pipefisher.model import BertStage
from pipefisher.model.rng import dropout_key
from pipefisher.run_spec import bert_config
from pipefisher.runtime.build import build_stage_modules, schedule_for
from pipefisher.runtime.split_backward import accumulating, apply_weight_grads, deferring, enable_split_backward

VARIANTS = ("B", "Bd", "Ba", "IW")


class _Case:
    """One stage, its two copies, a micro-batch, the stage's input and the gradient B starts from."""

    def __init__(self, args: argparse.Namespace, stage: str) -> None:
        overrides = [f"model={args.model}", "stages=2", "pipeline=zb-h1", f"micro_batch_size={args.micro_batch}",
                     "num_micro_batches=2", *args.set]
        cfg = h.compose(overrides)
        bert = bert_config(cfg)
        if stage == "encoder":
            module = BertStage(bert, 1, bert.num_layers, seed=cfg.seed)
        else:
            schedule = schedule_for(cfg)
            module = build_stage_modules(cfg, schedule, int(stage))[(0, int(stage))]
        self.name = f"{stage} ({module.extra_repr()})"
        self.plain = module.train()
        self.split = copy.deepcopy(module)
        enable_split_backward([self.split])
        s, hid = cfg.data.seq_len, bert.hidden_size
        source = SyntheticSource(seq_len=s, max_predictions=cfg.data.max_predictions, vocab_size=bert.vocab_size,
                                 seed=0)
        self.batch = source.get_samples(range(args.micro_batch))
        gen = torch.Generator().manual_seed(0)
        self.hidden = None if module.has_embeddings else torch.randn(args.micro_batch, s, hid, generator=gen)
        self.grad_out = None if module.has_heads else torch.randn(args.micro_batch, s, hid, generator=gen) * 1e-3

    def forward(self, module: BertStage) -> Tensor:
        """The stage's forward as ``executor._forward`` runs it (a fresh leaf input, a dropout key)."""
        x = None if self.hidden is None else self.hidden.clone().requires_grad_(True)
        with dropout_key(0, 0):
            return module(x, self.batch)

    def backward(self, y: Tensor) -> None:
        """``executor._backward``'s autograd call: the losses' sum, or y with the received gradient."""
        if y.dim() == 1:
            (y.float().sum() * 0.5).backward()
        else:
            torch.autograd.backward(y, self.grad_out)


class _Clock:
    """Wall (``perf_counter``) and this thread's CPU time (``thread_time``: on one intra-op thread the
    whole backward runs on it, and time the scheduler gives other processes is not counted), and
    minor page faults (``ru_minflt``), read together."""

    def __init__(self) -> None:
        self.last = self._read()
        self.parts: dict[str, float] = {}

    @staticmethod
    def _read() -> tuple[float, float, int]:
        return time.perf_counter(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def mark(self, name: str | None) -> None:
        """End the interval since the last mark; record it as ``name`` (wall s, ``name_cpu`` CPU s,
        ``flt_name`` faults), or leave it out when ``name`` is None."""
        now = self._read()
        if name is not None:
            a = self.last
            self.parts[name], self.parts[f"{name}_cpu"], self.parts[f"flt_{name}"] = \
                now[0] - a[0], now[1] - a[1], now[2] - a[2]
        self.last = now


def _run(case: _Case, variant: str, fresh: bool = False, cold: bool = False) -> dict[str, float]:
    """One untimed forward, then the timed backward of ``variant``: seconds (wall and CPU) and page
    faults per part (B, Bd, Ba, or I and W and their sum IW).

    Args:
        fresh: set every ``.grad`` to None first (a step's first micro-batch) instead of accumulating.
        cold: run an untimed forward between I and W, as a schedule runs other actions there.
    """
    module = case.plain if variant == "B" else case.split
    if fresh:
        module.zero_grad(set_to_none=True)
    y = case.forward(module)
    clock = _Clock()
    if variant != "IW":
        with accumulating() if variant == "Ba" else contextlib.nullcontext():
            case.backward(y)
        clock.mark(variant)
        return clock.parts
    with deferring([]) as store:
        case.backward(y)
    clock.mark("I")
    if cold:
        case.forward(case.plain)
        clock.mark(None)
    apply_weight_grads(store)
    clock.mark("W")
    out = clock.parts
    for suffix in ("", "_cpu"):
        out[f"IW{suffix}"] = out[f"I{suffix}"] + out[f"W{suffix}"]
    out["flt_IW"] = out["flt_I"] + out["flt_W"]
    return out


def _time(case: _Case, warmup: int, repeats: int, fresh: bool, cold: bool) -> dict[str, list[float]]:
    """``repeats`` rounds of every variant, the order rotated each round; per-round seconds and faults."""
    for _ in range(warmup):
        for v in VARIANTS:
            _run(case, v, fresh, cold)
    out: dict[str, list[float]] = defaultdict(list)
    for r in range(repeats):
        order = h.rotated(VARIANTS, r)
        if r // len(VARIANTS) % 2:
            order = order[::-1]
        for v in order:
            for k, val in _run(case, v, fresh, cold).items():
                out[k].append(val)
    return out


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def _timing_rows(t: dict[str, list[float]]) -> tuple[list[list], list[list]]:
    """Rows of the time table (median and min ms, wall and CPU; faults) and of the paired ratios
    (per round, by CPU time and by wall time: median, range, quartiles)."""
    ms = [[k, 1e3 * statistics.median(t[k]), 1e3 * min(t[k]), 1e3 * statistics.median(t[f"{k}_cpu"]),
           1e3 * min(t[f"{k}_cpu"]), statistics.median(t[f"flt_{k}"])] for k in ("B", "Bd", "Ba", "I", "W", "IW")]
    rows = []
    for suffix, clock in (("_cpu", "cpu"), ("", "wall")):
        for name, num, den in (("(I+W)/Ba", "IW", "Ba"), ("(I+W)/B", "IW", "B"), ("I/B", "I", "B"), ("W/B", "W", "B"),
                               ("Bd/B", "Bd", "B"), ("Ba/B", "Ba", "B")):
            r = [x / y for x, y in zip(t[f"{num}{suffix}"], t[f"{den}{suffix}"])]
            q = statistics.quantiles(r, n=4)
            rows.append([f"{name} {clock}", statistics.median(r), _spread(r), q[0], q[2]])
    return ms, rows


def _profile_ops(fn: Callable[[], None]) -> dict[str, tuple[int, float]]:
    """op name -> (calls, self CPU ms) of one call of ``fn``, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}


def _add(into: dict[str, list[float]], ops: dict[str, tuple[int, float]], rounds: int) -> None:
    for name, (n, ms) in ops.items():
        into[name][0] += n / rounds
        into[name][1] += ms / rounds


def _profile(case: _Case, rounds: int, top: int, fresh: bool = False) -> list[list]:
    """The ops whose self time per backward differs most between B and I+W, as rows (op, calls in
    B, calls in I+W, self ms in B, I, W, and I+W-B), then the totals; forwards run outside the profiler."""
    per: dict[str, dict[str, list[float]]] = {k: defaultdict(lambda: [0.0, 0.0]) for k in ("B", "I", "W")}
    for _ in range(rounds):
        if fresh:
            case.plain.zero_grad(set_to_none=True)
            case.split.zero_grad(set_to_none=True)
        y = case.forward(case.plain)
        _add(per["B"], _profile_ops(lambda: case.backward(y)), rounds)
        y = case.forward(case.split)
        store: list = []

        def input_part() -> None:
            with deferring(store):
                case.backward(y)

        _add(per["I"], _profile_ops(input_part), rounds)
        _add(per["W"], _profile_ops(lambda: apply_weight_grads(store)), rounds)
    zero = [0.0, 0.0]
    rows = []
    for name in set(per["B"]) | set(per["I"]) | set(per["W"]):
        b, i, w = (per[k].get(name, zero) for k in ("B", "I", "W"))
        rows.append([name, b[0], i[0] + w[0], b[1], i[1], w[1], i[1] + w[1] - b[1]])
    rows.sort(key=lambda r: -abs(r[-1]))
    total = ["(all ops)", *(sum(r[c] for r in rows) for c in range(1, 7))]
    return rows[:top] + [total]


def _apply_concatenated(stores: list[list]) -> None:
    """W of several micro-batches of one stage as one product per weight over their concatenated
    rows (torch.cat of the g and x operands, then one addmm_ / index_add_), the issue's proposal for
    back-to-back Ws; what ``apply_weight_grads`` does one store at a time."""
    for entries in zip(*stores):  # every store files the same weights in the same order
        param = entries[0][0]
        g = torch.cat([e[1] for e in entries])
        x = torch.cat([e[2] for e in entries])
        apply_weight_grads([(param, g, x)])
    for store in stores:
        store.clear()


def _time_concatenated(case: _Case, k: int, rounds: int) -> list[list]:
    """k pending Ws of the stage applied one after the other against concatenated, paired per round
    (every ``.grad`` exists, the order alternates); rows for the table."""
    def stores() -> list[list]:
        out = []
        for _ in range(k):
            y = case.forward(case.split)
            with deferring([]) as store:
                case.backward(y)
            out.append(store)
        return out

    times: dict[str, list[float]] = defaultdict(list)
    for r in range(rounds + 1):
        for variant in (("separate", "concatenated") if r % 2 else ("concatenated", "separate")):
            pending = stores()
            t0 = time.thread_time()
            if variant == "separate":
                for store in pending:
                    apply_weight_grads(store)
            else:
                _apply_concatenated(pending)
            if r:  # round 0 warms up
                times[variant].append(time.thread_time() - t0)
    ratio = [c / s for c, s in zip(times["concatenated"], times["separate"])]
    return [[f"{k} Ws separate", 1e3 * statistics.median(times["separate"]), "", ""],
            [f"{k} Ws concatenated", 1e3 * statistics.median(times["concatenated"]), statistics.median(ratio),
             _spread(ratio)]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert-mini")
    parser.add_argument("--stage", default="0,1", help="comma-separated: 0, 1 (of a 2-stage partition), encoder")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=40, help="timed rounds (each: B, Bd, Ba, I+W)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: a worker of D=2 on 2 cores)")
    parser.add_argument("--fresh-grads", action="store_true",
                        help="every .grad None before each backward (a step's first micro-batch), not accumulating")
    parser.add_argument("--cold", action="store_true", help="an untimed forward between I and W (as in a schedule)")
    parser.add_argument("--concat-ws", type=int, default=0,
                        help="also time this many back-to-back Ws applied separately against concatenated")
    parser.add_argument("--profile-rounds", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--top", type=int, default=15, help="rows of the op table")
    parser.add_argument("--set", action="append", default=[], help="extra train.py override (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.model}, seq 128, micro-batch {args.micro_batch}, {args.threads} thread(s), "
          f"{args.repeats} rounds after {args.warmup} warm-up{', fresh grads' if args.fresh_grads else ''}"
          f"{', a forward between I and W' if args.cold else ''}; {h.load()} at the start")
    for stage in args.stage.split(","):
        case = _Case(args, stage.strip())
        t = _time(case, args.warmup, args.repeats, args.fresh_grads, args.cold)
        ms, ratios = _timing_rows(t)
        print(f"\nstage {case.name}")
        print(h.table(["action", "median ms", "min ms", "median CPU ms", "min CPU ms", "minor faults"], ms))
        print()
        print(h.table(["paired ratio", "median", "range", "q1", "q3"], ratios))
        if args.concat_ws > 1:
            print(f"\n{args.concat_ws} pending Ws of the stage, CPU ms (median of {args.repeats} paired rounds)")
            print(h.table(["W", "median CPU ms", "concatenated / separate", "range"],
                          _time_concatenated(case, args.concat_ws, args.repeats)))
        if not args.no_profile:
            print(f"\nops by |I+W - B| self time, ms per backward (torch.profiler, {args.profile_rounds} rounds)")
            print(h.table(["op", "calls B", "calls I+W", "B ms", "I ms", "W ms", "I+W-B ms"],
                          _profile(case, args.profile_rounds, args.top, args.fresh_grads)))
    print(f"\n{h.load()} at the end")


if __name__ == "__main__":
    h.main_guard(main)
