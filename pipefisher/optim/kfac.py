"""K-FAC for ``nn.Linear`` layers as separately schedulable work units.

Why one module: nearly all of it is one class, :class:`KFACPreconditioner`, whose capture hooks, work-unit
dispatch and step logic share its per-layer state; the arithmetic and one layer's state already live in
``kfac_factors`` and ``kfac_layer``.

Shape legend:
    T   rows (tokens) of one micro-batch: B·S flattened
    I   input features of a layer; Ĩ = I + 1 with the bias column (else Ĩ = I)
    O   output features of a layer

Three modules: :mod:`~pipefisher.optim.kfac_factors`, the arithmetic (factor sums, factored
damping, Cholesky inverses, B⁻¹ G A⁻¹) as pure functions; :mod:`~pipefisher.optim.kfac_layer`,
the state and work units of one layer; this one, the selection of layers, the capture hooks, the
dispatch of work units by layer name and the step logic. :class:`~pipefisher.optim.kfac_driver.KFAC`
puts it in front of a base optimizer for single-process training.

[Note: work units] (DESIGN.md, "K-FAC for a Linear layer")
PipeFisher runs K-FAC's extra work in pipeline bubbles, so every piece is a method callable on its
own, per layer, in this order within one refresh:

    capture (hooks: x at F(i) inside ``with pre.micro_batch(i)``, g when B(i) reaches the layer)
      └─ curvature_a(name, i) after F(i)   curvature_b(name, i) after B(i)   (any interleaving)
           └─ factor_tensors(name) → all-reduce (sum) over replicas → finish_sync(name, world)
                └─ update_factors(name)          (running average, once all micro-batches are in)
                     └─ invert(name)             (λ_A and λ_B from BOTH traces, then both inverses)
                          └─ precondition(name)  (every step, after the gradient all-reduce)

Captured tensors are freed by the curvature unit that consumes them; factors are never zeroed or
freed by an inversion, so the partner factor's trace is always available (the reference defect).
``factor_tensors``/``finish_sync`` are optional (single process); without them ``update_factors``
averages over this process's rows only.

[Note: gradient scale]
The runtime backpropagates ``loss_scale · loss_mb`` per micro-batch (``loss_scale`` = 1/(N·W) in the
pipeline, 1/N with plain accumulation), and ``loss_mb`` is a mean over the micro-batch, so the
captured output gradient is g_t = (loss_scale / T)·∇_t ℓ for a loss ℓ averaged over the T rows.
We rescale it, g̃_t = g_t · T / loss_scale, and define B = (1/T_total) Σ_t g̃_t g̃_tᵀ: the
(empirical) Fisher of the per-row loss, independent of N, W and T, so the damping λ means the same
whatever the batch layout. For BERT the micro-batch loss is a mean over masked slots plus a mean
over sequences, not over the B·S rows; the rescale is then a fixed constant per run (B, S fixed),
which only sets the scale against which λ is read. A = (1/T_total) Σ_t x̃_t x̃_tᵀ likewise.
The preconditioned gradient B⁻¹ ∇W A⁻¹ then approximates F⁻¹ of the accumulated (mean) gradient.

[Note: replicas]
``factor_tensors`` turns this process's sums into means over its own rows; the all-reduce sums the
W replicas' means and ``finish_sync`` divides by W. This is the mean over all rows because every
replica processes the same number of equally shaped micro-batches.

[Note: running average]
At the k-th update, F ← decay·F + (1 − decay)·F_batch, except the first update, which takes
F_batch as it is (no bias toward zero). ``factor_decay = 0`` uses only the latest refresh.

[Note: staleness]
With ``curvature_interval = inverse_interval = k`` the factors are captured and inverted at steps
0, k, 2k, …, and step t is preconditioned with the inverses of the refresh at step k·⌊t/k⌋, i.e.
up to k − 1 steps old. In general step t uses the inverses computed at the last inverse step
≤ t, from the factors of the last curvature step ≤ that one. PipeFisher spreads one refresh over
the bubbles of k steps; then the runtime calls the work units itself, and step t uses the
inverses of the last refresh whose ``invert`` ran before t's optimizer step.

[Note: capture]
While capture is on, a forward hook on each layer, inside ``with pre.micro_batch(i)``, keeps the
layer input x of micro-batch i and registers a hook on the layer output tensor that keeps its
gradient g when the backward reaches it. The micro-batch is bound at forward time, so the backward
needs no context, and x and g always come from the same forward. (A tensor hook rather than
``register_full_backward_hook``: a full backward hook wraps every forward's inputs and outputs in an
extra autograd node even while capture is off, and warns for layers whose input needs no grad;
the gradient it reports for the output is the same.) With capture off the forward hook returns at
once. Forwards without grad (evaluation) or outside any ``micro_batch`` block capture nothing.

[Note: recomputation]
With activation checkpointing a layer's forward runs again inside its backward. Each micro-batch
is captured once per capture window (``set_capture(True)`` … ``step_curvature_done()``): a
non-reentrant recomputation (``use_reentrant=False``, as ``BertStage`` uses) finds it already
captured and is ignored, even when ``curvature_a`` has consumed x in between, which PipeFisher does
right after F. A reentrant checkpoint runs the first forward without grad, so there the capture
happens during the recomputation: enter ``micro_batch(i)`` around the backward too.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from pipefisher.optim.kfac_factors import INVERSE_PRECISIONS
from pipefisher.optim.kfac_layer import LinearKFAC

__all__ = ["ENCODER_LINEAR_PATTERN", "KFACPreconditioner", "select_linears"]

logger = logging.getLogger(__name__)

#: The encoder's Linear layers (those the reference work preconditions), by Hugging Face name.
ENCODER_LINEAR_PATTERN = (
    r"(?:^|\.)encoder\.layer\.\d+\."
    r"(?:attention\.self\.(?:query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)$"
)

_SEP = "/"  # state-dict keys are "<layer name>/<entry>": layer names contain dots


def select_linears(
    module: nn.Module, include: str | Sequence[str] | None = ENCODER_LINEAR_PATTERN
) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` submodules of ``module`` to precondition, by qualified name.

    Args:
        module: the model or pipeline stage.
        include: a regular expression searched in each Linear's name (default: the six Linear
            layers of every encoder block); a list of exact names; or ``None`` for every Linear.

    Returns:
        ``{name: linear}`` in module order.

    Raises:
        ValueError: a listed name is not a Linear of ``module``.
    """
    linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    if include is None:
        return linears
    if isinstance(include, str):
        pattern = re.compile(include)
        return {n: m for n, m in linears.items() if pattern.search(n)}
    missing = [n for n in include if n not in linears]
    if missing:
        raise ValueError(
            f"select_linears: {missing} are not nn.Linear modules of the model; Linear names: {list(linears)[:20]}"
        )
    return {n: linears[n] for n in include}


class KFACPreconditioner:
    """K-FAC factors, inverses and preconditioning for a set of Linear layers, as work units.

    See the module notes for the order of the units, the gradient scale, replicas, the running
    average, staleness, capture and recomputation.

    Args:
        named_linears: ``{name: nn.Linear}``, or a module whose Linear layers are selected by
            ``include`` (see :func:`select_linears`).
        damping: λ > 0, split between the factors by π (DESIGN.md "K-FAC for a Linear layer").
        factor_decay: running-average decay in [0, 1); 0 uses only the latest refresh.
        curvature_interval: capture curvature on steps that are multiples of this (≥ 1).
        inverse_interval: recompute the inverses on steps that are multiples of this (≥ 1).
        include: selection when ``named_linears`` is a module.
        loss_scale: the factor each micro-batch loss is multiplied by before backward (1/(N·W)
            in the pipeline runtime, 1/N with plain accumulation); see [Note: gradient scale].
        factor_dtype: dtype of factors and inverses (float32; float64 for exact tests).
        inverse_dtype: working precision of the inversions (``optimizer.inverse_dtype``): float32
            (the factor's dtype, float32 at least; the default, as in ASDL), float64, or auto
            (float64 up to ``FP64_MAX_DIM`` wide); see ``kfac_factors`` [Note: inversion precision].
        warn_if_empty: log a warning when no Linear layer is selected (a selection that matches nothing);
            False where an empty selection is expected (a pipeline stage holding only the embeddings or the
            heads).

    Raises:
        ValueError: a hyper-parameter out of range or unknown ``inverse_dtype``, or a given module
            is not ``nn.Linear``.
    """

    def __init__(
        self,
        named_linears: Mapping[str, nn.Linear] | nn.Module,
        damping: float = 1e-3,
        factor_decay: float = 0.95,
        curvature_interval: int = 1,
        inverse_interval: int = 1,
        *,
        include: str | Sequence[str] | None = ENCODER_LINEAR_PATTERN,
        loss_scale: float = 1.0,
        factor_dtype: torch.dtype = torch.float32,
        inverse_dtype: str = "float32",
        warn_if_empty: bool = True,
    ) -> None:
        if not damping > 0.0:
            raise ValueError(f"KFACPreconditioner: damping={damping} must be > 0")
        if not 0.0 <= factor_decay < 1.0:
            raise ValueError(f"KFACPreconditioner: factor_decay={factor_decay} must lie in [0, 1)")
        for key, value in (("curvature_interval", curvature_interval), ("inverse_interval", inverse_interval)):
            if int(value) != value or value < 1:
                raise ValueError(f"KFACPreconditioner: {key}={value} must be an integer >= 1")
        if not loss_scale > 0.0:
            raise ValueError(f"KFACPreconditioner: loss_scale={loss_scale} must be > 0")
        if inverse_dtype not in INVERSE_PRECISIONS:
            raise ValueError(
                f"KFACPreconditioner: inverse_dtype={inverse_dtype!r}; use one of {', '.join(INVERSE_PRECISIONS)}"
            )
        if inverse_interval % curvature_interval != 0:
            logger.warning(
                "K-FAC: inverse_interval=%d is not a multiple of curvature_interval=%d; some "
                "inversions will reuse unchanged factors",
                inverse_interval,
                curvature_interval,
            )
        if isinstance(named_linears, nn.Module):
            linears = select_linears(named_linears, include)
        else:
            linears = dict(named_linears)
        for name, m in linears.items():
            if not isinstance(m, nn.Linear):
                raise ValueError(f"KFACPreconditioner: {name!r} is a {type(m).__name__}, not nn.Linear")
        if not linears and warn_if_empty:
            logger.warning("K-FAC: no Linear layer selected (include=%r); preconditioning is a no-op", include)
        self.damping = float(damping)
        self.factor_decay = float(factor_decay)
        self.curvature_interval = int(curvature_interval)
        self.inverse_interval = int(inverse_interval)
        self.factor_dtype = factor_dtype
        self._loss_scale = float(loss_scale)
        self.last_refresh_step: int | None = None  # step whose captures fed the latest update
        self.last_inverse_step: int | None = None  # step at which the inverses in use were made
        self._layers = {n: self._new_layer(n, m, float(loss_scale), factor_dtype, inverse_dtype) for n, m in linears.items()}
        self._capturing = False
        self._capture_names: set[str] = set(self._layers)
        self._micro_batch: int | None = None
        self._handles = [layer.module.register_forward_hook(self._hook(layer)) for layer in self._layers.values()]

    def _new_layer(self, name: str, module: nn.Linear, loss_scale: float, factor_dtype: torch.dtype,
                   inverse_dtype: str) -> LinearKFAC:
        """The per-layer state (a subclass's preconditioner, e.g. ``EKFACPreconditioner``, makes its own)."""
        return LinearKFAC(name, module, loss_scale, factor_dtype, inverse_dtype)

    @property
    def layer_names(self) -> list[str]:
        """Names of the preconditioned layers, in module order."""
        return list(self._layers)

    @property
    def loss_scale(self) -> float:
        """See [Note: gradient scale]; settable (e.g. when the micro-batch count changes)."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        if not value > 0.0:
            raise ValueError(f"KFACPreconditioner: loss_scale={value} must be > 0")
        self._loss_scale = float(value)
        for layer in self._layers.values():
            layer.loss_scale = self._loss_scale

    def layer(self, name: str) -> LinearKFAC:
        """The state of layer ``name`` (factors ``a``, ``b``, inverses ``a_inv``, ``b_inv``, ``damping``).

        Raises:
            ValueError: unknown name (the message lists the layers).
        """
        try:
            return self._layers[name]
        except KeyError:
            raise ValueError(f"K-FAC: unknown layer {name!r}; layers: {self.layer_names}") from None

    # -- capture ---------------------------------------------------------------------------------

    @property
    def capturing(self) -> bool:
        """Whether the hooks currently record inputs and output gradients."""
        return self._capturing

    def set_capture(self, enabled: bool, names: Iterable[str] | None = None) -> None:
        """Turn curvature capture on or off (off: the forward hooks return at once).

        Turning it on opens a new capture window: each micro-batch is captured once per window
        (see [Note: recomputation]). ``names`` limits the capture to those layers (a PipeFisher
        phase may compute the curvature of some layers only); None captures every layer.
        """
        self._capture_names = set(self._layers) if names is None else {self.layer(n).name for n in names}
        if enabled:
            for name in self._capture_names:
                self._layers[name].open_window()
        self._capturing = bool(enabled) and bool(self._capture_names)

    @contextlib.contextmanager
    def micro_batch(self, index: int) -> Iterator[None]:
        """Files what the hooks capture inside the block under micro-batch ``index``.

        Enter it around the forward of the micro-batch (and around its backward too, so that a
        reentrant-checkpoint recomputation is captured; see [Note: recomputation]).
        """
        previous, self._micro_batch = self._micro_batch, int(index)
        try:
            yield
        finally:
            self._micro_batch = previous

    def _hook(self, layer: LinearKFAC) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if not self._capturing or self._micro_batch is None or layer.name not in self._capture_names:
                return
            if not torch.is_grad_enabled() or not output.requires_grad:
                return
            layer.capture(self._micro_batch, inputs[0], output)

        return hook

    def captured_micro_batches(self, name: str) -> tuple[list[int], list[int]]:
        """Micro-batches of layer ``name`` with a captured input / gradient not yet consumed."""
        layer = self.layer(name)
        return sorted(layer.xs), sorted(layer.gs)

    def remove_hooks(self) -> None:
        """Detach the hooks from the modules (the state stays)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- work units (each callable on its own; see [Note: work units]) ---------------------------

    def curvature_a(self, name: str, micro_batch: int) -> None:
        """Add Σ x̃ x̃ᵀ of ``micro_batch``'s captured input to layer ``name``'s A sum; free the input.

        Raises:
            ValueError: nothing captured for that micro-batch (curvature scheduled before its F).
        """
        self.layer(name).curvature_a(micro_batch)

    def curvature_b(self, name: str, micro_batch: int) -> None:
        """Add Σ g̃ g̃ᵀ of ``micro_batch``'s captured output gradient to the B sum; free it.

        Raises:
            ValueError: nothing captured for that micro-batch (curvature scheduled before its B).
        """
        self.layer(name).curvature_b(micro_batch)

    def factor_tensors(self, name: str) -> list[Tensor]:
        """This refresh's estimates [A_batch [Ĩ, Ĩ], B_batch [O, O]], to all-reduce (sum) in place.

        They are means over this process's rows; after the all-reduce over the replicas (any
        process group) call :meth:`finish_sync` with the group size (see [Note: replicas]).
        """
        return self.layer(name).factor_tensors()

    def finish_sync(self, name: str, world: int) -> None:
        """Divide layer ``name``'s all-reduced (summed) estimates by the replica count ``world``."""
        self.layer(name).finish_sync(world)

    def update_factors(self, name: str, step: int | None = None) -> None:
        """Fold this refresh's estimates into layer ``name``'s running averages A, B.

        ``step``: the step whose capture they came from (see :meth:`curvature_age`).
        """
        self.layer(name).update_factors(self.factor_decay, step)

    def invert(self, name: str, deferred: bool = False) -> None:
        """Both damped inverses of layer ``name`` in one unit, λ_A and λ_B from both traces.

        With ``deferred`` they are put in use only by :meth:`promote_inverses` (PipeFisher: the
        inverses of one refresh cycle are used from the next cycle on).

        Raises:
            ValueError: the layer has no factors yet.
        """
        self.layer(name).invert(self.damping, deferred)

    def promote_inverses(self, first_only: bool = False) -> int:
        """Put every layer's deferred inverses in use; returns how many layers had some.

        ``first_only``: only layers that have no inverses in use yet (their first refresh: there
        is nothing older to keep, so K-FAC acts from the step after its first inversion).
        """
        return sum(layer.promote() for layer in self._layers.values() if not first_only or not layer.ready)

    def precondition(self, name: str) -> bool:
        """Replace layer ``name``'s ``W.grad`` (and ``b.grad``) by (B + λ_B I)⁻¹ ∇ (A + λ_A I)⁻¹.

        Returns:
            False (gradients untouched) when the layer has no inverses yet or no gradient.
        """
        return self.layer(name).precondition()

    # -- the same over all layers ----------------------------------------------------------------

    def curvature_all(self) -> None:
        """curvature_a / curvature_b for every captured micro-batch of every layer."""
        for layer in self._layers.values():
            for mb in sorted(layer.xs):
                layer.curvature_a(mb)
            for mb in sorted(layer.gs):
                layer.curvature_b(mb)

    def update_all(self, step: int | None = None) -> list[str]:
        """update_factors for every layer with a refresh's curvature waiting; returns their names."""
        done = [n for n, layer in self._layers.items() if layer.has_curvature()]
        for name in done:
            self.update_factors(name, step)
        return done

    def invert_all(self) -> int:
        """invert every layer that has factors; returns how many were inverted."""
        names = [n for n, layer in self._layers.items() if layer.a is not None]
        for name in names:
            self.invert(name)
        return len(names)

    def precondition_all(self) -> int:
        """precondition every layer; returns how many were preconditioned."""
        return sum(layer.precondition() for layer in self._layers.values())

    def step_curvature_done(self) -> None:
        """End this step's capture: turn it off and check that every capture was consumed.

        Raises:
            RuntimeError: captured tensors were never consumed by a curvature unit (a schedule
                missing curvature work); they are freed before raising.
        """
        self._capturing = False
        left = {n: self.captured_micro_batches(n) for n, layer in self._layers.items() if layer.xs or layer.gs}
        for layer in self._layers.values():
            layer.clear_captures()
        if left:
            raise RuntimeError(f"K-FAC: captures never consumed by curvature work, layer: ([x mbs], [g mbs]): {left}")

    # -- single-process step logic ---------------------------------------------------------------

    def is_curvature_step(self, step: int) -> bool:
        """Whether ``step`` captures curvature (a multiple of ``curvature_interval``)."""
        return step % self.curvature_interval == 0

    def is_inverse_step(self, step: int) -> bool:
        """Whether ``step`` recomputes the inverses (a multiple of ``inverse_interval``)."""
        return step % self.inverse_interval == 0

    def on_step_start(self, step: int) -> None:
        """Capture this step's micro-batches iff it is a curvature step."""
        self.forget_raw_norms()
        self.set_capture(self.is_curvature_step(step))

    def refresh_and_precondition(self, step: int) -> None:
        """After the backward of all micro-batches of ``step``: all of K-FAC's work, in order.

        Curvature for every captured micro-batch → factor update → inversion when ``step`` is an
        inverse step → preconditioning of every layer (see [Note: staleness]).

        Raises:
            RuntimeError: capture was on but nothing was captured (forwards ran outside
                :meth:`micro_batch`).
        """
        if self._capturing and self._layers and not any(layer.seen for layer in self._layers.values()):
            raise RuntimeError(
                f"K-FAC: step {step} captures curvature but no layer recorded anything: run each "
                "micro-batch's forward inside `with preconditioner.micro_batch(i)`, with grad enabled"
            )
        self.curvature_all()
        if self.update_all(step):
            self.last_refresh_step = step
        self.step_curvature_done()
        if self.is_inverse_step(step) and self.invert_all():
            self.last_inverse_step = step
        self.precondition_all()

    # -- what the step used -----------------------------------------------------------------------

    def curvature_age(self, step: int) -> int | None:
        """Steps since the curvature behind the inverses in use was captured, the maximum over
        layers (``step`` − capture step); None while no layer has inverses.

        [Note: curvature age] With deferred inverses and a refresh every k steps, the inverses
        used in cycle c+1 come from a capture in cycle c, so the age reaches 2k − 1 (a capture in
        the cycle's first step, used until the last step of the next cycle); without deferral it
        is at most k − 1.
        """
        ages = [step - layer.inverse_step for layer in self._layers.values() if layer.inverse_step is not None]
        return max(ages) if ages else None

    def raw_grad_sq(self) -> dict[int, Tensor]:
        """``{id(param): ‖grad‖² before preconditioning}`` for the layers preconditioned since the
        last :meth:`forget_raw_norms`: a layer's weight carries ‖∇W‖² + ‖∇b‖², its bias 0.

        The runtime clips by the global norm of the gradient as it was before preconditioning
        (``optimizer.clip_before_precondition``); see ``pipefisher.optim.nvlamb`` [Note: the global norm].
        """
        out: dict[int, Tensor] = {}
        for layer in self._layers.values():
            if layer.raw_grad_sq is not None:
                out[id(layer.module.weight)] = layer.raw_grad_sq
                if layer.module.bias is not None:
                    out[id(layer.module.bias)] = torch.zeros_like(layer.raw_grad_sq)
        return out

    def forget_raw_norms(self) -> None:
        """Drop the raw gradient norms of the last preconditioning (call at each step's start)."""
        for layer in self._layers.values():
            layer.forget_raw_norm()

    def parameter_ids(self) -> set[int]:
        """``id`` of every weight and bias of the preconditioned layers."""
        return {id(p) for layer in self._layers.values() for p in layer.module.parameters()}

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Tensor]:
        """Factors, inverses, damping split and update counts as a flat dict of tensors.

        Keys are ``"<layer>/<entry>"`` with entries ``A``, ``B``, ``A_inv``, ``B_inv``,
        ``damping`` ([2] float64: λ_A, λ_B) and ``num_updates`` (0-d int64); loadable with
        ``torch.load(weights_only=True)``. Curvature captured or summed but not yet folded in by
        :meth:`update_factors` is not saved: save between steps.
        """
        return {f"{n}{_SEP}{k}": t for n, layer in self._layers.items() for k, t in layer.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore :meth:`state_dict` output (tensors moved to each layer's device and dtype).

        Raises:
            ValueError: a key names an unknown layer or entry, or a matrix has the wrong shape.
        """
        per_layer: dict[str, dict[str, Tensor]] = {n: {} for n in self._layers}
        for key, t in state.items():
            name, _, entry = key.rpartition(_SEP)
            if name not in per_layer or entry not in type(self._layers[name]).STATE_ENTRIES:
                raise ValueError(f"K-FAC load_state_dict: unexpected key {key!r}; layers: {self.layer_names}")
            per_layer[name][entry] = t
        for name, layer in self._layers.items():
            layer.load_state_dict(per_layer[name])
