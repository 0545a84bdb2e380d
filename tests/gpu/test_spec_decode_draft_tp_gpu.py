"""draft_model and eagle3 speculation beside a target at --tensor-parallel-size 2 on two GPUs (NCCL; run on
the GPU machine): the drafter lives whole on rank 0's GPU (distributed/parallel_state.py single_rank), the
target's CUDA graphs on. Greedy output against TP 1 without speculation, where bf16 noise allows; the
drafter's weights and pool on GPU 0; both pools from one plan. The EAGLE-3 head of
tests/gpu/test_spec_decode_eagle3_gpu.py has no embedding: rank 0 reads the target's whole from its weights.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.gpu import test_spec_decode_draft_gpu as draft_base
from tests.gpu import test_spec_decode_eagle3_gpu as eagle3_base
from tests.gpu.test_engine_gpu import _first_divergence_is_a_near_tie, _greedy, _llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

draft_folders = draft_base.folders  # module fixtures: a random Qwen3-0.6B and a 2-layer draft of it
eagle3_folders = eagle3_base.folders  # a random 6-layer Llama-3.1-8B and an EAGLE-3 head without embedding


def _collect() -> None:
    """Gives back the GPU memory of engines no variable holds any more (they keep reference cycles)."""
    gc.collect()
    torch.cuda.empty_cache()


def _free(llm) -> None:
    """Stops the engine; its memory comes back at the next _collect() once the caller's frame is gone."""
    llm.engine.shutdown()


def _plain_greedy(target, prompts) -> list:
    llm = _llm(target)
    try:
        return _greedy(llm, prompts, 96)
    finally:
        _free(llm)


def _check_against_plain(target, speculative_config, prompts) -> None:
    plain = _plain_greedy(target, prompts)
    _collect()  # the TP 1 engine's memory, before TP 2 plans both GPUs
    llm = _llm(target, speculative_config=speculative_config, tensor_parallel_size=2)
    engine = llm.engine
    assert engine.executor.runner.graph_runner is not None  # the target replays its graphs
    got = _greedy(llm, prompts, 96)
    assert engine.speculator.stats.num_draft_tokens > 0
    _first_divergence_is_a_near_tie(got, plain)
    drafter = engine.speculator.draft
    assert all(t.device.index == 0 for t in drafter.kv_caches)  # rank 0's GPU
    assert drafter.kv_manager.pool.num_blocks == engine.memory_plan.num_kv_blocks
    assert engine.executor.runner.kv_bytes_per_block() == engine.memory_plan.block_bytes
    drafter = engine = None
    _free(llm)


def test_draft_model_at_tp2_follows_tp1_without_speculation(draft_folders):
    target, small = draft_folders
    _check_against_plain(target, draft_base._spec(small), draft_base._prompts(6))
    _collect()
    own = _llm(target, speculative_config=draft_base._spec(target), tensor_parallel_size=2)
    _greedy(own, draft_base._prompts(4), 64)
    stats = own.engine.speculator.stats
    # the target as its own draft at TP 2: nearly every draft is the target's token (bf16 near-ties aside)
    assert stats.num_accepted_tokens > 0.7 * stats.num_draft_tokens > 0
    assert next(own.engine.speculator.draft.model.parameters()).device.index == 0
    _free(own)


def test_eagle3_at_tp2_follows_tp1_without_speculation(eagle3_folders):
    target, head = eagle3_folders
    _check_against_plain(target, eagle3_base._spec(head), eagle3_base._prompts(6))
