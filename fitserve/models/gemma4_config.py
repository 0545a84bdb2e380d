"""Gemma-4's config.json, read without transformers.

transformers' Gemma4TextConfig turns head_dim and num_key_value_heads into per-layer attributes, and
some versions refuse to read them globally ("'head_dim' is a per-layer attribute": vLLM 0.26 with
transformers 5.17 failed on it). fitserve reads the file itself, as it reads the dense families
(checkpoint_config.py), and keeps the values flat; kv_layers.py derives each layer's geometry.

Two forms:
- Gemma4ForConditionalGeneration: the text model's keys sit under `text_config` (its weights under
  `model.language_model.`), beside `vision_config` / `audio_config` towers, which fitserve does not load.
- Gemma4ForCausalLM: the text keys at the top level (weights under `model.`).
Both become one flat config: the text keys over Gemma4TextConfig's defaults, plus the wrapper's
architectures, dtype and eos ids, and `towers` (the tower configs present, for the log and the plan).
"""

from __future__ import annotations

import copy
from typing import Any

from fitserve.models import moe_experts_format
from fitserve.models.moe_experts_format import GEMMA_EXPERTS
from fitserve.models.text_config import text_values

GEMMA4_ARCHITECTURES = ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM")

# transformers 5.24's Gemma4TextConfig defaults (tests/unit/test_gemma4_config.py compares them).
GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "rope_parameters": None,
    "attention_bias": False,
    "sliding_window": 512,
    "layer_types": None,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
}
GEMMA4_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_TOWER_KEYS = ("vision_config", "audio_config")
# --enable-expert-parallel, as it reaches the model: an attribute of the config the model is built from
# (models/loader.py), read by the MoE layers (False when absent).
EXPERT_PARALLEL_ATTR = "fitserve_expert_parallel"


def expert_parallel_of(config: Any) -> bool:
    """Whether a tensor-parallel run splits the MoE experts across ranks (--enable-expert-parallel)
    rather than each expert's intermediate size."""
    return bool(getattr(config, EXPERT_PARALLEL_ATTR, False))


def with_expert_parallel(config: Any, enabled: bool) -> Any:
    """config as the model is built from it: a shallow copy carrying --enable-expert-parallel under
    EXPERT_PARALLEL_ATTR when it is set; the original (or config itself when not set) left as it was."""
    if not enabled:
        return config
    marked = copy.copy(config)
    setattr(marked, EXPERT_PARALLEL_ATTR, True)
    return marked


def gemma4_values(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's dict (either form) -> the flat values of a CheckpointConfig."""
    architecture = (raw.get("architectures") or [""])[0]
    text = raw.get("text_config")
    if architecture == "Gemma4ForConditionalGeneration" and text is None:
        raise ValueError(
            "config.json says Gemma4ForConditionalGeneration but has no text_config: the text model's keys "
            "must sit under text_config (or name the architecture Gemma4ForCausalLM)"
        )
    values = text_values(raw, GEMMA4_TEXT_DEFAULTS, _TOWER_KEYS)
    if values.get("rope_parameters") is None:
        values["rope_parameters"] = GEMMA4_DEFAULT_ROPE
    values["model_type"] = "gemma4_text"
    if values.get("use_bidirectional_attention") == "all":
        raise ValueError(
            "use_bidirectional_attention='all' makes every token see every other one: fitserve generates "
            "text causally; set it to null or 'vision' in config.json to serve this checkpoint"
        )
    return values


def refuse_quantized_experts(config: Any, fmt: Any) -> None:
    """ValueError for a Gemma-4 MoE (26B-A4B) whose experts the format would quantize in a form they do not
    run (models/moe_experts_format.py: 16-bit, or an int4 checkpoint's without act order). A checkpoint
    that leaves the experts in its ignore list (quantizing the attention and dense MLP only) runs too."""
    if not getattr(config, "enable_moe_block", False):
        return
    layers = list(range(int(config.num_hidden_layers)))
    moe_experts_format.refuse_quantized_experts(config, fmt, "Gemma-4 MoE model", layers, GEMMA_EXPERTS, True)
