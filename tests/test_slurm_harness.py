"""What the SLURM tests do on a machine with and without SLURM (issue 40, item 3): use a running
cluster, start an installed one as root, skip where SLURM is not installed, fail otherwise naming
the fix. Fast: the decision is a pure function, and the start path runs against stand-in commands."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from tests import slurm_harness
from tests.slurm_harness import SlurmState, slurm_nodes, slurm_plan

UP = {"pfnode1": "idle", "pfnode2": "mix"}


@pytest.mark.parametrize("state, min_nodes, action, says", [
    (SlurmState(True, True, UP, True), 1, "skip", "PIPEFISHER_SKIP_SLURM=1"),
    (SlurmState(False, True, UP, False), 2, "use", "2 SLURM node(s) up"),
    (SlurmState(False, False, None, True), 1, "skip", "SLURM is not installed (no slurmctld): "
                                                      "`sudo scripts/slurm/start.sh --nodes 2` installs"),
    (SlurmState(False, False, None, False), 2, "skip", "SLURM is not installed"),
    (SlurmState(False, True, None, True), 1, "start", "does not answer: starting it with "
                                                      "`scripts/slurm/start.sh --nodes 2`"),
    (SlurmState(False, True, {"pfnode1": "idle"}, True), 2, "start", "1 SLURM node(s) up"),
    (SlurmState(False, True, {"pfnode1": "down"}, True), 1, "start", "0 SLURM node(s) up"),
    (SlurmState(False, True, None, False), 1, "fail", "run `sudo scripts/slurm/start.sh --nodes 2` (as root)"),
    (SlurmState(False, False, {"login": "idle"}, False), 2, "fail", "1 SLURM node(s) up"),
], ids=["skip-asked", "running", "not-installed-root", "not-installed-user", "installed-stopped-root",
        "too-few-nodes-root", "node-down-root", "installed-stopped-user", "remote-controller-too-few"])
def test_slurm_plan_uses_starts_skips_or_fails(state: SlurmState, min_nodes: int, action: str, says: str) -> None:
    got, why = slurm_plan(state, min_nodes)
    assert (got, says in why) == (action, True), why


def _stand_in(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with slurmctld and an sinfo that answers once ``start.sh`` (a stand-in) has run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    flag = tmp_path / "started"
    _stand_in(bin_dir, "slurmctld", "exit 0\n")
    _stand_in(bin_dir, "sinfo", f'[ -f {flag} ] || {{ echo "Unable to contact slurm controller" >&2; exit 1; }}\n'
                                'printf "pfnode1 idle\\npfnode2 idle\\n"\n')
    _stand_in(tmp_path, "start.sh", f'echo "$@" >> {tmp_path}/calls; touch {flag}\n')
    tools = tmp_path / "tools"  # what the stand-ins run, and nothing else: a real SLURM's sinfo (CI starts one) stays out
    tools.mkdir()
    (tools / "touch").symlink_to(shutil.which("touch"))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{tools}")
    monkeypatch.delenv("PIPEFISHER_SKIP_SLURM", raising=False)
    monkeypatch.setattr(slurm_harness, "_SBIN", ())
    monkeypatch.setattr(slurm_harness, "_start_failed", {})
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    return tmp_path


def test_an_installed_slurm_that_is_not_running_is_started_with_two_nodes(fake_slurm: Path) -> None:
    assert slurm_nodes(1, script=fake_slurm / "start.sh") == {"pfnode1": "idle", "pfnode2": "idle"}
    assert (fake_slurm / "calls").read_text().split() == ["--nodes", "2"]
    slurm_nodes(2, script=fake_slurm / "start.sh")  # running now: not started again
    assert (fake_slurm / "calls").read_text().split() == ["--nodes", "2"]


def test_a_start_that_fails_fails_the_test_with_its_reason_once(fake_slurm: Path) -> None:
    _stand_in(fake_slurm, "start.sh", f'echo call >> {fake_slurm}/calls; echo "[slurm/start] error: no apt" >&2; exit 1\n')
    for _ in range(2):
        with pytest.raises(pytest.fail.Exception, match=r"starting it with .*exit status 1: \[slurm/start\] error: no apt"):
            slurm_nodes(1, script=fake_slurm / "start.sh")
    assert (fake_slurm / "calls").read_text().split() == ["call"]  # not tried again


def test_without_slurmctld_the_slurm_tests_skip_saying_why(fake_slurm: Path) -> None:
    (fake_slurm / "bin" / "slurmctld").unlink()
    (fake_slurm / "bin" / "sinfo").unlink()
    with pytest.raises(pytest.skip.Exception, match="SLURM is not installed"):
        slurm_nodes(1, script=fake_slurm / "start.sh")
    assert not (fake_slurm / "calls").exists()
