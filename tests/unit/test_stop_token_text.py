"""The token that ends a sequence (stop_token_ids, end of sequence) is in token_ids but not in the text,
unless include_stop_str_in_output, as in vLLM: with skip_special_tokens=False (what the Gemma-4 parsers
ask for) an answer must not end in the model's end-of-turn marker. A tiny Llama on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from fitserve import LLM, SamplingParams
from tests.unit.test_engine_vs_hf import hf_greedy, make_llm, save_tiny_model

PROMPT = [5, 17, 33, 2, 90]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[LLM, list[int]]:
    folder: Path = tmp_path_factory.mktemp("llama")
    model = save_tiny_model(folder, "LlamaForCausalLM")
    return make_llm(folder), hf_greedy(model, PROMPT, new_tokens=4)


def run(llm: LLM, max_tokens: int = 8, **params):
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, skip_special_tokens=False, **params)
    (output,) = llm.generate([{"prompt_token_ids": PROMPT}], sampling, use_tqdm=False)
    return output.outputs[0]


def test_a_stop_token_ends_the_tokens_but_not_the_text(tiny) -> None:
    llm, greedy = tiny
    tokenizer = llm.get_tokenizer()
    stop_at = greedy[2]  # the third greedy token becomes a stop token
    first = greedy.index(stop_at) + 1
    completion = run(llm, stop_token_ids=[stop_at], ignore_eos=True)
    assert completion.token_ids == greedy[:first]
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop_at
    assert completion.text == tokenizer.decode(greedy[: first - 1], skip_special_tokens=False)


def test_include_stop_str_in_output_keeps_the_stop_token_text(tiny) -> None:
    llm, greedy = tiny
    tokenizer = llm.get_tokenizer()
    stop_at = greedy[2]
    first = greedy.index(stop_at) + 1
    completion = run(llm, stop_token_ids=[stop_at], ignore_eos=True, include_stop_str_in_output=True)
    assert completion.text == tokenizer.decode(greedy[:first], skip_special_tokens=False)


def test_a_length_finish_keeps_every_token_text(tiny) -> None:
    llm, greedy = tiny
    tokenizer = llm.get_tokenizer()
    completion = run(llm, ignore_eos=True, max_tokens=4)
    assert completion.finish_reason == "length"
    assert completion.text == tokenizer.decode(greedy[:4], skip_special_tokens=False)
