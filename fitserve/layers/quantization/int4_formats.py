"""Each int4 checkpoint layout's tensors, and their conversion to the canonical Int4Weight.

Shapes for a layer of K input and N output features, G = K // group_size groups (1 per-channel):

- gptq (GPTQ, AutoRound auto_gptq): qweight int32 [K/8, N], code of column k = 8i + j in bits 4j..4j+3 of
  qweight[i, n]; qzeros int32 [G, N/8], zero of row n = 8i + j in bits 4j of qzeros[g, i] (checkpoint_format
  gptq stores z - 1); scales [G, N]; g_idx int32 [K] (group of each input column; act order when not k // g).
- awq (GEMM): qweight int32 [K, N/8] and qzeros int32 [G, N/8], packed along the output dim in AWQ's
  interleaved order: nibble i of word c holds row 8c + AWQ_ORDER[i]; scales [G, N]; no offset.
- pack-quantized (compressed-tensors): weight_packed int32 [N, K/8], code of column 8c + j in bits 4j of
  word c, stored as the signed int4 value + 8; weight_scale [N, G]; weight_zero_point (asymmetric) int32
  [N/8, G] packed along the output dim, + 8 likewise (older writers: unpacked int8 [N, G], packed at load);
  weight_g_idx [K] (actorder group); weight_shape [2].

`ParamSpec` says how a fused layer's tensor is cut into its shards' rows: along `shard_dim`, `rows_per`
output rows per element (8 where 8 rows share an int32).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from fitserve.layers.quantization.int4_weight import Int4Weight, act_order_from_g_idx
from fitserve.layers.quantization.projection_shapes import fused_projection_shapes, is_moe, projection_shapes
from fitserve.layers.quantization.quant_config import Int4Format

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds row 8c + AWQ_ORDER[i]
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int | None  # None: one tensor shared by every shard (g_idx, weight_shape)
    rows_per: int = 1


def param_specs(fmt: Int4Format, in_features: int, out_features: int) -> dict[str, ParamSpec]:
    k, n = in_features, out_features
    groups = k // fmt.group_for(k)
    i32, f32 = torch.int32, torch.float32
    if fmt.layout == "gptq":
        specs = {
            "qweight": ParamSpec((k // 8, n), i32, 1),
            "qzeros": ParamSpec((groups, n // 8), i32, 1, 8),
            "scales": ParamSpec((groups, n), f32, 1),
            "g_idx": ParamSpec((k,), i32, None),
        }
    elif fmt.layout == "awq":
        specs = {
            "qweight": ParamSpec((k, n // 8), i32, 1, 8),
            "qzeros": ParamSpec((groups, n // 8), i32, 1, 8),
            "scales": ParamSpec((groups, n), f32, 1),
        }
    else:
        specs = {
            "weight_packed": ParamSpec((n, k // 8), i32, 0),
            "weight_scale": ParamSpec((n, groups), f32, 0),
            "weight_shape": ParamSpec((2,), torch.int64, None),
        }
        if not fmt.symmetric:
            specs["weight_zero_point"] = ParamSpec(((n + 7) // 8, groups), i32, 0, 8)
        if fmt.act_order:
            specs["weight_g_idx"] = ParamSpec((k,), i32, None)
    return specs


def optional_params(fmt: Int4Format) -> frozenset[str]:
    """Tensors a checkpoint may leave out: GPTQ's g_idx without act order (it is then k // group_size)."""
    return frozenset() if fmt.act_order or fmt.layout != "gptq" else frozenset({"g_idx"})


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [A, B] -> uint8 [A, B, 8]: nibble j of each word (bits 4j..4j+3), low bits first."""
    if sys.byteorder != "little":
        return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF).to(torch.uint8)
    # little-endian: byte b of a word holds nibbles 2b (low half) and 2b + 1 (high half)
    data = packed.to(torch.int32).contiguous().view(torch.uint8).view(*packed.shape, 4)
    return torch.stack((data & 0xF, data >> 4), dim=-1).view(*packed.shape, 8)


def pack_zero_point_rows(zero_point: torch.Tensor) -> torch.Tensor:
    """An unpacked compressed-tensors zero point (signed int [N, G], N a multiple of 8, as writers before
    zero-point packing stored it) -> the packed int32 [N/8, G] form (values + 8, packed along the rows)."""
    codes = (zero_point.to(torch.int64) + 8) & 0xF
    grouped = codes.view(-1, 8, codes.shape[1])  # [N/8, 8, G]
    words = (grouped << (4 * torch.arange(8)).view(1, 8, 1)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def to_int4_weight(
    fmt: Int4Format, tensors: dict[str, torch.Tensor], in_features: int, name: str
) -> Int4Weight:
    """The layer's Int4Weight from its (fused) checkpoint tensors."""
    k = in_features
    group = fmt.group_for(k)
    if fmt.layout == "gptq":
        codes = unpack_rows(tensors["qweight"].t()).reshape(-1, k)  # [N, K/8, 8] -> [N, K]
        zeros = unpack_rows(tensors["qzeros"]).reshape(tensors["qzeros"].shape[0], -1).t()  # [N, G]
        zeros = ((zeros + fmt.zero_offset) & 0xF).float()  # v1: z - 1 stored in 4 bits (z = 0 wraps to 15)
        scales = tensors["scales"].t().contiguous()
        g_idx = tensors.get("g_idx")
    elif fmt.layout == "awq":
        order = torch.tensor(AWQ_ORDER)
        nibbles = unpack_rows(tensors["qweight"])  # [K, N/8, 8] in nibble order
        codes = torch.empty_like(nibbles)
        codes[..., order] = nibbles
        codes = codes.reshape(k, -1).t()
        zero_nibbles = unpack_rows(tensors["qzeros"])
        zeros = torch.empty_like(zero_nibbles)
        zeros[..., order] = zero_nibbles
        zeros = zeros.reshape(zero_nibbles.shape[0], -1).t().float()
        scales = tensors["scales"].t().contiguous()
        g_idx = None
    else:
        codes = unpack_rows(tensors["weight_packed"]).reshape(tensors["weight_packed"].shape[0], -1)[:, :k]
        scales = tensors["weight_scale"].contiguous()
        rows = scales.shape[0]
        if fmt.symmetric:
            zeros = torch.full(scales.shape, 8.0)
        else:
            packed = tensors["weight_zero_point"]  # [ceil(N/8), G] packed along the rows
            zeros = unpack_rows(packed.t()).reshape(packed.shape[1], -1)[:, :rows].t().float()
        g_idx = tensors.get("weight_g_idx")
    perm = act_order_from_g_idx(g_idx, group, name) if g_idx is not None else None
    if perm is not None:
        codes = codes[:, perm]
    weight = Int4Weight(codes.contiguous(), scales, zeros.contiguous(), group, perm)
    weight.check()
    return weight


def stored_int4_from_config(fmt: Int4Format, hf_config: Any) -> tuple[int, int] | None:
    """(parameters its quantized projections hold, their tensors' bytes as a checkpoint of `fmt` stores
    them: packed codes and zeros, g_idx (GPTQ writers store it even without act order), float16 scales)
    from config.json's shapes alone, for a folder without weight files (--load-format dummy); None for a
    config this does not size (MoE)."""
    gemma4 = _gemma4_quantized(fmt, hf_config)
    if gemma4 is not None:  # its experts one by one where the format quantizes them
        return _stored_int4(fmt, gemma4.values())
    qwen3_moe = _qwen3_moe_quantized(fmt, hf_config)
    if qwen3_moe is not None:  # its experts one by one (layers/moe_int4.py)
        return _stored_int4(fmt, qwen3_moe.values())
    qwen3_5 = _qwen3_5_quantized(fmt, hf_config)
    if qwen3_5 is not None:  # per-layer projections of its own, a MoE's experts one by one
        return _stored_int4(fmt, qwen3_5.values())
    if is_moe(hf_config):
        return None
    shapes = projection_shapes(hf_config)
    params = stored = 0
    for layer in range(hf_config.num_hidden_layers):
        for suffix, (in_features, out_features) in shapes.items():
            if not fmt.quantizes(f"model.layers.{layer}.{suffix}"):
                continue
            params += in_features * out_features
            for spec in param_specs(fmt, in_features, out_features).values():
                size = 2 if spec.dtype.is_floating_point else spec.dtype.itemsize
                stored += math.prod(spec.shape) * size
    return params, stored


def gpu_extra_from_config(fmt: Int4Format, hf_config: Any, dtype_bytes: int = 2) -> int:
    """Bytes the GPU form of the quantized projections (kernels/int4_repack.py: codes padded to 256 per
    row, a (scale, zero point) pair per group in the activation dtype, split-K counters, act order's
    permutation) takes beyond what the checkpoint stores (stored_int4_from_config); 0 for a config this
    does not size (MoE). Fused layers (q/k/v, gate/up) are repacked as one."""
    from fitserve.kernels.int4_repack import packed_int4_bytes

    sized = stored_int4_from_config(fmt, hf_config)
    if sized is None:
        return 0
    own = _qwen3_5_quantized(fmt, hf_config, fused=True)  # families with per-layer projections of their own
    if own is None:
        own = _gemma4_quantized(fmt, hf_config, fused=True)
    if own is None:
        own = _qwen3_moe_quantized(fmt, hf_config, fused=True)
    if own is not None:
        kept = sum(
            packed_int4_bytes(k, n, fmt.group_for(k), dtype_bytes) + (8 * k if fmt.act_order else 0)
            for k, n in own.values()
        )
        return max(0, kept - sized[1])
    fused = fused_projection_shapes(hf_config)
    kept = 0
    for layer in range(hf_config.num_hidden_layers):
        for suffix, (in_features, out_features) in fused.items():
            if fmt.quantizes(f"model.layers.{layer}.{suffix}"):
                kept += packed_int4_bytes(in_features, out_features, fmt.group_for(in_features), dtype_bytes)
                kept += 8 * in_features if fmt.act_order else 0
    return max(0, kept - sized[1])


def _qwen3_5_quantized(
    fmt: Int4Format, hf_config: Any, fused: bool = False
) -> dict[str, tuple[int, int]] | None:
    """A Qwen3.5 config's quantized projections (layer_projections.qwen3_5_quantized); None for any
    other config."""
    from fitserve.layers.quantization.layer_projections import is_qwen3_5, qwen3_5_quantized

    return qwen3_5_quantized(fmt, hf_config, fused) if is_qwen3_5(hf_config) else None


def _gemma4_quantized(
    fmt: Int4Format, hf_config: Any, fused: bool = False
) -> dict[str, tuple[int, int]] | None:
    """A Gemma-4 config's quantized projections (layer_projections.gemma4_quantized); None for any
    other config."""
    from fitserve.layers.quantization.layer_projections import gemma4_quantized, is_gemma4

    return gemma4_quantized(fmt, hf_config, fused) if is_gemma4(hf_config) else None


def _qwen3_moe_quantized(
    fmt: Int4Format, hf_config: Any, fused: bool = False
) -> dict[str, tuple[int, int]] | None:
    """A Qwen3-MoE config's quantized projections, experts included (layer_projections.qwen3_moe_quantized);
    None for any other config."""
    from fitserve.layers.quantization.layer_projections import is_qwen3_moe, qwen3_moe_quantized

    return qwen3_moe_quantized(fmt, hf_config, fused) if is_qwen3_moe(hf_config) else None


def _stored_int4(fmt: Int4Format, shapes: Any) -> tuple[int, int]:
    """(parameters, stored bytes) of the int4 projections of (in_features, out_features) `shapes`."""
    params = stored = 0
    for in_features, out_features in shapes:
        params += in_features * out_features
        for spec in param_specs(fmt, in_features, out_features).values():
            stored += math.prod(spec.shape) * (2 if spec.dtype.is_floating_point else spec.dtype.itemsize)
    return params, stored
