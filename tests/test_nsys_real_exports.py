"""What real Nsight Systems exports do that our own files do not (issue 25, "Real nsys files").

The databases are built here from what 21 public exports, nsys 2020.3 to 2026.2, were seen to
hold (as ``tests/test_nsys_exports.py`` builds its own from NVIDIA's column lists):

- ``NVTX_EVENTS`` has the same 19 columns throughout; 2026.2 adds ``binaryData``. Event types 34
  (mark), 59 (push/pop range), 60 (start/end range), 75 (domain create).
  ``globalTid = 1<<48 | pid<<24 | tid``. 2022.4/2023.1 give every name only through ``textId``.
- ``CUPTI_ACTIVITY_KIND_KERNEL`` has 25 columns (2020.3), 27 (2022.1: ``mangledName``), 28
  (2024.2: ``greenContextId``), 40 (2026.2: ``graphId``, …). Correlation ids restart in each
  process, so kernels join their launches by process too.
- ``TARGET_INFO_SESSION_START_TIME`` is absent in 2020.3 and gains ``systemClockNs`` in 2026.2;
  the metadata table is ``EXPORT_META_DATA`` in 2022.1–2023.1 and ``META_DATA_EXPORT`` +
  ``META_DATA_CAPTURE`` from 2023.4; from 2023.1 it records ``EXPORT_PARAM_TIME_NORMALIZE`` and
  ``EXPORT_PARAM_TIME_SHIFT``. Empty tables are omitted.
- A range still open when the capture stops ends at the capture's end (``ANALYSIS_DETAILS``),
  never NULL; a range that began before the capture starts before the capture's start.
- Clocks (issue 38, defect 2; [Note: the two clocks] in ``nsys_capture``): ``ANALYSIS_DETAILS``
  gives the capture's ``startTime`` 7–42 s after the session's start and ``stopTime = startTime +
  duration``. 2022.4, 2023.1 and 2024.2 count every row from the capture's start, in [0, duration],
  the last range ending exactly at ``duration``; 2026.2 puts them on the session clock, in
  [startTime, stopTime]. Domain-create rows (eventType 75) have a negative start and a NULL end
  (the process made its domain before the capture). The metadata names the version
  (``EXPORT_PRODUCT_VERSION``, e.g. ``2024.2.1.106``).

Whether 2020.3 writes ``ANALYSIS_DETAILS`` we do not know: its database here leaves the table out,
which exercises the fallback (the capture ends at the latest end recorded). Nor do we know the clock
of 2022.1: it is written with the capture starting at the session's start, where both clocks agree.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipefisher.planning.cli import plan_run
from pipefisher.planning.config import register_schedule_configs, to_schedule_config
from pipefisher.profiling import ProfileError, read_nsys
from pipefisher.profiling.range_names import RangeNames
from pipefisher.schedules import build_schedule
from pipefisher.simulate import CostModel, simulate
from pipefisher.timeline import COMPUTE_KINDS, Event
from tests.conftest import REPO

# --- the tables of each nsys generation ------------------------------------------------------------

NVTX_19 = ("start", "end", "eventType", "rangeId", "category", "color", "text", "globalTid", "endGlobalTid",
           "textId", "domainId", "uint64Value", "int64Value", "doubleValue", "uint32Value", "int32Value",
           "floatValue", "jsonTextId", "jsonText")
KERNEL_25 = ("start", "end", "deviceId", "contextId", "streamId", "correlationId", "globalPid", "demangledName",
             "shortName", "launchType", "cacheConfig", "registersPerThread", "gridX", "gridY", "gridZ", "blockX",
             "blockY", "blockZ", "staticSharedMemory", "dynamicSharedMemory", "localMemoryPerThread",
             "localMemoryTotal", "gridId", "sharedMemoryExecuted", "graphNodeId")
KERNEL_27 = KERNEL_25 + ("mangledName", "sharedMemoryLimitConfig")
KERNEL_28 = KERNEL_27 + ("greenContextId",)
KERNEL_40 = KERNEL_28 + ("graphId", "graphExecId", "launchId", "channelId", "channelType", "clusterX", "clusterY",
                         "clusterZ", "clusterSchedulingPolicy", "maxPotentialClusterSize", "maxActiveClusters",
                         "sharedMemoryCarveoutRequested")
SESSION_3 = ("utcEpochNs", "utcTime", "localTime")
COMMON = {
    "StringIds": ("id", "value"),
    "ThreadNames": ("nameId", "priority", "globalTid"),
    "PROCESSES": ("globalPid", "pid", "name"),
    "ENUM_NSYS_EVENT_TYPE": ("id", "name", "label"),
    "CUPTI_ACTIVITY_KIND_RUNTIME": ("start", "end", "eventClass", "globalTid", "correlationId", "nameId",
                                    "returnValue", "callchainId"),
}
ANALYSIS = ("globalVid", "duration", "startTime", "stopTime")


@dataclass(frozen=True)
class Generation:
    """The tables one nsys generation writes."""

    version: str
    kernel: tuple[str, ...]
    nvtx: tuple[str, ...] = NVTX_19
    session: tuple[str, ...] | None = SESSION_3
    meta: tuple[str, ...] = ("META_DATA_EXPORT", "META_DATA_CAPTURE")
    names: str = "mixed"  # text, textId (every name registered) or mixed (forwards registered)
    analysis: bool = True
    clock: str = "session"  # what the rows count from: the session's start, or the capture's ("capture")
    lead_ns: int = 0  # from the session's start to the capture's (ANALYSIS_DETAILS.startTime)


GENERATIONS = {g.version: g for g in (
    Generation("2020.3", KERNEL_25, session=None, meta=(), names="text", analysis=False),
    Generation("2022.1", KERNEL_27, meta=("EXPORT_META_DATA",)),
    Generation("2022.4", KERNEL_27, meta=("EXPORT_META_DATA",), names="textId", clock="capture",
               lead_ns=7_312_004_551),
    Generation("2023.1", KERNEL_27, meta=("EXPORT_META_DATA",), names="textId", clock="capture",
               lead_ns=12_630_117_902),
    Generation("2024.2", KERNEL_28, clock="capture", lead_ns=41_906_215_337),
    Generation("2026.2", KERNEL_40, nvtx=NVTX_19 + ("binaryData",), session=SESSION_3 + ("systemClockNs",),
               lead_ns=9_104_772_160),
)}
CURRENT = GENERATIONS["2024.2"]
MARK, PUSH_POP, START_END, DOMAIN_CREATE = 34, 59, 60, 75
PIDS = (5100, 4900)  # rank r runs as PIDS[r]
UTC0 = 1_790_000_000_000_000_000
START_NS = 5_000_000  # the run's first range starts 5 ms into the capture
COST = CostModel(forward_ns=(1_000_000, 1_200_000), backward_ns=(2_000_000, 2_400_000), p2p_ns=50_000,
                 step_ns=300_000)


def gtid(pid: int, tid: int) -> int:
    return (1 << 48) | (pid << 24) | tid


def truth(method: str = "1f1b", stages: int = 2, micro_batches: int = 2, steps: int = 3) -> list[Event]:
    """What the workers did, on the capture's clock."""
    events = simulate(build_schedule(method, stages, micro_batches), COST, steps=steps)
    return [replace(e, start_ns=e.start_ns + START_NS, end_ns=e.end_ns + START_NS) for e in events]


@dataclass
class Capture:
    """How one capture saw the run."""

    gen: Generation = CURRENT
    ranks: tuple[int, ...] = (0, 1)
    begin: int = 0  # when the capture started, on the truth's clock
    stop: int | None = None  # when it stopped (None: after the run)
    utc_ns: int = UTC0  # UTC of the capture's start (the session started lead earlier)
    lead: int | None = None  # from the session's start to the capture's (None: the generation's)
    normalize: bool = False  # nsys export --ts-normalize true
    shift_ns: int = 0  # nsys export --ts-shift
    analysis: bool | None = None  # write ANALYSIS_DETAILS (None: as the generation does)
    name_of: dict[str, str] | None = None  # our name -> the range's name (another runtime's)


def write_export(events: Sequence[Event], cap: Capture, path: Path) -> Path:
    """The export of ``events`` of ``cap.ranks`` as ``cap.gen`` writes it (empty tables omitted)."""
    gen = cap.gen
    tables = {**COMMON, "NVTX_EVENTS": gen.nvtx, "CUPTI_ACTIVITY_KIND_KERNEL": gen.kernel, "ANALYSIS_DETAILS": ANALYSIS}
    tables.update({t: ("name", "value") for t in gen.meta})
    if gen.session:
        tables["TARGET_INFO_SESSION_START_TIME"] = gen.session
    rows: dict[str, list[dict]] = defaultdict(list)
    strings: dict[str, int] = {}

    def string(value: str) -> int:
        if value not in strings:
            strings[value] = len(strings) + 1
            rows["StringIds"].append({"id": strings[value], "value": value})
        return strings[value]

    lead = gen.lead_ns if cap.lead is None else cap.lead
    session_utc = cap.utc_ns - lead
    moved = session_utc if cap.normalize else cap.shift_ns  # what the export adds to its clock's times
    stop = cap.stop if cap.stop is not None else max(e.end_ns for e in events) + 1_000_000
    zero = cap.begin if gen.clock == "capture" else cap.begin - lead  # timestamp 0, on the truth's clock

    def t(ns: int) -> int:
        return ns - zero + moved

    for i, name in ((MARK, "NvtxMark"), (PUSH_POP, "NvtxPushPopRange"), (START_END, "NvtxStartEndRange"),
                    (DOMAIN_CREATE, "NvtxDomainCreate")):
        rows["ENUM_NSYS_EVENT_TYPE"].append({"id": i, "name": name, "label": name})
    for table in gen.meta[:1]:
        rows[table] += [{"name": "EXPORT_SCHEMA_VERSION", "value": "3.x"},
                        {"name": "EXPORT_PRODUCT_VERSION", "value": f"{gen.version}.1.0"}]
        if gen.version >= "2023.1":
            rows[table] += [{"name": "EXPORT_PARAM_TIME_NORMALIZE", "value": str(cap.normalize).lower()},
                            {"name": "EXPORT_PARAM_TIME_SHIFT", "value": str(cap.shift_ns)}]
    if gen.session:
        row = {"utcEpochNs": session_utc, "utcTime": "t", "localTime": "t"}
        rows["TARGET_INFO_SESSION_START_TIME"].append({**row, "systemClockNs": 7} if "systemClockNs" in gen.session
                                                      else row)
    if cap.analysis if cap.analysis is not None else gen.analysis:
        rows["ANALYSIS_DETAILS"].append({"globalVid": 1, "duration": stop - cap.begin, "startTime": lead + moved,
                                         "stopTime": lead + moved + stop - cap.begin})
    for r in cap.ranks:
        pid = PIDS[r]
        main = gtid(pid, pid)
        rows["PROCESSES"].append({"globalPid": main & ~0xFFFFFF, "pid": pid, "name": "python"})
        rows["ThreadNames"].append({"nameId": string("python"), "priority": 0, "globalTid": main})
        rows["NVTX_EVENTS"] += [{"start": t(cap.begin) + 10, "eventType": MARK, "text": f"rank={r}", "globalTid": main},
                                {"start": t(cap.begin - lead // 2) - 20 if lead else t(cap.begin) - 20,
                                 "eventType": DOMAIN_CREATE, "text": "NCCL", "globalTid": main, "domainId": 1}]
        corr = 0  # correlation ids restart in every process
        for e in sorted((e for e in events if e.worker == r), key=lambda e: (e.start_ns, e.end_ns)):
            if e.end_ns <= cap.begin or e.start_ns >= stop:
                continue  # outside the capture
            name = (cap.name_of or {}).get(e.name, e.name)
            registered = gen.names == "textId" or (gen.names == "mixed" and e.kind == "F")
            label = {"textId": string(name)} if registered else {"text": name}
            rows["NVTX_EVENTS"].append({"start": t(e.start_ns), "end": t(min(e.end_ns, stop)), "eventType": PUSH_POP,
                                        "globalTid": main, "domainId": 0, **label})
            if e.kind in COMPUTE_KINDS and e.start_ns >= cap.begin and e.end_ns <= stop:
                corr += 1
                rows["CUPTI_ACTIVITY_KIND_RUNTIME"].append(
                    {"start": t(e.start_ns), "end": t(e.start_ns) + 500, "eventClass": 1, "globalTid": main,
                     "correlationId": corr, "nameId": string("cudaLaunchKernel"), "returnValue": 0})
                rows["CUPTI_ACTIVITY_KIND_KERNEL"].append(
                    {"start": t(e.start_ns), "end": t(e.end_ns), "deviceId": r, "streamId": 7, "correlationId": corr,
                     "globalPid": main & ~0xFFFFFF, "shortName": string("gemm"), "demangledName": string("gemm")})
    conn = sqlite3.connect(path)
    with conn:
        for table, cols in tables.items():
            if not rows.get(table):
                continue  # nsys leaves empty tables out
            conn.execute(f"CREATE TABLE {table} ({', '.join(cols)})")
            for row in rows[table]:
                assert set(row) <= set(cols), (table, set(row) - set(cols))
                conn.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(cols))})",
                             [row.get(c) for c in cols])
    conn.close()
    return path


def by_time(events: Iterable[Event]) -> list[Event]:
    return sorted(events, key=lambda e: (e.start_ns, e.worker, e.end_ns, e.name))


def of_steps(events: Iterable[Event], steps: Iterable[int]) -> list[Event]:
    keep = set(steps)
    return by_time(e for e in events if e.step in keep)


def moved(events: Iterable[Event], ns: int) -> list[Event]:
    return by_time(replace(e, start_ns=e.start_ns + ns, end_ns=e.end_ns + ns) for e in events)


# --- one database per generation ---------------------------------------------------------------------

@pytest.mark.parametrize("version", sorted(GENERATIONS))
def test_each_nsys_generation_reads_as_the_run_it_recorded(version: str, tmp_path: Path) -> None:
    gen, run = GENERATIONS[version], truth()
    path = write_export(run, Capture(gen), tmp_path / f"nsys{version}.sqlite")
    conn = sqlite3.connect(path)
    kernel_cols = len(conn.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_KERNEL)").fetchall())
    nvtx_cols = len(conn.execute("PRAGMA table_info(NVTX_EVENTS)").fetchall())
    names = conn.execute("SELECT count(*) FROM NVTX_EVENTS WHERE text IS NULL AND eventType = 59").fetchone()[0]
    conn.close()
    assert (kernel_cols, nvtx_cols) == {"2020.3": (25, 19), "2022.1": (27, 19), "2022.4": (27, 19),
                                        "2023.1": (27, 19), "2024.2": (28, 19), "2026.2": (40, 20)}[version]
    assert (names == len(run)) is (version in ("2022.4", "2023.1"))  # every name through textId
    profile = read_nsys(path)
    assert profile.gpu and not profile.notes  # ranks from the rank=N marks, both processes in one file
    on_file_clock = moved(run, gen.lead_ns if gen.clock == "session" else 0)
    assert by_time(profile.events) == on_file_clock  # kernel spans: correlation ids joined per process
    assert [e.step for e in by_time(profile.events) if e.kind == "STEP"] == [0, 0, 1, 1, 2, 2]


def test_per_rank_exports_of_2020_3_have_no_session_start_and_say_so(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    run = truth()
    for r in (0, 1):
        write_export(run, Capture(GENERATIONS["2020.3"], ranks=(r,)), tmp_path / f"old_rank{r}.sqlite")
    with caplog.at_level(logging.WARNING):
        profile = read_nsys(str(tmp_path / "old_rank*.sqlite"))
    assert by_time(profile.events) == by_time(run)
    assert "no TARGET_INFO_SESSION_START_TIME, so the exports' clocks are taken as one" in profile.notes[0]


# --- the clock of the rows: the capture's start or the session's (issue 38, defect 2) ----------------

CAPTURE_CLOCKED = [v for v, g in GENERATIONS.items() if g.clock == "capture"]


def _rows(path: Path) -> tuple[list[tuple[int, int | None, int]], tuple[int, int, int]]:
    """``([(start, end, eventType)], (duration, startTime, stopTime))`` of an export."""
    conn = sqlite3.connect(path)
    rows = conn.execute("SELECT start, end, eventType FROM NVTX_EVENTS").fetchall()
    window = conn.execute("SELECT duration, startTime, stopTime FROM ANALYSIS_DETAILS").fetchone()
    conn.close()
    return rows, window


@pytest.mark.parametrize("version", CAPTURE_CLOCKED)
def test_rows_counted_from_the_capture_start_keep_every_whole_step(version: str, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # The 300-step capture, small: the session started 40 ms before the capture, the capture
    # stopped inside step 9, so the last ranges end exactly at `duration`. Read on the session clock,
    # every range before 40 ms "began before the capture": steps 0-3 vanished while the log said 2 dropped.
    gen, run = GENERATIONS[version], truth(steps=10)
    stop = _inside(run, 9, "B")
    path = write_export(run, Capture(gen, stop=stop, lead=40_000_000), tmp_path / f"nsys{version}.sqlite")
    rows, (duration, start_time, stop_time) = _rows(path)
    ranges = [(s, e) for s, e, kind in rows if kind == PUSH_POP]
    assert (start_time, stop_time) == (40_000_000, 40_000_000 + duration)
    assert all(0 <= s and e <= duration for s, e in ranges) and max(e for _, e in ranges) == duration
    assert min(s for s, _ in ranges) < start_time  # 0F0 of step 0 starts before startTime: not before the capture
    assert [(s < 0, e) for s, e, kind in rows if kind == DOMAIN_CREATE] == [(True, None)] * 2
    with caplog.at_level(logging.INFO):
        profile = read_nsys(path)
    assert by_time(profile.events) == of_steps(run, range(9))  # every whole step, on the capture's clock
    assert profile.notes == [f"dropped 1 partial step(s) of the 10 the capture touches: step 9 (the capture "
                             f"stopped inside it: {len([e for e in run if e.start_ns < stop < e.end_ns])} action "
                             f"range(s) never ended)"]
    assert "read on the session clock" not in caplog.text  # the rows decided it, not a guess


@pytest.mark.parametrize("version", CAPTURE_CLOCKED)
def test_a_capture_shorter_than_its_start_time_still_plans(version: str, tmp_path: Path) -> None:
    # The 188-step capture: startTime (7-42 s) lies after every row, so on the session clock
    # every range began before the capture and "no complete step is left".
    gen, run = GENERATIONS[version], truth(steps=4)
    path = write_export(run, Capture(gen), tmp_path / f"nsys{version}.sqlite")
    rows, (duration, start_time, _) = _rows(path)
    assert max(e for _, e, kind in rows if kind == PUSH_POP) < duration < start_time
    result = _plan(str(path), tmp_path, "warmup_steps=1")
    assert result.measured.num_steps == 3 and (result.run.method, result.run.stages) == ("1f1b", 2)


def test_session_clock_rows_of_2026_2_lie_in_start_stop_and_a_late_capture_drops_its_step(tmp_path: Path) -> None:
    gen, run = GENERATIONS["2026.2"], truth(steps=3)
    begin = _inside(run, 0, "F", worker=0)  # the capture starts inside worker 0's first forward
    path = write_export(run, Capture(gen, begin=begin), tmp_path / "late.sqlite")
    rows, (duration, start_time, stop_time) = _rows(path)
    inside = [(s, e) for s, e, kind in rows if kind == PUSH_POP and s >= start_time]
    assert all(e <= stop_time for _, e in inside) and len(inside) == len(rows) - 2 * 2 - 2  # less marks, domains, 2 early
    profile = read_nsys(path)
    assert by_time(profile.events) == moved(of_steps(run, [1, 2]), gen.lead_ns - begin)
    assert profile.notes == ["dropped 1 partial step(s) of the 3 the capture touches: step 0 (the capture started "
                             "inside it: a range began before the capture)"]


@pytest.mark.parametrize("version", ["2024.2", None])
def test_rows_that_fit_both_clocks_are_read_by_the_version(version: str | None, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    # A 2024.2 capture whose session started 1 ms before it, the run 5 ms into it, stopped inside step 2:
    # every row lies in both [0, duration] and [startTime, stopTime]. Only the version tells that the
    # ranges ending at `duration` were cut off by the stop (capture clock), not ended 1 ms before it.
    run = truth(steps=3)
    path = write_export(run, Capture(stop=_inside(run, 2, "B"), lead=1_000_000), tmp_path / "both.sqlite")
    if version is None:
        conn = sqlite3.connect(path)
        with conn:
            conn.execute("DELETE FROM META_DATA_EXPORT WHERE name = 'EXPORT_PRODUCT_VERSION'")
        conn.close()
    with caplog.at_level(logging.INFO):
        profile = read_nsys(path)
    assert by_time(profile.events) == of_steps(run, [0, 1]) and len(profile.notes) == 1
    cut = "step 2 (the capture stopped inside it" in profile.notes[0]  # else: "stopped before its STEP"
    assert cut is (version is not None)
    said = "fit both the capture clock [0, " in caplog.text and "(version not recorded)" in caplog.text
    assert said is (version is None)  # a guess is said in the log


def test_2026_2_rows_that_fit_both_clocks_stay_on_the_session_clock(tmp_path: Path) -> None:
    # The session started 1 ms before the capture, which stopped 1 ms after the run: the last STEPs end
    # exactly at `duration`. On the capture clock they would be cut off by the stop; they are not.
    gen, run = GENERATIONS["2026.2"], truth(steps=3)
    path = write_export(run, Capture(gen, lead=1_000_000), tmp_path / "both.sqlite")
    rows, (duration, start_time, _) = _rows(path)
    assert max(e for _, e, kind in rows if kind == PUSH_POP) == duration
    assert min(e for _, e, kind in rows if kind == PUSH_POP) > start_time
    profile = read_nsys(path)
    assert by_time(profile.events) == moved(run, 1_000_000) and not profile.notes


def test_per_rank_capture_clock_exports_align_by_their_capture_start(tmp_path: Path) -> None:
    # Both ranks' captures started at one instant; their sessions 7.3 s and 12.6 s before it. On the
    # capture clock, timestamp 0 is utcEpochNs + startTime, not utcEpochNs.
    run = truth()
    for r, lead in ((0, 7_312_004_551), (1, 12_630_117_902)):
        write_export(run, Capture(ranks=(r,), lead=lead), tmp_path / f"cap_rank{r}.sqlite")
    profile = read_nsys(str(tmp_path / "cap_rank*.sqlite"))
    assert by_time(profile.events) == by_time(run) and not profile.notes


def test_a_capture_that_starts_inside_a_step_range_counts_that_step_as_dropped(tmp_path: Path) -> None:
    # Worker 1's optimizer STEP of step 0 was running when the capture started: the capture holds the
    # end of step 0 and then steps 1 and 2. The log counts step 0 among those dropped.
    gen, run = GENERATIONS["2026.2"], no_waits(truth(steps=3))
    step0 = next(e for e in run if e.worker == 1 and e.kind == "STEP" and e.step == 0)
    begin = (step0.start_ns + step0.end_ns) // 2
    path = write_export(run, Capture(gen, ranks=(1,), begin=begin), tmp_path / "in_step.sqlite")
    profile = read_nsys(path)
    assert by_time(profile.events) == moved(of_steps([e for e in run if e.worker == 1], [1, 2]), gen.lead_ns - begin)
    assert profile.notes == ["dropped 1 partial step(s) of the 3 the capture touches: step 0 (the capture started "
                             "inside it: a range began before the capture)"]


# --- ranges cut off by the capture's end, partial steps ------------------------------------------------

def _inside(run: Sequence[Event], step: int, kind: str, worker: int = 1) -> int:
    """An instant inside the first ``kind`` action of ``step`` on ``worker``."""
    e = min((e for e in run if e.step == step and e.kind == kind and e.worker == worker), key=lambda e: e.start_ns)
    return (e.start_ns + e.end_ns) // 2


@pytest.mark.parametrize("analysis", [True, False], ids=["analysis_details", "latest_end"])
def test_a_range_cut_off_by_the_capture_end_drops_its_step(analysis: bool, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    run = truth(steps=3)
    stop = _inside(run, 2, "B")  # the capture stops inside worker 1's first backward of step 2
    path = write_export(run, Capture(stop=stop, analysis=analysis), tmp_path / "cut.sqlite")
    conn = sqlite3.connect(path)
    cut = conn.execute("SELECT count(*) FROM NVTX_EVENTS WHERE end = ?", (stop,)).fetchone()[0]
    assert conn.execute("SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 59 AND end IS NULL").fetchone() == (0,)
    conn.close()
    assert cut == len([e for e in run if e.start_ns < stop < e.end_ns]) >= 1  # nsys closes them at the stop
    with caplog.at_level(logging.WARNING):
        profile = read_nsys(path)
    assert by_time(profile.events) == of_steps(run, [0, 1])  # the cut backward is not averaged in
    line = (f"dropped 1 partial step(s) of the 3 the capture touches: step 2 (the capture stopped inside it: "
            f"{cut} action range(s) never ended)")
    assert profile.notes == [line] and caplog.text.count("dropped 1 partial step") == 1


def no_waits(run: Iterable[Event]) -> list[Event]:
    """The run as a runtime records it that names no wait ranges (workers idle between actions)."""
    return [e for e in run if e.kind in ("F", "B", "I", "W", "STEP")]


def _after(run: Sequence[Event], step: int, name: str) -> int:
    """An instant 0.1 ms after ``name`` of ``step`` ended (a gap with no action of its worker, here)."""
    return next(e.end_ns for e in run if e.step == step and e.name == name) + 100_000


def test_a_last_step_without_its_step_range_is_not_a_full_step(tmp_path: Path) -> None:
    run = no_waits(truth(steps=3))
    stops = {0: _after(run, 2, "0F1"),  # rank 0 stopped after its two forwards of step 2, rank 1 after step 1
             1: next(e.end_ns for e in run if e.step == 1 and e.kind == "STEP" and e.worker == 1) + 100_000}
    for r, stop in stops.items():  # each rank's capture stopped in a gap between its actions
        assert not any(e.start_ns < stop < e.end_ns for e in run if e.worker == r)
        write_export(run, Capture(ranks=(r,), stop=stop), tmp_path / f"gap_rank{r}.sqlite")
    profile = read_nsys(str(tmp_path / "gap_rank*.sqlite"))
    assert len([e for e in profile.events if e.step == 2]) == 0 < len([e for e in run if e.step == 2 and e.worker == 0
                                                                        and e.end_ns < stops[0]]) == 2
    assert by_time(profile.events) == of_steps(run, [0, 1])  # 0F0 and 0F1 of step 2 were no full step
    assert profile.notes == ["dropped 1 partial step(s) of the 3 the capture touches: step 2 (the capture stopped "
                             "before its STEP)"]


def test_a_capture_that_starts_inside_a_step_drops_it(tmp_path: Path) -> None:
    run = truth(steps=3)
    begin = _inside(run, 0, "F", worker=0)  # the capture starts inside worker 0's first forward
    path = write_export(run, Capture(begin=begin), tmp_path / "late.sqlite")
    conn = sqlite3.connect(path)
    early = conn.execute("SELECT count(*) FROM NVTX_EVENTS WHERE start < 0 AND eventType = 59").fetchone()[0]
    conn.close()
    assert early == 2  # 0F0 and worker 1's wait for it, 1RECV_F0<0, began before the capture
    profile = read_nsys(path)
    assert by_time(profile.events) == moved(of_steps(run, [1, 2]), -begin)
    assert profile.notes == ["dropped 1 partial step(s) of the 3 the capture touches: step 0 (the capture started "
                             "inside it: a range began before the capture)"]


def test_a_capture_that_starts_between_actions_drops_the_short_first_step(tmp_path: Path) -> None:
    run = no_waits(truth(steps=3))
    begins = {0: _after(run, 0, "0F1"), 1: START_NS + 500_000}  # rank 0 missed its two forwards, rank 1 nothing
    for r, begin in begins.items():
        assert not any(e.start_ns < begin < e.end_ns for e in run if e.worker == r)
        write_export(run, Capture(ranks=(r,), begin=begin, utc_ns=UTC0 + begin), tmp_path / f"gap_rank{r}.sqlite")
    profile = read_nsys(str(tmp_path / "gap_rank*.sqlite"))
    assert by_time(profile.events) == moved(of_steps(run, [1, 2]), -begins[1])  # on the earlier capture's clock
    assert profile.notes == ["dropped 1 partial step(s) of the 3 the capture touches: step 0 (the capture started "
                             "between its actions: fewer forwards and backwards than a full step)"]


def test_nothing_whole_left_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    run = truth(steps=1)
    path = write_export(run, Capture(stop=_inside(run, 0, "B")), tmp_path / "short.sqlite")
    with pytest.raises(ProfileError) as exc:
        read_nsys(path)
    text = str(exc.value)
    assert "\n" not in text and str(path) in text and "no complete step is left" in text
    assert "capture whole steps" in text


# --- exports made with --ts-normalize / --ts-shift -------------------------------------------------

def test_normalized_per_rank_exports_are_not_shifted_again(tmp_path: Path) -> None:
    late = 4_000_000_017  # rank 1's capture started 4 s after rank 0's, both before the run
    run = moved(truth(), late)
    for r, utc in ((0, UTC0), (1, UTC0 + late)):
        shifted = [replace(e, start_ns=e.start_ns - (utc - UTC0), end_ns=e.end_ns - (utc - UTC0)) for e in run]
        write_export(shifted, Capture(GENERATIONS["2026.2"], ranks=(r,), utc_ns=utc, normalize=True),
                     tmp_path / f"norm_rank{r}.sqlite")  # the session clock: what --ts-normalize adds is known
    profile = read_nsys(str(tmp_path / "norm_rank*.sqlite"))
    assert by_time(profile.events) == moved(run, UTC0)  # UTC timestamps, as exported
    assert not profile.notes
    for r, utc in ((0, UTC0), (1, UTC0 + late)):  # the same captures exported plainly align by their session start
        shifted = [replace(e, start_ns=e.start_ns - (utc - UTC0), end_ns=e.end_ns - (utc - UTC0)) for e in run]
        write_export(shifted, Capture(ranks=(r,), utc_ns=utc), tmp_path / f"plain_rank{r}.sqlite")
    assert by_time(read_nsys(str(tmp_path / "plain_rank*.sqlite")).events) == by_time(run)
    with pytest.raises(ProfileError, match=r"norm_rank1\.sqlite was exported with --ts-normalize or --ts-shift .*"
                                           r"plain_rank0\.sqlite without.*export every rank the same way"):
        read_nsys([tmp_path / "plain_rank0.sqlite", tmp_path / "norm_rank1.sqlite"])


def test_shifted_exports_keep_the_users_shift(tmp_path: Path) -> None:
    late = 2_000_000_000
    run = moved(truth(), late)
    for r, utc, shift in ((0, UTC0, 1), (1, UTC0 + late, late + 1)):  # each shifted by hand onto one clock
        own = [replace(e, start_ns=e.start_ns - (utc - UTC0), end_ns=e.end_ns - (utc - UTC0)) for e in run]
        write_export(own, Capture(GENERATIONS["2026.2"], ranks=(r,), utc_ns=utc, shift_ns=shift),
                     tmp_path / f"shift_rank{r}.sqlite")
    profile = read_nsys(str(tmp_path / "shift_rank*.sqlite"))
    lead = GENERATIONS["2026.2"].lead_ns  # the shift moves session-clock times
    assert by_time(profile.events) == moved(run, lead + 1)  # the users' shifts, no session offsets added on top


# --- profiles of other runtimes: range-name maps ----------------------------------------------------

MEGATRON = {"F": "F{mb}.0.0", "B": "B{mb}.0.0", "I": "B{mb}.0.0", "W": "W{mb}.0.0"}


def megatron_names(run: Iterable[Event]) -> dict[str, str]:
    """Our name -> the zero-bubble fork's (one model chunk, no sequence split)."""
    out = {"STEP": "Optimizer"}
    for e in run:
        if e.kind in MEGATRON:
            out[e.name] = MEGATRON[e.kind].format(mb=e.name.split(e.kind)[1])
        elif e.kind != "STEP":
            out[e.name] = {"SEND_F": "send_forward", "RECV_F": "recv_forward", "SEND_B": "send_backward",
                           "RECV_B": "recv_backward"}.get(e.kind, e.kind.lower())
    return out


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Event], Path]:
    """A zb-h1 run (D=2, N=4, 3 steps) named as Megatron's zero-bubble fork names it, one export per rank."""
    d = tmp_path_factory.mktemp("megatron")
    run = truth("zb-h1", 2, 4, 3)
    names = megatron_names(run)
    for r in (0, 1):
        write_export(run, Capture(ranks=(r,), name_of=names), d / f"megatron_rank{r}.sqlite")
    return run, d


def test_megatron_zero_bubble_names_read_through_the_map(megatron: tuple[list[Event], Path]) -> None:
    run, d = megatron
    names = RangeNames(name="megatron_zb", patterns=[r"(?P<kind>[FBW])(?P<mb>\d+)\.(?P<chunk>\d+)\.\d+",
                                                     "(?P<kind>Optimizer)"], kinds={"B": "I", "Optimizer": "STEP"})
    profile = read_nsys(str(d / "megatron_rank*.sqlite"), names=names)
    actions = [e for e in run if e.kind in ("F", "B", "I", "W", "STEP")]
    assert {e.kind for e in actions} == {"F", "B", "I", "W", "STEP"}  # zb-h1: worker 0 runs whole backwards
    assert by_time(profile.events) == by_time(actions)  # B -> I where a W follows, else a whole B


def _plan(path: str, tmp_path: Path, *keys: str):
    register_schedule_configs()
    overrides = [f"from={path}", "plot=false", "model=bert-tiny", "micro_batch_size=4", *keys]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_schedule_config(compose(config_name="schedule", overrides=overrides))
    return plan_run(cfg, tmp_path / "plan", requested={k.split("=")[0] for k in overrides})


@pytest.mark.slow
def test_a_megatron_profile_plans_through_ranges_megatron_zb(megatron: tuple[list[Event], Path],
                                                             tmp_path: Path) -> None:
    _, d = megatron
    result = _plan(str(d / "megatron_rank*.sqlite"), tmp_path, "ranges=megatron_zb", "warmup_steps=0")
    assert (result.run.method, result.run.stages, result.run.num_micro_batches) == ("zb-h1", 2, 4)
    assert result.measured.num_steps == 3 and "pipeline=zb-h1" in result.summary
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "schedule.py", f"from={d / 'megatron_rank*.sqlite'}", "ranges=megatron_zb",
                           "model=bert-tiny", "micro_batch_size=4", "plot=false", f"hydra.run.dir={tmp_path / 'cli'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zb-h1 D=2 N=4" in proc.stdout and (tmp_path / "cli" / "assignment.json").is_file()


@pytest.mark.slow
def test_foreign_names_without_a_map_list_the_names_found(tmp_path: Path) -> None:
    counts = {"forward_0": 6, "forward_1": 5, "backward_0": 4, "Optimizer": 3, "iter": 2, "zz": 1}
    events, t = [], START_NS
    for name, n in counts.items():
        for _ in range(n):
            events.append(Event(0, name, "F", t, t + 1000, 0))  # kind unused: the export holds the name only
            t += 2000
    path = write_export(events, Capture(ranks=(0,)), tmp_path / "other.sqlite")
    with pytest.raises(ProfileError) as exc:
        read_nsys(path)
    text = str(exc.value)
    assert "\n" not in text and str(path) in text
    assert ("21 other range(s), most frequent: 'forward_0' ×6, 'forward_1' ×5, 'backward_0' ×4, 'Optimizer' ×3, "
            "'iter' ×2)") in text and "'zz'" not in text
    assert "ranges=megatron_zb" in text and "conf/ranges/" in text
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "schedule.py", f"from={path}", "model=bert-tiny", "plot=false",
                           f"hydra.run.dir={tmp_path / 'cli'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "most frequent: 'forward_0' ×6" in proc.stderr and "ranges=" in proc.stderr


def test_a_bad_name_map_is_one_line_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"ranges\.patterns\[0\]=.*: has group\(s\) micro; name groups only kind"):
        RangeNames(name="x", patterns=[r"F(?P<micro>\d+)"])
    with pytest.raises(ValueError, match=r"ranges\.patterns\[0\]=.*has no \(\?P<kind>\.\.\.\) group"):
        RangeNames(name="x", patterns=[r"F(?P<mb>\d+)"])
    with pytest.raises(ValueError, match=r"ranges\.kinds\.X='SEND_F': no action kind a name can map to"):
        RangeNames(name="x", patterns=[r"(?P<kind>X)"], kinds={"X": "SEND_F"})
