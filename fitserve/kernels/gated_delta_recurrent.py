"""The gated delta rule's decode step, fused: one token for each of B sequences, its state updated in place.

Per sequence b (one token) and value head h, with S = states[slots[b], h] (float32 [k_dim, v_dim]):

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

fused with what comes before it in the layer: q and k read raw from the conv output (per key head, value
head h reading key head h // (value heads / key heads)) and L2-normalised (q then times `scale`), and the
gating: g = -exp(A_log[h]) * softplus(a + dt_bias[h]), beta = sigmoid(b) rounded to b's dtype (the layer
rounds it there), from the in_proj_a / in_proj_b outputs a, b. One program per (block of BLOCK_V value
columns, value head, sequence): the rule is separable in the value columns, so each program reads its
[k_dim, BLOCK_V] slice of the state, updates it and writes it back; nothing else touches that slice.

CUDA-graph safe: the slots are a device tensor, nothing is read back to the host, the grid depends only on
B and the shapes. A row whose slot is negative (a padded row of a captured batch) reads and writes no
state and gets a zero output.

`fused_recurrent_gated_delta_rule_chain`: a speculative verify step's rows, each request's tokens in order
in one program (the state carried in registers), the state after each token written to its own slot
(worker/state_rings.py says why). Its reference is the decode step run token by token.

Reference: fitserve.layers.gated_delta_rule.recurrent_gated_delta_rule on the gathered states. Imports
triton: CUDA code paths only; under TRITON_INTERPRET=1 it also runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.fast_launch import INTERPRETING, host_launched
from fitserve.kernels.grid_math import cdiv, next_power_of_2

NUM_WARPS = 4


@host_launched
@triton.jit
def _recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    state_ptr,
    slot_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_g_tok,
    stride_beta_tok,
    stride_out_tok,
    stride_out_head,
    stride_state_slot,
    stride_state_head,
    stride_state_k,
    k_dim,
    v_dim,
    group,
    scale,
    eps,
    L2NORM: tl.constexpr,
    GATING: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    v_block = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    key_head = head // group
    k_cols = tl.arange(0, BLOCK_K)
    v_cols = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_in = (k_cols < k_dim) & live
    v_in = v_cols < v_dim

    q = tl.load(q_ptr + row * stride_q_tok + key_head * stride_q_head + k_cols, mask=k_in, other=0.0)
    k = tl.load(k_ptr + row * stride_k_tok + key_head * stride_k_head + k_cols, mask=k_in, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if L2NORM:
        q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + row * stride_v_tok + head * stride_v_head + v_cols, mask=v_in & live, other=0.0)
    v = v.to(tl.float32)
    g_in = tl.load(g_ptr + row * stride_g_tok + head)
    beta_in = tl.load(beta_ptr + row * stride_beta_tok + head)
    if GATING:  # g_ptr holds in_proj_a's output, beta_ptr in_proj_b's
        x = g_in.to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        # torch's F.softplus: x itself above 20
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus
        beta = tl.sigmoid(beta_in.to(tl.float32)).to(beta_in.dtype).to(tl.float32)
    else:
        g = g_in.to(tl.float32)
        beta = beta_in.to(tl.float32)

    tile = (
        state_ptr
        + slot * stride_state_slot
        + head * stride_state_head
        + k_cols[:, None] * stride_state_k
        + v_cols[None, :]
    )
    mask = k_in[:, None] & v_in[None, :]
    state = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)
    predicted = tl.sum(state * k[:, None], axis=0)  # S^T k [BLOCK_V]
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(tile, state, mask=mask)
    tl.store(
        out_ptr + row * stride_out_tok + head * stride_out_head + v_cols,
        out.to(out_ptr.dtype.element_ty),
        mask=v_in,
    )


def fused_recurrent_gated_delta_rule_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    a_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    l2norm: bool = False,
    scale: float = 1.0,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """One decode token for each of B sequences; states[slots[b]] updated in place. Returns out
    [B, value heads, v_dim] (given, or new in out_dtype, default float32).

    q, k [B, key heads, k_dim] (strided rows allowed, as views of the conv output); v [B, value heads,
    v_dim]; slots [B] int (device tensor; negative: a padded row). g, beta [B, value heads]: the decay and
    beta, or, with a_log and dt_bias [value heads] given, in_proj_a's and in_proj_b's outputs (the gating
    is computed here). l2norm: q and k normalised here, q times scale."""
    batch, key_heads, k_dim = k.shape
    heads, v_dim = v.shape[1], v.shape[2]
    gating = a_log is not None
    problems = []
    if q.shape != k.shape or v.shape[0] != batch or heads % key_heads:
        problems.append(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if g.shape != (batch, heads) or beta.shape != (batch, heads):
        problems.append(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{batch}, {heads}]")
    if gating and (dt_bias is None or a_log.shape != (heads,) or dt_bias.shape != (heads,)):
        problems.append(f"a_log and dt_bias must both be given as [{heads}]")
    if states.dim() != 4 or tuple(states.shape[1:]) != (heads, k_dim, v_dim):
        problems.append(f"states {tuple(states.shape)} must be [slots, {heads}, {k_dim}, {v_dim}]")
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        problems.append("states must be float32 with a contiguous last dim")
    if any(t.stride(-1) != 1 for t in (q, k, v)) or g.stride(-1) != 1 or beta.stride(-1) != 1:
        problems.append("q, k, v, g and beta need a contiguous last dim")
    if slots.shape != (batch,) or slots.dtype not in (torch.int32, torch.int64):
        problems.append(f"slots must be int32/int64 [{batch}], got {slots.dtype} {tuple(slots.shape)}")
    if problems:
        raise ValueError("fused_recurrent_gated_delta_rule_kernel: " + "; ".join(problems))
    if out is None:
        out = torch.empty(batch, heads, v_dim, dtype=out_dtype or torch.float32, device=v.device)
    if batch == 0:
        return out
    block_k = next_power_of_2(k_dim)
    block_v = block_v or min(32, next_power_of_2(v_dim))
    args = (
        q,
        k,
        v,
        g,
        beta,
        a_log if gating else g,
        dt_bias if gating else g,
        out,
        states,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        k_dim,
        v_dim,
        heads // key_heads,
        scale,
        eps,
    )
    constexprs = {"L2NORM": l2norm, "GATING": gating, "BLOCK_K": block_k, "BLOCK_V": block_v}
    grid = (cdiv(v_dim, block_v), heads, batch)
    if INTERPRETING:
        _recurrent_kernel[grid](*args, **constexprs)
    else:
        _recurrent_kernel[grid](*args, **constexprs, num_warps=NUM_WARPS)
    return out


@host_launched
@triton.jit
def _recurrent_chain_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    out_ptr,
    state_ptr,
    slot_ptr,
    source_ptr,
    length_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_a_tok,
    stride_b_tok,
    stride_out_tok,
    stride_out_head,
    stride_state_slot,
    stride_state_head,
    stride_state_k,
    k_dim,
    v_dim,
    group,
    scale,
    eps,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    v_block = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.program_id(2).to(tl.int64)
    # the rows of the chain this row starts (0: a later row of a chain, computed by its first row's program)
    length = tl.load(length_ptr + first)
    key_head = head // group
    k_cols = tl.arange(0, BLOCK_K)
    v_cols = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_in = k_cols < k_dim
    v_in = v_cols < v_dim
    mask = k_in[:, None] & v_in[None, :]
    tile = head * stride_state_head + k_cols[:, None] * stride_state_k + v_cols[None, :]
    source = tl.load(source_ptr + first).to(tl.int64)
    state = tl.load(state_ptr + source * stride_state_slot + tile, mask=mask & (length > 0), other=0.0)
    a_log = tl.load(a_log_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    for t in range(0, length):  # the chain's tokens in order, the state carried in registers
        row = first + t
        q = tl.load(q_ptr + row * stride_q_tok + key_head * stride_q_head + k_cols, mask=k_in, other=0.0)
        k = tl.load(k_ptr + row * stride_k_tok + key_head * stride_k_head + k_cols, mask=k_in, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        v = tl.load(v_ptr + row * stride_v_tok + head * stride_v_head + v_cols, mask=v_in, other=0.0)
        v = v.to(tl.float32)
        x = tl.load(a_ptr + row * stride_a_tok + head).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(a_log) * softplus
        b_in = tl.load(b_ptr + row * stride_b_tok + head)
        beta = tl.sigmoid(b_in.to(tl.float32)).to(b_in.dtype).to(tl.float32)
        state = state * tl.exp(g)
        predicted = tl.sum(state * k[:, None], axis=0)
        delta = (v - predicted) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        tl.store(state_ptr + slot * stride_state_slot + tile, state, mask=mask)
        tl.store(
            out_ptr + row * stride_out_tok + head * stride_out_head + v_cols,
            out.to(out_ptr.dtype.element_ty),
            mask=v_in,
        )


def fused_recurrent_gated_delta_rule_chain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor,
    lengths: torch.Tensor,
    *,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    scale: float,
    eps: float = 1e-6,
    block_v: int | None = None,
) -> torch.Tensor:
    """A speculative verify step's decode rows (models/delta_net_chain.py): B rows, each a token whose
    state continues another's. A row that starts a chain of n rows (lengths[row] = n; 0 for the chain's
    later rows, which follow it) reads states[sources[row]], runs the rule over the n tokens in order and
    writes the state after each token t to states[slots[row + t]]: one program per chain (and block of
    value columns and head), the state in registers between tokens. A plain decode row is a chain of 1
    whose source is its own slot (updated in place). Inputs as fused_recurrent_gated_delta_rule_kernel's
    with the gating (a, b: in_proj_a's and in_proj_b's outputs) and l2norm; slots, sources, lengths [B]
    int device tensors. Returns out [B, value heads, v_dim] float32. No host sync (the loop's length is
    read on the device)."""
    batch, key_heads, k_dim = k.shape
    heads, v_dim = v.shape[1], v.shape[2]
    problems = []
    if q.shape != k.shape or v.shape[0] != batch or heads % key_heads:
        problems.append(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if a.shape != (batch, heads) or b.shape != (batch, heads):
        problems.append(f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [{batch}, {heads}]")
    if a_log.shape != (heads,) or dt_bias.shape != (heads,):
        problems.append(f"a_log and dt_bias must be [{heads}]")
    if states.dim() != 4 or tuple(states.shape[1:]) != (heads, k_dim, v_dim):
        problems.append(f"states {tuple(states.shape)} must be [slots, {heads}, {k_dim}, {v_dim}]")
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        problems.append("states must be float32 with a contiguous last dim")
    if any(t.stride(-1) != 1 for t in (q, k, v, a, b)):
        problems.append("q, k, v, a and b need a contiguous last dim")
    for name, index in (("slots", slots), ("sources", sources), ("lengths", lengths)):
        if index.shape != (batch,) or index.dtype not in (torch.int32, torch.int64):
            problems.append(f"{name} must be int32/int64 [{batch}], got {index.dtype} {tuple(index.shape)}")
    if problems:
        raise ValueError("fused_recurrent_gated_delta_rule_chain: " + "; ".join(problems))
    out = torch.empty(batch, heads, v_dim, dtype=torch.float32, device=v.device)
    if batch == 0:
        return out
    block_v = block_v or min(32, next_power_of_2(v_dim))
    args = (
        q,
        k,
        v,
        a,
        b,
        a_log,
        dt_bias,
        out,
        states,
        slots,
        sources,
        lengths,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        b.stride(0),
        out.stride(0),
        out.stride(1),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        k_dim,
        v_dim,
        heads // key_heads,
        scale,
        eps,
    )
    constexprs = {"BLOCK_K": next_power_of_2(k_dim), "BLOCK_V": block_v}
    grid = (cdiv(v_dim, block_v), heads, batch)
    if INTERPRETING:
        _recurrent_chain_kernel[grid](*args, **constexprs)
    else:
        _recurrent_chain_kernel[grid](*args, **constexprs, num_warps=NUM_WARPS)
    return out
