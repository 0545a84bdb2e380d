"""MTP speculation (method mtp) under tensor parallel on two GPUs (NCCL; run on the GPU machine): the MTP
layer split like the target's, every drafter forward on both ranks (worker/draft_steps.py), the target's
CUDA graphs on.

- the small random Qwen3.5 of tests/gpu/test_spec_decode_mtp_gpu.py (all full-attention and hybrid, 2 KV
  heads: one per rank) with its random bf16 MTP layer: greedy output at TP 2 with MTP against TP 1 without,
  where bf16 noise allows; TP 2's drafts against TP 1's on the same tokens;
- the field report's setup (issue 32: two RTX 2080 Ti): Qwen3.6-27B-AWQ-INT4's shape (shared/models,
  dummy weights) at --tensor-parallel-size 2 with MTP at 3 and 4 draft tokens: it starts, drafts, and the
  KV pool, block bytes and the layer's per-rank KV agree with the plan.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu import test_spec_decode_mtp_gpu as base
from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

K = base.K
checkpoint = base.checkpoint  # the module fixture: the small Qwen3.5 with an MTP layer, full and hybrid
MTP = {"method": "mtp", "num_speculative_tokens": K}


def _recorded(llm) -> list[tuple[tuple[int, ...], list[int]]]:
    """(the request's tokens, its drafts) of every draft from now on."""
    drafter = llm.engine.speculator.draft
    records: list[tuple[tuple[int, ...], list[int]]] = []
    propose = drafter.propose

    def recording(requests, running_ids):
        drafts = propose(requests, running_ids)
        records.extend((tuple(r.all_token_ids), d) for r, d in zip(requests, drafts) if d)
        return drafts

    drafter.propose = recording
    return records


def test_mtp_at_tp2_follows_tp1_without_speculation(checkpoint):
    layout, folder = checkpoint
    base._skip_refused_hybrid(layout)
    prompts = base._prompts(6)
    plain_llm = base._llm(folder, speculative_config={})
    plain = base._greedy(plain_llm, prompts, 128, logprobs=5)
    base._free(plain_llm)
    llm = base._llm(folder, speculative_config=MTP, tensor_parallel_size=2)
    engine = llm.engine
    assert engine.executor.runner.graph_runner is not None  # the target replays its graphs
    got = base._greedy(llm, prompts, 128)
    assert engine.speculator.stats.num_draft_tokens > 0
    base.assert_leaves_only_at_near_ties(got, plain)
    drafter = engine.speculator.draft
    assert drafter.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    assert drafter.kv_bytes_per_token == 2 * 1 * 128 * 2  # one of the 2 KV heads of 128 per rank, bf16
    drafter = engine = None
    base._free(llm)


def test_drafts_at_tp2_match_tp1_on_the_same_tokens(checkpoint):
    """Both runs draft with MTP; where they drafted for the same tokens (before any bf16 divergence of the
    outputs) the drafts agree, but for rare near-ties of the layer's own argmax."""
    layout, folder = checkpoint
    base._skip_refused_hybrid(layout)
    prompts = base._prompts(8)  # enough shared draft contexts where bf16 lets the runs diverge early
    runs = []
    for tp in (1, 2):
        llm = base._llm(folder, speculative_config=MTP, tensor_parallel_size=tp)
        records = _recorded(llm)
        base._greedy(llm, prompts, 64)
        runs.append(dict(records))
        records = None
        base._free(llm)
    one, two = runs
    shared = [tokens for tokens in one if tokens in two]
    assert len(shared) >= 20
    same = sum(one[tokens] == two[tokens] for tokens in shared)
    assert same >= 0.9 * len(shared), f"{same} of {len(shared)} drafts agree"


@pytest.mark.parametrize("k", [3, 4])
def test_qwen36_27b_awq_int4_at_tp2_with_mtp_starts_drafts_and_matches_its_plan(k):
    """The field report's setup, dummy weights (so acceptance is meaningless): TP 2, MTP k = 3 and 4."""
    from fitserve import LLM
    from fitserve.layers.linear import UnquantizedLinearMethod

    llm = LLM(
        str(MODELS_DIR / "qwen3.6-27b-awq-int4"),
        tokenizer=str(SMOLLM2_TOKENIZER_DIR),
        load_format="dummy",
        max_model_len=4096,
        gpu_memory_utilization=0.85,
        tensor_parallel_size=2,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    engine = llm.engine
    drafter = engine.speculator.draft
    # the ignore list's re:.*mtp.* leaves the layer in bf16
    assert isinstance(drafter.predictor.layers[0].self_attn.q_proj.linear_method, UnquantizedLinearMethod)
    base._greedy(llm, base._prompts(4), 64)
    assert engine.speculator.stats.num_draft_tokens > 0
    assert drafter.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    assert drafter.kv_bytes_per_token == 2 * 2 * 256 * 2  # 2 of the 4 KV heads of 256 per rank, bf16
    drafter = engine = None
    base._free(llm)
