"""Qwen3-MoE's config rules that need no model code (the planner reads them before anything is built):
which layers transformers makes sparse, and the refusal of a format that would quantize the experts."""

from __future__ import annotations

from typing import Any

QWEN3_MOE_MODEL_TYPES = ("qwen3_moe",)


def is_qwen3_moe(config: Any) -> bool:
    return str(getattr(config, "model_type", "")) in QWEN3_MOE_MODEL_TYPES


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` has the sparse MLP (transformers' Qwen3MoeDecoderLayer rule)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (
        int(getattr(config, "num_experts", 0) or 0) > 0
        and layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
        and (layer_idx + 1) % step == 0
    )


def refuse_quantized_experts(config: Any, fmt: Any) -> None:
    """ValueError when the checkpoint's format `fmt` (or --quantization) would quantize the experts: they
    run 16-bit weights only (layers/moe.py). A format whose ignore list names them leaves them 16-bit."""
    if fmt is None:
        return
    sparse = [i for i in range(int(config.num_hidden_layers)) if is_sparse_layer(config, i)]
    names = ("gate_up_proj", "down_proj", "0.gate_proj", "0.up_proj", "0.down_proj")
    if not any(all(fmt.quantizes(f"model.layers.{i}.mlp.experts.{n}") for n in names) for i in sparse):
        return
    raise ValueError(
        f"{fmt.describe()} for a Qwen3-MoE model ({int(config.num_experts)} experts): fitserve's fused MoE "
        "experts run 16-bit weights only, and this format quantizes them (a quantized checkpoint whose "
        "ignore list does not name the experts, or --quantization on a 16-bit MoE checkpoint). What runs: "
        "the 16-bit checkpoint without --quantization (`fitserve plan MODEL` says what it needs and how it "
        "fits: --tensor-parallel-size, --cpu-offload-gb), or a quantized dense Qwen3 (AWQ / GPTQ / "
        "compressed-tensors int4, fp8, bitsandbytes)"
    )
