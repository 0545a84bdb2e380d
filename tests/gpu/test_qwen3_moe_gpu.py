"""Qwen3-MoE on CUDA (run on the GPU machine): Qwen3-30B-A3B's shape (examples/models) cut to 4 layers, random
bf16 weights saved in the hub's per-expert form; greedy tokens against HF's float32 forward on the same
weights, with CUDA graphs (the fused router and MoE kernels, the decode-sized MoE path at batch 1) and
eagerly, and at tensor parallel 2 both ways (intermediate split, expert parallel) where two GPUs exist."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.test_engine_gpu import _greedy, _llm, _prompts, _save_random_model
from tests.gpu.test_tensor_parallel_gpu import _agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

EXAMPLE_MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return _save_random_model("qwen3-30b-a3b", tmp_path_factory.mktemp("qwen3_moe"), 4, EXAMPLE_MODELS)


RUNS = {
    "graphs": {},
    "eager": {"enforce_eager": True},
    "tp2": {"tensor_parallel_size": 2},
    "tp2_expert_parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


@pytest.mark.parametrize("run", list(RUNS))
def test_greedy_follows_hf_float32(model_folder, run):
    settings = RUNS[run]
    if settings.get("tensor_parallel_size", 1) > torch.cuda.device_count():
        pytest.skip("needs two CUDA GPUs")
    prompts = _prompts(3)
    llm = _llm(model_folder, **settings)
    outs = _greedy(llm, prompts)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    for prompt, out in zip(prompts[:2], outs[:2], strict=True):
        agree = _agreement(model_folder, prompt, out)
        assert agree >= 0.99, f"{run}: greedy agreement with HF float32 {agree:.3f} < 0.99"
