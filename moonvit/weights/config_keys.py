"""Config keys a loader does not read: named in a warning, never dropped in silence.

A misspelt key (``num_hiden_layers``) or one of a newer checkpoint family would otherwise leave
its field at the default and the model quietly different from the checkpoint. Keys that every
transformers config carries (bookkeeping, generation defaults) are not worth a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["GENERIC_KEYS", "unread_keys", "warn_unread_keys"]

GENERIC_KEYS = frozenset(
    {
        # transformers' PretrainedConfig bookkeeping (v4 and v5 spellings)
        "_name_or_path",
        "_attn_implementation_autoset",
        "architectures",
        "auto_map",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "model_type",
        "id2label",
        "label2id",
        "problem_type",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "use_bfloat16",
        "pruned_heads",
        "tie_word_embeddings",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "finetuning_task",
        "tokenizer_class",
        "prefix",
        "task_specific_params",
        "tf_legacy_loss",
        # generation defaults that v4 configs repeat in every sub-config
        "bad_words_ids",
        "begin_suppress_tokens",
        "bos_token_id",
        "decoder_start_token_id",
        "diversity_penalty",
        "do_sample",
        "early_stopping",
        "encoder_no_repeat_ngram_size",
        "eos_token_id",
        "exponential_decay_length_penalty",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "length_penalty",
        "max_length",
        "min_length",
        "no_repeat_ngram_size",
        "num_beam_groups",
        "num_beams",
        "num_return_sequences",
        "output_scores",
        "pad_token_id",
        "remove_invalid_values",
        "repetition_penalty",
        "return_dict_in_generate",
        "sep_token_id",
        "suppress_tokens",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        # processor bookkeeping
        "image_processor_type",
        "processor_class",
    }
)


def unread_keys(values: Mapping[str, Any], read: Iterable[str]) -> list[str]:
    """The keys of ``values`` that are neither in ``read`` nor generic bookkeeping, sorted."""
    return sorted(set(values) - set(read) - GENERIC_KEYS)


def warn_unread_keys(path: str | Path, values: Mapping[str, Any], read: Iterable[str]) -> list[str]:
    """Warn (``UserWarning``) naming the keys of the file ``path`` that will be ignored; returns them."""
    keys = unread_keys(values, read)
    if keys:
        warnings.warn(f"{path}: ignoring keys this package does not read: {', '.join(keys)}", stacklevel=3)
    return keys
