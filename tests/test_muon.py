"""Muon's Newton–Schulz precision follows the hardware (``optimizer.ns_dtype``), and ``ShardedMuon``
orthogonalizes each matrix once per mesh, on its owner (issue 36).

Torch's Muon equality at bf16 and the fp32 reference over whole steps are in
``test_baseline_optimizers``; ``ShardedMuon`` at bf16 against torch's Muon bit for bit is in
``test_hybrid_optimizers``.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipefisher import hardware
from pipefisher.config import ConfigError
from pipefisher.optim import muon
from pipefisher.optim.muon import Muon, assign_owners, newton_schulz, ns_flops, resolve_ns_dtype
from pipefisher.runtime.teardown import release_process_group
from pipefisher.optim.factory import make_optimizer
from tests.conftest import compose_train
from tests.dist_harness import start_workers

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx fma avx2 bmi2
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8
processor\t: 1
model name\t: ignored
flags\t\t: ignored
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd sve bf16 i8mm
CPU implementer\t: 0x41
"""
NS = ((3.4445, -4.7750, 2.0315), 5, 1e-7)  # torch's coefficients, steps, eps


def test_cpuinfo_gives_the_model_and_the_first_processors_flags() -> None:
    assert hardware.parse_cpuinfo(EPYC) == ("AMD EPYC", frozenset("fpu vme sse sse2 avx fma avx2 bmi2".split()))
    model, flags = hardware.parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert model == "Intel(R) Xeon(R) Platinum 8480+" and {"avx512_bf16", "amx_bf16"} <= flags and "ignored" not in flags
    assert hardware.parse_cpuinfo(GRAVITON) == ("", frozenset("fp asimd sve bf16 i8mm".split()))
    assert hardware.parse_cpuinfo("") == ("", frozenset())


def _cpu(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: hardware.parse_cpuinfo(text))


def test_bf16_arithmetic_needs_avx512_bf16_or_amx_on_a_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch, EPYC)
    assert hardware.bf16_arithmetic("cpu") == (False, "CPU AMD EPYC without avx512_bf16/amx")
    _cpu(monkeypatch, SAPPHIRE_RAPIDS)
    assert hardware.bf16_arithmetic("cpu") == (True, "CPU Intel(R) Xeon(R) Platinum 8480+ with avx512_bf16/amx_bf16")
    _cpu(monkeypatch, EPYC.replace("avx2", "avx2 amx_bf16"))
    assert hardware.bf16_arithmetic(torch.device("cpu"))[0]


@pytest.mark.parametrize("capability, fast", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_bf16_arithmetic_on_cuda_needs_compute_capability_8(monkeypatch: pytest.MonkeyPatch, capability, fast) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU-X")
    yes, why = hardware.bf16_arithmetic("cuda")
    assert yes == fast and why.startswith(f"GPU GPU-X, compute capability {capability[0]}.{capability[1]}")


def test_describe_hardware_names_cpu_flags_threads_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch, EPYC)
    line = hardware.describe_hardware("cpu")
    assert line.startswith("CPU AMD EPYC (") and "avx2 yes, avx512f no, avx512_bf16 no, amx_bf16 no" in line
    assert f"{torch.get_num_threads()} torch threads, torch {torch.__version__}" in line


def test_ns_dtype_auto_follows_the_cpu_and_an_override_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _cpu(monkeypatch, EPYC)
    assert resolve_ns_dtype("auto", "cpu") == (torch.float32, "muon: Newton-Schulz in fp32 (CPU AMD EPYC without avx512_bf16/amx)")
    dtype, line = resolve_ns_dtype("bf16", "cpu")
    assert dtype == torch.bfloat16 and line.startswith("muon: Newton-Schulz in bf16 (optimizer.ns_dtype=bf16; CPU AMD EPYC")
    _cpu(monkeypatch, SAPPHIRE_RAPIDS)
    assert resolve_ns_dtype("auto", "cpu")[0] == torch.bfloat16
    assert resolve_ns_dtype("fp32", "cpu")[0] == torch.float32
    with pytest.raises(ValueError, match=r"optimizer.ns_dtype='fp16': choose one of auto, bf16, fp32"):
        resolve_ns_dtype("fp16", "cpu")


SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "model.vocab_size=128", "data.seq_len=16"]


def test_config_refuses_an_unknown_ns_dtype_and_warns_when_it_has_no_effect(caplog: pytest.LogCaptureFixture) -> None:
    assert compose_train(SMALL + ["optimizer=muon"]).optimizer.ns_dtype == "auto"
    with pytest.raises(ConfigError, match="optimizer.ns_dtype"):
        compose_train(SMALL + ["optimizer=muon", "optimizer.ns_dtype=fp16"])
    with caplog.at_level(logging.WARNING):
        compose_train(SMALL + ["optimizer=adamw", "optimizer.ns_dtype=fp32"])
    assert "optimizer.ns_dtype has no effect unless optimizer=muon" in caplog.text


def test_the_run_logs_its_newton_schulz_precision_once(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    _cpu(monkeypatch, EPYC)
    layer = torch.nn.Linear(8, 8)
    named = [("bert.encoder.layer.0.attention.self.query.weight", layer.weight)]
    for ns_dtype, want in (("auto", torch.float32), ("bf16", torch.bfloat16)):
        cfg = compose_train(SMALL + ["optimizer=muon", f"optimizer.ns_dtype={ns_dtype}"])
        caplog.clear()
        with caplog.at_level(logging.INFO):
            opt, _ = make_optimizer(cfg, named, torch.device("cpu"))
            make_optimizer(cfg, named, torch.device("cpu"), log_here=False)  # another worker of the run
        assert opt.muon.ns_dtype == want
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("muon: ")]
        assert len(lines) == 1
    assert lines == ["muon: Newton-Schulz in bf16 (optimizer.ns_dtype=bf16; CPU AMD EPYC without avx512_bf16/amx)"]


# -- the iteration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(16, 16), (24, 8), (8, 24)])
def test_newton_schulz_in_bf16_is_torchs_and_in_fp32_tracks_fp64(shape: tuple[int, int]) -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    kept = g.clone()
    assert torch.equal(newton_schulz(g, *NS, torch.bfloat16), _zeropower_via_newtonschulz(g, *NS))
    fp32, fp64 = newton_schulz(g, *NS, torch.float32), newton_schulz(g, *NS, torch.float64)
    assert fp32.dtype == torch.float32 and fp32.shape == shape
    torch.testing.assert_close(fp32.double(), fp64, rtol=0, atol=1e-5)
    bf16_error = (newton_schulz(g, *NS, torch.bfloat16).double() - fp64).abs().max()
    assert bf16_error > 100 * (fp32.double() - fp64).abs().max()  # fp32 is the more exact
    assert torch.equal(g, kept)  # the input (a momentum buffer without Nesterov) is never changed


def test_muon_without_nesterov_leaves_its_buffer_to_momentum() -> None:
    """fp32: the update *is* the buffer, and the iteration must not normalize it in place."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 6))
    opt = Muon([w], lr=0.1, nesterov=False, ns_dtype="fp32")
    w.grad = torch.randn(8, 6)
    opt.step()
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], 0.05 * w.grad, rtol=1e-6, atol=0)


def test_muon_refuses_an_unresolved_ns_dtype() -> None:
    with pytest.raises(ValueError, match="ns_dtype='auto'"):
        Muon([torch.nn.Parameter(torch.ones(2, 2))], ns_dtype="auto")


# -- owners ------------------------------------------------------------------------------------------

BERT_MINI_LAYER = [(256, 256)] * 4 + [(1024, 256), (256, 1024)]


def test_owners_balance_newton_schulz_work() -> None:
    shapes = BERT_MINI_LAYER * 4  # bert-mini's 24 Muon matrices
    owners = assign_owners(shapes, 2)
    load = [sum(ns_flops(s) for s, o in zip(shapes, owners) if o == r) for r in range(2)]
    assert load[0] == load[1]
    assert assign_owners(shapes, 2) == owners  # a pure function: every process agrees
    owners = assign_owners(shapes, 3)
    load = [sum(ns_flops(s) for s, o in zip(shapes, owners) if o == r) for r in range(3)]
    assert max(load) - min(load) <= ns_flops((256, 256))
    assert assign_owners([(4, 4), (8, 8)], 4) == [1, 0]  # the larger first, to rank 0; ranks 2, 3 idle
    assert ns_flops((3, 5), steps=1) == 4 * 9 * 5 + 2 * 27 == ns_flops((5, 3), steps=1)


def _chunks(t: torch.Tensor, dim: int, ranks: int) -> list[torch.Tensor]:
    """DTensor's parts of ``t`` (torch.chunk, then empty parts for the rest)."""
    parts = list(torch.chunk(t, ranks, dim))
    while len(parts) < ranks:
        shape = list(t.shape)
        shape[dim] = 0
        parts.append(t.new_empty(shape))
    return parts


def _all_to_all(buffers: list[torch.Tensor], send: list[list[int]], recv: list[list[int]]) -> list[torch.Tensor]:
    """What all_to_all_single delivers to each process, checking that the splits agree."""
    ranks = len(buffers)
    for r in range(ranks):
        for src in range(ranks):
            assert recv[r][src] == send[src][r], (r, src)
    pieces = [list(b.split(s)) for b, s in zip(buffers, send)]
    return [torch.cat([pieces[src][r] for src in range(ranks)]) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_parts_reach_their_owner_whole_and_results_come_back_as_parts(ranks: int) -> None:
    gen = torch.Generator().manual_seed(ranks)
    shapes = [(8, 6), (7, 6), (6, 10), (1, 6), (5, 3), (4, 9)]  # uneven, and empty parts for ranks > 1 row
    dims = [0, 0, 1, 0, 1, 1]
    wholes = [torch.randn(s, generator=gen) for s in shapes]
    owners = assign_owners(shapes, ranks)
    parts = [[_chunks(w, d, ranks)[r] for w, d in zip(wholes, dims)] for r in range(ranks)]
    packed = [muon._pack_to_owners(parts[r], shapes, dims, owners, r, ranks) for r in range(ranks)]
    got = _all_to_all([p[0] for p in packed], [p[1] for p in packed], [p[2] for p in packed])
    gathered = {}
    for r in range(ranks):
        mine = muon._unpack_at_owner(got[r], shapes, dims, owners, r, ranks)
        assert sorted(mine) == [i for i in range(len(shapes)) if owners[i] == r]
        gathered.update(mine)
    for i, w in enumerate(wholes):
        assert torch.equal(gathered[i], w), i
    results = {i: 2 * w + 1 for i, w in gathered.items()}
    packed = [muon._pack_from_owner({i: t for i, t in results.items() if owners[i] == r}, shapes, dims, owners, r,
                                    ranks, torch.float32, torch.device("cpu")) for r in range(ranks)]
    got = _all_to_all([p[0] for p in packed], [p[1] for p in packed], [p[2] for p in packed])
    for r in range(ranks):
        back = muon._unpack_parts(got[r], shapes, dims, owners, r, ranks)
        for i, (w, d) in enumerate(zip(wholes, dims)):
            assert torch.equal(back[i], _chunks(2 * w + 1, d, ranks)[r]), (r, i)


# -- two processes -------------------------------------------------------------------------------------

SHAPES = [(8, 6), (7, 6), (6, 10), (1, 6)]  # (7, 6): 4 + 3 rows; (1, 6) on Shard(0): rank 1's part is empty
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
STEPS = 3


def _sharded_worker(rank: int, out: str) -> None:
    """ShardedMuon over 2 processes (Shard(0) and Shard(1), bf16 and fp32) and Muon on the whole
    weights in this process, from the same weights and gradients; NS runs counted per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipefisher.optim.muon import ShardedMuon

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/pg", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (2,))
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(s, generator=gen) for s in SHAPES]
        grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
        found, want, runs = {}, {}, {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            whole = [torch.nn.Parameter(w.clone()) for w in weights]
            reference = torch.optim.Muon(whole, **MUON) if name == "bf16" else Muon(whole, ns_dtype=dtype, **MUON)
            for step_grads in grads:
                for p, g in zip(whole, step_grads):
                    p.grad = g.clone()
                reference.step()
            want[name] = [p.detach() for p in whole]
            for dim in (0, 1):
                parts = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(dim)])) for w in weights]
                sharded = ShardedMuon(parts, ns_dtype=dtype, **MUON)
                runs[name, dim] = []
                for step_grads in grads:
                    for p, g in zip(parts, step_grads):
                        p.grad = distribute_tensor(g, mesh, [Shard(dim)])
                    sharded.step()
                    runs[name, dim].append(sharded.ns_runs)
                found[name, dim] = [p.full_tensor().detach() for p in parts]
                runs["rows", dim] = [p.to_local().shape[dim] for p in parts]
        torch.save({"found": found, "want": want, "runs": runs}, f"{out}/muon{rank}.pt")
    finally:
        release_process_group()


@pytest.mark.slow
def test_sharded_muon_orthogonalizes_each_matrix_once_and_equals_muon(tmp_path: Path) -> None:
    start_workers(_sharded_worker, (str(tmp_path),), 2)
    res = [torch.load(tmp_path / f"muon{rank}.pt", weights_only=True) for rank in range(2)]
    owners = assign_owners(SHAPES, 2)
    assert [r["runs"].pop(("rows", 0))[3] for r in res] == [1, 0]  # (1, 6): rank 1's part is empty
    assert [r["runs"].pop(("rows", 1))[3] for r in res] == [3, 3]
    for key in res[0]["runs"]:
        per_rank = [r["runs"][key] for r in res]
        assert per_rank == [[owners.count(rank)] * STEPS for rank in range(2)], (key, per_rank)
        assert all(sum(step) == len(SHAPES) for step in zip(*per_rank))  # once per matrix per group
    for rank, r in enumerate(res):
        for (name, dim), got in r["found"].items():
            for shape, g, w in zip(SHAPES, got, r["want"][name]):
                assert torch.equal(g, w), f"rank {rank}, {name}, Shard({dim}), {shape}: {(g - w).abs().max()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_cuda_gpu_auto_is_bf16_where_capability_allows_and_muon_equals_torchs() -> None:
    device = torch.device("cuda")
    dtype, line = resolve_ns_dtype("auto", device)
    assert (dtype == torch.bfloat16) == (torch.cuda.get_device_capability(device) >= (8, 0)), line
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
    ours = [torch.nn.Parameter(w.clone().to(device)) for w in weights]
    theirs = [torch.nn.Parameter(w.clone().to(device)) for w in weights]
    fp64 = [torch.nn.Parameter(w.clone().double().to(device)) for w in weights]
    opts = [Muon(ours, ns_dtype="bf16", **MUON), torch.optim.Muon(theirs, **MUON), Muon(fp64, ns_dtype=torch.float64, **MUON)]
    fp32 = [torch.nn.Parameter(w.clone().to(device)) for w in weights]
    opts.append(Muon(fp32, ns_dtype="fp32", **MUON))
    for step_grads in grads:
        for params, opt in zip((ours, theirs, fp64, fp32), opts):
            for p, g in zip(params, step_grads):
                p.grad = g.to(device, p.dtype)
            opt.step()
    for a, b, c, d in zip(ours, theirs, fp64, fp32):
        assert torch.equal(a, b)
        torch.testing.assert_close(d.double(), c, rtol=0, atol=1e-6)  # torch's default: no TF32 in fp32 products
