"""Qwen3.5 / Qwen3.6 text models, dense and MoE: Qwen3_5(Moe)ForCausalLM and the text model of
Qwen3_5(Moe)ForConditionalGeneration (the published checkpoints, served as text).

A hybrid: most layers are Gated DeltaNet (linear_attention: a per-request recurrent state, no KV cache), every
fourth one gated softmax attention (full_attention: the paged KV cache); qwen3_5_delta_net.py and
qwen3_5_layers.py compute them, qwen3_5_decoder.py holds one of each kind with its MLP.
embed -> layers -> RMSNorm (1 + weight) -> LM head (untied unless tie_word_embeddings).

The DeltaNet states live in a RecurrentStatePool (worker/recurrent_state.py) that the model runner
allocates beside the KV cache (`allocate_recurrent_state`); the scheduler hands each running request a slot
(core/state_slots.py) that reaches the layers through the step's metadata: `state_slots`, the slots as a
device tensor split into decode rows and prompt pieces (built once per step, worker/step_inputs.py), which
the layers hand to the batched kernels (layers/gated_delta_rule.py). Prefix-cache snapshot copies run
outside the forward (`copy_states`, called by the model runner), so decode steps are captured in CUDA
graphs (worker/cuda_graphs.py: a static slots buffer, padded rows -1).

Weights: a ConditionalGeneration checkpoint keeps the text model under `model.language_model.`, read as
`model.`; the vision tower (`model.visual.`) and the multi-token-prediction layers (`mtp.`) are skipped
here, each with one log line: the MTP layers load into their own module (models/qwen3_5_mtp.py) when
--speculative-config method mtp runs them. MoE experts load from either the per-expert form
(`experts.<e>.gate_proj` ...) or the fused one (`experts.gate_up_proj`), an int4 checkpoint's per expert
(`experts.<e>.gate_proj.qweight` ...) into layers/moe_int4.py's experts.

MTP speculation (fitserve/spec_decode/mtp.py) reads the model's output hidden states (after the final
norm, what the LM head reads): `keep_output_hidden` makes every forward copy them into a fixed buffer.

Tensor parallel: every layer splits across the ranks (qwen3_5_layers.py and qwen3_5_delta_net.py say how);
each rank reads the whole checkpoint and keeps its part, and its state pool holds its heads' states only. A
--tensor-parallel-size that does not divide the attention heads or the DeltaNet key and value heads is
refused naming them.

Quantized checkpoints (config.json's quantization_config, or --quantization fp8 / bitsandbytes on a 16-bit
one): the linears take the format's method (qwen3_5_layers.py), their shapes checked before
building (quant_config.check_layer_shapes: a group size that does not divide a quantized layer's input is
refused naming the module). A MoE's experts run 16-bit or an int4 checkpoint's (without act order); a
format that would make them anything else is refused (qwen3_5_config.refuse_quantized_moe). The
checkpoint stores in_proj_qkv as one matrix; under tensor parallel a quantized method takes a rank's rows
one projection at a time, so each of its tensors is first cut into the q, k and v parts
(layers/quantization/fused_rows.py). k_proj and v_proj load as KvHeadsLinear's one shard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fitserve.distributed.parallel_state import tp
from fitserve.layers.attention.layer import Attention
from fitserve.layers.linear import PackedColumnLinear, ShardId, UnquantizedLinearMethod
from fitserve.layers.quantization.bnb_format import param_name as bnb_param_name
from fitserve.layers.quantization.fused_rows import fused_rows_pieces
from fitserve.layers.quantization.quant_config import check_layer_shapes, quant_format
from fitserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fitserve.models.cpu_offload import make_layers
from fitserve.models.expert_weights import check_quantized_experts_loaded, load_expert, load_quantized_expert
from fitserve.models.parameter_loads import ParameterLoads
from fitserve.models.qwen3_5_config import (
    delta_net_heads_per_rank,
    linear_layer_indices,
    refuse_quantized_moe,
)
from fitserve.models.qwen3_5_decoder import Qwen3_5DecoderLayer
from fitserve.models.qwen3_5_delta_net import GatedDeltaNet
from fitserve.models.qwen3_5_layers import KV_SHARD, PartialRope, Qwen3_5RMSNorm, rope_inv_freq

logger = logging.getLogger("fitserve")

VISION_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIXES = ("mtp.", "model.mtp.")
_PACKED: dict[str, tuple[str, ShardId]] = {
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
    ".self_attn.k_proj.": (".self_attn.k_proj.", KV_SHARD),
    ".self_attn.v_proj.": (".self_attn.v_proj.", KV_SHARD),
}
# a packed parameter's shard ids, by the packed module's marker
_SHARDS: dict[str, tuple[ShardId, ...]] = {
    ".gate_up_proj.": (0, 1),
    ".k_proj.": (KV_SHARD,),
    ".v_proj.": (KV_SHARD,),
}


class Qwen3_5Model(nn.Module):
    def __init__(self, config: Any, quant: Any = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = make_layers(config.num_hidden_layers, lambda i: Qwen3_5DecoderLayer(config, i, quant))
        self.norm = Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # MTP speculation: [rows, hidden] the output hidden states are copied into (None: not kept)
        self.output_hidden: torch.Tensor | None = None

    def keep_output_hidden(self, max_rows: int) -> torch.Tensor:
        """From now on every forward copies its output (after the final norm) into one preallocated
        [max_rows, hidden] buffer, row for row with the step's tokens: a copy inside the forward, so CUDA
        graphs captured after this call replay it (the engine builds the drafter before capturing). Rows
        past max_rows (a step larger than any the engine runs) are not kept."""
        weight = self.norm.weight
        self.output_hidden = torch.zeros(max_rows, weight.shape[0], dtype=weight.dtype, device=weight.device)
        return self.output_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = PartialRope(positions, self.inv_freq.float(), hidden.dtype)
        for layer in self.layers:
            hidden = layer(hidden, rope)
        out = self.norm(hidden)
        if self.output_hidden is not None:
            rows = min(out.shape[0], self.output_hidden.shape[0])
            self.output_hidden[:rows].copy_(out[:rows])
        return out


class Qwen3_5ForCausalLM(nn.Module):
    """`model(input_ids [T], positions [T]) -> hidden [T, hidden]` inside `forward_context`;
    `compute_logits(hidden) -> [N, vocab]`; `load_weights(...)` -> the parameters loaded."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        quant = _checked_format(config)
        self.config = config
        # read by the CUDA graphs (worker/cuda_graphs.py): DeltaNet layers keep per-request state
        # (core/state_slots.py); a checkpoint whose layers are all full attention keeps none
        self.has_recurrent_state = bool(linear_layer_indices(config))
        self.model = Qwen3_5Model(config, quant)
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tie_to=self.model.embed_tokens if tie else None
        )
        self.weights_prefix = getattr(config, "weights_prefix", "model.")
        self.state_pool: Any = None
        if getattr(config, "towers", None):
            logger.info("Qwen3.5: serving the text model only; the vision tower is not built or loaded")

    @property
    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not layer.is_linear]

    @property
    def delta_net_layers(self) -> list[GatedDeltaNet]:
        return [self.model.layers[i].linear_attn for i in linear_layer_indices(self.config)]

    def attach_state_pool(self, pool: Any) -> None:
        """Hands each DeltaNet layer its tensors of `pool` (worker/recurrent_state.py)."""
        self.state_pool = pool
        for layer, (conv, recurrent) in zip(self.delta_net_layers, pool.layer_states(), strict=True):
            layer.conv_states, layer.recurrent_states = conv, recurrent

    def copy_states(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Every DeltaNet layer's states of slots `sources` into slots `targets` (int64 device tensors,
        pairwise): the prefix-cache snapshot restores before a step's forward and saves after it, made by
        the model runner outside the forward (so a decode step's forward is capturable)."""
        if self.state_pool is not None and sources.numel():
            self.state_pool.copy_slots(sources, targets)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loads = ParameterLoads(self)
        experts: dict[str, set[tuple[int, str]]] = {}
        skipped = {"vision": 0, "mtp": 0}
        for name, tensor in weights:
            if name.startswith(VISION_PREFIXES):
                skipped["vision"] += 1
                continue
            if name.startswith(MTP_PREFIXES):
                skipped["mtp"] += 1
                continue
            if name.startswith(self.weights_prefix):
                name = "model." + name.removeprefix(self.weights_prefix)
            if name.startswith("lm_head.") and self.lm_head.tied:
                continue
            if ".mlp.experts." in name and (
                load_quantized_expert(self, name, tensor) or load_expert(self, name, tensor, loads, experts)
            ):
                continue
            name = bnb_param_name(name)  # bitsandbytes' dotted names (weight.absmax, ...) -> weight_absmax
            if self._load_merged_in_proj(name, tensor, loads):
                continue
            target, shard_id = _map_name(name)
            param = loads.param(name, target)
            if target.endswith(".conv_weight"):
                tensor = tensor.reshape(tensor.shape[0], -1)  # conv1d.weight [C, 1, K] -> [C, K]
            shards = next((ids for marker, ids in _SHARDS.items() if marker in target), ())
            fused = self._fused_quantized(target) if shard_id is None else None
            if fused is None:
                loads.load(name, target, tensor, shard_id, shards, param)
                continue
            for piece_id, piece in fused_rows_pieces(fused, target.rsplit(".", 1)[1], tensor):
                loads.load(name, target, piece, piece_id, fused.shard_ids, param)
        if skipped["vision"]:
            logger.info(
                "Skipped %d vision tower tensors: fitserve serves Qwen3.5's text model", skipped["vision"]
            )
        if skipped["mtp"]:
            logger.info(
                "Skipped %d multi-token-prediction (mtp.*) tensors here: they load only for "
                "--speculative-config method mtp, into the drafter",
                skipped["mtp"],
            )
        check_quantized_experts_loaded(self)
        return loads.loaded

    def _load_merged_in_proj(self, name: str, tensor: torch.Tensor, loads: ParameterLoads) -> bool:
        """A DeltaNet projection's weight (in_proj_qkv / _z / _b / _a) loaded into its parts of the layer's
        merged `in_proj` (16-bit checkpoints: GatedDeltaNet.merged_in_proj); False for any other tensor."""
        marker = ".linear_attn.in_proj_"
        if marker not in name or not name.endswith(".weight"):
            return False
        prefix, projection, _ = name.rsplit(".", 2)  # model.layers.<i>.linear_attn, in_proj_<x>, weight
        layer = self.get_submodule(prefix)
        if not layer.merged_in_proj:
            return False
        target = f"{prefix}.in_proj.weight"
        merged = layer.in_proj
        if projection == "in_proj_qkv":  # [q | k | v] rows, each part split by heads under TP
            sizes = [merged.full_shard_offsets[part][1] for part in "qkv"]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(
                    f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config's DeltaNet heads "
                    f"give q, k and v {sizes} = {sum(sizes)} rows"
                )
            pieces = zip("qkv", tensor.split(sizes))
        else:
            pieces = [(projection.removeprefix("in_proj_"), tensor)]
        for part, piece in pieces:
            loads.load(name, target, piece, part, merged.shard_ids)
        return True

    def _fused_quantized(self, target: str) -> PackedColumnLinear | None:
        """The layer of parameter `target` when it is a quantized packed layer that the checkpoint stores
        as one matrix (in_proj_qkv) and tensor parallel splits: its tensors load a projection at a time."""
        if tp().size == 1 or ".in_proj_qkv." not in target:
            return None
        layer = self.get_submodule(target.rsplit(".", 1)[0])
        if isinstance(layer.linear_method, UnquantizedLinearMethod):
            return None
        return layer


def _map_name(name: str) -> tuple[str, ShardId | None]:
    if name.endswith(".linear_attn.conv1d.weight"):
        return name.replace(".conv1d.weight", ".conv_weight"), None
    if ".mlp.experts." not in name:
        for marker, (packed, shard_id) in _PACKED.items():
            if marker in name:
                return name.replace(marker, packed), shard_id
    return name, None


def _checked_format(config: Any) -> Any:
    """The checkpoint's quantized format (None: 16-bit), once the model's sizes and the format are known to
    work: both DeltaNet head counts divide the ranks, a MoE's experts run the format, and the format's
    group size fits every quantized layer (each refusal names the values and the fix)."""
    delta_net_heads_per_rank(config, tp().size)  # both DeltaNet head counts must divide (names the sizes)
    fmt = quant_format(config)
    refuse_quantized_moe(config, fmt)
    if fmt is not None:
        check_layer_shapes(fmt, config)
    return fmt


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a multimodal Qwen3.5 checkpoint (text_config, flattened by qwen3_5_config.py;
    weights under model.language_model.). Image and video input are not served."""


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """The MoE variant: every layer's MLP is the sparse block with its shared expert."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForCausalLM):
    """The text model of a multimodal Qwen3.5 MoE checkpoint (Qwen3.6-35B-A3B)."""
