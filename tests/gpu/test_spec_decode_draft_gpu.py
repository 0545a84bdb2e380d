"""Speculative decoding with a draft model (method draft_model) on the CUDA engine, CUDA graphs on for the
target (the draft's steps run eagerly): greedy output against the same engine without it, where bf16
noise allows; both KV pools sized by one plan (run on the GPU machine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.test_engine_gpu import _first_divergence_is_a_near_tie, _greedy, _llm, _save_random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

K = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = _save_random_model("qwen3-0.6b", tmp_path_factory.mktemp("draft_target"))
    # a 2-layer model of the same shape otherwise: the same vocabulary, other weights after its layers
    draft = _save_random_model("qwen3-0.6b", tmp_path_factory.mktemp("draft_small"), num_layers=2)
    return target, draft


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(40 + 9 * i)] for i in range(n)]


def _spec(model, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


def _free(llm) -> None:
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()


def test_draft_model_follows_the_plain_engine_with_graphs(folders):
    target, small = folders
    prompts = _prompts(6)
    plain_llm = _llm(target)
    assert plain_llm.engine.executor.runner.graph_runner is not None  # the target replays its graphs
    plain = _greedy(plain_llm, prompts, 96)
    _free(plain_llm)

    own_llm = _llm(target, speculative_config=_spec(target))
    assert own_llm.engine.executor.runner.graph_runner is not None
    own = _greedy(own_llm, prompts, 96)
    stats = own_llm.engine.speculator.stats
    # the target as its own draft: nearly every draft is the target's token (bf16 sums of a verify
    # step's rows round apart from a decode step's only at near-ties)
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0.7 * stats.num_draft_tokens
    _first_divergence_is_a_near_tie(own, plain)
    _free(own_llm)

    small_llm = _llm(target, speculative_config=_spec(small))
    got = _greedy(small_llm, prompts, 96)
    assert small_llm.engine.speculator.stats.num_draft_tokens > 0
    _first_divergence_is_a_near_tie(got, plain)
    _free(small_llm)


def test_both_pools_come_from_one_plan(folders):
    target, small = folders
    plain_llm = _llm(target)
    plain_tokens = plain_llm.engine.memory_plan.kv_cache_tokens
    _free(plain_llm)
    llm = _llm(target, speculative_config=_spec(small))
    engine = llm.engine
    draft = engine.speculator.draft
    plan = engine.memory_plan
    assert draft.kv_manager.pool.num_blocks == plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == plan.block_bytes
    config = json.loads((small / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    draft_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    assert plan.inputs.draft is not None and plan.kv_bytes_per_token > draft_per_token
    # the draft's weights and KV come out of the same budget: fewer target tokens than without it
    assert plan.kv_cache_tokens < plain_tokens
    out = _greedy(llm, _prompts(2), 32)
    assert all(len(o.token_ids) == 32 for o in out)
    _free(llm)
