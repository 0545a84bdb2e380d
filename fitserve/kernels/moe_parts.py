"""What the grouped MoE kernels (kernels/fused_moe.py, kernels/fused_moe_int4.py) and the decode-sized ones
(kernels/moe_decode.py) share: the tile type, the activation constexprs and their Triton code, a block of
the sorted pairs, the dot that keeps float32 exact, and the launch (the interpreter's, or a compiled
kernel's with programmatic dependent launch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs
from fitserve.kernels.fast_launch import INTERPRETING
from fitserve.kernels.fp8_bits import stored_values

# Activation constexprs of the gate_up kernels' epilogues.
SILU, GELU_TANH, GELU = 0, 1, 2
ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU}


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu
        return x / (1.0 + tl.exp(-x))
    elif ACTIVATION == 1:  # gelu, tanh approximation: 0.5 x (1 + tanh(z)) = x * sigmoid(2 z)
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(-2.0 * z))
    else:  # gelu
        return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def pair_block(sorted_pairs_ptr, block_expert_ptr, block_m, num_pairs, BLOCK_M: tl.constexpr):
    """Block `block_m` of the grouped kernels' sorted pairs (kernels/fused_moe.py moe_route): its expert,
    its rows, each row's (token, slot) pair and which rows hold one (the others are padding)."""
    expert = tl.load(block_expert_ptr + block_m).to(tl.int64)
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    return expert, rows, pair, pair < num_pairs


@triton.jit
def dot(a, b, acc, FP32: tl.constexpr):
    """acc + a @ b; float32 inputs exactly (no TF32), for the tests' tight checks."""
    if FP32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


def launch(kernel, grid, args, constexprs: dict, device: torch.device, num_warps: int) -> None:
    if INTERPRETING:  # the interpreter runs the JIT function itself, without launch options
        kernel[grid](*args, **constexprs, USE_PDL=False)
        return
    kernel[grid](*args, **constexprs, num_warps=num_warps, **pdl_kwargs(device))


@triton.jit
def scaled_step(
    acc, a, a_scale, w_tile, s_rows, k, GROUP_K: tl.constexpr, PER_ROW: tl.constexpr, A_FP8: tl.constexpr, ok
):
    """acc + a @ dequantized(w_tile).T for one BLOCK_K step at column k of fp8 weights (Fp8Experts' rows
    from s_rows, each row's first scale; ok: which rows are real). W8A16: the tile's e4m3 values in
    a's dtype, and with column groups the step's partial product times its group's scale (per row:
    later). W8A8 (A_FP8: a fp8, a_scale [BLOCK_M] its rows' scales of this step's group): the fp8 product
    on the tensor cores, times the rows' scales and, with column groups, the weight's."""
    # if / else throughout: Triton compiles the statements after a returning `if` even when a constexpr
    # condition took it (an fp8 x bf16 tl.dot there does not compile)
    if A_FP8:
        part = tl.dot(a, tl.trans(w_tile))
        if PER_ROW:
            acc = acc + part * a_scale[:, None]
        else:
            scale = tl.load(s_rows + k // GROUP_K, mask=ok, other=0.0)
            acc = acc + part * (a_scale[:, None] * scale[None, :])
    else:
        w = stored_values(w_tile, a.dtype)  # bytes (below 8.9, beside bfloat16) decoded, else converted
        if PER_ROW:
            acc = tl.dot(a, tl.trans(w), acc)
        else:
            scale = tl.load(s_rows + k // GROUP_K, mask=ok, other=0.0)
            acc = acc + tl.dot(a, tl.trans(w)) * scale[None, :]
    return acc


@dataclass(frozen=True)
class Fp8Experts:
    """One projection of every local expert in fp8 (kernels/fused_moe_fp8.py, moe_decode.py): data
    float8_e4m3fn [E, N, K], scale float32 [E, N, G] with G = ceil(K / group_k) (1 for a scale a row)."""

    data: torch.Tensor
    scale: torch.Tensor
    group_k: int

    def step_k(self, tile_k: int, activation_group: int | None = None) -> tuple[int, bool]:
        """(BLOCK_K, PER_ROW): with column groups (of the weight, or W8A8's activation groups) the largest
        power of two up to tile_k that divides them, so that a step never straddles two scales; PER_ROW:
        one weight scale a row."""
        per_row = self.group_k >= self.data.shape[2]
        groups = ([] if per_row else [self.group_k]) + ([activation_group] if activation_group else [])
        block_k = tile_k
        while any(group % block_k for group in groups):
            block_k //= 2
        return block_k, per_row
