"""Paged KV cache bookkeeping: a BlockPool of fixed-size blocks and per-request block tables.

Nothing here touches a device: block ids index the KV tensors the model runner allocated.

Prefix caching: a full block is identified by a chained hash of (hash of the previous block, the
block's token ids). When a request is freed its hashed blocks keep their contents and stay findable
until the pool needs them again; the free queue hands out the least recently freed block first.
Block 0 is the null block: never handed out, it absorbs padded writes (CUDA graph padding).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from fitserve.core.request import Request

NULL_BLOCK_ID = 0


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Free queue (LRU order), reference counts and the hash -> block map of cached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache has {num_blocks} blocks but needs at least 2 (one is reserved): "
                "raise num_gpu_blocks_override, --cpu-kv-cache-space or --gpu-memory-utilization"
            )
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        # block_id -> block; the first entry is the next to hand out (least recently freed).
        self.free_block_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        self.cached_blocks: dict[int, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def usage(self) -> float:
        """Fraction of usable blocks held by live requests (free cached blocks do not count)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} blocks with {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(count):
            _, block = self.free_block_queue.popitem(last=False)
            if block.block_hash is not None:
                # Evict: its contents are about to be overwritten.
                if self.cached_blocks.get(block.block_hash) is block:
                    del self.cached_blocks[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue (the null block,
        a sliding group's stand-in for blocks behind its window, is skipped)."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the end of the free queue in order (the null
        block is skipped)."""
        for block in blocks:
            if block.block_id == NULL_BLOCK_ID:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: int) -> None:
        if block.block_hash is not None or block.block_id == NULL_BLOCK_ID:
            return
        if block_hash in self.cached_blocks:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
        self.cached_blocks.clear()
        return True


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent_hash, tuple(token_ids)))


class KVCacheManager:
    """Block tables per request over one BlockPool, with prefix-cache lookups and hit counters."""

    num_groups = 1  # one block table per request (kv_cache_groups.py: one per group of layers)

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}
        self.req_block_hashes: dict[str, list[int]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}  # leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: it grows as the request does)."""
        return self.req_block_ids.get(request_id, [])

    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the request's full blocks among its first num_tokens tokens (extended lazily)."""
        hashes = self.req_block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request that has nothing computed yet.

        At least one token is always left to compute so the step produces logits for it.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_hit_blocks * self.block_size)
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Whether allocate_slots with these arguments would find enough free blocks (changes nothing)."""
        blocks = self.req_blocks.get(request.request_id, ())
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = max(-(-total_tokens // self.block_size) - len(blocks) - len(computed_blocks), 0)
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return num_needed + num_revived <= self.pool.num_free_blocks

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[KVBlock] = ()
    ) -> bool:
        """Make room for num_new_tokens more tokens after the computed ones. False if the pool is short.

        computed_blocks: prefix-cache hits for a request being scheduled for the first time; the
        caller has already counted them in request.num_computed_tokens.
        """
        request_id = request.request_id
        blocks = self.req_blocks.get(request_id)
        if blocks is None:
            blocks = []
        total_tokens = request.num_computed_tokens + num_new_tokens
        num_needed = max(-(-total_tokens // self.block_size) - len(blocks) - len(computed_blocks), 0)
        if num_needed or computed_blocks or request_id not in self.req_blocks:
            num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
            if num_needed + num_revived > self.pool.num_free_blocks:
                return False
            self.pool.touch(computed_blocks)
            new_blocks = list(computed_blocks) + self.pool.allocate(num_needed)
            blocks.extend(new_blocks)
            self.req_blocks[request_id] = blocks
            self.req_block_ids.setdefault(request_id, []).extend(b.block_id for b in new_blocks)
        if self.enable_prefix_caching:
            # Blocks filled by this step are findable from the next schedule on. A token still in
            # flight (asynchronous scheduling) is not known yet: its block is hashed a step later.
            num_full = min(total_tokens, request.num_tokens) // self.block_size
            start = self.req_num_cached_blocks.get(request_id, 0)
            if num_full > start:
                # only known tokens: a verify step's total counts drafts that may be refused
                hashes = self._block_hashes(request, num_full * self.block_size)
                for i in range(start, num_full):
                    self.pool.cache(blocks[i], hashes[i])
                self.req_num_cached_blocks[request_id] = num_full
        return True

    def uncache_unwritten(self, request_id: str, first_block: int) -> list[int]:
        """A step that was to fill the request's blocks from index first_block on did not run: they leave
        the prefix cache (their contents were never written). Returns the ids of those blocks."""
        blocks = self.req_blocks.get(request_id, [])[first_block:]
        for block in blocks:
            if block.block_hash is not None and self.pool.cached_blocks.get(block.block_hash) is block:
                del self.pool.cached_blocks[block.block_hash]
            block.block_hash = None
        if request_id in self.req_num_cached_blocks:
            cached = self.req_num_cached_blocks[request_id]
            self.req_num_cached_blocks[request_id] = min(cached, first_block)
        return [block.block_id for block in blocks]

    def free(self, request: Request) -> None:
        """Return a request's blocks; the tail goes first into the free queue so it is evicted first."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.req_block_hashes.pop(request.request_id, None)
        self.req_num_cached_blocks.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
