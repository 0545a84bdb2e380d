"""LLM() with logit_bias and allowed_token_ids through the whole engine (a tiny Llama on the CPU):
greedy output follows the bias, samples stay inside the allowed ids, out-of-vocabulary ids are refused
before anything is queued."""

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


def generate(llm: LLM, **params) -> list[int]:
    sampling = SamplingParams(max_tokens=4, ignore_eos=True, **params)
    (output,) = llm.generate([{"prompt_token_ids": PROMPT}], sampling, use_tqdm=False)
    return output.outputs[0].token_ids


def test_bias_steers_greedy_output(tiny) -> None:
    llm, plain = tiny
    assert generate(llm, temperature=0) == plain
    assert generate(llm, temperature=0, logit_bias={123: 100.0}) == [123] * 4
    banned = generate(llm, temperature=0, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]


def test_samples_stay_inside_allowed_token_ids(tiny) -> None:
    llm, _ = tiny
    allowed = [7, 130, 250]
    assert set(generate(llm, temperature=1.0, seed=1, allowed_token_ids=allowed)) <= set(allowed)
    assert set(generate(llm, temperature=0, allowed_token_ids=allowed)) <= set(allowed)


def test_ids_outside_the_vocabulary_are_refused(tiny) -> None:
    llm, plain = tiny
    with pytest.raises(ValueError, match="allowed_token_ids holds token id 999999"):
        generate(llm, allowed_token_ids=[1, 999999])
    with pytest.raises(ValueError, match="logit_bias holds token id 999999"):
        generate(llm, logit_bias={999999: 1.0})
    assert generate(llm, temperature=0) == plain  # nothing was left queued
