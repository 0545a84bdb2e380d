"""Asynchronous scheduling: step N+1 is planned before step N's tokens reach the host."""

from __future__ import annotations

import pytest
import torch

from fitserve import SamplingParams
from fitserve.core.kv_cache import hash_block
from fitserve.worker.logits_processors import mask_stop_tokens_before_min_tokens
from fitserve.worker.sampler import SamplingRow
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model
from tests.unit.test_scheduler import make_request, make_scheduler


def test_a_token_in_flight_is_scheduled_as_a_placeholder():
    scheduler = make_scheduler()
    request = make_request("a", 5)
    scheduler.add_request(request)
    prefill = scheduler.schedule()
    assert prefill.scheduled[0].samples and request.num_output_placeholders == 1
    decode = scheduler.schedule()  # before the prefill's token arrived
    item = decode.scheduled[0]
    assert (item.start, item.num_new_tokens, item.samples) == (5, 1, True)
    assert item.start == request.num_tokens  # its input token is the one in flight
    assert request.num_output_placeholders == 2
    scheduler.update_from_output(prefill, {"a": 11})
    assert request.output_token_ids == [11] and request.num_output_placeholders == 1
    scheduler.update_from_output(decode, {"a": 12})
    assert request.output_token_ids == [11, 12] and request.num_output_placeholders == 0


def test_tokens_in_flight_count_toward_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", 5, max_tokens=2)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert len(first.scheduled) == len(second.scheduled) == 1
    assert scheduler.schedule().is_empty  # two tokens in flight already end it
    scheduler.update_from_output(first, {"a": 11})
    scheduler.update_from_output(second, {"a": 12})
    assert request.is_finished and request.output_token_ids == [11, 12]


def test_tokens_in_flight_count_toward_max_model_len():
    scheduler = make_scheduler(max_model_len=7)
    request = make_request("a", 5)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert not second.is_empty
    assert scheduler.schedule().is_empty
    scheduler.update_from_output(first, {"a": 11})
    scheduler.update_from_output(second, {"a": 12})
    assert request.is_finished and request.num_tokens == 7


def test_a_token_after_a_stop_is_dropped():
    scheduler = make_scheduler()
    request = make_request("a", 5)
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    scheduler.update_from_output(first, {"a": 0})  # eos
    assert request.is_finished
    scheduler.update_from_output(second, {"a": 12})
    assert request.output_token_ids == [0]
    assert scheduler.kv_manager.usage() == 0.0


def test_a_block_completed_by_a_token_in_flight_is_hashed_once_the_token_is_known():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", 3)
    scheduler.add_request(request)
    manager = scheduler.kv_manager
    first = scheduler.schedule()  # tokens 0..2, samples token 3
    second = scheduler.schedule()  # computes token 3 (in flight): the first block is now full
    assert manager.req_num_cached_blocks.get("a", 0) == 0
    scheduler.update_from_output(first, {"a": 40})
    scheduler.update_from_output(second, {"a": 41})
    scheduler.schedule()
    block = manager.req_blocks["a"][0]
    assert block.block_hash == hash_block(None, [1, 2, 3, 40])


def test_preempting_a_request_with_a_token_in_flight_keeps_the_token():
    scheduler = make_scheduler(num_blocks=4, block_size=4, prefix=False)  # 3 usable blocks
    first, second = make_request("a", 4), make_request("b", 4, first_token=50)
    scheduler.add_request(first)
    scheduler.add_request(second)
    prefill = scheduler.schedule()  # 2 blocks; decodes need a block each
    decode = scheduler.schedule()  # only one more block: b is preempted
    assert decode.num_preempted == 1 and [s.request.request_id for s in decode.scheduled] == ["a"]
    scheduler.update_from_output(prefill, {"a": 11, "b": 21})
    assert second.output_token_ids == [21] and second.num_output_placeholders == 0
    assert second.num_computed_tokens == 0  # recomputed, with its token, when admitted again


def test_min_tokens_counts_tokens_in_flight():
    logits = torch.zeros(2, 8)
    params = SamplingParams(min_tokens=3)
    rows = [
        SamplingRow(params, [1], [5], eos_token_ids=frozenset({0}), num_pending_outputs=1),  # 2 made
        SamplingRow(params, [1], [5], eos_token_ids=frozenset({0}), num_pending_outputs=2),  # 3 made
    ]
    mask_stop_tokens_before_min_tokens(logits, rows)
    assert logits[0, 0] == -torch.inf and logits[1, 0] == 0


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(folder, "LlamaForCausalLM")
    return folder


def test_penalties_defer_the_next_sampling_until_the_tokens_are_taken(llama_folder):
    llm = make_llm(llama_folder)
    engine = llm.engine
    engine.add_request("p", None, [5, 6, 7], SamplingParams(max_tokens=4, repetition_penalty=1.5))
    engine.step()
    assert engine._in_flight.launched.needs_token_history
    engine.step()  # queued the second step's forward, took the first token, then queued its sampling
    request = engine.scheduler.requests["p"]
    assert request.num_output_tokens == 1 and request.num_output_placeholders == 1
    assert engine._in_flight.launched._sample is None  # sampled already: after the token was taken


def test_penalised_requests_get_the_same_tokens_with_other_traffic(llama_folder):
    llm = make_llm(llama_folder)
    penalised = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [9, 8, 7, 9, 8]}], penalised, use_tqdm=False)
    mixed = llm.generate(
        [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [9, 8, 7, 9, 8]}],
        [plain, penalised],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_step_out_of_memory_ends_its_requests_with_the_knob_and_the_engine_goes_on(llama_folder):
    llm = make_llm(llama_folder)
    engine = llm.engine
    launch = engine.executor.launch

    def launch_failing_on_long_steps(scheduler_output, *args):
        if scheduler_output.num_batched_tokens > 10:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB.")
        return launch(scheduler_output, *args)

    engine.executor.launch = launch_failing_on_long_steps
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("short", None, [5, 6, 7], params)
    engine.step()  # 3 tokens: runs
    engine.add_request("long", None, list(range(20, 40)), params)
    outputs = engine.step()  # "long"'s 20 tokens with "short"'s decode: out of memory
    failed = {o.request_id: o for o in outputs}
    assert set(failed) == {"short", "long"}
    for output in failed.values():
        assert output.finished and output.outputs[0].finish_reason == "error"
        assert "--max-num-batched-tokens" in output.error and "Tried to allocate 1.50 GiB" not in output.error
        assert "torch tried to allocate 1.50 GiB" in output.error
    while engine.has_unfinished_requests():
        assert not engine.step()  # the short request's token in flight is dropped, not delivered
    assert engine.get_stats().kv_cache_usage == 0.0
    after = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert len(after[0].outputs[0].token_ids) == 6 and after[0].outputs[0].finish_reason == "length"
