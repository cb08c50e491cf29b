"""planning.memory's components against an independent count (issue 38, defect 4).

The reference for weights, gradients and optimizer state is the real thing: a D=2 run's stage modules
built as a worker builds them and the optimizer train.py makes, stepped once, their tensors' bytes
counted; activations, heads and the device terms are the note's formulas written out by hand for the
tiny case. bench/studies/15-memory-model.md measures the whole against peak RSS.
"""

from __future__ import annotations

import pytest
import torch

from pipefisher.planning import memory as M
from pipefisher.planning.strategy_search import hybrid_memory_per_worker
from pipefisher.runtime.build import build_stage_modules, run_shape, schedule_for
from pipefisher.optim.factory import make_optimizer
from tests.conftest import compose_train


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 1:  # the per-parameter step counters are scalars
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _worker_state(cfg, rank: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of worker ``rank`` after one optimizer step."""
    schedule = schedule_for(cfg)
    modules = build_stage_modules(cfg, schedule, rank)
    named, seen = [], set()
    for (pipe, stage), m in sorted(modules.items()):
        for n, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                named.append((f"{pipe}.{stage}.{n}", p))
    optimizer, _ = make_optimizer(cfg, named, torch.device("cpu"))
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step(grad_norm=torch.tensor(1.0))
    params = [p for _, p in named]
    state = [v for s in optimizer.state.values() for v in s.values()]
    return _storage_bytes(params), _storage_bytes(p.grad for p in params), _storage_bytes(state)


@pytest.mark.parametrize("method", ["1f1b", "chimera"])
def test_memory_model_components_match_a_real_worker_and_the_formulas(method: str) -> None:
    cfg = compose_train([f"pipeline={method}", "stages=2", "num_micro_batches=2"])
    run = run_shape(cfg)
    schedule = schedule_for(cfg)
    est = {d: M.estimate_memory_per_worker(run, "nvlamb", schedule, device=d) for d in M.DEVICES}
    b, s, h, a, v, p_ = 2, 32, 128, 2, 512, 5  # micro-batch, sequence, hidden, heads, vocab, predictions
    layer = 2 * s * b * h * (34 + 5 * a * s / h)  # one encoder layer, fp32 (twice the 16-bit count)
    logprobs = 4 * b * p_ * v
    stage_bytes = [n * layer for n in run.encoder_layers]
    stage_bytes[0] += 4 * s * b * h  # the embeddings' output
    stage_bytes[1] += logprobs  # the last stage keeps the MLM log-probabilities
    for w in (0, 1):
        params, grads, state = _worker_state(cfg, w)
        e = est["cuda"][w]
        assert e.weights == params and e.gradients == grads == params
        assert e.optimizer == state + params  # NVLAMB's two moments, and its step's one temporary per parameter
        assert state == 2 * params
        # In flight at the peak, by hand from the schedule (D=2, N=2): 1f1b holds two micro-batches of stage 0 on
        # worker 0 and one of stage 1 on worker 1; Chimera's down pipe and up pipe put stage 0 on worker 0 and
        # worker 1 respectively, and each worker holds both its stages' micro-batches at once.
        if method == "1f1b":
            held = 2 * stage_bytes[0] if w == 0 else stage_bytes[1]
        else:
            held = stage_bytes[0] + stage_bytes[1]
        heads = 2 * logprobs if (w == 1 or method == "chimera") else 0  # the heads' backward: two b·P·V buffers
        assert e.activations == pytest.approx(held + heads)
        assert (e.captures, e.allocator, e.runtime) == (0, 0, 0)
        assert e.total == pytest.approx(e.tensors)
        cpu = est["cpu"][w]
        transient = grads + params + e.activations  # gradients, the step's temporary, activations
        assert cpu.tensors == pytest.approx(e.tensors)
        assert cpu.allocator == pytest.approx(M.CPU_HEAP_RETENTION * transient)
        assert cpu.runtime == M.CPU_RUNTIME_BYTES
        assert cpu.total == pytest.approx(e.tensors + M.CPU_HEAP_RETENTION * transient + M.CPU_RUNTIME_BYTES)
        assert M.cuda_reserved_bytes(e) == pytest.approx(e.tensors * (1 + M.CUDA_RESERVED_SLACK))
    # The strategy search's model at sdp = tp = 1 is the same, per device, but for Chimera's gradient-sync
    # buffer (two replicas of each stage) where it outgrows the activations: a transient like them.
    for d in M.DEVICES:
        ours = hybrid_memory_per_worker(run, 1, 1, schedule, device=d)
        for w in (0, 1):
            more = max(ours[w].comm_buffers - ours[w].activations, 0)
            assert (method == "chimera") == (more > 0)
            retained = M.CPU_HEAP_RETENTION * more if d == "cpu" else 0
            assert ours[w].total == pytest.approx(est[d][w].total + more + retained)


def test_memory_model_refuses_an_unknown_device_in_one_line() -> None:
    run = run_shape(compose_train(["pipeline=1f1b", "stages=2", "num_micro_batches=2"]))
    with pytest.raises(ValueError, match=r"^device='tpu': choose one of cuda, cpu$"):
        M.estimate_memory_per_worker(run, "nvlamb", device="tpu")
    with pytest.raises(ValueError, match="device='mps'"):
        hybrid_memory_per_worker(run, device="mps")


def test_the_search_judges_a_cpu_budget_by_the_cpu_peak() -> None:
    """A budget between the tensors' bytes and a CPU worker's peak: the search ranks the candidate for a GPU
    and excludes it for CPU workers (whose peak RSS holds glibc's retention and the runtime besides)."""
    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import RunShape
    from pipefisher.planning.strategy_search import search_strategies

    bert = BertConfig.from_size("mini")
    run = RunShape(bert, "1f1b", 2, 4, 8)
    gpu, cpu = (max(m.total for m in hybrid_memory_per_worker(run, device=d).values()) for d in ("cuda", "cpu"))
    budget_gb = (gpu + cpu) / 2 / 1e9
    space = dict(devices=2, memory_gb=budget_gb, global_batch=32, methods=["1f1b"], micro_batch_sizes=[8],
                 optimizers=["nvlamb"], recompute=[False], sdp_degrees=[1], tp_degrees=[1])
    found = {d: [c for c in search_strategies(bert, device=d, **space) if c.stages == 2] for d in ("cuda", "cpu")}
    assert [c.excluded for c in found["cuda"]] == [None]
    assert "exceeds memory_gb" in found["cpu"][0].excluded
    assert found["cpu"][0].memory_gb == pytest.approx(cpu / 1e9)


def test_one_process_is_predicted_with_its_schedule_one_micro_batch_in_flight() -> None:
    """A one-process run trains through the worker (issue 39) with a one-stage schedule that runs each
    micro-batch's F then its B (``generators.gpipe`` at D=1), so the prediction holds one micro-batch's
    activations, not N."""
    from pipefisher.runtime.reporting import prediction_inputs

    cfg = compose_train(["stages=1", "num_micro_batches=4"])
    run, optimizer, schedule, assignment = prediction_inputs(cfg)
    assert (run.num_micro_batches, optimizer, schedule, assignment) == (4, "nvlamb", None, None)
    est = M.estimate_memory_per_worker(run, optimizer, device="cpu")[0]
    b, s, h, a, v, p_ = 2, 32, 128, 2, 512, 5
    # per micro-batch in flight: 2 layers, embeddings, the MLM head's saved log-probabilities (4 B per slot and
    # vocabulary entry); once: the head's backward temporaries (logits' gradient and softmax, 8 B)
    held = 2 * (2 * s * b * h * (34 + 5 * a * s / h)) + 4 * s * b * h + 4 * b * p_ * v
    assert est.activations == pytest.approx(held + 8 * b * p_ * v)


def test_only_parameters_of_32_mib_or_more_escape_the_cpu_retention() -> None:
    """glibc mmaps every block of at least DEFAULT_MMAP_THRESHOLD_MAX (32 MiB on 64-bit) and unmaps it at its
    free: bert-medium's word embedding (30522 x 512 x 4 bytes = 62.5 MB) and the decoder copy are such
    blocks, bert-mini's (31.3 MB) are not, nor any encoder weight of either."""
    from pipefisher.model.config import BertConfig
    from pipefisher.planning.costs import RunShape

    assert M.GLIBC_MMAP_THRESHOLD_MAX == 4 * 1024 * 1024 * 8
    medium = RunShape(BertConfig.from_size("medium"), "1f1b", 2, 4, 8)
    assert [M.mmapped_parameters(medium, [s]) for s in (0, 1)] == [30522 * 512] * 2
    assert M.mmapped_parameters(medium, [0, 1]) == 30522 * 512  # one worker, both ends: the tied tensor once
    mini = RunShape(BertConfig.from_size("mini"), "1f1b", 2, 4, 8)
    assert [M.mmapped_parameters(mini, [s]) for s in (0, 1)] == [0, 0]
    cpu, cuda = (M.estimate_memory_per_worker(medium, "nvlamb", device=d)[0] for d in ("cpu", "cuda"))
    params = cuda.weights / 4
    retained = 8 * (params - 30522 * 512) + cuda.activations  # gradients and temporaries of the rest, activations
    assert cpu.allocator == pytest.approx(M.CPU_HEAP_RETENTION * retained)
