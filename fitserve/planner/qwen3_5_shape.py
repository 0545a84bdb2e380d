"""Qwen3.5 / Qwen3.6's text parameters and per-request state, counted from config.json as transformers'
modeling_qwen3_5(_moe).py builds them.

Per full_attention layer: q_proj (query and gate: 2 x heads x head_dim rows), k_proj, v_proj, o_proj,
q_norm and k_norm. Per linear_attention (Gated DeltaNet) layer: in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a, out_proj (the projections), the conv1d (conv_dim x K), A_log and dt_bias (one per value head)
and the gated norm (v_dim). Every layer: two norms and the MLP (dense), or the router, the experts and the
shared expert with its one-output gate (MoE). Outside the layers: the embedding, the LM head (untied), the
final norm. The vision tower is not counted (not loaded), nor are the MTP layers here: they load only for
speculative method mtp, counted then as its draft (`qwen3_5_mtp_parameter_count`, planner/draft_plan.py).

The per-request state (worker/recurrent_state.py counts the same): per DeltaNet layer conv_dim x (K - 1)
elements in the model dtype and value heads x k_dim x v_dim in float32, the whole model's; under tensor
parallel each rank holds 1/n of it (the heads split evenly: planner/kv_memory.py state_bytes_per_seq_on_rank).
Every DeltaNet parameter splits by heads with its layer (conv1d, A_log, dt_bias included), though `replicated`
counts them whole: a few KB per layer, counted on every rank.

A quantized checkpoint: layers/quantization/layer_projections.py's `qwen3_5_projections` sizes each decoder
linear by the name the checkpoint gives it, and `qwen3_5_quantized` keeps those the format stores quantized
(its ignore list honoured as the model honours it), for the bytes the planner counts (int4_formats,
fp8_shapes, bnb_sizes) and the shape checks made before loading (quant_config.check_layer_shapes,
bnb_checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fitserve.models.qwen3_5_config import FULL_ATTENTION, LINEAR_ATTENTION
from fitserve.planner.architecture_counts import ArchitectureCounts


@dataclass(frozen=True)
class Qwen3_5Counts(ArchitectureCounts):
    """`other` also holds the LM head, the conv weights and the decay parameters; `replicated` the
    last two."""

    conv_state_elements: int  # per request, over the DeltaNet layers (model dtype)
    recurrent_state_elements: int  # per request, over the DeltaNet layers (float32)


def qwen3_5_counts(config: Any) -> Qwen3_5Counts:
    hidden, head_dim = int(config.hidden_size), int(config.head_dim)
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    key_size = int(config.linear_num_key_heads) * int(config.linear_key_head_dim)
    value_heads, v_dim = int(config.linear_num_value_heads), int(config.linear_value_head_dim)
    value_size = value_heads * v_dim
    conv_dim, width = 2 * key_size + value_size, int(config.linear_conv_kernel_dim)
    moe = bool(getattr(config, "num_experts", None))
    linear = replicated = experts = active_experts = conv_elements = recurrent_elements = 0
    for kind in config.layer_types:
        if kind == FULL_ATTENTION:
            linear += hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim) + heads * head_dim * hidden
            replicated += 2 * head_dim
        elif kind == LINEAR_ATTENTION:
            linear += hidden * (conv_dim + value_size + 2 * value_heads) + value_size * hidden
            replicated += conv_dim * width + 2 * value_heads + v_dim
            conv_elements += conv_dim * (width - 1)
            recurrent_elements += value_heads * int(config.linear_key_head_dim) * v_dim
        replicated += 2 * hidden
        if moe:
            num_experts, expert_width = int(config.num_experts), int(config.moe_intermediate_size)
            experts += 3 * num_experts * expert_width * hidden
            active_experts += 3 * int(config.num_experts_per_tok) * expert_width * hidden
            linear += 3 * hidden * int(config.shared_expert_intermediate_size)
            replicated += hidden * num_experts + hidden  # router, shared-expert gate
        else:
            linear += 3 * hidden * int(config.intermediate_size)
    replicated += hidden  # the final norm
    tables = int(config.vocab_size) * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return Qwen3_5Counts(
        linear=linear + experts,
        other=tables + replicated,
        replicated=replicated,
        experts=experts,
        active_experts=active_experts,
        conv_state_elements=conv_elements,
        recurrent_state_elements=recurrent_elements,
    )


def qwen3_5_mtp_parameter_count(shape: Any) -> int:
    """One MTP layer's parameters (models/qwen3_5_mtp.py): fc (2 x hidden -> hidden), its three norms
    (pre_fc_norm_embedding, pre_fc_norm_hidden, norm), and one full-attention decoder layer of the
    target's kind (attention with its q/k norms, two layer norms, the dense MLP or the MoE block). The
    embedding and the LM head are the target's, not counted again. `shape`: the target's ModelShape."""
    hidden, heads, kv_heads, head_dim = (
        shape.hidden_size,
        shape.num_attention_heads,
        shape.num_kv_heads,
        shape.head_dim,
    )
    num_experts, intermediate = shape.num_experts, shape.intermediate_size
    moe_intermediate, shared_expert_intermediate = (
        shape.moe_intermediate_size,
        shape.shared_expert_intermediate_size,
    )
    attention = hidden * (2 * heads * head_dim + 2 * kv_heads * head_dim) + heads * head_dim * hidden
    attention += 2 * head_dim
    if num_experts:
        mlp = 3 * num_experts * moe_intermediate * hidden + 3 * hidden * shared_expert_intermediate
        mlp += hidden * num_experts + hidden  # router, shared-expert gate
    else:
        mlp = 3 * hidden * intermediate
    return 2 * hidden * hidden + 3 * hidden + attention + 2 * hidden + mlp
