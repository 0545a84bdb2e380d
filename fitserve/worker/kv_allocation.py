"""The KV cache tensors, one per layer in its own geometry and with its group's block count, and the
startup log lines that describe them (fitserve/kv_layers.py, fitserve/kv_groups.py). A pipeline stage
allocates its own layers' caches only (`stage_kv_layers`), with the blocks every stage shares."""

from __future__ import annotations

import logging
import math
import mmap

import torch

from fitserve.config import EngineConfig
from fitserve.distributed.pipeline import stage_kv_layers
from fitserve.kv_groups import KvCacheGroup, elements_per_request_token, kv_cache_groups
from fitserve.kv_layers import KvLayerSpec
from fitserve.planner.memory import MemoryPlan

logger = logging.getLogger("fitserve")

GiB = 1 << 30


def stage_kv_bytes_per_token(config: EngineConfig, start: int, end: int) -> int:
    """EngineConfig.kv_bytes_per_token counted over the layers [start, end) alone (one pipeline stage's)."""
    model = config.model
    specs = stage_kv_layers(model.kv_layers, start, end)
    groups = kv_cache_groups(
        specs,
        model.max_model_len,
        config.scheduler.max_num_batched_tokens,
        config.cache.block_size,
        config.parallel.tensor_parallel_size,
    )
    element = config.cache.torch_kv_cache_dtype(model.dtype).itemsize
    return elements_per_request_token(groups, model.max_model_len, config.cache.block_size) * element


def layer_caches(
    specs: tuple[KvLayerSpec, ...],
    layer_group: list[int],
    num_blocks: int | tuple[int, ...],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, head_dim] cache per layer, each in its own layer's
    geometry with its group's block count (num_blocks: one for all, or one per KV cache group); a layer
    that reads another's cache (Gemma-4's KV-shared layers) gets an empty tensor, so that the list stays
    indexed by layer."""
    caches = []
    for index, spec in enumerate(specs):
        if not spec.owns_cache(index):
            caches.append(torch.empty(0, dtype=dtype, device=device))
            continue
        count = num_blocks if isinstance(num_blocks, int) else num_blocks[layer_group[index]]
        shape = (2, count, block_size, spec.num_kv_heads, spec.head_dim)
        caches.append(_zeroed(shape, dtype, device))
    return caches


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. In CPU memory it is a private anonymous mapping, whose pages the OS hands out zeroed
    as they are first touched: torch.zeros would write all of them at startup (0.8 s for the default
    model's 0.7 GiB on a 2-core CPU) before any is used."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)  # keeps `pages` alive


def log_kv_cache(
    plan: MemoryPlan,
    groups: tuple[KvCacheGroup, ...],
    group_num_blocks: tuple[int, ...],
    caches: list[torch.Tensor],
    dtype: torch.dtype,
) -> None:
    allocated = sum(t.numel() * t.element_size() for t in caches)
    inputs = plan.inputs
    logger.info(
        "KV cache size: %d tokens (%d blocks of %d, %.2f GiB, %s)",
        plan.kv_cache_tokens,
        plan.num_kv_blocks,
        inputs.block_size,
        allocated / GiB,
        str(dtype).replace("torch.", ""),
    )
    if len(groups) > 1:
        for group, count in zip(groups, group_num_blocks):
            logger.info(
                "KV cache group %s: %d layers, %d blocks (%d per max_model_len request)",
                f"sliding window {group.sliding_window}" if group.is_sliding else "full attention",
                len(group.layers),
                count,
                group.blocks_per_request,
            )
    logger.info(
        "Maximum concurrency for %d tokens per request: %.2fx", inputs.max_model_len, plan.max_concurrency
    )
