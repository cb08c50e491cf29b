"""schedule.py and train.py state the same curvature-age bound for the same plan (issue 40, item 4).

schedule.py plans with train.py's ``optimizer=pipefisher`` defaults (deferred inverses promoted
``when_ready``, ``max_staleness=8``) and its summary names the bound train.py prints at its start for
that plan (``runtime.build.describe_kfac``), not 2k - 1.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipefisher.planning.cli import plan_run
from pipefisher.planning.config import ScheduleConfig, register_schedule_configs, to_schedule_config
from pipefisher.runtime.build import describe_kfac, kfac_assignment, schedule_for
from pipefisher.schedules.kfac import curvature_age_bound
from tests.conftest import CONF_DIR, compose_train

AGE = re.compile(r"curvature age <= (\d+) step")


def _plan(tmp_path: Path, *overrides: str):
    register_schedule_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = to_schedule_config(compose(config_name="schedule", overrides=["plot=false", *overrides]))
    return plan_run(cfg, tmp_path / "plan")


def _train_line(summary: str) -> list[str]:
    """The train.py overrides of the summary's ``use it: python train.py …`` line."""
    line = next(x for x in summary.splitlines() if x.startswith("use it: python train.py "))
    return shlex.split(line.removeprefix("use it: python train.py "))


def test_schedule_config_plans_with_train_pys_pipefisher_defaults() -> None:
    group = OmegaConf.load(CONF_DIR / "optimizer" / "pipefisher.yaml")
    assert ScheduleConfig().promote_inverses == group.promote_inverses == "when_ready"
    assert ScheduleConfig().max_staleness == group.max_staleness == 8


@pytest.mark.parametrize("keys", [(), ("promote_inverses=at_cycle_end", "max_staleness=15")],
                         ids=["defaults", "at_cycle_end"])
def test_schedule_py_and_train_py_state_the_same_curvature_age_for_one_plan(tmp_path: Path, keys) -> None:
    # bert-base chimera D=4 N=8 on the default device estimate: k=5, whose when_ready bound (7) is
    # not 2k - 1 = 9 (what schedule.py said before).
    result = _plan(tmp_path, *keys)
    a = result.comparison.assignment
    assert a.interval > 1 and a.deferred
    planned = int(AGE.search(result.summary).group(1))
    cfg = compose_train(_train_line(result.summary), tiny=False)
    assert (cfg.optimizer.promote_inverses, cfg.optimizer.max_staleness) == (
        ("at_cycle_end", 15) if keys else ("when_ready", 8))
    started = describe_kfac(cfg, kfac_assignment(cfg, schedule_for(cfg)))
    assert int(AGE.search(started).group(1)) == planned == curvature_age_bound(a, cfg.optimizer.promote_inverses)
    if not keys:
        assert planned < 2 * a.interval - 1
