"""Torch reference semantics of every kernel in fitserve.kernels: plain torch, no triton, any device.

Each function computes in float32 from the same low-precision inputs and rounds once to the input
dtype, which is what the kernels do; the kernels' tests (tests/gpu) and benchmarks compare against
these. A float8 KV cache follows kv_format.py: written as clamp(x / scale), read as stored * scale in
float32; k_scale / v_scale are ignored for a cache in the model dtype.
"""

from __future__ import annotations

import torch

from fitserve.kernels.kv_format import dequantize_kv, is_fp8_kv_cache, kv_bytes_view, write_kv_cache


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes key/value [T, num_kv_heads, head_dim] into kv_cache [2, num_blocks, block_size, H, D].

    Token t goes to flat slot slot_mapping[t]; a negative slot (padding) writes nothing.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    write_kv_cache(kv_cache, key[valid], value[valid], slots, k_scale, v_scale)


def gather_sequence_kv(
    kv_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    context_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first context_len keys and values of one sequence, each [context_len, H, D]: as stored, or
    dequantized to float32 from a float8 cache."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_blocks = -(-context_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    stored = kv_bytes_view(kv_cache)[:, blocks].view(kv_cache.dtype)
    keys = stored[0].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:context_len]
    values = stored[1].reshape(num_blocks * block_size, num_kv_heads, head_dim)[:context_len]
    if is_fp8_kv_cache(kv_cache.dtype):
        return dequantize_kv(keys, torch.float32, k_scale), dequantize_kv(values, torch.float32, v_scale)
    return keys, values


def causal_attention_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One sequence: query [Q, Hq, D] are the last Q positions of a context of len(keys) tokens.

    Query row j sits at position len(keys) - Q + j and sees keys 0..that position. Float32 result.
    """
    num_queries, num_heads, _ = query.shape
    context_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.float().repeat_interleave(group, dim=1)
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
    key_pos = torch.arange(context_len, device=query.device)
    scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of query [T, Hq, D] over the paged cache, in the token layout of the layers'
    AttentionMetadata (query_start_loc, seq_lens, block_tables).

    Covers decode (every query length 1) and prefill/mixed batches alike. A sequence with
    seq_len 0 and one query row (a padded decode row) gets zeros.
    """
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for i, context_len in enumerate(lengths):
        start, end = starts[i], starts[i + 1]
        if end == start or context_len == 0:
            continue
        keys, values = gather_sequence_kv(kv_cache, block_tables[i], context_len, k_scale, v_scale)
        out[start:end] = causal_attention_reference(query[start:end], keys, values, scale).to(query.dtype)
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen RMSNorm: normalise in float32, round to x's dtype, then multiply by weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.float() * normed.to(x.dtype).float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype before the norm (as HF)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(summed, weight, eps), summed


def rotary_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos in the first rotary_dim/2 columns, sin in the rest.

    inv_freq [rotary_dim/2] already carries any rope scaling; the cache only tabulates it.
    """
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on the first rotary_dim dims of query [T, Hq, D] and key [T, Hkv, D].

    Returns new tensors; the kernel rotates in place.
    """
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1 = xf[..., :half]
        x2 = xf[..., half:rotary_dim]
        out = xf.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
        return out.to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] (gate then up) -> silu(gate) * up, [..., I]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
