"""What a quantized checkpoint's MoE experts share (layers/moe_int4.py's int4, layers/moe_fp8.py's fp8): the
split of the experts over tensor-parallel ranks (layers/moe.py `expert_split`), the projections each
expert loads and which the checkpoint has given, the forward (a GPU kernel of the subclass's, else the
torch reference on the experts' dequantized weights) and its all-reduce."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fitserve.distributed.collectives import all_reduce
from fitserve.layers.moe import expert_split, kernel_activation

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        fmt: Any,
        prefix: str,
        expert_parallel: bool,
    ) -> None:
        """Sizes are the whole model's; subclasses hold this rank's experts or intermediate slice."""
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.activation, self.kernel_activation = activation, kernel_activation(activation)
        self.fmt, self.prefix = fmt, prefix
        self.split = split = expert_split(num_experts, intermediate_size, expert_parallel)
        self.tp_rank, self.expert_parallel = split.rank, split.expert_parallel
        self.local_experts, self.first_expert = split.local_experts, split.first_expert
        self.intermediate_per_rank = split.width
        self._done: set[tuple[int, str]] = set()  # (expert, projection) the checkpoint has given

    def _shape(self, projection: str) -> tuple[int, int]:
        """(in_features, out_features) of one whole expert projection."""
        if projection == "down_proj":
            return self.intermediate_size, self.hidden_size
        return self.hidden_size, self.intermediate_size

    def rank_start(self) -> int:
        """The first intermediate column this rank holds of each of its experts."""
        return 0 if self.expert_parallel else self.tp_rank * self.intermediate_per_rank

    def missing(self) -> list[str]:
        """What the checkpoint has not given yet (`experts.<e>.<projection>`), empty once all loaded."""
        return [
            f"{self.prefix}.{expert}.{projection}"
            for expert in range(self.num_experts)
            for projection in PROJECTIONS
            if (expert, projection) not in self._done
        ]

    def takes_shared_expert(self, x: torch.Tensor, shared: object) -> bool:
        """False: the quantized kernels add no shared expert (a MoE block runs it beside them)."""
        return False

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, reduce: bool = True
    ) -> torch.Tensor:
        """[T, hidden]: the whole MoE output (reduce=True), or this rank's partial sum (reduce=False)."""
        if x.is_cuda:
            out = self.run_kernels(x, topk_ids, topk_weights)  # the subclass's GPU kernels
        else:
            out = self.reference(x, topk_ids, topk_weights)
        return all_reduce(out) if reduce else out

    def run_kernels(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert `local`'s (gate_up [2W, hidden], down [hidden, W]) in float32."""
        raise NotImplementedError

    def reference(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        seen: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """This rank's partial output in torch: each (token, slot) pair of a local expert through that
        expert's dequantized weights (rounded to x's dtype), weighted and rounded, then each token's k rows
        summed (FusedExperts.reference's arithmetic). `seen`: what W8A8's GEMMs see of their inputs (x and
        the float32 intermediate, quantized): then the products run in float32 on the float32 weights, as
        the kernels' fp8 x fp8 products do, and the intermediate is not rounded to x's dtype."""
        dtype = x.dtype if seen is None else torch.float32
        seen = seen or (lambda values: values)
        num_tokens, top_k = topk_ids.shape
        rows = torch.zeros(num_tokens * top_k, self.hidden_size, dtype=x.dtype, device=x.device)
        flat = topk_ids.reshape(-1) - self.first_expert
        weights = topk_weights.reshape(-1, 1).float()
        for local in torch.unique(flat).tolist():
            if not 0 <= local < self.local_experts:
                continue
            pairs = (flat == local).nonzero().squeeze(1)
            w13, w2 = self.dequantized(local)
            block = seen(x.index_select(0, pairs // top_k).to(dtype))
            gate, up = torch.nn.functional.linear(block, w13.to(dtype)).chunk(2, dim=-1)
            result = torch.nn.functional.linear(seen(self.activation(gate) * up), w2.to(dtype))
            rows[pairs] = (result * weights[pairs]).to(x.dtype)
        return rows.view(num_tokens, top_k, self.hidden_size).sum(dim=1)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts} ({self.local_experts} here), hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size} ({self.intermediate_per_rank} here), "
            f"{self.fmt.describe()}"
        )
