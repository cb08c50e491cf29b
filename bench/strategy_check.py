"""The strategy search's predictions beside measured runs at world 2 (issue 27): pp=2, dp=2, sdp=2, tp=2.

    python bench/strategy_check.py --out /tmp/round --run      # measure collectives + compute, run the four, compare
    python bench/strategy_check.py --out /tmp/round            # compare runs already in --out

``--run`` measures (``python -m pipefisher.measure.collectives --model bert-mini``) and then trains each
configuration for ``--steps`` steps on bert-mini, global batch 32, micro-batch 8 (each run in
``<out>/<name>``), with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed buffers leave the resident set.
The table: the search's step time (simulated, with the measured collectives and compute rates of the
same session) beside the median measured step after the first; its peak memory per worker (model state,
activations, sync buffers) beside the measured peak resident set less the process's before its model
was built (the interpreter and torch). CPU timings mean something only with workers <= cores, and on a
shared machine they follow its load: compare predictions with runs of the same session.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipefisher.model.config import BertConfig  # noqa: E402
from pipefisher.planning.comm_costs import CommCosts  # noqa: E402
from pipefisher.planning.costs import Hardware  # noqa: E402
from pipefisher.planning.strategy_search import search_strategies  # noqa: E402

RUNS = {  # name: (train.py keys, (pp, dp, sdp, tp, method))
    "pp2": (["stages=2", "pipeline=1f1b", "num_micro_batches=4"], (2, 1, 1, 1, "1f1b")),
    "dp2": (["stages=1", "data_parallel=2", "num_micro_batches=2"], (1, 2, 1, 1, "gpipe")),
    "sdp2": (["stages=1", "sdp=2", "num_micro_batches=2"], (1, 1, 2, 1, "gpipe")),
    "tp2": (["stages=1", "tp=2", "num_micro_batches=4"], (1, 1, 1, 2, "gpipe")),
}
COMMON = ["model=bert-mini", "micro_batch_size=8", "global_batch_size=32", "progress=false", "save_final=false",
          "log_every=100"]


def _run(out: Path, steps: int) -> None:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "WANDB_MODE": "disabled"}
    subprocess.run([sys.executable, "-m", "pipefisher.measure.collectives", "--out", str(out / "coll.json"),
                    "--max-bytes", "64m", "--model", "bert-mini", "--micro-batch-sizes", "8"], cwd=REPO, env=env,
                   check=True)
    for name, (keys, _) in RUNS.items():
        subprocess.run([sys.executable, "train.py", *COMMON, *keys, f"steps={steps}", f"hydra.run.dir={out / name}"],
                       cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _measured(folder: Path) -> tuple[float, float] | None:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steady = rows[1:]
    step = statistics.median(r["step_time_s"] for r in steady)
    base = rows[-1]["memory_baseline_per_worker_bytes"]
    peaks = [max(col) for col in zip(*(r["peak_memory_per_worker_bytes"] for r in steady))]
    return step, max(p - b for p, b in zip(peaks, base))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--run", action="store_true", help="measure and train first")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.run:
        _run(args.out, args.steps)
    comm = CommCosts.from_json(args.out / "coll.json", Hardware())
    found = search_strategies(BertConfig.from_size("mini"), devices=2, memory_gb=100, global_batch=32, comm=comm,
                              methods=["gpipe", "1f1b"], micro_batch_sizes=[8], optimizers=["nvlamb"],
                              recompute=[False], sdp_degrees=[1, 2], tp_degrees=[1, 2], seq_len=128, max_predictions=20)
    by_shape = {(c.stages, c.dp, c.sdp, c.tp, c.method): c for c in found if c.excluded is None}
    print(comm.describe())
    print(f"{'run':>5} {'pred step s':>11} {'meas step s':>11} {'ratio':>6} {'pred MB':>8} {'meas MB':>8} {'ratio':>6}")
    rows = []
    for name, (_, shape) in RUNS.items():
        c = by_shape[shape]
        got = _measured(args.out / name)
        if got is None:
            print(f"{name:>5} {c.step_time_s:>11.3f} {'-':>11}")
            continue
        step, mem = got
        rows.append((name, c.step_time_s, step, c.memory_gb * 1e3, mem / 1e6))
        print(f"{name:>5} {c.step_time_s:>11.3f} {step:>11.3f} {step / c.step_time_s:>6.2f} {c.memory_gb * 1e3:>8.0f} "
              f"{mem / 1e6:>8.0f} {mem / 1e6 / (c.memory_gb * 1e3):>6.2f}")
    print("ranking predicted:", " > ".join(r[0] for r in sorted(rows, key=lambda r: r[1])))
    print("ranking measured: ", " > ".join(r[0] for r in sorted(rows, key=lambda r: r[2])))


if __name__ == "__main__":
    main()
