"""Files the runs write get the mode the umask gives, not mkstemp's 0600 (issue 24): on a shared
file system the group reads profiles, timelines, assignments and checkpoints."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from pipefisher.atomic import current_umask, temp_beside, write_text_atomic
from pipefisher.profiling.sqlite import write_profile
from pipefisher.profiling.trace_json import write_trace_json
from pipefisher.runtime.checkpoint_io import atomic_write
from pipefisher.timeline import Event


@pytest.fixture(params=[0o022, 0o027, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_current_umask_reads_without_changing(umask) -> None:
    assert current_umask() == umask
    assert current_umask() == umask


def test_mkstemp_alone_would_give_0600(tmp_path: Path, umask) -> None:
    fd, name = tempfile.mkstemp(dir=tmp_path)  # what the writers used before: the reason for temp_beside
    os.close(fd)
    assert _mode(Path(name)) == 0o600


def test_every_atomic_writer_gives_0666_less_the_umask(tmp_path: Path, umask) -> None:
    expected = 0o666 & ~umask
    events = [Event(worker=0, name="0F0", kind="F", start_ns=0, end_ns=10)]
    written = [
        write_text_atomic(tmp_path / "assignment.json", "{}\n"),
        write_trace_json(tmp_path / "timeline.json", events),
    ]
    atomic_write(tmp_path / "shard_0.pt", lambda f: f.write(b"x"))
    written.append(tmp_path / "shard_0.pt")
    write_profile(tmp_path / "profile.sqlite", events, metadata={"config": {}})
    written.append(tmp_path / "profile.sqlite")
    fd, tmp = temp_beside(tmp_path / "other")
    os.close(fd)
    written.append(tmp)
    assert {p.name: oct(_mode(p)) for p in written} == {p.name: oct(expected) for p in written}
