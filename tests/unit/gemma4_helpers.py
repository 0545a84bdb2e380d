"""Tiny random Gemma-4 models for the tests: HF's (the reference) and fitserve's, on per-layer KV caches.

Each case turns on a set of Gemma-4's features; together they cover all of them: a sliding window
shorter than the test prompts, mixed head dims (sliding 16, full 32), attention_k_eq_v with its own KV head
count, per-layer inputs, KV sharing across both layer types, the double-wide MLP, final logit
softcapping and the MoE block.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from fitserve.kv_layers import kv_layer_specs
from fitserve.layers.attention.metadata import forward_context
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from tests.unit.model_helpers import ChunkSpec, build_attention_metadata

S, F = "sliding_attention", "full_attention"
WINDOW = 8
BASE: dict[str, Any] = {
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": WINDOW,
    "max_position_embeddings": 512,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "rms_norm_eps": 1e-6,
}
CASES: dict[str, dict[str, Any]] = {
    # E2B / E4B-like: per-layer inputs, the last 3 layers read the caches of layers 1 (sliding) and 2
    # (full), double-wide MLPs on those.
    "e_model": {
        "num_hidden_layers": 6,
        "layer_types": [S, S, F, S, S, F],
        "hidden_size_per_layer_input": 8,
        "num_kv_shared_layers": 3,
        "use_double_wide_mlp": True,
    },
    # 26B-A4B-like: experts beside the dense MLP; full layers K=V with 1 KV head of 32 (sliding: 2 of 16).
    "moe_k_eq_v": {
        "num_hidden_layers": 4,
        "layer_types": [S, F, S, F],
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 1,
        "enable_moe_block": True,
        "num_experts": 6,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
    },
}


def text_config(case: str) -> Any:
    return transformers.Gemma4TextConfig(architectures=["Gemma4ForCausalLM"], **{**BASE, **CASES[case]})


def conditional_config(case: str) -> Any:
    """The multimodal form: the same text model under text_config, with tiny vision and audio towers."""
    vision = transformers.Gemma4VisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8
    )
    audio = transformers.Gemma4AudioConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        output_proj_dims=16,
        subsampling_conv_channels=[8, 4],
    )
    return transformers.Gemma4Config(
        text_config=text_config(case).to_dict(),
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
        architectures=["Gemma4ForConditionalGeneration"],
    )


def build_hf(config: Any, seed: int = 0) -> nn.Module:
    """HF's model (eager attention, float32, eval) with O(1)-scale random weights: norm and router scales
    around 1, layer scalars in [0.5, 1.5], matrices std 1/sqrt(fan_in)."""
    torch.manual_seed(seed)
    model_class = getattr(transformers, config.architectures[0])
    model = model_class._from_config(config, attn_implementation="eager").to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "per_expert_scale")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embed" in name and param.ndim == 2 and "tower" not in name:
                param.copy_(torch.randn_like(param))
            elif param.ndim >= 2:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))
    return model


def fitserve_config(folder: Path) -> CheckpointConfig:
    config = CheckpointConfig.from_folder(folder)
    assert config is not None, f"fitserve did not read {folder / 'config.json'} itself"
    return config


def build_fitserve(folder: Path, hf_model: nn.Module) -> tuple[CheckpointConfig, nn.Module]:
    """fitserve's model from the saved folder's config.json, with HF's state dict loaded."""
    config = fitserve_config(folder)
    model = get_model_class(config)(config).eval()
    loaded = model.load_weights(hf_model.state_dict().items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert not missing, f"parameters left unloaded: {sorted(missing)}"
    return config, model


def saved_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


class GemmaPagedRunner:
    """Runs a fitserve model step by step over per-layer paged caches (shuffled blocks)."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        num_blocks: int = 48,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.block_size = model, block_size
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype)
            if spec.owns_cache(index)
            else torch.empty(0)
            for index, spec in enumerate(kv_layer_specs(config))
        ]
        self.free = list(range(num_blocks))
        random.Random(1).shuffle(self.free)
        self.sequences: dict[str, tuple[int, list[int]]] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor] | None:
        """Each chunk's logits; None on a tensor-parallel rank that gets none (all but the first)."""
        specs, input_ids, positions = [], [], []
        for seq_id, new_ids in chunks:
            computed, blocks = self.sequences.get(seq_id, (0, []))
            total = computed + len(new_ids)
            while len(blocks) * self.block_size < total:
                blocks.append(self.free.pop())
            self.sequences[seq_id] = (total, blocks)
            specs.append(ChunkSpec(computed, len(new_ids), list(blocks)))
            input_ids.extend(new_ids)
            positions.extend(range(computed, total))
        metadata = build_attention_metadata(specs, self.block_size)
        with forward_context(metadata, self.kv_caches):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return None
        return list(logits.split([len(ids) for _, ids in chunks]))


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_greedy_matches(
    got: list[int], hf_model: nn.Module, prompt: list[int], tie_margin: float = 1e-3
) -> None:
    """fitserve's greedy tokens equal HF's, except where HF's two best logits are within `tie_margin`
    (a near-tie that float rounding may break either way): the sequences may part there, and are
    compared up to that point only."""
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt + got])).logits[0].float()
    for step, token in enumerate(got):
        row = logits[len(prompt) - 1 + step]
        best = int(row.argmax())
        if token == best:
            continue
        top2 = torch.topk(row, 2).values
        gap = float(top2[0] - top2[1])
        assert row[token] >= top2[1] and gap < tie_margin, (
            f"step {step}: fitserve chose {token}, HF {best} (logit gap {gap:.3g}, not a near-tie)"
        )
        return


class GemmaRankRunner(GemmaPagedRunner):
    """GemmaPagedRunner for one tensor-parallel rank: each cache holds the rank's KV heads (as many as the
    model's attention layers hold: a split or replicated share of the layer's heads)."""

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        num_blocks: int = 48,
        block_size: int = 4,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(model, config, num_blocks, block_size, dtype)
        for index, attention in enumerate(model.attention_layers):
            if self.kv_caches[index].numel():
                shape = (2, num_blocks, block_size, attention.num_kv_heads, attention.head_dim)
                self.kv_caches[index] = torch.zeros(shape, dtype=dtype)
