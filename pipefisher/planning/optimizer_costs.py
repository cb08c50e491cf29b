"""What each element-wise optimizer's step costs the search: state bytes and step time of NVLAMB, AdamW and Muon.

Entry points: :func:`optimizer_state_bytes` (memory), :func:`optimizer_step_seconds` (time),
:func:`newton_schulz_flops`, :func:`muon_matrices` (the matrices Muon orthogonalizes in one stage).

[Note: element-wise optimizer costs] (per worker; p its parameters on one tp rank, sharded over ``sdp``; q of
them in the encoder's Linear weights, which Muon takes: ``optim.baselines``, ``ENCODER_LINEAR_PATTERN``)::

    state + the step's temporary   NVLAMB, AdamW: 2 moments + 1 temporary = 12 p / sdp bytes (Adam's 2 states)
                                   Muon: 12 (p - q) / sdp + 8 q / sdp (1 momentum + 1 temporary on its matrices)
    step, memory-bound             NVLAMB, AdamW: 28 bytes per parameter (read w, g, m, v; write w, m, v)
                                   Muon: 28 (p - q) / sdp + 20 q / sdp (read w, g, m; write w, m)
    step, Newton-Schulz            Muon: 5 (4 m² n + 2 m³) FLOPs per m x n matrix (m <= n; DESIGN.md) at
                                   the measured Newton-Schulz rate where ``comm`` has one
                                   (``compute.newton_schulz``), else flops_per_s, on the whole matrix on
                                   every rank that holds part of it
                                   (sdp or tp > 1: all-gather of the matrix first; ``ShardedMuon`` repeats
                                   the orthogonalization on each rank of its group, the naive form)

AdamW's step and state equal NVLAMB's here (its trust ratio's two norms are not charged), so the two differ in
the ranking only by their steps to target (the calibration). K-FAC and PipeFisher keep ``planning.memory``'s
model and the planner's units on top of NVLAMB's.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipefisher.model.config import BertConfig
from pipefisher.planning.comm_costs import CommCosts
from pipefisher.planning.costs import STEP_BYTES_PER_PARAM, Hardware, kfac_linear_dims

__all__ = ["ELEMENTWISE_OPTIMIZERS", "muon_matrices", "newton_schulz_flops", "optimizer_state_bytes",
           "optimizer_step_seconds"]

ELEMENTWISE_OPTIMIZERS = ("nvlamb", "adamw", "muon")
MUON_STEP_BYTES_PER_PARAM = 20  # read w, g, momentum; write w, momentum (fp32)
ADAM_STATE_BYTES_PER_PARAM = 12  # 2 moments + the step's one temporary
MUON_STATE_BYTES_PER_PARAM = 8  # 1 momentum + the step's one temporary
NS_STEPS = 5


def newton_schulz_flops(m: int, n: int, steps: int = NS_STEPS) -> float:
    """FLOPs of ``steps`` Newton–Schulz iterations X <- aX + (bA + cA²)X, A = XXᵀ, on an m x n matrix:
    ``steps`` (4 a² b + 2 a³) with a = min(m, n), b = max(m, n)."""
    a, b = min(m, n), max(m, n)
    return steps * (4.0 * a * a * b + 2.0 * a ** 3)


def muon_matrices(bert: BertConfig, encoder_layers: int) -> list[tuple[int, int]]:
    """(in, out) of the matrices Muon takes in a stage of ``encoder_layers`` encoder layers (its Linear weights)."""
    return kfac_linear_dims(bert, encoder_layers)


def _check(optimizer: str) -> None:
    if optimizer not in ELEMENTWISE_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: element-wise step costs are for {', '.join(ELEMENTWISE_OPTIMIZERS)}")


def optimizer_state_bytes(optimizer: str, params: float, muon_params: float, sdp: int = 1) -> float:
    """Optimizer state and the step's temporary on one worker ([Note: element-wise optimizer costs]).

    Args:
        optimizer: nvlamb, adamw or muon.
        params: the worker's parameters (on its tp rank, before sdp sharding).
        muon_params: those of them in encoder Linear weights (Muon's matrices).
        sdp: ranks sharding them.
    """
    _check(optimizer)
    if optimizer != "muon":
        return ADAM_STATE_BYTES_PER_PARAM * params / sdp
    return (ADAM_STATE_BYTES_PER_PARAM * (params - muon_params) + MUON_STATE_BYTES_PER_PARAM * muon_params) / sdp


def optimizer_step_seconds(optimizer: str, params: float, matrices: Sequence[tuple[int, int]], hardware: Hardware,
                           comm: CommCosts | None = None, sdp: int = 1, tp: int = 1) -> float:
    """The optimizer's own part of STEP on one worker ([Note: element-wise optimizer costs]); collectives of the
    gradient norm and the tied weight are the caller's.

    Args:
        optimizer: nvlamb, adamw or muon.
        params: the worker's parameters on its tp rank, before sdp sharding.
        matrices: Muon's whole matrices (in, out) on the worker (``muon_matrices`` of its stages).
        hardware: memory bandwidth and FLOP rate.
        comm: collective costs (the all-gather of a sharded matrix) and the measured Newton–Schulz rate; None: the
            ring model of ``hardware`` and its FLOP rate.
        sdp, tp: ranks sharding each parameter.
    """
    _check(optimizer)
    if optimizer != "muon":
        return params / sdp * STEP_BYTES_PER_PARAM / hardware.memory_bytes_per_s
    whole = sum(i * o for i, o in matrices)  # Muon's parameters, unsplit
    local = whole / tp
    seconds = ((params - local) * STEP_BYTES_PER_PARAM + local * MUON_STEP_BYTES_PER_PARAM) / sdp \
        / hardware.memory_bytes_per_s
    ns_rate = comm.ns_flops_per_s if comm is not None and comm.ns_flops_per_s else hardware.flops_per_s
    seconds += sum(newton_schulz_flops(i, o) for i, o in matrices) / ns_rate
    if sdp * tp > 1:
        comm = comm or CommCosts({}, hardware)
        seconds += comm.seconds("all_gather", sdp * tp, 4.0 * whole)
    return seconds
