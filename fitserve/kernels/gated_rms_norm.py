"""Gated DeltaNet's output norm in one kernel: the core output cast to the model dtype, RMS-normed per value
head, times the stored weight, times silu(gate), written as the [T, heads * head_dim] rows out_proj reads.

The torch path (models/qwen3_5_delta_net.py: `core.to(hidden.dtype)` in GatedDeltaNet.forward, then
GatedRMSNorm.forward) takes a dozen launches a layer; this one reproduces its numbers exactly, rounding to
the model dtype where each of its ops rounds:
    x = round(core)                                   the cast to the model dtype
    normed = round(x * (mean(x^2) + eps)^-0.5)        in float32
    t = round(weight * normed)                        the weight in the model dtype: a dtype product
    out = round(t * silu(gate))                       silu in float32, as F.silu(gate.float())
(round: to the model dtype; the identity in float32). silu is x / (1 + exp(-x)) with the CUDA math
library's exp (activation.exp_as_torch) and the mean a sum over head_dim divided by it, IEEE-rounded
divisions as torch's (Triton's `/` is an approximate one on CUDA). The sum of squares adds in another
order than torch's, so a row's float32 mean can be an ulp apart and, rarely, a value round the other way.

Grid: (tokens, head blocks), each program BLOCK_H heads of one token (grid_math.heads_per_program: a
tile of ~1024 values), so a batch-1 step of 48 value heads x 128 is 6 programs and an 8192-token prefill
step ~49k, each reading its heads' rows in one pass. On an H200 (bf16, 48 x 128): batch 1 in a CUDA graph
1.4 us against the torch path's 22.7; 8192 tokens 112 us against 1283 (~3.6 TB/s). Against torch's CUDA
path: equal at batch 1 and 64 (bf16); at 8192 tokens 86 of 50M values one bf16 ulp apart (938 in fp16),
where torch's own CPU and CUDA paths differ in 295 (3193).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.activation import exp_as_torch
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import cdiv, heads_per_program, next_power_of_2

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_TILE = 1024  # values a program holds: as many whole heads as fit (grid_math.heads_per_program)


@host_launched
@triton.jit
def _gated_rms_norm_kernel(
    core_ptr,
    gate_ptr,
    weight_ptr,
    out_ptr,
    num_heads,
    stride_core_token,
    stride_core_head,
    stride_gate_token,
    stride_gate_head,
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < HEAD_DIM
    # the norm's weight is a parameter, never written during a step: read before the wait
    # (kernels/dependent_launch.py)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    dtype = out_ptr.dtype.element_ty
    core = tl.load(
        core_ptr + token * stride_core_token + heads[:, None] * stride_core_head + cols[None, :],
        mask=mask,
        other=0.0,
    )
    x = core.to(dtype).to(tl.float32)
    variance = tl.div_rn(tl.sum(x * x, axis=1), HEAD_DIM * 1.0)
    normed = (x * tl.rsqrt(variance + eps)[:, None]).to(dtype).to(tl.float32)
    scaled = (weight[None, :] * normed).to(dtype).to(tl.float32)
    gate = tl.load(
        gate_ptr + token * stride_gate_token + heads[:, None] * stride_gate_head + cols[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    silu = tl.div_rn(gate, 1.0 + exp_as_torch(-gate))
    out = out_ptr + token * (num_heads * HEAD_DIM) + heads[:, None] * HEAD_DIM + cols[None, :]
    tl.store(out, (scaled * silu).to(dtype), mask=mask)


def _num_warps(tile: int) -> int:
    return 4 if tile <= 1024 else 8 if tile <= 4096 else 16


def gated_rms_norm(
    core: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """GatedRMSNorm(core.to(dtype), gate) of models/qwen3_5_delta_net.py, as a new contiguous [T, H * D]
    tensor in `dtype` (the model dtype: float16, bfloat16 or float32).

    core [T, H, D] in float32 or `dtype` (the gated delta rule's output), last dim contiguous; gate
    [T, H, D] or [T, H * D] in `dtype` (in_proj_z's output, a strided view is fine), last dim contiguous;
    weight [D] in `dtype` (the norm's stored weight, used as is). Reads no host data: CUDA-graph safe."""
    if dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"gated_rms_norm computes in float16, bfloat16 or float32; got dtype {dtype}")
    if core.dim() != 3 or core.stride(-1) != 1:
        raise ValueError(
            f"gated_rms_norm takes core [T, H, D] with a contiguous last dim; got core {tuple(core.shape)} "
            f"(strides {core.stride()})"
        )
    num_tokens, num_heads, head_dim = core.shape
    if gate.shape not in ((num_tokens, num_heads, head_dim), (num_tokens, num_heads * head_dim)):
        raise ValueError(
            f"gated_rms_norm needs gate [T, H, D] = {tuple(core.shape)} or [T, H * D] = "
            f"{(num_tokens, num_heads * head_dim)} like core; got gate {tuple(gate.shape)}"
        )
    if gate.stride(-1) != 1:
        raise ValueError(
            f"gated_rms_norm needs gate's last dim contiguous; got gate {tuple(gate.shape)} with strides "
            f"{gate.stride()} (pass in_proj_z's output or a view of it)"
        )
    if weight.shape != (head_dim,):
        raise ValueError(
            f"gated_rms_norm needs weight [D] = [{head_dim}] (one per head dim); got weight "
            f"{tuple(weight.shape)}"
        )
    if core.dtype not in (torch.float32, dtype) or gate.dtype != dtype or weight.dtype != dtype:
        raise ValueError(
            f"gated_rms_norm needs core in float32 or {dtype} and gate and weight in {dtype} (the model "
            f"dtype); got core {core.dtype}, gate {gate.dtype}, weight {weight.dtype}"
        )
    out = torch.empty((num_tokens, num_heads * head_dim), dtype=dtype, device=core.device)
    if out.numel() == 0:
        return out
    gate_token_stride = gate.stride(0)
    gate_head_stride = gate.stride(1) if gate.dim() == 3 else head_dim
    block_d = next_power_of_2(head_dim)
    block_h = heads_per_program(num_heads, block_d, HEAD_TILE)
    _gated_rms_norm_kernel[(num_tokens, cdiv(num_heads, block_h))](
        core,
        gate,
        weight,
        out,
        num_heads,
        core.stride(0),
        core.stride(1),
        gate_token_stride,
        gate_head_stride,
        eps,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=_num_warps(block_h * block_d),
        **pdl_kwargs(core.device),
    )
    return out
