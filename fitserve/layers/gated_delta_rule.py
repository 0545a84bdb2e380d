"""Gated DeltaNet's token mixing in torch: the short causal conv1d with its carried state, and the gated
delta rule, chunked for prompts and recurrent for decode steps (Qwen3.5 / Qwen3.6 linear_attention layers).

The gated delta rule keeps, per value head, a state S [k_dim, v_dim]. For each token t (decay g_t <= 0
in log space, learning rate beta_t in (0, 1), L2-normalised key k_t, query q_t scaled by k_dim^-0.5):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t

`recurrent_gated_delta_rule` runs that once for a batch of sequences (the decode step). A prompt runs
`chunk_gated_delta_rule`: tokens are split in chunks of C (64); within a chunk, with Gam_i the cumulative
log decay from the chunk start to token i, the C updates collapse into one lower unit-triangular system
(the UT transform of the WY representation):

    (I + A) U = beta * V,   (I + A) W = beta * exp(Gam) * K,   A_ij = beta_i k_i.k_j exp(Gam_i - Gam_j), j < i

so that the chunk's corrected values are V' = U - W S_0 (S_0: the state entering the chunk), its outputs
O = (Q * exp(Gam)) S_0 + (Q K^T * exp(Gam_i - Gam_j), j <= i) V', and the state leaving it
S_C = exp(Gam_C) S_0 + (K * exp(Gam_C - Gam))^T V'. Everything but the last two lines runs for all chunks
at once (one batched triangular solve); only the pass of the state from chunk to chunk is a loop, one
iteration per 64 tokens. All of it in float32, whatever the activations' dtype.

Shapes: a sequence's q, k [L, heads, k_dim] (q and k already repeated to the value heads), v [L, heads,
v_dim], g and beta [L, heads]; states [heads, k_dim, v_dim] (one sequence) or [B, heads, k_dim, v_dim].

On CUDA tensors (where triton is installed) every op here runs as Triton kernels (the CUDA branch at the
end of this file: fitserve/kernels/causal_conv1d.py, gated_delta_chunk.py, gated_delta_recurrent.py); the
torch code above is the CPU path and the kernels' reference. The batched ops (`causal_conv1d_varlen`,
`causal_conv1d_update`, `chunk_gated_delta_rule_varlen`, `fused_recurrent_gated_delta_rule_update`, and
`gated_delta_net_prefill` / `gated_delta_net_decode`, a layer's whole token mixing) take a step's sequences
at once and read and write their states in place in the layer's state pools by slot; the decode ones take
the slots as a device tensor and are CUDA-graph safe.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the form fla and transformers use)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal convolution, SiLU applied.

    x [L, C]; weight [C, K]; state [C, K - 1]: the K - 1 inputs before x (None: zeros, a fresh sequence).
    Returns (out [L, C] in x's dtype, the new state [C, K - 1]: the last K - 1 inputs, earlier state
    included when L < K - 1)."""
    if _use_kernels(x):  # CUDA: the Triton kernel (the CUDA branch at the end of this file)
        return _causal_conv1d_cuda(x, weight, state)
    channels, width = weight.shape
    if state is None:
        state = x.new_zeros((channels, width - 1))
    padded = torch.cat((state.to(x.dtype), x.transpose(0, 1)), dim=1)  # [C, K - 1 + L]
    out = F.conv1d(padded.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=channels)[0]
    new_state = padded[:, padded.shape[1] - (width - 1) :]
    return F.silu(out).transpose(0, 1).to(x.dtype), new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences: x [B, C], states [B, C, K - 1] -> (out [B, C], new states)."""
    if _use_kernels(x):
        return _causal_conv1d_step_cuda(x, weight, states)
    window = torch.cat((states.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, C, K]
    out = (window.to(weight.dtype) * weight.unsqueeze(0)).sum(dim=-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of B sequences: q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv].
    Returns (o [B, H, Dv] float32, the new state float32)."""
    if _use_kernels(v):
        return _recurrent_cuda(q, k, v, g, beta, state)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    decayed = state.float() * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", decayed, k)
    delta = (v - predicted) * beta.unsqueeze(-1)
    new_state = decayed + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", new_state, q), new_state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence of L tokens (see the module docstring): q, k [L, H, Dk]; v [L, H, Dv]; g, beta [L, H];
    state [H, Dk, Dv] entering the sequence (None: zeros). Returns (o [L, H, Dv], final state), float32."""
    if _use_chunk_kernel(v) and chunk_size == CHUNK_SIZE and k.shape[0] > 0:
        return _chunk_cuda(q, k, v, g, beta, state)
    length, heads, k_dim = k.shape
    v_dim = v.shape[-1]
    pad = (-length) % chunk_size
    # [H, N, C, D] after padding to whole chunks: padded tokens have k = v = 0 and g = 0, so they change
    # nothing (their own outputs are dropped)
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)).transpose(0, 1) for t in (g, beta))
    chunks = (length + pad) // chunk_size
    q, k, v = (t.reshape(heads, chunks, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(heads, chunks, chunk_size) for t in (g, beta))

    gam = g.cumsum(dim=-1)  # [H, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(Gam_i - Gam_j) for j <= i, 0 above the diagonal (masked before exp: no overflow)
    decay = (gam.unsqueeze(-1) - gam.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta.unsqueeze(-1)
    strictly_lower = (k_beta @ k.transpose(-1, -2)) * decay
    system = strictly_lower.masked_fill(~causal.tril(-1), 0.0) + torch.eye(
        chunk_size, dtype=q.dtype, device=q.device
    )
    rhs = torch.cat((v * beta.unsqueeze(-1), k_beta * gam.exp().unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :v_dim], solved[..., v_dim:]
    attention = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], lower triangle with the diagonal
    q_decayed = q * gam.exp().unsqueeze(-1)
    k_to_end = k * (gam[..., -1:] - gam).exp().unsqueeze(-1)
    chunk_decay = gam[..., -1].exp()  # [H, N]

    current = (
        torch.zeros(heads, k_dim, v_dim, dtype=q.dtype, device=q.device) if state is None else state.float()
    )
    out = torch.empty(heads, chunks, chunk_size, v_dim, dtype=q.dtype, device=q.device)
    for n in range(chunks):  # the state's pass from chunk to chunk: the only sequential part
        corrected = u[:, n] - w[:, n] @ current
        out[:, n] = q_decayed[:, n] @ current + attention[:, n] @ corrected
        current = current * chunk_decay[:, n, None, None] + k_to_end[:, n].transpose(-1, -2) @ corrected
    out = out.reshape(heads, chunks * chunk_size, v_dim)[:, :length].transpose(0, 1)
    return out, current


# --- Batched ops on a state pool -------------------------------------------------------------------------
# The same ops over a step's sequences at once, each sequence's state read from and written back to its slot
# of the layer's pools (worker/recurrent_state.py): conv [slots, C, K - 1] (model dtype) and recurrent
# [slots, H, Dk, Dv] (float32). q and k come per key head ([T, key heads, Dk]; value head h reads key head
# h // (H / key heads)). On CUDA each runs as Triton kernels (below); elsewhere it loops over the
# sequences with the ops above.


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    states: torch.Tensor,
    query_lens: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
) -> torch.Tensor:
    """Packed prompt pieces x [T, C] -> out [T, C] (x's dtype, SiLU applied); each sequence's new conv
    state written to states[slot] (its old one read where has_initial_state, zeros otherwise)."""
    if _use_kernels(x):
        from fitserve.kernels.causal_conv1d import causal_conv1d_varlen as kernel

        return kernel(_last_dim_contiguous(x), weight, states, query_lens, slots, has_initial_state)
    out = torch.empty_like(x)
    start = 0
    for length, slot, initial in zip(query_lens, slots, has_initial_state):
        if length > 0:
            rows = slice(start, start + length)
            out[rows], new_state = causal_conv1d(x[rows], weight, states[slot] if initial else None)
            states[slot] = new_state
        start += length
    return out


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token for each of B sequences: x [B, C] -> out [B, C]; states[slots] shifted in place. slots [B]
    int tensor on x's device (negative: a padded row, zero output). CUDA-graph safe on CUDA."""
    if _use_kernels(x):
        from fitserve.kernels.causal_conv1d import causal_conv1d_update as kernel

        return kernel(_last_dim_contiguous(x), weight, states, slots)
    live = slots >= 0
    out = torch.zeros_like(x)
    rows, live_slots = live.nonzero()[:, 0], slots[live].long()
    out[rows], new_states = causal_conv1d_step(x[rows], weight, states[live_slots])
    states[live_slots] = new_states.to(states.dtype)
    return out


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    query_lens: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
    *,
    l2norm: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    """The chunked rule over packed sequences: q, k [T, key heads, Dk]; v [T, H, Dv]; g, beta [T, H].
    Returns o [T, H, Dv] float32; each sequence's final state written to states[slot] (its initial one
    read from there where has_initial_state, zeros otherwise). l2norm: q and k L2-normalised here (q then
    times scale); otherwise used as given."""
    if _use_chunk_kernel(v):
        from fitserve.kernels.gated_delta_chunk import chunk_gated_delta_rule_kernel

        q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
        return chunk_gated_delta_rule_kernel(
            q, k, v, g, beta, states, query_lens, slots, has_initial_state, l2norm=l2norm, scale=scale
        )
    q, k = _value_heads(q, k, v.shape[1], l2norm, scale)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    start = 0
    for length, slot, initial in zip(query_lens, slots, has_initial_state):
        if length > 0:
            rows = slice(start, start + length)
            out[rows], new_state = chunk_gated_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot] if initial else None
            )
            states[slot] = new_state
        start += length
    return out


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float,
) -> torch.Tensor:
    """The decode step from the layer's raw inputs, states[slots] updated in place: q, k [B, key heads,
    Dk] (the conv output, L2-normalised here, q times scale); v [B, H, Dv]; a, b [B, H] (in_proj_a and
    in_proj_b outputs: g = -exp(a_log) softplus(a + dt_bias), beta = sigmoid(b)); slots [B] int tensor
    on v's device (negative: a padded row, zero output). Returns o [B, H, Dv] float32. CUDA-graph safe on
    CUDA (one kernel)."""
    if _use_kernels(v):
        from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_kernel

        q, k, v, a, b = (_last_dim_contiguous(t) for t in (q, k, v, a, b))
        return fused_recurrent_gated_delta_rule_kernel(
            q, k, v, a, b, states, slots, a_log=a_log, dt_bias=dt_bias, l2norm=True, scale=scale
        )
    q, k = _value_heads(q, k, v.shape[1], True, scale)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b)
    live = slots >= 0
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    rows, live_slots = live.nonzero()[:, 0], slots[live].long()
    out[rows], new_states = recurrent_gated_delta_rule(
        q[rows], k[rows], v[rows], g[rows], beta[rows], states[live_slots]
    )
    states[live_slots] = new_states
    return out


def gated_delta_net_prefill(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    query_lens: Sequence[int],
    slots: Sequence[int],
    has_initial_state: Sequence[bool],
    key_heads: int,
    k_dim: int,
) -> torch.Tensor:
    """A DeltaNet layer's token mixing for a step's prompt pieces, packed: qkv [T, conv_dim] (in_proj_qkv's
    output), g, beta [T, H] -> o [T, H, v_dim] float32, both states of each sequence read from (where
    has_initial_state) and written to its slot. On CUDA: three kernel launches for the whole batch (the
    conv, the chunked rule's two), q and k normalised in the kernel."""
    mixed = causal_conv1d_varlen(qkv, conv_weight, conv_states, query_lens, slots, has_initial_state)
    q, k, v = _split_heads(mixed, key_heads, k_dim, g.shape[1])
    return chunk_gated_delta_rule_varlen(
        q,
        k,
        v,
        g,
        beta,
        recurrent_states,
        query_lens,
        slots,
        has_initial_state,
        l2norm=True,
        scale=k_dim**-0.5,
    )


def gated_delta_net_decode(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    slots: torch.Tensor,
    key_heads: int,
    k_dim: int,
) -> torch.Tensor:
    """A DeltaNet layer's token mixing for B decode tokens: qkv [B, conv_dim], a, b [B, H] (in_proj_a and
    in_proj_b outputs) -> o [B, H, v_dim] float32, both states of slots[i] updated in place (slots [B] int
    tensor on qkv's device; negative: a padded row). On CUDA: two kernel launches, no host sync (CUDA-graph
    safe)."""
    mixed = causal_conv1d_update(qkv, conv_weight, conv_states, slots)
    q, k, v = _split_heads(mixed, key_heads, k_dim, a.shape[1])
    return fused_recurrent_gated_delta_rule_update(
        q, k, v, a, b, a_log, dt_bias, recurrent_states, slots, scale=k_dim**-0.5
    )


# --- A step's rows and slots -------------------------------------------------------------------------------
# Built once per step where the step's inputs are uploaded (worker/step_inputs.py), read by every DeltaNet
# layer (models/qwen3_5_delta_net.py): no layer builds an index tensor or copies anything to the device.


@dataclass
class StateRowsHost:
    """A step's sequences split for the DeltaNet layers, on the host: decode rows (one token after earlier
    ones: the recurrent update) and prompt pieces (the chunked rule). The arrays are uploaded with the
    step's other inputs; the lists stay on the host (the prefill kernels' launch tables)."""

    decode_slots: np.ndarray  # int32 [D]: each decode row's slot
    decode_rows: np.ndarray  # int64 [D]: their token rows (empty unless the step also has prompt pieces)
    prefill_rows: np.ndarray  # int64 [P]: the prompt pieces' token rows (empty unless decode rows too)
    prefill_query_lens: list[int]
    prefill_slots: list[int]
    prefill_initial: list[bool]  # False: a fresh sequence (first token at position 0), from zeros

    def arrays(self) -> list[np.ndarray]:
        return [self.decode_slots, self.decode_rows, self.prefill_rows]


def split_state_rows(
    query_lens: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int]
) -> StateRowsHost:
    """Each sequence of a step by its kind. A one-token sequence at position 0 is a prompt piece (it starts
    from zeros, not from whatever its slot holds)."""
    decode_rows: list[int] = []
    decode_slots: list[int] = []
    prefill_rows: list[int] = []
    lens: list[int] = []
    prefill_slots: list[int] = []
    initial: list[bool] = []
    start = 0
    for query_len, seq_len, slot in zip(query_lens, seq_lens, slots, strict=True):
        if query_len == 1 and seq_len > 1:
            decode_rows.append(start)
            decode_slots.append(slot)
        elif query_len > 0:
            prefill_rows.extend(range(start, start + query_len))
            lens.append(query_len)
            prefill_slots.append(slot)
            initial.append(seq_len > query_len)
        start += query_len
    mixed = bool(decode_rows) and bool(lens)
    return StateRowsHost(
        decode_slots=np.array(decode_slots, dtype=np.int32),
        decode_rows=np.array(decode_rows if mixed else [], dtype=np.int64),
        prefill_rows=np.array(prefill_rows if mixed else [], dtype=np.int64),
        prefill_query_lens=lens,
        prefill_slots=prefill_slots,
        prefill_initial=initial,
    )


@dataclass
class DeltaNetStepSlots:
    """A step's state slots on the device, as the DeltaNet layers read them (AttentionMetadata.state_slots).

    decode_slots: int32 [D], each decode row's slot (negative: a padded row of a captured batch, which
    touches no state); None without decode rows. decode_rows / prefill_rows: int64 token rows of each kind,
    given only when the step has both kinds (else the kind present owns every row, in order). The prompt
    pieces' lengths, slots and has-initial-state flags stay host lists (the prefill kernels' launch grids)."""

    decode_slots: torch.Tensor | None
    decode_rows: torch.Tensor | None = None
    prefill_rows: torch.Tensor | None = None
    prefill_query_lens: tuple[int, ...] = ()
    prefill_slots: tuple[int, ...] = ()
    prefill_initial: tuple[bool, ...] = ()

    @property
    def is_decode_only(self) -> bool:
        """Every row decodes: the step a CUDA graph can replay (worker/cuda_graphs.py)."""
        return not self.prefill_query_lens

    @classmethod
    def decode_only(cls, slots: torch.Tensor) -> DeltaNetStepSlots:
        return cls(decode_slots=slots)

    @classmethod
    def from_host(cls, host: StateRowsHost, uploaded: Sequence[torch.Tensor]) -> DeltaNetStepSlots:
        """host's split with its arrays as uploaded (in `host.arrays()` order)."""
        decode_slots, decode_rows, prefill_rows = uploaded
        mixed = decode_rows.numel() > 0
        return cls(
            decode_slots=decode_slots if decode_slots.numel() else None,
            decode_rows=decode_rows if mixed else None,
            prefill_rows=prefill_rows if mixed else None,
            prefill_query_lens=tuple(host.prefill_query_lens),
            prefill_slots=tuple(host.prefill_slots),
            prefill_initial=tuple(host.prefill_initial),
        )

    @classmethod
    def build(
        cls, query_lens: Sequence[int], seq_lens: Sequence[int], slots: Sequence[int], device: torch.device
    ) -> DeltaNetStepSlots:
        """Split and copied to the device here (callers that do not go through the step's upload)."""
        host = split_state_rows(query_lens, seq_lens, slots)
        return cls.from_host(host, [torch.from_numpy(a).to(device) for a in host.arrays()])


def _split_heads(
    mixed: torch.Tensor, key_heads: int, k_dim: int, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output [N, conv_dim] -> views q, k [N, key heads, k_dim], v [N, heads, v_dim]."""
    n, key_size = mixed.shape[0], key_heads * k_dim
    q = mixed[:, :key_size].view(n, key_heads, k_dim)
    k = mixed[:, key_size : 2 * key_size].view(n, key_heads, k_dim)
    v = mixed[:, 2 * key_size :].view(n, heads, -1)
    return q, k, v


def _value_heads(
    q: torch.Tensor, k: torch.Tensor, heads: int, l2norm: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k per key head -> float32 per value head, normalised (and q scaled) if asked."""
    q, k = q.float(), k.float()
    if l2norm:
        q, k = l2_normalize(q) * scale, l2_normalize(k)
    repeat = heads // k.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    return q, k


# --- CUDA branch: the Triton kernels ------------------------------------------------------------------------
# fitserve/kernels/causal_conv1d.py, gated_delta_chunk.py, gated_delta_recurrent.py (they import triton, so
# only here, on CUDA tensors). The per-sequence ops above run one sequence through them, its state in a
# one-slot pool; the batched ops call them directly.


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and _triton_available()


def _use_chunk_kernel(t: torch.Tensor) -> bool:
    """The chunked kernel needs ~116 KB of shared memory a block below compute capability 8.0 at any tile
    (kernels/gated_delta_chunk.runs_on): a V100 / T4 / 2080 Ti prefills through the torch ops above."""
    if not _use_kernels(t):
        return False
    from fitserve.kernels.gated_delta_chunk import runs_on

    return runs_on(t.device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _causal_conv1d_cuda(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    from fitserve.kernels.causal_conv1d import causal_conv1d_varlen as kernel

    channels, width = weight.shape
    if state is None:
        pool = x.new_zeros((1, channels, width - 1))
    else:
        pool = state.to(x.dtype).reshape(1, channels, width - 1).clone()
    out = kernel(_last_dim_contiguous(x), weight, pool, [x.shape[0]], [0], [state is not None])
    return out, pool[0]


def _causal_conv1d_step_cuda(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from fitserve.kernels.causal_conv1d import causal_conv1d_update as kernel

    pool = states.to(x.dtype).contiguous().clone()
    slots = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    return kernel(_last_dim_contiguous(x), weight, pool, slots), pool


def _recurrent_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_kernel

    pool = state.to(torch.float32).contiguous().clone()
    slots = torch.arange(v.shape[0], dtype=torch.int32, device=v.device)
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
    return fused_recurrent_gated_delta_rule_kernel(q, k, v, g, beta, pool, slots), pool


def _chunk_cuda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fitserve.kernels.gated_delta_chunk import chunk_gated_delta_rule_kernel

    heads, k_dim, v_dim = v.shape[1], k.shape[2], v.shape[2]
    if state is None:
        pool = torch.zeros(1, heads, k_dim, v_dim, dtype=torch.float32, device=v.device)
    else:
        pool = state.to(torch.float32).reshape(1, heads, k_dim, v_dim).clone()
    q, k, v, g, beta = (_last_dim_contiguous(t) for t in (q, k, v, g, beta))
    out = chunk_gated_delta_rule_kernel(q, k, v, g, beta, pool, [v.shape[0]], [0], [state is not None])
    return out, pool[0]
