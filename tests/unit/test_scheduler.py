from fitserve.config import SchedulerConfig
from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.request import Request, RequestStatus
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import Scheduler

EOS = 0


def make_scheduler(
    num_blocks=64, block_size=4, budget=64, max_num_seqs=8, max_model_len=256, prefix=True, threshold=0
):
    manager = KVCacheManager(num_blocks, block_size, prefix)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        long_prefill_token_threshold=threshold,
    )
    return Scheduler(config, manager)


def make_request(request_id: str, num_tokens: int, first_token: int = 1, **params) -> Request:
    params.setdefault("max_tokens", 100)
    tokens = [first_token + i for i in range(num_tokens)]
    return Request(request_id, request_id, 0, tokens, SamplingParams(**params), frozenset({EOS}))


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    scheduler.update_from_output(out, sampled)
    return out


def test_chunked_prefill_respects_the_token_budget():
    scheduler = make_scheduler(budget=8)
    request = make_request("a", 20)
    scheduler.add_request(request)
    chunks = []
    while request.num_output_tokens == 0:
        out = run_step(scheduler)
        assert out.num_batched_tokens <= 8
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [8, 8, 4]
    out = run_step(scheduler)
    assert out.scheduled[0].num_new_tokens == 1  # decoding


def test_long_prefill_threshold_caps_each_request_not_the_step():
    scheduler = make_scheduler(budget=16, threshold=5)
    decoding = make_request("d", 3)
    scheduler.add_request(decoding)
    run_step(scheduler)  # d's prompt (under the threshold): one step, then it decodes
    for name in "ab":
        scheduler.add_request(make_request(name, 12, first_token=20 if name == "a" else 40))
    steps = []
    while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
        out = run_step(scheduler)
        steps.append([(s.request.request_id, s.num_new_tokens) for s in out.scheduled])
    # a and b prefill side by side in chunks of at most 5, beside d's one token a step
    assert steps == [
        [("d", 1), ("a", 5), ("b", 5)],
        [("d", 1), ("a", 5), ("b", 5)],
        [("d", 1), ("a", 2), ("b", 2)],
    ]
    lone = make_scheduler(budget=16, threshold=0)
    lone.add_request(make_request("a", 12))
    assert run_step(lone).scheduled[0].num_new_tokens == 12  # 0: only the budget limits


def test_decode_is_scheduled_before_new_prefill_and_max_num_seqs_holds():
    scheduler = make_scheduler(budget=10, max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 4))
    out = run_step(scheduler)
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert scheduler.num_waiting == 1
    out = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]


def test_preemption_by_recompute_when_blocks_run_out():
    # 7 usable blocks of 4 tokens; two requests of 12 tokens take 3 blocks each, and grow.
    scheduler = make_scheduler(num_blocks=8, budget=64, prefix=False)
    first, second = make_request("a", 12), make_request("b", 12, first_token=50)
    scheduler.add_request(first)
    scheduler.add_request(second)
    run_step(scheduler)  # both prefilled, one token each: 13 tokens -> 4 blocks each needed next
    out = run_step(scheduler)
    assert out.num_preempted == 1
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    # Once a finishes, b is recomputed from scratch: prompt and its generated token.
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = run_step(scheduler)
    assert out.scheduled[0].request is second
    assert out.scheduled[0].num_new_tokens == 13


def test_prefix_hits_skip_computation():
    scheduler = make_scheduler(block_size=4)
    scheduler.add_request(make_request("a", 10))
    run_step(scheduler)
    scheduler.add_request(make_request("b", 10))
    out = run_step(scheduler)
    item = next(s for s in out.scheduled if s.request.request_id == "b")
    assert (item.start, item.num_new_tokens) == (8, 2)
    assert item.request.num_cached_tokens == 8


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler()
    request = make_request("a", 10)
    scheduler.add_request(request)
    run_step(scheduler)
    assert scheduler.kv_manager.usage() > 0
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_manager.usage() == 0.0
    assert not scheduler.has_unfinished_requests()
    assert "a" in scheduler.schedule().finished_req_ids


def test_stop_conditions():
    scheduler = make_scheduler()
    by_length = make_request("len", 4, max_tokens=2)
    by_eos = make_request("eos", 4)
    by_stop_id = make_request("stopid", 4, stop_token_ids=[7])
    min_tokens = make_request("min", 4, min_tokens=2, stop_token_ids=[7])
    for request in (by_length, by_eos, by_stop_id, min_tokens):
        scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"len": 5, "eos": EOS, "stopid": 7, "min": 7})
    assert by_eos.status == RequestStatus.FINISHED_STOPPED and by_eos.stop_reason is None
    assert by_stop_id.status == RequestStatus.FINISHED_STOPPED and by_stop_id.stop_reason == 7
    assert not min_tokens.is_finished
    assert not by_length.is_finished
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"len": 5, "min": 7})
    assert by_length.status == RequestStatus.FINISHED_LENGTH
    assert min_tokens.status == RequestStatus.FINISHED_STOPPED


def test_max_model_len_ends_a_request():
    scheduler = make_scheduler(max_model_len=6)
    request = make_request("a", 5)
    scheduler.add_request(request)
    run_step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_tokens == 6


def test_sibling_waits_for_the_first_sample_prompt():
    scheduler = make_scheduler(block_size=4, budget=4)
    first = make_request("p#0", 9)
    sibling = make_request("p#1", 9)
    sibling.waits_for = first
    scheduler.add_request(first)
    scheduler.add_request(sibling)
    steps = 0
    while sibling.num_computed_tokens == 0:
        run_step(scheduler)
        steps += 1
    assert sibling.num_cached_tokens == 8
    # The sibling joins the step that computes the last chunk: its 8 hit tokens were computed earlier.
    assert steps == 3
