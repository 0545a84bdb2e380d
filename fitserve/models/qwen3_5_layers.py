"""Qwen3.5 / Qwen3.6 decoder layers, computed as transformers' modeling_qwen3_5(_moe).py computes them.

- RMSNorm (layer norms, q/k norms, the final norm): x * (mean(x^2) + eps)^-0.5 in float32 times
  (1 + weight): the checkpoints store the offset from 1 (zeros at init).
- full_attention: q_proj gives, per head, the query and then a gate of head_dim each; q and k are
  RMS-normed per head, then rotated on their first head_dim x partial_rotary_factor dims (rotate-half
  pairs within those; the mrope sections of the multimodal model all carry the 1-D position for text, so
  they are plain RoPE here); softmax attention over the paged KV cache, scale head_dim^-0.5; the output
  times sigmoid(gate), then o_proj.
- linear_attention (Gated DeltaNet): in_proj_qkv -> a depthwise causal conv1d of width
  linear_conv_kernel_dim over q, k and v together, SiLU -> q, k L2-normalised (q scaled by k_dim^-0.5),
  each key head serving linear_num_value_heads / linear_num_key_heads value heads; beta = sigmoid(in_proj_b),
  decay g = -exp(A_log) * softplus(in_proj_a + dt_bias); the gated delta rule (layers/gated_delta_rule.py);
  a gated RMSNorm per value head (weight as stored, times silu(in_proj_z)); out_proj.
  Per request it keeps a conv state (the last K - 1 conv inputs) and a recurrent state (value heads x k_dim
  x v_dim, float32) in a slot of the model's RecurrentStatePool (worker/recurrent_state.py): the step's
  metadata names each sequence's slot; a sequence whose first token is at position 0 starts from zeros.
  With prefix caching the metadata's slots also name snapshot copies (core/state_slots.py): a sequence
  resuming from a prefix-cache hit has its slot filled from a snapshot first, and a sequence whose step
  ends on a block boundary has its final state copied into a snapshot slot.
- MLP: down(silu(gate(x)) * up(x)); the MoE block: softmax router over all experts, top-k renormalised,
  the experts (layers/moe.py) plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

Tensor parallel is not supported yet (the model refuses it); the linears are whole on one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import get_forward_context
from fitserve.layers.gated_delta_rule import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)
from fitserve.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, default_weight_loader
from fitserve.layers.moe import FusedExperts
from fitserve.models.qwen3_5_config import LINEAR_ATTENTION


def _parameter(shape: tuple[int, ...], fill: float) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


def _silu(name: str) -> None:
    if name != "silu":
        raise ValueError(f"hidden_act={name!r} is not supported for Qwen3.5: its checkpoints use 'silu'")


class Qwen3_5RMSNorm(nn.Module):
    """RMSNorm times (1 + weight), in float32, cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter((dim,), 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """DeltaNet's output norm: RMSNorm (weight as stored) of each value head, times silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter((dim,), 1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


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
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        self.head_dim = int(config.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.q_proj = ReplicatedLinear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = ReplicatedLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = ReplicatedLinear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = ReplicatedLinear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3_5RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Qwen3_5RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_idx
        )

    def forward(self, hidden: torch.Tensor, rope: PartialRope) -> torch.Tensor:
        tokens = hidden.shape[0]
        query_gate = self.q_proj(hidden).view(tokens, self.num_heads, 2 * self.head_dim)
        query, gate = query_gate[..., : self.head_dim], query_gate[..., self.head_dim :]
        q = rope.rotate(self.q_norm(query))
        k = rope.rotate(self.k_norm(self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)))
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q.contiguous(), k.contiguous(), v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.num_k_heads = int(config.linear_num_key_heads)
        self.num_v_heads = int(config.linear_num_value_heads)
        self.k_dim = int(config.linear_key_head_dim)
        self.v_dim = int(config.linear_value_head_dim)
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} is not a multiple of linear_num_key_heads="
                f"{self.num_k_heads}: each key head must serve a whole number of value heads"
            )
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_width = int(config.linear_conv_kernel_dim)
        self.in_proj_qkv = ReplicatedLinear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = ReplicatedLinear(hidden, self.value_size, bias=False)
        self.in_proj_b = ReplicatedLinear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = ReplicatedLinear(hidden, self.num_v_heads, bias=False)
        # the checkpoint's conv1d.weight [conv_dim, 1, K] is kept as [conv_dim, K] (load_weights squeezes it)
        self.conv_weight = _parameter((self.conv_dim, self.conv_width), 0.0)
        self.A_log = _parameter((self.num_v_heads,), 0.0)
        self.dt_bias = _parameter((self.num_v_heads,), 1.0)
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = ReplicatedLinear(self.value_size, hidden, bias=False)
        # set by the model once the pool exists (worker/recurrent_state.py): this layer's state tensors,
        # conv [slots, conv_dim, K - 1] and recurrent [slots, value heads, k_dim, v_dim] float32
        self.conv_states: torch.Tensor | None = None
        self.recurrent_states: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden)
        beta = torch.sigmoid(self.in_proj_b(hidden))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias.float())
        metadata = get_forward_context().attn_metadata if self.conv_states is not None else None
        slots = getattr(metadata, "state_slots_cpu", None) if metadata is not None else None
        if slots is None:  # no cache (a profiling run, a test's whole-sequence forward): one fresh sequence
            core = self._sequence(qkv, beta, g, None)
        else:
            core = self._batch(qkv, beta, g, metadata.query_lens_cpu, metadata.seq_lens_cpu, slots)
        core = self.norm(core.to(hidden.dtype), z.view(tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(core.reshape(tokens, self.value_size))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """conv output [N, conv_dim] -> q (normalised, scaled), k (normalised) [N, value heads, k_dim] in
        float32, and v [N, value heads, v_dim]."""
        n = mixed.shape[0]
        q, k, v = mixed.split((self.key_size, self.key_size, self.value_size), dim=-1)
        q = l2_normalize(q.float().view(n, self.num_k_heads, self.k_dim)) * self.k_dim**-0.5
        k = l2_normalize(k.float().view(n, self.num_k_heads, self.k_dim))
        repeat = self.num_v_heads // self.num_k_heads
        if repeat > 1:
            q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(n, self.num_v_heads, self.v_dim)

    def _sequence(
        self, qkv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, slot: int | None, fresh: bool = True
    ) -> torch.Tensor:
        """One sequence's tokens, from zeros (fresh: its first token is at position 0) or from its slot's
        states; the states it ends with are stored in the slot (slot None: nothing stored)."""
        conv_state = recurrent = None
        if slot is not None and not fresh:
            assert self.conv_states is not None and self.recurrent_states is not None
            conv_state, recurrent = self.conv_states[slot], self.recurrent_states[slot]
        mixed, new_conv = causal_conv1d(qkv, self.conv_weight, conv_state)
        q, k, v = self._heads(mixed)
        out, new_state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent)
        if slot is not None:
            assert self.conv_states is not None and self.recurrent_states is not None
            self.conv_states[slot] = new_conv
            self.recurrent_states[slot] = new_state
        return out

    def _batch(
        self,
        qkv: torch.Tensor,
        beta: torch.Tensor,
        g: torch.Tensor,
        query_lens: list[int],
        seq_lens: list[int],
        slots: list[int],
    ) -> torch.Tensor:
        """The step's sequences: decode tokens (one token after earlier ones) in one batched recurrent
        update, every other sequence (a prompt or its next chunk) by the chunked rule from its state."""
        assert self.conv_states is not None and self.recurrent_states is not None
        # prefix-cache hits start from a snapshot of the state (core/state_slots.py): copied in first
        for row, snapshot in getattr(slots, "restores", {}).items():
            self._copy_state(snapshot, slots[row])
        out = torch.empty(qkv.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=qkv.device)
        decode_rows: list[int] = []
        decode_slots: list[int] = []
        start = 0
        for query_len, seq_len, slot in zip(query_lens, seq_lens, slots):
            if query_len == 1 and seq_len > 1:
                decode_rows.append(start)
                decode_slots.append(slot)
            else:
                rows = slice(start, start + query_len)
                out[rows] = self._sequence(qkv[rows], beta[rows], g[rows], slot, fresh=seq_len == query_len)
            start += query_len
        if decode_rows:
            rows_t = torch.tensor(decode_rows, dtype=torch.long, device=qkv.device)
            slots_t = torch.tensor(decode_slots, dtype=torch.long, device=qkv.device)
            mixed, new_conv = causal_conv1d_step(qkv[rows_t], self.conv_weight, self.conv_states[slots_t])
            self.conv_states[slots_t] = new_conv.to(self.conv_states.dtype)
            q, k, v = self._heads(mixed)
            o, new_state = recurrent_gated_delta_rule(
                q, k, v, g[rows_t], beta[rows_t], self.recurrent_states[slots_t]
            )
            self.recurrent_states[slots_t] = new_state
            out[rows_t] = o
        # steps ending on a block boundary keep the state there for later prefix-cache hits
        for row, snapshot in getattr(slots, "saves", {}).items():
            self._copy_state(slots[row], snapshot)
        return out

    def _copy_state(self, source: int, target: int) -> None:
        """Both states of slot `source` into slot `target` of this layer's pool."""
        assert self.conv_states is not None and self.recurrent_states is not None
        self.conv_states[target] = self.conv_states[source]
        self.recurrent_states[target] = self.recurrent_states[source]


class Qwen3_5MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3_5SparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.num_experts_per_tok)
        self.gate = ReplicatedLinear(hidden, int(config.num_experts), bias=False)
        self.experts = FusedExperts(
            int(config.num_experts), hidden, int(config.moe_intermediate_size), F.silu
        )
        self.shared_expert = Qwen3_5MLP(hidden, int(config.shared_expert_intermediate_size))
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).float()
        routed = self.experts(x, ids, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        _silu(str(getattr(config, "hidden_act", "silu")))
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx)
        if getattr(config, "num_experts", None):
            self.mlp: nn.Module = Qwen3_5SparseMoeBlock(config)
        else:
            self.mlp = Qwen3_5MLP(hidden, int(config.intermediate_size))
        self.input_layernorm = Qwen3_5RMSNorm(hidden, eps)
        self.post_attention_layernorm = Qwen3_5RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, rope: PartialRope) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        mixed = self.linear_attn(normed) if self.is_linear else self.self_attn(normed, rope)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
