"""BERT for pretraining, split into pipeline stages.

Entry points: ``BertConfig`` (``BertConfig.from_size("mini")``), ``partition_layers`` (which
pipeline layers each stage holds), ``BertStage`` (one stage; ``build_full_model`` for all of it),
``load_hf_state_dict`` / ``merge_stage_state_dicts`` (Hugging Face names in and out).
Pipeline layers: 0 = embeddings, 1..L = encoder layers, L+1 = heads; stage bounds are inclusive.
"""

from pipefisher.model.bert import (
    BATCH_KEYS,
    DECODER_WEIGHT_NAME,
    WORD_EMBEDDINGS_NAME,
    Batch,
    BertStage,
    build_full_model,
    load_hf_state_dict,
    merge_stage_state_dicts,
    EVAL_SUMS,
    pretraining_eval_sums,
    pretraining_loss,
)
from pipefisher.model.config import BERT_SIZES, BertConfig, BertSize
from pipefisher.model.partition import layer_costs, partition_layers, stage_costs

__all__ = [
    "BATCH_KEYS",
    "BERT_SIZES",
    "Batch",
    "BertConfig",
    "BertSize",
    "BertStage",
    "DECODER_WEIGHT_NAME",
    "WORD_EMBEDDINGS_NAME",
    "build_full_model",
    "layer_costs",
    "load_hf_state_dict",
    "merge_stage_state_dicts",
    "partition_layers",
    "pretraining_loss",
    "pretraining_eval_sums",
    "EVAL_SUMS",
    "stage_costs",
]
