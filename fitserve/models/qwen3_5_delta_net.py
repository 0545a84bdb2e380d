"""Qwen3.5 / Qwen3.6's Gated DeltaNet layer (layer type linear_attention), computed as transformers'
modeling_qwen3_5(_moe).py computes it.

in_proj_qkv -> a depthwise causal conv1d of width linear_conv_kernel_dim over q, k and v together, SiLU ->
q, k L2-normalised (q scaled by k_dim^-0.5), each key head serving linear_num_value_heads /
linear_num_key_heads value heads; beta = sigmoid(in_proj_b), decay g = -exp(A_log) * softplus(in_proj_a +
dt_bias); the gated delta rule (layers/gated_delta_rule.py); a gated RMSNorm per value head (weight as stored,
times silu(in_proj_z)); out_proj.

Per request it keeps a conv state (the last K - 1 conv inputs) and a recurrent state (value heads x k_dim x
v_dim, float32) in a slot of the model's RecurrentStatePool (worker/recurrent_state.py): the step's metadata
carries the slots as a device tensor, split into decode rows (one token after earlier ones) and prompt pieces
once per step (`state_slots`, layers/gated_delta_rule.py DeltaNetStepSlots); the decode rows go through one
batched update (CUDA-graph safe: slots read on the device, -1 a padded row), the prompt pieces through one
varlen prefill; a sequence whose first token is at position 0 starts from zeros. With prefix caching a
sequence resuming from a hit has its slot filled from a snapshot before the step, and one whose step ends on
a block boundary has its final state copied to a snapshot after it (core/state_slots.py): the model runner
makes those copies around the forward (`copy_states`); a caller passing only host slots (`state_slots_cpu`)
gets them made here, per layer.

Tensor parallel (rank r of n, as vLLM splits the layer; layers/tp_shards.py): key and value heads split
evenly (both counts divisible by n, else refused naming them), so a rank keeps whole key heads with the value
heads they serve. in_proj_qkv is column-parallel with its q, k and v parts each split by heads (a rank's rows
are [its q | its k | its v]), and the conv1d weight's channels the same way (they are in_proj_qkv's outputs);
in_proj_z, in_proj_b, in_proj_a, A_log and dt_bias split by value heads; the gated norm is per head
(replicated weight); out_proj row-parallel. The rank's state pools hold only its heads
(worker/recurrent_state.py), so the kernels run unchanged on fewer heads.

A 16-bit layer keeps its four input projections in one matrix, `in_proj` [q | k | v | z | b | a], each part
split by heads as above: one GEMM a step where there were four (models/qwen3_5.py loads the checkpoint's four
tensors into its parts). A quantized checkpoint keeps them apart, each with its format's linear method. On
CUDA the gated norm is one kernel (kernels/gated_rms_norm.py; models/qwen3_5_layers.FUSED_ON_CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.distributed.parallel_state import tp
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
    PackedColumnLinear,
    RowParallelLinear,
    WholeTensor,
    check_loaded_shape,
    default_weight_loader,
)
from fitserve.layers.tp_shards import rank_rows
from fitserve.models.delta_net_chain import ChainedStepSlots, chained_decode
from fitserve.models.qwen3_5_config import delta_net_heads_per_rank
from fitserve.models.qwen3_5_layers import filled_parameter, linear_method_of, use_fused_kernels

# A DeltaNet layer's four input projections, as the checkpoint names them (GatedDeltaNet merges 16-bit ones)
IN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


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


class GatedRMSNorm(nn.Module):
    """DeltaNet's output norm: RMSNorm (weight as stored) of each value head, times silu(gate)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = filled_parameter((dim,), 1.0)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim], gate [T, heads, dim] -> [T, heads, dim] in x's dtype."""
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


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

        projections = {name: method(name) for name in IN_PROJECTIONS}
        # 16-bit projections of the same input: one matrix [q | k | v | z | b | a], one GEMM a step where
        # there were four (two of them 48-row cuBLAS calls of ~5 us each at batch 1); load_weights fills
        # its parts from the checkpoint's four tensors. A quantized checkpoint keeps them apart (its
        # formats and ignore list name them one by one).
        self.merged_in_proj = all(projection is None for projection in projections.values())
        if self.merged_in_proj:
            start = 2 * whole_key + whole_value
            offsets["z"] = (start, whole_value)
            offsets["b"] = (start + whole_value, value_heads)
            offsets["a"] = (start + whole_value + value_heads, value_heads)
            self.in_proj = PackedColumnLinear(hidden, offsets, bias=False)
        else:
            self.in_proj_qkv = PackedColumnLinear(
                hidden, offsets, bias=False, linear_method=projections["in_proj_qkv"]
            )
            self.in_proj_z = ColumnParallelLinear(
                hidden, whole_value, bias=False, linear_method=projections["in_proj_z"]
            )
            self.in_proj_b = ColumnParallelLinear(
                hidden, value_heads, bias=False, linear_method=projections["in_proj_b"]
            )
            self.in_proj_a = ColumnParallelLinear(
                hidden, value_heads, bias=False, linear_method=projections["in_proj_a"]
            )
        # the checkpoint's conv1d.weight [conv_dim, 1, K] is kept as [conv_dim, K] (load_weights squeezes it)
        self.conv_weight = filled_parameter(
            (self.conv_dim, self.conv_width), 0.0, rank_parts_loader(qkv_parts)
        )
        self.whole_conv_dim = sum(qkv_parts)
        self.A_log = filled_parameter((self.num_v_heads,), 0.0, rank_parts_loader((value_heads,)))
        self.dt_bias = filled_parameter((self.num_v_heads,), 1.0, rank_parts_loader((value_heads,)))
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

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, hidden] -> (qkv [T, conv_dim], z [T, value_size], b, a [T, value heads]): this rank's
        columns of in_proj_qkv, in_proj_z, in_proj_b and in_proj_a (views of one output when merged)."""
        if self.merged_in_proj:
            sizes = (self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads)
            return self.in_proj(hidden).split(sizes, dim=-1)
        return tuple(getattr(self, name)(hidden) for name in IN_PROJECTIONS)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv, z, b, a = self.project(hidden)
        metadata = get_forward_context().attn_metadata if self.conv_states is not None else None
        if metadata is None or (metadata.state_slots is None and metadata.state_slots_cpu is None):
            # no cache (a profiling run, a test's whole-sequence forward): one fresh sequence
            core = self._fresh_sequence(qkv, *self._gates(a, b))
        elif metadata.state_slots is not None:  # the step's slots, uploaded with its inputs
            core = self._batch(qkv, a, b, metadata.state_slots)
        else:
            core = self._batch_with_copies(qkv, a, b, metadata)
        z = z.view(tokens, self.num_v_heads, self.v_dim)
        if use_fused_kernels(hidden):  # the cast, the norm and the gate in one kernel
            from fitserve.kernels.gated_rms_norm import gated_rms_norm

            core = gated_rms_norm(core, z, self.norm.weight, self.norm.eps, hidden.dtype)
        else:
            core = self.norm(core.to(hidden.dtype), z)
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
            inputs = (qkv, a, b) if rows is None else (qkv[rows], a[rows], b[rows])
            params_and_states = (
                self.A_log,
                self.dt_bias,
                self.conv_weight,
                self.conv_states,
                self.recurrent_states,
            )
            heads = (self.num_k_heads, self.k_dim)
            if isinstance(step, ChainedStepSlots):  # a verify step: each request's rows in order
                decode_out = chained_decode(*inputs, *params_and_states, step, *heads)
            else:
                decode_out = gated_delta_net_decode(*inputs, *params_and_states, step.decode_slots, *heads)
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
