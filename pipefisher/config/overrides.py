"""Command-line override checks before Hydra composes anything: an unknown key names the closest one
(:func:`check_override_keys`), ``--key value`` and an unknown group option get the fix, and
:func:`refuse_unknown_keys` turns the refusal into an entry point's one-line exit."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import get_type_hints

from pipefisher.config.choices import ConfigError
from pipefisher.config.schema import TrainConfig


def _schema_keys(schema: type, prefix: str = "", rename: Mapping[str, str] | None = None) -> list[str]:
    """Every dotted key of a dataclass schema, nested dataclasses included (``model``, ``model.name``, …)."""
    keys = []
    hints = get_type_hints(schema)
    for f in fields(schema):
        key = prefix + (rename or {}).get(f.name, f.name)
        keys.append(key)
        if is_dataclass(hints.get(f.name)):
            keys += _schema_keys(hints[f.name], key + ".", rename)
    return keys


def check_override_keys(args: Iterable[str], schema: type | None = None,
                        rename: Mapping[str, str] | None = None) -> None:
    """Refuse a command-line override whose key the schema lacks, naming the closest key.

    Hydra's own message for ``stagez=2`` suggests ``+stagez=2``, which adds a key nothing reads
    (and then fails on the structured config); the fix is almost always a typo (issue 16).
    Arguments that are not plain ``key=value`` changes (flags, ``+key``/``++key``/``~key``,
    ``group@package=…``, ``hydra.*`` and ``hydra/*``) are left to Hydra, and so is any key below
    a field that is not itself a schema (a list or a free-form value).

    Args:
        args: command-line arguments, as in ``sys.argv[1:]``.
        schema: the dataclass of the composed config (default :class:`TrainConfig`).
        rename: field name -> config key, where they differ (schedule.py's ``from_`` is ``from``).

    Raises:
        ConfigError: ``<key>=<value>: unknown key '<key>'; did you mean <closest>=<value>?``
    """
    schema = schema or TrainConfig
    keys = _schema_keys(schema, rename=rename)
    known = set(keys)
    args = list(args)
    _refuse_flag_style(args, known)
    _refuse_unknown_choices(args, schema, rename)
    leaves: dict[str, list[str]] = {}
    for key in keys:
        leaves.setdefault(key.rsplit(".", 1)[-1], []).append(key)
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if "@" in key or "/" in key or key == "hydra" or key.startswith("hydra."):
            continue
        parts = key.split(".")
        if not all(p.isidentifier() for p in parts):
            continue  # not a key Hydra would take either: leave its message to Hydra
        # The longest prefix that is a schema key decides: below a non-schema field anything goes.
        depth = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), 0)
        if depth == len(parts):
            continue
        parent = ".".join(parts[:depth])
        if depth and not any(k.startswith(parent + ".") for k in keys):
            continue  # below a leaf (a list or a free-form field)
        siblings = [k for k in keys if k.count(".") == depth and k.startswith(parent + "." if depth else "")]
        close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6) or \
            difflib.get_close_matches(key, keys, n=1, cutoff=0.75) or leaves.get(parts[-1], [])[:1]
        hint = f"; did you mean {close[0]}={value}?" if close else ""
        where = f"'{parent}' has" if depth else "the config has"
        raise ConfigError(f"{arg}: unknown key '{key}'{hint} ({where} no key '{parts[depth]}'; --help lists the keys)")


# Hydra's own command-line flags (``python train.py --help`` lists them): left to Hydra.
_HYDRA_FLAGS = {"help", "hydra-help", "version", "cfg", "resolve", "package", "run", "multirun", "shell-completion",
                "config-path", "config-name", "config-dir", "experimental-rerun", "info"}
_CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # pipefisher/conf


def _refuse_flag_style(args: list[str], known: set[str]) -> None:
    """``--steps 30`` or ``--steps=30``: Hydra takes ``key=value``, and argparse's own error
    ("unrecognized arguments") does not say so (issue 40, item 5)."""
    for i, arg in enumerate(args):
        if not arg.startswith("--") or arg[2:].split("=", 1)[0] in _HYDRA_FLAGS:
            continue
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        if key not in known:
            continue
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = nxt if nxt is not None and not nxt.startswith("-") and "=" not in nxt else "<value>"
        shown = arg if eq or value == "<value>" else f"{arg} {value}"
        raise ConfigError(f"{shown}: options are key=value without dashes: write {key}={value}")


def _refuse_unknown_choices(args: list[str], schema: type, rename: Mapping[str, str] | None) -> None:
    """``optimizer=kfca``: name the group's options (its YAML files) before Hydra lists them with
    its internal ``*_schema`` entries (issue 40, item 5)."""
    hints = get_type_hints(schema)
    groups = {(rename or {}).get(f.name, f.name) for f in fields(schema)
              if is_dataclass(hints.get(f.name)) and (_CONF_DIR / (rename or {}).get(f.name, f.name)).is_dir()}
    for arg in args:
        if arg.startswith(("-", "+", "~")) or "=" not in arg:
            continue
        group, value = arg.split("=", 1)
        if group not in groups or not value or any(c in value for c in "()[]${}*?") or value == "null":
            continue  # a sweep function, an interpolation or a glob: Hydra's to expand
        options = sorted(p.stem for p in (_CONF_DIR / group).glob("*.yaml"))
        for choice in value.split(","):
            if choice not in options and choice != f"{group}_schema":  # the schema: refused after composition
                close = difflib.get_close_matches(choice, options, n=1, cutoff=0.5)
                hint = f"did you mean {group}={close[0]}? " if close else ""
                raise ConfigError(f"{arg}: no {group} '{choice}'; {hint}choose one of {', '.join(options)}")


def refuse_unknown_keys(args: Iterable[str], program: str, schema: type | None = None,
                        rename: Mapping[str, str] | None = None) -> None:
    """:func:`check_override_keys` for an entry point: an unknown key ends the process with
    ``<program>: <message>`` and status 1 (``HYDRA_FULL_ERROR=1``: the error with its traceback)."""
    try:
        check_override_keys(args, schema, rename)
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SystemExit(f"{program}: {err}") from None
