"""Qwen3.5 / Qwen3.6 decoder layers, computed as transformers' modeling_qwen3_5(_moe).py computes them.

- RMSNorm (layer norms, q/k norms, the final norm): x * (mean(x^2) + eps)^-0.5 in float32 times
  (1 + weight): the checkpoints store the offset from 1 (zeros at init).
- full_attention: q_proj gives, per head, the query and then a gate of head_dim each; q and k are
  RMS-normed per head, then rotated on their first head_dim x partial_rotary_factor dims (rotate-half
  pairs within those; the mrope sections of the multimodal model all carry the 1-D position for text, so
  they are plain RoPE here); softmax attention over the paged KV cache, scale head_dim^-0.5; the output
  times sigmoid(gate), then o_proj.
- linear_attention (Gated DeltaNet): models/qwen3_5_delta_net.py; the decoder layer that holds either kind
  with the MLP or the MoE block: models/qwen3_5_decoder.py.
- MLP: down(silu(gate(x)) * up(x)); the MoE block: softmax router over all experts, top-k renormalised,
  the experts (layers/moe.py) plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

Tensor parallel (rank r of n, as vLLM splits these layers; layers/tp_shards.py):
- full_attention: q_proj (query and gate, packed per head) column-parallel by heads; k_proj and v_proj by
  KV heads, replicated when there are fewer than ranks; q/k norms replicated; o_proj row-parallel.
- MLP: gate_up column-parallel, down row-parallel. MoE: the router and the shared expert's one-output gate
  replicated (every rank needs the softmax over all experts, and the gate is one row); the experts split
  their intermediate dim, or the experts themselves with --enable-expert-parallel (layers/moe.py); the
  shared expert splits like the dense MLP. The routed and the shared partial outputs are summed on each
  rank and all-reduced once per layer.
Embedding and LM head are vocab-parallel (models/qwen3_5.py).

On CUDA (FUSED_ON_CUDA) the torch ops between the projections run as kernels that round as those ops
round: the norms (kernels/norm.py, with the residual add), the q/k norms with the partial rotation
(kernels/qk_norm_partial_rope.py), the output gate and the MLP's activation (kernels/activation.py),
DeltaNet's gated norm (kernels/gated_rms_norm.py), the MoE routing (kernels/moe_router.py) and the shared
expert's gate with the sum (kernels/shared_expert_gate.py); the CPU keeps the torch ops (HF's reference).

Quantized checkpoints: every linear of the full layers (q_proj, k_proj, v_proj, o_proj), of the DeltaNet
layers (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) and of the MLP or the MoE's shared expert
(gate_up_proj fused from gate_proj and up_proj, down_proj) takes the
format's linear method (layers/quantization/methods.py: int4, fp8 or bitsandbytes 4-bit), or none where the
checkpoint's ignore list leaves the module in 16 bits (`linear_method_of`). The norms, the conv1d, A_log and
dt_bias stay in the model dtype, as every Qwen3.5 quantized checkpoint stores them. A MoE's experts run
int4 from an int4 checkpoint (layers/moe_int4.py; other formats are refused before building,
models/qwen3_5_config.refuse_quantized_moe); its router and the shared expert's gate stay 16-bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.distributed.collectives import all_reduce
from fitserve.distributed.parallel_state import tp
from fitserve.layers.attention.layer import Attention
from fitserve.layers.linear import (
    ColumnParallelLinear,
    LinearMethod,
    MergedColumnParallelLinear,
    PackedColumnLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from fitserve.layers.quantization.methods import linear_method_for
from fitserve.layers.tp_shards import first_kv_head, kv_heads_per_rank, split_evenly
from fitserve.models.gemma4_config import expert_parallel_of
from fitserve.models.moe_experts_format import layer_experts

if TYPE_CHECKING:
    from fitserve.kernels.moe_decode import SharedExpert

# On CUDA the norms, the q/k rotation, the gates and the MoE routing run as fused Triton kernels (a batch-1
# step of the 27B went from 3,462 launches to 1,069); False runs the torch ops there too (tests compare).
FUSED_ON_CUDA = True


def use_fused_kernels(x: torch.Tensor) -> bool:
    return FUSED_ON_CUDA and x.is_cuda


def filled_parameter(
    shape: tuple[int, ...], fill: float, loader: Any = default_weight_loader
) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


KV_SHARD = "kv"  # KvHeadsLinear's one shard id


class KvHeadsLinear(PackedColumnLinear):
    """k_proj or v_proj of the full layers: `num_kv_heads` heads of head_dim rows, split across the ranks,
    or each replicated on n / heads ranks when there are fewer heads than ranks (layers/tp_shards.py).

    A packed layer of one shard, KV_SHARD, whose rows on a rank start at its first head: a quantized
    method cuts a rank's rows of each checkpoint tensor by the shard's `shard_rank_rows` (tp_split.py), so
    the checkpoint's tensors load with that shard id (models/qwen3_5.py)."""

    def __init__(
        self,
        input_size: int,
        head_dim: int,
        num_kv_heads: int,
        bias: bool,
        linear_method: LinearMethod | None = None,
    ) -> None:
        state = tp()
        self.head_dim = head_dim
        self.num_heads = kv_heads_per_rank(num_kv_heads, state.size)
        self.first_head = first_kv_head(num_kv_heads, state.rank, state.size)
        rows = self.num_heads * head_dim
        super().__init__(
            input_size,
            {KV_SHARD: (0, num_kv_heads * head_dim)},
            bias,
            linear_method,
            rank_offsets={KV_SHARD: (0, rows)},
        )

    def shard_rank_rows(self, shard_id: object) -> tuple[int, int]:
        return self.first_head * self.head_dim, self.num_heads * self.head_dim


def linear_method_of(
    quant: Any, config: Any, layer_idx: int, block: str, layer: str, modules: tuple[str, ...]
) -> LinearMethod | None:
    """The linear method of `model.layers.<i>.<block>.<layer>` (None: unquantized) for the checkpoint's
    format `quant`, fused from its linear `modules`. The format's ignore list is matched against both the
    names the checkpoint gives them (a ConditionalGeneration checkpoint's `model.language_model.layers...`,
    as its quantization_config lists them) and the names they are read as (`model.layers...`): a module
    either name leaves out stays unquantized."""
    if quant is None:
        return None
    name = f"model.layers.{layer_idx}.{block}"
    stored = f"{getattr(config, 'weights_prefix', 'model.')}layers.{layer_idx}.{block}"
    method = linear_method_for(quant, f"{name}.{layer}", [f"{stored}.{module}" for module in modules])
    if method is None or stored == name:
        return method
    if linear_method_for(quant, f"{name}.{layer}", [f"{name}.{module}" for module in modules]) is None:
        return None
    return method


def check_activation(name: str) -> None:
    if name != "silu":
        raise ValueError(f"hidden_act={name!r} is not supported for Qwen3.5: its checkpoints use 'silu'")


class Qwen3_5RMSNorm(nn.Module):
    """RMSNorm times (1 + weight), in float32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = filled_parameter((dim,), 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, dim] or [T, heads, dim] (a strided view is fine) -> a new tensor."""
        if use_fused_kernels(x):  # one kernel (torch: ~8 launches)
            from fitserve.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, weight_offset=1.0, round_normed=False)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum rounded to the dtype first as HF's add rounds it. On
        CUDA one kernel working in place: x and residual are overwritten (the caller reads neither again)."""
        if use_fused_kernels(x):
            from fitserve.kernels.norm import fused_add_rms_norm

            return fused_add_rms_norm(
                x, residual, self.weight, self.eps, weight_offset=1.0, round_normed=False
            )
        summed = residual + x
        return self(summed), summed


class PartialRope:
    """One step's cos/sin [T, rotary_dim] for the full layers: rotate-half RoPE on the first rotary_dim
    dims of each head, the rest passed through."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> None:
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        self.cos = angles.cos().to(dtype).unsqueeze(1)
        self.sin = angles.sin().to(dtype).unsqueeze(1)
        self.rotary_dim = angles.shape[-1]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] -> rotated copy."""
        rotated, passed = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        first, second = rotated.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)
        return torch.cat((rotated * self.cos + turned * self.sin, passed), dim=-1)


def rope_inv_freq(config: Any) -> torch.Tensor:
    rope = config.rope_parameters
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported for Qwen3.5: its checkpoints use 'default' "
            "(set rope_parameters.rope_type to 'default' or serve the model without RoPE scaling)"
        )
    rotary_dim = int(config.head_dim * float(rope["partial_rotary_factor"]))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (float(rope["rope_theta"]) ** exponents)


class Qwen3_5Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, quant: Any = None) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        self.head_dim = int(config.head_dim)
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
        # this rank's heads (all of them at tensor_parallel_size 1)
        self.num_heads = split_evenly(heads, tp().size, "the number of attention heads")

        def method(name: str) -> LinearMethod | None:
            return linear_method_of(quant, config, layer_idx, "self_attn", name, (name,))

        # rows [query | gate] per head, so a split by heads keeps each head's pair on one rank
        self.q_proj = ColumnParallelLinear(
            hidden, heads * self.head_dim * 2, bias=bias, linear_method=method("q_proj")
        )
        self.k_proj = KvHeadsLinear(hidden, self.head_dim, kv_heads, bias, method("k_proj"))
        self.v_proj = KvHeadsLinear(hidden, self.head_dim, kv_heads, bias, method("v_proj"))
        self.num_kv_heads = self.k_proj.num_heads
        self.o_proj = RowParallelLinear(
            heads * self.head_dim, hidden, bias=bias, linear_method=method("o_proj")
        )
        self.q_norm = Qwen3_5RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Qwen3_5RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx
        )

    def forward(self, hidden: torch.Tensor, rope: PartialRope) -> torch.Tensor:
        tokens = hidden.shape[0]
        query_gate = self.q_proj(hidden).view(tokens, self.num_heads, 2 * self.head_dim)
        # fused: the q/k norms and the rotation in one kernel, the output gate in another
        if use_fused_kernels(hidden):
            from fitserve.kernels.activation import sigmoid_gate_mul
            from fitserve.kernels.qk_norm_partial_rope import qk_norm_partial_rope

            k = self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
            q, k = qk_norm_partial_rope(
                query_gate,
                k,
                self.q_norm.weight,
                self.k_norm.weight,
                self.q_norm.eps,
                rope.cos.squeeze(1),
                rope.sin.squeeze(1),
            )
            v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
            return self.o_proj(sigmoid_gate_mul(self.attn(q, k, v), query_gate))
        query, gate = query_gate[..., : self.head_dim], query_gate[..., self.head_dim :]
        q = rope.rotate(self.q_norm(query))
        k = rope.rotate(self.k_norm(self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)))
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q.contiguous(), k.contiguous(), v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class Qwen3_5MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        gate_up_method: LinearMethod | None = None,
        down_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, linear_method=gate_up_method
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, linear_method=down_method
        )

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]: the MLP's output (reduce=True), or this rank's partial sum of it (reduce=False:
        the caller all-reduces it)."""
        gate_up = self.gate_up_proj(x)
        if use_fused_kernels(gate_up):
            from fitserve.kernels.activation import silu_and_mul

            hidden = silu_and_mul(gate_up, as_torch=True)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        if reduce:
            return self.down_proj(hidden)
        return self.down_proj.linear_method.apply(self.down_proj, hidden)


class Qwen3_5SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, layer_idx: int = 0, quant: Any = None) -> None:
        """quant: the checkpoint's quantized format or None. An int4 checkpoint's experts run as int4
        (layers/moe_int4.py) and its shared expert through its format's linear method; the router and the
        shared expert's one-output gate stay 16-bit."""
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.num_experts_per_tok)
        self.gate = ReplicatedLinear(hidden, int(config.num_experts), bias=False)
        self.experts = layer_experts(config, quant, layer_idx, F.silu, expert_parallel_of(config))
        block = "mlp.shared_expert"
        self.shared_expert = Qwen3_5MLP(
            hidden,
            int(config.shared_expert_intermediate_size),
            linear_method_of(quant, config, layer_idx, block, "gate_up_proj", ("gate_proj", "up_proj")),
            linear_method_of(quant, config, layer_idx, block, "down_proj", ("down_proj",)),
        )
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def _shared_expert_tensors(self) -> SharedExpert | None:
        """The shared expert's weights for kernels/moe_decode.py, or None when they are not plain 16-bit
        tensors (a quantized shared expert keeps its own kernels)."""
        from fitserve.kernels.moe_decode import SharedExpert

        gate_up = getattr(self.shared_expert.gate_up_proj, "weight", None)
        down = getattr(self.shared_expert.down_proj, "weight", None)
        gate = getattr(self.shared_expert_gate, "weight", None)
        if any(t is None or t.dim() != 2 or not t.dtype.is_floating_point for t in (gate_up, down, gate)):
            return None
        if any(t.element_size() != 2 for t in (gate_up, down, gate)):
            return None
        return SharedExpert(gate_up, down, gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # each rank's partial sums of both branches (the gate is per token, so it scales a partial sum
        # as it scales the whole), added and all-reduced once
        if use_fused_kernels(x):  # the routing in one kernel, the shared expert's gate and the sum in another
            from fitserve.kernels.moe_router import router_topk
            from fitserve.kernels.shared_expert_gate import add_gated_shared_expert

            weights, ids = router_topk(self.gate(x), None, self.top_k, round_to_scores_dtype=True)
            shared = self._shared_expert_tensors()
            if shared is not None and self.experts.takes_shared_expert(x, shared):  # both in two kernels
                return all_reduce(self.experts(x, ids, weights, reduce=False, shared=shared))
            routed = self.experts(x, ids, weights, reduce=False)
            shared = self.shared_expert(x, reduce=False)
            return all_reduce(add_gated_shared_expert(routed, shared, x, self.shared_expert_gate.weight))
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).float()
        routed = self.experts(x, ids, weights, reduce=False)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return all_reduce(routed + shared)
