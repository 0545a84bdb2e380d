"""The plan is the engine's: planned against what fitserve's CPU model runner builds for tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.planner.engine_plan import inputs_from_engine_config
from fitserve.planner.hardware import cpu_device, probe_host
from fitserve.planner.memory import MemoryTerms, plan_memory, planned_vs_measured
from fitserve.planner.resolve import create_engine_config
from fitserve.worker.model_runner import ModelRunner
from tests.unit.model_helpers import build_hf_model, tiny_hf_config


@pytest.mark.parametrize(
    ("architecture", "overrides"),
    [
        ("Qwen3ForCausalLM", {"tie_word_embeddings": True}),
        ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),
        ("LlamaForCausalLM", {"num_key_value_heads": 4}),
    ],
)
def test_cpu_plan_matches_the_model_runner(architecture: str, overrides: dict, tmp_path: Path) -> None:
    build_hf_model(tiny_hf_config(architecture, **overrides), seed=0).save_pretrained(tmp_path)
    config = create_engine_config(EngineArgs(model=str(tmp_path), device="cpu", cpu_kv_cache_space=0.01))
    inputs = inputs_from_engine_config(config, cpu_device(probe_host()))
    planned = plan_memory(inputs)
    runner = ModelRunner(config)
    measured_weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert planned.terms.weights == pytest.approx(measured_weights, rel=0.01)
    assert planned.block_bytes == runner.kv_bytes_per_block()
    sized = runner.size_kv_cache()
    assert planned.num_kv_blocks == sized.num_kv_blocks
    runner.allocate_kv_cache(sized)
    allocated = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    assert allocated == planned.kv_cache_bytes


def test_measured_terms_and_the_log_lines(tmp_path: Path) -> None:
    build_hf_model(tiny_hf_config("Qwen3ForCausalLM"), seed=0).save_pretrained(tmp_path)
    config = create_engine_config(EngineArgs(model=str(tmp_path), device="cpu"))
    inputs = inputs_from_engine_config(config, cpu_device(probe_host()))
    assert inputs.dtype == "float32" and inputs.cudagraph_capture_sizes == ()
    planned = plan_memory(inputs)
    runner = ModelRunner(config)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    measured = plan_memory(inputs, MemoryTerms(weights, 0, 0, planned.terms.runtime_overhead))
    lines = planned_vs_measured(planned, measured)
    assert lines[0] == (
        f"weights: planned {planned.terms.weights / 2**30:.2f} GiB, measured {weights / 2**30:.2f} GiB "
        f"({(planned.terms.weights - weights) / weights * 100:+.1f}%)"
    )
    assert lines[-1].endswith("(+0.0%)")  # the CPU KV cache follows max_model_len, not the measured terms
    assert torch.get_default_dtype() == torch.float32
