"""The chunked gated delta rule for prefill, over a packed batch of sequences of any lengths.

Semantics: fitserve.layers.gated_delta_rule.chunk_gated_delta_rule (its docstring derives the chunked
form) for each sequence of the batch, the sequence's state read from and written back to its slot of a
state pool [slots, value heads, k_dim, v_dim] (float32). Per chunk of CHUNK tokens, with Gam the
cumulative log decay from the chunk start and A_ij = beta_i k_i.k_j exp(Gam_i - Gam_j) (j < i):

    T = (I + A)^-1,   W = T (beta exp(Gam) K),   U = T (beta V),   V' = U - W S
    O = (Q exp(Gam)) S + ((Q K^T) * exp(Gam_i - Gam_j), j <= i) V'
    S <- exp(Gam_last) S + (K exp(Gam_last - Gam))^T V'

Two kernels:
- `_chunk_inverse_kernel`, one program per (chunk, value head) of the whole batch, all in parallel: the
  chunk's A from K K^T and T by forward substitution (row i of T is e_i - sum_{j<i} A_ij T_j), written
  to a float32 scratch [chunks, heads, CHUNK, CHUNK];
- `_chunk_state_kernel`, one program per (block of BLOCK_V value columns, value head, sequence): the
  state's pass from chunk to chunk, sequential within the sequence. The delta rule is separable in the
  value columns (column j of S, U, V' and O depends on column j of V only), so each program keeps a
  [k_dim, BLOCK_V] slice of the state in registers and never talks to the others.

Everything is float32 (the activations are widened on load); the dots take float32 operands, which
Triton runs as TF32 on the tensor cores unless DOT_PRECISION says "ieee". q and k may be given per key
head ([T, key heads, k_dim]: value head h reads key head h // (value heads / key heads)) and raw (L2NORM:
normalised in the kernel, q then times `scale`), as the layer's conv output holds them.

Reference: fitserve.layers.gated_delta_rule.chunk_gated_delta_rule per sequence. Imports triton: CUDA code
paths only (kernels/__init__.py); under TRITON_INTERPRET=1 it also runs on CPU tensors
(tests/unit/test_gated_delta_kernels_interpret.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from fitserve.kernels.capability import kernel_capability, shared_memory_per_block
from fitserve.kernels.fast_launch import INTERPRETING, host_launched
from fitserve.kernels.grid_math import cdiv, next_power_of_2

CHUNK = 64
MAX_K_DIM = 256  # the whole k_dim of a chunk is one tile (q, k, w: [CHUNK, k_dim] float32 in registers)
DOT_PRECISION = "tf32"
INVERSE_WARPS = 4
STATE_WARPS = 8
# software pipelining of the state kernel's per-chunk loads (q, k, v, the inverse: ~56 KB a stage in
# bfloat16); a kernel whose stages do not fit the shared memory is relaunched with one stage
NUM_STAGES = 2
_fitting_stages: dict[tuple, int] = {}
# Below sm_80 Triton 3.6 has no tensor-core dot: tl.dot runs on FMAs with float32 operand tiles in shared
# memory, and the state kernel (k_dim 128) asks ~116 KB at any BLOCK_V (118784 B at 16, 122880 at 32;
# sm_75 and sm_70 builds), more than a V100 (96 KB) or T4 (64 KB) block may have. There the kernel refuses
# and the layer is to take its torch path (layers/gated_delta_rule.py, by runs_on).
MIN_CAPABILITY = (8, 0)


def runs_on(device: torch.device) -> bool:
    """Whether chunk_gated_delta_rule_kernel runs on `device` (CPU: the interpreter's; CUDA: from
    MIN_CAPABILITY on, by kernels/capability.py, so a forced target counts)."""
    capability = kernel_capability(device)
    return capability is None or capability >= MIN_CAPABILITY


# value columns a state program owns, by the shared memory a block may have (kernels/capability.py; the
# state kernel at k_dim 128, 8 warps, one stage: 115 KB at 64 columns, compiled for sm_86)
WIDE_BLOCK_V_MIN_SHARED = 160 * 1024


def default_block_v(v_dim: int, shared_memory: int) -> int:
    """64 value columns a program where a block may have WIDE_BLOCK_V_MIN_SHARED bytes (A100, H100),
    else 32 (A10 / RTX 30xx and 40xx / L4: 99 KB; V100: 96 KB; T4: 64 KB); fewer for narrow heads."""
    widest = 64 if shared_memory >= WIDE_BLOCK_V_MIN_SHARED else 32
    return max(16, min(widest, next_power_of_2(v_dim)))


@host_launched
@triton.jit
def _chunk_inverse_kernel(
    k_ptr,
    g_ptr,
    beta_ptr,
    inverse_ptr,
    chunk_start_ptr,
    chunk_len_ptr,
    stride_k_tok,
    stride_k_head,
    stride_g_tok,
    stride_beta_tok,
    num_heads,
    k_dim,
    group,
    eps,
    L2NORM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(chunk_start_ptr + chunk).to(tl.int64)
    length = tl.load(chunk_len_ptr + chunk)
    rows = tl.arange(0, CHUNK)
    cols = tl.arange(0, BLOCK_K)
    valid = rows < length
    tokens = start + rows
    k_rows = k_ptr + tokens[:, None] * stride_k_tok + (head // group) * stride_k_head + cols[None, :]
    k = tl.load(k_rows, mask=valid[:, None] & (cols[None, :] < k_dim), other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    g = tl.load(g_ptr + tokens * stride_g_tok + head, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tokens * stride_beta_tok + head, mask=valid, other=0.0).to(tl.float32)
    gam = tl.cumsum(g, axis=0)
    # A transposed: a_t[j, i] = A_ij = beta_i k_i.k_j exp(Gam_i - Gam_j) for j < i (above the diagonal),
    # 0 elsewhere (masked before exp: no overflow). Transposed, row i of A is a column: its extraction
    # reduces within rows and lands in the layout that scales the rows of the inverse, no conversion.
    above = rows[:, None] < rows[None, :]
    decay_t = tl.exp(tl.where(above, gam[None, :] - gam[:, None], float("-inf")))
    a_t = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * beta[None, :] * decay_t
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    # forward substitution: rows before i are final when row i is computed (A_ij = 0 for j >= i)
    for i in range(1, CHUNK):
        a_row = tl.sum(tl.where(rows[None, :] == i, a_t, 0.0), axis=1)  # A[i, j], indexed by j
        combined = tl.sum(a_row[:, None] * inverse, axis=0)  # sum_j A_ij T_j
        inverse = tl.where(rows[:, None] == i, inverse - combined[None, :], inverse)
    base = (chunk.to(tl.int64) * num_heads + head) * CHUNK * CHUNK
    tl.store(inverse_ptr + base + rows[:, None] * CHUNK + rows[None, :], inverse)


@host_launched
@triton.jit
def _chunk_state_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    inverse_ptr,
    out_ptr,
    state_ptr,
    seq_start_ptr,
    seq_end_ptr,
    first_chunk_ptr,
    slot_ptr,
    has_initial_ptr,
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
    num_heads,
    k_dim,
    v_dim,
    group,
    scale,
    eps,
    L2NORM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    v_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    seq_start = tl.load(seq_start_ptr + seq)
    seq_end = tl.load(seq_end_ptr + seq)
    first_chunk = tl.load(first_chunk_ptr + seq).to(tl.int64)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    has_initial = tl.load(has_initial_ptr + seq) != 0
    key_head = head // group

    rows = tl.arange(0, CHUNK)
    k_cols = tl.arange(0, BLOCK_K)
    v_cols = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_in = k_cols < k_dim
    v_in = v_cols < v_dim
    state_tile = (
        state_ptr
        + slot * stride_state_slot
        + head * stride_state_head
        + k_cols[:, None] * stride_state_k
        + v_cols[None, :]
    )
    state_mask = k_in[:, None] & v_in[None, :]
    state = tl.load(state_tile, mask=state_mask & has_initial, other=0.0).to(tl.float32)

    causal = rows[:, None] >= rows[None, :]
    num_chunks = tl.cdiv(seq_end - seq_start, CHUNK)
    for n in range(0, num_chunks):
        tokens = (seq_start + n * CHUNK + rows).to(tl.int64)
        valid = tokens < seq_end
        row_k_mask = valid[:, None] & k_in[None, :]
        q = tl.load(
            q_ptr + tokens[:, None] * stride_q_tok + key_head * stride_q_head + k_cols[None, :],
            mask=row_k_mask,
            other=0.0,
        ).to(tl.float32)
        k = tl.load(
            k_ptr + tokens[:, None] * stride_k_tok + key_head * stride_k_head + k_cols[None, :],
            mask=row_k_mask,
            other=0.0,
        ).to(tl.float32)
        if L2NORM:
            q = q * (tl.rsqrt(tl.sum(q * q, axis=1) + eps) * scale)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
        v = tl.load(
            v_ptr + tokens[:, None] * stride_v_tok + head * stride_v_head + v_cols[None, :],
            mask=valid[:, None] & v_in[None, :],
            other=0.0,
        ).to(tl.float32)
        g = tl.load(g_ptr + tokens * stride_g_tok + head, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tokens * stride_beta_tok + head, mask=valid, other=0.0).to(tl.float32)
        inverse_base = ((first_chunk + n) * num_heads + head) * CHUNK * CHUNK
        inverse = tl.load(inverse_ptr + inverse_base + rows[:, None] * CHUNK + rows[None, :])

        gam = tl.cumsum(g, axis=0)
        gam_last = tl.sum(g, axis=0)  # padded rows have g = 0
        w = tl.dot(inverse, k * (beta * tl.exp(gam))[:, None], input_precision=DOT_PRECISION)
        u = tl.dot(inverse, v * beta[:, None], input_precision=DOT_PRECISION)
        corrected = u - tl.dot(w, state, input_precision=DOT_PRECISION)  # V' [CHUNK, BLOCK_V]
        decay = tl.exp(tl.where(causal, gam[:, None] - gam[None, :], float("-inf")))
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay
        out = tl.dot(q * tl.exp(gam)[:, None], state, input_precision=DOT_PRECISION)
        out += tl.dot(scores, corrected, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + tokens[:, None] * stride_out_tok + head * stride_out_head + v_cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & v_in[None, :],
        )
        k_to_end = k * tl.exp(gam_last - gam)[:, None]
        state = state * tl.exp(gam_last) + tl.dot(
            tl.trans(k_to_end), corrected, input_precision=DOT_PRECISION
        )
    tl.store(state_tile, state, mask=state_mask)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
) -> None:
    tokens, key_heads, k_dim = k.shape
    heads, v_dim = v.shape[1], v.shape[2]
    problems = []
    if q.shape != k.shape or v.shape[0] != tokens:
        problems.append(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if heads % key_heads:
        problems.append(f"{heads} value heads are not a multiple of {key_heads} key heads")
    if g.shape != (tokens, heads) or beta.shape != (tokens, heads):
        problems.append(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [{tokens}, {heads}]")
    if states.dim() != 4 or tuple(states.shape[1:]) != (heads, k_dim, v_dim):
        problems.append(f"states {tuple(states.shape)} must be [slots, {heads}, {k_dim}, {v_dim}]")
    if states.dtype != torch.float32 or states.stride(-1) != 1:
        problems.append("states must be float32 with a contiguous last dim")
    if any(t.stride(-1) != 1 for t in (q, k, v)) or g.stride(-1) != 1 or beta.stride(-1) != 1:
        problems.append("q, k, v, g and beta need a contiguous last dim")
    if k_dim > MAX_K_DIM:
        problems.append(f"k_dim {k_dim} > {MAX_K_DIM}")
    if problems:
        raise ValueError("chunk_gated_delta_rule_kernel: " + "; ".join(problems))


def chunk_gated_delta_rule_kernel(
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
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """The packed sequences' outputs [T, value heads, v_dim] (out_dtype, default float32); each
    sequence's final state is written to states[slot] (its initial state read from there where
    has_initial_state, zeros otherwise).

    q, k [T, key heads, k_dim]; v [T, value heads, v_dim]; g, beta [T, value heads]: any float dtype,
    strided rows allowed (contiguous last dim). query_lens, slots, has_initial_state: per sequence, on
    the host (a prefill step is not captured). l2norm: q and k L2-normalised in the kernel, q times scale
    (else they are used as given, scale ignored)."""
    if not runs_on(v.device):
        have, need = kernel_capability(v.device), MIN_CAPABILITY
        raise ValueError(
            f"the chunked Gated DeltaNet kernel needs compute capability {need[0]}.{need[1]} (its tiles do "
            f"not fit the shared memory of a {have[0]}.{have[1]} GPU's block): run the torch path of "
            "fitserve/layers/gated_delta_rule.py there (gated_delta_chunk.runs_on)"
        )
    _check(q, k, v, g, beta, states)
    tokens, key_heads, k_dim = k.shape
    heads, v_dim = v.shape[1], v.shape[2]
    out = torch.empty(tokens, heads, v_dim, dtype=out_dtype or torch.float32, device=v.device)
    lengths = [int(n) for n in query_lens]
    if sum(lengths) != tokens or len(slots) != len(lengths) or len(has_initial_state) != len(lengths):
        raise ValueError(
            f"query_lens (sum {sum(lengths)}), slots ({len(slots)}) and has_initial_state "
            f"({len(has_initial_state)}) do not describe {tokens} tokens of {len(lengths)} sequences"
        )
    # empty sequences keep their state and make no chunks
    seq_start, seq_end, first_chunk, seq_slot, seq_initial = [], [], [], [], []
    chunk_start, chunk_len = [], []
    position = 0
    for n, slot, initial in zip(lengths, slots, has_initial_state):
        if n > 0:
            seq_start.append(position)
            seq_end.append(position + n)
            first_chunk.append(len(chunk_start))
            seq_slot.append(int(slot))
            seq_initial.append(int(bool(initial)))
            for offset in range(0, n, CHUNK):
                chunk_start.append(position + offset)
                chunk_len.append(min(CHUNK, n - offset))
        position += n
    if not seq_start:
        return out
    table = torch.tensor([chunk_start, chunk_len], dtype=torch.int32).to(v.device, non_blocking=True)
    per_seq = torch.tensor([seq_start, seq_end, first_chunk, seq_slot, seq_initial], dtype=torch.int32).to(
        v.device, non_blocking=True
    )
    num_chunks = len(chunk_start)
    inverse = torch.empty(num_chunks, heads, CHUNK, CHUNK, dtype=torch.float32, device=v.device)
    block_k = max(16, next_power_of_2(k_dim))
    block_v = block_v or default_block_v(v_dim, shared_memory_per_block(kernel_capability(v.device)))
    group = heads // key_heads
    _launch(
        _chunk_inverse_kernel,
        (num_chunks, heads),
        (
            k,
            g,
            beta,
            inverse,
            table[0],
            table[1],
            k.stride(0),
            k.stride(1),
            g.stride(0),
            beta.stride(0),
            heads,
            k_dim,
            group,
            eps,
        ),
        {"L2NORM": l2norm, "CHUNK": CHUNK, "BLOCK_K": block_k, "DOT_PRECISION": DOT_PRECISION},
        INVERSE_WARPS,
    )
    _launch(
        _chunk_state_kernel,
        (cdiv(v_dim, block_v), heads, len(seq_start)),
        (
            q,
            k,
            v,
            g,
            beta,
            inverse,
            out,
            states,
            per_seq[0],
            per_seq[1],
            per_seq[2],
            per_seq[3],
            per_seq[4],
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
            heads,
            k_dim,
            v_dim,
            group,
            scale,
            eps,
        ),
        {
            "L2NORM": l2norm,
            "CHUNK": CHUNK,
            "BLOCK_K": block_k,
            "BLOCK_V": block_v,
            "DOT_PRECISION": DOT_PRECISION,
        },
        STATE_WARPS,
    )
    return out


def _launch(kernel, grid, args, constexprs, num_warps: int) -> None:
    if INTERPRETING:  # the interpreter runs the JIT function itself, without launch options
        kernel[grid](*args, **constexprs)
        return
    key = (id(kernel), tuple(sorted(constexprs.items())), num_warps)
    stages = _fitting_stages.get(key, NUM_STAGES)
    try:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=stages)
    except OutOfResources:  # raised when the kernel is loaded, before it runs: nothing written yet
        if stages == 1:
            raise
        _fitting_stages[key] = 1
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=1)
