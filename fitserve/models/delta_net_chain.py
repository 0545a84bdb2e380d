"""A Gated DeltaNet layer's decode rows of a speculative verify step: each request's rows in order.

A verify step's rows of one request are consecutive tokens of one sequence (spec_decode/verify.py), so
unlike attention rows they cannot be updated at once: row j continues from the state row j - 1 left. On
CUDA each chain runs in one program of two kernels (the conv, the recurrent rule), its tokens in order,
writing the state after each token to its own pool row. The torch path (the CPU, and the kernels'
reference) groups the step's decode rows by depth in their chain (worker/state_rings.py): depth 0 holds
every request's first row (and the plain decode rows), depth j the j-th drafts; each depth is one batched
decode update (layers/gated_delta_rule.gated_delta_net_decode) after copying into its rows' pool rows the
state each continues from. Either way the request keeps the state after its last accepted token.

Such a step runs eagerly (`is_decode_only` is False: the decode CUDA graphs carry one slot per row and no
chain); a step without drafts replays them as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fitserve.layers import gated_delta_rule as delta_ops
from fitserve.layers.gated_delta_rule import DeltaNetStepSlots, StateRowsHost, gated_delta_net_decode


@dataclass
class ChainDepthRows:
    """One depth on the device: decode rows (indices among the step's decode rows), their pool rows
    (int64), and the state copies made before it (source rows, target rows; None: none)."""

    rows: torch.Tensor
    slots: torch.Tensor
    copies: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def from_array(cls, array: torch.Tensor, sizes: tuple[int, int]) -> ChainDepthRows:
        """Views of worker/state_rings.ChainDepth.array() as uploaded."""
        n, copies = sizes
        rows, slots = array[:n], array[n : 2 * n]
        sources, targets = array[2 * n : 2 * n + copies], array[2 * n + copies :]
        return cls(rows, slots, (sources, targets) if copies else None)


@dataclass
class ChainedStepSlots(DeltaNetStepSlots):
    """A verify step's slots: the decode rows also by chain depth (`depths`, run in order by the torch
    path), and per decode row the pool row its state continues from (`sources`) and, for the first row
    of a chain, the chain's length (`lengths`, 0 for its later rows; a plain decode row is a chain of 1
    reading its own row): the Triton path runs each chain in one program."""

    depths: tuple[ChainDepthRows, ...] = ()
    sources: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        """Never replayed by a decode CUDA graph (its graphs know one slot per row, not the chain)."""
        return False

    @classmethod
    def from_uploaded(
        cls,
        host: StateRowsHost,
        uploaded: Sequence[torch.Tensor],
        chain_arrays: Sequence[torch.Tensor],
        depth_sizes: Sequence[tuple[int, int]],
    ) -> ChainedStepSlots:
        """host's split with its arrays as uploaded, and worker/state_rings.StepChain.arrays() as
        uploaded (`chain_arrays`) with its depths' sizes."""
        plain = DeltaNetStepSlots.from_host(host, uploaded)
        pairs = zip(chain_arrays[:-1], depth_sizes, strict=True)
        depths = tuple(ChainDepthRows.from_array(array, sizes) for array, sizes in pairs)
        heads = chain_arrays[-1]
        half = heads.shape[0] // 2
        return cls(
            decode_slots=plain.decode_slots,
            decode_rows=plain.decode_rows,
            prefill_rows=plain.prefill_rows,
            prefill_query_lens=plain.prefill_query_lens,
            prefill_slots=plain.prefill_slots,
            prefill_initial=plain.prefill_initial,
            depths=depths,
            sources=heads[:half],
            lengths=heads[half:],
        )


def chained_decode(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    step: ChainedStepSlots,
    key_heads: int,
    k_dim: int,
) -> torch.Tensor:
    """The step's decode rows qkv [D, conv_dim], a, b [D, H] (in_proj_a's and in_proj_b's outputs) -> o
    [D, H, v_dim] float32, each state written to its row's pool row. On CUDA two kernel launches
    (kernels/causal_conv1d.causal_conv1d_chain, gated_delta_recurrent.fused_recurrent_gated_delta_rule_chain);
    elsewhere depth by depth: its state copies, then its rows' batched update."""
    if delta_ops._use_kernels(qkv):
        return _chained_kernels(
            qkv, a, b, a_log, dt_bias, conv_weight, conv_states, recurrent_states, step, key_heads, k_dim
        )
    out: torch.Tensor | None = None
    for depth in step.depths:
        if depth.copies is not None:
            sources, targets = depth.copies
            for states in (conv_states, recurrent_states):
                states.index_copy_(0, targets, states.index_select(0, sources))
        rows = depth.rows
        depth_out = gated_delta_net_decode(
            qkv[rows],
            a[rows],
            b[rows],
            a_log,
            dt_bias,
            conv_weight,
            conv_states,
            recurrent_states,
            depth.slots,
            key_heads,
            k_dim,
        )
        if out is None:  # every decode row is at one depth
            out = torch.empty((qkv.shape[0], *depth_out.shape[1:]), dtype=depth_out.dtype, device=qkv.device)
        out.index_copy_(0, rows, depth_out)
    assert out is not None, "a verify step without decode rows reached a DeltaNet layer"
    return out


def _chained_kernels(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    step: ChainedStepSlots,
    key_heads: int,
    k_dim: int,
) -> torch.Tensor:
    """chained_decode through the Triton kernels (they import triton: CUDA only, or its interpreter)."""
    from fitserve.kernels.causal_conv1d import causal_conv1d_chain
    from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_chain

    assert step.decode_slots is not None and step.sources is not None and step.lengths is not None
    slots, sources, lengths = step.decode_slots, step.sources, step.lengths
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    mixed = causal_conv1d_chain(qkv, conv_weight, conv_states, slots, sources, lengths)
    n, key_size, heads = mixed.shape[0], key_heads * k_dim, a.shape[1]
    q = mixed[:, :key_size].view(n, key_heads, k_dim)
    k = mixed[:, key_size : 2 * key_size].view(n, key_heads, k_dim)
    v = mixed[:, 2 * key_size :].view(n, heads, -1)
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (a, b))
    return fused_recurrent_gated_delta_rule_chain(
        q,
        k,
        v,
        a,
        b,
        recurrent_states,
        slots,
        sources,
        lengths,
        a_log=a_log,
        dt_bias=dt_bias,
        scale=k_dim**-0.5,
    )
