"""The CPU attention backend's sliding window and read-only (KV-shared) attention against a direct
softmax over each query's visible keys: positions p - window + 1 .. p, as transformers masks them."""

from __future__ import annotations

import random

import pytest
import torch

import fitserve.layers.attention.layer as layer_module
from fitserve.layers.attention.cpu_backend import LONG_QUERY_TILE, CpuAttentionBackend
from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import forward_context
from tests.unit.model_helpers import ChunkSpec, build_attention_metadata

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 16


def reference(q, keys, values, chunks, window, scale):
    """q [T, H, D]; keys/values: per sequence [len, KVH, D] (positions 0..len-1). A softmax over each
    query's visible keys: the masked entries get exactly zero weight."""
    out, row = [], 0
    for chunk, k, v in zip(chunks, keys, values, strict=True):
        positions = torch.arange(chunk.num_computed, chunk.num_computed + chunk.query_len)
        key_positions = torch.arange(k.shape[0])
        visible = key_positions[None, :] <= positions[:, None]
        if window is not None:
            visible &= key_positions[None, :] > positions[:, None] - window
        ks = k.repeat_interleave(HEADS // KV_HEADS, dim=1)  # [len, H, D]
        vs = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + chunk.query_len], ks) * scale
        weights = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
        out.append(torch.einsum("hqk,khd->qhd", weights, vs))
        row += chunk.query_len
    return torch.cat(out)


def run_step(queries, window, write=True, seed=0):
    """queries: (cached tokens, new tokens) per sequence. The cache holds random earlier keys/values;
    the new ones are written by the backend (or, write=False, already in the cache)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = list(range(1, 200))
    random.Random(seed).shuffle(blocks)
    cache = torch.zeros(2, 200, BLOCK, KV_HEADS, DIM)
    chunks, keys, values, new_k, new_v = [], [], [], [], []
    for cached, new in queries:
        total = cached + new
        table = [blocks.pop() for _ in range(-(-total // BLOCK))]
        k = torch.randn(total, KV_HEADS, DIM, generator=generator)
        v = torch.randn(total, KV_HEADS, DIM, generator=generator)
        upto = total if not write else cached
        for position in range(upto):
            slot = table[position // BLOCK], position % BLOCK
            cache[0][slot], cache[1][slot] = k[position], v[position]
        chunks.append(ChunkSpec(cached, new, table))
        keys.append(k)
        values.append(v)
        new_k.append(k[cached:])
        new_v.append(v[cached:])
    q = torch.randn(sum(n for _, n in queries), HEADS, DIM, generator=generator)
    metadata = build_attention_metadata(chunks, BLOCK)
    backend = CpuAttentionBackend()
    k_in, v_in = (torch.cat(new_k), torch.cat(new_v)) if write else (None, None)
    got = backend.forward(q, k_in, v_in, cache, metadata, 0.25, window=window, write=write)
    return got, reference(q, keys, values, chunks, window, 0.25)


STEPS = {
    "decodes past the window": [(20, 1), (9, 1), (3, 1)],
    "prefill from the start, longer than the window": [(0, 40)],
    "short chunks over a cached prefix": [(17, 5), (30, 3)],
    "a long chunk over a cached prefix": [(25, 30)],
    "long query tiles": [(3, LONG_QUERY_TILE + 40)],
    "mixed": [(0, 33), (12, 1), (21, 4)],
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("window", [6, 50, None])
def test_window_matches_reference(step, window):
    got, want = run_step(STEPS[step], window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("step", ["decodes past the window", "mixed", "a long chunk over a cached prefix"])
def test_read_only_attention_writes_nothing(step):
    got, want = run_step(STEPS[step], 6, write=False)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_window_changes_the_result():
    """The window is really applied: the same step without it differs."""
    windowed, _ = run_step(STEPS["mixed"], 6)
    full, _ = run_step(STEPS["mixed"], None)
    assert (windowed - full).abs().max() > 1e-2


def test_cuda_path_refuses_contexts_past_the_window():
    """A backend without supports_sliding_window (the CUDA one) gets a refusal naming the limit and fix."""

    class NoWindowBackend(CpuAttentionBackend):
        supports_sliding_window = False
        name = "cuda"

    layer = Attention(HEADS, DIM, 0.25, KV_HEADS, layer_idx=0, sliding_window=8)
    metadata = build_attention_metadata([ChunkSpec(0, 9, [1, 2, 3])], BLOCK)
    cache = torch.zeros(2, 4, BLOCK, KV_HEADS, DIM)
    q, k, v = torch.randn(9, HEADS, DIM), torch.randn(9, KV_HEADS, DIM), torch.randn(9, KV_HEADS, DIM)
    original = layer_module.get_attention_backend
    layer_module.get_attention_backend = lambda device: NoWindowBackend()
    try:
        with (
            forward_context(metadata, [cache]),
            pytest.raises(ValueError, match="exceeds layer 0's sliding window of 8.*--device cpu"),
        ):
            layer.forward(q, k, v)
    finally:
        layer_module.get_attention_backend = original


def test_cuda_path_refuses_kv_shared_layers():
    """A backend that cannot read another layer's cache (the CUDA one) refuses a KV-shared layer, naming
    the layers and the fix, instead of attending over the wrong cache."""

    class NoSharingBackend(CpuAttentionBackend):
        supports_kv_sharing = False
        name = "cuda"

    layer = Attention(HEADS, DIM, 0.25, KV_HEADS, layer_idx=3, kv_cache_layer=1)
    metadata = build_attention_metadata([ChunkSpec(0, 5, [1, 2])], BLOCK)
    caches = [torch.zeros(2, 4, BLOCK, KV_HEADS, DIM) for _ in range(2)] + [torch.empty(0)] * 2
    original = layer_module.get_attention_backend
    layer_module.get_attention_backend = lambda device: NoSharingBackend()
    try:
        with (
            forward_context(metadata, caches),
            pytest.raises(ValueError, match="layer 3 reads layer 1's KV cache.*--device cpu"),
        ):
            q = torch.randn(5, HEADS, DIM)
            layer.forward(q, q, q)
    finally:
        layer_module.get_attention_backend = original
