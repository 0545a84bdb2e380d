"""KV cache groups: the layers that keep a request's blocks alike, each group with its own block pool.

A full-attention layer keeps every block of a request. A sliding-window layer of window W only ever reads
the last W keys, so it needs at most `cdiv(W - 1 + max_num_batched_tokens, block_size) + 1` blocks per
request at a time (the window behind a step's first token, the step's own tokens, one block of
misalignment), whatever the request's length (vLLM's SlidingWindowSpec counts the same). Layers are
grouped by what they keep: the full group (full-attention layers, and sliding ones whose window needs as
many blocks as a max_model_len request anyway), then one group per window size. KV-shared layers own no
cache and belong to no group; they read their source layer's, in its group.

The memory is split in proportion to need: the planner sizes the pool in "request blocks" (the
`cdiv(max_model_len, block_size)` blocks of a full-length request), each costing the bytes that every
group spends on its share of such a request (`bytes_per_token` below), so a pool of N request blocks holds
N / cdiv(max_model_len, block_size) full-length requests in every group at once. The full group gets N
blocks; a sliding group gets N x its need / the full need (rounded up). Separate pools, not one pool of
equal pages as vLLM's hybrid allocator: Gemma-4's full and sliding layers have different KV heads and
head dims (and counts), so equal pages would need padding or layer regrouping, while per-group tensors
sized to the group's need waste nothing at full length. The cost: short requests (shorter than the
window) fill a sliding pool as fast as the full one, so for them the pool holds fewer requests than a
shared one would; at max_model_len, the case the plan reports, there is no difference.
"""

from __future__ import annotations

from dataclasses import dataclass

from fitserve.kv_layers import KvLayerSpec


@dataclass(frozen=True)
class KvCacheGroup:
    """Layers that own a cache and keep the same blocks. sliding_window None: the full group."""

    sliding_window: int | None
    layers: tuple[int, ...]
    elements_per_token: int  # K and V over the group's layers, on one rank
    blocks_per_request: int  # blocks one max_model_len request holds at most at once in this group

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None


def full_blocks_per_request(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def sliding_blocks_per_request(
    window: int, max_model_len: int, max_num_batched_tokens: int, block_size: int
) -> int:
    """Blocks a window-W layer holds for one request at most: the W - 1 keys behind a step's first token,
    a step's tokens, and one block because the window's start is not block aligned."""
    tokens = min(window - 1 + max_num_batched_tokens, max_model_len)
    return min(-(-tokens // block_size) + 1, full_blocks_per_request(max_model_len, block_size))


def kv_cache_groups(
    specs: tuple[KvLayerSpec, ...],
    max_model_len: int,
    max_num_batched_tokens: int,
    block_size: int,
    tensor_parallel_size: int = 1,
) -> tuple[KvCacheGroup, ...]:
    """The groups of `specs`' layers that own a cache: the full group first (when any layer is in it),
    then the sliding groups by window. A model without sliding layers has one group."""
    full_need = full_blocks_per_request(max_model_len, block_size)
    layers: dict[int | None, list[int]] = {}
    elements: dict[int | None, int] = {}
    needs: dict[int | None, int] = {}
    for index, spec in enumerate(specs):
        if not spec.owns_cache(index):
            continue
        window = spec.sliding_window
        need = full_need
        if window is not None:
            need = sliding_blocks_per_request(window, max_model_len, max_num_batched_tokens, block_size)
            if need >= full_need:
                window = None  # its window keeps as many blocks as a full-length request: no saving
        layers.setdefault(window, []).append(index)
        per_token = 2 * max(1, spec.num_kv_heads // tensor_parallel_size) * spec.head_dim
        elements[window] = elements.get(window, 0) + per_token
        needs[window] = full_need if window is None else need
    order = ([None] if None in layers else []) + sorted(w for w in layers if w is not None)
    return tuple(KvCacheGroup(w, tuple(layers[w]), elements[w], needs[w]) for w in order)


def elements_per_request_token(groups: tuple[KvCacheGroup, ...], max_model_len: int, block_size: int) -> int:
    """K/V elements the groups keep per token of a full-length request, rounded up: what one "request
    block" of the pool costs, divided by block_size. Equals the plain per-token sum with one group."""
    full_need = full_blocks_per_request(max_model_len, block_size)
    total = sum(group.blocks_per_request * group.elements_per_token for group in groups)
    return -(-total // full_need)


def group_num_blocks(groups: tuple[KvCacheGroup, ...], num_blocks: int, full_need: int) -> tuple[int, ...]:
    """Each group's pool (the null block included) for a plan of `num_blocks` request blocks: the same
    number of full-length requests in every group. A pool smaller than one full-length request (set by
    --num-gpu-blocks-override) still gives a sliding group what the longest request the full group can
    hold needs there, so a request that fits one group fits all."""
    usable = max(0, num_blocks - 1)
    counts = []
    for group in groups:
        need = group.blocks_per_request
        if need >= full_need:
            counts.append(num_blocks)
        else:
            counts.append(1 + max(-(-usable * need // full_need), min(need, usable)))
    return tuple(counts)
