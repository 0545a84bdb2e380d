"""The longest max_model_len of which a KV cache of fixed bytes holds a number of requests.

With one KV cache group every token costs the same, so the answer is the pool's tokens / requests. With
sliding-window groups (fitserve/kv_groups.py) a request's cost is its full layers' bytes per token times
its length plus its sliding layers' window, which does not shrink with it: a shorter max_model_len costs
more per token, so the length is searched (a request's bytes grow with its length: the search is exact).
"""

from __future__ import annotations

import math

from fitserve.planner.kv_memory import kv_bytes_per_token, kv_groups
from fitserve.planner.memory import MemoryPlan
from fitserve.planner.memory_inputs import with_settings


def largest_length(plan: MemoryPlan, requests: int, longest: int) -> int:
    """The largest multiple of block_size, at most `longest`, of which `plan`'s KV bytes (its blocks x
    block_bytes) hold `requests` requests at once."""
    inputs = plan.inputs
    block = inputs.block_size
    usable_blocks = max(0, plan.num_kv_blocks - 1)
    if len(kv_groups(inputs)) <= 1:
        return min(longest, usable_blocks // requests * block)
    pool_bytes = usable_blocks * plan.block_bytes

    def holds(num_blocks: int) -> bool:
        at_length = with_settings(inputs, max_model_len=num_blocks * block)
        request_block_bytes = kv_bytes_per_token(at_length) * block
        return pool_bytes // request_block_bytes >= requests * num_blocks

    low, high = 0, math.ceil(longest / block)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if holds(middle) else (low, middle - 1)
    return min(longest, low * block)
