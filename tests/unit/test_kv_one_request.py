"""The engine refuses to start when its KV cache cannot hold one request of max_model_len tokens (vLLM does
the same): the message names both numbers, the max_model_len that fits and the flags that make room."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fitserve.planner.memory import MemoryTerms, plan_memory
from fitserve.worker.platforms import check_one_request_fits
from tests.unit.planner_helpers import memory_inputs

GiB = 1 << 30


def _config(max_model_len: int, override: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        model=SimpleNamespace(max_model_len=max_model_len),
        cache=SimpleNamespace(num_gpu_blocks_override=override, gpu_memory_utilization=0.3),
    )


def _plan_with_free_kv(free_bytes: int):
    inputs = memory_inputs("llama-3.1-8b", gpu_memory_utilization=0.3)
    budget = int(0.3 * inputs.device.total_bytes)
    weights = budget - free_bytes - 2 * GiB
    return plan_memory(inputs, MemoryTerms(weights, GiB, GiB // 2, GiB // 2))


def test_a_cache_smaller_than_one_request_is_refused_with_the_length_that_fits() -> None:
    plan = _plan_with_free_kv(GiB // 4)  # 2,048 tokens of the 8B shape's 128 KiB a token
    assert 0 < plan.kv_cache_tokens < 4096
    with pytest.raises(ValueError) as error:
        check_one_request_fits(plan, _config(4096))
    message = str(error.value)
    assert f"holds {plan.kv_cache_tokens:,} tokens" in message
    assert "max_model_len=4,096" in message
    assert f"--max-model-len {plan.kv_cache_tokens} or less" in message
    assert "--gpu-memory-utilization (now 0.3)" in message


def test_a_cache_holding_one_request_passes_and_an_override_is_trusted() -> None:
    plan = _plan_with_free_kv(GiB // 4)
    check_one_request_fits(plan, _config(plan.kv_cache_tokens))
    check_one_request_fits(plan, _config(4096, override=8))
