"""Our K-FAC work units against ASDL's (asdfghjkl) on the same model, batch, layers and damping.

    python bench/kfac_vs_asdl.py            # bert-mini, 8 x 128 tokens, 15 rounds: ~1 min
    python bench/kfac_vs_asdl.py --quick    # 4 x 128 tokens, 5 rounds: ~15 s
    python bench/kfac_vs_asdl.py --model small --batch-size 8

One process, fp32 factors, the Linear layers of the encoder (6 per encoder layer; the same
``nn.Linear`` modules for both). ASDL is driven through the path PipeFisher's reference code used:
``asdl.save_inputs_outgrads`` keeps each layer's input and output gradient during forward and
backward, ``OperationContext.calc_cov_kron`` turns them into the Kronecker factors, ``Kron.update_inv``
inverts them (factored damping from both traces, Cholesky) and ``Kron.mvp`` preconditions the gradient.
Ours: ``set_capture`` + ``micro_batch(0)`` around forward and backward, ``curvature_all`` +
``update_all``, ``invert_all``, ``precondition_all``. Timed separately, median over rounds, the two
implementations taking turns (the order swapped every round) so that load from other jobs on the
machine hits both alike:

- ``capture``: forward + backward with the capture hooks on (``fwd+bwd`` alone is the reference);
- ``curvature``: A and B of every layer from the captured batch (ours also normalizes and folds the
  estimate into the running average, which is a copy on the first update; ASDL's factors are scaled
  to the same definition, A = mean of x xᵀ, B = mean of g̃ g̃ᵀ with the per-row gradient g̃). ASDL's
  ``save_inputs`` keeps a layer's [B, S, I] input unflattened, which ``calc_cov_kron`` cannot take,
  so the script flattens it to [T, I] first (a view);
- ``capture + curvature``: ours is the sum of the two rows above; ASDL's is its other path,
  ``asdl.no_centered_cov``, which computes A in the forward hooks and B in the backward hooks;
- ``inversion``: both damped inverses of every layer, damping ``--damping`` split by π, ours with
  its default ``optimizer.inverse_dtype=float32`` (the factor's dtype, as ASDL); the two rows below
  it time ours with ``inverse_dtype=auto`` (float64 up to ``FP64_MAX_DIM`` = 1024 wide: all of
  bert-mini's factors but the 1025-wide A of ``output.dense``) and ``float64``, each beside ASDL's
  same float32 call timed again (ASDL has no float64 path);
- ``precondition``: B⁻¹ G A⁻¹ for every layer (the gradients are restored before each call).

The math is not identical in one place: ours preconditions the bias jointly with the weight through
the homogeneous coordinate (A is (I+1)×(I+1)), ASDL keeps A at I×I and multiplies the bias gradient
by B⁻¹ alone. The script checks that both computed the same factors (A's weight block and B) before
it reports any time.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import types
import warnings
from collections.abc import Callable

import torch
from torch import nn

import _harness as h
from pipefisher.data.synthetic import SyntheticSource
from pipefisher.model import BertConfig, build_full_model
from pipefisher.optim.kfac import KFACPreconditioner, select_linears


def _import_asdl() -> types.ModuleType:
    """asdl, with its NVTX ranges (``torch.cuda.nvtx``) replaced by no-ops for CPU-only torch."""
    with warnings.catch_warnings():  # asdl 0.1a5 calls torch.jit.script at import
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=DeprecationWarning)
        import asdl
        import asdl.operations.operation as operation
        import asdl.symmatrix  # noqa: F401  (Kron)
    operation.nvtx = types.SimpleNamespace(
        range=lambda *a, **k: contextlib.nullcontext(), range_push=lambda *a, **k: None, range_pop=lambda: None)
    return asdl


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Bench:
    """The model, one batch, and both implementations' state over the same ``nn.Linear`` modules."""

    def __init__(self, args: argparse.Namespace, asdl: types.ModuleType) -> None:
        self.asdl = asdl
        config = BertConfig.from_size(args.model, hidden_dropout=0.0, attention_dropout=0.0)  # same x, g for both
        self.model = build_full_model(config, seed=0)
        source = SyntheticSource(args.seq_len, args.max_predictions, config.vocab_size, seed=0)
        self.batch = source.get_samples(range(args.batch_size))
        self.rows = args.batch_size * args.seq_len  # T, tokens of the batch
        self.linears: dict[str, nn.Linear] = select_linears(self.model)
        self.damping = args.damping
        # factor_decay 0: every refresh replaces the factors, so each round times the same work.
        self.ours = KFACPreconditioner(self.linears, damping=args.damping, factor_decay=0.0, loss_scale=1.0)
        self.krons: dict[str, object] = {}
        self.grads: dict[str, torch.Tensor] = {}

    def _loss(self) -> torch.Tensor:
        return self.model(None, self.batch).sum()

    def fwd_bwd(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self._loss().backward()

    # -- ours ------------------------------------------------------------------------------------

    def ours_refresh(self) -> tuple[float, float]:
        """(capture s, curvature s) of one refresh from the batch."""
        self.model.zero_grad(set_to_none=True)
        pre = self.ours

        def capture() -> None:
            pre.set_capture(True)
            with pre.micro_batch(0):
                loss = self._loss()
            loss.backward()

        def curvature() -> None:
            pre.curvature_all()
            pre.update_all()
            pre.step_curvature_done()

        return _timed(capture), _timed(curvature)

    def ours_invert(self, inverse_dtype: str = "float32") -> float:
        """invert_all with ``inverse_dtype`` (float32, our default; auto; float64)."""
        for name in self.linears:
            self.ours.layer(name).inverse_dtype = inverse_dtype
        return _timed(self.ours.invert_all)

    def ours_precondition(self) -> float:
        self._restore_grads()
        return _timed(self.ours.precondition_all)

    # -- asdl ------------------------------------------------------------------------------------

    def asdl_refresh(self) -> tuple[float, float]:
        """(capture s, curvature s); the factors end in ``self.krons`` as ``asdl.symmatrix.Kron``."""
        self.model.zero_grad(set_to_none=True)
        modules = list(self.linears.values())
        kron_cls = self.asdl.symmatrix.Kron
        t = self.rows
        times = []
        start = time.perf_counter()
        with warnings.catch_warnings():  # asdl registers non-full backward hooks
            warnings.filterwarnings("ignore", message=r".*non-full backward hook.*", category=FutureWarning)
            with self.asdl.save_inputs_outgrads(self.model, targets=modules) as cxt:
                self._loss().backward()
                times.append(time.perf_counter() - start)
                start = time.perf_counter()
                for name, m in self.linears.items():
                    # save_inputs keeps the [B, S, I] input as it came (only the fused hooks and the
                    # gradients are flattened); flatten it to the [T, I] rows calc_cov expects (a view).
                    inputs = cxt.in_data(m)
                    inputs[:] = [x.flatten(0, -2) for x in inputs]
                    cxt.calc_cov_kron(m, clear_in_out=True)
                    kron = cxt.cov_kron(m)
                    # Σ x xᵀ → mean over the T rows; Σ g gᵀ of the mean loss's gradient g = g̃ / T
                    # → mean of g̃ g̃ᵀ = T · Σ g gᵀ (our definition, [Note: gradient scale]).
                    self.krons[name] = kron_cls(kron["A"].div_(t), kron["B"].mul_(t))
                times.append(time.perf_counter() - start)
        return times[0], times[1]

    def asdl_fused(self) -> float:
        """Forward + backward computing A in the forward hooks and B in the backward hooks (``no_centered_cov``)."""
        self.model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*non-full backward hook.*", category=FutureWarning)
            with self.asdl.no_centered_cov(self.model, [(m, "kron") for m in self.linears.values()]) as cxt:
                self._loss().backward()
                krons = [cxt.cov_kron(m) for m in self.linears.values()]
        elapsed = time.perf_counter() - start
        assert all(k is not None and "A" in k and "B" in k for k in krons), "ASDL computed no Kronecker factors"
        return elapsed

    def asdl_invert(self) -> float:
        def run() -> None:
            for kron in self.krons.values():
                kron.update_inv(self.damping)

        return _timed(run)

    def asdl_precondition(self) -> float:
        self._restore_grads()

        def run() -> None:
            for name, m in self.linears.items():
                self.krons[name].mvp(vec_weight=m.weight.grad, vec_bias=m.bias.grad, use_inv=True, inplace=True)

        return _timed(run)

    # -- shared ----------------------------------------------------------------------------------

    def save_grads(self) -> None:
        self.fwd_bwd()
        self.grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def _restore_grads(self) -> None:
        for n, p in self.model.named_parameters():
            if n in self.grads:
                p.grad.copy_(self.grads[n])

    def check_same_factors(self) -> float:
        """Largest relative difference between our factors and ASDL's (A's weight block, B).

        Raises:
            AssertionError: they differ beyond float32 rounding: the two sides would not time the same work.
        """
        worst = 0.0
        for name in self.linears:
            ours = self.ours.layer(name)
            theirs = self.krons[name]
            for a, b in ((ours.a[:-1, :-1], theirs.A), (ours.b, theirs.B)):
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
        assert worst < 1e-3, f"our factors and ASDL's differ (max relative difference {worst:.2e})"
        return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 4, 5 rounds")
    p.add_argument("--model", default="mini", help="BERT size (default mini)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences in the batch (default 8)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=20)
    p.add_argument("--damping", type=float, default=1e-3)
    p.add_argument("--rounds", type=int, default=15, help="timed rounds after 2 warm-up rounds")
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.rounds = 4, 5

    torch.set_num_threads(h.cores())
    asdl = _import_asdl()
    b = _Bench(args, asdl)
    b.save_grads()
    inversions = {"inversion": "float32",
                  "inversion, ours inverse_dtype=auto (fp64 up to 1024 wide)": "auto",
                  "inversion, ours inverse_dtype=float64": "float64"}
    names = ("fwd+bwd", "capture", "curvature", "capture + curvature (ASDL: fused hooks)", *inversions,
             "precondition")
    times: dict[tuple[str, str], list[float]] = {(n, impl): [] for n in names for impl in ("ours", "asdl")}
    check = None
    for r in range(args.rounds + 2):
        order = ("ours", "asdl") if r % 2 == 0 else ("asdl", "ours")
        got: dict[tuple[str, str], float] = {}
        got[("fwd+bwd", "ours")] = got[("fwd+bwd", "asdl")] = _timed(b.fwd_bwd)
        for impl in order:
            got[("capture", impl)], got[("curvature", impl)] = b.ours_refresh() if impl == "ours" else b.asdl_refresh()
        got[(names[3], "asdl")] = b.asdl_fused()
        got[(names[3], "ours")] = got[("capture", "ours")] + got[("curvature", "ours")]
        if check is None:
            check = b.check_same_factors()
        for row, inverse_dtype in inversions.items():  # ASDL has no fp64 path: its fp32 call beside each of ours
            for impl in order:
                got[(row, impl)] = b.ours_invert(inverse_dtype) if impl == "ours" else b.asdl_invert()
        for impl in order:
            got[("precondition", impl)] = b.ours_precondition() if impl == "ours" else b.asdl_precondition()
        if r >= 2:  # warm-up rounds are not counted
            for key, value in got.items():
                times[key].append(value)

    med = {key: h.median(v) * 1e3 for key, v in times.items()}
    rows = [["fwd+bwd (no K-FAC, reference)", med[("fwd+bwd", "ours")], "-", "-"]]
    for n in names[1:]:
        rows.append([n, med[(n, "ours")], med[(n, "asdl")], med[(n, "ours")] / med[(n, "asdl")]])
    total = {impl: med[("capture", impl)] - med[("fwd+bwd", impl)] + sum(
        med[(n, impl)] for n in ("curvature", "inversion", "precondition")) for impl in ("ours", "asdl")}
    rows.append(["one refresh: (capture − fwd+bwd) + curvature + inversion + precondition",
                 total["ours"], total["asdl"], total["ours"] / total["asdl"]])
    print(f"bert-{args.model}, batch {args.batch_size} x {args.seq_len} = {b.rows} tokens, {len(b.linears)} encoder "
          f"Linear layers, damping {args.damping:g}, fp32 factors (ours inverted in fp32 unless a row says so), "
          f"{torch.get_num_threads()} threads; "
          f"median of {args.rounds} rounds; {h.load()}; factors agree to {check:.1e} (max relative difference)")
    print()
    print(h.table(["unit (all layers)", "ours ms", "ASDL ms", "ours/ASDL"], rows))


if __name__ == "__main__":
    h.main_guard(main)
