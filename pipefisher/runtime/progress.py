"""The training loop's progress on rank 0: a tqdm bar on a terminal, a line every ``log_every`` steps
elsewhere (:func:`progress_range`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from pipefisher.config import TrainConfig

__all__ = ["progress_range", "LineProgress"]


def progress_range(cfg: TrainConfig, enabled: bool, first: int = 0, stream: IO[str] | None = None) -> Iterator[int] | Any:
    """``range(first, cfg.steps)``, wrapped in a tqdm bar when ``enabled`` and ``cfg.progress``.

    A bar is for a terminal: where ``stream`` (stderr) is none (a log file, a job's output), a
    redrawn bar becomes a line per step, so the steps go in a :class:`LineProgress` instead (issue
    40, item 5).
    """
    steps = range(first, cfg.steps)
    if not (enabled and cfg.progress):
        return steps
    stream = stream if stream is not None else sys.stderr
    if not _is_terminal(stream):
        return LineProgress(steps, cfg.steps, every=cfg.log_every, stream=stream)
    from tqdm import tqdm

    return tqdm(steps, initial=first, total=cfg.steps, desc="train", unit="step", dynamic_ncols=True, file=stream)


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class LineProgress:
    """The progress of a run whose output is no terminal: one line, as tqdm formats its bar, after
    the first step, every ``every`` steps (the steps whose loss the bar shows: ``log_every``) and
    the last, instead of a bar redrawn every step. Iterates the steps; ``set_postfix`` and
    ``close`` as tqdm's."""

    def __init__(self, steps: range, total: int, every: int, stream: IO[str], desc: str = "train") -> None:
        self.steps, self.total, self.every, self.stream, self.desc = steps, total, max(1, every), stream, desc
        self.postfix = ""
        self._start = time.monotonic()

    def __iter__(self) -> Iterator[int]:
        for step in self.steps:
            yield step  # the caller's step runs (and sets the postfix) before the line
            if step % self.every == 0 or step == self.total - 1:
                self._line(step + 1)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())

    def close(self) -> None:
        self.stream.flush()

    def _line(self, done: int) -> None:
        from tqdm import tqdm

        line = tqdm.format_meter(done, self.total, time.monotonic() - self._start, prefix=self.desc, unit="step",
                                 postfix=self.postfix or None, initial=self.steps.start)
        self.stream.write(line + "\n")
        self.stream.flush()
