"""The whole engine (scheduler, paged per-layer KV caches, sampler) on tiny Gemma-4 models against HF.

Prompts and outputs run past the sliding window (8): greedy tokens equal HF's (near-ties allowed, see
gemma4_helpers.assert_greedy_matches) with prefix caching on and off, chunked prefill and preemption;
logprobs within 1e-4 of HF's log-softmax.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve import LLM, SamplingParams
from tests.model_folders import save_with_tokenizer
from tests.unit.gemma4_helpers import (
    assert_greedy_matches,
    build_hf,
    conditional_config,
    text_config,
)

PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77)), [200, 3, 3, 9, 250, 11, 12, 13, 14, 15, 16, 100, 7]]
NEW_TOKENS = 12
ENGINE_VARIANTS = {
    "prefix caching on": {},
    "prefix caching off": {"enable_prefix_caching": False},
    "chunked prefill": {"max_num_batched_tokens": 6, "max_num_seqs": 4},
    "preemption": {"num_gpu_blocks_override": 9},
}


@pytest.fixture(scope="module", params=["e_model-causal", "moe_k_eq_v-conditional"])
def tiny_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    case, form = request.param.split("-")
    config = text_config(case) if form == "causal" else conditional_config(case)
    folder = tmp_path_factory.mktemp(request.param)
    model = build_hf(config, seed=3)
    return save_with_tokenizer(model, folder), model


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return LLM(str(folder), dtype="float32", block_size=8, **kwargs)


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_hf(tiny_model, variant):
    folder, hf_model = tiny_model
    llm = make_llm(folder, **ENGINE_VARIANTS[variant])
    for _ in range(2 if variant == "prefix caching on" else 1):  # the second pass hits the prefix cache
        for prompt, output in zip(PROMPTS, greedy(llm, PROMPTS), strict=True):
            assert len(output.outputs[0].token_ids) == NEW_TOKENS
            assert_greedy_matches(output.outputs[0].token_ids, hf_model, prompt)
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    if variant == "prefix caching on":
        assert llm.engine.kv_manager.prefix_cache_hits > 0
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_kv_caches_follow_the_layers(tiny_model):
    """One cache per layer in its own geometry; KV-shared layers allocate nothing."""
    folder, _ = tiny_model
    llm = make_llm(folder)
    caches = llm.engine.executor.runner.kv_caches
    specs = llm.engine.config.model.kv_layers
    for index, (spec, cache) in enumerate(zip(specs, caches, strict=True)):
        if spec.owns_cache(index):
            assert tuple(cache.shape[-2:]) == (spec.num_kv_heads, spec.head_dim)
        else:
            assert cache.numel() == 0
    per_token = sum(c[:, 0, 0].numel() for c in caches if c.numel()) * 4
    assert llm.engine.config.kv_bytes_per_token == per_token


def test_logprobs_match_hf(tiny_model):
    folder, hf_model = tiny_model
    prompt = PROMPTS[1]
    out = greedy(make_llm(folder), [prompt], logprobs=5, prompt_logprobs=3)[0]
    with torch.no_grad():
        full = prompt + out.outputs[0].token_ids
        reference = torch.log_softmax(hf_model(input_ids=torch.tensor([full])).logits[0].float(), dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        assert len(position) >= 5
        for token_id, entry in position.items():
            assert abs(entry.logprob - row[token_id].item()) < 1e-4
    for i, position in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(position[prompt[i]].logprob - reference[i - 1][prompt[i]].item()) < 1e-4
