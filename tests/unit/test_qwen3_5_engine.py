"""The whole engine (scheduler with state slots, paged KV cache, recurrent state pool, sampler) on tiny
Qwen3.5 models against HF transformers' generate: greedy tokens equal token for token, with prompts longer
than a DeltaNet chunk, several requests of different lengths at once, prefill chunked across steps,
preemption (recompute), prefix caching on (hits resume from state snapshots) and off; logprobs within
1e-4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve import LLM, SamplingParams
from fitserve.core.state_slots import StateSlotKVManager
from tests.model_folders import save_with_tokenizer
from tests.unit.qwen3_5_helpers import build_hf, hf_greedy, hf_logits, make_config

NEW_TOKENS = 10
_generator = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(0, 256, (n,), generator=_generator).tolist() for n in (5, 70, 140, 33)]
ENGINE_VARIANTS = {
    "prefix caching on": {},
    "prefix caching off": {"enable_prefix_caching": False},
    # 24 tokens a step: every prompt but the first is spread over steps, beside other requests' decodes
    "chunked prefill": {"max_num_batched_tokens": 24, "max_num_seqs": 3},
    # 21 usable blocks of 8: the 150-token request needs 19, so the others are preempted and recomputed
    "preemption": {"num_gpu_blocks_override": 22, "max_num_batched_tokens": 64},
}


@pytest.fixture(scope="module", params=["dense-causal", "moe-conditional"])
def tiny_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module, list[list[int]]]:
    family, form = request.param.split("-")
    config = make_config(moe=family == "moe", conditional=form == "conditional")
    model = build_hf(config, seed=3)
    folder = save_with_tokenizer(model, tmp_path_factory.mktemp(request.param))
    expected = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return folder, model, expected


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(str(folder), dtype="float32", block_size=8, **kwargs)


def greedy(llm: LLM, prompts: list[list[int]], **params) -> list:
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_hf_generate(tiny_model, variant):
    folder, _, expected = tiny_model
    llm = make_llm(folder, **ENGINE_VARIANTS[variant])
    for _ in range(2 if variant == "prefix caching on" else 1):  # the second pass would hit the prefix cache
        outputs = greedy(llm, PROMPTS)
        assert [output.outputs[0].token_ids for output in outputs] == expected
    engine = llm.engine
    if variant == "preemption":
        assert engine.scheduler.num_preemptions_total > 0
    if variant == "prefix caching on":  # the second pass resumes from state snapshots (core/state_slots.py)
        assert engine.kv_manager.prefix_cache_hits > 0
    if variant == "prefix caching off":
        assert engine.kv_manager.prefix_cache_hits == 0
    assert isinstance(engine.kv_manager, StateSlotKVManager)
    slots = engine.kv_manager.state_slots
    assert slots.num_free == slots.num_slots - 1  # every slot back once the requests are done
    assert engine.get_stats().kv_cache_usage == 0.0


def test_requests_one_by_one_reuse_slots(tiny_model):
    """A slot's next owner starts from zeros, whatever the last one left in it."""
    folder, _, expected = tiny_model
    llm = make_llm(folder, max_num_seqs=1)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        assert greedy(llm, [prompt])[0].outputs[0].token_ids == want


def test_logprobs_match_hf(tiny_model):
    folder, hf_model, expected = tiny_model
    prompt = PROMPTS[2]
    out = greedy(make_llm(folder, max_num_batched_tokens=48), [prompt], logprobs=5, prompt_logprobs=3)[0]
    assert out.outputs[0].token_ids == expected[2]
    reference = torch.log_softmax(hf_logits(hf_model, prompt + out.outputs[0].token_ids), dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        assert len(position) >= 5
        for token_id, entry in position.items():
            assert abs(entry.logprob - row[token_id].item()) < 1e-4
    for i, position in enumerate(out.prompt_logprobs[1:], start=1):
        assert abs(position[prompt[i]].logprob - reference[i - 1][prompt[i]].item()) < 1e-4


def test_state_pool_beside_the_kv_cache(tiny_model):
    """The pool: max_num_seqs + 1 slots per DeltaNet layer, and 2 x max_num_seqs snapshot slots for prefix
    caching; only the full-attention layer has a KV cache."""
    folder, _, _ = tiny_model
    llm = make_llm(folder, max_num_seqs=3)
    runner = llm.engine.executor.runner
    pool = runner.model.state_pool
    assert pool.slots == 4 + 6 and len(pool.conv) == len(pool.recurrent) == 3
    assert tuple(pool.conv[0].shape) == (10, 2 * 2 * 8 + 4 * 8, 3)
    assert tuple(pool.recurrent[0].shape) == (10, 4, 8, 8) and pool.recurrent[0].dtype == torch.float32
    assert [cache.numel() > 0 for cache in runner.kv_caches] == [False, False, True, False]
    assert llm.engine.memory_plan.recurrent_state_bytes == pool.nbytes
