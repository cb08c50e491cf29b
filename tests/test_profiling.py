"""profile.sqlite round trips, reading Nsight Systems exports (CPU and GPU spans), plots, tables."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from pipefisher.profiling import (
    KIND_COLORS,
    Profile,
    ProfileError,
    WorkerInfo,
    plot_timeline,
    read_nsys,
    read_profile,
    utilization_table,
    write_profile,
)
from pipefisher.profiling.nsys import parse_action_name
from pipefisher.profiling.sqlite import global_tid_of_worker
from pipefisher.schedules import build_schedule
from pipefisher.simulate import CostModel, simulate
from pipefisher.timeline import Event


@pytest.fixture(scope="module")
def chimera_events() -> list[Event]:
    return simulate(build_schedule("chimera", 4, 8), CostModel.uniform(4, 1000), steps=2)


def _by_time(events: list[Event]) -> list[Event]:
    return sorted(events, key=lambda e: (e.start_ns, e.worker, e.end_ns, e.name))


# --- profile.sqlite ---------------------------------------------------------------------------

def test_write_then_read_restores_events_metadata_and_workers(tmp_path: Path,
                                                              chimera_events: list[Event]) -> None:
    extra = [Event(1, "1CURV_A3", "CURV_A", 50_000, 50_700, 2),  # K-FAC kinds not yet in the IR
             Event(1, "1INVERT", "INVERT", 50_700, 52_000, 2),
             Event(0, "custom range", "OTHER", 40_000, 40_000, 5)]  # any name/kind round-trips
    events = chimera_events + extra
    metadata = {"config": {"model": {"name": "bert-tiny"}, "lr": 1e-3}, "method": "chimera",
                "num_stages": 4, "num_micro_batches": 8, "num_steps": 2, "device": "cpu",
                "oversubscribed": True}
    path = tmp_path / "run" / "profile.sqlite"
    write_profile(path, events, metadata=metadata, worker_ranks={0: 4, 1: 5, 2: 6, 3: 7},
                  worker_hosts={0: "node-a"})

    profile = read_profile(path)
    assert isinstance(profile, Profile) and profile.source == "pipefisher"
    assert profile.events == events
    assert profile.metadata == metadata
    assert profile.workers[0] == WorkerInfo(0, 4, global_tid_of_worker(0), "node-a")
    assert profile.workers[3].rank == 7 and profile.workers[3].host is None
    assert profile.num_workers == 4
    assert [p.name for p in path.parent.iterdir()] == ["profile.sqlite"]  # no temp file left


def test_profile_uses_the_nsys_layout_and_the_nsys_reader_reads_it(tmp_path: Path,
                                                                   chimera_events: list[Event]) -> None:
    path = tmp_path / "profile.sqlite"
    write_profile(path, chimera_events, metadata={"method": "chimera"})
    with sqlite3.connect(path) as conn:
        row = conn.execute("SELECT n.eventType, n.globalTid, coalesce(n.text, s.value) FROM NVTX_EVENTS AS n "
                           "LEFT JOIN StringIds AS s ON s.id = n.textId WHERE n.rowid = 1").fetchone()
    assert row == (59, global_tid_of_worker(chimera_events[0].worker), chimera_events[0].name)
    assert (row[1] >> 24) & 0xFFFFFF == row[1] & 0xFFFFFF  # pid == tid, as for a main thread

    plain = read_nsys(path)  # ignores PIPEFISHER_*: workers from pids, steps from STEP ranges
    assert plain.source == "nsys" and plain.metadata == {}
    assert _by_time(plain.events) == _by_time(chimera_events)


def test_write_replaces_an_existing_profile_whole(tmp_path: Path) -> None:
    path = tmp_path / "profile.sqlite"
    write_profile(path, [Event(0, "0F0", "F", 0, 10)] * 3, metadata={"a": 1})
    write_profile(path, [Event(1, "0B0", "B", 5, 9, 1)], metadata={"b": [1, 2]})
    profile = read_profile(path)
    assert profile.events == [Event(1, "0B0", "B", 5, 9, 1)]
    assert profile.metadata == {"b": [1, 2]}


def test_write_rejects_metadata_that_is_not_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"metadata\['cfg'\]"):
        write_profile(tmp_path / "p.sqlite", [], metadata={"cfg": object()})
    assert not list(tmp_path.iterdir())


# --- a database in the Nsight Systems export layout -------------------------------------------

_NSYS_SCHEMA = """
CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
    rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
    endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER,
    int64Value INTEGER, doubleValue REAL, uint32Value INTEGER, int32Value INTEGER,
    floatValue REAL, jsonTextId INTEGER, jsonText TEXT);
CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
    eventClass INTEGER NOT NULL, globalTid INTEGER, correlationId INTEGER, nameId INTEGER NOT NULL,
    returnValue INTEGER NOT NULL, callchainId INTEGER);
CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
    deviceId INTEGER NOT NULL, contextId INTEGER NOT NULL, streamId INTEGER NOT NULL,
    correlationId INTEGER, globalPid INTEGER, demangledName INTEGER NOT NULL,
    shortName INTEGER NOT NULL);
"""


def _gtid(pid: int, tid: int) -> int:
    return (1 << 48) | (pid << 24) | tid  # nsys puts a hardware id above pid and tid


def _nsys_db(path: Path, ranges: list[tuple], launches: list[tuple], strings: dict[int, str]) -> Path:
    """ranges: (start, end, eventType, text, textId, globalTid); launches: (globalTid, call_start,
    correlationId, kernel_start, kernel_end)."""
    conn = sqlite3.connect(path)
    with conn:
        conn.executescript(_NSYS_SCHEMA)
        conn.executemany("INSERT INTO StringIds VALUES (?, ?)", list(strings.items()))
        conn.executemany("INSERT INTO NVTX_EVENTS(start, end, eventType, text, textId, globalTid) "
                         "VALUES (?, ?, ?, ?, ?, ?)", ranges)
        for gtid, call, corr, k_start, k_end in launches:
            conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, 0, 0, NULL)",
                         (call, call + 5, gtid, corr))
            conn.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, ?, ?, 0, 0)",
                         (k_start, k_end, corr, gtid & ~0xFFFFFF))
    conn.close()
    return path


@pytest.fixture
def two_thread_export(tmp_path: Path) -> Path:
    """One process (pid 4242), two threads = two workers; names in text and via textId."""
    t0, t1 = _gtid(4242, 4242), _gtid(4242, 4250)
    strings = {1: "0F0", 2: "1F0", 3: "STEP", 4: "aten::linear"}
    ranges = [
        # start, end, eventType, text, textId, globalTid
        (100, 200, 59, None, 1, t0),             # 0F0 via textId
        (120, 150, 59, "forward", None, t0),     # nested non-action range inside 0F0
        (210, 230, 59, "0SEND_F0>1", None, t0),
        (250, 300, 59, None, 3, t0),             # STEP via textId
        (310, 400, 59, "0F1", None, t0),         # step 1 (after the STEP)
        (320, 320, 34, "a mark", None, t0),      # NVTX mark: no end, ignored
        (215, 240, 59, "1RECV_F0<0", None, t1),
        (240, 330, 59, None, 2, t1),             # 1F0 via textId
        (330, 360, 59, None, 4, t1),             # non-action range (via textId)
        (360, 380, 60, "STEP", None, t1),        # start/end range
    ]
    launches = [
        # globalTid, runtime call start, correlationId, kernel start, kernel end
        (t0, 110, 1, 1000, 1100),  # 0F0 (directly)
        (t0, 130, 2, 1100, 1300),  # 0F0 (through the nested "forward" range)
        (t0, 260, 3, 1400, 1450),  # STEP
        (t1, 250, 4, 1320, 1500),  # 1F0
        (t1, 300, 5, 1500, 1600),  # 1F0
        (t1, 340, 6, 1600, 1700),  # aten::linear: belongs to no action
        (t0, 500, 7, 1800, 1900),  # outside every range
    ]
    return _nsys_db(tmp_path / "export.sqlite", ranges, launches, strings)


def test_nsys_export_reads_into_cpu_events(two_thread_export: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipefisher.profiling"):
        profile = read_profile(two_thread_export, gpu=False)  # no PIPEFISHER_* tables: read_nsys
    assert profile.source == "nsys" and profile.metadata == {}
    assert profile.events == [
        Event(0, "0F0", "F", 100, 200, 0),
        Event(0, "0SEND_F0>1", "SEND_F", 210, 230, 0),
        Event(1, "1RECV_F0<0", "RECV_F", 215, 240, 0),
        Event(1, "1F0", "F", 240, 330, 0),
        Event(0, "STEP", "STEP", 250, 300, 0),
        Event(1, "STEP", "STEP", 360, 380, 0),
    ]  # 0F1 began a step no STEP closed: a partial step, dropped (issue 25)
    assert profile.notes == ["dropped 1 partial step(s) of the 2 the capture touches: step 1 (the capture stopped "
                             "before its STEP)"]
    tids = [(w.worker, w.global_tid & 0xFFFFFF) for w in profile.workers.values()]
    assert tids == [(0, 4242), (1, 4250)]
    assert "ignored 2 NVTX range(s)" in caplog.text  # "forward" and "aten::linear"


def test_nsys_export_reads_into_gpu_spans(two_thread_export: Path) -> None:
    profile = read_profile(two_thread_export, gpu=True)
    assert profile.gpu and read_profile(two_thread_export).events == profile.events  # gpu=auto: kernels
    assert profile.events == [
        Event(0, "0SEND_F0>1", "SEND_F", 210, 230, 0),  # ranges without kernels keep their CPU range
        Event(1, "1RECV_F0<0", "RECV_F", 215, 240, 0),
        Event(1, "STEP", "STEP", 360, 380, 0),
        Event(0, "0F0", "F", 1000, 1300, 0),      # first kernel start .. last kernel end
        Event(1, "1F0", "F", 1320, 1600, 0),
        Event(0, "STEP", "STEP", 1400, 1450, 0),
    ]
    assert not read_profile(two_thread_export, gpu=False).gpu


def test_nsys_workers_by_process_and_per_process_correlation_ids(tmp_path: Path) -> None:
    # Two processes reuse correlationId 1: each kernel must join its own process's call.
    p0, p1 = _gtid(900, 900), _gtid(700, 701)
    ranges = [(0, 100, 59, "1F0", None, p0), (0, 100, 59, "0F0", None, p1),
              (0, 100, 59, "0B0", None, p0 + 3)]  # a second thread of process 900: worker 1 too
    launches = [(p0, 10, 1, 500, 600), (p1, 10, 1, 200, 300), (p0 + 3, 20, 2, 700, 800)]
    path = _nsys_db(tmp_path / "procs.sqlite", ranges, launches, {})
    profile = read_nsys(path, gpu=True)
    assert sorted(profile.events, key=lambda e: e.name) == [
        Event(1, "0B0", "B", 700, 800), Event(0, "0F0", "F", 200, 300), Event(1, "1F0", "F", 500, 600)]
    assert profile.events[0] == Event(0, "0F0", "F", 200, 300)  # pid 700 < 900: worker 0


def test_nsys_worker_name_prefix_wins(tmp_path: Path) -> None:
    g = _gtid(1, 1)
    ranges = [(0, 10, 59, "w3:1F0", None, g), (10, 20, 59, "rank2/0B1", None, g)]
    profile = read_nsys(_nsys_db(tmp_path / "p.sqlite", ranges, [], {}))
    assert profile.events == [Event(3, "1F0", "F", 0, 10), Event(2, "0B1", "B", 10, 20)]


def test_action_names_parse_including_kfac_kinds() -> None:
    assert parse_action_name("3B5@1") == ("B", 5)
    assert parse_action_name("1SEND_F2>2") == ("SEND_F", 2)
    assert parse_action_name("STEP") == ("STEP", None)
    assert parse_action_name("2CURV_B4@1") == ("CURV_B", 4)
    assert parse_action_name("0INVERT") == ("INVERT", None)
    assert parse_action_name("forward") is None and parse_action_name("F") is None


# --- bad databases ----------------------------------------------------------------------------

def test_not_sqlite_raises_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "report.sqlite"
    path.write_text("this is a text file, not a database\n" * 20)
    with pytest.raises(ProfileError, match=r"report\.sqlite: not an SQLite database.*nsys export"):
        read_profile(path)
    with pytest.raises(ProfileError, match="no such profile file"):
        read_profile(tmp_path / "missing.sqlite")


def test_missing_nvtx_table_raises_naming_table_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "empty.sqlite"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
    conn.close()
    with pytest.raises(ProfileError, match=r"empty\.sqlite: has no NVTX_EVENTS table.*--trace=nvtx"):
        read_profile(path)
    assert issubclass(ProfileError, ValueError)


def test_no_action_ranges_raises(tmp_path: Path) -> None:
    path = _nsys_db(tmp_path / "other.sqlite", [(0, 10, 59, "forward", None, 1)], [], {})
    with pytest.raises(ProfileError,
                       match=r"other\.sqlite: table NVTX_EVENTS has no range named like an action"):
        read_profile(path)


def test_gpu_spans_need_cupti_tables(tmp_path: Path) -> None:
    path = tmp_path / "profile.sqlite"
    write_profile(path, [Event(0, "0F0", "F", 0, 10)], metadata={})
    with pytest.raises(ProfileError, match=r"CUPTI_ACTIVITY_KIND_KERNEL is missing.*gpu=False"):
        read_profile(path, gpu=True)


# --- plot and table ---------------------------------------------------------------------------

def test_plot_writes_pdf_and_png_for_chimera(tmp_path: Path, chimera_events: list[Event]) -> None:
    paths = plot_timeline(chimera_events, tmp_path / "plots" / "chimera", title="chimera D=4 N=8",
                          num_workers=4)
    assert [p.name for p in paths] == ["chimera.pdf", "chimera.png"]
    assert paths[0].read_bytes()[:5] == b"%PDF-" and paths[0].stat().st_size > 1000
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[1].stat().st_size > 1000


def test_plot_draws_kfac_kinds_and_rejects_no_events(tmp_path: Path) -> None:
    events = [Event(0, "0F0", "F", 0, 10), Event(0, "0CURV_A0", "CURV_A", 10, 15),
              Event(1, "1CURV_B0", "CURV_B", 0, 5), Event(1, "1INVERT", "INVERT", 5, 20),
              Event(1, "1PRECOND", "PRECOND", 20, 25), Event(0, "0SYNC_FACTOR", "SYNC_FACTOR", 15, 30)]
    assert all(p.stat().st_size > 0 for p in plot_timeline(events, tmp_path / "kfac.png",
                                                           oversubscribed=True))
    kfac = ["F", "B", "CURV_A", "CURV_B", "INVERT", "PRECOND", "STEP"]
    assert len({KIND_COLORS[k] for k in kfac}) == len(kfac)
    with pytest.raises(ValueError, match="no events"):
        plot_timeline([], tmp_path / "none")


def test_utilization_table_lists_workers_and_bubble_utilization(chimera_events: list[Event]) -> None:
    table = utilization_table(chimera_events)
    lines = table.splitlines()
    assert lines[0].split() == ["worker", "busy", "utilization"]
    assert [ln.split()[0] for ln in lines[1:5]] == ["W0", "W1", "W2", "W3"]
    # Chimera D=4, N=8: bubble (D-2)/(2N+D-2) = 2/18, so 16/18 = 88.9% utilization.
    assert "overall bubble utilization 88.9% (4 workers" in lines[5]
    assert "W4" in utilization_table([Event(0, "0F0", "F", 0, 10)], num_workers=5)
    assert "more workers than CPU cores" in utilization_table(chimera_events, oversubscribed=True)
