"""The whole engine (scheduler, paged KV cache, sampler) against HF transformers on tiny random models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve import LLM, SamplingParams
from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.request import Request
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77)), [200, 3, 3, 9, 250, 11, 12, 13, 14, 15, 16, 100, 7]]
NEW_TOKENS = 12


def save_tiny_model(folder: Path, architecture: str) -> torch.nn.Module:
    config = tiny_hf_config(architecture, tie_word_embeddings=architecture == "Qwen2ForCausalLM")
    model = build_hf_model(config, seed=3)
    save_with_tokenizer(model, folder)
    return model


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny_model(folder, request.param)


def hf_greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def make_llm(folder: Path, **kwargs) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 64)
    kwargs.setdefault("block_size", 8)
    return LLM(str(folder), dtype="float32", **kwargs)


def greedy_outputs(llm: LLM, prompts: list[list[int]], **params) -> list:
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **params)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)


ENGINE_VARIANTS = {
    "prefix caching on": {},
    "prefix caching off": {"enable_prefix_caching": False},
    "chunked prefill": {"max_num_batched_tokens": 6, "max_num_seqs": 4},
    "preemption": {"num_gpu_blocks_override": 7},
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_greedy_matches_hf_token_for_token(tiny_model, variant):
    folder, hf_model = tiny_model
    expected = [hf_greedy(hf_model, p) for p in PROMPTS]
    llm = make_llm(folder, **ENGINE_VARIANTS[variant])
    # Single prompts, then the mixed-length batch (a second pass also exercises prefix-cache hits).
    assert [o.outputs[0].token_ids for o in greedy_outputs(llm, PROMPTS[:1])] == expected[:1]
    assert [o.outputs[0].token_ids for o in greedy_outputs(llm, PROMPTS)] == expected
    assert [o.outputs[0].token_ids for o in greedy_outputs(llm, PROMPTS)] == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    if variant == "prefix caching on":
        assert llm.engine.kv_manager.prefix_cache_hits > 0
    assert llm.engine.get_stats().kv_cache_usage == 0.0


def test_logprobs_match_hf_log_softmax(tiny_model):
    folder, hf_model = tiny_model
    prompt = PROMPTS[1]
    llm = make_llm(folder)
    out = greedy_outputs(llm, [prompt], logprobs=5, prompt_logprobs=3)[0]
    with torch.no_grad():
        full = prompt + out.outputs[0].token_ids
        reference = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        assert len(position) >= 5
        for token_id, entry in position.items():
            assert abs(entry.logprob - row[token_id].item()) < 1e-4
        assert max(position.values(), key=lambda e: e.logprob).rank == 1
    assert out.prompt_logprobs[0] is None
    for i, position in enumerate(out.prompt_logprobs[1:], start=1):
        token_id = prompt[i]
        assert abs(position[token_id].logprob - reference[i - 1][token_id].item()) < 1e-4
    expected_sum = sum(
        reference[len(prompt) - 1 + s][t].item() for s, t in enumerate(out.outputs[0].token_ids)
    )
    assert abs(out.outputs[0].cumulative_logprob - expected_sum) < 1e-3


def test_seeded_sampling_is_independent_of_the_batch(tiny_model):
    folder, _ = tiny_model
    llm = make_llm(folder)
    seeded = SamplingParams(temperature=4.0, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=4.0, max_tokens=7, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [{"prompt_token_ids": p} for p in [PROMPTS[2], PROMPTS[0], PROMPTS[1]]]
    mixed = llm.generate(crowd, [other, seeded, other], use_tqdm=False)[1].outputs[0].token_ids
    assert alone == mixed
    unseeded = SamplingParams(temperature=4.0, max_tokens=10, ignore_eos=True)
    draws = {
        tuple(
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], unseeded, use_tqdm=False)[0].outputs[0].token_ids
        )
        for _ in range(4)
    }
    assert len(draws) > 1  # without a seed, sampling really is random


def test_n_samples_share_the_prompt_blocks(tiny_model):
    folder, _ = tiny_model
    llm = make_llm(folder)
    params = SamplingParams(n=3, temperature=30.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    full_blocks = (len(PROMPTS[1]) - 1) // 8
    assert llm.engine.kv_manager.prefix_cache_hits == 2 * full_blocks * 8


def test_stop_strings_cut_the_text(tiny_model):
    folder, _ = tiny_model
    llm = make_llm(folder)
    tokenizer = llm.get_tokenizer()
    free = greedy_outputs(llm, [PROMPTS[0]])[0].outputs[0]
    text = free.text
    assert len(text) >= 4, "the tiny model's output is too short to pick a stop string from"
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = greedy_outputs(llm, [PROMPTS[0]], stop=[stop])[0].outputs[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = greedy_outputs(llm, [PROMPTS[0]], stop=[stop], include_stop_str_in_output=True)[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    assert tokenizer is not None


def test_bad_prompts_are_refused_and_leave_other_requests_alone(tiny_model):
    folder, hf_model = tiny_model
    llm = make_llm(folder, max_model_len=64)
    engine = llm.engine
    good = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("good", None, PROMPTS[0], good)
    with pytest.raises(ValueError, match=r"the prompt has 64 tokens but max_model_len is 64"):
        engine.add_request("long", None, list(range(64)), good)
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request("empty", None, [], good)
    with pytest.raises(ValueError, match=r"prompt token id 999 is outside the vocabulary \[0, 256\)"):
        engine.add_request("oov", None, [1, 999], good)
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request("good", None, PROMPTS[0], good)
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert finished[0].outputs[0].token_ids == hf_greedy(hf_model, PROMPTS[0])
    # The offline API validates a whole batch before queueing any of it.
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate(
            [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": list(range(70))}], good, use_tqdm=False
        )
    assert not engine.has_unfinished_requests()


def test_abort_frees_blocks_at_once(tiny_model):
    folder, _ = tiny_model
    engine = make_llm(folder).engine
    engine.add_request("a", None, PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.get_stats().kv_cache_usage > 0
    engine.abort_request(["a"])
    assert engine.get_stats().kv_cache_usage == 0.0
    assert not engine.has_unfinished_requests()


def test_models_without_sliding_layers_keep_one_table(tiny_model):
    """One KV cache group: the plain manager, no per-group tables, and every layer reads the step's one
    metadata (what the CUDA backend and its graphs are given)."""
    folder, _ = tiny_model
    llm = make_llm(folder, max_num_batched_tokens=16, max_num_seqs=4)
    runner = llm.engine.executor.runner
    assert type(llm.engine.kv_manager) is KVCacheManager
    assert len(llm.engine.config.kv_groups) == 1 and runner.group_tables is None
    scheduler = llm.engine.scheduler
    scheduler.add_request(Request("x", "x", 0, PROMPTS[1], SamplingParams(max_tokens=1), frozenset()))
    step = scheduler.schedule()
    assert all(item.group_block_ids == () for item in step.scheduled)
    assert runner._prepare_inputs(step.scheduled).layer_metadata is None
