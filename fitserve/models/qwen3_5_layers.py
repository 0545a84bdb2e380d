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
  metadata carries the slots as a device tensor, split into decode rows (one token after earlier ones)
  and prompt pieces once per step (`state_slots`, layers/gated_delta_rule.py DeltaNetStepSlots); the
  decode rows go through one batched update (CUDA-graph safe: slots read on the device, -1 a padded row),
  the prompt pieces through one varlen prefill; a sequence whose first token is at position 0 starts from
  zeros. With prefix caching a sequence resuming from a hit has its slot filled from a snapshot before the
  step, and one whose step ends on a block boundary has its final state copied to a snapshot after it
  (core/state_slots.py): the model runner makes those copies around the forward (`copy_states`); a caller
  passing only host slots (`state_slots_cpu`) gets them made here, per layer.
- MLP: down(silu(gate(x)) * up(x)); the MoE block: softmax router over all experts, top-k renormalised,
  the experts (layers/moe.py) plus a shared expert scaled by sigmoid(shared_expert_gate(x)).

Tensor parallel (rank r of n, as vLLM splits these layers; layers/tp_shards.py):
- Gated DeltaNet: key and value heads split evenly (both counts divisible by n, else refused naming them),
  so a rank keeps whole key heads with the value heads they serve. in_proj_qkv is column-parallel with its
  q, k and v parts each split by heads (a rank's rows are [its q | its k | its v]), and the conv1d weight's
  channels the same way (they are in_proj_qkv's outputs); in_proj_z, in_proj_b, in_proj_a, A_log and
  dt_bias split by value heads; the gated norm is per head (replicated weight); out_proj row-parallel. The
  rank's state pools hold only its heads (worker/recurrent_state.py), so the kernels run unchanged on
  fewer heads.
- full_attention: q_proj (query and gate, packed per head) column-parallel by heads; k_proj and v_proj by
  KV heads, replicated when there are fewer than ranks; q/k norms replicated; o_proj row-parallel.
- MLP: gate_up column-parallel, down row-parallel. MoE: the router and the shared expert's one-output gate
  replicated (every rank needs the softmax over all experts, and the gate is one row); the experts split
  their intermediate dim, or the experts themselves with --enable-expert-parallel (layers/moe.py); the
  shared expert splits like the dense MLP. The routed and the shared partial outputs are summed on each
  rank and all-reduced once per layer.
Embedding and LM head are vocab-parallel (models/qwen3_5.py).

Quantized checkpoints (dense models; models/qwen3_5.py refuses a quantized MoE): every linear of the
full layers (q_proj, k_proj, v_proj, o_proj), of the DeltaNet layers (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a, out_proj) and of the MLP (gate_up_proj fused from gate_proj and up_proj, down_proj) takes the
format's linear method (layers/quantization/methods.py: int4, fp8 or bitsandbytes 4-bit), or none where the
checkpoint's ignore list leaves the module in 16 bits (`linear_method_of`). The norms, the conv1d, A_log and
dt_bias stay in the model dtype, as every Qwen3.5 quantized checkpoint stores them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.distributed.collectives import all_reduce
from fitserve.distributed.parallel_state import tp
from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import get_forward_context
from fitserve.layers.gated_delta_rule import (
    DeltaNetStepSlots,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_net_decode,
    gated_delta_net_prefill,
    l2_normalize,
)
from fitserve.layers.linear import (
    ColumnParallelLinear,
    LinearMethod,
    MergedColumnParallelLinear,
    PackedColumnLinear,
    ReplicatedLinear,
    RowParallelLinear,
    WholeTensor,
    check_loaded_shape,
    default_weight_loader,
)
from fitserve.layers.moe import FusedExperts
from fitserve.layers.quantization.methods import linear_method_for
from fitserve.layers.tp_shards import first_kv_head, kv_heads_per_rank, rank_rows, split_evenly
from fitserve.models.delta_net_chain import ChainedStepSlots, chained_decode
from fitserve.models.gemma4_config import expert_parallel_of
from fitserve.models.qwen3_5_config import LINEAR_ATTENTION, delta_net_heads_per_rank


def _parameter(shape: tuple[int, ...], fill: float, loader: Any = default_weight_loader) -> nn.Parameter:
    param = nn.Parameter(torch.full(shape, fill), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def rank_parts_loader(parts: tuple[int, ...]) -> Any:
    """A weight loader for a parameter whose rows are `parts` (their whole sizes) stacked, each split
    evenly across the ranks: it copies in this rank's rows of each part, stacked in the same order (the
    DeltaNet conv1d weight's q, k and v channels; A_log's and dt_bias's value heads)."""

    def load(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        state = tp()
        if state.size == 1:
            default_weight_loader(param, loaded_weight)
            return
        whole = sum(parts)
        if loaded_weight.shape[0] != whole:
            check_loaded_shape(torch.Size((whole, *param.shape[1:])), loaded_weight)
        pieces, start = [], 0
        for size in parts:
            per_rank = size // state.size
            pieces.append(rank_rows(loaded_weight, 0, start + state.rank * per_rank, per_rank))
            start += size
        default_weight_loader(param, torch.cat(pieces) if len(pieces) > 1 else pieces[0])

    return load


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
        query, gate = query_gate[..., : self.head_dim], query_gate[..., self.head_dim :]
        q = rope.rotate(self.q_norm(query))
        k = rope.rotate(self.k_norm(self.k_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)))
        v = self.v_proj(hidden).view(tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q.contiguous(), k.contiguous(), v)
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, -1)))


class GatedDeltaNet(nn.Module):
    def __init__(self, config: Any, layer_idx: int, quant: Any = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        key_heads, value_heads = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.k_dim = int(config.linear_key_head_dim)
        self.v_dim = int(config.linear_value_head_dim)
        if value_heads % key_heads:
            raise ValueError(
                f"linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads="
                f"{key_heads}: each key head must serve a whole number of value heads"
            )
        # this rank's heads and sizes (all of them at tensor_parallel_size 1)
        self.num_k_heads, self.num_v_heads = delta_net_heads_per_rank(config, tp().size)
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_width = int(config.linear_conv_kernel_dim)
        whole_key, whole_value = key_heads * self.k_dim, value_heads * self.v_dim
        qkv_parts = (whole_key, whole_key, whole_value)
        # the checkpoint's one [q | k | v] matrix: each part split by heads (PackedColumnLinear's shard
        # None path), so a rank's rows are [its q | its k | its v]
        offsets = {"q": (0, whole_key), "k": (whole_key, whole_key), "v": (2 * whole_key, whole_value)}

        def method(name: str) -> LinearMethod | None:
            return linear_method_of(quant, config, layer_idx, "linear_attn", name, (name,))

        self.in_proj_qkv = PackedColumnLinear(
            hidden, offsets, bias=False, linear_method=method("in_proj_qkv")
        )
        self.in_proj_z = ColumnParallelLinear(
            hidden, whole_value, bias=False, linear_method=method("in_proj_z")
        )
        self.in_proj_b = ColumnParallelLinear(
            hidden, value_heads, bias=False, linear_method=method("in_proj_b")
        )
        self.in_proj_a = ColumnParallelLinear(
            hidden, value_heads, bias=False, linear_method=method("in_proj_a")
        )
        # the checkpoint's conv1d.weight [conv_dim, 1, K] is kept as [conv_dim, K] (load_weights squeezes it)
        self.conv_weight = _parameter((self.conv_dim, self.conv_width), 0.0, rank_parts_loader(qkv_parts))
        self.whole_conv_dim = sum(qkv_parts)
        self.A_log = _parameter((self.num_v_heads,), 0.0, rank_parts_loader((value_heads,)))
        self.dt_bias = _parameter((self.num_v_heads,), 1.0, rank_parts_loader((value_heads,)))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(whole_value, hidden, bias=False, linear_method=method("out_proj"))
        # set by the model once the pool exists (worker/recurrent_state.py): this layer's state tensors of
        # this rank's heads, conv [slots, conv_dim, K - 1] and recurrent [slots, value heads, k_dim, v_dim]
        # float32
        self.conv_states: torch.Tensor | None = None
        self.recurrent_states: torch.Tensor | None = None

    def whole_tensors(self) -> list[WholeTensor]:
        """The conv1d weight's whole [q | k | v channels, K] (as load_weights hands it to its loader), for
        dummy weights (models/weights.py); its projections are linear layers that name their own."""
        weight = self.conv_weight
        shape = (self.whole_conv_dim, self.conv_width)

        def load(whole: torch.Tensor) -> None:
            weight.weight_loader(weight, whole)  # type: ignore[attr-defined]

        return [
            WholeTensor(weight, "conv_weight", shape, load, weight if tuple(weight.shape) == shape else None)
        ]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden)
        a, b = self.in_proj_a(hidden), self.in_proj_b(hidden)
        metadata = get_forward_context().attn_metadata if self.conv_states is not None else None
        if metadata is None or (metadata.state_slots is None and metadata.state_slots_cpu is None):
            # no cache (a profiling run, a test's whole-sequence forward): one fresh sequence
            core = self._fresh_sequence(qkv, *self._gates(a, b))
        elif metadata.state_slots is not None:  # the step's slots, uploaded with its inputs
            core = self._batch(qkv, a, b, metadata.state_slots)
        else:
            core = self._batch_with_copies(qkv, a, b, metadata)
        core = self.norm(core.to(hidden.dtype), z.view(tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(core.reshape(tokens, self.value_size))

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj_a's and in_proj_b's outputs -> the decay g (float32) and beta."""
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, torch.sigmoid(b)

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

    def _fresh_sequence(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """One sequence's tokens from zeros, its final state not kept (no state pool in use)."""
        mixed, _ = causal_conv1d(qkv, self.conv_weight, None)
        q, k, v = self._heads(mixed)
        out, _ = chunk_gated_delta_rule(q, k, v, g, beta, None)
        return out

    def _batch(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, step: DeltaNetStepSlots
    ) -> torch.Tensor:
        """The step's sequences: all decode rows in one batched update (gated_delta_net_decode, slots by a
        device tensor: CUDA-graph safe), all prompt pieces in one varlen prefill from their states; each
        kind's outputs written into its rows. States are read from and written to the slots in place."""
        assert self.conv_states is not None and self.recurrent_states is not None
        decode_out = prefill_out = None
        if step.decode_slots is not None:
            rows = step.decode_rows
            qkv_d, a_d, b_d = (qkv, a, b) if rows is None else (qkv[rows], a[rows], b[rows])
            if isinstance(step, ChainedStepSlots):  # a verify step: each request's rows in order
                decode_out = chained_decode(
                    qkv_d,
                    a_d,
                    b_d,
                    self.A_log,
                    self.dt_bias,
                    self.conv_weight,
                    self.conv_states,
                    self.recurrent_states,
                    step,
                    self.num_k_heads,
                    self.k_dim,
                )
            else:
                decode_out = gated_delta_net_decode(
                    qkv_d,
                    a_d,
                    b_d,
                    self.A_log,
                    self.dt_bias,
                    self.conv_weight,
                    self.conv_states,
                    self.recurrent_states,
                    step.decode_slots,
                    self.num_k_heads,
                    self.k_dim,
                )
        if step.prefill_query_lens:
            rows = step.prefill_rows
            qkv_p, a_p, b_p = (qkv, a, b) if rows is None else (qkv[rows], a[rows], b[rows])
            g, beta = self._gates(a_p, b_p)
            prefill_out = gated_delta_net_prefill(
                qkv_p,
                g,
                beta,
                self.conv_weight,
                self.conv_states,
                self.recurrent_states,
                step.prefill_query_lens,
                step.prefill_slots,
                step.prefill_initial,
                self.num_k_heads,
                self.k_dim,
            )
        if prefill_out is None:
            assert decode_out is not None, "a step with no rows reached a DeltaNet layer"
            return decode_out
        if decode_out is None:
            return prefill_out
        assert step.decode_rows is not None and step.prefill_rows is not None
        out = torch.empty(qkv.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=qkv.device)
        out.index_copy_(0, step.decode_rows, decode_out)
        out.index_copy_(0, step.prefill_rows, prefill_out)
        return out

    def _batch_with_copies(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, metadata: Any
    ) -> torch.Tensor:
        """A caller that passed only host slots (`state_slots_cpu`, not through the step's upload): the
        split made and copied here, and the prefix-cache snapshot copies made by this layer (the model
        runner makes them for all layers at once, worker side, when it uploads the slots)."""
        slots = metadata.state_slots_cpu
        step = DeltaNetStepSlots.build(metadata.query_lens_cpu, metadata.seq_lens_cpu, slots, qkv.device)
        for row, snapshot in getattr(slots, "restores", {}).items():
            self._copy_state(snapshot, slots[row])
        out = self._batch(qkv, a, b, step)
        for row, snapshot in getattr(slots, "saves", {}).items():
            self._copy_state(slots[row], snapshot)
        return out

    def _copy_state(self, source: int, target: int) -> None:
        """Both states of slot `source` into slot `target` of this layer's pool."""
        assert self.conv_states is not None and self.recurrent_states is not None
        self.conv_states[target] = self.conv_states[source]
        self.recurrent_states[target] = self.recurrent_states[source]


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
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        if reduce:
            return self.down_proj(hidden)
        return self.down_proj.linear_method.apply(self.down_proj, hidden)


class Qwen3_5SparseMoeBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.num_experts_per_tok)
        self.gate = ReplicatedLinear(hidden, int(config.num_experts), bias=False)
        self.experts = FusedExperts(
            int(config.num_experts),
            hidden,
            int(config.moe_intermediate_size),
            F.silu,
            expert_parallel=expert_parallel_of(config),
        )
        self.shared_expert = Qwen3_5MLP(hidden, int(config.shared_expert_intermediate_size))
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probabilities = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype).float()
        # each rank's partial sums of both branches (the gate is per token, so it scales a partial sum
        # as it scales the whole), added and all-reduced once
        routed = self.experts(x, ids, weights, reduce=False)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, reduce=False)
        return all_reduce(routed + shared)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, quant: Any = None) -> None:
        """quant: the checkpoint's quantized format (layers/quantization/quant_config.quant_format) or
        None; a MoE layer takes none (models/qwen3_5.py refuses a quantized MoE before building)."""
        super().__init__()
        _silu(str(getattr(config, "hidden_act", "silu")))
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx, quant)
        else:
            self.self_attn = Qwen3_5Attention(config, layer_idx, quant)
        if getattr(config, "num_experts", None):
            self.mlp: nn.Module = Qwen3_5SparseMoeBlock(config)
        else:
            self.mlp = Qwen3_5MLP(
                hidden,
                int(config.intermediate_size),
                linear_method_of(quant, config, layer_idx, "mlp", "gate_up_proj", ("gate_proj", "up_proj")),
                linear_method_of(quant, config, layer_idx, "mlp", "down_proj", ("down_proj",)),
            )
        self.input_layernorm = Qwen3_5RMSNorm(hidden, eps)
        self.post_attention_layernorm = Qwen3_5RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, rope: PartialRope) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        mixed = self.linear_attn(normed) if self.is_linear else self.self_attn(normed, rope)
        hidden = hidden + mixed
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
