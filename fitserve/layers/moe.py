"""Mixture-of-experts experts: the one module a fused MoE kernel (token sorting by expert, grouped GEMM,
top-k weighting fused) replaces later.

`experts(x [T, hidden], topk_ids [T, k], topk_weights [T, k]) -> [T, hidden]`: each token's output is the
weighted sum over its k experts of down_e(act(gate_e(x)) * up_e(x)). The weights are stored as the HF
checkpoints store them, all experts in one tensor each:
  gate_up_proj [E, 2 * intermediate, hidden]  (gate rows, then up rows)
  down_proj    [E, hidden, intermediate]
This implementation is plain torch (the CPU path and the GPU reference): tokens are grouped by expert
with one sort, each expert that has tokens runs two matmuls over its rows, and each token's k weighted
rows are summed. Only the experts some token chose are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fitserve.layers.linear import default_weight_loader


class FusedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False
        )
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // top_k)  # each pair's token, in expert order
        weights = topk_weights.reshape(-1)[order, None]  # float32: each row is weighted, then cast back
        routed = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            block = rows[start : start + count]
            gate, up = torch.nn.functional.linear(block, self.gate_up_proj[expert]).chunk(2, dim=-1)
            result = torch.nn.functional.linear(self.activation(gate) * up, self.down_proj[expert])
            routed[start : start + count] = (result * weights[start : start + count]).to(routed.dtype)
            start += count
        # back to (token, slot) order, then each token's k weighted rows summed
        unsorted = torch.empty_like(routed)
        unsorted[order] = routed
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"
