"""A model's shape as the planner needs it, read from its config.json, and its parameter count.

Families: the pre-norm decoders (Llama, Mistral, Qwen2, Qwen3 and the like), with mixture-of-experts
MLPs as Mixtral (`num_local_experts`, experts of `intermediate_size`) and Qwen-MoE (`num_experts`,
experts of `moe_intermediate_size`, an optional shared expert) name them; a Qwen-MoE layer in
`mlp_only_layers`, or off its `decoder_sparse_step`, keeps a dense MLP of `intermediate_size` (as
transformers builds it), every other layer of a MoE model is sparse. Gemma-4 (mixed layer geometries,
per-layer inputs, KV-shared layers, experts beside a dense MLP) is counted by gemma4_shape.py; its
`kv_layers` hold each layer's cache geometry (kv_layers.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fitserve.kv_layers import KvLayerSpec, is_gemma4, is_qwen3_5, kv_elements_per_token, kv_layer_specs
from fitserve.layers.quantization.layer_projections import moe_sparse_layer
from fitserve.planner.gemma4_shape import gemma4_counts
from fitserve.planner.qwen3_5_shape import qwen3_5_counts

# model_type values whose q/k/v projections carry a bias without saying so in config.json.
_QKV_BIAS_MODEL_TYPES = ("qwen2", "qwen2_moe")


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how the planner treats them; `linear + other` is the model's total."""

    linear: int  # decoder projection matrices: what a quantization method quantizes
    other: int  # embeddings, LM head, norms, biases, MoE routers: kept in the model dtype
    replicated: int  # the part of `other` every tensor-parallel rank holds whole (norms, routers)

    @property
    def total(self) -> int:
        return self.linear + self.other


@dataclass(frozen=True)
class ModelShape:
    architecture: str
    model_type: str
    hidden_size: int
    intermediate_size: int  # dense MLP width (per expert for Mixtral-style MoE)
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    torch_dtype: str | None = None  # config.json's dtype of the checkpoint, e.g. "bfloat16"
    # Each layer's KV cache geometry where layers differ (Gemma-4), else (): every layer has
    # num_kv_heads x head_dim. head_dim is then the largest layer's (activation estimates).
    kv_layers: tuple[KvLayerSpec, ...] = ()
    counts: ParamCounts | None = None  # counted by the family's own rule (Gemma-4), else from the shape
    active_params: int | None = None  # parameters a token runs, where it differs from the total (MoE)
    towers: tuple[str, ...] = ()  # multimodal towers config.json describes, not counted (text only)
    # Hybrid models (Qwen3.5's DeltaNet layers): state elements per request, model dtype and float32
    conv_state_elements: int = 0
    recurrent_state_elements: int = 0
    # and their key and value head counts, which tensor parallel splits too ((): none)
    linear_head_counts: tuple[int, ...] = ()
    # MoE layers of the generic decoders (None: every layer when the model has experts)
    sparse_layers: int | None = None

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelShape:
        """Reads a transformers PretrainedConfig (the text part of a multimodal one)."""
        config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        hidden = _first_int(config, "hidden_size", "n_embd", "d_model")
        heads = _first_int(config, "num_attention_heads", "n_head")
        model_type = str(getattr(config, "model_type", "") or "")
        num_experts = _first_int(config, "num_local_experts", "num_experts", default=0)
        moe_width = _first_int(config, "moe_intermediate_size", default=0)
        dense_width = _first_int(config, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
        num_layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
        archs = getattr(hf_config, "architectures", None) or []
        if is_gemma4(config):
            return cls._gemma4(config, archs[0] if archs else "")
        if is_qwen3_5(config):
            return cls._qwen3_5(config, archs[0] if archs else "")
        return cls(
            architecture=archs[0] if archs else "",
            model_type=model_type,
            hidden_size=hidden,
            intermediate_size=dense_width,
            num_layers=num_layers,
            num_attention_heads=heads,
            num_kv_heads=_first_int(config, "num_key_value_heads", default=heads),
            head_dim=_first_int(config, "head_dim", default=hidden // heads),
            vocab_size=_first_int(config, "vocab_size"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type in _QKV_BIAS_MODEL_TYPES or bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type.startswith("qwen3"),
            num_experts=num_experts,
            num_experts_per_tok=_first_int(config, "num_experts_per_tok", default=0) if num_experts else 0,
            moe_intermediate_size=(moe_width or dense_width) if num_experts else 0,
            shared_expert_intermediate_size=_first_int(config, "shared_expert_intermediate_size", default=0),
            torch_dtype=_dtype_name(config),
            sparse_layers=sum(moe_sparse_layer(config, i) for i in range(num_layers))
            if num_experts
            else None,
        ).with_active_params()

    @classmethod
    def _gemma4(cls, config: Any, architecture: str) -> ModelShape:
        specs = kv_layer_specs(config)
        counts = gemma4_counts(config)
        moe = bool(getattr(config, "enable_moe_block", False))
        return cls(
            architecture=architecture,
            model_type="gemma4_text",
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=max(spec.num_kv_heads for spec in specs),
            head_dim=max(spec.head_dim for spec in specs),
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=True,
            num_experts=int(config.num_experts) if moe else 0,
            num_experts_per_tok=int(config.top_k_experts) if moe else 0,
            moe_intermediate_size=int(config.moe_intermediate_size) if moe else 0,
            torch_dtype=_dtype_name(config),
            kv_layers=specs,
            counts=ParamCounts(counts.linear, counts.other, counts.replicated),
            active_params=counts.active if moe else None,
            towers=tuple(getattr(config, "towers", ()) or ()),
        )

    @classmethod
    def _qwen3_5(cls, config: Any, architecture: str) -> ModelShape:
        counts = qwen3_5_counts(config)
        moe = bool(getattr(config, "num_experts", None))
        return cls(
            architecture=architecture,
            model_type=str(config.model_type),
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size if not moe else config.moe_intermediate_size,
            num_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=True,
            num_experts=int(config.num_experts) if moe else 0,
            num_experts_per_tok=int(config.num_experts_per_tok) if moe else 0,
            moe_intermediate_size=int(config.moe_intermediate_size) if moe else 0,
            shared_expert_intermediate_size=int(config.shared_expert_intermediate_size) if moe else 0,
            torch_dtype=_dtype_name(config),
            kv_layers=kv_layer_specs(config),
            counts=ParamCounts(counts.linear, counts.other, counts.replicated),
            active_params=counts.active if moe else None,
            towers=tuple(getattr(config, "towers", ()) or ()),
            conv_state_elements=counts.conv_state_elements,
            recurrent_state_elements=counts.recurrent_state_elements,
            linear_head_counts=(int(config.linear_num_key_heads), int(config.linear_num_value_heads)),
        )

    def state_bytes_per_seq(self, dtype_bytes: int) -> int:
        """A request's recurrent state over the hybrid layers (0 for attention-only models)."""
        return self.conv_state_elements * dtype_bytes + self.recurrent_state_elements * 4

    def kv_elements_per_token(self, tensor_parallel_size: int = 1) -> int:
        """K and V elements per token over the layers that own a cache, on one rank."""
        if self.kv_layers:
            return kv_elements_per_token(self.kv_layers, tensor_parallel_size)
        return 2 * self.num_layers * self.kv_heads_per_rank(tensor_parallel_size) * self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_sparse_layers(self) -> int:
        if not self.is_moe:
            return 0
        return self.num_layers if self.sparse_layers is None else self.sparse_layers

    def mlp_linear_params(self) -> int:
        """The MLP projections of all layers: the sparse layers' experts (and shared expert), the dense
        layers' gated MLP."""
        hidden, sparse = self.hidden_size, self.num_sparse_layers
        dense = 3 * hidden * self.intermediate_size * (self.num_layers - sparse)
        experts = self.num_experts * 3 * hidden * self.moe_intermediate_size
        return dense + sparse * (experts + 3 * hidden * self.shared_expert_intermediate_size)

    def with_active_params(self) -> ModelShape:
        """This shape with `active_params` set for a generic MoE: the total less the experts a token does
        not run (num_experts - num_experts_per_tok of each sparse layer)."""
        if not self.is_moe or self.counts is not None:
            return self
        idle = self.num_sparse_layers * (self.num_experts - self.num_experts_per_tok)
        unused = idle * 3 * self.hidden_size * self.moe_intermediate_size
        return dataclasses.replace(self, active_params=self.parameter_counts().total - unused)

    def parameter_counts(self) -> ParamCounts:
        """Counted from the shapes alone: what a checkpoint of this config holds."""
        if self.counts is not None:
            return self.counts
        hidden, q, kv = self.hidden_size, self.q_size, self.kv_size
        attention = hidden * (q + 2 * kv) + q * hidden
        biases = (q + 2 * kv if self.qkv_bias else 0) + (hidden if self.o_bias else 0)
        norms = 2 * hidden + (2 * self.head_dim if self.qk_norm else 0)
        router = hidden * self.num_experts + (hidden if self.shared_expert_intermediate_size else 0)
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        replicated = self.num_layers * norms + self.num_sparse_layers * router + hidden
        return ParamCounts(
            linear=self.num_layers * attention + self.mlp_linear_params(),
            other=embeddings + self.num_layers * biases + replicated,
            replicated=replicated,
        )

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads each rank holds: split across ranks, replicated once ranks outnumber them."""
        return max(1, self.num_kv_heads // tensor_parallel_size)


def _first_int(config: Any, *names: str, default: int | None = None) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    if default is None:
        raise ValueError(
            f"config.json has none of {', '.join(names)}: the planner cannot size this model "
            "(pass a model folder whose config.json is a decoder-only language model)"
        )
    return default


def _dtype_name(config: Any) -> str | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if value is None:
        return None
    return str(value).removeprefix("torch.")
