"""Speculative decoding on a model with sliding-window layers in their own KV cache group (tiny Gemma-4,
window 8, block size 8, max_model_len 128: the sliding layers keep only their window's blocks,
core/kv_cache_groups.py).

A verify step writes the drafts' keys and values in every group and the scheduler rolls a request back to
its accepted tokens afterwards; a sliding group frees blocks behind the window of the next token to compute,
so a block freed on a count that still held rejected drafts would be missing after the rollback. The
drafts here are n-gram lookups (method ngram, no KV cache of its own) and a drafter that proposes the right
tokens but for its last draft, so every verify step rejects one: greedy output equals the same engine
without speculation token for token, with prefix caching on and off, chunked prefill and preemption, and
every pool is whole at the end. A draft model's KV cache lives in the full layers' group, and it is
lossless there too.
"""

from __future__ import annotations

import random

import pytest

from fitserve import LLM, SamplingParams
from fitserve.core.kv_cache_groups import HybridKVCacheManager
from tests.model_folders import save_with_tokenizer
from tests.unit.gemma4_helpers import build_hf, text_config
from tests.unit.model_helpers import build_hf_model, tiny_hf_config

K = 3
NEW_TOKENS = 24
RNG = random.Random(5)
# few distinct tokens: the model repeats itself and n-gram drafts are found (and often refused)
PROMPTS = [
    [RNG.randrange(8) for _ in range(40)],
    [RNG.randrange(256) for _ in range(30)] + [1, 2, 3] * 5,
    [RNG.randrange(16) for _ in range(50)],
]
BASE = {"max_model_len": 128, "max_num_batched_tokens": 16, "max_num_seqs": 4, "num_gpu_blocks_override": 32}
VARIANTS = {
    "prefix caching on": {"num_gpu_blocks_override": 64},
    "prefix caching off": {"enable_prefix_caching": False},
    "chunked prefill": {"max_num_batched_tokens": 6},
    # 14 full blocks for three requests of up to 74 tokens (10 blocks each): they preempt each other
    "preemption": {"num_gpu_blocks_override": 14, "max_num_batched_tokens": 8},
}
LOGPROBS: list = []  # the logprobs of each greedy() run, in order: a test's runs compare with the one before
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


@pytest.fixture(scope="module", params=["e_model", "moe_k_eq_v"])
def folder(request, tmp_path_factory):
    return save_with_tokenizer(
        build_hf(text_config(request.param), seed=3), tmp_path_factory.mktemp(request.param)
    )


def make_llm(folder, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", block_size=8, **{**BASE, **kwargs})


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    """Each prompt's greedy tokens, after checking their logprobs against the last run's (a key lost from
    a window changes them long before it changes a token)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    logprobs = [
        [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outputs
    ]
    if LOGPROBS:
        for want, have in zip(LOGPROBS[-1], logprobs, strict=True):
            for w, h in zip(want, have):
                common = w.keys() & h.keys()
                assert common and all(abs(w[t] - h[t]) < 1e-4 for t in common), (w, h)
    LOGPROBS.append(logprobs)
    return [list(output.outputs[0].token_ids) for output in outputs]


def assert_pools_whole(llm: LLM) -> None:
    manager = llm.engine.kv_manager
    assert isinstance(manager, HybridKVCacheManager), "the sliding layers should have a group of their own"
    for group in manager.managers:
        assert group.pool.num_free_blocks == group.pool.num_usable_blocks
        assert all(block.ref_cnt == 0 for block in group.pool.blocks[1:])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ngram_greedy_equals_without_speculation(folder, variant):
    settings = VARIANTS[variant]
    LOGPROBS.clear()
    expected = greedy(make_llm(folder, **settings))
    llm = make_llm(folder, speculative_config=NGRAM, **settings)
    passes = 2 if variant == "prefix caching on" else 1  # the second pass starts from cached blocks
    for _ in range(passes):
        assert greedy(llm) == expected
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    assert_pools_whole(llm)


def test_a_rejected_draft_every_step_keeps_the_window(folder):
    """The drafter proposes the next K answer tokens with the last one wrong: each verify step accepts
    K - 1 and rolls back one position, across the window's block boundaries."""
    LOGPROBS.clear()
    expected = greedy(make_llm(folder))
    llm = make_llm(folder, speculative_config={"method": "oracle", "num_speculative_tokens": K})
    proposer = llm.engine.speculator.proposer
    vocab = llm.engine.config.model.vocab_size
    proposer.load(PROMPTS, expected, vocab)
    right = proposer.propose
    proposer.propose = lambda request: [*right(request)[:-1], *[(t + 1) % vocab for t in right(request)[-1:]]]
    assert greedy(llm) == expected
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # the sliding pool holds far fewer blocks than one finished request's 10: blocks were freed as it ran
    sliding = llm.engine.kv_manager.managers[1]
    assert sliding.pool.num_usable_blocks < 10
    assert_pools_whole(llm)


def test_a_draft_model_keeps_its_keys_in_the_full_group(folder, tmp_path):
    """A draft model (a tiny Llama of the same vocabulary, random: its drafts are mostly refused) keeps its
    KV cache in the first group's blocks, the full layers' (kv_groups.py puts them first), which are never
    freed behind a window: lossless with the sliding group beside it."""
    config = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=1)
    draft = save_with_tokenizer(build_hf_model(config, seed=21), tmp_path)
    LOGPROBS.clear()
    expected = greedy(make_llm(folder, **VARIANTS["preemption"]))
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    llm = make_llm(folder, speculative_config=spec, **VARIANTS["preemption"])
    groups = llm.engine.config.kv_groups
    assert len(groups) == 2 and not groups[0].is_sliding
    assert greedy(llm) == expected
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert_pools_whole(llm)
