"""K-FAC refreshed every k steps (fresh and deferred), run through PipelineWorker, against an
independent dense reference on the same tiny BERT, batches and weights (issue 28, item 0).

Shape legend: T rows (tokens) of a step, I input and O output features of a layer, Ĩ = I + 1.

The reference is written here from DESIGN.md "K-FAC for a Linear layer" and the documented scaling
(``pipefisher.optim.kfac`` [Note: gradient scale], [Note: running average]), in float64, sharing no
K-FAC code with ``pipefisher.optim``: per encoder Linear layer, from the layer inputs x and output
gradients g its own hooks record,

    A_batch = (1/T) Σ_t x̃_t x̃_tᵀ, x̃ = [x; 1]       B_batch = (1/T) Σ_t g̃_t g̃_tᵀ, g̃ = g · (T/N) / loss_scale
    A ← A_batch at the first refresh, else decay·A + (1 − decay)·A_batch (B likewise), with
    decay = factor_decay^k (``optimizer.factor_decay_per=step``, the default) or factor_decay (``refresh``)
    π = sqrt((tr A / Ĩ) / (tr B / O)), λ_A = π·sqrt(λ), λ_B = sqrt(λ)/π
    inverses torch.linalg.inv(A + λ_A I), torch.linalg.inv(B + λ_B I)
    preconditioned [∇W | ∇b] = (B + λ_B I)⁻¹ [∇W | ∇b] (A + λ_A I)⁻¹

(T/N: the rows of one micro-batch, whose loss is a mean over them; loss_scale = 1/N.) The refresh
steps come from ASDL's own interval logic (``PreconditionedGradientMaker.do_update_curvature`` /
``do_update_preconditioner`` with ``curvature_upd_interval = f``, ``preconditioner_upd_interval = k``:
factors at steps 0, f, 2f, …, inverses of the factors as they then stand at 0, k, 2k, …; f = k unless
a case decouples them, issue 28). Fresh: a refresh's inverses precondition the step that computed
it. Deferred (PipeFisher's numerics): inverses made in refresh cycle c precondition cycle c+1, and a
layer's first inverses the steps after the step that made them; with ``promote_inverses=when_ready``
every inverse preconditions the steps after the one that made it. The plan cases run a PipeFisher
assignment whose stage-1 INVERTs run one phase after their curvature: there the reference inverts
those layers one step after their capture. ASDL's K-FAC itself cannot be the reference on these
layers: it keeps the bias apart (A is I×I, the bias gradient is multiplied by B⁻¹ only, π comes from
the I×I block) and its moving average starts from zero (the first refresh is weighted by
``ema_decay``); so ASDL checks the reference's per-refresh factors instead: ``asdl.no_centered_cov``
on the same forward and backward gives Σ x xᵀ (the weight block of A) and Σ g gᵀ (B up to the scale).

Compared at every step 0..2k: the running factors, the damping split, the inverses in use (and the
pending deferred ones), the preconditioned gradients, the curvature age; and every weight after the
run. One process (stages=1) for k = 1, 2, 3 fresh and k = 1, 2 deferred; two pipeline stages for k = 2
fresh and deferred; factors every 1 or 2 steps with inverses every 2 or 4 (fresh, deferred, D=2);
when_ready at k = 2, 3 and D=2; the plan with a lag under both rules. The comparison can fail: a
reference refreshing at t % k == 1, with the other staleness (fresh for deferred, deferred for fresh;
at k = 1 deferred means "curvature of the previous steps' batches only"), with factors only at
inverse steps, with the other promotion rule, or without the lag, must not match.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import types
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.testing import assert_close

from pipefisher.config import TrainConfig
from pipefisher.data import get_micro_batch
from pipefisher.model import build_full_model
from pipefisher.optim import global_grad_norm
from pipefisher.runtime.build import encoder_layers_per_stage, schedule_for
from pipefisher.runtime.teardown import release_process_group
from pipefisher.schedules import ActionKind
from pipefisher.schedules.kfac import (assignment_to_json, check_assignment, critical_path_assignment,
                                       curvature_age_bound, kfac_layer_counts)
from pipefisher.optim.factory import make_optimizer
from pipefisher.run_spec import bert_config, data_plan, data_source
from tests.conftest import compose_train
from tests.dist_harness import start_workers

torch.set_num_threads(1)

F64 = torch.float64
MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "num_micro_batches=2", "lr=0.01"]
#: The encoder Linear layers (written out here, not taken from pipefisher.optim).
LINEAR = re.compile(r"encoder\.layer\.\d+\.(?:attention\.self\.(?:query|key|value)|attention\.output\.dense"
                    r"|intermediate\.dense|output\.dense)$")
RTOL = 1e-4  # float32 K-FAC against the float64 reference
WORD, DECODER = "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"  # tied


@dataclass(frozen=True)
class Case:
    """k: inverse interval (the cycle); f: factor interval (0: k); promote: when deferred inverses
    are used; lag: a PipeFisher plan (stages=2, 1f1b) whose stage-1 INVERTs run ``lag`` phases after
    their curvature (phase 0), instead of ``optimizer=kfac``'s critical path."""

    k: int
    deferred: bool
    stages: int = 1
    decay_per: str = "step"
    f: int = 0
    promote: str = "at_cycle_end"
    lag: int = 0

    @property
    def id(self) -> str:
        tail = "" if self.decay_per == "step" else f"-decay-per-{self.decay_per}"
        tail += f"-factors-every-{self.f}" if self.f else ""
        tail += "-when-ready" if self.promote == "when_ready" else ""
        tail += f"-plan-invert-lag-{self.lag}" if self.lag else ""
        return f"k{self.k}-{'deferred' if self.deferred else 'fresh'}-D{self.stages}{tail}"

    @property
    def steps(self) -> int:
        return 2 * self.k + 1

    @property
    def factor_every(self) -> int:
        return self.f or self.k


CASES = [Case(1, False), Case(2, False), Case(3, False), Case(1, True), Case(2, True),
         Case(2, False, stages=2), Case(2, True, stages=2), Case(2, True, decay_per="refresh"),
         # factors every f steps, inverses every k (issue 28, item 1)
         Case(2, False, f=1), Case(4, False, f=1), Case(4, False, f=2), Case(4, True, f=2),
         Case(2, False, stages=2, f=1),
         # deferred inverses in use from the step after their INVERT (issue 28, item 2)
         Case(2, True, promote="when_ready"), Case(3, True, promote="when_ready"),
         Case(2, True, stages=2, promote="when_ready"),
         Case(3, True, stages=2, promote="when_ready", lag=1), Case(3, True, stages=2, lag=1)]
#: The cases the "teeth" test perturbs: together they take every branch of it (k = 1; a phase, a decay
#: unit and a promotion rule to flip; factors apart from inverses; a plan's INVERT lag), each a few
#: float64 reference runs; every case is compared with its own reference in the test before it.
TEETH = [Case(1, False), Case(2, True, stages=2), Case(2, True, decay_per="refresh"), Case(4, False, f=2),
         Case(2, False, stages=2, f=1), Case(2, True, promote="when_ready"),
         Case(3, True, stages=2, promote="when_ready", lag=1)]


def _cfg(case: Case, plan: str | None = None) -> TrainConfig:
    optimizer = ["optimizer=pipefisher", f"optimizer.schedule={plan}"] if plan else \
        ["optimizer=kfac", f"optimizer.deferred_inverse={str(case.deferred).lower()}"]
    return compose_train(MODEL + [f"stages={case.stages}", f"steps={case.steps}", *optimizer,
                                  f"optimizer.curvature_interval={case.factor_every}",
                                  f"optimizer.inverse_interval={case.k}",
                                  f"optimizer.promote_inverses={case.promote}",
                                  f"optimizer.factor_decay_per={case.decay_per}"])


def _lagged_plan(case: Case, path: Path) -> str:
    """A PipeFisher plan for ``case``: the deferred critical-path refresh, with stage 1's INVERTs
    moved ``case.lag`` phases later (before that phase's PRECOND); written as JSON."""
    cfg = _cfg(case)
    schedule = schedule_for(cfg)
    cp = critical_path_assignment(schedule, kfac_layer_counts(schedule, encoder_layers_per_stage(cfg, 2)),
                                  case.k, deferred=True)
    phases = list(cp.phases)
    moved = tuple(x for x in phases[0].actions[1] if x.kind == ActionKind.INVERT)
    phases[0] = replace(phases[0], actions={**phases[0].actions,
                                            1: tuple(x for x in phases[0].actions[1] if x not in moved)})
    acts = phases[case.lag].actions[1]
    first = next(i for i, x in enumerate(acts) if x.kind == ActionKind.PRECOND)
    phases[case.lag] = replace(phases[case.lag], actions={**phases[case.lag].actions,
                                                          1: acts[:first] + moved + acts[first:]})
    plan = replace(cp, phases=tuple(phases), metadata={"planner": "pipefisher"})
    check_assignment(plan)
    assignment_to_json(plan, path)
    return str(path)


# --------------------------------------------------------------------------------------------
# Ours: PipelineWorker, recording K-FAC's state just before each optimizer step
# --------------------------------------------------------------------------------------------


def _clone(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def _worker(rank: int, cases: list[Case], out_dir: str) -> None:
    from pipefisher.runtime.worker import PipelineWorker

    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        cfg = _cfg(case, str(Path(out_dir) / f"plan{i}.json") if case.lag else None)
        if rank >= cfg.num_workers:
            continue
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/pg{i}", rank=rank,
                                world_size=cfg.num_workers, timeout=datetime.timedelta(seconds=120))
        try:
            worker = PipelineWorker(cfg, rank, cfg.num_workers, torch.device("cpu"))
            steps: list[dict[str, Any]] = []

            def record(w: PipelineWorker = worker, out: list = steps) -> None:
                layers = {}
                for pre in w.kfac.pre.values():
                    for name in pre.layer_names:
                        layer = pre.layer(name)
                        m = layer.module
                        layers[name] = {
                            "A": _clone(layer.a), "B": _clone(layer.b),
                            "A_inv": _clone(layer.a_inv), "B_inv": _clone(layer.b_inv),
                            "damping": torch.tensor(layer.damping, dtype=F64),
                            "pending": None if layer.pending is None else tuple(_clone(t) for t in layer.pending[:2]),
                            "preconditioned": layer.raw_grad_sq is not None,
                            "grad_w": _clone(m.weight.grad), "grad_b": _clone(m.bias.grad),
                        }
                out.append({"layers": layers})

            worker.before_optimizer_step.append(record)
            for step in range(case.steps):
                worker.train_step(step)
                steps[step]["age"] = worker.curvature_age
            params = {n: p.detach().clone() for m in worker.modules.values() for n, p in m.named_parameters()}
            stages = {n: stage for (_, stage), pre in worker.kfac.pre.items() for n in pre.layer_names}
            bound = curvature_age_bound(worker.assignment, cfg.optimizer.promote_inverses)
            torch.save({"steps": steps, "params": params, "stages": stages, "age_bound": bound},
                       Path(out_dir) / f"case{i}_rank{rank}.pt")
        finally:
            release_process_group()


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per case id: {"steps": per step {"layers": {name: state}, "age"}, "params": {name: tensor}},
    the stages' records merged (each layer and parameter lives on one stage)."""
    out = tmp_path_factory.mktemp("kfac_interval")
    for i, case in enumerate(CASES):
        if case.lag:
            _lagged_plan(case, out / f"plan{i}.json")
    world = max(c.stages for c in CASES)
    start_workers(_worker, (CASES, str(out)), world)
    merged = {}
    for i, case in enumerate(CASES):
        shards = [torch.load(out / f"case{i}_rank{r}.pt", weights_only=True) for r in range(case.stages)]
        steps = [{"layers": {}, "age": None} for _ in range(case.steps)]
        params: dict[str, Tensor] = {}
        stages: dict[str, int] = {}
        for shard in shards:
            stages.update(shard["stages"])
            for t, rec in enumerate(shard["steps"]):
                steps[t]["layers"].update(rec["layers"])
                if rec["age"] is not None:  # all-reduced: the same on every rank
                    steps[t]["age"] = rec["age"]
            params.update(shard["params"])
        merged[case.id] = {"steps": steps, "params": params, "stages": stages, "age_bound": shards[0]["age_bound"]}
    return merged


# --------------------------------------------------------------------------------------------
# The dense reference
# --------------------------------------------------------------------------------------------


def _import_asdl() -> tuple[types.ModuleType | None, str]:
    """``(asdl, "")``, or ``(None, why it does not import)``."""
    try:
        with warnings.catch_warnings():  # asdl 0.1a5 calls torch.jit.script at import
            warnings.simplefilter("ignore", DeprecationWarning)
            import asdl
            import asdl.operations.operation  # noqa: F401
            import asdl.precondition.prec_grad_maker  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available": said in the skip
        return None, f"{type(exc).__name__}: {exc}"
    return asdl, ""


@contextlib.contextmanager
def _asdl_cpu(asdl: types.ModuleType):
    """asdl's NVTX ranges (torch.cuda.nvtx) as no-ops, for CPU-only torch."""
    op = asdl.operations.operation
    noop = types.SimpleNamespace(range=lambda *a, **k: contextlib.nullcontext(), range_push=lambda *a, **k: None,
                                 range_pop=lambda: None)
    saved, op.nvtx = op.nvtx, noop
    try:
        yield
    finally:
        op.nvtx = saved


class _Layer:
    """Reference state of one Linear layer (float64)."""

    def __init__(self) -> None:
        self.xs: list[Tensor] = []  # this step's inputs [T/N, I], one per micro-batch
        self.gs: list[Tensor] = []  # this step's output gradients [T/N, O]
        self.a: Tensor | None = None  # [Ĩ, Ĩ]
        self.b: Tensor | None = None  # [O, O]
        self.inv: tuple[Tensor, Tensor, Tensor] | None = None  # (A⁻¹, B⁻¹, [λ_A, λ_B]) in use
        self.factor_step: int | None = None  # the step whose capture was folded in last
        # every inversion: (its step, (A⁻¹, B⁻¹, [λ_A, λ_B]), the capture step of the factors it inverted)
        self.made: list[tuple[int, tuple[Tensor, Tensor, Tensor], int]] = []


def _refresh_steps(case: Case, phase: int, asdl: types.ModuleType | None, model: nn.Module,
                   factor_every: int) -> tuple[list[int], list[int]]:
    """Steps that refresh the factors and the inverses of a layer whose curvature and INVERT run in
    phase 0: ASDL's interval logic (phase 0), or (t - phase) % f == 0 and (t - phase) % k == 0."""
    factors = [t for t in range(case.steps) if (t - phase) % factor_every == 0]
    inverses = [t for t in range(case.steps) if (t - phase) % case.k == 0]
    if asdl is not None and phase == 0:
        prec = asdl.precondition.prec_grad_maker
        maker = prec.PreconditionedGradientMaker(model, prec.PreconditioningConfig(
            curvature_upd_interval=factor_every, preconditioner_upd_interval=case.k))
        by_asdl = ([t for t in range(case.steps) if maker.do_update_curvature(t)],
                   [t for t in range(case.steps) if maker.do_update_preconditioner(t)])
        assert by_asdl == (factors, inverses), f"ASDL refreshes at {by_asdl}, ours at {(factors, inverses)}"
    return factors, inverses


def _in_use(case: Case, deferred: bool, promote: str, phase: int, made: list[int], t: int) -> int | None:
    """The step whose INVERT made the inverses that precondition step t (None: none yet)."""
    if not deferred:
        done = [r for r in made if r <= t]
        return max(done) if done else None
    earlier = [r for r in made if r < t]
    if not earlier:
        return None
    if promote == "when_ready":  # from the step after the INVERT
        return max(earlier)
    cycle = lambda s: (s - phase) // case.k  # noqa: E731
    older_cycle = [r for r in earlier if cycle(r) < cycle(t)]
    return max(older_cycle) if older_cycle else min(earlier)  # a first refresh: used from the next step


def reference(case: Case, *, phase: int = 0, deferred: bool | None = None, asdl: types.ModuleType | None = None,
              decay_per: str | None = None, factor_every: int | None = None, promote: str | None = None,
              stages: dict[str, int] | None = None) -> dict[str, Any]:
    """The dense reference run of ``case``; the keywords override its refresh rule (``phase``: the
    refresh phase; ``stages``: each layer's stage, needed by a plan with a lag).

    Returns:
        {"steps": per step {"layers": {name: {"A", "B", "A_inv", "B_inv", "damping", "grad_w",
        "grad_b", "raw_w", "raw_b"}}, "age"}, "params": {name: tensor}, "asdl_checked": int}.
    """
    deferred = case.deferred if deferred is None else deferred
    promote = promote or case.promote
    factor_every = factor_every or case.factor_every
    cfg = _cfg(case)
    o = cfg.optimizer
    decay = o.factor_decay ** factor_every if (decay_per or case.decay_per) == "step" else o.factor_decay
    model = build_full_model(bert_config(cfg), seed=cfg.seed)
    model.train()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and LINEAR.search(n)}
    assert len(linears) == 6 * cfg.model.num_layers
    state = {n: _Layer() for n in linears}

    def hook(name: str):
        def forward_hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            x = inputs[0].detach()
            state[name].xs.append(x.reshape(-1, x.shape[-1]).to(F64))
            output.register_hook(lambda g: state[name].gs.append(g.detach().reshape(-1, g.shape[-1]).to(F64)))
        return forward_hook

    for name, m in linears.items():
        m.register_forward_hook(hook(name))
    source, plan = data_source(cfg), data_plan(cfg)
    optimizer, scheduler = make_optimizer(cfg, list(model.named_parameters()), torch.device("cpu"))
    n = cfg.num_micro_batches
    loss_scale = 1.0 / n
    factor_steps, inverse_steps = _refresh_steps(case, phase, asdl, model, factor_every)
    if case.lag:  # stage 1's INVERTs run lag steps after its curvature (phase 0)
        assert stages is not None, "a plan with a lag needs each layer's stage"
    lag = {name: case.lag if stages is not None and stages[name] == 1 else 0 for name in linears}
    out: list[dict[str, Any]] = []
    asdl_checked = 0
    for t in range(case.steps):
        for s in state.values():
            s.xs.clear()
            s.gs.clear()
        cov = contextlib.nullcontext()
        if asdl is not None and t in factor_steps:
            cov = asdl.no_centered_cov(model, [(m, "kron") for m in linears.values()])
        with warnings.catch_warnings(), (_asdl_cpu(asdl) if asdl is not None else contextlib.nullcontext()):
            warnings.filterwarnings("ignore", message=r".*non-full backward hook.*", category=FutureWarning)
            with cov as cxt:
                for j in range(n):
                    losses = model(None, get_micro_batch(source, t, j, 0, **plan))
                    (losses.sum() * loss_scale).backward()
                krons = {name: cxt.cov_kron(m) for name, m in linears.items()} if cxt is not None else {}
        raw_norm = global_grad_norm(model.parameters())
        rec: dict[str, Any] = {}
        ages = []
        for name, m in linears.items():
            s = state[name]
            assert len(s.xs) == len(s.gs) == n
            if t in factor_steps:
                a_batch, b_batch = _factor_estimates(s, loss_scale)
                if name in krons:  # ASDL: Σ x xᵀ (weight block) and Σ g gᵀ of the captured gradients
                    _check_asdl(krons[name], a_batch, b_batch, len(s.xs[0]) / loss_scale, sum(len(x) for x in s.xs))
                    asdl_checked += 1
                if s.a is None:
                    s.a, s.b = a_batch, b_batch
                else:
                    s.a = decay * s.a + (1 - decay) * a_batch
                    s.b = decay * s.b + (1 - decay) * b_batch
                s.factor_step = t
            if t - lag[name] in inverse_steps:  # the factors as they stand: folded at s.factor_step
                s.made.append((t, _damped_inverses(s.a, s.b, o.damping), s.factor_step))
            made = {r: (inv, captured) for r, inv, captured in s.made}
            use = _in_use(case, deferred, promote, phase, list(made), t)
            s.inv = None if use is None else made[use][0]
            if use is not None:
                ages.append(t - made[use][1])
            raw = torch.cat([m.weight.grad, m.bias.grad[:, None]], dim=1).to(F64)  # [O, Ĩ]
            pre = raw if s.inv is None else s.inv[1] @ raw @ s.inv[0]  # [O, Ĩ]
            with torch.no_grad():
                m.weight.grad.copy_(pre[:, :-1])
                m.bias.grad.copy_(pre[:, -1])
            latest = s.made[-1][1] if s.made else None
            rec[name] = {"A": s.a, "B": s.b, "A_inv": None if s.inv is None else s.inv[0],
                         "B_inv": None if s.inv is None else s.inv[1], "damping": None if s.inv is None else s.inv[2],
                         "pending": latest if deferred and latest is not None and s.made[-1][0] != use else None,
                         "grad_w": pre[:, :-1], "grad_b": pre[:, -1], "raw_w": raw[:, :-1], "raw_b": raw[:, -1]}
        out.append({"layers": rec, "age": max(ages) if ages else None})
        optimizer.step(grad_norm=raw_norm if o.clip_before_precondition else None)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return {"steps": out, "params": {nm: p.detach().clone() for nm, p in model.named_parameters()},
            "asdl_checked": asdl_checked}


def _factor_estimates(s: _Layer, loss_scale: float) -> tuple[Tensor, Tensor]:
    """This step's A_batch [Ĩ, Ĩ] and B_batch [O, O] from the recorded inputs and output gradients."""
    x = torch.cat(s.xs)  # [T, I]
    x1 = torch.cat([x, torch.ones(len(x), 1, dtype=F64)], dim=1)  # [T, Ĩ]
    rows_mb = len(s.xs[0])  # T/N: the per-micro-batch loss is a mean over them
    g = torch.cat(s.gs) * (rows_mb / loss_scale)  # [T, O] per-row gradients g̃
    return x1.T @ x1 / len(x1), g.T @ g / len(g)


def _check_asdl(kron: dict[str, Tensor], a_batch: Tensor, b_batch: Tensor, g_scale: float, rows: int) -> None:
    """ASDL's Σ x xᵀ and Σ g gᵀ equal the reference's per-refresh estimates (weight block of A)."""
    assert_close(kron["A"].to(F64) / rows, a_batch[:-1, :-1], rtol=RTOL, atol=RTOL * float(a_batch.abs().max()))
    assert_close(kron["B"].to(F64) * g_scale ** 2 / rows, b_batch, rtol=RTOL, atol=RTOL * float(b_batch.abs().max()))


def _damped_inverses(a: Tensor, b: Tensor, damping: float) -> tuple[Tensor, Tensor, Tensor]:
    """(A + λ_A I)⁻¹, (B + λ_B I)⁻¹ and [λ_A, λ_B] with the factored damping split."""
    pi = ((a.trace() / a.shape[0]) / (b.trace() / b.shape[0])).sqrt()
    lam_a, lam_b = pi * damping ** 0.5, damping ** 0.5 / pi
    a_inv = torch.linalg.inv(a + lam_a * torch.eye(a.shape[0], dtype=F64))
    b_inv = torch.linalg.inv(b + lam_b * torch.eye(b.shape[0], dtype=F64))
    return a_inv, b_inv, torch.stack([lam_a, lam_b])


# --------------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------------


def _close(actual: Tensor | None, expected: Tensor | None, what: str) -> None:
    """Equal to RTOL of the expected tensor's largest entry (or both missing)."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: ours {'set' if actual is not None else 'missing'}, " \
                                                    f"reference {'set' if expected is not None else 'missing'}"
        return
    assert_close(actual.to(F64), expected, rtol=RTOL, atol=RTOL * float(expected.abs().max()),
                 msg=lambda m: f"{what}: {m}")


def compare(got: dict[str, Any], ref: dict[str, Any]) -> None:
    """Raise AssertionError at the first difference between our run and the reference."""
    assert len(got["steps"]) == len(ref["steps"])
    for t, (g, r) in enumerate(zip(got["steps"], ref["steps"])):
        assert g["age"] == r["age"], f"step {t}: curvature age ours {g['age']}, reference {r['age']}"
        assert set(g["layers"]) == set(r["layers"]), f"step {t}: layers differ"
        for name, mine in g["layers"].items():
            theirs = r["layers"][name]
            where = f"step {t} {name}"
            for key in ("A", "B", "A_inv", "B_inv"):
                _close(mine[key], theirs[key], f"{where} {key}")
            if theirs["damping"] is not None:
                _close(mine["damping"], theirs["damping"], f"{where} damping (λ_A, λ_B)")
            pend, ref_pend = mine["pending"], theirs["pending"]
            assert (pend is None) == (ref_pend is None), f"{where}: pending inverses ours {pend is not None}, " \
                                                         f"reference {ref_pend is not None}"
            if pend is not None:
                _close(pend[0], ref_pend[0], f"{where} pending A_inv")
                _close(pend[1], ref_pend[1], f"{where} pending B_inv")
            assert mine["preconditioned"] == (theirs["A_inv"] is not None), f"{where}: preconditioned?"
            # [∇W | ∇b] as one matrix: the key's bias gradient is rounding noise alone (softmax ignores
            # a shift of every key by the same vector), so it is compared on the matrix's scale.
            grad = torch.cat([mine["grad_w"], mine["grad_b"][:, None]], dim=1)  # [O, Ĩ]
            _close(grad, torch.cat([theirs["grad_w"], theirs["grad_b"][:, None]], dim=1), f"{where} preconditioned [∇W | ∇b]")
    word, decoder = WORD, DECODER
    for name, value in got["params"].items():
        expected = ref["params"][word if name == decoder else name]
        assert_close(value, expected, rtol=RTOL, atol=1e-5, msg=lambda m, nm=name: f"weight {nm} after the run: {m}")


def compare_preconditioned(got: dict[str, Any], ref: dict[str, Any]) -> int:
    """Only the numbers: the preconditioned gradients at the steps both runs precondition (none of
    the bookkeeping compare() checks first: ages, which inverses exist). Returns how many matched.

    Raises:
        AssertionError: at the first preconditioned gradient that differs.
    """
    matched = 0
    for t, (g, r) in enumerate(zip(got["steps"], ref["steps"])):
        for name, mine in g["layers"].items():
            theirs = r["layers"][name]
            if mine["preconditioned"] and theirs["A_inv"] is not None:
                grad = torch.cat([mine["grad_w"], mine["grad_b"][:, None]], dim=1)  # [O, Ĩ]
                _close(grad, torch.cat([theirs["grad_w"], theirs["grad_b"][:, None]], dim=1),
                       f"step {t} {name} preconditioned [∇W | ∇b]")
                matched += 1
    return matched


def _expected_age_bound(case: Case) -> int:
    """The oldest curvature a step uses: k − 1 fresh; 2k − 1 deferred to the next cycle; k + lag
    (the INVERT's lag behind its curvature) when used from the step after the INVERT."""
    if not case.deferred:
        return case.k - 1
    return 2 * case.k - 1 if case.promote == "at_cycle_end" else case.k + case.lag


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_interval_k_matches_dense_reference_at_every_step(case: Case, ours) -> None:
    got = ours[case.id]
    ref = reference(case, stages=got["stages"])  # ASDL's cross-check of it: the test below
    compare(got, ref)
    preconditioned = [t for t, s in enumerate(got["steps"]) if s["age"] is not None]
    # Fresh: every step is preconditioned; deferred: every step after step 0.
    assert preconditioned == list(range(1 if case.deferred else 0, case.steps))
    ages = [got["steps"][t]["age"] for t in preconditioned]
    assert max(ages) == _expected_age_bound(case) == got["age_bound"]


ASDL_CASES = [c for c in CASES if c.stages == 1 and not c.lag and c.k <= 3]  # every rule of refresh steps


@pytest.mark.parametrize("case", ASDL_CASES, ids=[c.id for c in ASDL_CASES])
def test_reference_refresh_steps_and_factors_equal_asdls(case: Case) -> None:
    """ASDL's interval logic gives the reference's refresh steps, and its ``no_centered_cov`` the
    reference's per-refresh factors (weight block of A, and B), at every factor refresh of 6 Linear
    layers × 2 encoder layers. Skipped, with the import error, where asdl does not import."""
    asdl, why = _import_asdl()
    if asdl is None:
        pytest.skip(f"the ASDL cross-check of the dense reference needs asdl (pip install asdfghjkl): {why}")
    ref = reference(case, asdl=asdl)
    assert ref["asdl_checked"] == len(range(0, case.steps, case.factor_every)) * 6 * 2


@pytest.mark.slow
@pytest.mark.parametrize("case", TEETH, ids=[c.id for c in TEETH])
def test_reference_with_another_phase_or_staleness_does_not_match(case: Case, ours) -> None:
    """The comparison has teeth: the wrong refresh phase (k > 1), the other staleness, factors as
    often as inverses (decoupled cases), the other promotion rule (deferred) and no INVERT lag (a
    plan with one) fail it, on the bookkeeping (which step has inverses, the curvature age) and on
    the numbers alone (the preconditioned gradients of the steps both precondition)."""
    got = ours[case.id]
    stages = got["stages"]
    assert compare_preconditioned(got, reference(case, stages=stages)) > 0
    wrong = [reference(case, deferred=not case.deferred, stages=stages)]
    if case.k > 1:
        wrong.append(reference(case, phase=1, stages=stages))
    if case.factor_every > 1:
        wrong.append(reference(case, decay_per="refresh" if case.decay_per == "step" else "step", stages=stages))
    if case.factor_every != case.k:
        wrong.append(reference(case, factor_every=case.k, stages=stages))
    if case.deferred and case.k > 1:  # at k = 1 both rules use an inverse from the next step on
        wrong.append(reference(case, promote="at_cycle_end" if case.promote == "when_ready" else "when_ready",
                               stages=stages))
    if case.lag:
        wrong.append(reference(case, stages={name: 0 for name in stages}))
    for ref in wrong:
        with pytest.raises(AssertionError):
            compare(got, ref)
        with pytest.raises(AssertionError, match="preconditioned"):
            compare_preconditioned(got, ref)
