"""State slots of hybrid models (fitserve/core/state_slots.py) under the real scheduler: one slot per running
request, never the spare slot 0, back on finish and on preemption, no prefix-cache hits."""

from __future__ import annotations

from fitserve.config import SchedulerConfig
from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.request import Request, RequestStatus
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import Scheduler
from fitserve.core.state_slots import StateSlotKVManager, num_state_slots, state_slots_of


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 3, budget: int = 64) -> Scheduler:
    manager = StateSlotKVManager(KVCacheManager(num_blocks, 4, True), num_state_slots(max_num_seqs))
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=256)
    return Scheduler(config, manager)


def make_request(request_id: str, num_tokens: int, max_tokens: int = 20) -> Request:
    tokens = [1 + i for i in range(num_tokens)]
    return Request(request_id, request_id, 0, tokens, SamplingParams(max_tokens=max_tokens), frozenset({0}))


def step(scheduler: Scheduler):
    """One step; its output carries the slots as the model runner reads them (before the step's tokens
    finish anyone), as `held`."""
    out = scheduler.schedule()
    out.held = state_slots_of(out.scheduled)
    scheduler.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    return out


def test_one_slot_per_running_request_and_back_when_done():
    scheduler = make_scheduler()
    slots = scheduler.kv_manager.state_slots
    requests = [make_request(f"r{i}", 10, max_tokens=2 + i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    out = step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["r0", "r1", "r2"]  # max_num_seqs
    assert out.held == [1, 2, 3]  # slot 0 is the spare
    assert requests[3].state_slot is None and slots.num_free == 0
    while scheduler.has_unfinished_requests():
        held = step(scheduler).held or []
        assert None not in held and len(set(held)) == len(held)
    assert all(request.state_slot is None for request in requests)
    assert slots.num_free == slots.num_slots - 1


def test_preemption_gives_the_slot_back():
    # 6 usable blocks of 4: two 10-token prompts take 3 each; growing, the later one is preempted (alone,
    # each fits: 20 tokens in 5 blocks)
    scheduler = make_scheduler(num_blocks=7)
    first, second = make_request("a", 10, max_tokens=10), make_request("b", 10, max_tokens=10)
    scheduler.add_request(first)
    scheduler.add_request(second)
    step(scheduler)
    assert (first.state_slot, second.state_slot) == (1, 2)
    preempted = 0
    while not preempted:
        preempted = step(scheduler).num_preempted
    assert second.status == RequestStatus.PREEMPTED and second.state_slot is None
    assert second.num_computed_tokens == 0  # recomputed from scratch, its state from zeros
    assert first.state_slot == 1
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert scheduler.kv_manager.state_slots.num_free == 3


def test_no_prefix_cache_hits():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 17, max_tokens=1))
    while scheduler.has_unfinished_requests():
        step(scheduler)
    again = make_request("b", 17, max_tokens=1)
    scheduler.add_request(again)
    out = step(scheduler)
    assert out.scheduled[0].start == 0 and again.num_cached_tokens == 0
    assert scheduler.kv_manager.prefix_cache_hits == 0


def test_attention_only_models_carry_no_slots():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(16, 4, True))
    scheduler.add_request(make_request("a", 5))
    assert state_slots_of(scheduler.schedule().scheduled) is None


def test_only_checkpoints_with_delta_net_layers_keep_recurrent_state():
    """The CUDA graphs (worker/cuda_graphs.py) copy state slots in only for a model with DeltaNet layers: a
    Qwen3.5 checkpoint of full-attention layers only has no slots, and its decode graphs must not ask."""
    from fitserve.models.qwen3_5 import Qwen3_5ForCausalLM
    from tests.unit.qwen3_5_helpers import FULL, make_config

    config = make_config(moe=False, conditional=False)
    assert Qwen3_5ForCausalLM(config).has_recurrent_state
    config.layer_types = [FULL] * config.num_hidden_layers
    assert not Qwen3_5ForCausalLM(config).has_recurrent_state
