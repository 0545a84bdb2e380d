"""CpuAttentionBackend against a naive dense causal attention in float64."""

from __future__ import annotations

import random

import pytest
import torch

from fitserve.layers.attention import get_attention_backend
from fitserve.layers.attention.cpu_backend import LONG_QUERY_TILE, CpuAttentionBackend
from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import forward_context
from tests.unit.model_helpers import ChunkSpec, build_attention_metadata


def naive_causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first_pos: int
) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.., keys/values [L, Hkv, D] -> [n, H, D] in float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, L]
    query_pos = torch.arange(q.shape[0])[:, None] + first_pos
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > query_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


def run_case(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[float, torch.Tensor]:
    """seqs: (seq_len, query_len) each. Returns (max abs error vs naive, the KV cache after the call)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-seq_len // block_size) for seq_len, _ in seqs)
    num_blocks = blocks_needed + 3
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    # Finite garbage everywhere: unwritten slots must be masked, not relied on to be zero.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    chunks, full_keys, full_values, q_parts, k_new, v_new = [], [], [], [], [], []
    for seq_len, query_len in seqs:
        block_ids = [free.pop() for _ in range(-(-seq_len // block_size))]
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        num_cached = seq_len - query_len
        for pos in range(num_cached):
            block, offset = block_ids[pos // block_size], pos % block_size
            kv_cache[0, block, offset] = keys[pos]
            kv_cache[1, block, offset] = values[pos]
        chunks.append(ChunkSpec(num_cached, query_len, block_ids))
        full_keys.append(keys)
        full_values.append(values)
        q_parts.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
        k_new.append(keys[num_cached:])
        v_new.append(values[num_cached:])
    metadata = build_attention_metadata(chunks, block_size)
    scale = head_dim**-0.5
    q = torch.cat(q_parts)
    out = CpuAttentionBackend().forward(q, torch.cat(k_new), torch.cat(v_new), kv_cache, metadata, scale)
    assert out.shape == q.shape and out.dtype == dtype
    error = 0.0
    for part, chunk, keys, values, got in zip(
        q_parts, chunks, full_keys, full_values, out.split([c.query_len for c in chunks]), strict=True
    ):
        want = naive_causal_attention(part, keys, values, scale, chunk.num_computed)
        error = max(error, (got.double() - want).abs().max().item())
    # The new keys/values landed at their slots.
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[0][metadata.slot_mapping], torch.cat(k_new))
    assert torch.equal(flat[1][metadata.slot_mapping], torch.cat(v_new))
    return error, kv_cache


# prefill from scratch (long: own call), decode, long chunk over a cached prefix, short chunk over a
# prefix (batched with the decodes), a first token
MIXED = [(20, 20), (37, 1), (50, 18), (30, 5), (1, 1)]


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_mixed_batch_matches_naive_fp32(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    error, _ = run_case(MIXED, num_heads, num_kv_heads, 32, block_size, torch.float32)
    assert error < 1e-5


@pytest.mark.parametrize("block_size", [16, 4])
def test_decode_only_batch_matches_naive(block_size: int) -> None:
    seqs = [(n, 1) for n in (3, 17, 64, 65, 300, 1)]
    error, _ = run_case(seqs, 8, 2, 64, block_size, torch.float32, seed=1)
    assert error < 1e-5


def test_equal_short_chunks_over_prefix_match_naive() -> None:
    error, _ = run_case([(40, 4), (9, 4), (4, 4)], 8, 2, 32, 4, torch.float32, seed=2)
    assert error < 1e-5


def test_long_prefills_each_alone_match_naive() -> None:
    error, _ = run_case([(33, 33), (70, 40), (17, 17)], 4, 2, 32, 16, torch.float32, seed=3)
    assert error < 1e-5


def test_long_chunk_over_prefix_in_query_tiles_matches_naive() -> None:
    """A 600-token chunk after 60 cached tokens: two query tiles, each reading only the keys it sees."""
    assert LONG_QUERY_TILE < 600 <= 2 * LONG_QUERY_TILE
    error, _ = run_case([(660, 600), (530, 530), (95, 1)], 4, 2, 16, 16, torch.float32, seed=5)
    assert error < 1e-5


def test_backend_reused_across_layers_and_steps() -> None:
    """One backend instance, two layers' caches, two steps: each step's plan serves its own layers."""
    backend = CpuAttentionBackend()
    caches = [torch.zeros(2, 8, 4, 2, 8) for _ in range(2)]
    history: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.empty(0, 2, 8), torch.empty(0, 2, 8))] * 2
    for step, (computed, new) in enumerate([(0, 6), (6, 1)]):
        metadata = build_attention_metadata([ChunkSpec(computed, new, [5, 2])], block_size=4)
        for layer in range(2):
            q, k, v = torch.randn(new, 4, 8), torch.randn(new, 2, 8), torch.randn(new, 2, 8)
            keys, values = (torch.cat([old, x]) for old, x in zip(history[layer], (k, v), strict=True))
            history[layer] = (keys, values)
            out = backend.forward(q, k, v, caches[layer], metadata, 0.35)
            want = naive_causal_attention(q, keys, values, 0.35, computed)
            assert (out.double() - want).abs().max().item() < 1e-5, (step, layer)


@pytest.mark.parametrize("block_size", [16, 4])
def test_mixed_batch_matches_naive_bf16(block_size: int) -> None:
    error, _ = run_case(MIXED, 8, 2, 64, block_size, torch.bfloat16, seed=4)
    # bf16 inputs are exact in the float64 reference; the rest is bf16 rounding of the output
    # (|out| < 4, bf16 relative step 2^-8) with float32 softmax inside.
    assert error < 2e-2


def test_backend_works_in_and_out_of_inference_mode() -> None:
    """The shared backend keeps reusable buffers; one made under inference_mode must not leak outside."""
    backend = CpuAttentionBackend()
    metadata = build_attention_metadata([ChunkSpec(3, 2, [1, 0])], block_size=4)
    cache = torch.zeros(2, 2, 4, 2, 8)
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    with torch.inference_mode():
        inside = backend.forward(q, k, v, cache.clone(), metadata, 0.3)
    with torch.no_grad():
        outside = backend.forward(q, k, v, cache.clone(), metadata, 0.3)
    assert torch.equal(inside, outside)


def test_backend_registry_by_device_type() -> None:
    backend = get_attention_backend(torch.device("cpu"))
    assert isinstance(backend, CpuAttentionBackend)
    assert get_attention_backend("cpu") is backend
    with pytest.raises(ValueError, match=r"no attention backend for device type 'meta': use one of \['cpu'"):
        get_attention_backend("meta")


def test_attention_layer_needs_forward_context() -> None:
    layer = Attention(num_heads=4, head_dim=8, scale=0.3, num_kv_heads=2, layer_idx=0)
    x = torch.randn(3, 32)
    with pytest.raises(RuntimeError, match="outside forward_context"):
        layer(x, x[:, :16], x[:, :16])


def test_attention_layer_uses_its_layer_cache() -> None:
    """Layer 1 writes into kv_caches[1] and leaves kv_caches[0] alone."""
    layer = Attention(num_heads=4, head_dim=8, scale=8**-0.5, num_kv_heads=2, layer_idx=1)
    metadata = build_attention_metadata([ChunkSpec(0, 5, [2])], block_size=8)
    caches = [torch.zeros(2, 4, 8, 2, 8) for _ in range(2)]
    q, k, v = torch.randn(5, 32), torch.randn(5, 16), torch.randn(5, 16)
    with forward_context(metadata, caches):
        out = layer(q, k, v)
    want = naive_causal_attention(q.view(5, 4, 8), k.view(5, 2, 8), v.view(5, 2, 8), 8**-0.5, 0)
    assert (out.view(5, 4, 8).double() - want).abs().max().item() < 1e-5
    assert torch.equal(caches[1][0, 2, :5], k.view(5, 2, 8))
    assert not caches[0].any()


def test_attention_layer_without_metadata_is_one_causal_sequence() -> None:
    layer = Attention(num_heads=6, head_dim=8, scale=0.2, num_kv_heads=3, layer_idx=0)
    q, k, v = torch.randn(7, 48), torch.randn(7, 24), torch.randn(7, 24)
    with forward_context(None, []):
        out = layer(q, k, v)
    want = naive_causal_attention(q.view(7, 6, 8), k.view(7, 3, 8), v.view(7, 3, 8), 0.2, 0)
    assert (out.view(7, 6, 8).double() - want).abs().max().item() < 1e-5


def test_attention_layer_refuses_uneven_groups() -> None:
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        Attention(num_heads=6, head_dim=8, scale=0.3, num_kv_heads=4)
