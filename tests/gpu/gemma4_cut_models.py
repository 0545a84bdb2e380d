"""Gemma-4's real geometries (shared/models) cut to a few layers, with random bf16 weights saved as a
checkpoint beside the SmolLM2 tokenizer, and HF transformers' float32 log-probabilities over a sequence:
what the Gemma-4 GPU tests build and compare against."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.model_folders import save_with_tokenizer
from tests.paths import MODELS_DIR

CLEAR_MARGIN = 0.5  # as tests/gpu/test_engine_gpu.py: bf16 noise breaks closer top-2 logits either way


def save_cut_model(shape: str, num_layers: int, tmp: Path, **changes: object) -> Path:
    """The first `num_layers` layers of `shape`'s text config (the last made a full-attention layer), with
    `changes` to the config; skips the test where transformers has no Gemma-4."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4ForCausalLM"):
        pytest.skip("this transformers has no Gemma-4")
    text = json.loads((MODELS_DIR / shape / "config.json").read_text())["text_config"]
    text.update(num_hidden_layers=num_layers, layer_types=text["layer_types"][:num_layers], **changes)
    text["layer_types"][-1] = "full_attention"
    config = transformers.Gemma4TextConfig(**text)
    config.architectures = ["Gemma4ForCausalLM"]
    config.initializer_range = 0.05
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Gemma4ForCausalLM(config).to(torch.bfloat16)
    folder = tmp / shape
    save_with_tokenizer(model, folder)
    del model
    torch.cuda.empty_cache()
    return folder


def hf_logprobs(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """HF's float32 log-probabilities [len(token_ids), vocab] on the CPU (computed on CUDA)."""
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids], device="cuda")).logits[0].float()
    del model
    torch.cuda.empty_cache()
    return torch.log_softmax(logits, dim=-1).cpu()
