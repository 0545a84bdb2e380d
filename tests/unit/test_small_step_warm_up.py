"""ModelRunner._small_step_forward, the startup steps that compile the small-step kernel variants on a GPU
(profile_run calls it there with 1 and 2 tokens): its metadata is a real one-sequence step. Run here on the
CPU backend, it writes exactly the step's slots of the scratch cache (block 1) and no others."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.planner.resolve import create_engine_config
from fitserve.worker.model_runner import ModelRunner
from tests.unit.model_helpers import build_hf_model, tiny_hf_config


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_writes_the_steps_slots_and_nothing_else(num_tokens: int, tmp_path: Path) -> None:
    build_hf_model(tiny_hf_config("Qwen3ForCausalLM"), seed=0).save_pretrained(tmp_path)
    runner = ModelRunner(create_engine_config(EngineArgs(model=str(tmp_path), device="cpu")))
    scratch = runner._layer_caches(3)
    sentinel = 12345.0  # finite: the CPU kernels read a block's unused slots (masked) as well
    for cache in scratch:
        cache.fill_(sentinel)
    with torch.inference_mode():
        runner._small_step_forward(scratch, num_tokens)
    for cache in scratch:  # [2, blocks, block_size, kv heads, head dim]
        written = (cache != sentinel).any(dim=-1).any(dim=-1)  # [2, blocks, block_size]
        expected = torch.zeros_like(written)
        expected[:, 1, :num_tokens] = True
        assert torch.equal(written, expected)
