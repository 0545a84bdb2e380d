"""The server's startup "Memory:" line counts the KV cache as the engine does: the pool's bytes in the
cache's own element type, and the tokens requests can use (block 0 is reserved)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fitserve.config import CacheConfig, EngineConfig, ModelConfig
from fitserve.server.api_server import _kv_cache_gib


def engine_with(kv_cache_dtype: str) -> SimpleNamespace:
    """What _kv_cache_gib reads of an engine: its config (SmolLM2-135M's shape) and its stats."""
    shape = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, head_dim=64)
    model = ModelConfig("m", "/m", "test", "/m", shape, torch.bfloat16, max_model_len=8192)
    config = EngineConfig(model, CacheConfig(block_size=16, kv_cache_dtype=kv_cache_dtype))
    stats = SimpleNamespace(num_kv_blocks=1025, block_size=16)
    return SimpleNamespace(config=config, get_stats=lambda: stats)


@pytest.mark.parametrize(("kv_cache_dtype", "element_bytes"), [("auto", 2), ("fp8", 1), ("fp8_e5m2", 1)])
def test_kv_gib_uses_the_cache_element_type(kv_cache_dtype: str, element_bytes: int) -> None:
    expected = 1025 * 16 * 2 * 30 * 3 * 64 * element_bytes / 2**30
    assert _kv_cache_gib(engine_with(kv_cache_dtype)) == pytest.approx(expected)
