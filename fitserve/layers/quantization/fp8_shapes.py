"""fp8 layers sized from config.json alone: the shape checks made before loading, and the bytes an fp8
layer holds (the planner's count for a folder without weight files, and for --quantization fp8)."""

from __future__ import annotations

from typing import Any

from fitserve.layers.quantization.fp8_format import Fp8Format
from fitserve.layers.quantization.projection_shapes import is_moe
from fitserve.layers.quantization.projection_shapes import projection_shapes as shapes_of


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]] | None:
    """Each decoder projection's (in_features, out_features); None for a MoE config (not sized here)."""
    return None if is_moe(hf_config) else shapes_of(hf_config)


def check_fp8_layer_shapes(fmt: Fp8Format, hf_config: Any) -> None:
    """ValueError for a block size that is not positive (the only shape fp8 depends on: any N and K
    load; the GPU's W8A8 GEMM takes dims that are multiples of 16 and others run weight-only)."""
    if fmt.block is not None and min(fmt.block) <= 0:
        raise ValueError(
            f"fp8 block size {list(fmt.block)}: both must be positive; fix config.json's quantization_config"
        )


def fp8_layer_bytes(fmt: Fp8Format, in_features: int, out_features: int) -> int:
    """What fitserve keeps for one fp8 layer: 1 byte a weight + float32 scales ([N, ceil(K / bk)] for a
    block format, [N, 1] otherwise: a per-tensor scale is repeated over its rows) + one static input
    scale: the weight-only path's form (CPU, GPUs below 8.9). The GPU's block-scaled W8A8 GEMM keeps the
    block scales as stored ([N/128, K/128]), fewer bytes; this is its upper bound."""
    groups = -(-in_features // fmt.block[1]) if fmt.strategy == "block" and fmt.block else 1
    static = 4 if fmt.activations == "static" else 0
    return in_features * out_features + 4 * out_features * groups + static


def stored_fp8_from_config(fmt: Fp8Format, hf_config: Any) -> tuple[int, int] | None:
    """(parameters its fp8 projections hold, the bytes fitserve keeps for them) from config.json's
    shapes; None for a config this does not size (a MoE other than Qwen3-MoE, Qwen3.5/3.6 MoE and
    Gemma-4). Fused projections are counted one by one, which is the same sum."""
    from fitserve.layers.quantization.layer_projections import (
        gemma4_quantized,
        is_gemma4,
        is_qwen3_5,
        is_qwen3_moe,
        qwen3_5_quantized,
        qwen3_moe_quantized,
    )

    # per-layer projections of their own, a MoE's experts one by one (layers/moe_fp8.py keeps each with its
    # canonical scale, as fp8_layer_bytes counts)
    for applies, projections in (
        (is_gemma4, gemma4_quantized),
        (is_qwen3_5, qwen3_5_quantized),
        (is_qwen3_moe, qwen3_moe_quantized),
    ):
        if applies(hf_config):
            quantized = projections(fmt, hf_config).values()
            return sum(k * n for k, n in quantized), sum(fp8_layer_bytes(fmt, k, n) for k, n in quantized)
    shapes = projection_shapes(hf_config)
    if shapes is None:
        return None
    params = stored = 0
    for layer in range(hf_config.num_hidden_layers):
        for suffix, (in_features, out_features) in shapes.items():
            if not fmt.quantizes(f"model.layers.{layer}.{suffix}"):
                continue
            params += in_features * out_features
            stored += fp8_layer_bytes(fmt, in_features, out_features)
    return params, stored


def fp8_scale_bytes(hf_config: Any) -> int:
    """--quantization fp8: the per-channel float32 scales of every decoder projection (4 bytes a row)."""
    from fitserve.layers.quantization.layer_projections import (
        gemma4_projections,
        is_gemma4,
        is_qwen3_5,
        qwen3_5_projections,
    )

    if is_gemma4(hf_config):
        return 4 * sum(out for _, out in gemma4_projections(hf_config).values())
    shapes = projection_shapes(hf_config)
    if shapes is None:
        return 0

    if is_qwen3_5(hf_config):
        return 4 * sum(out for _, out in qwen3_5_projections(hf_config).values())
    return 4 * hf_config.num_hidden_layers * sum(out for _, out in shapes.values())
