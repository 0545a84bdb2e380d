"""A bitsandbytes 4-bit checkpoint checked from its safetensors headers (names, dtypes, shapes) before any
weight loads: every quantized projection must have its packed codes at the size config.json's shapes
give, an absmax whose length gives a block size fitserve runs, a quant_state of the config's 4-bit type,
and the nested (double quant) tensors exactly when the config says so. Each refusal names the tensor, the
value, the limit and the fix. The loader checks the same again from the tensors' contents
(bnb_method.py: the quant_state's JSON, the code table).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fitserve.layers.quantization.bnb_format import BLOCK_SIZES, BnbFormat
from fitserve.layers.quantization.projection_shapes import projection_shapes as shapes_in_out

_BYTES = {"U8": 1, "I8": 1, "BOOL": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}
_FIX = "the checkpoint is truncated or does not match config.json (download it again)"


def projection_shapes(hf_config: Any) -> dict[str, tuple[int, int]]:
    """Decoder projection suffix -> (N, K) from config.json."""
    return {name: (n, k) for name, (k, n) in shapes_in_out(hf_config).items()}


def check_bnb_tensors(
    fmt: BnbFormat, tensors: Mapping[str, tuple[str, Sequence[int]]], hf_config: Any
) -> None:
    """`tensors`: every checkpoint tensor's name -> (safetensors dtype, shape). ValueError on the first
    quantized projection that does not hold what a bitsandbytes 4-bit checkpoint of config.json holds."""
    from fitserve.layers.quantization.layer_projections import (
        gemma4_quantized,
        is_gemma4,
        is_qwen3_5,
        qwen3_5_quantized,
    )

    if is_qwen3_5(hf_config):  # each quantized module by its checkpoint name (its layers differ)
        for module, (k, n) in qwen3_5_quantized(fmt, hf_config).items():
            _check_projection(fmt, module, n, k, tensors)
        return
    if is_gemma4(hf_config):
        for module, (k, n) in gemma4_quantized(fmt, hf_config).items():
            _check_projection(fmt, module, n, k, tensors)
        return
    shapes = projection_shapes(hf_config)
    for layer in range(hf_config.num_hidden_layers):
        for suffix, (n, k) in shapes.items():
            module = f"model.layers.{layer}.{suffix}"
            if fmt.quantizes(module):
                _check_projection(fmt, module, n, k, tensors)


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total


def _check_projection(
    fmt: BnbFormat, module: str, n: int, k: int, tensors: Mapping[str, tuple[str, Sequence[int]]]
) -> None:
    weight = tensors.get(f"{module}.weight")
    if weight is None:
        raise ValueError(f"checkpoint has no tensor {module}.weight; {_FIX}")
    dtype, shape = weight
    if dtype in ("F16", "BF16", "F32") and list(shape) == [n, k]:
        raise ValueError(
            f"{module}.weight is a 16/32-bit [{n}, {k}] matrix, but config.json's quantization_config says "
            "bitsandbytes 4-bit: the checkpoint was not saved quantized; serve it without its "
            "quantization_config with --quantization bitsandbytes (nf4 while loading), or re-save it"
        )
    stored = _numel(shape) * _BYTES.get(dtype, 1)
    if stored != n * k // 2:
        raise ValueError(
            f"quantized tensor {module}.weight holds {stored} bytes of codes, expected {n * k // 2} (two "
            "4-bit "
            f"codes a byte for its [{n}, {k}] weight); {_FIX}"
        )
    states = [name for name in tensors if name.startswith(f"{module}.weight.quant_state.bitsandbytes__")]
    if not states:
        raise ValueError(
            f"{module}.weight has no quant_state tensor ({module}.weight.quant_state.bitsandbytes__nf4 or "
            "__fp4, the block size, shape and dtype bitsandbytes needs to decode it): the checkpoint is "
            "incomplete; re-save it with transformers' save_pretrained of a load_in_4bit model, or download "
            "it again"
        )
    kind = states[0].rsplit("__", 1)[-1]
    if kind != fmt.quant_type:
        raise ValueError(
            f"{states[0]}: a {kind} quant_state, but config.json's bnb_4bit_quant_type is "
            f"{fmt.quant_type!r}; "
            f"{_FIX}"
        )
    absmax = tensors.get(f"{module}.weight.absmax")
    if absmax is None:
        raise ValueError(f"checkpoint has no tensor {module}.weight.absmax (the block scales); {_FIX}")
    blocks = _numel(absmax[1])
    blocksize = n * k // blocks if blocks and (n * k) % blocks == 0 else 0
    if blocksize not in BLOCK_SIZES or k % blocksize:
        raise ValueError(
            f"{module}.weight.absmax holds {blocks} block scales for a [{n}, {k}] weight (block size "
            f"{n * k / max(blocks, 1):g}): fitserve runs bitsandbytes block sizes "
            f"{', '.join(map(str, BLOCK_SIZES))} that divide the input dim {k}; {_FIX}, or re-quantize with "
            "blocksize 64"
        )
    nested = f"{module}.weight.nested_absmax" in tensors
    if nested != fmt.double_quant:
        has = "has" if nested else "lacks"
        raise ValueError(
            f"{module} {has} nested_absmax (double quant) but config.json's bnb_4bit_use_double_quant is "
            f"{str(fmt.double_quant).lower()}; {_FIX}"
        )
