"""Qwen3-MoE on CUDA (run on the GPU machine): Qwen3-30B-A3B's shape (examples/models) cut to 4 layers, random
bf16 weights saved in the hub's per-expert form; greedy tokens against HF's float32 forward on the same
weights, with CUDA graphs (the fused router and MoE kernels, the decode-sized MoE path at batch 1) and
eagerly, and at tensor parallel 2 both ways (intermediate split, expert parallel) where two GPUs exist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.test_engine_gpu import CLEAR_MARGIN, _greedy, _hf_logprobs, _llm, _prompts
from tests.model_folders import save_with_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = Path(__file__).resolve().parents[2] / "examples" / "models" / "qwen3-30b-a3b" / "config.json"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("qwen3_moe") / "qwen3-30b-a3b-4l"
    folder.mkdir()
    config_dict = json.loads(SHAPE.read_text())
    config_dict["num_hidden_layers"] = 4
    (folder / "config.json").write_text(json.dumps(config_dict))
    config = AutoConfig.from_pretrained(folder)
    config.initializer_range = 0.05  # a wide init: the greedy path follows the weights
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    save_with_tokenizer(model, folder)
    del model
    torch.cuda.empty_cache()
    return folder


def _agreement(folder: Path, prompt: list[int], token_ids: list[int]) -> float:
    reference = _hf_logprobs(folder, prompt + token_ids, torch.float32)[len(prompt) - 1 : -1]
    top2 = reference.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
    assert clear.sum() >= 50, "too few clear positions to judge"
    return (torch.tensor(token_ids) == top2.indices[:, 0])[clear].float().mean().item()


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
        agree = _agreement(model_folder, prompt, out.token_ids)
        assert agree >= 0.99, f"{run}: greedy agreement with HF float32 {agree:.3f} < 0.99"
