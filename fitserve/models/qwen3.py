"""Qwen3 (dense): per-head RMSNorm on q and k before RoPE, an explicit head_dim, optional attention bias."""

from __future__ import annotations

from typing import Any

from fitserve.models.decoder_blocks import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
