"""The engine on tiny Gemma-4 models whose sliding layers keep only their window's blocks (their own KV
cache group, core/kv_cache_groups.py), against HF transformers.

Window 8, block size 8, max_model_len 128 and steps of at most 16 tokens: a sliding layer keeps at most
cdiv(8 - 1 + 16, 8) + 1 = 4 blocks a request, the full layers all 16 of a full-length one. Prompts and
outputs run well past the window: greedy tokens equal HF's (near-ties allowed) with prefix caching on and
off, chunked prefill, preemption and many requests at once; logprobs within 1e-4; every pool whole at the
end.
"""

from __future__ import annotations

import random

import pytest
import torch

from fitserve import LLM, SamplingParams
from fitserve.core.kv_cache_groups import HybridKVCacheManager
from tests.model_folders import save_with_tokenizer
from tests.unit.gemma4_helpers import assert_greedy_matches, build_hf, text_config

RNG = random.Random(11)
PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77)), [RNG.randrange(256) for _ in range(60)]]
MANY = [[RNG.randrange(256) for _ in range(RNG.randrange(9, 50))] for _ in range(12)]
NEW_TOKENS = 12
BASE = {"max_model_len": 128, "max_num_batched_tokens": 16, "max_num_seqs": 4, "num_gpu_blocks_override": 32}
VARIANTS = {
    "prefix caching on": {"num_gpu_blocks_override": 64},  # room to keep the first pass's blocks
    "prefix caching off": {"enable_prefix_caching": False},
    "chunked prefill": {"max_num_batched_tokens": 6, "max_num_seqs": 4},
    # 9 full blocks: the 72-token request fills them alone, so the others are preempted and recomputed;
    # 3 sliding ones (cdiv(8 - 1 + 8, 8) + 1 = 3 a request)
    "preemption": {"num_gpu_blocks_override": 10, "max_num_batched_tokens": 8},
}


@pytest.fixture(scope="module", params=["e_model", "moe_k_eq_v"])
def tiny_model(request, tmp_path_factory):
    model = build_hf(text_config(request.param), seed=3)
    return save_with_tokenizer(model, tmp_path_factory.mktemp(request.param)), model


def make_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", block_size=8, **{**BASE, **kwargs})


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


def sliding_manager(llm: LLM) -> HybridKVCacheManager:
    manager = llm.engine.kv_manager
    assert isinstance(manager, HybridKVCacheManager), "the sliding layers should have a group of their own"
    return manager


def assert_pools_whole(manager: HybridKVCacheManager) -> None:
    for group in manager.managers:
        assert group.pool.num_free_blocks == group.pool.num_usable_blocks
        assert all(block.ref_cnt == 0 for block in group.pool.blocks[1:])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf_with_windowed_blocks(tiny_model, variant):
    folder, hf_model = tiny_model
    llm = make_llm(folder, **VARIANTS[variant])
    manager = sliding_manager(llm)
    full_pool, sliding_pool = (m.pool.num_usable_blocks for m in manager.managers)
    assert sliding_pool < full_pool
    if variant != "prefix caching on":
        # the sliding pool cannot hold the 72-token request's 9 blocks: it completes only if blocks are freed
        assert sliding_pool < 9
    for _ in range(2 if variant == "prefix caching on" else 1):  # the second pass hits the prefix cache
        for prompt, output in zip(PROMPTS, greedy(llm, PROMPTS), strict=True):
            assert len(output.outputs[0].token_ids) == NEW_TOKENS
            assert_greedy_matches(output.outputs[0].token_ids, hf_model, prompt)
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    if variant == "prefix caching on":
        assert manager.prefix_cache_hits > 0
    assert llm.engine.get_stats().kv_cache_usage == 0.0
    assert_pools_whole(manager)


def test_many_requests_at_once(tiny_model):
    folder, hf_model = tiny_model
    llm = make_llm(folder, max_num_seqs=8, num_gpu_blocks_override=40)
    for prompt, output in zip(MANY, greedy(llm, MANY), strict=True):
        assert_greedy_matches(output.outputs[0].token_ids, hf_model, prompt)
    assert_pools_whole(sliding_manager(llm))


def test_logprobs_match_hf(tiny_model):
    folder, hf_model = tiny_model
    prompt = PROMPTS[2]
    out = greedy(make_llm(folder, max_num_batched_tokens=8), [prompt], logprobs=5, prompt_logprobs=3)[0]
    with torch.no_grad():
        full = prompt + out.outputs[0].token_ids
        reference = torch.log_softmax(hf_model(input_ids=torch.tensor([full])).logits[0].float(), dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        for token_id, entry in position.items():
            assert abs(entry.logprob - row[token_id].item()) < 1e-4
    for i, position in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(position[prompt[i]].logprob - reference[i - 1][prompt[i]].item()) < 1e-4


def test_sliding_caches_are_sized_for_their_window(tiny_model):
    """A sliding layer's tensor has its group's blocks, far fewer than a full layer's, and the plan's bytes
    per token are what the tensors hold per request block."""
    folder, _ = tiny_model
    llm = make_llm(folder, num_gpu_blocks_override=None)
    runner = llm.engine.executor.runner
    groups = llm.engine.config.kv_groups
    assert [g.blocks_per_request for g in groups] == [16, 4]
    full_blocks, sliding_blocks = runner.group_num_blocks
    usable = full_blocks - 1
    assert sliding_blocks == 1 + -(-usable * 4 // 16)
    for index, spec in enumerate(llm.engine.config.model.kv_layers):
        if spec.owns_cache(index):
            expected = sliding_blocks if index in groups[1].layers else full_blocks
            assert runner.kv_caches[index].shape[1] == expected
    plan = llm.engine.memory_plan
    assert plan.group_num_blocks == runner.group_num_blocks
    assert plan.max_concurrency == pytest.approx(usable / 16)
