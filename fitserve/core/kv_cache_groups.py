"""Block tables per group of layers (fitserve/kv_groups.py), for models that mix full and sliding attention.

`HybridKVCacheManager` has KVCacheManager's interface (the scheduler and the engine use either) over one
manager per group, each with its own BlockPool: the full group's is a plain KVCacheManager, a sliding
group's a `SlidingWindowKVCacheManager`, which frees a request's blocks once they fall wholly behind the
window of the next token to compute. A freed block's place in the request's table becomes the null block
(so block index = position // block_size still holds); a hashed one stays in the prefix cache until its
pool needs it.

A step's allocation is all or nothing: every group is checked before any allocates. Prefix hits hold for
every group: the full group's longest cached prefix, cut back until each sliding group has the blocks
the first computed token's window reads (`SlidingWindowKVCacheManager.longest_hit`, vLLM's rule), and the
full group's prefix cut to that same length.
"""

from __future__ import annotations

from collections.abc import Sequence

from fitserve.core.kv_cache import NULL_BLOCK_ID, KVBlock, KVCacheManager
from fitserve.core.request import Request
from fitserve.kv_groups import KvCacheGroup


class SlidingWindowKVCacheManager(KVCacheManager):
    """One sliding group's block tables: query position p reads keys p - window + 1 .. p only."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, window: int) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self.window = window
        self.null_block = self.pool.blocks[NULL_BLOCK_ID]
        self.req_first_live: dict[str, int] = {}  # blocks before this index are null in the table
        # cached blocks a hit needs right before its end: those the next token's window reads
        self.window_blocks = -(-(window - 1) // block_size)

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Index of the first block the window of position num_computed_tokens still reads."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Frees the request's blocks wholly behind the window of its next token (oldest first, so the
        pool evicts them first) and puts the null block in their place."""
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            return
        first_needed = min(self.first_needed_block(num_computed_tokens), len(blocks))
        start = self.req_first_live.get(request_id, 0)
        if first_needed <= start:
            return
        ids = self.req_block_ids[request_id]
        skipped = blocks[start:first_needed]
        for i in range(start, first_needed):
            blocks[i] = self.null_block
            ids[i] = NULL_BLOCK_ID
        self.pool.free(skipped)
        self.req_first_live[request_id] = first_needed

    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> list[KVBlock]:
        """The longest hit of at most max_blocks blocks whose last `window_blocks` blocks (or all, back to
        the first) are cached; the blocks before them are null."""
        if self.window_blocks == 0:
            return [self.null_block] * max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            block = self.pool.lookup(hashes[i])
            if block is None:
                run = 0
                continue
            run += 1
            if run == self.window_blocks:
                return [self.null_block] * i + [self.pool.lookup(h) for h in hashes[i : i + run]]  # type: ignore[misc]
        return [self.pool.lookup(h) for h in hashes[:run]]  # type: ignore[misc]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        if not super().allocate_slots(request, num_new_tokens, computed_blocks):
            return False
        if computed_blocks:  # a prefix hit: its blocks behind the window came as null blocks
            leading_nulls = 0
            while leading_nulls < len(computed_blocks) and computed_blocks[leading_nulls] is self.null_block:
                leading_nulls += 1
            self.req_first_live[request.request_id] = leading_nulls
        return True

    def free(self, request: Request) -> None:
        self.req_first_live.pop(request.request_id, None)
        super().free(request)


class HybridKVCacheManager:
    """One KVCacheManager per group (group 0 first: its table is ScheduledRequest.block_ids)."""

    def __init__(
        self,
        groups: tuple[KvCacheGroup, ...],
        num_blocks: Sequence[int],
        block_size: int,
        enable_prefix_caching: bool,
    ) -> None:
        if len(groups) != len(num_blocks):
            raise ValueError(f"{len(groups)} KV cache groups but {len(num_blocks)} pool sizes")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups
        self.managers: list[KVCacheManager] = []
        self.sliding: list[SlidingWindowKVCacheManager] = []
        shared_hashes: dict[str, list[int]] = {}  # one hash chain per request, whatever the group
        for group, count in zip(groups, num_blocks):
            if group.sliding_window is None:
                manager = KVCacheManager(count, block_size, enable_prefix_caching)
            else:
                manager = SlidingWindowKVCacheManager(
                    count, block_size, enable_prefix_caching, group.sliding_window
                )
                self.sliding.append(manager)
            manager.req_block_hashes = shared_hashes
            self.managers.append(manager)
        self.num_groups = len(self.managers)
        self._no_hits: list[Sequence[KVBlock]] = [()] * self.num_groups
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def pool(self):  # noqa: ANN201 - the first group's BlockPool, for the stats' block count
        return self.managers[0].pool

    @property
    def num_free_blocks(self) -> int:
        return min(manager.num_free_blocks for manager in self.managers)

    def usage(self) -> float:
        """The fullest group's share of its pool: the one that runs out first."""
        return max(manager.usage() for manager in self.managers)

    def block_ids(self, request_id: str) -> list[int]:
        return self.managers[0].block_ids(request_id)

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The tables of groups 1.. (group 0's is block_ids)."""
        return tuple(manager.block_ids(request_id) for manager in self.managers[1:])

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """Per group, the blocks of the longest prefix cached for every group, and its token count."""
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], 0
        first = self.managers[0]
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = first._block_hashes(request, max_hit_blocks * self.block_size)
        hits: list[list[KVBlock]] = []
        for manager in self.managers:
            if isinstance(manager, SlidingWindowKVCacheManager):
                hits.append(manager.longest_hit(hashes, max_hit_blocks))
            else:
                hits.append(_prefix_hit(manager, hashes, max_hit_blocks))
        length = min(len(hit) for hit in hits)
        while True:  # a shorter end can leave another sliding group without its window: settle
            for index, manager in enumerate(self.managers):
                if isinstance(manager, SlidingWindowKVCacheManager) and len(hits[index]) > length:
                    hits[index] = manager.longest_hit(hashes, length)
            shortest = min(len(hit) for hit in hits)
            if shortest == length:
                break
            length = shortest
        hits = [hit[:length] for hit in hits]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += length * self.block_size
        return hits, length * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Sequence[KVBlock]] = ()
    ) -> bool:
        """All groups or none: blocks behind the windows are freed first, then every group is checked."""
        request_id = request.request_id
        for manager in self.sliding:
            manager.remove_skipped_blocks(request_id, request.num_computed_tokens)
        per_group = computed_blocks or self._no_hits
        total_blocks = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        for manager, computed in zip(self.managers, per_group):
            blocks = manager.req_blocks.get(request_id)
            grows = blocks is None or computed or len(blocks) < total_blocks
            if grows and not manager.can_allocate(request, num_new_tokens, computed):
                return False
        for manager, computed in zip(self.managers, per_group):
            allocated = manager.allocate_slots(request, num_new_tokens, computed)
            assert allocated, "checked above"
        return True

    def uncache_unwritten(self, request_id: str, first_block: int) -> list[int]:
        """Every group's blocks from first_block on leave the prefix cache; returns group 0's ids (the
        engine compares them with other requests' group-0 tables)."""
        ids = self.managers[0].uncache_unwritten(request_id, first_block)
        for manager in self.managers[1:]:
            manager.uncache_unwritten(request_id, first_block)
        return [block_id for block_id in ids if block_id != NULL_BLOCK_ID]

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request)

    def reset_prefix_cache(self) -> bool:
        if any(m.pool.num_free_blocks != m.pool.num_usable_blocks for m in self.managers):
            return False
        return all([manager.reset_prefix_cache() for manager in self.managers])


def _prefix_hit(manager: KVCacheManager, hashes: Sequence[int], max_blocks: int) -> list[KVBlock]:
    hits = []
    for block_hash in hashes[:max_blocks]:
        block = manager.pool.lookup(block_hash)
        if block is None:
            break
        hits.append(block)
    return hits


def make_kv_cache_manager(
    groups: tuple[KvCacheGroup, ...],
    num_blocks: Sequence[int],
    block_size: int,
    enable_prefix_caching: bool,
) -> KVCacheManager | HybridKVCacheManager:
    """The manager for these groups: a plain KVCacheManager for one (every model without sliding-window
    layers: the scheduler's path is then exactly the single-table one), else a HybridKVCacheManager."""
    if len(groups) <= 1:
        return KVCacheManager(num_blocks[0], block_size, enable_prefix_caching)
    return HybridKVCacheManager(groups, num_blocks, block_size, enable_prefix_caching)
