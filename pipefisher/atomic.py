"""Files written whole or not at all, with the permissions any other file of the user gets.

``tempfile.mkstemp`` creates its file with mode 0600 whatever the umask, so a file renamed into
place from it stays unreadable to the group on a shared file system (issue 24). Every atomic
writer of the project (checkpoints, profile.sqlite, timeline.json, assignment.json, the CPU peak
cache) takes its temporary file from :func:`temp_beside`, which gives it the mode ``open()``
would: 0666 less the process's umask.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["current_umask", "fsync_path", "temp_beside", "usual_file_mode", "write_text_atomic"]


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no /proc: set and restore (not thread-safe, called rarely)
    os.umask(mask)
    return mask


def usual_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the process's umask."""
    return 0o666 & ~current_umask()


def fsync_path(path: str | Path) -> None:
    """Flush a file or a folder (after a rename into it) to disk; a platform or file system that
    cannot open or sync it is skipped."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse to sync a directory
        pass
    finally:
        os.close(fd)


def temp_beside(path: str | Path) -> tuple[int, Path]:
    """A new temporary file in ``path``'s folder (to ``os.replace`` onto ``path``): its open fd and
    path, with mode 0666 & ~umask."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, usual_file_mode())
    return fd, Path(tmp)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: readers see the old file or
    the whole new one, never a part; the folder is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
