"""optimizer=ekfac (issue 28, item 3): Adam's second moment in the eigenbasis of K-FAC's factors.

- the per-step rescaling against an explicit dense computation (Kronecker product of eigenbases from
  ``torch.linalg.eigh`` of explicitly built A and B, vec'd gradient, moments) over several steps with
  a basis refresh in between;
- the pipeline (1f1b D=2) equals single-process ekfac; PipeFisher's placement of the
  eigendecompositions in bubbles equals the same plan's units on the critical path;
- a run resumed from a checkpoint (bases pending, moments under way) equals the uninterrupted run;
- config checks name the field and the fix.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pipefisher.config import ConfigError, TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.optim import EKFACPreconditioner, KFACPreconditioner, build_preconditioner, global_grad_norm
from pipefisher.optim.factory import make_optimizer
from pipefisher.run_spec import bert_config, data_plan, data_source
from pipefisher.runtime.checkpoint import load_shard, step_dir
from tests.conftest import compose_train
from tests.dist_harness import start_workers

# -- dense reference on one small layer ------------------------------------------------------------


def _dense_reference(xs: list[torch.Tensor], targets: list[torch.Tensor], weight: torch.Tensor,
                     bias: torch.Tensor | None, decay: float, refresh_every: int, beta2: float,
                     eps: float) -> list[torch.Tensor]:
    """Per step, the rescaled [∇W | ∇b] of a Linear layer trained on nothing (weights fixed), built
    the long way: x̃ = [x; 1], A = mean x̃x̃ᵀ, B = mean g̃g̃ᵀ with g̃ = T·∂L/∂y = 2(y − target),
    running averages, Q from eigh at refresh steps, and the rescaling as a dense matrix on vec(G):
    (Q_A ⊗ Q_B) diag(1/(√v̂ + ε)) (Q_A ⊗ Q_B)ᵀ vec(G) (column-major vec)."""
    out, a_run, b_run, v, q_a, q_b = [], None, None, None, None, None
    for step, (x, target) in enumerate(zip(xs, targets)):
        rows = x.shape[0]
        y = x @ weight.T + (0 if bias is None else bias)
        dy = 2.0 * (y - target) / rows  # ∂/∂y of mean over rows of ‖y − target‖²
        x_t = torch.cat([x, torch.ones(rows, 1, dtype=x.dtype)], dim=1) if bias is not None else x
        grad = dy.T @ x_t  # [O, Ĩ] = [∇W | ∇b]
        a_new = x_t.T @ x_t / rows
        g_t = dy * rows
        b_new = g_t.T @ g_t / rows
        a_run = a_new if a_run is None else decay * a_run + (1 - decay) * a_new
        b_run = b_new if b_run is None else decay * b_run + (1 - decay) * b_new
        if step % refresh_every == 0:
            q_a, q_b = torch.linalg.eigh(a_run)[1], torch.linalg.eigh(b_run)[1]
        kron = torch.kron(q_a, q_b)  # [Ĩ·O, Ĩ·O]: (Q_A ⊗ Q_B) vec(X) = vec(Q_B X Q_Aᵀ)
        vec = grad.T.reshape(-1)  # column-major vec(G)
        projected = kron.T @ vec
        v = (1 - beta2) * projected ** 2 if v is None else beta2 * v + (1 - beta2) * projected ** 2
        v_hat = v / (1 - beta2 ** (step + 1))
        scaled = kron @ (projected / (v_hat.sqrt() + eps))
        out.append(scaled.reshape(grad.shape[1], grad.shape[0]).T)  # un-vec (column-major)
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_eigenbasis_rescaling_equals_dense_kronecker_computation_across_a_basis_refresh(bias: bool) -> None:
    torch.manual_seed(0)
    in_f, out_f, rows, steps, refresh, beta2, eps, decay = 5, 4, 12, 6, 3, 0.9, 1e-8, 0.5
    layer = nn.Linear(in_f, out_f, bias=bias).double()
    pre = EKFACPreconditioner({"fc": layer}, factor_decay=decay, curvature_interval=1, inverse_interval=refresh,
                              factor_dtype=torch.float64, beta2=beta2, eps=eps)
    xs = [torch.randn(rows, in_f, dtype=torch.float64) for _ in range(steps)]
    targets = [torch.randn(rows, out_f, dtype=torch.float64) for _ in range(steps)]
    ref = _dense_reference(xs, targets, layer.weight.detach(), None if not bias else layer.bias.detach(),
                           decay, refresh, beta2, eps)
    bases = []
    for step in range(steps):
        layer.zero_grad(set_to_none=True)
        pre.on_step_start(step)
        with pre.micro_batch(0):
            loss = (layer(xs[step]) - targets[step]).pow(2).sum(-1).mean()
        loss.backward()
        pre.refresh_and_precondition(step)
        got = layer.weight.grad if not bias else torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        torch.testing.assert_close(got, ref[step], rtol=1e-7, atol=1e-10, msg=lambda m, s=step: f"step {s}: {m}")
        bases.append(pre.layer("fc").q_a.clone())
    assert pre.layer("fc").moment_steps == steps  # v kept across the refresh at step 3 (bias correction t = 6)
    assert torch.equal(bases[1], bases[2]) and not torch.allclose(bases[2], bases[3])  # refreshed at step 3 only


def test_deferred_bases_wait_for_promotion_and_v_needs_a_basis() -> None:
    torch.manual_seed(1)
    layer = nn.Linear(3, 2)
    pre = EKFACPreconditioner({"fc": layer})
    x = torch.randn(8, 3)
    pre.set_capture(True)
    with pre.micro_batch(0):
        layer(x).pow(2).sum().backward()
    pre.curvature_all()
    pre.update_all(0)
    pre.step_curvature_done()
    raw = layer.weight.grad.clone()
    pre.invert("fc", deferred=True)
    assert not pre.precondition("fc") and torch.equal(layer.weight.grad, raw)  # nothing in use yet
    assert pre.layer("fc").v is None
    assert pre.promote_inverses() == 1 and pre.layer("fc").ready
    assert pre.precondition("fc") and not torch.equal(layer.weight.grad, raw)
    assert pre.layer("fc").moment_steps == 1


def test_state_dict_round_trips_bases_moment_and_count() -> None:
    torch.manual_seed(2)
    layer = nn.Linear(3, 2)
    pre = EKFACPreconditioner({"fc": layer}, beta2=0.5)
    for step in range(2):
        layer.zero_grad()
        pre.on_step_start(step)
        with pre.micro_batch(0):
            layer(torch.randn(8, 3)).pow(2).sum().backward()
        pre.refresh_and_precondition(step)
    state = pre.state_dict()
    assert {"fc/Q_A", "fc/Q_B", "fc/V", "fc/moment_steps"} <= set(state) and "fc/A_inv" not in state
    other = EKFACPreconditioner({"fc": nn.Linear(3, 2)}, beta2=0.5)
    other.load_state_dict(state)
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key]), key
    with pytest.raises(ValueError, match="fc/V has shape"):
        other.load_state_dict({**state, "fc/V": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="unexpected key 'fc/"):
        KFACPreconditioner({"fc": nn.Linear(3, 2)}).load_state_dict(state)  # K-FAC has no moment


def test_build_preconditioner_refuses_unknown_kinds_and_bad_moments() -> None:
    layer = {"fc": nn.Linear(3, 2)}
    assert type(build_preconditioner("kfac", layer)) is KFACPreconditioner
    assert isinstance(build_preconditioner("ekfac", layer, beta2=0.9, eps=1e-6), EKFACPreconditioner)
    with pytest.raises(ValueError, match="choose one of kfac, ekfac"):
        build_preconditioner("shampoo", layer)
    with pytest.raises(ValueError, match="beta2=1.0"):
        EKFACPreconditioner(layer, beta2=1.0)
    with pytest.raises(ValueError, match="eps=0.0"):
        EKFACPreconditioner(layer, eps=0.0)


# -- configuration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,field,fix", [
    (["optimizer=ekfac", "optimizer.ekfac_beta2=1.0"], "optimizer.ekfac_beta2=1.0", "[0, 1)"),
    (["optimizer=ekfac", "optimizer.ekfac_eps=0"], "optimizer.ekfac_eps=0.0", "must be > 0"),
    (["optimizer=kfac", "optimizer.preconditioner=shampoo"], "optimizer.preconditioner='shampoo'", "kfac, ekfac"),
    (["optimizer=nvlamb", "optimizer.preconditioner=ekfac"], "optimizer.preconditioner='ekfac'", "optimizer=ekfac"),
])
def test_ekfac_config_errors_name_the_field_and_the_fix(overrides: list[str], field: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose_train(overrides)
    assert field in str(err.value) and fix in str(err.value)


def test_optimizer_ekfac_is_kfac_with_the_eigenbasis_preconditioner() -> None:
    o = compose_train(["optimizer=ekfac"]).optimizer
    assert (o.name, o.preconditioner, o.ekfac_beta2, o.ekfac_eps) == ("kfac", "ekfac", 0.999, 1e-8)
    pf = compose_train(["optimizer=pipefisher", "optimizer.preconditioner=ekfac", "stages=2"]).optimizer
    assert (pf.name, pf.preconditioner) == ("pipefisher", "ekfac")


# -- the pipeline against one process -------------------------------------------------------------

MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=64",
         "model.vocab_size=128", "data.seq_len=16", "data.max_predictions=3", "micro_batch_size=4", "lr=0.01"]
# ekfac_eps above the rounding floor of the projected gradient (ekfac [Note: eps and degenerate
# eigenspaces]): this tiny model's B factors have rank ~ its few masked positions, and directions of a
# (near-)degenerate eigenspace are fixed by rounding alone, so with eps=1e-8 float32 vs float64 eigh of
# the same factors already changes biases' signs after 4 steps, 1e-4 by < 1 % (measured).
EPS = ["optimizer.ekfac_eps=1e-4"]
EKFAC = ["optimizer=ekfac", *EPS]
# Against the one-process reference (other summation orders) eps=1e-3: changing only the thread count
# (1 vs 2) of the reference moves its 4-step parameters by 0.77 % of a tensor's largest movement at
# eps=1e-4 and by 0.07 % at 1e-3 (measured); CI once saw 2.1 % between pipeline and reference at 1e-4.
EKFAC_VS_ONE_PROCESS = ["optimizer=ekfac", "optimizer.ekfac_eps=1e-3"]


def _single_process_ekfac(cfg: TrainConfig, steps: int
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Independent reference: one process, every micro-batch, factors, eigenbases and rescaling each
    step (interval 1, bases used at once), then NVLAMB clipped by the raw gradient's norm.

    Returns:
        (the first step's rescaled gradients, the initial parameters, the parameters after ``steps``
        steps), by name."""
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    source, plan = data_source(cfg), data_plan(cfg)
    o, n = cfg.optimizer, cfg.num_micro_batches
    pre = EKFACPreconditioner(model, factor_decay=o.factor_decay, loss_scale=1.0 / n, beta2=o.ekfac_beta2,
                              eps=o.ekfac_eps)
    optimizer, scheduler = make_optimizer(cfg, list(model.named_parameters()), torch.device("cpu"))
    for step in range(steps):
        pre.on_step_start(step)
        for j in range(n):
            with pre.micro_batch(j):
                losses = model(None, get_micro_batch(source, step, j, 0, **plan))
            (losses.sum() / n).backward()
        raw_norm = global_grad_norm(model.parameters())
        pre.refresh_and_precondition(step)
        if step == 0:
            first = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step(grad_norm=raw_norm)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return first, initial, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory):
    from pipefisher.planning.assign import plan_interval
    from pipefisher.planning.costs import estimate_run_costs
    from pipefisher.runtime.worker import CPU_HARDWARE, encoder_layers_per_stage, run_shape, schedule_for
    from pipefisher.schedules.kfac import assignment_to_json, kfac_layer_counts
    from tests.dist_harness import run_cases

    tmp = tmp_path_factory.mktemp("ekfac")
    single = compose_train(MODEL + EKFAC_VS_ONE_PROCESS + ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "steps=4"])
    pf = compose_train(MODEL + ["pipeline=chimera", "stages=2", "num_micro_batches=4", "optimizer=pipefisher",
                                "optimizer.preconditioner=ekfac"])
    schedule = schedule_for(pf)
    layers = kfac_layer_counts(schedule, encoder_layers_per_stage(pf, schedule.num_stages))
    assignment, _ = plan_interval(schedule, estimate_run_costs(run_shape(pf), CPU_HARDWARE), layers, 2)
    path = tmp / "plan_k2.json"
    assignment_to_json(assignment, path)
    steps = 5  # two whole cycles of k=2 and one more step: deferred bases in use from step 2 on
    bubbles = dataclasses.replace(compose_train(MODEL + EPS + ["pipeline=chimera", "stages=2", "num_micro_batches=4",
                                                               "optimizer=pipefisher", "optimizer.preconditioner=ekfac",
                                                               "optimizer.promote_inverses=at_cycle_end",  # as critical's
                                                               f"optimizer.schedule={path}"]), steps=steps)
    critical = dataclasses.replace(compose_train(MODEL + EKFAC + ["pipeline=chimera", "stages=2", "num_micro_batches=4",
                                                          f"optimizer.schedule={path}"]), steps=steps)
    return single, run_cases([(single, 4), (bubbles, steps), (critical, steps)], tmp)


@pytest.mark.slow
def test_ekfac_pipeline_1f1b_d2_equals_single_process(pipeline_results) -> None:
    cfg, results = pipeline_results
    first, initial, ref = _single_process_ekfac(cfg, steps=4)
    word, decoder = "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"
    seen = set()
    for r in results[0].values():
        for key, grad in r["grads"].items():  # step 0: rescaled in the bases of step 0's own factors
            name = key.split("/", 2)[2]
            torch.testing.assert_close(grad, first[word if name == decoder else name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, k=key: f"step 0 gradient {k}: {m}")
        for key, value in r["params"].items():
            # The four steps' movement agrees to 1 % of the tensor's largest movement (see
            # EKFAC_VS_ONE_PROCESS: near-degenerate eigenspaces make the bases depend on rounding).
            name = key.split("/", 2)[2]
            ref_name = word if name == decoder else name
            moved, ref_moved = value - initial[ref_name], ref[ref_name] - initial[ref_name]
            torch.testing.assert_close(moved, ref_moved, rtol=1e-2, atol=1e-2 * ref_moved.abs().max().item(),
                                       msg=lambda m, k=key: f"{k}'s movement over 4 steps: {m}")
            seen.add(name)
    assert {word if n == decoder else n for n in seen} == set(ref)


@pytest.mark.slow
def test_ekfac_bases_in_bubbles_equal_the_same_plan_on_the_critical_path(pipeline_results) -> None:
    _, results = pipeline_results
    bubbles, critical = results[1], results[2]
    for rank in bubbles:
        for key, value in bubbles[rank]["params"].items():
            torch.testing.assert_close(value, critical[rank]["params"][key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=key: f"{k}: {m}")
    assert [sum(v) for v in bubbles[0]["losses"]] == pytest.approx([sum(v) for v in critical[0]["losses"]], rel=1e-5)


# -- checkpoint resume ----------------------------------------------------------------------------

RESUME = ["pipeline=1f1b", "stages=2", "num_micro_batches=2", "steps=6", "optimizer.curvature_interval=2",
          "optimizer.inverse_interval=2", "optimizer.deferred_inverse=true", "model.hidden_dropout=0.1",
          "model.attention_dropout=0.1", "cluster.worker_timeout_s=60"]


@pytest.mark.slow
def test_resumed_ekfac_run_equals_uninterrupted_run_with_bases_and_moments_restored(tmp_path: Path) -> None:
    from tests.dist_harness import train_jobs
    from tests.test_checkpoint import INTERRUPT_AT, _assert_same_state, _interrupted, _losses

    assert INTERRUPT_AT == 4  # the checkpoint after step 3 holds step 2's deferred bases, pending
    straight = compose_train(MODEL + EKFAC + RESUME + ["checkpoint.every_steps=6"])
    saving = compose_train(MODEL + EKFAC + RESUME + ["checkpoint.every_steps=2"])
    resume = compose_train(MODEL + EKFAC + RESUME + ["checkpoint.every_steps=2", "resume=auto"])
    jobs = [([straight, straight], str(tmp_path / "straight"), False, None),
            (_interrupted(saving), str(tmp_path / "resumed"), True, None),
            ([resume, resume], str(tmp_path / "resumed"), False, None)]
    (tmp_path / "pg").mkdir()
    start_workers(train_jobs, (jobs, str(tmp_path / "pg")), 2)
    assert not dist.is_initialized()
    steps, losses = _losses(tmp_path / "straight")
    resumed_steps, resumed = _losses(tmp_path / "resumed")
    assert steps == resumed_steps == list(range(6))
    torch.testing.assert_close(resumed, losses, rtol=1e-6, atol=0.0)
    for rank in range(2):
        saved = load_shard(step_dir(tmp_path / "resumed" / "checkpoints", 3), rank)
        for pre in saved["kfac"].values():  # what the resume had to restore: pending bases, moments
            assert all(layer["has_pending"] for layer in pre["extra"].values())
            counts = [int(t) for k, t in pre["state"].items() if k.endswith("/moment_steps")]
            # a layer's first bases (step 0's) are used from step 1 on: v updated at steps 1, 2, 3
            assert counts and all(c == 3 for c in counts)
            assert any(k.endswith("/V") for k in pre["state"])
        a = load_shard(step_dir(tmp_path / "straight" / "checkpoints", 5), rank)
        b = load_shard(step_dir(tmp_path / "resumed" / "checkpoints", 5), rank)
        _assert_same_state(a, b, f"ekfac worker {rank}")


# -- the convergence study's ekfac arms -------------------------------------------------------------


def test_convergence_study_ekfac_arms_compose_and_tune_their_own_lr() -> None:
    from tests.test_convergence_bench import _load

    ca, cv = _load("convergence_analysis"), _load("convergence")
    overrides = cv.arm_overrides("ekfac-k5-deferred", 0.95)
    o = compose_train(overrides).optimizer
    assert (o.name, o.preconditioner, o.curvature_interval, o.inverse_interval, o.deferred_inverse) == \
        ("kfac", "ekfac", 5, 5, True)
    assert o.factor_decay == pytest.approx(0.95 ** 5, rel=1e-5) and o.factor_decay_per == "refresh"
    assert compose_train(cv.arm_overrides("ekfac-k1", 0.95)).optimizer.deferred_inverse is False
    assert [ca.family(a) for a in ("ekfac-k1", "ekfac-k7-deferred", "kfac-k1")] == ["ekfac", "ekfac", "kfac"]
    spec = ca.StudySpec(steps={32: 100}, lr_grid={"ekfac": [5e-3]}, final_arms=["ekfac-k1", "ekfac-k5-deferred"],
                        seeds=1)
    todo, _ = ca.plan_runs(spec, {})
    assert [(r.arm, r.lr, r.damping) for r in todo] == [("ekfac-k1", 5e-3, None)]  # the grid first, no damping
    todo, _ = ca.plan_runs(spec, {todo[0].key: 6.2})
    assert [r.arm for r in todo] == ["ekfac-k5-deferred"]
    with pytest.raises(ValueError, match="ekfac-kK or ekfac-kK-deferred"):
        cv.arm_overrides("ekfac-k2-ready", 0.95)
