"""Mixture-of-experts experts: the one module a fused MoE kernel (token sorting by expert, grouped GEMM,
top-k weighting fused) replaces later.

`experts(x [T, hidden], topk_ids [T, k], topk_weights [T, k]) -> [T, hidden]`: each token's output is the
weighted sum over its k experts of down_e(act(gate_e(x)) * up_e(x)). The weights are stored as the HF
checkpoints store them, all experts in one tensor each:
  gate_up_proj [E, 2 * intermediate, hidden]  (gate rows, then up rows)
  down_proj    [E, hidden, intermediate]
On CUDA `forward` runs fitserve/kernels/fused_moe.py: routing on the GPU, two grouped GEMMs (act(gate) * up
fused into the first) and a sum of each token's k weighted rows, with no host sync, so decode steps are
captured in CUDA graphs; at batch 1 only the k chosen experts' weights are read. `reference` is plain torch
(the CPU path and the kernel's reference): tokens are grouped by expert with one sort, each expert that has
tokens runs two matmuls over its rows (a host sync: the per-expert counts), and each token's k weighted
rows are summed. Only the experts some token chose are read.

Tensor parallel (distributed/parallel_state.py), rank r of n; the weight loaders take the whole
checkpoint tensors and keep the rank's part:
- by default each expert's intermediate dim is split (as a column-parallel gate/up and a row-parallel
  down): rank r holds intermediate rows [r * I/n, (r+1) * I/n) of every expert's gate and of its up
  (gate_up_proj [E, 2 * I/n, hidden]) and those columns of down (down_proj [E, hidden, I/n]);
- with expert parallel (`expert_parallel=True`, --enable-expert-parallel) the experts are split: rank r
  holds experts [r * E/n, (r+1) * E/n) whole. The router runs on every rank (every rank has every
  token), so each rank computes its experts' share of every token's output.
Either way a rank's output is a partial sum: the ranks' outputs summed (one all-reduce) give the MoE
output. `forward(..., reduce=True)` does that all-reduce; a caller that sums it with another partial
output first (the dense MLP beside it) passes reduce=False and reduces once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from fitserve.distributed.collectives import all_reduce
from fitserve.distributed.parallel_state import tp
from fitserve.layers.linear import WholeTensor, default_weight_loader, whole_tensor
from fitserve.layers.tp_shards import split_evenly

if TYPE_CHECKING:
    from fitserve.kernels.moe_decode import SharedExpert


def kernel_activation(activation: Callable[[torch.Tensor], torch.Tensor]) -> str | None:
    """The fused kernel's name for `activation` ("silu", "gelu_tanh", "gelu"), found by evaluating it on a
    few points (the models pass lambdas as well as torch functions); None when it is none of them."""
    probe = torch.linspace(-8.0, 8.0, 161, dtype=torch.float64, device="cpu")
    try:
        values = activation(probe)
    except (RuntimeError, TypeError):
        return None
    candidates = {
        "silu": torch.nn.functional.silu(probe),
        "gelu_tanh": torch.nn.functional.gelu(probe, approximate="tanh"),
        "gelu": torch.nn.functional.gelu(probe),
    }
    for name, expected in candidates.items():
        if isinstance(values, torch.Tensor) and torch.allclose(values, expected, rtol=1e-9, atol=1e-12):
            return name
    return None


def experts_per_rank(num_experts: int, size: int) -> int:
    """E / n under expert parallel, or ValueError naming E, n and the fix."""
    if num_experts % size:
        raise ValueError(
            f"expert parallel splits the model's {num_experts} experts across tensor_parallel_size={size} "
            f"ranks, but {num_experts} is not divisible by {size}: choose a --tensor-parallel-size that "
            f"divides {num_experts}, or drop --enable-expert-parallel (each expert's intermediate size is "
            "split across the ranks instead)"
        )
    return num_experts // size


@dataclass(frozen=True)
class ExpertSplit:
    """This tensor-parallel rank's share of a MoE layer's experts."""

    rank: int
    size: int
    expert_parallel: bool  # whole experts per rank (--enable-expert-parallel, more than one rank)
    local_experts: int
    first_expert: int
    width: int  # each local expert's intermediate columns (all of them under expert parallel)


def expert_split(num_experts: int, intermediate_size: int, expert_parallel: bool) -> ExpertSplit:
    """Under expert parallel E / n whole experts a rank, else every expert's I / n intermediate columns;
    ValueError naming the sizes and the fix when n does not divide them."""
    state = tp()
    parallel = expert_parallel and state.size > 1
    if parallel:
        local, width = experts_per_rank(num_experts, state.size), intermediate_size
    else:
        what = "the MoE experts' intermediate size (moe_intermediate_size)"
        local, width = num_experts, split_evenly(intermediate_size, state.size, what)
    first = state.rank * local if parallel else 0
    return ExpertSplit(state.rank, state.size, parallel, local, first, width)


class FusedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        expert_parallel: bool = False,
    ) -> None:
        """Sizes are the whole model's; the parameters hold this rank's experts or intermediate slice."""
        super().__init__()
        split = expert_split(num_experts, intermediate_size, expert_parallel)
        self.tp_rank, self.tp_size = split.rank, split.size
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.kernel_activation = kernel_activation(activation)
        self.expert_parallel = split.expert_parallel
        self.local_experts, self.intermediate_per_rank = split.local_experts, split.width
        self.first_expert = split.first_expert
        local, width = self.local_experts, self.intermediate_per_rank
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * width, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, width), requires_grad=False)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def rank_part(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor (gate_up_proj [E, 2I, hidden] or down_proj
        [E, hidden, I]): its experts, or every expert's intermediate slice."""
        if self.tp_size == 1:
            return loaded_weight
        if loaded_weight.shape[0] != self.num_experts:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, but the model has "
                f"{self.num_experts} experts: the checkpoint does not match the model's config.json"
            )
        if self.expert_parallel:
            return loaded_weight.narrow(0, self.first_expert, self.local_experts)
        return self._width_part(param, loaded_weight)

    def _width_part(self, param: nn.Parameter, weights: torch.Tensor) -> torch.Tensor:
        """This rank's intermediate slice of `weights`, whose last two dims are one expert's gate_up_proj
        [2I, hidden] or down_proj [hidden, I] (all the experts' stacked before them, or just the one)."""
        width, start = self.intermediate_per_rank, self.tp_rank * self.intermediate_per_rank
        if param is self.down_proj:
            return weights.narrow(-1, start, width)
        whole = self.intermediate_size
        if weights.shape[-2] != 2 * whole:
            raise ValueError(
                f"checkpoint tensor has shape {tuple(weights.shape)}, but gate_up_proj has "
                f"2 x {whole} rows per expert: the checkpoint does not match the model's config.json"
            )
        gate = weights.narrow(-2, start, width)
        up = weights.narrow(-2, whole + start, width)
        return torch.cat((gate, up), dim=-2)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, self.rank_part(param, loaded_weight))

    def whole_tensors(self) -> list[WholeTensor]:
        """For dummy weights, each of this rank's experts' whole tensors, one expert at a time as a
        per-expert checkpoint holds them (gate and up rows [2I, hidden], down [hidden, I]): with expert
        parallel a rank draws only its own experts; otherwise every expert, cut to its intermediate slice."""
        shapes = {
            "gate_up_proj": (2 * self.intermediate_size, self.hidden_size),
            "down_proj": (self.hidden_size, self.intermediate_size),
        }
        tensors = []
        for local in range(self.local_experts):
            expert = self.first_expert + local
            for name, shape in shapes.items():
                param = getattr(self, name)

                def cut(whole: torch.Tensor, param: nn.Parameter = param) -> torch.Tensor:
                    return whole if self.expert_parallel else self._width_part(param, whole)

                tensors.append(whole_tensor(param, f"{name}.{expert}", shape, param[local], cut))
        return tensors

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        reduce: bool = True,
        shared: SharedExpert | None = None,
    ) -> torch.Tensor:
        """[T, hidden]: the whole MoE output (reduce=True), or this rank's partial sum (reduce=False).
        shared: a shared expert to add, with its gate, in the same kernels (only where
        `takes_shared_expert` said so)."""
        if x.is_cuda and self.kernel_activation is not None:
            from fitserve.kernels.fused_moe import fused_moe

            out = fused_moe(
                x,
                self.gate_up_proj,
                self.down_proj,
                topk_ids,
                topk_weights,
                self.kernel_activation,
                first_expert=self.first_expert,
                shared=shared,
            )
        else:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"FusedExperts: the activation {self.activation!r} has no fused CUDA kernel (it takes "
                    "silu, gelu with the tanh approximation and gelu), and the torch path syncs with the "
                    "host, so it cannot be captured in a CUDA graph: run with --enforce-eager"
                )
            out = self.reference(x, topk_ids, topk_weights)
        return all_reduce(out) if reduce else out

    def takes_shared_expert(self, x: torch.Tensor, shared: SharedExpert) -> bool:
        """Whether forward can add this shared expert in its own kernels for x: a decode-sized CUDA batch
        (kernels/moe_decode.py) whose shared expert has 16-bit weights in x's dtype, on the GPU, as wide
        as this rank's experts."""
        if not (x.is_cuda and self.kernel_activation is not None):
            return False
        from fitserve.kernels import moe_decode

        tensors = (shared.gate_up_proj, shared.down_proj, shared.gate_weight)
        return (
            moe_decode.takes(x.shape[0], with_shared=True)
            and all(t.is_cuda and t.dtype == x.dtype for t in tensors)
            and shared.gate_up_proj.shape == (2 * self.intermediate_per_rank, self.hidden_size)
            and shared.down_proj.shape == (self.hidden_size, self.intermediate_per_rank)
            and shared.gate_weight.numel() == self.hidden_size
        )

    def reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's partial output [T, hidden] in plain torch (the CPU path and the kernel's reference)."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        if self.expert_parallel:  # only the (token, slot) pairs routed to this rank's experts
            local_ids = flat_ids - self.first_expert
            pairs = ((local_ids >= 0) & (local_ids < self.local_experts)).nonzero().squeeze(1)
            local_ids = local_ids.index_select(0, pairs)
            order = pairs.index_select(0, torch.argsort(local_ids, stable=True))
            counts = torch.bincount(local_ids, minlength=self.local_experts).tolist()
        else:
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
        # back to (token, slot) order (zeros for pairs another rank's experts serve), then each token's k
        # weighted rows summed
        unsorted = (torch.zeros if self.expert_parallel else torch.empty)(
            num_tokens * top_k, x.shape[-1], dtype=routed.dtype, device=routed.device
        )
        unsorted[order] = routed
        return unsorted.view(num_tokens, top_k, -1).sum(dim=1)

    def extra_repr(self) -> str:
        split = ""
        if self.tp_size > 1:
            split = (
                f", experts {self.first_expert}..{self.first_expert + self.local_experts - 1} on this rank"
                if self.expert_parallel
                else f", intermediate {self.intermediate_per_rank} per rank"
            )
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"
            + split
        )
