"""The end of Qwen3.5/3.6's sparse MoE block in one kernel: the shared expert's one-output gate, its
sigmoid, the gated shared expert and the sum with the routed experts' output.

In torch that is the gate projection (a dot product per token: two cuBLAS launches), a sigmoid, a
multiply and an add: four to five launches a layer, each a few microseconds at a decode step's handful of
rows (models/qwen3_5_layers.py, Qwen3_5SparseMoeBlock). Here one program per token reads x, the gate's
weight row, the shared expert's and the routed experts' rows once.

Numbers as the torch ops round them in the activation dtype: g = round(x . w) (accumulated in float32,
as cuBLAS does, in another order), s = round(sigmoid(g)) (torch's sigmoid exactly: kernels/activation.py's
exp_as_torch and a rounded division), out = round(routed + round(s * shared)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.activation import exp_as_torch
from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import next_power_of_2


@host_launched
@triton.jit
def _shared_expert_gate_kernel(
    routed_ptr,
    shared_ptr,
    x_ptr,
    gate_weight_ptr,
    out_ptr,
    hidden_size,
    stride_routed,
    stride_shared,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    gate_weight = tl.load(gate_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a parameter
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    logit = tl.sum(x * gate_weight, axis=0).to(dtype).to(tl.float32)
    gate = tl.div_rn(1.0, 1.0 + exp_as_torch(-logit)).to(dtype).to(tl.float32)  # torch.sigmoid's numbers
    shared = tl.load(shared_ptr + row * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
    routed = tl.load(routed_ptr + row * stride_routed + cols, mask=mask, other=0.0).to(tl.float32)
    gated = (gate * shared).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (routed + gated).to(dtype), mask=mask)


def add_gated_shared_expert(
    routed: torch.Tensor, shared: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor
) -> torch.Tensor:
    """routed, shared, x [T, hidden] of one dtype (last dim contiguous), gate_weight [1, hidden] (the
    shared_expert_gate's weight) -> new [T, hidden]: routed + sigmoid(x @ gate_weight.T) * shared."""
    if (
        routed.dim() != 2
        or shared.shape != routed.shape
        or x.shape != routed.shape
        or gate_weight.shape != (1, routed.shape[-1])
        or len({routed.dtype, shared.dtype, x.dtype}) != 1
        or any(t.stride(-1) != 1 for t in (routed, shared, x, gate_weight))
    ):
        raise ValueError(
            "add_gated_shared_expert takes routed, shared and x [T, hidden] of one dtype and gate_weight "
            f"[1, hidden], last dims contiguous; got routed {tuple(routed.shape)} {routed.dtype}, shared "
            f"{tuple(shared.shape)} {shared.dtype}, x {tuple(x.shape)} {x.dtype}, gate_weight "
            f"{tuple(gate_weight.shape)} (strides {[t.stride() for t in (routed, shared, x, gate_weight)]})"
        )
    num_tokens, hidden_size = routed.shape
    out = torch.empty((num_tokens, hidden_size), dtype=routed.dtype, device=routed.device)
    if num_tokens == 0:
        return out
    block = next_power_of_2(hidden_size)
    _shared_expert_gate_kernel[(num_tokens,)](
        routed,
        shared,
        x,
        gate_weight,
        out,
        hidden_size,
        routed.stride(0),
        shared.stride(0),
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
        **pdl_kwargs(routed.device),
    )
    return out
