"""Gemma-4 text models: Gemma4ForCausalLM and the text part of Gemma4ForConditionalGeneration.

As transformers' modeling_gemma4.py computes it (the parts: gemma4_layers.py): token embeddings times
sqrt(hidden); on the E models, per-layer inputs (a second embedding table of num_layers x
hidden_size_per_layer_input per token, times sqrt of that width, averaged with a normed projection of the
embeddings); the decoder layers, each with its layer type's RoPE (rope_parameters: "default" on sliding
layers, "proportional" with partial_rotary_factor on full ones) and its own cache geometry (kv_layers.py);
a final RMSNorm; the tied LM head; logits softcapped by final_logit_softcapping (cap * tanh(x / cap)).

On CUDA the layers run Triton kernels (gemma4_layers.py) and each layer type's RoPE is a cos/sin table
over the whole head in the model dtype (HF rounds its tables so), read by the kernels at the step's
positions: "proportional" layers' unrotated pairs hold cos 1 and sin 0. Nothing in the forward reads a
host value, so a CUDA graph can hold it (the MoE experts are layers/moe.py's).

Tensor parallel: the vocabulary of both embedding tables is split across ranks and each lookup is
all-reduced (every rank needs the whole embeddings, and the per-layer table is too large to replicate);
the per-layer model projection is replicated (its output is normed per layer, so every rank needs it
whole); the LM head's logits are joined on rank 0, which alone softcaps them (None on the others).
gemma4_layers.py says how a decoder layer splits.

Weights: a ConditionalGeneration checkpoint keeps the text model under `model.language_model.`, which is
read as `model.`; its vision and audio towers (and their embedders) are skipped, with one log line.

Quantized checkpoints (config.json's quantization_config: AWQ / GPTQ / compressed-tensors / AutoRound int4,
fp8, bitsandbytes 4-bit; or --quantization fp8 / bitsandbytes on a 16-bit one): the decoder's linears and
the E models' per-layer model projection take the format's method (gemma4_layers.py), the shapes checked
before building (quant_config.check_layer_shapes: a group size that does not divide a quantized layer's
input is refused naming the module). The MoE experts run 16-bit, or an int4 checkpoint's (one tensor set per
expert and projection, into layers/moe_int4.py's experts); a format that would make them anything else is
refused before building (gemma4_config.refuse_quantized_experts). A 26B-A4B checkpoint whose ignore list
keeps the experts 16-bit runs with its attention and dense MLP quantized.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fitserve.kv_layers import kv_layer_specs
from fitserve.layers.attention.layer import Attention
from fitserve.layers.linear import ReplicatedLinear, ShardId, UnquantizedLinearMethod
from fitserve.layers.quantization.bnb_format import param_name as bnb_param_name
from fitserve.layers.quantization.quant_config import check_layer_shapes, quant_format
from fitserve.layers.rotary_embedding import RopeSettings, RotaryEmbedding, StepRope
from fitserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fitserve.models.cpu_offload import make_layers
from fitserve.models.expert_weights import check_quantized_experts_loaded, load_quantized_expert
from fitserve.models.gemma4_config import refuse_quantized_experts
from fitserve.models.gemma4_layers import Gemma4DecoderLayer, GemmaRMSNorm, quantized_method, use_kernels
from fitserve.models.parameter_loads import ParameterLoads

logger = logging.getLogger("fitserve")

# Checkpoint prefixes of the multimodal towers, which serving text does not load.
TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
_PACKED: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def gemma4_inv_freq(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2]: "default" rotates every pair; "proportional" rotates the first
    partial_rotary_factor of them with exponents over the whole head_dim and leaves the rest unrotated
    (angle 0); both divided by `factor`."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ValueError(
            f"rope_type={rope_type!r} is not supported for Gemma-4 layers: use 'default' or 'proportional'"
        )
    base = float(rope.get("rope_theta", 10_000.0))
    proportion = float(rope.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    rotated = int(proportion * head_dim // 2)
    exponents = torch.arange(0, 2 * rotated, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = torch.cat((1.0 / (base**exponents), torch.zeros(head_dim // 2 - rotated)))
    return inv_freq / float(rope.get("factor", 1.0)) if rope_type == "proportional" else inv_freq


def _table_rope(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
    """The step's cos/sin tables in StepRope's form (the torch rotation on every device)."""
    cos, sin = rotary(positions, dtype)
    half = rotary.head_dim // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return StepRope(cos=cos.unsqueeze(1), sin=signed_sin.unsqueeze(1))


class Gemma4Model(nn.Module):
    def __init__(self, config: Any, quant: Any = None) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.specs = kv_layer_specs(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden)
        self.embed_scale = hidden**0.5
        self.rotary = nn.ModuleDict()
        for spec in self.specs:
            if spec.layer_type not in self.rotary:
                rope = (config.rope_parameters or {}).get(spec.layer_type)
                if not isinstance(rope, dict):
                    raise ValueError(
                        f"rope_parameters has no entry for {spec.layer_type!r} layers: Gemma-4's config.json "
                        "must give each layer type its own rope settings (or leave rope_parameters out)"
                    )
                rotary = RotaryEmbedding(spec.head_dim, RopeSettings(), config.max_position_embeddings)
                rotary.inv_freq = gemma4_inv_freq(rope, spec.head_dim).to(rotary.inv_freq.device)
                self.rotary[spec.layer_type] = rotary
        self.layers = make_layers(
            config.num_hidden_layers, lambda i: Gemma4DecoderLayer(config, i, self.specs[i], quant)
        )
        for index, spec in enumerate(self.specs):
            if not spec.owns_cache(index):
                source = self.layers[spec.cache_layer].self_attn
                source.kv_consumers.append(self.layers[index].self_attn.attn)
        self.norm = GemmaRMSNorm(hidden, eps)
        self.per_layer_size = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer_size:
            packed = config.num_hidden_layers * self.per_layer_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input, packed)
            # replicated: each layer's slice of its output is normed whole (see the module docstring)
            projection = "per_layer_model_projection"
            self.per_layer_model_projection = ReplicatedLinear(
                hidden,
                packed,
                bias=False,
                linear_method=quantized_method(quant, config, projection, (projection,)),
            )
            self.per_layer_projection_norm = GemmaRMSNorm(self.per_layer_size, eps)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, num_layers, hidden_size_per_layer_input]: the token's own per-layer embedding and the
        normed projection of its embedding, averaged (times 2^-0.5)."""
        shape = (input_ids.shape[0], self.config.num_hidden_layers, self.per_layer_size)
        table = self.embed_tokens_per_layer(input_ids)
        own = (table * torch.tensor(self.per_layer_size**0.5, dtype=table.dtype)).reshape(shape)
        projected = self.per_layer_model_projection(embeds) * self.config.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + own) * 2.0**-0.5

    @staticmethod
    def _rope(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        """The kernels' form on CUDA (positions and a whole-head cos/sin table in the model dtype, as HF
        rounds its tables; "proportional" layers' unrotated pairs hold cos 1, sin 0), else the tables."""
        if use_kernels(positions):
            return rotary.rope_for_step(positions, dtype, table_dtype=dtype)
        return _table_rope(rotary, positions, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        embeds = embeds * torch.tensor(self.embed_scale, dtype=embeds.dtype)
        per_layer = self.per_layer_inputs(input_ids, embeds) if self.per_layer_size else None
        ropes = {kind: self._rope(rotary, positions, embeds.dtype) for kind, rotary in self.rotary.items()}
        hidden = embeds
        for index, layer in enumerate(self.layers):
            layer_input = per_layer[:, index] if per_layer is not None else None
            hidden = layer(hidden, ropes[self.specs[index].layer_type], layer_input)
        return self.norm(hidden)


class Gemma4ForCausalLM(nn.Module):
    """`model(input_ids [T], positions [T]) -> hidden [T, hidden]` inside `forward_context`;
    `compute_logits(hidden) -> [N, vocab]` softcapped; `load_weights(...)` -> the parameters loaded."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        quant = _checked_format(config)
        self.config = config
        self.model = Gemma4Model(config, quant)
        tie = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.model.embed_tokens if tie else None
        )
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.weights_prefix = getattr(config, "weights_prefix", "model.")
        towers = getattr(config, "towers", None)
        if towers:
            logger.info(
                "Gemma-4: serving the text model only; the %s tower(s) are not built or loaded",
                " and ".join(towers),
            )

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def fit_positions(self, max_model_len: int) -> None:
        """The RoPE tables cover positions up to the engine's max_model_len, not the model's whole
        max_position_embeddings (262,144 for the large models: 384 MiB of bf16 tables on CUDA)."""
        for rotary in self.model.rotary.values():
            rotary.max_positions = min(rotary.max_positions, max_model_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Softcapped logits [N, vocab]; with tensor parallel, on rank 0 only (None on the others)."""
        logits = self.lm_head(hidden)
        if logits is None:
            return None
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loads = ParameterLoads(self)
        skipped_towers = 0
        for name, tensor in weights:
            if name.startswith(TOWER_PREFIXES):
                skipped_towers += 1
                continue
            if name.startswith(self.weights_prefix):
                name = "model." + name.removeprefix(self.weights_prefix)
            if name.startswith("lm_head.") and self.lm_head.tied:
                continue
            if ".experts." in name and load_quantized_expert(self, name, tensor, ".experts."):
                continue  # an int4 checkpoint's expert tensor (`experts.<e>.<projection>.<param>`)
            name = bnb_param_name(name)  # bitsandbytes' dotted names (weight.absmax, ...) -> weight_absmax
            target, shard_id = _map_name(name)
            if self._is_shared_layer_kv(target, shard_id):
                continue  # a KV-shared layer computes no keys or values: its k/v weights are unused
            self._check_not_16bit(name, target)
            shards = () if shard_id is None else self.get_submodule(target.rsplit(".", 1)[0]).shard_ids
            loads.load(name, target, tensor, shard_id, shards)
        check_quantized_experts_loaded(self)
        for attention in self.attention_layers:  # a shared layer reads its cache with the writer's scales
            source = self.attention_layers[attention.kv_cache_layer]
            attention.k_scale, attention.v_scale = source.k_scale, source.v_scale
        if skipped_towers:
            logger.info(
                "Skipped %d vision/audio tower tensors: fitserve serves Gemma-4's text model only",
                skipped_towers,
            )
        return loads.loaded

    def _check_not_16bit(self, name: str, target: str) -> None:
        """ValueError for a 16-bit weight stored for a layer that config.json's quantization_config says is
        int4 (its ignore list does not name the module: e.g. a MoE router the checkpoint keeps 16-bit),
        which would otherwise match no parameter."""
        module_name, _, param = target.rpartition(".")
        if param != "weight":
            return
        try:
            layer = self.get_submodule(module_name)
        except AttributeError:
            return
        method = getattr(layer, "linear_method", None)
        if method is None or isinstance(method, UnquantizedLinearMethod) or hasattr(layer, "weight"):
            return
        module = name.removesuffix(".weight")
        raise ValueError(
            f"checkpoint tensor {name!r} is a 16-bit weight, but config.json's quantization_config quantizes "
            f"{module} (its ignore list does not name it): add the module to the ignore list (e.g. "
            "'re:.*router.*' for the MoE router), or use a checkpoint that stores it quantized"
        )

    def _is_shared_layer_kv(self, target: str, shard_id: ShardId | None) -> bool:
        parts = target.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
            return False
        attention = self.model.layers[int(parts[2])].self_attn
        return attention.shared and (shard_id in ("k", "v") or parts[4] in ("k_norm", "v_norm"))


def _checked_format(config: Any) -> Any:
    """The checkpoint's quantized format (None: 16-bit), once it is known to work: it leaves a MoE's
    experts 16-bit, and its group size fits every quantized layer (each refusal names the values and the
    fix)."""
    fmt = quant_format(config)
    refuse_quantized_experts(config, fmt)
    if fmt is not None:
        check_layer_shapes(fmt, config)
    return fmt


def _map_name(name: str) -> tuple[str, ShardId | None]:
    for module, (packed, shard_id) in _PACKED.items():
        marker = f".{module}."
        if marker in name:
            return name.replace(marker, f".{packed}."), shard_id
    return name, None


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The text model of a multimodal Gemma-4 checkpoint (config.json's text_config, flattened by
    gemma4_config.py; weights under model.language_model.). Image and audio input are not served."""
