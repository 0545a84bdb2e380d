"""Tiny random Qwen3.5 models (dense and MoE) for the tests: HF's (the reference), saved as checkpoints.

Three Gated DeltaNet layers and one full-attention layer; 2 key heads serving 4 value heads; a partial
rotary of a quarter of head_dim with mrope sections (text positions: plain RoPE); the MoE with 4 experts,
2 per token, and a shared expert.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import transformers
from torch import nn

LIN, FULL = "linear_attention", "full_attention"
TEXT: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": [LIN, LIN, FULL, LIN],
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}
MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
}
VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
}


def make_config(moe: bool, conditional: bool) -> Any:
    """The HF config of one of the four forms (dense or MoE, CausalLM or ConditionalGeneration)."""
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    text_class = getattr(transformers, f"{family}TextConfig")
    text = text_class(**TEXT, **(MOE if moe else {}))
    if not conditional:
        text.architectures = [f"{family}ForCausalLM"]
        return text
    return getattr(transformers, f"{family}Config")(
        text_config=text.to_dict(), vision_config=VISION, architectures=[f"{family}ForConditionalGeneration"]
    )


def build_hf(config: Any, seed: int = 0) -> nn.Module:
    """HF's model (eager attention, float32, eval) with O(1)-scale random weights: norm offsets around 0
    (gated norm weights around 1), decays spread over (0.3, 1), matrices std 1/sqrt(fan_in)."""
    torch.manual_seed(seed)
    model_class = getattr(transformers, config.architectures[0])
    model = model_class._from_config(config, attn_implementation="eager").to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "norm" in name:
                param.copy_(0.2 * torch.randn_like(param))
            elif name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(-3.0, 0.0))
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * torch.randn_like(param))
            elif "embed" in name:
                param.copy_(torch.randn_like(param))
            elif param.ndim >= 2:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    return model


def hf_logits(model: nn.Module, tokens: list[int]) -> torch.Tensor:
    """HF's float32 logits [len(tokens), vocab] of one sequence, in one forward."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def hf_greedy(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
