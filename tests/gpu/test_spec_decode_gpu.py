"""Speculative decoding on the CUDA engine, CUDA graphs on (a verify step replays the decode graphs):
greedy output against the same engine without it, where bf16 noise allows (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_engine_gpu import _first_divergence_is_a_near_tie, _greedy, _llm, _save_random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return _save_random_model("qwen3-0.6b", tmp_path_factory.mktemp("spec_models"))


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _repeating_prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(10)] * 4 for i in range(n)]


def test_ngram_and_oracle_follow_the_plain_engine(model_folder):
    prompts = _repeating_prompts(6)
    plain_llm = _llm(model_folder)
    plain = _greedy(plain_llm, prompts, 96)
    del plain_llm
    torch.cuda.empty_cache()
    ngram_llm = _llm(model_folder, speculative_config=NGRAM)
    ngram = _greedy(ngram_llm, prompts, 96)  # a random model rarely repeats itself: few drafts, if any
    del ngram_llm
    torch.cuda.empty_cache()
    _first_divergence_is_a_near_tie(ngram, plain)

    oracle_llm = _llm(model_folder, speculative_config={"method": "oracle", "num_speculative_tokens": 3})
    vocab = oracle_llm.engine.config.model.vocab_size
    oracle_llm.engine.speculator.proposer.load(prompts, [list(o.token_ids) for o in plain], vocab)
    oracle = _greedy(oracle_llm, prompts, 96)
    stats = oracle_llm.engine.speculator.stats
    # a verify step's bf16 sums over 4 rows round apart from a decode step's: where the random model's
    # top two are near-tied the paths part, and the oracle's later drafts stop matching
    assert stats.num_accepted_tokens > 0
    _first_divergence_is_a_near_tie(oracle, plain)
