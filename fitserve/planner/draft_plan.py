"""Speculative decoding's draft model (or EAGLE-3 head) in the memory plan: its weights and its KV per
token, read from its config.json and weight headers (nothing loads), so the KV cache's tokens and max
concurrency stay right."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fitserve.planner.memory import DTYPE_BYTES, DraftFootprint, MemoryInputs, draft_footprint
from fitserve.spec_decode.config import SpeculativeConfig, parse_speculative_config


def with_draft(
    inputs: MemoryInputs,
    speculative: SpeculativeConfig | dict[str, Any] | None,
    trust_remote_code: bool = False,
    load_format: str = "auto",
) -> MemoryInputs:
    """`inputs` with the draft model of `speculative` (a parsed config, or --speculative-config's raw
    value) counted; unchanged for other methods or none."""
    from fitserve.planner.model_info import inspect_model

    if not isinstance(speculative, SpeculativeConfig):
        speculative = parse_speculative_config(speculative)
    if speculative is not None and speculative.method == "eagle3" and speculative.model is not None:
        return replace(inputs, draft=_eagle3_footprint(inputs, speculative, trust_remote_code, load_format))
    if speculative is None or speculative.method != "draft_model" or speculative.model is None:
        return inputs
    dummy = "dummy" if load_format == "dummy" else "auto"
    info = inspect_model(speculative.model, speculative.revision, trust_remote_code, dummy)
    draft = draft_footprint(inputs, speculative.model, info.shape, info.weights, speculative.quantization)
    return replace(inputs, draft=draft)


def _eagle3_footprint(
    inputs: MemoryInputs, speculative: SpeculativeConfig, trust_remote_code: bool, load_format: str
) -> DraftFootprint:
    """An EAGLE-3 head (fitserve/spec_decode/eagle3.py) in the target's dtype: its one layer, fc, norm,
    lm_head over the draft vocabulary, its embedding when the checkpoint has one, d2t, and the target's
    buffer of the three layers' hidden states (max_num_batched_tokens or max_num_seqs x (k + 1) rows);
    its KV: one layer's K and V per token."""
    from fitserve.models.loader import load_hf_config
    from fitserve.planner.draft_checkpoint import (
        eagle3_parameter_count,
        read_keys,
        resolve_draft,
        weight_files,
    )

    path, _ = resolve_draft(speculative.model, speculative.revision)
    config = load_hf_config(path, trust_remote_code=trust_remote_code)
    keys = set() if load_format == "dummy" else read_keys(weight_files(path))
    element = DTYPE_BYTES[inputs.dtype]
    weights = eagle3_parameter_count(config, "embed_tokens.weight" in keys) * element
    draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
    weights += draft_vocab * 8  # d2t
    k = speculative.num_speculative_tokens
    rows = max(inputs.max_num_batched_tokens, inputs.max_num_seqs * (k + 1))
    weights += rows * 3 * inputs.shape.hidden_size * element
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DraftFootprint(speculative.model, weights, 2 * int(heads) * int(head_dim))
