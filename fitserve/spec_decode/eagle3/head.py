"""The EAGLE-3 head as a torch module (fitserve/spec_decode/eagle3/), under its checkpoint's names: one
decoder layer `midlayer` whose q/k/v read [embedding, hidden] (twice the hidden size in), `fc` over the
target's three streams, `norm`, `lm_head` over the draft vocabulary and `d2t` (draft id -> target id
offset); its weights loaded from the released format, or random (the target's --load-format dummy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fitserve.layers.layernorm import RMSNorm
from fitserve.layers.linear import QKVParallelLinear, ReplicatedLinear
from fitserve.layers.rotary_embedding import RotaryEmbedding, rope_settings_from_config
from fitserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fitserve.models.decoder_blocks import DecoderAttention, DecoderSpec, GatedMLP, head_dim_of
from fitserve.models.parameter_loads import ParameterLoads


class Eagle3Head(nn.Module):
    """The checkpoint's modules, under its names (midlayer.*, fc, norm, lm_head, embed_tokens)."""

    def __init__(self, hf_config: Any, target_hidden: int, max_positions: int, own_embedding: bool) -> None:
        super().__init__()
        c = hf_config
        hidden = int(c.hidden_size)
        self.hidden_size = hidden
        self.draft_vocab_size = int(getattr(c, "draft_vocab_size", None) or c.vocab_size)
        self.norm_before_residual = bool(getattr(c, "norm_before_residual", False))
        bias = bool(getattr(c, "attention_bias", False))
        self.midlayer = nn.Module()
        self.midlayer.hidden_norm = RMSNorm(hidden, c.rms_norm_eps)
        self.midlayer.input_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        self.midlayer.post_attention_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        attention = DecoderAttention(c, DecoderSpec(qkv_bias=bias, o_bias=bias), 0, None)
        # q/k/v read [embedding, hidden]: twice the hidden size in
        attention.qkv_proj = QKVParallelLinear(
            2 * hidden, attention.head_dim, c.num_attention_heads, attention.num_kv_heads, bias=bias
        )
        self.midlayer.self_attn = attention
        self.midlayer.mlp = GatedMLP(
            hidden, c.intermediate_size, bool(getattr(c, "mlp_bias", False)), c.hidden_act
        )
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, c.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.embed_tokens = VocabParallelEmbedding(int(c.vocab_size), hidden) if own_embedding else None
        self.rotary_emb = RotaryEmbedding(head_dim_of(c), rope_settings_from_config(c), max_positions)
        # draft id -> target id offset (zeros: the draft vocabulary is the target's first ids)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings [T, H], hidden [T, H]: fc of the target's streams, or the head's own output
        before) -> (normed output for the logits, output before the final norm: the next step's hidden)."""
        layer = self.midlayer
        rope = self.rotary_emb.rope_for_step(positions, embeds.dtype)
        embeds = layer.input_layernorm.forward(embeds)
        if self.norm_before_residual:
            hidden = layer.hidden_norm.forward(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = layer.hidden_norm.forward(hidden)
        x = torch.cat([embeds, hidden], dim=-1)
        attend = layer.self_attn.forward_cpu if rope.cos is not None else layer.self_attn.forward
        x = attend(x, rope)
        x, residual = layer.post_attention_layernorm.forward(x, residual)
        x = layer.mlp.forward(x)
        return self.norm.forward(x, residual)

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy over the draft vocabulary, as target ids."""
        ids = self.lm_head(normed).argmax(dim=-1)
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loads = ParameterLoads(self)
        packed = {
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
        for name, tensor in weights:
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.long).reshape(-1))
                continue
            name = name.removeprefix("model.")
            if name.startswith("layers.0."):  # some conversions name the midlayer as layer 0
                name = "midlayer." + name.removeprefix("layers.0.")
            if name.startswith("embed_tokens.") and self.embed_tokens is None:
                continue
            target, module, shard_id = name, "", None
            for checkpoint_module, (packed_module, shard) in packed.items():
                marker = f".{checkpoint_module}."
                if marker in name:
                    target, module, shard_id = (
                        name.replace(marker, f".{packed_module}."),
                        packed_module,
                        shard,
                    )
                    break
            loads.load(name, target, tensor, shard_id, shards.get(module, ()))
        return loads.loaded

    def initialize_dummy(self, seed: int) -> None:
        """Random weights (the target's --load-format dummy): normal(0, 0.02) matrices, unit norms, d2t 0."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed + 3)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator) * 0.02
                param.data.copy_(values.to(param.dtype))
