"""BERT for pretraining (MLM + NSP) as a sequence of pipeline layers, split into stages.

Why one module: it is one model whose submodules carry Hugging Face's names so that state dicts load
unchanged, and :class:`BertStage` slices that same layer sequence into stages; the layers, the stage and the
state-dict helpers change together.

Shape legend:
    B  micro-batch size (sequences)
    S  sequence length (tokens)
    H  hidden size
    A  attention heads; D = H / A is the head size
    P  masked-LM prediction slots per sequence (max_predictions; 0-padded)
    V  vocabulary size

[Note: pipeline layers]
The model is the sequence of L + 2 *pipeline layers*

    index:  0            1 .. L                         L + 1
            embeddings | encoder layer 0 .. L-1       | heads (pooler, NSP, MLM)

A ``BertStage(config, first_layer, last_layer)`` holds pipeline layers ``first_layer`` through
``last_layer``, **both inclusive**; ``build_full_model`` is ``BertStage(config, 0, L + 1)``.
Pipeline layer ``j`` in 1..L is encoder layer ``j - 1``, and it is stored under its Hugging Face
name ``bert.encoder.layer.{j-1}`` whichever stage holds it, so every stage's parameter names are a
subset of ``transformers.BertForPreTraining``'s and stage state dicts merge by plain union.

[Note: initialization independent of the split]
Each pipeline layer draws its initial weights from its own generator seeded by (seed, pipeline
layer index), never from the global RNG. Stages built on different processes, in any order,
therefore hold exactly the weights of the full model. The MLM decoder is tied to the word
embeddings (Devlin et al. 2019); a last stage without the embeddings owns a copy, initialized
from the embeddings' generator (its first draw), so both copies start equal. The runtime keeps
them equal by summing their gradients (``BertStage.tied_parameter_name``), DESIGN.md "Schedules".

[Note: MLM head at masked positions only]
The H x V decoder applied to all S tokens costs about ten encoder layers (DESIGN.md, "Where
BERT's compute is"), so, as in NVIDIA's implementation, the last stage gathers the P masked
positions first and runs the MLM head on [B, P, H] only. NVIDIA's data pads
``masked_lm_positions`` and ``masked_lm_ids`` with 0; a slot counts as padding when its
``masked_lm_ids`` is 0 (id 0 is [PAD], never a prediction target). The MLM loss is the
cross-entropy averaged over the real (non-padding) slots of the micro-batch.

[Note: dropout]
Dropout masks are keyed by (seed, pipeline layer, dropout site, step, micro-batch), not drawn from
the process's RNG, so a stage split across workers draws the full model's masks
(``pipefisher.model.rng``, [Note: randomness independent of placement]). Each pipeline layer's
dropout sites are named when the layer is built (``name_dropout_sites``); the trainer sets
(step, micro-batch) with ``dropout_key`` around a forward.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipefisher.model.config import BertConfig
from pipefisher.model.rng import KeyedDropout, current_dropout_key, name_dropout_sites, replay_dropout_key

__all__ = [
    "Batch",
    "BATCH_KEYS",
    "BertStage",
    "build_full_model",
    "pretraining_loss",
    "pretraining_eval_sums",
    "EVAL_SUMS",
    "load_hf_state_dict",
    "merge_stage_state_dicts",
    "WORD_EMBEDDINGS_NAME",
    "DECODER_WEIGHT_NAME",
]

Batch = Mapping[str, Tensor]
"""A micro-batch: ``input_ids`` [B,S], ``segment_ids`` [B,S], ``input_mask`` [B,S] (1 = real
token), ``masked_lm_positions`` [B,P], ``masked_lm_ids`` [B,P] (0 = padding slot),
``next_sentence_labels`` [B] (1 = sentence B is random); all integer tensors."""

BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "segment_ids",
    "input_mask",
    "masked_lm_positions",
    "masked_lm_ids",
    "next_sentence_labels",
)

WORD_EMBEDDINGS_NAME = "bert.embeddings.word_embeddings.weight"
DECODER_WEIGHT_NAME = "cls.predictions.decoder.weight"
_PREDICTIONS_BIAS_NAME = "cls.predictions.bias"
_HF_DECODER_BIAS_NAME = "cls.predictions.decoder.bias"

# Where to look in a Hugging Face state dict when a name is absent: HF ties the decoder to the
# word embeddings and aliases ``cls.predictions.decoder.bias`` to ``cls.predictions.bias``, and
# saved checkpoints may keep only one name of each tied pair.
_HF_FALLBACKS: dict[str, tuple[str, ...]] = {
    DECODER_WEIGHT_NAME: (WORD_EMBEDDINGS_NAME,),
    _PREDICTIONS_BIAS_NAME: (_HF_DECODER_BIAS_NAME,),
}


# --------------------------------------------------------------------------------------------
# Modules (attribute names follow transformers' BertForPreTraining so parameter names match)
# --------------------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        # word_embeddings is registered first: it is the first draw of pipeline layer 0's
        # generator, which the untied decoder copy of a last stage replays.
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = KeyedDropout(config.hidden_dropout)

    def forward(self, input_ids: Tensor, segment_ids: Tensor) -> Tensor:
        """Embed token ids [B,S] and segment ids [B,S] into hidden states [B,S,H]."""
        seq_len = input_ids.size(1)
        positions = torch.arange(seq_len, device=input_ids.device)  # [S]
        hidden = (
            self.word_embeddings(input_ids)  # [B,S,H]
            + self.position_embeddings(positions)[None]  # [1,S,H]
            + self.token_type_embeddings(segment_ids)  # [B,S,H]
        )
        return self.dropout(self.LayerNorm(hidden))


class BertSelfAttention(nn.Module):
    """Multi-head scaled dot-product self-attention (before the output projection)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_size = config.head_size
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = KeyedDropout(config.attention_dropout)

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        """Attend ``hidden`` [B,S,H] over itself; ``additive_mask`` [B,1,1,S]; returns [B,S,H]."""
        b, s, _ = hidden.shape

        def heads(x: Tensor) -> Tensor:  # [B,S,H] -> [B,A,S,D]; under tp the local A/tp heads, [B,S,H/tp] in
            return x.view(b, s, -1, self.head_size).transpose(1, 2)

        q, k, v = heads(self.query(hidden)), heads(self.key(hidden)), heads(self.value(hidden))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_size)  # [B,A,S,S]
        probs = self.dropout(torch.softmax(scores + additive_mask, dim=-1))  # [B,A,S,S]
        context = probs @ v  # [B,A,S,D]
        return context.transpose(1, 2).reshape(b, s, -1)  # [B,S,H] ([B,S,H/tp] under tp: runtime.tensor_parallel)


class BertSelfOutput(nn.Module):
    """Attention output projection, dropout, residual, LayerNorm (post-LN)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = KeyedDropout(config.hidden_dropout)

    def forward(self, context: Tensor, residual: Tensor) -> Tensor:
        """[B,S,H], [B,S,H] -> [B,S,H]."""
        return self.LayerNorm(self.dropout(self.dense(context)) + residual)


class BertAttention(nn.Module):
    """Self-attention sub-layer."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        """[B,S,H] -> [B,S,H]."""
        return self.output(self.self(hidden, additive_mask), hidden)


class BertIntermediate(nn.Module):
    """FFN up-projection H -> 4H with exact (erf) GELU."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        assert config.intermediate_size is not None  # filled in by BertConfig.__post_init__
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """[B,S,H] -> [B,S,4H]."""
        return F.gelu(self.dense(hidden))


class BertOutput(nn.Module):
    """FFN down-projection 4H -> H, dropout, residual, LayerNorm (post-LN)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        assert config.intermediate_size is not None
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = KeyedDropout(config.hidden_dropout)

    def forward(self, inner: Tensor, residual: Tensor) -> Tensor:
        """[B,S,4H], [B,S,H] -> [B,S,H]."""
        return self.LayerNorm(self.dropout(self.dense(inner)) + residual)


class BertLayer(nn.Module):
    """One encoder layer: self-attention sub-layer then FFN sub-layer, each post-LN."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden: Tensor, additive_mask: Tensor) -> Tensor:
        """[B,S,H] -> [B,S,H]; ``additive_mask`` [B,1,1,S]."""
        attended = self.attention(hidden, additive_mask)
        return self.output(self.intermediate(attended), attended)


class BertPooler(nn.Module):
    """tanh(dense(hidden of the first token, [CLS]))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """[B,S,H] -> [B,H]."""
        return torch.tanh(self.dense(hidden[:, 0]))


class BertPredictionHeadTransform(nn.Module):
    """MLM transform: dense, exact GELU, LayerNorm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., H] -> [..., H]."""
        return self.LayerNorm(F.gelu(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    """MLM head: transform, then the decoder H -> V (weight tied to word embeddings) plus bias."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor) -> Tensor:
        """[B,P,H] -> logits [B,P,V]."""
        return self.decoder(self.transform(hidden)) + self.bias


class BertPreTrainingHeads(nn.Module):
    """``cls``: the MLM head (``predictions``) and the NSP classifier (``seq_relationship``)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class _BertEncoder(nn.Module):
    """``bert.encoder``: the encoder layers this stage holds, keyed by encoder index ("0".."L-1")."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleDict()


class _BertBody(nn.Module):
    """``bert``: the parts of the HF ``BertModel`` this stage holds (absent parts are ``None``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings: BertEmbeddings | None = None
        self.encoder = _BertEncoder()
        self.pooler: BertPooler | None = None


# --------------------------------------------------------------------------------------------
# Initialization
# --------------------------------------------------------------------------------------------


def _layer_generator(seed: int, pipeline_layer: int) -> torch.Generator:
    """A CPU generator seeded by (seed, pipeline layer index) only: see [Note: initialization]."""
    digest = hashlib.sha256(f"pipefisher-bert:{seed}:{pipeline_layer}".encode()).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return generator


@torch.no_grad()
def _init_modules(modules: Sequence[nn.Module], generator: torch.Generator, std: float) -> None:
    """BERT init in registration order: normal(0, std) weights, zero biases, unit LayerNorms."""
    for root in modules:
        for module in root.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()


# --------------------------------------------------------------------------------------------
# Stage
# --------------------------------------------------------------------------------------------


def pretraining_loss(mlm_logits: Tensor, nsp_logits: Tensor, batch: Batch) -> Tensor:
    """MLM and NSP cross-entropy of one micro-batch.

    Args:
        mlm_logits: [B,P,V] logits at the masked slots.
        nsp_logits: [B,2] next-sentence logits.
        batch: the micro-batch (uses ``masked_lm_ids`` [B,P] and ``next_sentence_labels`` [B]).

    Returns:
        ``torch.stack([mlm_loss, nsp_loss])`` [2], fp32. ``mlm_loss`` averages over the slots
        whose ``masked_lm_ids`` != 0 (0 marks NVIDIA's padding; 0 when no slot is real);
        ``nsp_loss`` averages over the B sequences. The training loss is the sum.
    """
    labels = batch["masked_lm_ids"].long()  # [B,P]
    vocab = mlm_logits.size(-1)
    mlm_sum = F.cross_entropy(
        mlm_logits.reshape(-1, vocab).float(), labels.reshape(-1), ignore_index=0, reduction="sum"
    )
    num_real = (labels != 0).sum().clamp(min=1)
    mlm_loss = mlm_sum / num_real
    nsp_loss = F.cross_entropy(nsp_logits.float(), batch["next_sentence_labels"].long())
    return torch.stack([mlm_loss, nsp_loss])


#: The sums :func:`pretraining_eval_sums` returns, in order.
EVAL_SUMS = ("mlm_loss_sum", "mlm_correct", "mlm_count", "nsp_loss_sum", "nsp_correct", "nsp_count")


def pretraining_eval_sums(mlm_logits: Tensor, nsp_logits: Tensor, batch: Batch) -> Tensor:
    """Held-out evaluation sums of one micro-batch (to be added up over micro-batches and workers).

    Returns:
        [6] float64, in the order of :data:`EVAL_SUMS`: the summed MLM cross-entropy over the real
        masked slots (``masked_lm_ids`` != 0), how many of them the argmax predicts right, their
        count; the summed NSP cross-entropy, the right NSP predictions and the sequence count.
    """
    labels = batch["masked_lm_ids"].long()  # [B,P]
    vocab = mlm_logits.size(-1)
    flat = mlm_logits.reshape(-1, vocab).float()
    real = labels.reshape(-1) != 0
    mlm_sum = F.cross_entropy(flat, labels.reshape(-1), ignore_index=0, reduction="sum")
    mlm_correct = ((flat.argmax(-1) == labels.reshape(-1)) & real).sum()
    nsp_labels = batch["next_sentence_labels"].long()
    nsp_sum = F.cross_entropy(nsp_logits.float(), nsp_labels, reduction="sum")
    nsp_correct = (nsp_logits.argmax(-1) == nsp_labels).sum()
    return torch.stack([mlm_sum.double(), mlm_correct.double(), real.sum().double(),
                        nsp_sum.double(), nsp_correct.double(), torch.tensor(float(nsp_labels.numel()),
                                                                             dtype=torch.float64,
                                                                             device=nsp_labels.device)])


class BertStage(nn.Module):
    """A contiguous slice of BERT's pipeline layers, with Hugging Face parameter names.

    Pipeline layers: 0 = embeddings, 1..L = encoder layers 0..L-1, L+1 = heads; the stage holds
    ``first_layer`` through ``last_layer`` inclusive (see [Note: pipeline layers] above).

    Args:
        config: the architecture.
        first_layer: first pipeline layer held (0 = embeddings).
        last_layer: last pipeline layer held, inclusive (L + 1 = heads).
        seed: initialization seed; every stage built with the same seed holds exactly the
            weights of ``build_full_model(config, seed)`` restricted to its layers.
        recompute: in training (grad enabled, ``self.training``), run each encoder layer under
            ``torch.utils.checkpoint`` (non-reentrant) to keep only its input alive; the
            dropout key (or, outside one, the RNG state) is replayed, so dropout and the
            numerics are unchanged.

    Raises:
        ValueError: the slice is empty or outside 0..L+1.
    """

    def __init__(
        self,
        config: BertConfig,
        first_layer: int,
        last_layer: int,
        seed: int = 0,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        top = config.num_pipeline_layers - 1
        if not 0 <= first_layer <= last_layer <= top:
            raise ValueError(
                f"stage layers first_layer={first_layer}, last_layer={last_layer} are not a "
                f"non-empty slice of the pipeline layers 0..{top} (0 = embeddings, "
                f"1..{config.num_layers} = encoder layers, {top} = heads; last_layer is inclusive)"
            )
        self.config = config
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.seed = seed
        self.recompute = recompute
        std = config.initializer_range

        self.bert = _BertBody()
        self.cls: BertPreTrainingHeads | None = None
        if self.has_embeddings:
            self.bert.embeddings = BertEmbeddings(config)
            _init_modules([self.bert.embeddings], _layer_generator(seed, 0), std)
            name_dropout_sites(self.bert.embeddings, seed, 0)
        for index in self.encoder_layer_indices:
            layer = BertLayer(config)
            _init_modules([layer], _layer_generator(seed, index + 1), std)
            name_dropout_sites(layer, seed, index + 1)
            self.bert.encoder.layer[str(index)] = layer
        if self.has_heads:
            self.bert.pooler = BertPooler(config)
            self.cls = BertPreTrainingHeads(config)
            predictions = self.cls.predictions
            _init_modules(
                [self.bert.pooler, predictions.transform, self.cls.seq_relationship],
                _layer_generator(seed, top),
                std,
            )
            if self.bert.embeddings is not None:
                predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
            else:
                # Replay the first draw of pipeline layer 0's generator: the word embeddings.
                with torch.no_grad():
                    predictions.decoder.weight.normal_(
                        0.0, std, generator=_layer_generator(seed, 0)
                    )

    # ---- what the stage holds ----------------------------------------------------------------

    @property
    def has_embeddings(self) -> bool:
        """Whether this stage holds pipeline layer 0 (and so embeds the batch itself)."""
        return self.first_layer == 0

    @property
    def has_heads(self) -> bool:
        """Whether this stage holds the last pipeline layer (pooler, NSP, MLM) and returns losses."""
        return self.last_layer == self.config.num_pipeline_layers - 1

    @property
    def encoder_layer_indices(self) -> range:
        """Encoder layer indices (0..L-1, the keys of ``bert.encoder.layer``) held by this stage."""
        start = max(self.first_layer, 1) - 1
        stop = min(self.last_layer, self.config.num_layers)
        return range(start, stop)

    @property
    def tied_parameter_name(self) -> str | None:
        """Name of this stage's copy of the word-embedding / MLM-decoder weight, if untied here.

        ``"bert.embeddings.word_embeddings.weight"`` on a first stage without the heads,
        ``"cls.predictions.decoder.weight"`` on a last stage without the embeddings: their
        gradients must be summed across the two processes before the optimizer step. ``None``
        when the stage holds neither or both (then the decoder *is* the embedding Parameter).
        """
        if self.has_embeddings and not self.has_heads:
            return WORD_EMBEDDINGS_NAME
        if self.has_heads and not self.has_embeddings:
            return DECODER_WEIGHT_NAME
        return None

    # ---- compute -----------------------------------------------------------------------------

    def encode(self, hidden: Tensor | None, batch: Batch) -> Tensor:
        """Run the embeddings (first stage) and the encoder layers this stage holds.

        Args:
            hidden: [B,S,H] output of the previous stage; ignored (may be ``None``) on the
                first stage.
            batch: the micro-batch; ``input_mask`` [B,S] is read here on every stage.

        Returns:
            [B,S,H] hidden states after this stage's last encoder layer.
        """
        if self.bert.embeddings is not None:
            hidden = self.bert.embeddings(batch["input_ids"], batch["segment_ids"])  # [B,S,H]
        elif hidden is None:
            raise ValueError(
                f"stage holding pipeline layers {self.first_layer}..{self.last_layer} has no "
                "embeddings: pass the previous stage's hidden states [B,S,H]"
            )
        if len(self.bert.encoder.layer) == 0:
            return hidden
        mask = batch["input_mask"]  # [B,S]
        # 0 for real tokens, the most negative float for padding keys: exp() underflows to 0.
        additive_mask = (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(
            hidden.dtype
        ).min  # [B,1,1,S]
        use_checkpoint = self.recompute and self.training and torch.is_grad_enabled()
        key = current_dropout_key()  # the replay in backward re-enters it: [Note: dropout]
        for layer in self.bert.encoder.layer.values():
            if use_checkpoint:
                # Under a key the replay needs no stash of the global RNG states.
                hidden = checkpoint(_run_layer, layer, key, hidden, additive_mask, use_reentrant=False,
                                    preserve_rng_state=key is None)
            else:
                hidden = layer(hidden, additive_mask)
        assert hidden is not None
        return hidden

    def logits(self, hidden: Tensor, batch: Batch) -> tuple[Tensor, Tensor]:
        """Apply the heads to the encoder output.

        Args:
            hidden: [B,S,H] output of the last encoder layer.
            batch: the micro-batch (uses ``masked_lm_positions`` [B,P]).

        Returns:
            ``(mlm_logits [B,P,V], nsp_logits [B,2])``; the MLM head runs only at the P gathered
            positions, padding slots included (they are dropped by the loss).
        """
        if self.cls is None or self.bert.pooler is None:
            raise ValueError(
                f"stage holding pipeline layers {self.first_layer}..{self.last_layer} has no "
                f"heads (pipeline layer {self.config.num_pipeline_layers - 1})"
            )
        positions = batch["masked_lm_positions"].long()  # [B,P]
        index = positions.unsqueeze(-1).expand(-1, -1, hidden.size(-1))  # [B,P,H]
        masked = hidden.gather(1, index)  # [B,P,H]
        mlm_logits = self.cls.predictions(masked)  # [B,P,V]
        nsp_logits = self.cls.seq_relationship(self.bert.pooler(hidden))  # [B,2]
        return mlm_logits, nsp_logits

    def forward(self, hidden: Tensor | None, batch: Batch) -> Tensor:
        """Run this stage on one micro-batch.

        Args:
            hidden: [B,S,H] from the previous stage, or ``None`` on the first stage.
            batch: the whole micro-batch (every stage sees the same one).

        Returns:
            [B,S,H] hidden states for the next stage, or, on the stage holding the heads,
            ``torch.stack([mlm_loss, nsp_loss])`` [2] (see ``pretraining_loss``); the training
            loss is its sum.
        """
        hidden = self.encode(hidden, batch)
        if not self.has_heads:
            return hidden
        mlm_logits, nsp_logits = self.logits(hidden, batch)
        return pretraining_loss(mlm_logits, nsp_logits, batch)

    def evaluate(self, hidden: Tensor | None, batch: Batch) -> Tensor:
        """Like :meth:`forward`, but the stage holding the heads returns the evaluation sums
        [6] of :func:`pretraining_eval_sums` instead of the losses (call it in eval mode, no grad)."""
        hidden = self.encode(hidden, batch)
        if not self.has_heads:
            return hidden
        return pretraining_eval_sums(*self.logits(hidden, batch), batch)

    def extra_repr(self) -> str:
        return f"pipeline layers {self.first_layer}..{self.last_layer} (inclusive)"


def _run_layer(layer: BertLayer, key: tuple[int, int] | None, hidden: Tensor, additive_mask: Tensor) -> Tensor:
    """``layer(hidden, additive_mask)`` under the dropout key of its forward, so that recompute's
    replay in the backward pass draws the forward's masks ([Note: dropout])."""
    with replay_dropout_key(key):
        return layer(hidden, additive_mask)


def build_full_model(config: BertConfig, seed: int = 0, recompute: bool = False) -> BertStage:
    """The whole model as one stage (pipeline layers 0..L+1), decoder tied to word embeddings."""
    return BertStage(config, 0, config.num_pipeline_layers - 1, seed=seed, recompute=recompute)


# --------------------------------------------------------------------------------------------
# Hugging Face state dicts
# --------------------------------------------------------------------------------------------


def load_hf_state_dict(stage: BertStage, hf_state_dict: Mapping[str, Tensor]) -> None:
    """Load the weights this stage holds from a ``BertForPreTraining`` state dict.

    Keys the stage does not hold (other layers, HF's ``position_ids`` / ``token_type_ids``
    buffers) are ignored. ``cls.predictions.decoder.weight`` falls back to the word embeddings
    and ``cls.predictions.bias`` to ``cls.predictions.decoder.bias`` when a checkpoint keeps
    only one name of a tied pair.

    Args:
        stage: the stage to fill in place.
        hf_state_dict: HF parameter name -> tensor (any dtype/device; copied).

    Raises:
        KeyError: a parameter of the stage is missing (the message lists them).
        ValueError: a tensor has the wrong shape.
    """
    selected: dict[str, Tensor] = {}
    missing: list[str] = []
    for name, own in stage.state_dict().items():
        candidates = (name, *_HF_FALLBACKS.get(name, ()))
        source = next((hf_state_dict[c] for c in candidates if c in hf_state_dict), None)
        if source is None:
            missing.append(name)
            continue
        if tuple(source.shape) != tuple(own.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(source.shape)} != model shape "
                f"{tuple(own.shape)}: the checkpoint was made for a different BertConfig"
            )
        selected[name] = source
    if missing:
        raise KeyError(
            f"HF state dict lacks {len(missing)} parameter(s) of the stage holding pipeline "
            f"layers {stage.first_layer}..{stage.last_layer}: {missing[:8]}"
            + (" ..." if len(missing) > 8 else "")
        )
    stage.load_state_dict(selected, strict=True)


def merge_stage_state_dicts(state_dicts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Merge the state dicts of the stages of one model into one HF-named state dict.

    The result loads with ``strict=True`` into ``transformers.BertForPreTraining``
    (``cls.predictions.decoder.weight`` and ``cls.predictions.decoder.bias`` are filled in as the
    aliases HF expects), and into any ``BertStage`` through ``load_hf_state_dict``.

    Args:
        state_dicts: ``stage.state_dict()`` of each stage, any order.

    Returns:
        HF parameter name -> tensor.

    Raises:
        ValueError: a name other than the tied word-embedding/decoder weight appears in two
            stages, or the two copies of the tied weight differ (their gradients were not
            summed across the first and last stage).
    """
    merged: dict[str, Tensor] = {}
    for state_dict in state_dicts:
        for name, tensor in state_dict.items():
            if name in merged:
                raise ValueError(f"{name} is held by two stages: pass each stage's state dict once")
            merged[name] = tensor
    embeddings = merged.get(WORD_EMBEDDINGS_NAME)
    decoder = merged.get(DECODER_WEIGHT_NAME)
    if embeddings is not None and decoder is not None and decoder is not embeddings:
        if embeddings.shape != decoder.shape or not torch.allclose(
            embeddings, decoder.to(embeddings.device), rtol=1e-5, atol=1e-6
        ):
            raise ValueError(
                f"{WORD_EMBEDDINGS_NAME} and {DECODER_WEIGHT_NAME} differ: the tied weight's "
                "gradient must be summed across the first and last stage (tied_parameter_name)"
            )
    if embeddings is not None:
        merged[DECODER_WEIGHT_NAME] = embeddings
    if _PREDICTIONS_BIAS_NAME in merged:
        merged[_HF_DECODER_BIAS_NAME] = merged[_PREDICTIONS_BIAS_NAME]
    return merged
