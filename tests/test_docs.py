"""The documentation as a spec: README's size, links that resolve, and the commands marked runnable run.

A fenced block right after a line ``<!-- runnable ... -->`` in README.md or docs/*.md is run line by line as a
user would type it (from a fresh working folder, `python X.py` being the repository's script); a line that
shows a typo or a refusal must fail with one message and no traceback, every other line must exit 0.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOC_FILES = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "bench" / "README.md",
             *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "bench" / "studies").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_is_at_most_12_kb() -> None:
    assert len((REPO / "README.md").read_bytes()) <= 12 * 1024


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    missing = [target for target, _ in _LINK.findall(doc.read_text())
               if not target.startswith(("http://", "https://", "mailto:")) and not (doc.parent / target).exists()]
    assert not missing, f"{doc.relative_to(REPO)} links to missing files: {missing}"


def runnable_blocks() -> list[tuple[str, list[str]]]:
    """(``file:line``, the block's command lines) of every block marked runnable."""
    blocks = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- runnable") and i + 1 < len(lines) and lines[i + 1].startswith("```"):
                end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
                cmds = [c for c in lines[i + 2:end] if c.strip() and not c.lstrip().startswith("#")]
                blocks.append((f"{doc.relative_to(REPO)}:{i + 1}", cmds))
    return blocks


def test_some_blocks_are_marked_runnable() -> None:
    assert len(runnable_blocks()) >= 2


def _argv(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    assert words[0] == "python", command
    if words[1].endswith(".py"):
        return [sys.executable, str(REPO / words[1]), *words[2:]]
    return [sys.executable, *words[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("where, commands", runnable_blocks(), ids=[w for w, _ in runnable_blocks()])
def test_runnable_block_runs_as_written(where: str, commands: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for command in commands:
        proc = subprocess.run(_argv(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        expected_failure = "typo" in command or "refused" in command
        if expected_failure:
            assert proc.returncode != 0 and "Traceback" not in proc.stderr, (where, command, proc.stderr[-2000:])
        else:
            assert proc.returncode == 0, (where, command, proc.stdout[-2000:], proc.stderr[-2000:])
