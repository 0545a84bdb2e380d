"""A request the KV cache cannot hold even alone (a pool smaller than one request: --num-gpu-blocks-override
allows it, the start-up check that one max_model_len request fits is skipped for it) is ended with an error
naming both sizes and the fix, instead of being preempted and re-admitted forever; the other requests
finish as usual. Both places it is found: admitted in chunks and outgrowing the pool while running, and a
first chunk larger than the whole pool."""

from __future__ import annotations

from fitserve import SamplingParams
from tests.unit.test_engine_vs_hf import make_llm, save_tiny_model

# 6 blocks of 8 (one reserved): the cache holds 40 tokens
POOL = {"num_gpu_blocks_override": 6, "max_model_len": 128, "max_num_seqs": 4}


def run(llm, prompts, max_tokens, max_steps=500):
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True)
        engine.add_request(str(i), None, prompt, params)
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"the engine still had requests after {max_steps} steps")


def test_a_request_that_outgrows_the_whole_cache_ends_with_an_error(tmp_path):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = make_llm(tmp_path, max_num_batched_tokens=16, **POOL)
    finished = run(llm, [list(range(1, 21)), [7, 8, 9]], max_tokens=[60, 10])
    big, small = finished["0"], finished["1"]
    assert big.outputs[0].finish_reason == "error"
    assert "the KV cache holds 40 tokens (5 blocks of 8, --num-gpu-blocks-override 6)" in big.error
    assert "a prompt of 20 and 20 generated" in big.error and "lower its max_tokens" in big.error
    assert small.outputs[0].finish_reason == "length" and len(small.outputs[0].token_ids) == 10
    manager = llm.engine.kv_manager
    assert manager.pool.num_free_blocks == manager.pool.num_usable_blocks


def test_a_first_chunk_larger_than_the_cache_ends_with_an_error(tmp_path):
    save_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = make_llm(tmp_path, max_num_batched_tokens=64, enable_prefix_caching=False, **POOL)
    finished = run(llm, [list(range(1, 50)), [3, 4]], max_tokens=[4, 4])
    assert finished["0"].outputs[0].finish_reason == "error"
    assert "a prompt of 49 and 0 generated" in finished["0"].error
    assert finished["1"].outputs[0].finish_reason == "length"
