"""Split BERT's L + 2 pipeline layers into contiguous stages balanced by estimated cost.

Pipeline layers are numbered as in ``pipefisher.model.bert``: 0 = embeddings, 1..L = encoder
layers, L + 1 = heads. A partition is a list of ``(first_layer, last_layer)`` pairs, **both
inclusive**, one per stage, so ``BertStage(config, *partition[k])`` builds stage k. The first stage
always holds the embeddings and the last the heads, and every stage holds at least one encoder
layer (DESIGN.md, "Where BERT's compute is": balance by cost, not by layer count).
"""

from __future__ import annotations

import functools
import itertools
import math

from collections.abc import Sequence

from pipefisher.model.config import BertConfig

__all__ = ["layer_costs", "partition_layers", "stage_costs"]


def layer_costs(config: BertConfig, seq_len: int = 128, max_predictions: int = 20) -> list[float]:
    """Estimated forward FLOPs per sequence of each of the L + 2 pipeline layers.

    Counts 2 FLOPs per multiply-add of the matrix products; element-wise work is a small term.

    Args:
        config: the architecture (H, V, FFN width).
        seq_len: S, tokens per sequence.
        max_predictions: P, masked-LM slots per sequence (the MLM head runs only there).

    Returns:
        ``[embeddings, encoder layer 0, ..., encoder layer L-1, heads]`` in FLOPs:
        embeddings ~ 10·S·H (three lookups, sum, LayerNorm); encoder layer = 24·S·H² + 4·S²·H
        for FFN width 4H (QKV and output projections 8·S·H², FFN 4·S·H·F, scores and context
        4·S²·H); heads = MLM transform 2·P·H² + decoder 2·P·H·V + pooler 2·H² + NSP 4·H.
    """
    if seq_len < 1 or max_predictions < 0:
        raise ValueError(
            f"seq_len={seq_len}, max_predictions={max_predictions}: need seq_len ≥ 1 and "
            "max_predictions ≥ 0"
        )
    s, h = float(seq_len), float(config.hidden_size)
    p, v = float(max_predictions), float(config.vocab_size)
    f = float(config.intermediate_size or 4 * config.hidden_size)
    embeddings = 10.0 * s * h
    encoder = 8.0 * s * h * h + 4.0 * s * h * f + 4.0 * s * s * h
    heads = 2.0 * p * h * h + 2.0 * p * h * v + 2.0 * h * h + 4.0 * h
    return [embeddings] + [encoder] * config.num_layers + [heads]


def stage_costs(costs: Sequence[float], partition: Sequence[tuple[int, int]]) -> list[float]:
    """Sum of ``costs`` over each stage's pipeline layers (``partition`` pairs are inclusive)."""
    return [sum(costs[first : last + 1]) for first, last in partition]


def _bounds_from_counts(counts: Sequence[int], num_layers: int) -> list[tuple[int, int]]:
    """Encoder-layer counts per stage -> inclusive pipeline-layer bounds (embeddings/heads added)."""
    bounds: list[tuple[int, int]] = []
    next_layer = 1
    for k, count in enumerate(counts):
        first = 0 if k == 0 else next_layer
        last = next_layer + count - 1
        if k == len(counts) - 1:
            last = num_layers + 1
        bounds.append((first, last))
        next_layer += count
    return bounds


def _balanced_counts(costs: Sequence[float], num_stages: int) -> list[int]:
    """Encoder layers per stage minimizing the most expensive stage (exact DP, O(D·L²))."""
    num_layers = len(costs) - 2
    embeddings, encoder, heads = costs[0], costs[1:-1], costs[-1]
    prefix = [0.0]
    for c in encoder:
        prefix.append(prefix[-1] + c)

    def cost(k: int, i: int, j: int) -> float:  # stage k holding encoder layers i..j-1
        extra = (embeddings if k == 0 else 0.0) + (heads if k == num_stages - 1 else 0.0)
        return prefix[j] - prefix[i] + extra

    inf = float("inf")
    # best[k][j]: the smallest possible max stage cost of stages 0..k covering encoder layers 0..j-1.
    best = [[inf] * (num_layers + 1) for _ in range(num_stages)]
    split = [[0] * (num_layers + 1) for _ in range(num_stages)]
    for j in range(1, num_layers + 1):
        best[0][j] = cost(0, 0, j)
    for k in range(1, num_stages):
        for j in range(k + 1, num_layers + 1):
            for i in range(k, j):
                candidate = max(best[k - 1][i], cost(k, i, j))
                if candidate < best[k][j]:
                    best[k][j], split[k][j] = candidate, i
    counts: list[int] = []
    j = num_layers
    for k in range(num_stages - 1, 0, -1):
        i = split[k][j]
        counts.append(j - i)
        j = i
    counts.append(j)
    return counts[::-1]


def _v_balanced_counts(costs: Sequence[float], num_stages: int) -> list[int] | None:
    """Encoder layers per stage minimizing the most loaded worker of a V placement (worker r holds
    stages r and S−1−r; the first and the last stage, both on worker 0, may hold no encoder layer):
    exhaustive over the compositions, None when there are too many.

    Up to ``_V_SEARCH_LIMIT`` compositions, so the answer is kept per (costs, stages): the strategy search
    asks for the same partition of every candidate several times (memory, activations, costs)."""
    counts = _v_balanced_counts_of(tuple(costs), num_stages)
    return None if counts is None else list(counts)


@functools.lru_cache(maxsize=256)
def _v_balanced_counts_of(costs: tuple[float, ...], num_stages: int) -> tuple[int, ...] | None:
    """:func:`_v_balanced_counts` for hashable costs."""
    num_layers = len(costs) - 2
    if math.comb(num_layers + num_stages - 1, num_stages - 1) > _V_SEARCH_LIMIT:
        return None
    embeddings, encoder, heads = costs[0], costs[1:-1], costs[-1]
    prefix = [0.0]
    for c in encoder:
        prefix.append(prefix[-1] + c)
    best: tuple[float, list[int]] | None = None
    for cuts in itertools.combinations_with_replacement(range(num_layers + 1), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        if min(counts[1:-1], default=1) < 1:  # only the first and the last stage may be empty
            continue
        stage = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
        stage[0] += embeddings
        stage[-1] += heads
        load = max(stage[r] + stage[num_stages - 1 - r] for r in range(num_stages // 2))
        if best is None or load < best[0]:
            best = (load, counts)
    return tuple(best[1]) if best else None


_V_SEARCH_LIMIT = 300_000


def partition_layers(
    config: BertConfig,
    num_stages: int,
    seq_len: int = 128,
    max_predictions: int = 20,
    layers_per_stage: Sequence[int] | None = None,
    v_shape: bool = False,
) -> list[tuple[int, int]]:
    """Split the L + 2 pipeline layers into ``num_stages`` contiguous stages.

    Args:
        config: the architecture.
        num_stages: D, number of pipeline stages (1 ≤ D ≤ L + 2; beyond L, the heads and then the
            embeddings get stages without encoder layers).
        seq_len: S, used by the cost estimate.
        max_predictions: P, used by the cost estimate.
        layers_per_stage: explicit number of *encoder* layers per stage (length D, each ≥ 1 but
            the first and the last, which may be 0, summing to L); the embeddings go with stage 0 and the heads with stage D-1. When
            ``None``, the counts minimize the largest stage cost under ``layer_costs``.
        v_shape: the stages are placed in a V (zb-v: worker r holds stages r and D−1−r, D even):
            balance the workers' loads (the sum of their two stages) instead of the stages'
            (exhaustive search; the per-stage balance when the model has too many layers for it).

    Returns:
        One ``(first_layer, last_layer)`` pair per stage, both inclusive, covering 0..L+1.

    Raises:
        ValueError: ``num_stages`` out of range, or ``layers_per_stage`` inconsistent.
    """
    num_layers = config.num_layers
    if num_stages < 1:
        raise ValueError(f"stages={num_stages} must be ≥ 1")
    if num_stages > num_layers + 2:
        raise ValueError(
            f"stages={num_stages} exceeds model.num_layers={num_layers} + 2 (the embeddings and the heads "
            f"can have stages of their own): use stages ≤ {num_layers + 2}"
        )
    if num_stages > num_layers and layers_per_stage is None:
        # One encoder layer per stage; the heads (the MLM decoder costs about an encoder layer at
        # the masked positions), then the embeddings, get a stage of their own.
        counts = [1] * num_layers + [0]
        if num_stages == num_layers + 2:
            counts = [0] + counts
        return _bounds_from_counts(counts, num_layers)
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ValueError(
                f"layers_per_stage={counts} has {len(counts)} entries but stages={num_stages}: "
                "give one encoder-layer count per stage"
            )
        if any(c < 1 for c in counts[1:-1]) or min(counts) < 0 or sum(counts) != num_layers:
            raise ValueError(
                f"layers_per_stage={counts} must be positive counts (0 allowed for the first and the "
                f"last stage: embeddings or heads alone) summing to "
                f"model.num_layers={num_layers} (it sums to {sum(counts)}): e.g. "
                f"{_even_counts(num_layers, num_stages)}, or leave it unset to balance by cost"
            )
    else:
        costs = layer_costs(config, seq_len, max_predictions)
        counts = (_v_balanced_counts(costs, num_stages) if v_shape and num_stages % 2 == 0 else None) \
            or _balanced_counts(costs, num_stages)
    return _bounds_from_counts(counts, num_layers)


def _even_counts(num_layers: int, num_stages: int) -> list[int]:
    """An example of valid counts for error messages: as even as possible."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if k < extra else 0) for k in range(num_stages)]
