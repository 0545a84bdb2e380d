"""Gemma-4's decoder layer and its parts, computed as transformers' modeling_gemma4.py computes them.

- RMSNorm: x * (mean(x^2) + eps)^-0.5 in float32, times the weight as stored (Gemma-4 stores the scale
  itself, not the `1 + weight` of Gemma 1-3), cast back; v_norm and the router's norm carry no weight.
- Attention: q, k, v projections; per-head RMSNorm of q and k (and of v, unscaled), then RoPE on q and k;
  softmax scale 1.0 (the norms stand in for 1/sqrt(d)); no attention-logit softcapping. Full layers with
  `attention_k_eq_v` have no v_proj: the values are the key projection's output, v-normed, unrotated.
  KV-shared layers have only q_proj, q_norm and o_proj and attend over an earlier layer's cache.
- MLP: down(act(gate(x)) * up(x)) with gelu (tanh approximation); twice as wide on KV-shared layers when
  `use_double_wide_mlp`.
- MoE (`enable_moe_block`): beside the dense MLP, a router (unscaled RMSNorm of the residual, times `scale`
  and hidden^-0.5, a projection, softmax, top-k renormalised, times `per_expert_scale`) picks experts that
  run on the residual's own pre-norm; each branch has its post-norm and the two are added.
- Per-layer input (E models): gate(h) -> act -> times the layer's slice of the per-layer embedding ->
  projection -> norm, added to the residual stream. Every layer's output is scaled by `layer_scalar`.

Tensor parallel (rank r of n, layers/tp_shards.py): q heads are split; KV heads split, or replicated when
a layer type has fewer than n (sliding and full layers each by their own count); o_proj is row-parallel
over the whole num_attention_heads x head_dim. The dense MLP splits its intermediate dim and the MoE
experts their intermediate dim or (expert parallel) the experts themselves; on MoE layers the two
branches' partial outputs are all-reduced in one collective (each has its own post-norm, so they are
reduced side by side, not summed). The router and the per-layer-input gate and projection are
replicated: every rank needs their whole output (the softmax over all experts; the gate's product with
the whole per-layer input), and the per-layer pair is small enough that computing it on every rank is
cheaper than a collective per layer. Norms are replicated.

Quantized checkpoints (config.json's quantization_config, or --quantization fp8 / bitsandbytes on a 16-bit
one): each linear takes the format's method (layers/quantization/methods.py: int4, fp8 or bitsandbytes
4-bit), or none where the checkpoint's ignore list leaves it in 16 bits (`quantized_method`): q/k/v (the
shards a layer has), o_proj, the dense MLP, the per-layer input gate and projection, and the MoE router's
projection (published checkpoints list it in their ignore list: 16-bit then). The experts stay 16-bit
(models/gemma4.py refuses a format that quantizes them).

On CUDA the same values come from Triton kernels (imported there only; the CPU path is the torch above):
the norms as kernels/norm.py's gemma_rms_norm, each "residual + post-norm(x)" with the multiply by
layer_scalar and the next sublayer's input norm as one gemma_norm_add, gelu-and-multiply as one kernel,
and q/k norm + RoPE + cache write in the attention backend's fused kernel (rotary_cache_write.py; KV-shared
layers normalise and rotate q alone). No step reads a host value, so a CUDA graph can hold the forward
(the MoE experts aside: layers/moe.py). Roundings differ from torch's only where a kernel keeps float32
longer: the fused q/k norm rounds the normalised head before the weight (kernels/norm.py's Llama order),
and sums and products are taken in float32 and rounded once, as torch rounds each op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.distributed.collectives import all_reduce
from fitserve.distributed.parallel_state import tp
from fitserve.kv_layers import FULL, KvLayerSpec
from fitserve.layers.attention.layer import Attention
from fitserve.layers.attention.metadata import get_forward_context
from fitserve.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from fitserve.layers.quantization.methods import linear_method_for
from fitserve.layers.rotary_embedding import StepRope
from fitserve.models.gemma4_config import expert_parallel_of
from fitserve.models.moe_experts_format import GEMMA_EXPERTS, layer_experts

# Off switch for comparisons (tests/gpu/test_gemma4_kernels_gpu.py): False runs the torch path on CUDA too.
USE_KERNELS = True


def use_kernels(x: torch.Tensor) -> bool:
    """Whether x's ops take the Triton kernels (CUDA only: they import triton)."""
    return x.is_cuda and USE_KERNELS


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


def activation_of(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    name = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if name not in ACTIVATIONS:
        raise ValueError(
            f"hidden_activation={name!r} is not supported for Gemma-4: use one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


def quantized_method(quant: Any, config: Any, layer: str, modules: tuple[str, ...]) -> Any:
    """The linear method of fitserve's layer `model.<layer>` (None: unquantized) fused from the
    checkpoint's linear `modules` (names under the text model, e.g. "layers.3.self_attn.q_proj") for the
    format `quant`. The ignore list is matched against both the names the checkpoint gives them
    (`model.language_model.layers...` in a ConditionalGeneration checkpoint, as its quantization_config
    lists them) and the names they are read as (`model.layers...`): either leaving a module out keeps the
    layer 16-bit."""
    if quant is None:
        return None
    name = f"model.{layer}"
    stored = getattr(config, "weights_prefix", "model.")
    method = linear_method_for(quant, name, [stored + module for module in modules])
    if method is None or stored == "model.":
        return method
    if linear_method_for(quant, name, ["model." + module for module in modules]) is None:
        return None
    return method


def _parameter(shape: tuple[int, ...]) -> nn.Parameter:
    param = nn.Parameter(torch.ones(shape), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter((dim,)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x) and x.dim() in (2, 3) and x.stride(-1) == 1:
            from fitserve.kernels.norm import gemma_rms_norm

            return gemma_rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            normed = normed * self.weight.float()
        return normed.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, spec: KvLayerSpec, quant: Any = None) -> None:
        super().__init__()
        hidden, eps, bias = config.hidden_size, config.rms_norm_eps, bool(config.attention_bias)
        self.head_dim = spec.head_dim
        self.shared = not spec.owns_cache(layer_idx)
        self.k_eq_v = bool(config.attention_k_eq_v) and spec.layer_type == FULL
        shards = ("q",) if self.shared else ("q", "k") if self.k_eq_v else ("q", "k", "v")
        path = f"layers.{layer_idx}.self_attn"
        qkv = tuple(f"{path}.{shard}_proj" for shard in shards)
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            config.num_attention_heads,
            spec.num_kv_heads,
            bias,
            linear_method=quantized_method(quant, config, f"{path}.qkv_proj", qkv),
            shards=shards,
        )
        # this rank's heads (all of them unless tensor parallel splits them); a KV-shared layer's are those
        # of the layer whose cache it reads (same layer type, so the same split)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            hidden,
            bias=bias,
            linear_method=quantized_method(quant, config, f"{path}.o_proj", (f"{path}.o_proj",)),
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = None if self.shared else GemmaRMSNorm(self.head_dim, eps)
        self.v_norm = None if self.shared else GemmaRMSNorm(self.head_dim, eps, with_scale=False)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            1.0,
            self.num_kv_heads,
            layer_idx=layer_idx,
            sliding_window=spec.sliding_window,
            kv_cache_layer=spec.cache_layer,
        )
        # The Attention of each layer that reads this layer's cache (set by the model): a forward without
        # a cache hands them this layer's keys and values.
        self.kv_consumers: list[Attention] = []

    def forward(self, hidden: torch.Tensor, rope: StepRope) -> torch.Tensor:
        if rope.cos_sin_cache is not None:
            return self._forward_kernels(hidden, rope)
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        q = self.q_norm.forward(qkv[:, : self.q_size].reshape(num_tokens, self.num_heads, self.head_dim))
        q = rope.rotate_(q)
        if self.shared:
            return self.o_proj.forward(self.attn.forward(q, q, q))  # k and v: read from the shared cache
        assert self.k_norm is not None and self.v_norm is not None
        shape = (num_tokens, self.num_kv_heads, self.head_dim)
        k_proj = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(shape)
        v_proj = k_proj if self.k_eq_v else qkv[:, self.q_size + self.kv_size :].reshape(shape)
        k = rope.rotate_(self.k_norm.forward(k_proj))
        v = self.v_norm.forward(v_proj)
        if self.kv_consumers and get_forward_context().attn_metadata is None:
            for consumer in self.kv_consumers:
                consumer.shared_kv = (k, v)
        return self.o_proj.forward(self.attn.forward(q, k, v))

    def _forward_kernels(self, hidden: torch.Tensor, rope: StepRope) -> torch.Tensor:
        """forward on CUDA (rope: positions and a whole-head cos/sin table): q and k go to the attention
        layer unnormalised and unrotated with their norms, for the backend's fused kernel (q rotates in
        place inside the qkv output; k is normalised and rotated on its way into the cache)."""
        from fitserve.kernels.rotary_cache_write import norm_rotate_q

        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        q = qkv[:, : self.q_size].reshape(num_tokens, self.num_heads, self.head_dim)
        if self.shared:
            norm_rotate_q(rope.positions, q, rope.cos_sin_cache, (self.q_norm.weight, self.q_norm.eps))
            return self.o_proj.forward(self.attn.forward(q, q, q))  # k and v: read from the shared cache
        assert self.k_norm is not None and self.v_norm is not None
        shape = (num_tokens, self.num_kv_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(shape)
        v = self.v_norm.forward(k if self.k_eq_v else qkv[:, self.q_size + self.kv_size :].reshape(shape))
        if self.kv_consumers and get_forward_context().attn_metadata is None:
            # without a cache the KV-shared layers take this layer's keys as tensors: rotate them here
            q, k = rope.apply(self.q_norm.forward(q), self.k_norm.forward(k))
            for consumer in self.kv_consumers:
                consumer.shared_kv = (k, v)
            return self.o_proj.forward(self.attn.forward(q, k, v))
        qk_norm = (self.q_norm, self.k_norm)
        return self.o_proj.forward(self.attn.forward(q, k, v, rope, qk_norm))  # type: ignore[arg-type]


class Gemma4MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable,
        methods: tuple[Any, Any] = (None, None),
    ) -> None:
        """methods: the linear methods of gate_up_proj and down_proj (None: unquantized)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, linear_method=methods[0]
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=False, linear_method=methods[1]
        )
        self.activation = activation
        self.gelu_tanh = activation is ACTIVATIONS["gelu_pytorch_tanh"]  # one kernel on CUDA

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """[T, hidden]: the MLP's output (reduce=True), or this rank's partial sum of it (reduce=False:
        the caller all-reduces it)."""
        gate_up = self.gate_up_proj.forward(x)
        if use_kernels(gate_up) and self.gelu_tanh:
            from fitserve.kernels.activation import gelu_tanh_and_mul

            hidden = gelu_tanh_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = self.activation(gate) * up
        if reduce:
            return self.down_proj.forward(hidden)
        return self.down_proj.linear_method.apply(self.down_proj, hidden)


class Gemma4Router(nn.Module):
    def __init__(self, config: Any, proj_method: Any = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.top_k_experts)
        self.root_size = hidden**-0.5
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps, with_scale=False)
        # every rank routes every token over all the experts (the softmax and top-k need all scores)
        self.proj = ReplicatedLinear(hidden, config.num_experts, bias=False, linear_method=proj_method)
        self.scale = _parameter((hidden,))
        self.per_expert_scale = _parameter((config.num_experts,))
        self._norm_weight: torch.Tensor | None = None  # scale * root_size in float32 (kernel path)
        self._norm_weight_of = -1  # the scale's version it was computed from

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (top-k weights float32 [T, k], expert ids [T, k])."""
        if use_kernels(x) and x.dim() == 2 and x.stride(-1) == 1:
            return self._forward_kernels(x)
        scores = self.proj.forward(self.norm.forward(x) * self.scale * self.root_size)
        probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probabilities, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids

    def _forward_kernels(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """forward in three launches: the norm with norm_weight() as its weight, the projection, and
        route()."""
        from fitserve.kernels.norm import gemma_rms_norm

        return self.route(gemma_rms_norm(x, self.norm_weight(), self.norm.eps))

    def norm_weight(self) -> torch.Tensor:
        """scale * hidden^-0.5 in float32: the weight of one norm that stands for the unscaled norm and the
        two multiplies (rounded once where torch rounds after each). Computed on the first forward (the
        profiling run's, before any graph capture) and again after the scale changes."""
        if self._norm_weight is None or self._norm_weight_of != self.scale._version:
            self._norm_weight = self.scale.float() * self.root_size
            self._norm_weight_of = self.scale._version
        return self._norm_weight

    def route(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed input (CUDA) -> (weights, ids): the projection, then softmax + top-k + renormalise +
        per-expert scale in one kernel (kernels/moe_router.py)."""
        from fitserve.kernels.moe_router import router_topk

        return router_topk(self.proj.forward(normed), self.per_expert_scale, self.top_k)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, spec: KvLayerSpec, quant: Any = None) -> None:
        """quant: the checkpoint's quantized format (quant_config.quant_format), None for 16-bit."""
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        activation = activation_of(config)
        self.self_attn = Gemma4Attention(config, layer_idx, spec, quant)
        double_wide = bool(config.use_double_wide_mlp) and self.self_attn.shared
        layer = f"layers.{layer_idx}"

        def method(name: str, modules: tuple[str, ...]) -> Any:
            return quantized_method(quant, config, f"{layer}.{name}", tuple(f"{layer}.{m}" for m in modules))

        mlp_methods = (
            method("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
            method("mlp.down_proj", ("mlp.down_proj",)),
        )
        self.mlp = Gemma4MLP(
            hidden, config.intermediate_size * (2 if double_wide else 1), activation, mlp_methods
        )
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.layer_scalar = _parameter((1,))
        self.moe = bool(config.enable_moe_block)
        if self.moe:
            self.router = Gemma4Router(config, method("router.proj", ("router.proj",)))
            parallel = expert_parallel_of(config)
            self.experts = layer_experts(config, quant, layer_idx, activation, parallel, GEMMA_EXPERTS)
            self.post_feedforward_layernorm_1 = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = GemmaRMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = GemmaRMSNorm(hidden, eps)
        self.per_layer_size = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer_size:
            self.activation = activation
            # replicated: the gate's output meets the whole per-layer input (see the module docstring)
            self.per_layer_input_gate = ReplicatedLinear(
                hidden,
                self.per_layer_size,
                bias=False,
                linear_method=method("per_layer_input_gate", ("per_layer_input_gate",)),
            )
            self.per_layer_projection = ReplicatedLinear(
                self.per_layer_size,
                hidden,
                bias=False,
                linear_method=method("per_layer_projection", ("per_layer_projection",)),
            )
            self.post_per_layer_input_norm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, hidden: torch.Tensor, rope: StepRope, per_layer_input: torch.Tensor | None
    ) -> torch.Tensor:
        if use_kernels(hidden):
            return self._forward_kernels(hidden, rope, per_layer_input)
        residual = hidden
        hidden = self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), rope))
        hidden = residual + hidden
        residual = hidden
        if self.moe:
            weights, ids = self.router(residual)
            dense = self.mlp(self.pre_feedforward_layernorm(hidden), reduce=False)
            routed = self.experts(self.pre_feedforward_layernorm_2(residual), ids, weights, reduce=False)
            dense, routed = self._reduce_pair(dense, routed)
            hidden = self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(routed)
        else:
            hidden = self.mlp(self.pre_feedforward_layernorm(hidden))
        hidden = residual + self.post_feedforward_layernorm(hidden)
        if self.per_layer_size:
            assert per_layer_input is not None
            gated = self.activation(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar

    def _forward_kernels(
        self, hidden: torch.Tensor, rope: StepRope, per_layer_input: torch.Tensor | None
    ) -> torch.Tensor:
        """forward on CUDA: each residual add with the post-norm before it (and layer_scalar, and the
        next sublayer's input norm) in one gemma_norm_add; in a MoE layer the post-attention add with the
        three input norms of the block in one gemma_moe_head, the two post-norms, their sum and the residual
        add in one gemma_moe_tail (kernels/gemma_moe_norms.py); the same roundings as forward's torch ops
        but the router's input (rounded once)."""
        from fitserve.kernels.activation import gelu_tanh_mul
        from fitserve.kernels.gemma_moe_norms import gemma_moe_head, gemma_moe_tail
        from fitserve.kernels.norm import gemma_norm_add

        eps = self.input_layernorm.eps
        attention = self.self_attn.forward(self.input_layernorm.forward(hidden), rope)
        if self.moe:
            residual, dense_input, routed_input, router_input = gemma_moe_head(
                attention,
                hidden,
                self.post_attention_layernorm.weight,
                self.pre_feedforward_layernorm.weight,
                self.pre_feedforward_layernorm_2.weight,
                self.router.norm_weight(),
                eps,
            )
            weights, ids = self.router.route(router_input)
            dense = self.mlp.forward(dense_input, reduce=False)
            routed = self.experts(routed_input, ids, weights, reduce=False)
            dense, routed = self._reduce_pair(dense, routed)
            hidden = gemma_moe_tail(
                dense,
                routed.to(dense.dtype),
                residual,
                self.post_feedforward_layernorm_1.weight,
                self.post_feedforward_layernorm_2.weight,
                self.post_feedforward_layernorm.weight,
                eps,
                None if self.per_layer_size else self.layer_scalar,
            )
        else:
            normed, residual = gemma_norm_add(
                attention,
                hidden,
                self.post_attention_layernorm.weight,
                eps,
                next_weight=self.pre_feedforward_layernorm.weight,
            )
            assert normed is not None
            out = self.mlp.forward(normed)
            scalar = None if self.per_layer_size else self.layer_scalar
            _, hidden = gemma_norm_add(out, residual, self.post_feedforward_layernorm.weight, eps, scalar)
        if self.per_layer_size:
            assert per_layer_input is not None
            gate = self.per_layer_input_gate.forward(hidden)
            if self.mlp.gelu_tanh:
                gated = gelu_tanh_mul(gate, per_layer_input)
            else:
                gated = self.activation(gate) * per_layer_input
            projected = self.per_layer_projection.forward(gated)
            _, hidden = gemma_norm_add(
                projected, hidden, self.post_per_layer_input_norm.weight, eps, self.layer_scalar
            )
        return hidden

    @staticmethod
    def _reduce_pair(dense: torch.Tensor, routed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense MLP's and the experts' partial outputs, each summed over the ranks, in one all-reduce
        (side by side: each goes through its own post-norm before they are added, so their sum would not
        do)."""
        if tp().size == 1:
            return dense, routed
        both = all_reduce(torch.stack((dense, routed.to(dense.dtype))))
        return both[0], both[1]
