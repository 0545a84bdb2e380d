"""The per-layer KV cache tensors (worker/kv_allocation.py): each layer's geometry and group block count,
zeroed, and in CPU memory mapped lazily (the OS zeroes each page when it is first touched), so a start does
not write the whole cache before serving."""

from __future__ import annotations

import torch

from fitserve.kv_layers import SLIDING, KvLayerSpec
from fitserve.worker.kv_allocation import layer_caches


def test_cpu_caches_are_zeroed_private_and_shaped_per_layer():
    specs = (
        KvLayerSpec(num_kv_heads=2, head_dim=8, cache_layer=0, sliding_window=4, layer_type=SLIDING),
        KvLayerSpec(num_kv_heads=1, head_dim=16, cache_layer=1),
        KvLayerSpec(num_kv_heads=1, head_dim=16, cache_layer=1),  # reads layer 1's cache
    )
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        caches = layer_caches(specs, [1, 0, 0], (7, 5), 4, dtype, torch.device("cpu"))
        assert [tuple(c.shape) for c in caches] == [(2, 5, 4, 2, 8), (2, 7, 4, 1, 16), (0,)]
        assert all(c.dtype == dtype and c.is_contiguous() for c in caches)
        assert all(float(c.float().abs().sum()) == 0.0 for c in caches)
        caches[0][1, 2] = 1.5  # writable, and no other layer's memory
        assert float(caches[0].float().sum()) == 1.5 * 4 * 2 * 8
        assert float(caches[1].float().abs().sum()) == 0.0
        again = layer_caches(specs, [1, 0, 0], (7, 5), 4, dtype, torch.device("cpu"))
        assert float(again[0].float().abs().sum()) == 0.0  # a new mapping, not the old pages
