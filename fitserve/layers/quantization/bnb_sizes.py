"""Bytes of a bitsandbytes 4-bit model's quantized projections as fitserve holds them, from config.json's
shapes alone (a folder without weight files, --load-format dummy, --quantization bitsandbytes): half a
byte a weight (two codes a byte) and one float16 absmax a block (a double-quantized checkpoint's absmax is
decoded at load; see kernels/nf4_pack.py). The planner (planner/weights.py) sizes a checkpoint's own
tensors from their headers the same way (`held_bytes`)."""

from __future__ import annotations

from typing import Any

from fitserve.layers.quantization.bnb_format import DEFAULT_BLOCKSIZE, BnbFormat
from fitserve.layers.quantization.projection_shapes import is_moe, projection_shapes

SCALE_BYTES = 2  # one float16 absmax a block


def held_bytes(params: int, blocksize: int = DEFAULT_BLOCKSIZE) -> int:
    """Bytes fitserve holds for `params` 4-bit weights in blocks of `blocksize`."""
    return params // 2 + params // blocksize * SCALE_BYTES


def stored_bnb_from_config(fmt: BnbFormat, hf_config: Any) -> tuple[int, int] | None:
    """(parameters the quantized projections hold, the bytes fitserve holds them in); None for a config
    this does not size (MoE)."""
    from fitserve.layers.quantization.layer_projections import (
        gemma4_quantized,
        is_gemma4,
        is_qwen3_5,
        qwen3_5_quantized,
    )

    if is_gemma4(hf_config):  # its experts stay 16-bit (a format quantizing them is refused)
        params = sum(k * n for k, n in gemma4_quantized(fmt, hf_config).values())
        return params, held_bytes(params, fmt.blocksize)
    if is_moe(hf_config):
        return None

    if is_qwen3_5(hf_config):  # per-layer projections of its own
        params = sum(k * n for k, n in qwen3_5_quantized(fmt, hf_config).values())
        return params, held_bytes(params, fmt.blocksize)
    params = 0
    for layer in range(hf_config.num_hidden_layers):
        for suffix, (in_features, out_features) in projection_shapes(hf_config).items():
            if fmt.quantizes(f"model.layers.{layer}.{suffix}"):
                params += in_features * out_features
    return params, held_bytes(params, fmt.blocksize)
