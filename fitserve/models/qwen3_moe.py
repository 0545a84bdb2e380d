"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's decoder with a sparse MLP.

Attention is Qwen3's (per-head q/k RMSNorm before RoPE, models/decoder_blocks.py). The MLP of layer i is
sparse unless i is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`, as
transformers' modeling_qwen3_moe.py decides it: a router (one linear, hidden -> num_experts), softmax in
float32, the top `num_experts_per_tok` experts, their probabilities renormalised over the k when
`norm_topk_prob` and rounded to the model dtype, then layers/moe.py's experts (no shared expert). On CUDA
the routing is one kernel (kernels/moe_router.py) and the experts run fused (kernels/fused_moe.py; a
decode step's few tokens through kernels/moe_decode.py), so decode steps are captured in CUDA graphs.

Tensor parallel splits each expert's intermediate size, or with --enable-expert-parallel the experts
(layers/moe.py); the router runs whole on every rank. Experts load from the per-expert checkpoint form or
transformers 5's fused one (models/expert_weights.py). An int4 checkpoint's experts (AWQ, GPTQ without act
order, compressed-tensors W4A16, AutoRound) run as int4 (layers/moe_int4.py, kernels/fused_moe_int4.py);
a format that would quantize them otherwise (fp8, bitsandbytes, --quantization) is refused before anything
is built (models/qwen3_moe_config.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.layers.linear import ReplicatedLinear
from fitserve.layers.quantization.layer_projections import moe_sparse_layer
from fitserve.layers.quantization.quant_config import quant_format
from fitserve.models.decoder_blocks import DecoderForCausalLM, DecoderSpec
from fitserve.models.expert_weights import check_quantized_experts_loaded, load_expert, load_quantized_expert
from fitserve.models.gemma4_config import expert_parallel_of
from fitserve.models.moe_experts_format import layer_experts
from fitserve.models.parameter_loads import ParameterLoads
from fitserve.models.qwen3_moe_config import refuse_quantized_experts


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act={config.hidden_act!r} is not supported for Qwen3-MoE: its experts run 'silu'"
            )
        hidden, num_experts = config.hidden_size, int(config.num_experts)
        self.top_k = int(config.num_experts_per_tok)
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.gate = ReplicatedLinear(hidden, num_experts, bias=False)
        self.experts = layer_experts(
            config, quant_format(config), layer_idx, F.silu, expert_parallel_of(config)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights float32 [T, k], expert ids [T, k]): the top k of the router's softmax,
        renormalised over the k when the config says so, each rounded to x's dtype."""
        scores = self.gate.forward(x)
        if x.is_cuda and self.renormalize:  # one kernel (it always renormalises)
            from fitserve.kernels.moe_router import router_topk

            return router_topk(scores, None, self.top_k, round_to_scores_dtype=True)
        probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype).float(), ids

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The MoE output [T, hidden]; reduce=False: this tensor-parallel rank's partial sum."""
        weights, ids = self.route(x)
        return self.experts.forward(x, ids, weights, reduce)


def _sparse_block(config: Any, layer_idx: int) -> nn.Module | None:
    return Qwen3MoeSparseBlock(config, layer_idx) if moe_sparse_layer(config, layer_idx) else None


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def __init__(self, config: Any) -> None:
        refuse_quantized_experts(config, quant_format(config))
        super().__init__(config)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, sparse_mlp=_sparse_block
        )

    def load_weights(self, weights: Any) -> set[str]:
        self._experts_seen: dict[str, set[tuple[int, str]]] = {}
        loaded = super().load_weights(weights)
        check_quantized_experts_loaded(self)
        return loaded

    def _load_own_form(self, loads: ParameterLoads, name: str, tensor: torch.Tensor) -> bool:
        """The per-expert tensors (`...mlp.experts.<e>.gate_proj.weight` ...) into the fused parameters, or
        an int4 checkpoint's (`....gate_proj.qweight` ...) into Int4FusedExperts; transformers 5's fused
        16-bit form loads by name."""
        if ".mlp.experts." not in name:
            return False
        if load_quantized_expert(self, name, tensor):
            return True
        return load_expert(self, name, tensor, loads, self._experts_seen)
