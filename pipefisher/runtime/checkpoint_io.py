"""Checkpoint files: paths, atomic writes, shards and manifests, verification and loading
(the layout and its guarantees: [Note: checkpoint layout] in ``pipefisher.runtime.checkpoint``)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from pipefisher.atomic import fsync_path, temp_beside
from pipefisher.config import ConfigError, TrainConfig

__all__ = ['CHECKPOINT_FORMAT', 'MANIFEST', 'MATCHING_FIELDS', 'CheckpointError', 'ShardInfo', 'atomic_write', 'check_compatible', 'checkpoint_root', 'config_fields', 'config_hash', 'file_info', 'find_latest', 'list_checkpoints', 'load_shard', 'prune_checkpoints', 'save_checkpoint', 'shard_name', 'step_dir', 'verify_checkpoint', 'write_manifest', 'write_shard']

log = logging.getLogger("pipefisher.runtime.checkpoint")  # the public module's name: one logger for checkpoints

CHECKPOINT_FORMAT = 1
MANIFEST = "manifest.json"
#: Config fields a checkpoint must agree on to be loadable (the state's shapes and placement, and
#: the data and weight streams). ``model`` and ``pipeline`` stand for all their fields.
MATCHING_FIELDS = ("model", "pipeline", "stages", "data_parallel", "num_micro_batches", "micro_batch_size",
                   "seed", "optimizer.name", "sdp", "tp", "optimizer.kfac_owners")
#: Matching fields recorded only when they differ from these values, so that checkpoints written
#: before the fields existed keep their hash: sharded data parallel and tensor parallel (issue 27); K-FAC's
#: owners (a replica holds inverses only for the layers it owns: ``runtime.kfac_owners``).
_UNLESS = {"sdp": 1, "tp": 1, "optimizer.kfac_owners": "holder"}
#: Fields whose change on resume is not worth a warning (they do not change the trajectory).
_QUIET_FIELDS = ("resume", "eval.", "checkpoint.", "fault.", "progress", "wandb.", "cluster.", "log_every", "profile.",
                 "device", "save_final", "init_from")  # init_from: the checkpoint's weights replace its weights
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt; the message names it and what is wrong."""


@dataclass(frozen=True)
class ShardInfo:
    """A written shard: its file name in the step folder, its size in bytes and its sha256."""

    file: str
    size: int
    sha256: str


# -- paths ---------------------------------------------------------------------------------------


def checkpoint_root(cfg: TrainConfig, output_dir: str | os.PathLike) -> Path:
    """Where this run writes checkpoints: ``checkpoint.dir``, or ``<output_dir>/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(output_dir) / "checkpoints"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """The folder of the checkpoint after ``step``."""
    return Path(root) / f"step_{step}"


def shard_name(rank: int) -> str:
    """File name of worker ``rank``'s shard."""
    return f"worker_{rank}.pt"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``step_<n>`` folder under ``root``, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return sorted(found)


# -- atomic files ----------------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> ShardInfo:
    """Write ``path`` through ``write(file)`` so that it appears whole or not at all.

    The data goes to a temporary file in the same folder, is fsynced, hashed and renamed into
    place with ``os.replace``; the folder is fsynced after the rename.

    Returns:
        The file's name, size and sha256.
    """
    path = Path(path)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            digest = hashlib.sha256()
            size = 0
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return ShardInfo(path.name, size, digest.hexdigest())


def file_info(folder: str | os.PathLike, name: str) -> ShardInfo:
    """Size and sha256 of the file ``name`` (a path relative to ``folder``), for a manifest."""
    size, digest = _file_digest(Path(folder) / name)
    return ShardInfo(name, size, digest)


def _file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


# -- config agreement ------------------------------------------------------------------------------


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: list(obj) if isinstance(obj, tuple) else obj}


def config_fields(cfg: TrainConfig) -> dict[str, Any]:
    """The :data:`MATCHING_FIELDS` of ``cfg``, flattened to ``{"model.hidden_size": 128, …}``."""
    flat = _flatten(asdict(cfg))
    return {k: v for k, v in sorted(flat.items()) if any(k == f or k.startswith(f + ".") for f in MATCHING_FIELDS)
            and not (k in _UNLESS and v == _UNLESS[k])}


def config_hash(fields: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of :func:`config_fields`."""
    return hashlib.sha256(json.dumps(dict(fields), sort_keys=True).encode()).hexdigest()


def check_compatible(manifest: Mapping[str, Any], cfg: TrainConfig, world_size: int,
                     kfac_interval: int | None, where: Path) -> None:
    """Raise unless the checkpoint described by ``manifest`` can continue this run.

    Fields outside :data:`MATCHING_FIELDS` may differ; they are logged.

    Raises:
        ConfigError: naming every differing field with both values, and the fix.
    """
    fields = config_fields(cfg)
    saved = manifest.get("config_fields", {})
    problems = []
    if manifest.get("config_hash") != config_hash(fields):
        for key in sorted(set(fields) | set(saved)):
            was, now = saved.get(key, _UNLESS.get(key, "<absent>")), fields.get(key, _UNLESS.get(key, "<absent>"))
            if was != now:
                problems.append(f"{key}: checkpoint {was!r}, this run {now!r}")
        if not problems:
            problems.append("config hash differs (checkpoint written by another version of pipefisher)")
    if manifest.get("world_size") != world_size:
        problems.append(f"world size: checkpoint {manifest.get('world_size')}, this run {world_size}")
    if manifest.get("kfac_interval") != kfac_interval:
        problems.append(f"K-FAC refresh interval: checkpoint {manifest.get('kfac_interval')}, this run "
                        f"{kfac_interval} (set by optimizer.curvature_interval or the plan in optimizer.schedule)")
    if problems:
        was = {**_UNLESS, **saved}
        fix = " ".join(f"{p.split(':')[0]}={was[p.split(':')[0]]!r}" for p in problems if p.split(":")[0] in was)
        raise ConfigError(
            f"checkpoint {where} does not fit this run:\n  " + "\n  ".join(problems)
            + f"\nFix: resume with the checkpoint's values{' (' + fix + ')' if fix else ''}, or start afresh with "
            "resume=none (and another checkpoint.dir, so that its checkpoints are kept)"
        )
    changed = []
    now = _flatten(asdict(cfg))
    for key, value in sorted(_flatten(manifest.get("config", {})).items()):
        if key in fields or key.startswith(_QUIET_FIELDS) or key not in now:
            continue
        if now[key] != value:
            changed.append(f"{key}: {value!r} -> {now[key]!r}")
    if changed:
        log.warning("resuming from %s with changed settings (this run's values apply; the loss trajectory "
                    "differs from an uninterrupted run): %s", where, "; ".join(changed))


# -- writing -------------------------------------------------------------------------------------


def write_shard(folder: str | os.PathLike, rank: int, state: Mapping[str, Any]) -> ShardInfo:
    """Atomically ``torch.save`` worker ``rank``'s state (tensors and primitives only) into ``folder``."""
    return atomic_write(Path(folder) / shard_name(rank), lambda f: torch.save(dict(state), f))


def write_manifest(folder: str | os.PathLike, step: int, cfg: TrainConfig, world_size: int,
                   shards: list[ShardInfo], kfac_interval: int | None = None,
                   files: list[ShardInfo] | None = None) -> Path:
    """Atomically write ``manifest.json``, which marks the checkpoint complete; returns its path.

    ``files``: further files of the checkpoint (the DCP folders of sharded runs), checked like shards."""
    fields = config_fields(cfg)
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "world_size": world_size,
        "config_hash": config_hash(fields),
        "config_fields": fields,
        "kfac_interval": kfac_interval,
        "created_unix_s": time.time(),
        "shards": [asdict(s) | {"rank": r} for r, s in enumerate(shards)],
        **({"files": [asdict(f) for f in files]} if files else {}),
        "config": asdict(cfg),
    }
    text = json.dumps(manifest, indent=1, default=str).encode()
    path = Path(folder) / MANIFEST
    atomic_write(path, lambda f: f.write(text))
    return path


def prune_checkpoints(root: str | os.PathLike, keep_last: int, current: int) -> list[Path]:
    """Delete checkpoint folders older than step ``current``, keeping the ``keep_last`` newest
    complete ones (the current one counts; 0 keeps all). Incomplete folders older than ``current``
    are deleted too. Folders of later steps (another timeline, see :func:`agree_on_resume`) stay.

    Returns:
        The folders deleted.
    """
    if keep_last <= 0:
        return []
    entries = [(s, p) for s, p in list_checkpoints(root) if s <= current]
    complete = [(s, p) for s, p in entries if (p / MANIFEST).is_file()]
    keep = {p for _, p in complete[-keep_last:]} | {step_dir(root, current)}
    removed = []
    for s, p in entries:
        if p not in keep and s < current:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("pruned checkpoints %s (checkpoint.keep_last=%d)", ", ".join(p.name for p in removed), keep_last)
    return removed


def save_checkpoint(root: str | os.PathLike, step: int, rank: int, world_size: int, state: Mapping[str, Any],
                    cfg: TrainConfig, kfac_interval: int | None,
                    write_more: Callable[[Path], list[ShardInfo]] | None = None) -> Path:
    """Write the checkpoint after ``step``; every worker calls it (a collective).

    Each worker writes its shard (and, with ``write_more``, whatever it writes into the folder: the
    DCP folders of sharded runs, returning the files to list); rank 0 waits for all of them, writes
    the manifest and prunes.

    Returns:
        The checkpoint's folder.
    """
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:  # a folder re-written after a resume: it is no longer complete until the new manifest
        (folder / MANIFEST).unlink(missing_ok=True)
    info = write_shard(folder, rank, state)
    more = write_more(folder) if write_more is not None else []
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object((info, more), gathered, dst=0)  # the barrier: every shard is on disk
    if rank == 0:
        assert gathered is not None and all(s is not None for s in gathered)
        shards, files = [s for s, _ in gathered], [f for _, fs in gathered for f in fs]
        write_manifest(folder, step, cfg, world_size, shards, kfac_interval, files)
        log.info("checkpoint %s written: the state after %d steps (%s counts from step_0, as metrics.jsonl "
                 "does; %d shards, %.1f MB)", folder, step + 1, folder.name, world_size,
                 sum(s.size for s in shards + files) / 1e6)
        prune_checkpoints(root, cfg.checkpoint.keep_last, step)
    return folder


# -- reading -------------------------------------------------------------------------------------


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {folder}: no {MANIFEST} (incomplete: the run stopped while saving it)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {folder}: unreadable {MANIFEST} ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT or "shards" not in manifest:
        raise CheckpointError(f"checkpoint {folder}: {MANIFEST} is not a format-{CHECKPOINT_FORMAT} manifest")
    return manifest


def _check_shard(folder: Path, entry: Mapping[str, Any], data: bytes | None = None) -> None:
    path = folder / entry["file"]
    if data is None:
        if not path.is_file():
            raise CheckpointError(f"checkpoint {folder}: shard {entry['file']} is missing")
        size, digest = _file_digest(path)
    else:
        size, digest = len(data), hashlib.sha256(data).hexdigest()
    if size != entry["size"]:
        raise CheckpointError(f"checkpoint {folder}: shard {entry['file']} has {size} bytes, the manifest says "
                              f"{entry['size']} (truncated or overwritten)")
    if digest != entry["sha256"]:
        raise CheckpointError(f"checkpoint {folder}: shard {entry['file']} does not match its sha256 (corrupt)")


def verify_checkpoint(folder: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint folder: manifest present and every shard of the right size and hash.

    Returns:
        The manifest.

    Raises:
        CheckpointError: naming the folder and what is wrong.
    """
    folder = Path(folder)
    manifest = _read_manifest(folder)
    if len(manifest["shards"]) != manifest.get("world_size"):
        raise CheckpointError(f"checkpoint {folder}: {len(manifest['shards'])} shards for world size "
                              f"{manifest.get('world_size')}")
    for entry in [*manifest["shards"], *manifest.get("files", [])]:
        _check_shard(folder, entry)
    return manifest


def find_latest(root: str | os.PathLike) -> Path | None:
    """The newest valid checkpoint folder under ``root`` (see [Note: checkpoint layout]), or None.

    Incomplete or corrupt folders are skipped with a warning naming them and the reason.
    """
    for _step, folder in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(folder)
        except CheckpointError as err:
            log.warning("skipping %s", err)
            continue
        return folder
    return None



def load_shard(folder: str | os.PathLike, rank: int) -> dict[str, Any]:
    """Read worker ``rank``'s shard, check it against the manifest, and load it on the CPU.

    Raises:
        CheckpointError: no manifest, no entry for ``rank``, or a shard that does not match.
    """
    folder = Path(folder)
    manifest = _read_manifest(folder)
    entries = [e for e in manifest["shards"] if e.get("rank") == rank]
    if len(entries) != 1:
        raise CheckpointError(f"checkpoint {folder}: the manifest lists no shard of worker {rank}")
    path = folder / entries[0]["file"]
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"checkpoint {folder}: cannot read {path.name} ({err})") from None
    _check_shard(folder, entries[0], data)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
