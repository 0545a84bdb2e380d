"""The memory planner on Qwen3.6's hybrid layers (config.json fixtures of Qwen3.6-27B and 35B-A3B): only the
full-attention layers have KV, and the DeltaNet state pool (max_num_seqs + 1 slots) comes out of the
budget before the KV cache, so the KV tokens and max concurrency are what is left."""

from __future__ import annotations

import dataclasses

import pytest

from fitserve.args import EngineArgs
from fitserve.planner.fit import auto_fit
from fitserve.planner.hardware import parse_assume_gpus
from fitserve.planner.memory import plan_memory
from fitserve.planner.report import plan_text
from tests.unit.planner_helpers import H100, memory_inputs, model_info

MiB = 1 << 20
# per request: DeltaNet layers x (conv_dim x 3 bf16 conv inputs + value heads x 128 x 128 float32)
STATE_PER_SEQ = {
    "qwen3.6-27b": 48 * (10_240 * 3 * 2 + 48 * 128 * 128 * 4),
    "qwen3.6-35b-a3b": 30 * (8_192 * 3 * 2 + 32 * 128 * 128 * 4),
}
KV_PER_TOKEN = {"qwen3.6-27b": 16 * 2 * 4 * 256 * 2, "qwen3.6-35b-a3b": 10 * 2 * 2 * 256 * 2}


@pytest.mark.parametrize("name", list(STATE_PER_SEQ))
def test_state_pool_comes_before_the_kv_cache(name):
    inputs = memory_inputs(name, max_model_len=32_768, max_num_seqs=8, max_num_batched_tokens=2048)
    plan = plan_memory(inputs)
    assert plan.recurrent_state_bytes == 9 * STATE_PER_SEQ[name]
    assert plan.kv_bytes_per_token == KV_PER_TOKEN[name]
    assert plan.free_for_kv_bytes == plan.budget_bytes - plan.terms.total - plan.recurrent_state_bytes
    # eight more slots: eight requests' states fewer bytes of KV cache (and, where the sampler's peak
    # is the larger, eight more rows of logits for it)
    more = plan_memory(dataclasses.replace(inputs, max_num_seqs=16))
    more_activation = more.terms.activation - plan.terms.activation
    assert plan.free_for_kv_bytes - more.free_for_kv_bytes - more_activation == 8 * STATE_PER_SEQ[name]


def test_plan_shows_the_state_and_a_fitting_concurrency():
    args = EngineArgs(max_model_len=32_768)
    result = auto_fit(model_info("qwen3.6-27b"), args, parse_assume_gpus(H100), serving=True)
    plan = result.plan
    slots = plan.inputs.max_num_seqs + 1
    # and the prefix cache's snapshot slots (--mamba-cache-mode align: 2 x max_num_seqs, at most 16)
    assert plan.state_snapshot_bytes == 16 * STATE_PER_SEQ["qwen3.6-27b"]
    assert plan.recurrent_state_bytes == slots * STATE_PER_SEQ["qwen3.6-27b"] + plan.state_snapshot_bytes
    assert plan.max_concurrency >= 1.0  # a max_model_len request fits beside the state pool
    text = plan_text(result)
    assert f"recurrent state ({slots} slots x {STATE_PER_SEQ['qwen3.6-27b'] / MiB:.1f} MiB)" in text
    assert f"state snapshots (16 x {STATE_PER_SEQ['qwen3.6-27b'] / MiB:.1f} MiB)" in text
    assert "48 linear-attention layers keep recurrent state instead" in text
    assert "16 full layers x 4 KV heads x 256" in text


def test_weights_count_the_text_model():
    for name, low, high in (("qwen3.6-27b", 26.5, 27.5), ("qwen3.6-35b-a3b", 34.0, 35.5)):
        shape = model_info(name).shape
        assert low < shape.parameter_counts().total / 1e9 < high
    moe = model_info("qwen3.6-35b-a3b").shape
    assert moe.active_params is not None and 3.0 < moe.active_params / 1e9 < 3.8
