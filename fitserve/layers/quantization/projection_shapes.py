"""A dense decoder's projections sized from config.json alone, for the checks made before loading and the
bytes a quantized format holds (the planner's count for a folder without weight files)."""

from __future__ import annotations

from typing import Any

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def is_moe(hf_config: Any) -> bool:
    return any(getattr(hf_config, name, None) for name in ("num_local_experts", "num_experts"))


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Each decoder projection's checkpoint suffix -> (in_features, out_features)."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    inter = hf_config.intermediate_size
    shapes = ((hidden, heads * head_dim), (hidden, kv), (hidden, kv), (heads * head_dim, hidden))
    shapes += ((hidden, inter), (hidden, inter), (inter, hidden))
    return dict(zip(PROJECTIONS, shapes, strict=True))


def fused_projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """The layers fitserve fuses them into (q/k/v, gate/up), keyed by their first projection's suffix:
    (in_features, out_features)."""
    shapes = projection_shapes(hf_config)
    (k, q), (_, kv) = shapes["self_attn.q_proj"], shapes["self_attn.k_proj"]
    (_, inter) = shapes["mlp.gate_proj"]
    return {
        "self_attn.q_proj": (k, q + 2 * kv),
        "self_attn.o_proj": shapes["self_attn.o_proj"],
        "mlp.gate_proj": (k, 2 * inter),
        "mlp.down_proj": shapes["mlp.down_proj"],
    }
