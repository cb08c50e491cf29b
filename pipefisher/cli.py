"""Hydra entry points behind ``train.py`` and ``profile.py`` (and the ``pipefisher-train`` /
``pipefisher-profile`` console scripts).

The scripts at the repository root only call these functions, so the config directory is the
package's ``pipefisher/conf`` (``conf/`` at the root is a link to it) wherever the package lives.

[Note: errors a user can fix print one message]
A :class:`~pipefisher.config.ConfigError`, a ``DataError`` (bad ``data.path``, unreadable shard),
a ``CheckpointError`` or a ``ScheduleError`` is a message for the user, not a bug: it is printed
as ``<script>: <message>`` on stderr, without a traceback, and the exit status is 1
(``HYDRA_FULL_ERROR=1`` raises it with its traceback instead). The same holds when a worker
process raised one (the launcher's exception then carries the worker's traceback as text). A
failed run's output directory is removed when it holds only what Hydra wrote before the run
(``.hydra/`` and the job's log), so a mistyped command leaves nothing behind; otherwise the
message is appended to the job's log. The config (and ``data.path``'s shards) are checked here,
before wandb or any worker starts. A command-line key the config lacks is refused before Hydra
composes anything, naming the closest key (:func:`~pipefisher.config.check_override_keys`).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf

from pipefisher.config import KFAC_OPTIMIZERS, TrainConfig, refuse_unknown_keys, register_configs, to_train_config
from pipefisher.run_folder import clean_up_failed_run

__all__ = ["train_main", "profile_main", "UserError", "user_message"]

log = logging.getLogger(__name__)
register_configs()

_CONF = Path(__file__).parent / "conf"
#: (module, class) of the errors that carry a message for the user (see the Note above).
_USER_ERRORS = (
    ("pipefisher.config", "ConfigError"),
    ("pipefisher.data.batches", "DataError"),
    ("pipefisher.runtime.checkpoint_io", "CheckpointError"),  # its home module, as a worker's traceback names it
    ("pipefisher.schedules.checks", "ScheduleError"),
)
# The last "<module>.<Class>: message" line of a traceback that a worker's failure carries as text.
_RAISED = re.compile(r"^(pipefisher(?:\.\w+)+)\.(\w+): ", re.MULTILINE)


class UserError(CompactHydraException):
    """A user-fixable error: Hydra prints its message alone and exits with status 1."""


def _user_error_types() -> tuple[type[BaseException], ...]:
    # Only a module already imported can have raised its error: looking the classes up in
    # sys.modules keeps torch (imported by the data and checkpoint modules) off this path.
    return tuple(getattr(sys.modules[m], name) for m, name in _USER_ERRORS if m in sys.modules)


def user_message(err: BaseException) -> str | None:
    """The message to show for ``err`` when it is a user-fixable error (see the Note), else None.

    A worker's failure (``ProcessRaisedException`` of local workers, ``WorkerFailed`` of
    torchrun/SLURM workers) counts when the traceback it carries ends in such an error.
    """
    if isinstance(err, _user_error_types()):
        return str(err)
    if type(err).__name__ in ("ProcessRaisedException", "WorkerFailed"):
        text = str(err)
        found = list(_RAISED.finditer(text))
        if found and (found[-1].group(1), found[-1].group(2)) in _USER_ERRORS:
            where = f"worker {err.error_index}: " if hasattr(err, "error_index") else ""
            return where + text[found[-1].end():].strip()
    return None


def _reported(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Wrap a Hydra task so that user-fixable errors end in one message (see the Note)."""

    @functools.wraps(task)
    def wrapper(dcfg: DictConfig) -> Any:
        try:
            _refuse_schema_choices()
            return task(dcfg)
        except Exception as err:
            message = user_message(err)
            if message is None:
                raise
            clean_up_failed_run(message)
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            raise UserError(f"{_program()}: {message}") from err

    return wrapper


def _refuse_schema_choices() -> None:
    """``model=model_schema`` (a schema that Hydra lists among a group's options) is no model: refuse it."""
    from pipefisher.config import ConfigError

    for group, choice in HydraConfig.get().runtime.choices.items():
        if isinstance(choice, str) and choice == f"{group}_schema":
            raise ConfigError(f"{group}={choice}: that is the schema the {group} options extend, not one of them; "
                              f"choose one of {', '.join(_options(group))}")


def _program() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "train.py"


def _check_schedule_file(cfg: TrainConfig) -> None:
    """Read ``optimizer.schedule`` (an assignment.json of schedule.py, or a strategy file's plan) before any
    worker starts."""
    if cfg.optimizer.name in KFAC_OPTIMIZERS and cfg.optimizer.schedule:
        from pipefisher.config import ConfigError
        from pipefisher.schedules.kfac import assignment_from_json  # no torch; a strategy file's plan too

        try:
            assignment_from_json(cfg.optimizer.schedule)
        except OSError as exc:
            raise ConfigError(f"optimizer.schedule={cfg.optimizer.schedule}: cannot be read ({exc.strerror}); give "
                              f"the assignment.json that schedule.py wrote") from None
        except ValueError as exc:
            raise ConfigError(f"optimizer.schedule={exc}") from None


def _check_data(cfg: TrainConfig) -> None:
    """Open the hdf5 shards ``data.path`` names (fields, dtypes, shapes), and the held-out data when
    the run evaluates, before wandb and the workers start."""
    if cfg.data.kind == "hdf5":
        from pipefisher.run_spec import data_source  # imports torch: only after the config is valid

        data_source(cfg)
    if cfg.eval.every_steps > 0:
        from pipefisher.evaluation import eval_source

        eval_source(cfg)
        log.info("held-out evaluation every %d steps on %d sequences: eval.batches=%d micro-batches of %d (a run "
                 "with another micro_batch_size evaluates other sequences unless eval.batches x micro_batch_size "
                 "stays %d)", cfg.eval.every_steps, cfg.eval.batches * cfg.micro_batch_size, cfg.eval.batches,
                 cfg.micro_batch_size, cfg.eval.batches * cfg.micro_batch_size)


def _run(dcfg: DictConfig) -> float:
    hc = HydraConfig.get()
    if dcfg.get("strategy"):  # the search's strategy file sets its keys before validation
        from pipefisher.planning.strategy_file import apply_strategy

        apply_strategy(dcfg, list(hc.overrides.task))
    cfg = to_train_config(dcfg)
    # Said before torch is imported and any worker starts (seconds on a busy machine).
    log.info("%s (L=%d, H=%d), %s, stages=%d, global batch %d = micro-batch %d x num_micro_batches %d x "
             "data_parallel %d%s, %s, %d steps; run folder %s",
             cfg.model.name, cfg.model.num_layers, cfg.model.hidden_size, f"pipeline={cfg.pipeline.method}"
             if cfg.num_workers > 1 else "one process", cfg.stages, cfg.global_batch_size, cfg.micro_batch_size,
             cfg.num_micro_batches, cfg.data_parallel, (f" x sdp {cfg.sdp} (sharded)" if cfg.sdp > 1 else "")
             + (f", tp={cfg.tp} (each worker's layers split over {cfg.tp} processes: {cfg.num_workers} in all)"
                if cfg.tp > 1 else ""),
             f"optimizer={cfg.optimizer.name}", cfg.steps,
             _shown(hc.runtime.output_dir))
    _check_schedule_file(cfg)
    _check_data(cfg)
    from pipefisher.launch import run_training  # imports torch: only after the config is valid

    multirun = hc.mode.name == "MULTIRUN"
    result = run_training(
        cfg,
        output_dir=hc.runtime.output_dir,
        overrides=list(hc.overrides.task),
        sweep_dir=hc.sweep.dir if multirun else None,
        resume_command=_resume_command(sys.argv, hc.sweep.dir if multirun else None, hc.runtime.output_dir),
    )
    if cfg.strategy:  # the prediction beside what the run measured
        from pipefisher.planning.strategy_file import report_strategy_run

        report_strategy_run(cfg.strategy, hc.runtime.output_dir)
    return float(result.get("loss", float("nan")))


# Hydra's flags that take a value (the next argument).
_FLAGS_WITH_VALUE = ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "--package", "-p",
                     "--info", "-i", "--cfg", "-c", "--experimental-rerun")


def _shown(path: str | os.PathLike) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    full, cwd = Path(path).resolve(), Path.cwd().resolve()
    return str(full.relative_to(cwd)) if cwd in full.parents else str(full)


def _resume_command(argv: list[str], sweep_dir: str | None, output_dir: str) -> str:
    """The command line that continues this run from its latest checkpoint: the user's own, in
    the same run folder (``hydra.run.dir``, or ``hydra.sweep.dir`` for a ``-m`` run), with
    ``resume=auto``. Hydra's flags go last: it takes no override after ``-m``."""
    args, flags = [], []
    rest = iter(argv[1:])
    for arg in rest:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in _FLAGS_WITH_VALUE:
                flags.append(next(rest, ""))
        elif not arg.lstrip("+").startswith(("resume=", "hydra.run.dir=", "hydra.sweep.dir=")):
            args.append(arg)
    where = f"hydra.sweep.dir={_shown(sweep_dir)}" if sweep_dir else f"hydra.run.dir={_shown(output_dir)}"
    program = argv[0] if argv and argv[0] else "train.py"
    words = (["python", _shown(program) if Path(program).is_file() else program] if program.endswith(".py")
             else [os.path.basename(program)])
    return " ".join(shlex.quote(w) for w in [*words, *args, where, "resume=auto", *flags])


# -- --help ----------------------------------------------------------------------------------------

_HELP = "pipefisher_train"


def _options(group: str) -> list[str]:
    """The options of a config group: its YAML files under ``conf/``."""
    folder = _CONF / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def _config_groups() -> str:
    """``group: option, …`` lines of the groups a TrainConfig field selects, from ``conf/``.

    Hydra's own list holds every folder under ``conf/`` (finetune's ``task`` too) and the schemas
    registered in each group (``model_schema``, …), which are no choice a user makes.
    """
    hints = get_type_hints(TrainConfig)
    lines = []
    for f in fields(TrainConfig):
        if is_dataclass(hints[f.name]):
            options = _options(f.name)
            if options:
                lines.append(f"{f.name}: {', '.join(options)}")
    return "\n".join(lines)


def _register_help() -> None:
    """Register the help page ``hydra/help=pipefisher_train``: Hydra's, with our group list."""
    template = "\n".join([
        "${hydra.help.header}",
        "== Configuration groups ==",
        "Compose your configuration from those groups (group=option)",
        "",
        _config_groups().replace("$", "$$"),
        "",
        "== Config ==",
        "Override anything in the config (foo.bar=value)",
        "",
        "$CONFIG",
        "",
        "${hydra.help.footer}",
    ])
    node = OmegaConf.create({"app_name": "${hydra.job.name}",
                             "header": "${hydra.help.app_name} is powered by Hydra.\n",
                             "footer": "Powered by Hydra (https://hydra.cc)\nUse --hydra-help to view Hydra specific help\n",
                             "template": template})
    ConfigStore.instance().store(group="hydra/help", name=_HELP, node=node)


_register_help()


def _start(main: Callable[[], Any]) -> Any:
    """Check the command line's keys, choose our help page, then hand over to Hydra."""
    args = sys.argv[1:]
    refuse_unknown_keys(args, _program(), TrainConfig)
    if ("--help" in args or "-h" in args) and not any(a.startswith("hydra/help=") for a in args):
        # The page lives in the ConfigStore; choosing it from conf/config.yaml's defaults
        # (`override hydra/help: pipefisher_train`) would do the same.
        sys.argv = [*sys.argv, f"hydra/help={_HELP}"]
    return main()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
@_reported
def _train(dcfg: DictConfig) -> float:
    return _run(dcfg)


def _deep_enough(dcfg: DictConfig, overrides: list[str]) -> None:
    """Give profile.py's default model an encoder layer per stage when it has fewer (issue 16, item 1).

    ``python profile.py pipeline=chimera stages=8`` names no model, and the default (bert-tiny, 2
    layers) cannot be cut into 8 stages. Of the ways out, more layers of the same small model keep
    a CPU profile short (bert-medium, the smallest size with 8 layers, has 4x the width and about
    ten times the work per step). A depth the user chose (``model=…``, ``model.num_layers``,
    ``pipeline.layers_per_stage``) stays, and the config check names the problem; other
    ``model.*`` keys (a smaller width, say) do not choose a depth.
    """
    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    if keys & {"model", "model.num_layers", "pipeline.layers_per_stage"} or any(k.startswith("model@") for k in keys):
        return
    need = int(dcfg.stages) * int(dcfg.pipeline.num_virtual)
    have = int(dcfg.model.num_layers)
    if need > have:
        dcfg.model.num_layers = need
        log.info("profiling %s with model.num_layers=%d instead of %d: one encoder layer per stage "
                 "(choose the model with model=..., e.g. model=bert-medium)", dcfg.model.name, need, have)


@hydra.main(config_path="conf", config_name="profile", version_base="1.3")
@_reported
def _profile(dcfg: DictConfig) -> float:
    _deep_enough(dcfg, list(HydraConfig.get().overrides.task))
    return _run(dcfg)


def train_main() -> float:
    """Compose, validate, train; returns the last step's loss (Hydra sweepers may use it)."""
    return _start(_train)


def profile_main() -> float:
    """Train a few steps recording the timeline; writes profile.sqlite and timeline.pdf/png."""
    return _start(_profile)
