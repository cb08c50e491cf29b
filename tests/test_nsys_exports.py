"""Planning from real Nsight Systems exports, and a profile.sqlite / timeline.json that tools read
(issue 15).

The databases here are built inside the tests from the column lists of NVIDIA's published export
schema (``nsys export --type sqlite``, schema 3.x), not from our writer: a GPU run of four
processes (one per rank, pids not in rank order), CUDA kernels joined to their runtime calls on
correlationId, names partly in ``text`` and partly through ``textId`` → ``StringIds``, backward
kernels launched from PyTorch's autograd thread, a slower warm-up step, and CPU ranges that are
either launch windows (88 µs, the normal case on a GPU) or cover their kernels. Each numbered
defect of the issue has a test below named for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from pipefisher.planning.cli import plan_run
from pipefisher.planning.config import register_schedule_configs, to_schedule_config
from pipefisher.planning.costs import RunShape, costs_from_profile
from pipefisher.profiling import ProfileError, read_nsys, read_profile
from pipefisher.profiling.nvtx import mark_rank
from pipefisher.schedules import build_schedule
from pipefisher.simulate import CostModel, simulate
from pipefisher.timeline import COMPUTE_KINDS, Event
from tests.conftest import REPO

# --- NVIDIA's export schema: the column lists of the tables these tests write ------------------

COLUMNS: dict[str, tuple[str, ...]] = {
    "StringIds": ("id", "value"),
    "ThreadNames": ("nameId", "priority", "globalTid"),
    "PROCESSES": ("globalPid", "pid", "name"),
    "META_DATA_EXPORT": ("name", "value"),
    "TARGET_INFO_SESSION_START_TIME": ("utcEpochNs", "utcTime", "localTime"),
    "ENUM_NSYS_EVENT_TYPE": ("id", "name", "label"),
    "NVTX_EVENTS": ("start", "end", "eventType", "rangeId", "category", "color", "text", "globalTid",
                    "endGlobalTid", "textId", "domainId", "uint64Value", "int64Value", "doubleValue",
                    "uint32Value", "int32Value", "floatValue", "jsonTextId", "jsonText", "binaryData"),
    "CUPTI_ACTIVITY_KIND_RUNTIME": ("start", "end", "eventClass", "globalTid", "correlationId", "nameId",
                                    "returnValue", "callchainId"),
    "CUPTI_ACTIVITY_KIND_KERNEL": ("start", "end", "deviceId", "contextId", "greenContextId", "streamId",
                                   "correlationId", "globalPid", "demangledName", "shortName", "mangledName",
                                   "launchType", "cacheConfig", "registersPerThread", "gridX", "gridY", "gridZ",
                                   "blockX", "blockY", "blockZ", "staticSharedMemory", "dynamicSharedMemory",
                                   "localMemoryPerThread", "localMemoryTotal", "gridId", "sharedMemoryExecuted",
                                   "graphNodeId", "sharedMemoryLimitConfig"),
}
NOT_NULL_ZERO = {"eventClass", "returnValue", "deviceId", "contextId", "streamId", "registersPerThread", "gridX",
                 "gridY", "gridZ", "blockX", "blockY", "blockZ", "staticSharedMemory", "dynamicSharedMemory",
                 "localMemoryPerThread", "localMemoryTotal", "gridId", "demangledName", "shortName", "nameId"}
MARK, PUSH_POP = 34, 59
PIDS = (7300, 7100, 7400, 7200)  # rank r runs as process PIDS[r]: pid order is not rank order
UTC0 = 1_790_000_000_000_000_000


def gtid(pid: int, tid: int) -> int:
    """nsys's serialized thread id (a hardware id above pid and tid)."""
    return (1 << 48) | (pid << 24) | tid


class Export:
    """Rows of an nsys export, written to SQLite with the schema's columns."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict]] = defaultdict(list)
        self.strings: dict[str, int] = {}

    def string(self, value: str) -> int:
        if value not in self.strings:
            self.strings[value] = len(self.strings) + 1
            self.add("StringIds", id=self.strings[value], value=value)
        return self.strings[value]

    def add(self, table: str, **values) -> None:
        assert set(values) <= set(COLUMNS[table]), set(values) - set(COLUMNS[table])
        self.rows[table].append(values)

    def write(self, path: Path, omit: Iterable[str] = ()) -> Path:
        conn = sqlite3.connect(path)
        with conn:
            for table, cols in COLUMNS.items():
                if table in omit:
                    continue
                conn.execute(f"CREATE TABLE {table} ({', '.join(cols)})")
                for row in self.rows.get(table, []):
                    full = [row.get(c, 0 if c in NOT_NULL_ZERO else None) for c in cols]
                    conn.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(cols))})", full)
        conn.close()
        return path


# --- a GPU run of 4 ranks, as nsys records it -------------------------------------------------

TRUE_COST = CostModel(forward_ns=(1_100_000, 1_400_000, 1_600_000, 1_900_000),
                      backward_ns=(2_300_000, 2_800_000, 3_300_000, 3_900_000), p2p_ns=40_000, step_ns=300_000)
WARM_COST = replace(TRUE_COST, forward_ns=tuple(4 * f for f in TRUE_COST.forward_ns))  # cudnn autotune, allocator
WINDOW_NS = 88_000  # a launch window: the CPU range ends when its kernels are queued
START_NS = 2_000_000  # the first step starts 2 ms into the capture (a range before 0 began before it)


def gpu_truth(method: str = "gpipe", steps: int = 3) -> list[Event]:
    """What the GPUs did: step 0 (warm-up, slower forwards) then steps 1.. at TRUE_COST."""
    schedule = build_schedule(method, 4, 4)
    warm = simulate(schedule, WARM_COST, steps=1)
    gap = 500_000
    rest = simulate(schedule, TRUE_COST, steps=steps - 1)
    shift = max(e.end_ns for e in warm) + gap - min(e.start_ns for e in rest)
    events = warm + [replace(e, start_ns=e.start_ns + shift, end_ns=e.end_ns + shift, step=e.step + 1) for e in rest]
    return [replace(e, start_ns=e.start_ns + START_NS, end_ns=e.end_ns + START_NS) for e in events]


@dataclass
class Run:
    """How the export records the run."""

    launch_windows: bool = True  # CPU ranges are launch windows (else they cover their kernels)
    marks: bool = True  # each process recorded NVTX mark rank=N
    enclosing_step: bool = False  # a user range "STEP" around each iteration
    rank_shift_ns: tuple[int, ...] = (0, 0, 0, 0)  # per-rank clock shift (per-rank exports)


def record(truth: Sequence[Event], run: Run, ranks: Iterable[int] = range(4)) -> Export:
    """The export of ``ranks`` of a run whose GPUs did ``truth``."""
    ex = Export()
    for i, name in ((MARK, "NvtxMark"), (PUSH_POP, "NvtxPushPopRange"), (60, "NvtxStartEndRange")):
        ex.add("ENUM_NSYS_EVENT_TYPE", id=i, name=name, label=name)
    ex.add("META_DATA_EXPORT", name="EXPORT_SCHEMA_VERSION", value="3.16.1")
    ranks = list(ranks)
    shift = run.rank_shift_ns[ranks[0]] if len(ranks) == 1 else 0
    ex.add("TARGET_INFO_SESSION_START_TIME", utcEpochNs=UTC0 + shift, utcTime="t", localTime="t")
    corr = 0
    for r in ranks:
        pid = PIDS[r]
        main, autograd = gtid(pid, pid), gtid(pid, pid + 1)
        ex.add("PROCESSES", globalPid=main & ~0xFFFFFF, pid=pid, name="python")
        ex.add("ThreadNames", nameId=ex.string("python"), priority=0, globalTid=main)
        ex.add("ThreadNames", nameId=ex.string("pt_autograd_0"), priority=0, globalTid=autograd)
        if run.marks:
            ex.add("NVTX_EVENTS", start=10, eventType=MARK, text=f"rank={r}", globalTid=main, domainId=0)
        mine = sorted((e for e in truth if e.worker == r), key=lambda e: (e.start_ns, e.end_ns))
        for step in sorted({e.step for e in mine}) if run.enclosing_step else ():
            evs = [e for e in mine if e.step == step]
            ex.add("NVTX_EVENTS", start=evs[0].start_ns - 1000, end=max(e.end_ns for e in evs) + 1000,
                   eventType=PUSH_POP, text="STEP", globalTid=main, domainId=0)
        for e in mine:
            start, end = e.start_ns, e.end_ns
            name = {"textId": ex.string(e.name)} if e.kind == "F" else {"text": e.name}  # registered or not
            if e.kind not in COMPUTE_KINDS:  # messages: no kernel, the CPU range is the wait
                ex.add("NVTX_EVENTS", start=start, end=end, eventType=PUSH_POP, globalTid=main, domainId=0, **name)
                continue
            cpu_end = start + WINDOW_NS if run.launch_windows else end
            ex.add("NVTX_EVENTS", start=start, end=cpu_end, eventType=PUSH_POP, globalTid=main, domainId=0, **name)
            launcher = autograd if e.kind == "B" else main  # torch's autograd thread launches backward kernels
            cuts = [start + (end - start) * k // 3 for k in range(4)]
            for k in range(3):
                corr += 1
                ex.add("CUPTI_ACTIVITY_KIND_RUNTIME", start=start + 1000 * k, end=start + 1000 * k + 800,
                       eventClass=1, globalTid=launcher, correlationId=corr, nameId=ex.string("cudaLaunchKernel"))
                ex.add("CUPTI_ACTIVITY_KIND_KERNEL", start=cuts[k], end=cuts[k + 1], deviceId=r, streamId=7,
                       correlationId=corr, globalPid=main & ~0xFFFFFF, shortName=ex.string("gemm"),
                       demangledName=ex.string("gemm"))
    if shift:
        for table in ("NVTX_EVENTS", "CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_KERNEL"):
            for row in ex.rows[table]:
                for col in ("start", "end"):
                    if row.get(col) is not None:
                        row[col] -= shift  # this capture's clock: timestamp 0 is its own session start
    return ex


def plan_cfg(path: str | Path, *keys: str):
    register_schedule_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_schedule_config(compose(config_name="schedule", overrides=[
            f"from={path}", "plot=false", "model=bert-tiny", "micro_batch_size=4", *keys]))


def plan(path: str | Path, tmp_path: Path, *keys: str):
    requested = {"from", "plot", "model", "micro_batch_size", *(k.split("=")[0] for k in keys)}
    return plan_run(plan_cfg(path, *keys), tmp_path / "plan", requested=requested)


def by_time(events: Iterable[Event]) -> list[Event]:
    return sorted(events, key=lambda e: (e.start_ns, e.worker, e.end_ns, e.name))


@pytest.fixture(scope="module")
def truth() -> list[Event]:
    return gpu_truth()


@pytest.fixture(scope="module")
def exports(truth: list[Event], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("exports")
    return {"windows": record(truth, Run()).write(d / "windows.sqlite"),
            "covering": record(truth, Run(launch_windows=False)).write(d / "covering.sqlite")}


# --- 1. GPU time ---------------------------------------------------------------------------------

def test_1_launch_windows_plan_like_ranges_that_cover_the_gpu_work(exports: dict[str, Path], truth: list[Event],
                                                                   tmp_path: Path) -> None:
    windows, covering = plan(exports["windows"], tmp_path / "w", "stages=4"), \
        plan(exports["covering"], tmp_path / "c", "stages=4")
    assert windows.comparison.nvlamb.utilization == covering.comparison.nvlamb.utilization
    assert windows.comparison.pipefisher.utilization == covering.comparison.pipefisher.utilization
    assert windows.measured == covering.measured
    assert "kernel time of CUDA kernels" in windows.summary
    cost = costs_from_profile(read_profile(exports["windows"], warmup_steps=1), windows.run)
    assert cost.forward_ns == TRUE_COST.forward_ns and cost.backward_ns == TRUE_COST.backward_ns  # not 88 µs
    true_split = covering.measured.utilization
    cpu = plan(exports["windows"], tmp_path / "cpu", "stages=4", "gpu=false")  # what the planner did before
    assert cpu.measured.utilization < 0.2 < true_split  # launch windows alone look idle, kernels do not


# --- 2. negative p2p latency --------------------------------------------------------------------

def test_2_receives_that_end_before_their_send_do_not_crash_the_planner(truth: list[Event], tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    skew = [replace(e, start_ns=e.start_ns - 5_000_000, end_ns=e.end_ns - 5_000_000)
            if e.worker == 1 else e for e in truth]  # rank 1's clock runs 5 ms behind: its receives "end early"
    path = record(skew, Run()).write(tmp_path / "skewed.sqlite")
    with caplog.at_level(logging.WARNING):
        result = plan(path, tmp_path, "stages=4")
    assert result.comparison.nvlamb.step_time_s > 0
    assert "ended before their send started" in caplog.text and "skewed.sqlite" in caplog.text
    cost = costs_from_profile(read_profile(path, warmup_steps=1), result.run)
    assert cost.p2p_ns >= 0


# --- 3. backward kernels from the autograd thread -----------------------------------------------

def test_3_backward_kernels_launched_from_the_autograd_thread_count(exports: dict[str, Path],
                                                                    truth: list[Event]) -> None:
    profile = read_nsys(exports["windows"])
    backwards = [e for e in profile.events if e.kind == "B"]
    assert len(backwards) == len([e for e in truth if e.kind == "B"])
    assert by_time(backwards) == by_time(e for e in truth if e.kind == "B")  # kernel spans, not launch windows


# --- 4. the warm-up step ------------------------------------------------------------------------

def test_4_the_warm_up_step_is_skipped(exports: dict[str, Path], truth: list[Event], tmp_path: Path) -> None:
    profile = read_profile(exports["windows"], warmup_steps=1)
    assert by_time(profile.events) == by_time(e for e in truth if e.step >= 1)
    result = plan(exports["windows"], tmp_path, "stages=4")  # warmup_steps=1 by default
    assert result.measured.num_steps == 2
    with_warm = plan(exports["windows"], tmp_path / "all", "stages=4", "warmup_steps=0")
    assert with_warm.measured.num_steps == 3
    with pytest.raises(ValueError, match=r"warmup_steps=3 skips every step of the 3 it holds.*warmup_steps=0"):
        plan(exports["windows"], tmp_path / "none", "stages=4", "warmup_steps=3")


# --- 5. ranks ----------------------------------------------------------------------------------

def test_5_ranks_come_from_rank_marks_not_pid_order(exports: dict[str, Path], truth: list[Event],
                                                    tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    profile = read_nsys(exports["windows"])
    assert by_time(profile.events) == by_time(truth) and not profile.notes
    assert [(w, (info.global_tid >> 24) & 0xFFFFFF) for w, info in profile.workers.items()] == list(enumerate(PIDS))
    unmarked = record(truth, Run(marks=False)).write(tmp_path / "unmarked.sqlite")
    with caplog.at_level(logging.WARNING):
        guessed = read_nsys(unmarked)
    assert "ranks taken from pid order" in guessed.notes[0] and "mark_rank" in caplog.text
    assert by_time(guessed.events) != by_time(truth)  # the pids were not in rank order
    assert "ranks taken from pid order" in plan(unmarked, tmp_path, "stages=4").summary


def test_5_per_rank_file_names_give_ranks_when_marks_are_missing(truth: list[Event], tmp_path: Path) -> None:
    for r in range(4):
        record(truth, Run(marks=False), ranks=[r]).write(tmp_path / f"report_rank{r}.sqlite")
    profile = read_nsys(str(tmp_path / "report_rank*.sqlite"))
    assert by_time(profile.events) == by_time(truth) and not profile.notes


def test_mark_rank_is_a_no_op_without_cuda() -> None:
    assert mark_rank(3) is torch.cuda.is_available()
    with pytest.raises(ValueError, match="rank=-1"):
        mark_rank(-1)


# --- 6. run keys --------------------------------------------------------------------------------

def test_6_method_stages_and_micro_batches_come_from_the_profile(exports: dict[str, Path], tmp_path: Path) -> None:
    result = plan(exports["windows"], tmp_path, "stages=4", "num_micro_batches=4")  # no pipeline= given
    assert (result.run.method, result.run.stages, result.run.num_micro_batches) == ("gpipe", 4, 4)
    assert "pipeline=gpipe" in result.summary
    with pytest.raises(ValueError, match=r"num_micro_batches=8 \(the profile has 4: micro-batches 0-3\)"):
        plan(exports["windows"], tmp_path, "num_micro_batches=8")
    with pytest.raises(ValueError, match=r"pipeline.method=1f1b \(the profile's order .* is gpipe\)"):
        plan(exports["windows"], tmp_path, "pipeline=1f1b")
    with pytest.raises(ValueError, match=r"stages=2 \(the profile has 4"):
        plan(exports["windows"], tmp_path, "stages=2")


def test_6_a_1f1b_profile_is_read_as_1f1b(tmp_path: Path) -> None:
    path = record(gpu_truth("1f1b", steps=2), Run()).write(tmp_path / "one.sqlite")
    assert plan(path, tmp_path, "micro_batch_size=4").run.method == "1f1b"


# --- 7. one export per rank ----------------------------------------------------------------------

def test_7_per_rank_exports_combine_on_one_clock(truth: list[Event], exports: dict[str, Path],
                                                 tmp_path: Path) -> None:
    shifts = (0, 3_000_000_011, 7_000_000_003, 11_000_000_007)  # each capture started at its own time
    lead = 12_000_000_000  # the run starts after every capture did (a range before a capture marks a partial step)
    truth = [replace(e, start_ns=e.start_ns + lead, end_ns=e.end_ns + lead) for e in truth]
    files = [record(truth, Run(rank_shift_ns=shifts), ranks=[r]).write(tmp_path / f"gpu{r}.sqlite")
             for r in (2, 0, 3, 1)]
    combined = read_nsys(str(tmp_path / "gpu*.sqlite"))
    assert by_time(combined.events) == by_time(truth)
    assert read_nsys(",".join(map(str, files))).events == combined.events
    together = plan(str(tmp_path / "gpu*.sqlite"), tmp_path / "a", "stages=4")
    assert together.measured == plan(exports["windows"], tmp_path / "b", "stages=4").measured
    with pytest.raises(ValueError, match=r"no events of worker\(s\) \[0, 1\].*report_rank\*\.sqlite"):
        plan(files[0], tmp_path / "c", "stages=4", "num_micro_batches=4", "pipeline=gpipe")


# --- 8. an enclosing range named like an action ----------------------------------------------------

def test_8_an_enclosing_step_range_is_not_the_optimizer_step(truth: list[Event], tmp_path: Path) -> None:
    path = record(truth, Run(enclosing_step=True)).write(tmp_path / "enclosed.sqlite")
    profile = read_nsys(path)
    assert by_time(profile.events) == by_time(truth)
    steps_only = record([e for e in truth if e.kind != "STEP"], Run(enclosing_step=True)).write(tmp_path / "s.sqlite")
    bracketed = read_nsys(steps_only, gpu=False)  # no optimizer STEP range: the brackets count the steps
    assert {e.step for e in bracketed.events} == {0, 1, 2} and all(e.kind != "STEP" for e in bracketed.events)


# --- 9. damaged input ---------------------------------------------------------------------------

def _one_line(exc: pytest.ExceptionInfo, path: Path) -> str:
    text = str(exc.value)
    assert "\n" not in text and str(path) in text
    return text


def test_9_a_corrupt_page_is_one_line_naming_the_file_and_the_fix(exports: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "corrupt.sqlite"
    data = bytearray(exports["windows"].read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[2 * page:] = b"\xa5" * (len(data) - 2 * page)  # every page after the schema's is garbage
    path.write_bytes(bytes(data))
    with pytest.raises(ProfileError) as exc:
        read_profile(path)
    assert "damaged" in _one_line(exc, path) and "nsys export --type sqlite" in str(exc.value)


def test_9_an_empty_file_is_not_reported_as_a_missing_table(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    path.touch()
    with pytest.raises(ProfileError) as exc:
        read_profile(path)
    assert "empty (0 bytes)" in _one_line(exc, path) and "NVTX_EVENTS" not in str(exc.value)


def test_9_unterminated_ranges_drop_their_step_or_say_so(truth: list[Event], tmp_path: Path) -> None:
    ex = record(truth, Run())
    last = max(e.step for e in truth)
    cut = min(e.start_ns for e in truth if e.step == last and e.kind == "B")
    for row in ex.rows["NVTX_EVENTS"]:
        if row.get("end") is not None and row["end"] > cut:
            row["end"] = None  # the capture stopped at `cut`
    path = ex.write(tmp_path / "cut.sqlite")
    profile = read_nsys(path)
    assert {e.step for e in profile.events} == set(range(last)) and "never ended" in profile.notes[0]
    for row in ex.rows["NVTX_EVENTS"]:
        if row["eventType"] == PUSH_POP:
            row["end"] = None
    path = ex.write(tmp_path / "all_open.sqlite")
    with pytest.raises(ProfileError) as exc:
        read_nsys(path)
    assert "never ended" in _one_line(exc, path) and "capture whole steps" in str(exc.value)


def test_9_names_lost_with_string_ids_are_an_error_not_a_silent_drop(truth: list[Event], tmp_path: Path) -> None:
    path = record(truth, Run()).write(tmp_path / "nostrings.sqlite", omit={"StringIds"})
    with pytest.raises(ProfileError) as exc:
        read_nsys(path)
    assert "StringIds table is missing" in _one_line(exc, path)


# --- profile.sqlite answers NVIDIA-style queries; timeline.json ------------------------------------

# Event types of the Trace Event Format (Google's "Trace Event Format" document) and what each needs.
_TRACE_PHASES = {"X": ("name", "ts", "dur", "pid", "tid"), "M": ("name", "pid", "args"),
                 "B": ("name", "ts", "pid", "tid"), "E": ("ts", "pid", "tid"), "i": ("name", "ts", "pid")}
_METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name", "thread_sort_index"}


def validate_trace(doc: dict) -> list[dict]:
    """Check ``doc`` against the Trace Event Format (JSON object form); return its X events."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    complete = []
    for ev in doc["traceEvents"]:
        assert ev["ph"] in _TRACE_PHASES, ev
        for key in _TRACE_PHASES[ev["ph"]]:
            assert key in ev, (key, ev)
        assert isinstance(ev["pid"], int) and isinstance(ev.get("tid", 0), int)
        if ev["ph"] == "M":
            assert ev["name"] in _METADATA_NAMES and isinstance(ev["args"], dict)
        if ev["ph"] == "X":
            assert isinstance(ev["name"], str) and isinstance(ev.get("cat", ""), str)
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            complete.append(ev)
    by_thread = defaultdict(list)  # complete events on one thread must nest, never partly overlap
    for ev in complete:
        by_thread[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    for spans in by_thread.values():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start + 1e-9:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-9, (start, end, stack)
            stack.append(end)
    return complete


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CPU run of profile.py: gpipe D=2 N=2, 2 steps (one profiled), a tiny model."""
    out = tmp_path_factory.mktemp("cpu_run")
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    args = ["profile.py", "pipeline=gpipe", "stages=2", "num_micro_batches=2", "steps=2", f"hydra.run.dir={out}",
            "model=bert-tiny", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
            "model.vocab_size=128", "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=2"]
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_cpu_runs_profile_answers_nvidia_style_queries(cpu_run: Path) -> None:
    conn = sqlite3.connect(cpu_run / "profile.sqlite")
    names = conn.execute(  # what NVIDIA's nvtx recipes select: same-thread ranges, text or registered string
        "SELECT coalesce(n.text, s.value), n.globalTid FROM NVTX_EVENTS AS n LEFT JOIN StringIds AS s "
        "ON s.id = n.textId WHERE n.endGlobalTid IS NULL AND n.eventType = 59 AND n.domainId = 0").fetchall()
    assert {"0F0", "1B1", "STEP"} <= {n for n, _ in names}
    assert conn.execute("SELECT count(*) FROM NVTX_EVENTS WHERE text IS NULL AND eventType = 59").fetchone() == (0,)
    threads = conn.execute(
        "SELECT DISTINCT s.value, t.globalTid / 0x1000000 % 0x1000000, p.pid, p.name FROM NVTX_EVENTS AS n "
        "JOIN ThreadNames AS t ON t.globalTid = n.globalTid JOIN StringIds AS s ON s.id = t.nameId "
        "JOIN PROCESSES AS p ON p.globalPid = n.globalTid - n.globalTid % 0x1000000 "
        "WHERE n.eventType = 59 ORDER BY 1").fetchall()
    assert [t[0] for t in threads] == ["worker 0 (rank 0)", "worker 1 (rank 1)"]
    assert all(pid == real and pid != os.getpid() for _, pid, real, _ in threads) and threads[0][1] != threads[1][1]
    assert [r[0] for r in conn.execute("SELECT text FROM NVTX_EVENTS WHERE eventType = 34 ORDER BY text")] == \
        ["rank=0", "rank=1"]
    assert conn.execute("SELECT host FROM PIPEFISHER_WORKERS").fetchall() == [(socket.gethostname(),)] * 2
    (utc,) = conn.execute("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME").fetchone()
    assert conn.execute("SELECT utcOffsetNs FROM PIPEFISHER_HOSTS").fetchall() == [(utc,)]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"META_DATA_EXPORT", "ENUM_NSYS_EVENT_TYPE", "TARGET_INFO_SESSION_START_TIME"} <= tables
    conn.close()
    ours = read_profile(cpu_run / "profile.sqlite")  # our reader: exact events, workers by their real pids
    assert ours.source == "pipefisher" and not ours.gpu and ours.num_workers == 2
    as_nsys = read_nsys(cpu_run / "profile.sqlite")  # workers from the rank=N marks, steps from STEP ranges
    assert [(e.worker, e.kind, e.start_ns, e.end_ns) for e in by_time(as_nsys.events)] == \
        [(e.worker, e.kind, e.start_ns, e.end_ns) for e in by_time(ours.events)]  # waits are named by collective


@pytest.mark.slow
def test_a_cpu_run_writes_a_valid_timeline_json(cpu_run: Path) -> None:
    doc = json.loads((cpu_run / "timeline.json").read_text())
    complete = validate_trace(doc)
    profile = read_profile(cpu_run / "profile.sqlite")
    assert sorted(ev["name"] for ev in complete) == sorted(e.name for e in profile.events)
    processes = {ev["pid"]: ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "process_name"}
    assert sorted(processes) == [0, 1] and all(socket.gethostname() in n for n in processes.values())
    durations = sorted(round(ev["dur"] * 1000) for ev in complete)
    assert durations == sorted(e.duration_ns for e in profile.events)


def test_trace_validator_rejects_partly_overlapping_spans() -> None:
    bad = {"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 0, "tid": 1},
                           {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 0, "tid": 1}]}
    with pytest.raises(AssertionError):
        validate_trace(bad)


# --- the GPU path, checked on CPU ----------------------------------------------------------------

def test_kfac_comm_ablation_all_reduce_uses_the_layers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipefisher.optim import KFACPreconditioner
    from pipefisher.runtime import kfac_work
    from pipefisher.schedules import Action

    class Sent(Exception):
        pass

    devices = []

    def all_reduce(tensor: torch.Tensor, group=None, **_) -> None:
        devices.append(tensor.device)
        raise Sent

    monkeypatch.setattr(kfac_work.dist, "all_reduce", all_reduce)
    layer = torch.nn.Linear(4, 4, device="meta")  # stands in for a CUDA device: anything but CPU
    work = kfac_work.KfacWork({(0, 0): KFACPreconditioner({"l": layer}, include=None)}, {0: object()},
                              deferred=False, ablate=True)
    with pytest.raises(Sent):
        work.run(Action.from_str("0SYNC_FACTOR"))
    assert devices == [torch.device("meta")]


def test_gpu_check_script_refuses_to_run_without_cuda() -> None:
    script = REPO / "bench" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode != 0 and "no CUDA device" in proc.stdout + proc.stderr


def test_run_shape_of_profile_is_4_gpipe_workers(exports: dict[str, Path], tmp_path: Path) -> None:
    run = plan(exports["windows"], tmp_path, "stages=4").run
    assert isinstance(run, RunShape) and run.num_workers == 4 and run.dp_width == 1
