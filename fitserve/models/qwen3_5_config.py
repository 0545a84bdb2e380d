"""Qwen3.5 / Qwen3.6 config.json (dense `qwen3_5` and MoE `qwen3_5_moe`), read without transformers.

Two forms, as for Gemma-4 (gemma4_config.py):
- Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration (the published checkpoints): the
  text model's keys sit under `text_config` (its weights under `model.language_model.`), beside a
  `vision_config` tower that fitserve does not load;
- Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM: the text keys at the top level (weights under `model.`).
Both become one flat config: the text keys over transformers 5.24's Qwen3_5(Moe)TextConfig defaults, plus
the wrapper's architectures, dtype and eos ids, `towers` (for the log) and `weights_prefix`.

What the model and the planner read from it: `layer_types` (linear_attention: Gated DeltaNet; full_attention:
gated softmax attention), the DeltaNet sizes (`linear_*`), the partial rotary factor of the full layers, and
for the MoE the expert counts and the shared expert's size.
"""

from __future__ import annotations

from typing import Any

from fitserve.kv_layers import FULL as FULL_ATTENTION
from fitserve.kv_layers import LINEAR as LINEAR_ATTENTION
from fitserve.models.moe_experts_format import refuse_quantized_experts
from fitserve.models.text_config import text_values

QWEN3_5_DENSE_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
QWEN3_5_MOE_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
QWEN3_5_ARCHITECTURES = QWEN3_5_DENSE_ARCHITECTURES + QWEN3_5_MOE_ARCHITECTURES

# transformers 5.24's Qwen3_5TextConfig defaults; the MoE's add and change the keys below.
QWEN3_5_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 4096,
    "intermediate_size": 12_288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": None,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": None,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "mtp_num_hidden_layers": 0,
}
QWEN3_5_MOE_TEXT_DEFAULTS: dict[str, Any] = {
    **QWEN3_5_TEXT_DEFAULTS,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def qwen3_5_values(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json's dict (either form) -> the flat values of a CheckpointConfig."""
    architecture = (raw.get("architectures") or [""])[0]
    text = raw.get("text_config")
    if architecture.endswith("ForConditionalGeneration") and not isinstance(text, dict):
        causal = architecture.replace("ConditionalGeneration", "CausalLM")
        raise ValueError(
            f"config.json says {architecture} but has no text_config: the text model's keys must sit under "
            f"text_config (or name the architecture {causal})"
        )
    moe = architecture in QWEN3_5_MOE_ARCHITECTURES
    values = text_values(raw, QWEN3_5_MOE_TEXT_DEFAULTS if moe else QWEN3_5_TEXT_DEFAULTS, ("vision_config",))
    values["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    values["layer_types"] = qwen3_5_layer_types(values)
    rope = dict(values.get("rope_parameters") or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", values.get("rope_theta", DEFAULT_ROPE_THETA))
    rope.setdefault(
        "partial_rotary_factor", values.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)
    )
    values["rope_parameters"] = rope
    return values


def qwen3_5_layer_types(values: dict[str, Any]) -> list[str]:
    """layer_types as given, or every full_attention_interval-th layer full (the reference's default)."""
    num_layers = int(values["num_hidden_layers"])
    types = values.get("layer_types")
    if types is None:
        interval = int(values.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(
            f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}: config.json must "
            "list one type per layer"
        )
    unknown = sorted(set(types) - {LINEAR_ATTENTION, FULL_ATTENTION})
    if unknown:
        raise ValueError(
            f"layer_types holds {unknown}: Qwen3.5 runs {LINEAR_ATTENTION!r} and {FULL_ATTENTION!r} layers"
        )
    return types


def linear_layer_indices(config: Any) -> list[int]:
    """The decoder layers that are Gated DeltaNet layers (and keep recurrent state, not KV)."""
    return [i for i, kind in enumerate(config.layer_types) if kind == LINEAR_ATTENTION]


def delta_net_heads_per_rank(config: Any, tensor_parallel_size: int) -> tuple[int, int]:
    """(key heads, value heads) of one rank's Gated DeltaNet layers: both counts split evenly across the
    ranks (each rank keeps whole key heads with the value heads they serve); ValueError naming both counts
    and the sizes that divide them otherwise."""
    key_heads, value_heads = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    size = tensor_parallel_size
    if key_heads % size or value_heads % size:
        working = [n for n in range(1, key_heads + 1) if key_heads % n == 0 and value_heads % n == 0]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the Gated DeltaNet heads "
            f"(linear_num_key_heads={key_heads}, linear_num_value_heads={value_heads}): each rank holds an "
            f"equal share of both; choose --tensor-parallel-size among {working}"
        )
    return key_heads // size, value_heads // size


def refuse_quantized_moe(config: Any, fmt: Any) -> None:
    """ValueError when a Qwen3.5 MoE's (Qwen3.6-35B-A3B's) checkpoint format or --quantization would
    quantize its experts in a form they do not run: the fused experts run 16-bit weights or an int4
    checkpoint's without act order (models/moe_experts_format.py); the message says what runs instead."""
    if fmt is None or not getattr(config, "num_experts", None):
        return
    layers = list(range(int(config.num_hidden_layers)))
    refuse_quantized_experts(config, fmt, "Qwen3.5 MoE model", layers, with_architecture=True)
