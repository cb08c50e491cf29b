"""No module of the package above ~450 lines without a reason written at its top (issue 39, item 2):
a "Why one module:" sentence in its first 30 lines, saying why its parts belong together."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import REPO

MAX_LINES = 450
REASON = "Why one module:"
REASON_WITHIN = 30  # lines from the top of the file


def _unexplained_large_modules(root: Path) -> list[str]:
    """Modules under ``root`` longer than MAX_LINES whose first REASON_WITHIN lines do not give a reason."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > MAX_LINES and not any(REASON in line for line in lines[:REASON_WITHIN]):
            found.append(f"{path.relative_to(root.parent)} ({len(lines)} lines)")
    return found


def test_the_size_check_finds_an_unexplained_large_module(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "x = 1\n" * MAX_LINES
    (pkg / "small.py").write_text('"""Small."""\n' + "x = 1\n" * (MAX_LINES - 1))
    (pkg / "large.py").write_text('"""Large."""\n' + body)
    (pkg / "explained.py").write_text(f'"""Large.\n\n{REASON} its parts share one state.\n"""\n' + body)
    (pkg / "late.py").write_text('"""Large."""\n' + "x = 1\n" * REASON_WITHIN + f"# {REASON} too far down\n" + body)
    assert _unexplained_large_modules(pkg) == [f"pkg/large.py ({MAX_LINES + 1} lines)",
                                               f"pkg/late.py ({MAX_LINES + REASON_WITHIN + 2} lines)"]


def test_every_module_above_450_lines_says_why_it_is_one_module() -> None:
    found = _unexplained_large_modules(REPO / "pipefisher")
    assert not found, (f"split these modules, or say at the top of each docstring why its parts belong together "
                       f"('{REASON} ...'):\n  " + "\n  ".join(found))
