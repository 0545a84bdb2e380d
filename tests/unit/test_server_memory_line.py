"""The server's startup "Memory:" line reads the engine's memory plan: the pool's bytes in the cache's own
element type, and the tokens requests can use (block 0 is reserved)."""

from __future__ import annotations

import pytest

from fitserve.planner.memory import plan_memory
from fitserve.server.api_server import memory_line
from tests.unit.planner_helpers import memory_inputs


@pytest.mark.parametrize(("kv_cache_dtype", "element_bytes"), [("auto", 2), ("fp8", 1), ("fp8_e5m2", 1)])
def test_the_memory_line_counts_the_cache_element_type(kv_cache_dtype: str, element_bytes: int) -> None:
    plan = plan_memory(
        memory_inputs("qwen3-0.6b", kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=1025)
    )
    per_token = 2 * 28 * 8 * 128 * element_bytes  # Qwen3-0.6B: 28 layers, 8 KV heads of 128
    expected_gib = 1025 * 16 * per_token / 2**30
    assert memory_line(plan, 3 * 2**30) == (
        f"Memory: KV cache {expected_gib:.2f} GiB (16384 tokens in 1025 blocks of 16, one reserved), "
        "process peak RSS 3.00 GiB"
    )
