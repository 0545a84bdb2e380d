"""Qwen3.5 / Qwen3.6's multi-token-prediction (MTP) layers, as their checkpoints store them (`mtp.*`) and as
vLLM's qwen3_5_mtp.py computes them.

One MTP step at position p reads the embedding of token p + 1 (the target's embedding table, shared) and
the target's output hidden state at p (after its final norm: what vLLM hands its MTP drafter), and
predicts token p + 2:

    x = fc([pre_fc_norm_embedding(embed) | pre_fc_norm_hidden(hidden)])   (2 x hidden -> hidden, no bias)
    x = mtp.layers.0(x)      (a full-attention decoder layer of the target's kind: gated q, q/k norms,
                              partial RoPE; the dense MLP, or the MoE block on the MoE models)
    out = mtp.norm(x)        -> the target's LM head gives the draft; `out` is the next step's hidden

All norms are Qwen3.5's RMSNorm times (1 + weight). The layer attends over its own paged KV cache (one
layer, cache index 0; fitserve/spec_decode/mtp.py holds it).

Quantized checkpoints: the MTP layers are usually left in 16 bits (compressed-tensors exports list
`re:.*mtp.*` in their ignore list); each linear takes the checkpoint format's method unless the ignore
list leaves it out under its stored name (`mtp.fc`, `mtp.layers.0.self_attn.q_proj`, ...).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitserve.layers.linear import LinearMethod, ReplicatedLinear
from fitserve.layers.quantization.bnb_format import param_name as bnb_param_name
from fitserve.layers.quantization.methods import linear_method_for
from fitserve.models.expert_weights import load_expert, load_quantized_expert
from fitserve.models.parameter_loads import ParameterLoads
from fitserve.models.qwen3_5 import _SHARDS, MTP_PREFIXES, _map_name
from fitserve.models.qwen3_5_config import FULL_ATTENTION
from fitserve.models.qwen3_5_decoder import Qwen3_5DecoderLayer
from fitserve.models.qwen3_5_layers import PartialRope, Qwen3_5RMSNorm, rope_inv_freq

# the model classes whose checkpoints carry MTP layers fitserve runs
MTP_ARCHITECTURES = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
# names only a quantized linear's tensors carry (int4 codes and scales, fp8 scales, bitsandbytes state)
_QUANTIZED_MARKERS = (
    ".weight_packed",
    ".qweight",
    ".scales",
    ".weight_scale",
    ".absmax",
    ".quant_map",
    ".quant_state",
)
# the tensors every MTP checkpoint has (beside the layer's own)
REQUIRED_MTP_KEYS = (
    "mtp.fc.",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.norm.weight",
    "mtp.layers.0.",
)


def mtp_layer_count(hf_config: Any) -> int:
    """config.json's mtp_num_hidden_layers (0 when absent)."""
    return int(getattr(hf_config, "mtp_num_hidden_layers", 0) or 0)


def runs_mtp(hf_config: Any) -> bool:
    """Whether the model is of a family whose MTP layers fitserve runs."""
    return any(a in MTP_ARCHITECTURES for a in getattr(hf_config, "architectures", None) or [])


def mtp_keys(files: Iterable[Path]) -> tuple[tuple[Path, ...], set[str]]:
    """The safetensors files holding `mtp.*` tensors and those tensors' names (headers only)."""
    holding, keys = [], set()
    for file in files:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            found = {k for k in json.loads(f.read(size)) if k.startswith("mtp.")}
        if found:
            holding.append(file)
            keys |= found
    return tuple(holding), keys


def missing_mtp_keys(keys: set[str]) -> list[str]:
    """The required MTP tensors (REQUIRED_MTP_KEYS, by prefix) not among `keys`."""
    return [k.rstrip(".") for k in REQUIRED_MTP_KEYS if not any(key.startswith(k) for key in keys)]


def stores_quantized(keys: Iterable[str]) -> bool:
    """Whether the checkpoint stores any MTP linear quantized (packed codes or scales beside it): else the
    layer is built in 16 bits whatever the format's ignore list says, as its tensors are."""
    return any(marker in key for key in keys for marker in _QUANTIZED_MARKERS)


def mtp_layer_config(config: Any) -> Any:
    """config as the MTP layer is built from it: a shallow copy with one full-attention layer whose
    checkpoint names start at `mtp.` (linear_method_of matches the ignore list against `mtp.layers.0...`)."""
    layer_config = copy.copy(config)
    layer_config.layer_types = [FULL_ATTENTION]
    layer_config.num_hidden_layers = 1
    layer_config.weights_prefix = "mtp."
    return layer_config


class Qwen3_5MultiTokenPredictor(nn.Module):
    """The checkpoint's `mtp.*` modules under their names less `mtp.` (fc, pre_fc_norm_embedding,
    pre_fc_norm_hidden, layers.0, norm). `forward(embeds, hidden, positions) -> out` inside the drafter's
    forward_context."""

    def __init__(self, config: Any, quant: Any = None) -> None:
        super().__init__()
        hidden, eps = int(config.hidden_size), config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps)
        fc_method: LinearMethod | None = linear_method_for(quant, "mtp.fc", ["mtp.fc"])
        self.fc = ReplicatedLinear(2 * hidden, hidden, bias=False, linear_method=fc_method)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(mtp_layer_config(config), 0, quant)])
        self.norm = Qwen3_5RMSNorm(hidden, eps)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """embeds [T, H] (token p + 1), hidden [T, H] (the target's output at p, or this module's own
        output of the step before) -> [T, H], normed: the LM head's input and the next step's hidden."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        rope = PartialRope(positions, self.inv_freq.float(), x.dtype)
        return self.norm(self.layers[0](x, rope))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads the `mtp.` tensors of `weights` (others are passed over); the parameters loaded."""
        loads = ParameterLoads(self)
        experts: dict[str, set[tuple[int, str]]] = {}
        for name, tensor in weights:
            if not name.startswith(MTP_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
                continue
            name = name.removeprefix("model.").removeprefix("mtp.")
            if ".mlp.experts." in name and (
                load_quantized_expert(self, name, tensor) or load_expert(self, name, tensor, loads, experts)
            ):
                continue
            name = bnb_param_name(name)
            target, shard_id = _map_name(name)
            shards = next((ids for marker, ids in _SHARDS.items() if marker in target), ())
            loads.load(name, target, tensor, shard_id, shards)
        return loads.loaded

    def initialize_dummy(self, seed: int) -> None:
        """Random weights (the target's --load-format dummy), drawn as the target's are."""
        from fitserve.models.weights import initialize_dummy_weights

        initialize_dummy_weights(self, seed + 5)
