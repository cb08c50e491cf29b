"""A thin, rank-aware wrapper over ``wandb`` that never needs the network by default.

[Note: which mode wins] The effective mode is decided once, in this order:

1. ``enabled=False`` or ``mode="disabled"`` in the config → disabled.
2. the ``WANDB_MODE`` environment variable, when set (``online`` / ``offline`` / ``disabled``;
   ``dryrun`` is wandb's old name for ``offline``). ``WANDB_DISABLED=true`` also disables.
3. ``mode`` from the config (``offline`` by default).

So the environment can switch a configured run between offline and online, or turn it off, but a
run the config disables stays disabled. When disabled, or on a rank other than 0, the logger is a
no-op: ``wandb`` is not imported and no file is created.

[Note: a resumed run is the same wandb run] (issue 40, item 5) A run's wandb id is stored in its
run folder (:data:`RUN_ID_FILE`). An attempt that continues from a checkpoint (``resume=auto`` or
a path, a requeued SLURM job) opens that id with ``resume="allow"``, so every attempt's steps land
in one wandb run (offline: ``wandb sync`` uploads each attempt's folder into it). Steps after the
checkpoint that the interrupted attempt had logged come again with the same values (a resumed run
follows the uninterrupted trajectory); wandb keeps the first and drops the repeats. An attempt that
starts at step 0 gets a new id.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from pipefisher.atomic import write_text_atomic
from pipefisher.tracking.metrics import to_python

__all__ = ["WANDB_MODES", "RUN_ID_FILE", "WandbLogger", "resolve_mode", "run_name_from_overrides"]

logger = logging.getLogger(__name__)

#: Modes accepted in the config and in ``WANDB_MODE``.
WANDB_MODES: tuple[str, ...] = ("online", "offline", "disabled")
#: The run folder's file holding its wandb run id ([Note: a resumed run is the same wandb run]).
RUN_ID_FILE = "wandb_run_id.txt"


#: Keys that say how a run is watched, not what it trains: left out of run names.
UNNAMED_KEYS: tuple[str, ...] = ("progress", "log_every", "resume")
#: The longest run name (wandb shows names up to 128 characters).
MAX_NAME = 128


def _last_part(value: str) -> str:
    """A path's last part (quotes dropped); anything else as it is."""
    value = value.strip().strip("'\"")
    return (Path(value.rstrip("/")).name or value) if "/" in value else value


def _short_value(value: str) -> str:
    """An override's value for a run name: a path's last part, element by element in a list
    (``[a/b,c/d]`` -> ``[b,d]``) or dict (``{x: a/b}`` -> ``{x: b}``), so brackets stay paired."""
    value = value.strip()
    if len(value) >= 2 and (value[0], value[-1]) in (("[", "]"), ("{", "}")):
        items = []
        for item in value[1:-1].split(","):
            key, colon, rest = item.partition(":") if value[0] == "{" else ("", "", item)
            items.append(f"{key.strip()}: {_last_part(rest)}" if colon else _last_part(rest))
        return value[0] + ",".join(items) + value[-1]
    return _last_part(value)


def run_name_from_overrides(overrides: Sequence[str], *, exclude: Sequence[str] = ()) -> str:
    """A run name from Hydra command-line overrides, e.g. ``"pipeline=chimera,stages=4"``.

    Like Hydra's ``hydra.job.override_dirname``: overrides sorted by key and joined with commas,
    so the same choices give the same name in any order. Leading ``+``, ``++`` and ``~`` are
    dropped; ``hydra.*``, ``wandb.*``, :data:`UNNAMED_KEYS` and keys in ``exclude`` are left
    out; a path keeps its last part (``data.path=/scratch/u/wiki`` -> ``data.path=wiki``), in a list
    each element does (``init.checkpoint=[runs/wt2]`` -> ``init.checkpoint=[wt2]``; issue 40); a
    name longer than :data:`MAX_NAME` is cut there, ending in ``…``.

    Args:
        overrides: the overrides as typed, e.g. ``HydraConfig.get().overrides.task``.
        exclude: keys to leave out (e.g. ``["seed", "wandb.mode"]``).

    Returns:
        The name; ``"default"`` when no override is left.
    """
    parts: list[tuple[str, str]] = []
    for raw in overrides:
        item = raw.strip().lstrip("+~")
        if not item:
            continue
        key, _, value = item.partition("=")
        key = key.strip()
        if key.split(".")[0] in ("hydra", "wandb") or key in UNNAMED_KEYS or key in exclude:
            continue
        parts.append((key, f"{key}={_short_value(value)}" if _ else key))
    name = ",".join(item for _, item in sorted(parts)) or "default"
    return name if len(name) <= MAX_NAME else name[:MAX_NAME - 1] + "…"


def resolve_mode(mode: str, *, enabled: bool = True) -> str:
    """The effective wandb mode (see [Note: which mode wins]).

    Args:
        mode: the configured mode, one of :data:`WANDB_MODES`.
        enabled: the config's on/off switch.

    Returns:
        ``"online"``, ``"offline"`` or ``"disabled"``.

    Raises:
        ValueError: ``mode`` or ``WANDB_MODE`` is not a known mode.
    """
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode={mode!r} is not one of {', '.join(WANDB_MODES)}")
    if not enabled or mode == "disabled":
        return "disabled"
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if not env:
        return mode
    env = "offline" if env == "dryrun" else env
    if env not in WANDB_MODES:
        raise ValueError(
            f"environment variable WANDB_MODE={env!r} is not one of {', '.join(WANDB_MODES)}; "
            "unset it or pick one of those"
        )
    return env


def _stored_id(path: str | Path | None) -> str | None:
    """The wandb run id stored in ``path``, or None (no file, or not an id)."""
    if path is None or not Path(path).is_file():
        return None
    text = Path(path).read_text().strip()
    return text if text and text.replace("-", "").replace("_", "").isalnum() else None


def _default_rank() -> int:
    """The process rank from the launcher's environment (``RANK``), 0 when unset."""
    return int(os.environ.get("RANK", "0"))


class WandbLogger:
    """Log metrics and images to one wandb run, or do nothing.

    Only rank 0 creates a run; on other ranks, and when the resolved mode is ``disabled``, every
    method is a no-op and ``wandb`` is never imported.

    Args:
        cfg_dict: the run's resolved config (stored as the run's config).
        project: wandb project.
        group: runs grouped together, normally the sweep id.
        name: the run's name, normally :func:`run_name_from_overrides`; ``None`` lets wandb pick.
        mode: ``"offline"`` (default), ``"online"`` or ``"disabled"``; see [Note: which mode wins].
        dir: where wandb writes (``<dir>/wandb/offline-run-*``), normally the Hydra output
            directory; created if missing. ``None``: ``WANDB_DIR`` or the working directory.
        enabled: the config's on/off switch.
        rank: this process's rank; ``None`` reads ``RANK`` from the environment (0 when unset).
        tags: optional run tags.
        run_id_file: where this run keeps its wandb id (normally ``<run folder>/``:data:`RUN_ID_FILE`);
            None: wandb picks an id and nothing is stored.
        continuing: this attempt continues from a checkpoint: reopen the stored id, when there is one,
            with ``resume="allow"`` ([Note: a resumed run is the same wandb run]).
    """

    def __init__(
        self,
        cfg_dict: Mapping[str, Any] | None = None,
        *,
        project: str = "pipefisher",
        group: str | None = None,
        name: str | None = None,
        mode: str = "offline",
        dir: str | Path | None = None,  # noqa: A002 - mirrors wandb.init
        enabled: bool = True,
        rank: int | None = None,
        tags: Sequence[str] | None = None,
        run_id_file: str | Path | None = None,
        continuing: bool = False,
    ) -> None:
        self.rank = _default_rank() if rank is None else rank
        self.mode = resolve_mode(mode, enabled=enabled)
        self._run: Any = None
        self._wandb: Any = None
        if self.mode == "disabled" or self.rank != 0:
            logger.debug("wandb: no run (mode=%s, rank=%d)", self.mode, self.rank)
            return

        import wandb  # deferred: a disabled logger must not need (or pay for) the import

        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        run_id = _stored_id(run_id_file) if continuing else None  # None: wandb picks a new id
        resume = "allow" if run_id is not None else None
        self._run = wandb.init(
            project=project,
            group=group,
            name=name,
            config=dict(cfg_dict) if cfg_dict is not None else None,
            mode=self.mode,
            dir=str(dir) if dir is not None else None,
            tags=list(tags) if tags else None,
            reinit="finish_previous",
            settings=wandb.Settings(silent=True),  # our lines below, not wandb's banner and summary table
            id=run_id,
            resume=resume,
        )
        if run_id_file is not None:
            write_text_atomic(run_id_file, self._run.id + "\n")
        self._offline_dir = str(Path(self._run.dir).parent) if self.mode == "offline" else None
        logger.info("wandb: %s run %r in %s%s", self.mode, name, self._run.dir,
                    f" (continuing wandb run {run_id})" if resume else "")

    @property
    def active(self) -> bool:
        """Whether a wandb run is open (rank 0, not disabled, not finished)."""
        return self._run is not None

    @property
    def run_dir(self) -> Path | None:
        """The run's files directory (``.../wandb/<run>/files``), or None without a run."""
        return Path(self._run.dir) if self._run is not None else None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` at ``step``; tensor and numpy values are converted to Python numbers.

        Args:
            metrics: name → value; objects wandb understands (``wandb.Image`` …) pass through.
            step: the training step (monotonically increasing); ``None`` uses wandb's counter.
        """
        if self._run is None:
            return
        clean = {}
        for key, value in metrics.items():
            try:
                clean[key] = to_python(value)
            except TypeError:
                clean[key] = value  # a wandb media object or similar
        self._run.log(clean, step=step)

    def log_image(self, key: str, path: str | Path, step: int | None = None) -> None:
        """Log the image file at ``path`` (PNG, JPEG, …) under ``key``.

        Raises:
            FileNotFoundError: ``path`` does not exist (also checked when no run is open, so a
                broken plot path shows up in disabled test runs too).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"log_image({key!r}): no image file at {path}")
        if self._run is None:
            return
        self._run.log({key: self._wandb.Image(str(path))}, step=step)

    def finish(self) -> None:
        """Close the run (writes its summary); safe to call twice."""
        if self._run is not None:
            url = None if self._offline_dir else getattr(self._run, "url", None)
            self._run.finish()
            self._run = None
            if self._offline_dir:
                logger.info("wandb: upload this run with `wandb sync %s`", self._offline_dir)
            elif url:
                logger.info("wandb: %s", url)

    def __enter__(self) -> WandbLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish()
