"""The Hydra config: groups compose, schemas catch typos and wrong types, cross-field checks name the fix."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from pipefisher.config import ConfigError, TrainConfig
from tests.conftest import CONF_DIR, compose_dict, compose_train

SIZES = {  # L / H / A from DESIGN.md
    "bert-tiny": (2, 128, 2), "bert-mini": (4, 256, 4), "bert-small": (4, 512, 8),
    "bert-medium": (8, 512, 8), "bert-base": (12, 768, 12), "bert-large": (24, 1024, 16),
}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_model_group_has_every_bert_size(name: str) -> None:
    cfg = compose_train([f"model={name}"], tiny=False)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_heads) == SIZES[name]
    assert cfg.model.name == name


def test_default_config_is_a_valid_single_process_run() -> None:
    cfg = compose_train([], tiny=False)
    assert isinstance(cfg, TrainConfig)
    assert (cfg.stages, cfg.pipeline.method, cfg.optimizer.name, cfg.data.kind, cfg.cluster.name) == (
        1, "gpipe", "nvlamb", "synthetic", "local")
    assert cfg.wandb.mode == "offline"


@pytest.mark.parametrize("group,options", [
    ("pipeline", ["gpipe", "1f1b", "chimera", "interleaved"]),
    ("optimizer", ["nvlamb", "kfac", "pipefisher"]),
    ("data", ["synthetic", "hdf5"]),
    ("cluster", ["local", "slurm"]),
])
def test_every_group_option_composes(group: str, options: list[str]) -> None:
    for option in options:
        assert (CONF_DIR / group / f"{option}.yaml").exists()
        compose_dict([f"{group}={option}"])


def test_top_level_keys_users_type() -> None:
    cfg = compose_train(["stages=2", "micro_batch_size=4", "num_micro_batches=3", "steps=7", "seed=5",
                         "lr=0.002", "wandb.mode=disabled"])
    assert (cfg.stages, cfg.micro_batch_size, cfg.num_micro_batches, cfg.steps, cfg.seed, cfg.lr) == (
        2, 4, 3, 7, 5, 0.002)
    assert cfg.wandb.mode == "disabled"


def test_typo_in_a_key_fails_at_composition() -> None:
    with pytest.raises((ConfigCompositionException, ConfigAttributeError, ConfigKeyError)):
        compose_dict(["stagse=2"])
    with pytest.raises((ConfigCompositionException, ConfigAttributeError, ConfigKeyError)):
        compose_dict(["model.hiden_size=64"])


def test_wrong_type_fails_at_composition() -> None:
    with pytest.raises((ConfigCompositionException, ValidationError)):
        compose_dict(["stages=two"])


def test_unknown_group_option_lists_the_choices() -> None:
    with pytest.raises(ConfigCompositionException, match="bert-tiny"):
        compose_dict(["model=bert-huge"])


@pytest.mark.parametrize("overrides,field,fix", [
    (["model.num_heads=3"], "model.num_heads", "divisible"),
    (["stages=5"], "stages", "exceeds model.num_layers=2 + 2"),
    (["model=bert-mini", "pipeline=chimera", "stages=3", "model.num_layers=4"], "stages", "even number"),
    (["model=bert-mini", "pipeline=chimera", "stages=2", "num_micro_batches=3"], "num_micro_batches", "multiple"),
    (["data.seq_len=1024"], "data.seq_len", "max_position_embeddings"),
    (["micro_batch_size=0"], "micro_batch_size", "at least 1"),
    (["lr=-1"], "lr", "positive"),
    (["pipeline.layers_per_stage=[1,2]", "stages=2"], "pipeline.layers_per_stage", "summing to"),
    (["data=hdf5", "data.path=/nonexistent/shards"], "data.path", "prepare"),
    (["optimizer=kfac", "optimizer.curvature_interval=2", "optimizer.inverse_interval=3"], "optimizer.inverse_interval",
     "multiple of optimizer.curvature_interval=2"),
    (["optimizer=pipefisher", "optimizer.inverse_interval=2"], "optimizer.inverse_interval",
     "decoupled intervals need optimizer=kfac"),
    (["optimizer=pipefisher", "optimizer.promote_inverses=later"], "optimizer.promote_inverses", "when_ready"),
])
def test_cross_field_errors_name_the_field_and_the_fix(overrides: list[str], field: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_train(overrides)
    assert field in str(err.value) and fix in str(err.value)


def test_kfac_factor_and_inverse_intervals_decouple_with_a_one_line_refusal() -> None:
    """Factors every curvature_interval steps, inverses every inverse_interval (a multiple of it)."""
    cfg = compose_train(["optimizer=kfac", "optimizer.curvature_interval=2", "optimizer.inverse_interval=4"])
    assert (cfg.optimizer.curvature_interval, cfg.optimizer.inverse_interval) == (2, 4)
    with pytest.raises(ConfigError) as err:
        compose_train(["optimizer=kfac", "optimizer.curvature_interval=4", "optimizer.inverse_interval=2"])
    assert "\n" not in str(err.value).strip()


def test_hdf5_needs_a_path() -> None:
    with pytest.raises(Exception, match="data.path"):
        compose_train(["data=hdf5"])


def test_slurm_cluster_selects_the_submitit_launcher() -> None:
    cfg = compose_dict(["cluster=slurm"], with_hydra=True)
    assert cfg.cluster.name == "slurm"
    assert "SlurmLauncher" in cfg.hydra.launcher._target_


# -- hybrid parallelism: what sdp / tp accept (issue 27) ---------------------------------------

_HYBRID = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128",
           "data.seq_len=16", "data.max_predictions=3"]


@pytest.mark.parametrize("split", ["sdp=2", "tp=2"])
@pytest.mark.parametrize("optimizer", ["nvlamb", "adamw", "muon"])
def test_sdp_and_tp_accept_nvlamb_adamw_and_muon(split: str, optimizer: str) -> None:
    cfg = compose_train(_HYBRID + [split, f"optimizer={optimizer}"])  # tests/test_hybrid_optimizers.py trains them
    assert cfg.optimizer.name == optimizer and cfg.num_workers == 2


@pytest.mark.parametrize("split", ["sdp=2", "tp=2"])
def test_sdp_and_tp_run_under_slurm_one_task_per_process(split: str) -> None:
    cfg = compose_train(_HYBRID + [split, "stages=2", "cluster=slurm", "cluster.nodes=2"])
    assert cfg.cluster.name == "slurm" and cfg.num_workers == 4  # the launcher asks 4 / 2 tasks per node


@pytest.mark.parametrize("split", ["sdp", "tp"])
@pytest.mark.parametrize("optimizer", ["kfac", "pipefisher"])
def test_sdp_and_tp_still_refuse_kfac_naming_what_is_missing(split: str, optimizer: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{split}=2: optimizer={optimizer} needs whole weights: .*not built\); "
                                          rf"use optimizer=nvlamb, adamw or muon, or {split}=1$") as err:
        compose_train(_HYBRID + [f"{split}=2", f"optimizer={optimizer}"])
    assert "\n" not in str(err.value)


def test_sdp_and_tp_optimizers_are_every_optimizer_but_kfacs() -> None:
    """No optimizer falls between the K-FAC refusal and the built ones (each name is tested above)."""
    from pipefisher.config import KFAC_OPTIMIZERS, OPTIMIZERS, SDP_OPTIMIZERS, TP_OPTIMIZERS

    assert set(SDP_OPTIMIZERS) == set(TP_OPTIMIZERS) == set(OPTIMIZERS) - set(KFAC_OPTIMIZERS)


def test_factor_decay_per_step_scales_the_decay_of_a_refresh_every_k_steps() -> None:
    from pipefisher.optim.factory import refresh_decay

    assert refresh_decay(0.95, "step", 1) == 0.95
    assert refresh_decay(0.95, "step", 4) == pytest.approx(0.95 ** 4)
    assert refresh_decay(0.95, "refresh", 4) == 0.95
    with pytest.raises(Exception, match="factor_decay_per"):
        compose_train(["optimizer=kfac", "optimizer.factor_decay_per=cycle"])


# -- pipeline.chimera_stacking (issue 26, item 1) -----------------------------------------------

_CHIMERA4 = ["model=bert-mini", "pipeline=chimera", "stages=4"]


@pytest.mark.parametrize("overrides, fix", [
    (_CHIMERA4 + ["num_micro_batches=4", "pipeline.chimera_stacking=doubling"],
     "num_micro_batches=4: chimera with pipeline.chimera_stacking=doubling runs whole doubled units of 2 x stages = 8 "
     "micro-batches; use num_micro_batches=8 (or auto), or pipeline.chimera_stacking=direct"),
    (_CHIMERA4 + ["num_micro_batches=12", "pipeline.chimera_stacking=doubling"], "use num_micro_batches=8 (or auto)"),
    (_CHIMERA4 + ["micro_batch_size=2", "global_batch_size=24", "pipeline.chimera_stacking=doubling"],
     "global_batch_size=24: gives num_micro_batches=12 micro-batches of micro_batch_size=2 x data_parallel=1, but "
     "chimera with pipeline.chimera_stacking=doubling needs a multiple of 2 x stages = 8; use global_batch_size=32"),
    (["pipeline=1f1b", "stages=2", "pipeline.chimera_stacking=doubling"],
     "pipeline.chimera_stacking='doubling': only pipeline=chimera stacks basic units"),
    (_CHIMERA4 + ["pipeline.chimera_stacking=halving"], "pipeline.chimera_stacking='halving': choose one of direct, doubling"),
], ids=["N-below-2D", "N-not-multiple-of-2D", "global-batch", "not-chimera", "unknown"])
def test_chimera_stacking_errors_are_one_line_naming_the_fix(overrides: list[str], fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_train(overrides)
    assert fix in str(err.value) and "\n" not in str(err.value)


def test_chimera_doubling_auto_micro_batches_is_two_units_of_stages() -> None:
    from pipefisher.config import micro_batch_rule, num_micro_batches_for

    assert num_micro_batches_for("chimera", 4, "doubling") == 8 and num_micro_batches_for("chimera", 4) == 4
    assert micro_batch_rule("chimera", 4, "doubling")[0] == 8 and micro_batch_rule("chimera", 4)[0] == 4
    cfg = compose_train(_CHIMERA4 + ["pipeline.chimera_stacking=doubling"])
    assert cfg.num_micro_batches == 8 and cfg.global_batch_size == 16 and cfg.micro_batch_size == 2
    assert compose_train(_CHIMERA4 + ["pipeline.chimera_stacking=doubling", "micro_batch_size=1",
                                      "global_batch_size=16"]).num_micro_batches == 16


def test_the_optimizer_factory_names_the_optimizers_as_the_config_does() -> None:
    """``pipefisher.optim.factory`` sits below ``config`` and repeats its names: they must agree."""
    from pipefisher import config
    from pipefisher.optim import factory

    assert factory.KFAC_OPTIMIZERS == config.KFAC_OPTIMIZERS
    assert factory.FACTOR_DECAY_UNITS == config.FACTOR_DECAY_UNITS


#: Every public name of the one-module ``pipefisher/config.py`` before it became a package (issue 39, item 2).
_NAMES_BEFORE_THE_SPLIT = (
    "CHIMERA_STACKINGS CheckpointConfig ClusterConfig ConfigError DATA_KINDS DEFAULT_GLOBAL_BATCH DataConfig EvalConfig "
    "FACTOR_DECAY_UNITS FAULT_MODES FaultConfig HardwareConfig INVERSE_DTYPES KFAC_OPTIMIZERS KFAC_UPDATES ModelConfig "
    "NONFINITE_MODES NS_DTYPES OPTIMIZERS OPTIMIZER_PLACEMENTS OptimizerConfig PIPELINE_METHODS PRECISIONS "
    "PRECONDITIONERS PROMOTE_INVERSES PipelineConfig ProfileConfig RESUME_MODES SDP_OPTIMIZERS TP_OPTIMIZERS "
    "TrainConfig V_METHODS WANDB_MODES WandbConfig check_override_keys micro_batch_rule num_micro_batches_for "
    "refuse_unknown_keys register_configs resolve_batch schedule_method to_train_config validate _fail"
).split()


def test_the_config_package_still_offers_every_name_the_module_did() -> None:
    import pipefisher.config as config

    missing = [n for n in _NAMES_BEFORE_THE_SPLIT if not hasattr(config, n)]
    assert not missing, f"pipefisher.config lost {missing}; re-export them in pipefisher/config/__init__.py"
    assert callable(config.validate)  # the function, not the module pipefisher.config.validation
    # Worker tracebacks name it so, and pipefisher.cli._USER_ERRORS recognizes it by that name.
    assert (ConfigError.__module__, ConfigError.__qualname__) == ("pipefisher.config", "ConfigError")
    with pytest.raises(ConfigError, match=r"^stages=0: must be at least 1$"):
        TrainConfig(stages=0)
