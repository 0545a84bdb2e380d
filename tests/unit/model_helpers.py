"""Test helpers: tiny random HF models, and a paged KV cache + metadata to run fitserve models step by step.

`PagedTestRunner` plays the model runner's part in miniature: it hands out blocks from a shuffled pool
(so block tables are not the identity), builds `AttentionMetadata` for a step of (sequence, new tokens)
chunks and returns each chunk's logits. Other helpers' tests may import it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch import nn

from fitserve.kernels import reference
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from fitserve.models.registry import get_model_class

TINY_DIMS: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}

_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
}


def tiny_hf_config(architecture: str, **overrides: Any) -> Any:
    """A small config of `architecture` (2 layers, hidden 64, 4 heads, 2 kv heads, vocab 256)."""
    config_class = getattr(transformers, _CONFIG_CLASSES[architecture])
    return config_class(architectures=[architecture], **{**TINY_DIMS, **overrides})


def build_hf_model(config: Any, seed: int = 0) -> nn.Module:
    """The HF model for `config` (eager attention, fp32, eval) with O(1)-scale random weights.

    HF's own init (std 0.02) gives near-zero logits that would hide errors; here matrices get
    std 1/sqrt(fan_in), norms 1 + noise and biases noise, so logits spread over several units.
    """
    torch.manual_seed(seed)
    model_class = getattr(transformers, config.architectures[0])
    model = model_class._from_config(config, attn_implementation="eager").to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[-1]))
    return model


def build_fitserve_model(hf_config: Any, state_dict: dict[str, torch.Tensor]) -> nn.Module:
    """The fitserve model for `hf_config` (fp32, CPU) with `state_dict` loaded; every parameter loaded."""
    model = get_model_class(hf_config)(hf_config).eval()
    loaded = model.load_weights(state_dict.items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert not missing, f"parameters left unloaded: {sorted(missing)}"
    return model


@torch.no_grad()
def hf_logits(hf_model: nn.Module, token_ids: list[int]) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: HF's logits at every position of one sequence."""
    return hf_model(input_ids=torch.tensor([token_ids])).logits[0].float()


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_dim] cache per layer."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]


@dataclass
class ChunkSpec:
    """One sequence's part of a step: `query_len` new tokens after `num_computed` cached ones."""

    num_computed: int
    query_len: int
    block_ids: list[int]


def build_attention_metadata(chunks: list[ChunkSpec], block_size: int) -> AttentionMetadata:
    slots: list[int] = []
    for chunk in chunks:
        for position in range(chunk.num_computed, chunk.num_computed + chunk.query_len):
            slots.append(chunk.block_ids[position // block_size] * block_size + position % block_size)
    query_lens = [chunk.query_len for chunk in chunks]
    seq_lens = [chunk.num_computed + chunk.query_len for chunk in chunks]
    max_blocks = max(len(chunk.block_ids) for chunk in chunks)
    tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
    for row, chunk in enumerate(chunks):
        tables[row, : len(chunk.block_ids)] = torch.tensor(chunk.block_ids, dtype=torch.int32)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def attention_reference_from_metadata(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The kernels' torch reference (kernels/reference.py) over a step's AttentionMetadata."""
    return reference.paged_attention_reference(
        query,
        kv_cache,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        scale,
        k_scale,
        v_scale,
    )


@dataclass
class _SequenceState:
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)


class PagedTestRunner:
    """Runs a fitserve model step by step over a paged KV cache, as the model runner would."""

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        num_blocks: int = 64,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        head_dim = (
            getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        )
        self.kv_caches = allocate_kv_caches(
            hf_config.num_hidden_layers,
            num_blocks,
            block_size,
            hf_config.num_key_value_heads,
            head_dim,
            dtype,
        )
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.sequences: dict[str, _SequenceState] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """chunks: (sequence id, its next new token ids) -> float32 logits [len(new ids), vocab] per chunk."""
        specs: list[ChunkSpec] = []
        input_ids: list[int] = []
        positions: list[int] = []
        for seq_id, new_ids in chunks:
            state = self.sequences.setdefault(seq_id, _SequenceState())
            total = state.num_computed + len(new_ids)
            while len(state.block_ids) * self.block_size < total:
                state.block_ids.append(self.free_blocks.pop())
            specs.append(ChunkSpec(state.num_computed, len(new_ids), list(state.block_ids)))
            input_ids.extend(new_ids)
            positions.extend(range(state.num_computed, total))
        metadata = build_attention_metadata(specs, self.block_size)
        with forward_context(metadata, self.kv_caches):
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions))
        logits = self.model.compute_logits(hidden)
        for seq_id, new_ids in chunks:
            self.sequences[seq_id].num_computed += len(new_ids)
        return list(logits.split([len(new_ids) for _, new_ids in chunks]))


def greedy_with_mixed_steps(
    runner: PagedTestRunner, prompts: dict[str, list[int]], late: str, joins_at: int = 2, steps: int = 5
) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """Every prompt but `late` prefills in the first step, then all decode greedily; `late` joins at step
    `joins_at` (its prefill beside the others' decodes). Returns, per prompt, the logits of every token it
    fed (the last sampled token is not fed) and its whole token sequence."""
    tokens = dict(prompts)
    produced: dict[str, list[torch.Tensor]] = {name: [] for name in tokens}
    pending = {name: ids for name, ids in tokens.items() if name != late}
    for step in range(steps):
        if step == joins_at:
            pending[late] = tokens[late]
        names = list(pending)
        for name, logits in zip(names, runner.step([(n, pending[n]) for n in names]), strict=True):
            produced[name].append(logits)
            tokens[name] = tokens[name] + [int(logits[-1].argmax())]
            pending[name] = [tokens[name][-1]]
    return {name: (torch.cat(pieces), tokens[name]) for name, pieces in produced.items()}
