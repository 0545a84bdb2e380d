"""KV cache groups: sliding-window groups free the blocks behind their window, prefix hits hold for every
group, allocation is all or nothing, and every block comes back (core/kv_cache_groups.py, kv_groups.py).

Block size 4, window 8: the next token at position p reads keys p - 7 .. p, so blocks wholly before
p - 7 are freed; a prefix hit needs the cdiv(8 - 1, 4) = 2 blocks before its end cached in the sliding
group. A chunk of 4 tokens: a sliding request holds at most cdiv(7 + 4, 4) + 1 = 4 blocks.
"""

from __future__ import annotations

import random

import pytest

from fitserve.config import SchedulerConfig
from fitserve.core.kv_cache import NULL_BLOCK_ID, KVCacheManager
from fitserve.core.kv_cache_groups import HybridKVCacheManager, make_kv_cache_manager
from fitserve.core.request import Request
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import Scheduler
from fitserve.kv_groups import KvCacheGroup, group_num_blocks, kv_cache_groups
from fitserve.kv_layers import SLIDING, KvLayerSpec

BS, WINDOW, CHUNK, MAX_LEN = 4, 8, 4, 64
FULL_NEED = MAX_LEN // BS  # 16
SLIDING_NEED = -(-(WINDOW - 1 + CHUNK) // BS) + 1  # 4
GROUPS = (KvCacheGroup(None, (1,), 8, FULL_NEED), KvCacheGroup(WINDOW, (0,), 8, SLIDING_NEED))


def make_request(request_id: str, tokens: list[int], **params) -> Request:
    return Request(request_id, request_id, 0, tokens, SamplingParams(**params), frozenset())


def hybrid(full_blocks: int = 40, sliding_blocks: int = 12, prefix: bool = True) -> HybridKVCacheManager:
    return HybridKVCacheManager(GROUPS, (full_blocks, sliding_blocks), BS, prefix)


def live(manager: HybridKVCacheManager, request_id: str) -> list[int]:
    return [b for b in manager.managers[1].block_ids(request_id) if b != NULL_BLOCK_ID]


def run_chunks(manager: HybridKVCacheManager, request: Request, chunk: int) -> None:
    """Computes the request's known tokens chunk by chunk, as the scheduler would."""
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, n)
        request.num_computed_tokens += n


def assert_all_returned(manager: HybridKVCacheManager) -> None:
    for group in manager.managers:
        pool = group.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert pool.blocks[NULL_BLOCK_ID].ref_cnt == 1
        assert all(block.ref_cnt == 0 for block in pool.blocks[1:])


def test_groups_collapse_when_the_window_keeps_a_whole_request():
    specs = (KvLayerSpec(2, 16, 0, WINDOW, SLIDING), KvLayerSpec(1, 32, 1))
    groups = kv_cache_groups(specs, MAX_LEN, CHUNK, BS)
    assert [g.sliding_window for g in groups] == [None, WINDOW]
    assert [g.blocks_per_request for g in groups] == [FULL_NEED, SLIDING_NEED]
    assert [g.elements_per_token for g in groups] == [2 * 32, 2 * 2 * 16]
    # a step of 64 tokens needs the whole context in the sliding layer: one group, nothing to free
    (only,) = kv_cache_groups(specs, MAX_LEN, MAX_LEN, BS)
    assert only.sliding_window is None and only.layers == (0, 1)


def test_pools_split_in_proportion_to_need_with_a_floor_for_one_request():
    # 10 full-length requests: 160 full blocks, 40 sliding ones (plus the null block each)
    assert group_num_blocks(GROUPS, 161, FULL_NEED) == (161, 41)
    # an override smaller than one request: the sliding group still holds the longest one that fits
    assert group_num_blocks(GROUPS, 9, FULL_NEED) == (9, 1 + SLIDING_NEED)


def test_one_group_is_the_plain_manager():
    manager = make_kv_cache_manager(GROUPS[:1], (20,), BS, True)
    assert type(manager) is KVCacheManager
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=MAX_LEN), manager)
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=2))
    (item,) = scheduler.schedule().scheduled
    assert item.group_block_ids == ()


def test_blocks_behind_the_window_are_freed_as_chunks_and_decoding_move_on():
    manager = hybrid()
    request = make_request("a", list(range(30)))
    sliding_free = manager.managers[1].num_free_blocks
    while request.num_computed_tokens < request.num_tokens:
        start = request.num_computed_tokens
        n = min(CHUNK, request.num_tokens - start)
        assert manager.allocate_slots(request, n)
        request.num_computed_tokens += n
        table = manager.managers[1].block_ids("a")
        first_needed = max(0, start - WINDOW + 1) // BS
        assert table[:first_needed] == [NULL_BLOCK_ID] * first_needed
        assert NULL_BLOCK_ID not in table[first_needed:]
        assert len(live(manager, "a")) <= SLIDING_NEED
        assert manager.managers[1].num_free_blocks == sliding_free - len(live(manager, "a"))
    assert len(manager.block_ids("a")) == 8  # the full group keeps all 30 tokens' blocks
    for token in range(40, 60):  # decoding: one token a step
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert len(live(manager, "a")) <= 3  # cdiv(7 + 1, 4) + 1
    manager.free(request)
    assert_all_returned(manager)


def test_a_prefix_hit_needs_the_window_before_its_end_in_the_sliding_group():
    manager = hybrid(sliding_blocks=30)
    first = make_request("a", list(range(32)))
    run_chunks(manager, first, CHUNK)
    manager.free(first)
    # 8 blocks cached in both groups (the sliding ones freed behind the window keep their contents)
    again = make_request("b", list(range(32)) + [99])
    hits, tokens = manager.get_computed_blocks(again)
    assert tokens == 32 and [len(h) for h in hits] == [8, 8]
    assert hits[1][:6] == [manager.managers[1].null_block] * 6  # only the 2 blocks the window reads
    # the sliding group loses block 6 (positions 24..27): the longest valid hit ends at block 6
    pool = manager.managers[1].pool
    lost = hits[1][6]
    del pool.cached_blocks[lost.block_hash]
    lost.block_hash = None
    hits, tokens = manager.get_computed_blocks(make_request("c", list(range(32)) + [99]))
    assert tokens == 24 and [len(h) for h in hits] == [6, 6]
    assert [b.block_id for b in hits[1][:4]] == [NULL_BLOCK_ID] * 4
    # admitted from the hit: computes from token 24 on; the sliding table is null before its window
    request = make_request("d", list(range(32)) + [99])
    hits, tokens = manager.get_computed_blocks(request)
    request.num_computed_tokens = tokens
    assert manager.allocate_slots(request, request.num_tokens - tokens, hits)
    assert manager.managers[1].block_ids("d")[:4] == [NULL_BLOCK_ID] * 4
    assert manager.block_ids("d")[:6] == [b.block_id for b in hits[0]]
    manager.free(request)
    assert_all_returned(manager)


def test_an_early_block_outside_the_window_does_not_cut_the_hit():
    manager = hybrid(sliding_blocks=30)
    first = make_request("a", list(range(32)))
    run_chunks(manager, first, CHUNK)
    manager.free(first)
    pool = manager.managers[1].pool
    early = pool.lookup(manager.managers[0]._block_hashes(make_request("x", list(range(32))), 32)[0])
    assert early is not None
    del pool.cached_blocks[early.block_hash]
    early.block_hash = None
    _, tokens = manager.get_computed_blocks(make_request("b", list(range(32)) + [99]))
    assert tokens == 32


def test_allocation_is_all_or_nothing_across_groups():
    manager = hybrid(full_blocks=40, sliding_blocks=4)  # 3 usable sliding blocks
    a = make_request("a", list(range(12)))
    assert manager.allocate_slots(a, 12)  # 3 blocks in each group
    a.num_computed_tokens = 12
    b = make_request("b", list(range(100, 104)))
    full_free = manager.managers[0].num_free_blocks
    assert not manager.allocate_slots(b, 4)  # the sliding pool is empty
    assert manager.managers[0].num_free_blocks == full_free
    assert manager.block_ids("b") == []
    manager.free(a)
    assert_all_returned(manager)


@pytest.mark.parametrize("prefix", [True, False])
def test_many_requests_with_preemption_leak_nothing(prefix: bool):
    """The scheduler over a hybrid manager small enough to preempt: shared prefixes, chunks, decoding, all
    to the end; the pools come back whole and every table respects the window on the way."""
    rng = random.Random(7)
    manager = hybrid(full_blocks=20, sliding_blocks=8, prefix=prefix)
    config = SchedulerConfig(max_num_batched_tokens=CHUNK, max_num_seqs=6, max_model_len=MAX_LEN)
    scheduler = Scheduler(config, manager)
    shared = list(range(200, 212))
    for i in range(20):
        prompt = (shared if i % 2 else []) + [rng.randrange(100) for _ in range(rng.randrange(3, 30))]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=rng.randrange(5, 25)))
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        for item in out.scheduled:
            (sliding_table,) = item.group_block_ids
            first_needed = max(0, item.start - WINDOW + 1) // BS
            assert NULL_BLOCK_ID not in sliding_table[first_needed:]
            assert NULL_BLOCK_ID not in item.block_ids
        sampled = {item.request.request_id: rng.randrange(100) for item in out.scheduled if item.samples}
        scheduler.update_from_output(out, sampled)
        steps += 1
        assert steps < 2000
    assert scheduler.num_preemptions_total > 0
    assert_all_returned(manager)
    if prefix:
        assert manager.prefix_cache_hits > 0


def test_a_step_that_did_not_run_uncaches_every_group():
    manager = hybrid()
    request = make_request("a", list(range(16)))
    assert manager.allocate_slots(request, 16)
    request.num_computed_tokens = 16
    ids = manager.uncache_unwritten("a", 2)  # blocks 2 and 3 were never written
    assert ids == manager.block_ids("a")[2:]
    for group in manager.managers:
        blocks = group.req_blocks["a"]
        assert all(block.block_hash is None for block in blocks[2:])
        assert all(block.block_hash is not None for block in blocks[:2])
    manager.free(request)
    assert_all_returned(manager)
