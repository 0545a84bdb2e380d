"""Shared by the quantized-checkpoint tests: the greedy comparison of fitserve's whole engine against HF
transformers on tiny Llama / Qwen3 models (test_quant_{fp8,int4,bnb}_engine.py), and fitserve's model of a
checkpoint folder loaded without the engine (the Gemma-4 and Qwen3.5 quantized logits tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from fitserve import LLM, SamplingParams
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.checkpoint_config import CheckpointConfig
from tests.unit.model_helpers import build_fitserve_model
from tests.unit.test_engine_vs_hf import hf_greedy

# tiny_hf_config overrides of the three engine tests: each projection's input 128 or 256 wide
DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77))]
NEW_TOKENS = 10


def greedy_hf(model: torch.nn.Module) -> list[list[int]]:
    """HF transformers' NEW_TOKENS greedy tokens after each of PROMPTS (the reference)."""
    return [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]


def fitserve_llm(folder: Path, **kwargs) -> LLM:
    """fitserve's engine on the CPU in float32 for the folder (`kwargs`: quantization, load_format, ...)."""
    return LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=8, **kwargs)


def greedy_fitserve(llm: LLM) -> list[list[int]]:
    """The engine's NEW_TOKENS greedy tokens after each of PROMPTS."""
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def model_of(llm: LLM) -> torch.nn.Module:
    """The model the engine runs."""
    return llm.engine.executor.runner.model


def load_model(folder: Path, flag: str | None = None) -> torch.nn.Module:
    """fitserve's model of the folder's checkpoint (`flag`: --quantization), every parameter loaded, on this
    process's tensor-parallel rank."""
    config = with_quantization_flag(CheckpointConfig.from_folder(folder), flag)
    return build_fitserve_model(config, load_file(folder / "model.safetensors"))
