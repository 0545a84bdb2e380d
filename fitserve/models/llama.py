"""Llama family: Llama 2/3/3.1 (and SmolLM2, DeepSeek-R1-Distill-Llama, which are Llama) and Mistral."""

from __future__ import annotations

from typing import Any

from fitserve.models.decoder_blocks import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    """`attention_bias` puts a bias on q/k/v and o; `mlp_bias` on gate/up and down (both off in Llama)."""

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers; its `sliding_window` (when set) is each attention layer's window (masked on the CPU;
    the CUDA path refuses contexts longer than it)."""
