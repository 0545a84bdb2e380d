"""Qwen2 / Qwen2.5: Llama's layers with a bias on the q/k/v projections (none on o or the MLP)."""

from __future__ import annotations

from typing import Any

from fitserve.models.decoder_blocks import DecoderForCausalLM, DecoderSpec


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
