"""A mixture of experts' routing after its score projection, in one kernel: softmax over the experts,
the top k, renormalised over those k, times a per-expert scale (Gemma-4's router, layers ahead of
models/gemma4_layers.py's Gemma4Router) or rounded to the scores' dtype (Qwen3.5/3.6's sparse MoE block).

In torch that is seven launches per layer (softmax, topk, sum, divide, the scale's gather, multiply and
a cast), each a few microseconds at a decode step's handful of rows: on the 26B-A4B shape, ~200 of a
batch-1 step's ~600 launches. Here one program per token reads its E scores once.

Numbers as torch's ops give them: the softmax in float32 (exp(s - max) / sum), the k largest
probabilities in descending order (ties: the lowest expert id first; torch.topk leaves tie order
unspecified), each divided by their sum, then multiplied by the scale of its expert in float32; ids
int64 as torch.topk returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import host_launched
from fitserve.kernels.grid_math import next_power_of_2

MAX_EXPERTS = 1024


@host_launched
@triton.jit
def _router_topk_kernel(
    scores_ptr,
    expert_scale_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_scores,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr = True,
    ROUND_TO_SCORES_DTYPE: tl.constexpr = False,  # each weight rounded to the scores' dtype (Qwen3.5)
):
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    scores = tl.load(
        scores_ptr + row * stride_scores + experts, mask=experts < num_experts, other=-float("inf")
    ).to(tl.float32)
    exps = tl.exp(scores - tl.max(scores, axis=0))
    probabilities = exps / tl.sum(exps, axis=0)
    left = experts < num_experts
    top_values = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(tl.where(left, probabilities, -1.0), axis=0)
        best_id = tl.min(tl.where(left & (probabilities == best), experts, BLOCK_E), axis=0)
        left = left & (experts != best_id)
        top_values = tl.where(slots == slot, best, top_values)
        top_ids = tl.where(slots == slot, best_id, top_ids)
    in_top = slots < TOP_K
    total = tl.sum(tl.where(in_top, top_values, 0.0), axis=0)
    weights = top_values / total
    if HAS_SCALE:
        weights = weights * tl.load(expert_scale_ptr + top_ids, mask=in_top, other=0.0).to(tl.float32)
    if ROUND_TO_SCORES_DTYPE:
        weights = weights.to(scores_ptr.dtype.element_ty).to(tl.float32)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=in_top)
    tl.store(ids_ptr + row * TOP_K + slots, top_ids.to(tl.int64), mask=in_top)


def router_topk(
    scores: torch.Tensor,
    expert_scale: torch.Tensor | None,
    top_k: int,
    round_to_scores_dtype: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [T, E] (any float dtype, last dim contiguous), expert_scale [E] or None -> (weights float32
    [T, k], ids int64 [T, k]): the top k of softmax(scores) renormalised over the k, times
    expert_scale[id] (Gemma-4). round_to_scores_dtype: each weight rounded to the scores' dtype, as
    Qwen3.5's `(weights / weights.sum()).to(x.dtype)` rounds them (stored as float32 all the same)."""
    num_tokens, num_experts = scores.shape if scores.dim() == 2 else (0, 0)
    if (
        scores.dim() != 2
        or scores.stride(-1) != 1
        or (expert_scale is not None and expert_scale.shape != (num_experts,))
        or not 1 <= top_k <= num_experts <= MAX_EXPERTS
    ):
        raise ValueError(
            f"router_topk takes scores [T, E] with a contiguous last dim, expert_scale [E] or None and 1 <= "
            f"top_k <= E <= {MAX_EXPERTS}; got scores {tuple(scores.shape)} (strides {scores.stride()}), "
            f"expert_scale {None if expert_scale is None else tuple(expert_scale.shape)}, top_k {top_k}"
        )
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=scores.device)
    if num_tokens == 0:
        return weights, ids
    block_e = next_power_of_2(num_experts)
    _router_topk_kernel[(num_tokens,)](
        scores,
        scores if expert_scale is None else expert_scale,
        weights,
        ids,
        num_experts,
        scores.stride(0),
        TOP_K=top_k,
        BLOCK_K=next_power_of_2(top_k),
        BLOCK_E=block_e,
        HAS_SCALE=expert_scale is not None,
        ROUND_TO_SCORES_DTYPE=round_to_scores_dtype,
        num_warps=4 if block_e >= 512 else 2 if block_e >= 128 else 1,
        **pdl_kwargs(scores.device),
    )
    return weights, ids
