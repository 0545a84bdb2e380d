"""Qwen3-MoE's config rules that need no model code (the planner reads them before anything is built):
which layers transformers makes sparse, which experts run int4, and the refusal of a format that would
quantize the experts in a form they do not run."""

from __future__ import annotations

from typing import Any

from fitserve.layers.quantization.layer_projections import moe_sparse_layer
from fitserve.layers.quantization.quant_config import Int4Format

QWEN3_MOE_MODEL_TYPES = ("qwen3_moe",)


def is_qwen3_moe(config: Any) -> bool:
    return str(getattr(config, "model_type", "")) in QWEN3_MOE_MODEL_TYPES


def experts_quantized(config: Any, fmt: Any, layer_idx: int) -> bool:
    """Whether `fmt` stores layer `layer_idx`'s experts quantized (not where its ignore list names them)."""
    names = ("gate_up_proj", "down_proj", "0.gate_proj", "0.up_proj", "0.down_proj")
    return fmt is not None and all(fmt.quantizes(f"model.layers.{layer_idx}.mlp.experts.{n}") for n in names)


def int4_experts(config: Any, fmt: Any, layer_idx: int) -> bool:
    """Whether layer `layer_idx`'s experts run as int4 (an int4 checkpoint that quantizes them)."""
    return isinstance(fmt, Int4Format) and experts_quantized(config, fmt, layer_idx)


def refuse_quantized_experts(config: Any, fmt: Any) -> None:
    """ValueError when the checkpoint's format `fmt` (or --quantization) would quantize the experts in a
    form they do not run: int4 checkpoints run (without act order), fp8 and bitsandbytes do not (the fused
    experts hold 16-bit or int4 weights). A format whose ignore list names them leaves them 16-bit."""
    if fmt is None:
        return
    sparse = [i for i in range(int(config.num_hidden_layers)) if moe_sparse_layer(config, i)]
    if not any(experts_quantized(config, fmt, i) for i in sparse):
        return
    if isinstance(fmt, Int4Format) and not fmt.act_order:
        return
    why = "int4 with act order (g_idx)" if isinstance(fmt, Int4Format) else "this format"
    raise ValueError(
        f"{fmt.describe()} for a Qwen3-MoE model ({int(config.num_experts)} experts): fitserve's fused MoE "
        f"experts run 16-bit or int4 weights (without act order), not {why} (a quantized checkpoint whose "
        "ignore list does not name the experts, or --quantization on a 16-bit MoE checkpoint). What runs: "
        "an AWQ / GPTQ (desc_act false) / compressed-tensors W4A16 / AutoRound checkpoint of the model, or "
        "the 16-bit one without --quantization (`fitserve plan MODEL` says what it needs and how it fits: "
        "--tensor-parallel-size, --cpu-offload-gb)"
    )
