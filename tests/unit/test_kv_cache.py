import pytest

from fitserve.core.kv_cache import NULL_BLOCK_ID, BlockPool, KVCacheManager
from fitserve.core.request import Request
from fitserve.core.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, request_id, 0, tokens, SamplingParams(**params), frozenset())


def schedule_all(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit a request the way the scheduler does: prefix hits first, then the rest."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    return manager.block_ids(request.request_id)


def test_pool_never_hands_out_the_null_block_and_counts_usage():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.usage() == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(blocks)
    assert pool.usage() == 0.0


def test_pool_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="needs at least 2"):
        BlockPool(1)


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    first_blocks = schedule_all(manager, first)
    second = make_request("b", list(range(8)) + [99, 98, 97])
    second_blocks = schedule_all(manager, second)
    assert second_blocks[:2] == first_blocks[:2]
    assert second_blocks[2] != first_blocks[2]
    assert manager.prefix_cache_hits == 8
    assert manager.prefix_cache_queries == 10 + 11
    # Shared blocks hold two references: freeing one request keeps them out of the free queue.
    manager.free(first)
    assert manager.num_free_blocks == 19 - 3
    manager.free(second)
    assert manager.usage() == 0.0


def test_full_prompt_hit_still_computes_the_last_token():
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    schedule_all(manager, make_request("a", list(range(8))))
    again = make_request("b", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 4  # the second block is recomputed so the step has logits to sample from


def test_freed_cached_blocks_are_found_again_then_evicted_lru():
    manager = KVCacheManager(num_blocks=5, block_size=4, enable_prefix_caching=True)
    old = make_request("old", list(range(9)))
    schedule_all(manager, old)  # 3 blocks
    manager.free(old)
    assert manager.usage() == 0.0  # cached but free blocks do not count as used
    again = make_request("again", list(range(8)) + [7])
    assert manager.get_computed_blocks(again)[1] == 8
    # A request that needs every block evicts the cached ones.
    big = make_request("big", [1000 + i for i in range(16)])
    schedule_all(manager, big)
    assert manager.get_computed_blocks(make_request("x", list(range(9))))[1] == 0


def test_prefix_caching_off_never_hits():
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=False)
    schedule_all(manager, make_request("a", list(range(12))))
    assert manager.get_computed_blocks(make_request("b", list(range(12))))[1] == 0


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    schedule_all(manager, make_request("a", list(range(12))))
    probe = make_request("b", list(range(12)), prompt_logprobs=1)
    assert manager.get_computed_blocks(probe)[1] == 0


def test_allocate_fails_cleanly_when_short():
    manager = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(12)))
    assert not manager.allocate_slots(request, 12)
    assert manager.block_ids("a") == []
    assert manager.num_free_blocks == 2


def test_a_verify_step_past_the_known_tokens_caches_only_whole_known_blocks():
    """A verify step asks room for its drafts beyond the request's known tokens; the blocks it fills are
    hashed from known tokens only, so once the request's own tokens fill the next block (drafts refused),
    that block is found by the hash of those tokens and a later request reusing them hits every block."""
    manager = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    request = make_request("a", list(range(100, 106)))  # 6 prompt tokens: 1 full block
    schedule_all(manager, request)
    for token in (7, 8):
        request.append_output_token(token)  # 8 known tokens, 6 computed
    assert manager.allocate_slots(request, 2 + 4)  # the 2 new tokens and 4 drafts: up to token 12
    request.num_computed_tokens = 8  # the drafts were all refused; the request goes on with its own
    for token in (9, 10, 11, 12):
        request.append_output_token(token)
    assert manager.allocate_slots(request, 4)
    request.num_computed_tokens = 12
    later = make_request("b", list(request.all_token_ids) + [13])
    _, num_hit_tokens = manager.get_computed_blocks(later)
    assert num_hit_tokens == 12  # 3 whole blocks, the third filled after the verify step
