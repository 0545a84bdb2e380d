"""Gemma-4's text parameters, counted from config.json as transformers' modeling_gemma4.py builds them.

Per layer (its KV geometry from kv_layers.py): q_proj and o_proj; k_proj, and v_proj unless the layer is a
full one with attention_k_eq_v, except on KV-shared layers (which have neither, nor k_norm); q_norm and
k_norm of head_dim; the dense MLP (twice as wide on KV-shared layers with use_double_wide_mlp); four
norms and `layer_scalar`; on the E models the per-layer input gate, projection and norm; with
enable_moe_block the router (projection, scale, per-expert scale), the experts and three more norms.
Outside the layers: the embedding (tied to the LM head), on the E models the per-layer embedding table,
its projection and norm, and the final norm. The vision and audio towers are not counted: fitserve
serves the text model only.

`active` counts the experts a token runs (top_k_experts of num_experts), as "26B-A4B" names 3.8 B.

A quantized checkpoint: layers/quantization/layer_projections.py's `gemma4_projections` sizes every linear
the checkpoint may store quantized by the name it gives it (attention, dense MLP, the E models' per-layer
input gate, projection and model projection, the MoE router), and `gemma4_quantized` keeps those the format
stores quantized, its ignore list honoured as the model honours it (models/gemma4_layers.quantized_method),
for the bytes the planner counts and the shape checks made before loading; the MoE experts one by one, where
the format stores them in a form they run (int4 or FP8; models/moe_experts_format.py refuses the others).
"""

from __future__ import annotations

from typing import Any

from fitserve.kv_layers import FULL, kv_layer_specs
from fitserve.planner.architecture_counts import ArchitectureCounts


def gemma4_counts(config: Any) -> ArchitectureCounts:
    specs = kv_layer_specs(config)
    hidden, heads = config.hidden_size, config.num_attention_heads
    per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    num_layers = config.num_hidden_layers
    moe = bool(getattr(config, "enable_moe_block", False))
    linear = replicated = experts = active_experts = 0
    for index, spec in enumerate(specs):
        shared = not spec.owns_cache(index)
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and spec.layer_type == FULL
        linear += 2 * hidden * heads * spec.head_dim  # q_proj, o_proj
        if not shared:
            linear += hidden * spec.num_kv_heads * spec.head_dim * (1 if k_eq_v else 2)
        replicated += spec.head_dim * (1 if shared else 2)  # q_norm, k_norm
        double = bool(getattr(config, "use_double_wide_mlp", False)) and shared
        linear += 3 * hidden * config.intermediate_size * (2 if double else 1)
        replicated += 4 * hidden + 1  # the four norms and layer_scalar
        if per_layer:  # the per-layer gate and projection: every rank holds them whole
            replicated += 2 * hidden * per_layer + hidden
        if moe:
            num_experts, width = config.num_experts, config.moe_intermediate_size
            experts += 3 * num_experts * width * hidden
            active_experts += 3 * config.top_k_experts * width * hidden
            replicated += hidden * num_experts + hidden + num_experts + 3 * hidden
    replicated += hidden  # the final norm
    tables = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", True) else 2)
    if per_layer:
        tables += config.vocab_size_per_layer_input * num_layers * per_layer
        replicated += hidden * num_layers * per_layer + per_layer  # the model projection, whole on every rank
    return ArchitectureCounts(
        linear=linear + experts,
        other=tables + replicated,
        replicated=replicated,
        experts=experts,
        active_experts=active_experts,
    )
