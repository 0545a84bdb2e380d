"""Gated DeltaNet's short depthwise causal conv1d (width K, 4 in the Qwen3.5 / 3.6 checkpoints), SiLU
applied, with each sequence's conv state (its last K - 1 inputs) in a slot of a pool [slots, channels,
K - 1] (the model dtype).

- `causal_conv1d_varlen`: a packed batch of prompt pieces (prefill). Token t of a sequence sums
  weight[c, j] * input[t - (K - 1) + j] over j, inputs before the sequence's first token read from its
  slot's state (zeros for a fresh sequence). Two kernels: the outputs (one program per BLOCK_T tokens of a
  sequence x BLOCK_C channels), then the new states (one program per sequence x BLOCK_C channels),
  launched after the first so that no program overwrites a state another one still reads.
- `causal_conv1d_update`: one token for each of B sequences (decode): out = silu(weight . [state, x]),
  the state shifted by one in place. CUDA-graph safe (slots a device tensor; a negative slot marks a
  padded row: no state read or written, a zero output).

- `causal_conv1d_chain`: a speculative verify step's rows, each request's tokens in order in one program,
  the state after each token written to its own slot (worker/state_rings.py says why).

Float32 accumulation, the output rounded once to x's dtype. Reference:
fitserve.layers.gated_delta_rule.causal_conv1d and causal_conv1d_step. Imports triton: CUDA code paths
only; under TRITON_INTERPRET=1 it also runs on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fitserve.kernels.fast_launch import INTERPRETING, host_launched
from fitserve.kernels.grid_math import cdiv, next_power_of_2

BLOCK_T = 32
BLOCK_C = 128
UPDATE_BLOCK_C = 256
NUM_WARPS = 4


@host_launched
@triton.jit
def _conv_varlen_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    state_ptr,
    block_seq_ptr,
    block_start_ptr,
    seq_start_ptr,
    seq_len_ptr,
    slot_ptr,
    has_initial_ptr,
    stride_x_tok,
    stride_out_tok,
    stride_weight,
    stride_state_slot,
    stride_state_chan,
    channels,
    WIDTH: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    block = tl.program_id(0)
    seq = tl.load(block_seq_ptr + block)
    first = tl.load(block_start_ptr + block)
    start = tl.load(seq_start_ptr + seq).to(tl.int64)
    length = tl.load(seq_len_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + seq) != 0
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_in = chans < channels
    local = first + tl.arange(0, BLOCK_T)  # token positions within the sequence
    token_in = local < length
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(WIDTH):
        source = local - (WIDTH - 1) + j  # the input's position; < 0: from the state
        from_x = token_in & (source >= 0)
        x = tl.load(
            x_ptr + (start + source)[:, None] * stride_x_tok + chans[None, :],
            mask=from_x[:, None] & chan_in[None, :],
            other=0.0,
        ).to(tl.float32)
        from_state = token_in & (source < 0) & has_initial
        carried = tl.load(
            state_ptr
            + slot * stride_state_slot
            + chans[None, :] * stride_state_chan
            + (WIDTH - 1 + source)[:, None],
            mask=from_state[:, None] & chan_in[None, :],
            other=0.0,
        ).to(tl.float32)
        tap = tl.load(weight_ptr + chans * stride_weight + j, mask=chan_in, other=0.0).to(tl.float32)
        acc += (x + carried) * tap[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + (start + local)[:, None] * stride_out_tok + chans[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=token_in[:, None] & chan_in[None, :],
    )


@host_launched
@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    seq_start_ptr,
    seq_len_ptr,
    slot_ptr,
    has_initial_ptr,
    stride_x_tok,
    stride_state_slot,
    stride_state_chan,
    channels,
    WIDTH: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    start = tl.load(seq_start_ptr + seq).to(tl.int64)
    length = tl.load(seq_len_ptr + seq)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + seq) != 0
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_in = chans < channels
    column = tl.arange(0, BLOCK_S)  # the new state's column i holds input length - (K - 1) + i
    column_in = column < WIDTH - 1
    source = length - (WIDTH - 1) + column
    from_x = column_in & (source >= 0)
    x = tl.load(
        x_ptr + (start + source)[None, :] * stride_x_tok + chans[:, None],
        mask=chan_in[:, None] & from_x[None, :],
        other=0.0,
    )
    tile = state_ptr + slot * stride_state_slot + chans[:, None] * stride_state_chan
    from_state = column_in & (source < 0) & has_initial
    carried = tl.load(
        tile + (WIDTH - 1 + source)[None, :], mask=chan_in[:, None] & from_state[None, :], other=0.0
    )
    new = tl.where(from_x[None, :], x.to(state_ptr.dtype.element_ty), carried)
    tl.store(tile + column[None, :], new, mask=chan_in[:, None] & column_in[None, :])


@host_launched
@triton.jit
def _conv_update_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    state_ptr,
    slot_ptr,
    stride_x_tok,
    stride_out_tok,
    stride_weight,
    stride_state_slot,
    stride_state_chan,
    channels,
    WIDTH: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_in = chans < channels
    taps = tl.arange(0, BLOCK_W)
    tile = state_ptr + slot * stride_state_slot + chans[:, None] * stride_state_chan
    x = tl.load(x_ptr + row * stride_x_tok + chans, mask=chan_in & live, other=0.0)
    # the window [state, x]: tap j < K - 1 from state column j, tap K - 1 from x
    from_state = chan_in[:, None] & (taps < WIDTH - 1)[None, :] & live
    window = tl.load(tile + taps[None, :], mask=from_state, other=0.0)
    window = tl.where((taps == WIDTH - 1)[None, :], x[:, None].to(window.dtype), window)
    # the new state: column i holds tap i + 1 of the window
    shifted = tl.load(tile + 1 + taps[None, :], mask=from_state & (taps < WIDTH - 2)[None, :], other=0.0)
    shifted = tl.where((taps == WIDTH - 2)[None, :], x[:, None].to(shifted.dtype), shifted)
    weight = tl.load(
        weight_ptr + chans[:, None] * stride_weight + taps[None, :],
        mask=chan_in[:, None] & (taps < WIDTH)[None, :],
        other=0.0,
    )
    acc = tl.sum(window.to(tl.float32) * weight.to(tl.float32), axis=1)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + row * stride_out_tok + chans, acc.to(out_ptr.dtype.element_ty), mask=chan_in)
    tl.store(tile + taps[None, :], shifted, mask=from_state)


@host_launched
@triton.jit
def _conv_chain_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    state_ptr,
    slot_ptr,
    source_ptr,
    length_ptr,
    stride_x_tok,
    stride_out_tok,
    stride_weight,
    stride_state_slot,
    stride_state_chan,
    channels,
    WIDTH: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64)
    # the rows of the chain this row starts (0: a later row of a chain, computed by its first row's program)
    length = tl.load(length_ptr + first)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_in = chans < channels
    taps = tl.arange(0, BLOCK_W)
    from_state = chan_in[:, None] & (taps < WIDTH - 1)[None, :]
    weight = tl.load(
        weight_ptr + chans[:, None] * stride_weight + taps[None, :],
        mask=chan_in[:, None] & (taps < WIDTH)[None, :],
        other=0.0,
    ).to(tl.float32)
    current = tl.load(source_ptr + first).to(tl.int64)
    for t in range(0, length):  # the chain's tokens in order, each state read from the row the last wrote
        row = first + t
        tile = state_ptr + current * stride_state_slot + chans[:, None] * stride_state_chan
        x = tl.load(x_ptr + row * stride_x_tok + chans, mask=chan_in, other=0.0)
        window = tl.load(tile + taps[None, :], mask=from_state, other=0.0)
        window = tl.where((taps == WIDTH - 1)[None, :], x[:, None].to(window.dtype), window)
        shifted = tl.load(tile + 1 + taps[None, :], mask=from_state & (taps < WIDTH - 2)[None, :], other=0.0)
        shifted = tl.where((taps == WIDTH - 2)[None, :], x[:, None].to(shifted.dtype), shifted)
        acc = tl.sum(window.to(tl.float32) * weight, axis=1)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * stride_out_tok + chans, acc.to(out_ptr.dtype.element_ty), mask=chan_in)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        tl.debug_barrier()  # every thread has read the state before any overwrites it (a plain row's slot)
        target = state_ptr + slot * stride_state_slot + chans[:, None] * stride_state_chan
        tl.store(target + taps[None, :], shifted, mask=from_state)
        tl.debug_barrier()  # ... and has written it before the next token reads it
        current = slot


def _check(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, name: str) -> None:
    channels, width = weight.shape
    problems = []
    if x.dim() != 2 or x.shape[1] != channels or x.stride(-1) != 1:
        problems.append(f"x {tuple(x.shape)} must be [tokens, {channels}] with a contiguous last dim")
    if states.dim() != 3 or tuple(states.shape[1:]) != (channels, width - 1) or states.stride(-1) != 1:
        problems.append(f"states {tuple(states.shape)} must be [slots, {channels}, {width - 1}], contiguous")
    if weight.stride(-1) != 1 or width < 2:
        problems.append(f"weight {tuple(weight.shape)} must be [channels, K >= 2] with a contiguous last dim")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    query_lens: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
    *,
    silu: bool = True,
) -> torch.Tensor:
    """x [T, channels] (the packed sequences' tokens) -> out [T, channels] in x's dtype; each sequence's
    new state (its last K - 1 inputs, earlier state included when it is shorter) written to states[slot].
    query_lens, slots, has_initial_state: per sequence, on the host."""
    _check(x, weight, states, "causal_conv1d_varlen")
    tokens, channels = x.shape
    width = weight.shape[1]
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    lengths = [int(n) for n in query_lens]
    if sum(lengths) != tokens or len(slots) != len(lengths) or len(has_initial_state) != len(lengths):
        raise ValueError(
            f"causal_conv1d_varlen: query_lens (sum {sum(lengths)}), slots ({len(slots)}) and "
            f"has_initial_state ({len(has_initial_state)}) do not describe {tokens} tokens"
        )
    seq_start, seq_len, seq_slot, seq_initial, block_seq, block_start = [], [], [], [], [], []
    position = 0
    for n, slot, initial in zip(lengths, slots, has_initial_state):
        if n > 0:  # an empty sequence keeps its state
            for first in range(0, n, BLOCK_T):
                block_seq.append(len(seq_start))
                block_start.append(first)
            seq_start.append(position)
            seq_len.append(n)
            seq_slot.append(int(slot))
            seq_initial.append(int(bool(initial)))
        position += n
    if not seq_start:
        return out
    per_seq = torch.tensor([seq_start, seq_len, seq_slot, seq_initial], dtype=torch.int32)
    per_seq = per_seq.to(x.device, non_blocking=True)
    blocks = torch.tensor([block_seq, block_start], dtype=torch.int32).to(x.device, non_blocking=True)
    _launch(
        _conv_varlen_kernel,
        (len(block_seq), cdiv(channels, BLOCK_C)),
        (
            x,
            weight,
            out,
            states,
            blocks[0],
            blocks[1],
            per_seq[0],
            per_seq[1],
            per_seq[2],
            per_seq[3],
            x.stride(0),
            out.stride(0),
            weight.stride(0),
            states.stride(0),
            states.stride(1),
            channels,
        ),
        {"WIDTH": width, "SILU": silu, "BLOCK_T": BLOCK_T, "BLOCK_C": BLOCK_C},
    )
    _launch(
        _conv_state_kernel,
        (len(seq_start), cdiv(channels, BLOCK_C)),
        (
            x,
            states,
            per_seq[0],
            per_seq[1],
            per_seq[2],
            per_seq[3],
            x.stride(0),
            states.stride(0),
            states.stride(1),
            channels,
        ),
        {"WIDTH": width, "BLOCK_S": max(2, next_power_of_2(width - 1)), "BLOCK_C": BLOCK_C},
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    silu: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token for each of B sequences: x [B, channels] -> out [B, channels] (x's dtype); states[slots]
    shifted in place. slots [B] int device tensor (negative: a padded row)."""
    _check(x, weight, states, "causal_conv1d_update")
    batch, channels = x.shape
    if slots.shape != (batch,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"causal_conv1d_update: slots must be int32/int64 [{batch}], got {tuple(slots.shape)}"
        )
    if out is None:
        out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    width = weight.shape[1]
    _launch(
        _conv_update_kernel,
        (batch, cdiv(channels, UPDATE_BLOCK_C)),
        (
            x,
            weight,
            out,
            states,
            slots,
            x.stride(0),
            out.stride(0),
            weight.stride(0),
            states.stride(0),
            states.stride(1),
            channels,
        ),
        {"WIDTH": width, "SILU": silu, "BLOCK_W": next_power_of_2(width), "BLOCK_C": UPDATE_BLOCK_C},
    )
    return out


def causal_conv1d_chain(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor,
    lengths: torch.Tensor,
    *,
    silu: bool = True,
) -> torch.Tensor:
    """A speculative verify step's decode rows (models/delta_net_chain.py): x [B, channels] -> out [B,
    channels] (x's dtype). A row that starts a chain of n rows (lengths[row] = n; 0 for the chain's later
    rows, which follow it) reads states[sources[row]], and token t of the chain writes its new state to
    states[slots[row + t]], which token t + 1 reads: one program per chain and block of channels. A plain
    decode row is a chain of 1 whose source is its own slot. slots, sources, lengths [B] int device
    tensors; no host sync."""
    _check(x, weight, states, "causal_conv1d_chain")
    batch, channels = x.shape
    for name, index in (("slots", slots), ("sources", sources), ("lengths", lengths)):
        if index.shape != (batch,) or index.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"causal_conv1d_chain: {name} must be int32/int64 [{batch}], got {index.dtype} "
                f"{tuple(index.shape)}"
            )
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    width = weight.shape[1]
    _launch(
        _conv_chain_kernel,
        (batch, cdiv(channels, UPDATE_BLOCK_C)),
        (
            x,
            weight,
            out,
            states,
            slots,
            sources,
            lengths,
            x.stride(0),
            out.stride(0),
            weight.stride(0),
            states.stride(0),
            states.stride(1),
            channels,
        ),
        {"WIDTH": width, "SILU": silu, "BLOCK_W": next_power_of_2(width), "BLOCK_C": UPDATE_BLOCK_C},
    )
    return out


def _launch(kernel, grid, args, constexprs) -> None:
    if INTERPRETING:  # the interpreter runs the JIT function itself, without launch options
        kernel[grid](*args, **constexprs)
        return
    kernel[grid](*args, **constexprs, num_warps=NUM_WARPS)
