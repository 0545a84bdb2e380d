"""The pre-norm decoder shared by the Llama, Mistral, Qwen2, Qwen3 and Qwen3-MoE families.

embed -> N x [RMSNorm -> attention (packed qkv, optional per-head q/k RMSNorm, RoPE) -> residual add ->
RMSNorm -> gated SiLU MLP -> residual add] -> RMSNorm -> LM head. A family differs only in its
`DecoderSpec` (which projections carry a bias, whether q/k are normalised, which layers' MLP is sparse).

Parameter names follow HF checkpoints, except that q/k/v live in one `qkv_proj` and gate/up in one
`gate_up_proj`; `load_weights` maps the checkpoint's names onto them through `packed_modules_mapping`.
An int4 checkpoint (config.json's quantization_config) gives the projections it quantizes an int4 linear
method (layers/quantization), whose parameters carry the checkpoint's names (qweight, scales, ...).

Pipeline parallel (distributed/pipeline.py): a stage builds only its range of decoder layers (the others
are parameterless `MissingLayer`s, so every name and index stays the checkpoint's), the first stage the
embedding, the last the final norm and the LM head (and the embedding too when the head is tied to it);
a stage after the first starts from the (hidden, residual) the one before sent, and a stage before the
last returns them instead of normalised hidden states.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fitserve.distributed.parallel_state import pp
from fitserve.distributed.pipeline import this_stage_layers
from fitserve.layers.activation import SiluAndMul
from fitserve.layers.attention.layer import Attention
from fitserve.layers.layernorm import RMSNorm
from fitserve.layers.linear import (
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    ShardId,
)
from fitserve.layers.quantization.bnb_format import param_name as bnb_param_name
from fitserve.layers.quantization.methods import linear_method_for
from fitserve.layers.quantization.quant_config import Int4Format, int4_format
from fitserve.layers.rotary_embedding import RotaryEmbedding, StepRope, rope_settings_from_config
from fitserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fitserve.models.cpu_offload import make_layers
from fitserve.models.parameter_loads import ParameterLoads


@dataclass(frozen=True)
class DecoderSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's dims of q and k, before RoPE
    # MoE families (models/qwen3_moe.py): (config, layer index) -> the layer's sparse MLP, or None where
    # the layer keeps the dense GatedMLP. Its forward(x, reduce) returns a partial sum with reduce=False,
    # as GatedMLP's does.
    sparse_mlp: Callable[[Any, int], nn.Module | None] | None = None


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_windows_of(config: Any) -> list[int | None]:
    """Each layer's attention window (None = full attention), as HF transformers decides it."""
    window = getattr(config, "sliding_window", None)
    num_layers = config.num_hidden_layers
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    first_sliding = getattr(config, "max_window_layers", 0) if hasattr(config, "use_sliding_window") else 0
    return [window if i >= first_sliding else None for i in range(num_layers)]


def quantized(
    fmt: Int4Format | None, prefix: str, layer: str, modules: tuple[str, ...]
) -> LinearMethod | None:
    """The linear method of `prefix`.`layer` (None: unquantized), fused from the checkpoint's `modules`."""
    return linear_method_for(fmt, f"{prefix}.{layer}", [f"{prefix}.{module}" for module in modules])


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        hidden_act: str,
        quant: Int4Format | None = None,
        prefix: str = "mlp",
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported: this decoder implements 'silu'")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size] * 2,
            bias=bias,
            linear_method=quantized(quant, prefix, "gate_up_proj", ("gate_proj", "up_proj")),
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias=bias,
            linear_method=quantized(quant, prefix, "down_proj", ("down_proj",)),
        )

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """Calls the sublayers' forward directly (see DecoderLayer); reduce=False: down_proj's partial sum
        (RowParallelLinear.forward)."""
        return self.down_proj.forward(self.act_fn.forward(self.gate_up_proj.forward(x)), reduce)


class DecoderAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: DecoderSpec,
        layer_idx: int,
        sliding_window: int | None,
        quant: Int4Format | None = None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}.self_attn"
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.num_heads,
            self.num_kv_heads,
            bias=spec.qkv_bias,
            linear_method=quantized(quant, prefix, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
        )
        # this rank's heads (all of them unless tensor parallel splits them: layers/tp_shards.py)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=spec.o_bias,
            linear_method=quantized(quant, prefix, "o_proj", ("o_proj",)),
        )
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_idx=layer_idx,
            sliding_window=sliding_window,
        )

    def _split(
        self, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[RMSNorm, RMSNorm] | None]:
        """The qkv projection's output -> q [T, heads, head_dim], k [T, kv_heads, head_dim], v, and the
        q/k norms (Qwen3) still to apply: they are normalised and rotated in the cache write's kernel
        where the backend can."""
        num_tokens = qkv.shape[0]
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        return q, k, v, qk_norm

    def attend(self, qkv: torch.Tensor, rope: StepRope) -> torch.Tensor:
        """The qkv projection's output -> attention's output (before o_proj)."""
        q, k, v, qk_norm = self._split(qkv)
        return self.attn.forward(q, k, v, rope, qk_norm)

    def forward(self, hidden: torch.Tensor, rope: StepRope, reduce: bool = True) -> torch.Tensor:
        """reduce=False: o_proj's partial sum (RowParallelLinear.forward)."""
        return self.o_proj.forward(self.attend(self.qkv_proj.forward(hidden), rope), reduce)

    def write_kv(self, hidden: torch.Tensor, rope: StepRope) -> torch.Tensor:
        """forward up to the attention core: the qkv projection, then k/v into the cache (rotated and
        normalised on the way). Returns q [T, heads, head_dim], ready for attn.attend_cached."""
        q, k, v, qk_norm = self._split(self.qkv_proj.forward(hidden))
        return self.attn.write_kv(q, k, v, rope, qk_norm)

    def forward_cpu(self, hidden: torch.Tensor, rope: StepRope, reduce: bool = True) -> torch.Tensor:
        """forward with rope tables (the CPU). Without q/k norms, q and k sit side by side in the qkv
        output, so one rotation covers both sets of heads: the same values as rotating each, in fewer
        ops."""
        if self.q_norm is not None:
            return self.forward(hidden, rope, reduce)
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        qk_size = self.qkv_proj.q_size + self.qkv_proj.kv_size
        qk = rope.rotate_(
            qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        )
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return self.o_proj.forward(self.attn.forward(q, k, qkv[:, qk_size:]), reduce)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        spec: DecoderSpec,
        layer_idx: int,
        sliding_window: int | None,
        quant: Int4Format | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, layer_idx, sliding_window, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sparse = spec.sparse_mlp(config, layer_idx) if spec.sparse_mlp is not None else None
        self.mlp = sparse or GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            spec.mlp_bias,
            config.hidden_act,
            quant,
            f"model.layers.{layer_idx}.mlp",
        )

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: StepRope, partial: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's (mlp output, residual stream); returns this layer's.

        partial=True: the mlp outputs, taken (unless residual is None: the embeddings) and returned, are
        this tensor-parallel rank's partial sums, before down_proj's all-reduce; the norm after each
        row-parallel layer sums them (RMSNorm.forward_sum: on GPUs the all-reduce, the residual add and
        the norm are one kernel). DecoderModel.forward's main loop runs so and sums the last layer's in
        its final norm.

        The sublayers' forward is called directly, not through nn.Module.__call__: steps that are not
        CUDA graphs (every CPU step, a GPU's prefill chunks) are bound by per-call host overheads, and
        __call__ is one of them (~1 ms of a ~21 ms SmolLM2 CPU step at batch 1). None of the sublayers
        carries hooks: --cpu-offload-gb hooks whole decoder layers, which are still called as modules.
        With rope tables (the CPU path) attention takes DecoderAttention.forward_cpu."""
        hidden, residual = self.norm_input(hidden, residual, partial)
        attend = self.self_attn.forward_cpu if rope.cos is not None else self.self_attn.forward
        return self.feed_forward(attend(hidden, rope, reduce=False), residual, partial)

    def norm_input(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, partial: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input RMSNorm, which adds hidden into the residual stream (the first layer starts that
        stream from the embeddings). Returns (normalised, residual). partial: hidden is the previous
        layer's mlp output before its all-reduce (forward)."""
        if residual is None:
            return self.input_layernorm.forward(hidden), hidden
        if partial:
            return self.input_layernorm.forward_sum(hidden, residual)
        return self.input_layernorm.forward(hidden, residual)

    def feed_forward(
        self, attention_partial: torch.Tensor, residual: torch.Tensor, partial: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj's output before its all-reduce -> (mlp output, residual): the post-attention RMSNorm
        (summing it over the ranks and adding it into the residual stream), then the MLP, whose output is
        returned before its all-reduce with partial (forward)."""
        hidden, residual = self.post_attention_layernorm.forward_sum(attention_partial, residual)
        return self.mlp.forward(hidden, reduce=not partial), residual


class MissingLayer(nn.Module):
    """A decoder layer another pipeline stage holds: no parameters, never run."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a decoder layer of another pipeline stage was run here: a fitserve bug")


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec) -> None:
        super().__init__()
        stage = pp()
        self.pipelined = stage.size > 1  # read once, as built: forward takes the stage path
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.embed_tokens = None
        if stage.is_first or (stage.is_last and tie):  # a tied LM head reads the embedding's matrix
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), rope_settings_from_config(config), config.max_position_embeddings
        )
        windows = sliding_windows_of(config)
        quant = int4_format(config)  # a quantized checkpoint's format (layers/quantization), else None
        self.start_layer, self.end_layer = this_stage_layers(config.num_hidden_layers)

        def build(i: int) -> nn.Module:
            if not self.start_layer <= i < self.end_layer:
                return MissingLayer()
            return DecoderLayer(config, spec, i, windows[i], quant)

        # make_layers: --cpu-offload-gb moves the first layers to CPU memory as they are built
        self.layers = make_layers(config.num_hidden_layers, build)
        # this stage's layers (all of them without pipeline parallel), in order; a tuple, not registered
        self.stage_layers = tuple(self.layers[self.start_layer : self.end_layer])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        # EAGLE-3 speculation (fitserve/spec_decode/eagle3/): {layer index: slot} of the residual
        # streams each forward copies into `aux_hidden` [rows, slots x hidden]; empty: nothing is kept.
        self.aux_slots: dict[int, int] = {}
        self.aux_hidden: torch.Tensor | None = None

    def keep_aux_hidden(self, layer_ids: tuple[int, ...], max_rows: int) -> torch.Tensor:
        """From now on, every forward copies the residual stream entering each layer of `layer_ids` (HF's
        `hidden_states[i]`: the output of layer i - 1; i = num_hidden_layers: the last layer's, before the
        final norm) into one preallocated [max_rows, len(layer_ids) x hidden] buffer, row for row with
        the step's tokens. A fixed buffer written inside the forward: CUDA graphs captured after this call
        replay the copies into it (capture after, as the engine does: the drafter is built before the
        graphs). Rows past max_rows (a step larger than any the engine runs) are not kept."""
        hidden_size = self.norm.weight.shape[0]
        weight = self.norm.weight
        self.aux_hidden = torch.zeros(
            max_rows, len(layer_ids) * hidden_size, dtype=weight.dtype, device=weight.device
        )
        self.aux_slots = {layer: slot for slot, layer in enumerate(layer_ids)}
        return self.aux_hidden

    def _keep_aux(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        slot = self.aux_slots.get(layer)
        if slot is None:
            return
        buffer = self.aux_hidden
        rows = min(hidden.shape[0], buffer.shape[0])
        width = hidden.shape[1]
        out = buffer[:rows, slot * width : (slot + 1) * width]
        if residual is None:  # the first layer's input: the embeddings
            out.copy_(hidden[:rows])
        else:
            torch.add(hidden[:rows], residual[:rows], out=out)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """hidden [T, hidden] after the final norm; with pipeline stages, a stage after the first starts
        from `intermediate` (the previous stage's (hidden, residual)) and one before the last returns its
        own (hidden, residual) instead."""
        if self.pipelined:
            return self._stage_forward(input_ids, positions, intermediate)
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.rope_for_step(positions, hidden.dtype)
        residual = None
        if self.aux_slots:  # a separate loop: a step without EAGLE-3 runs the one below, unchanged
            for index, layer in enumerate(self.layers):
                self._keep_aux(index, hidden, residual)
                hidden, residual = layer(hidden, residual, rope)
            self._keep_aux(len(self.layers), hidden, residual)
            hidden, _ = self.norm(hidden, residual)
            return hidden
        for layer in self.layers:  # each layer's mlp output stays a partial sum until the next norm
            hidden, residual = layer(hidden, residual, rope, partial=True)
        hidden, _ = self.norm.forward_sum(hidden, residual)
        return hidden

    def _stage_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Any:
        if intermediate is None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb.rope_for_step(positions, hidden.dtype)
        for layer in self.stage_layers:
            hidden, residual = layer(hidden, residual, rope)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def forward_in_pieces(
        self, input_ids: torch.Tensor, positions: torch.Tensor, q_out: torch.Tensor, attn_out: torch.Tensor
    ) -> Generator[Attention, None, torch.Tensor]:
        """forward (CUDA only), cut at each layer's attention core, so that each piece in between can be
        its own CUDA graph (worker/piecewise_graphs.py) while the cores, whose launch depends on the
        step's sequence lengths, run eagerly.

        A piece ends when a layer has written its keys and values into the cache: it copies the layer's
        q into q_out [T, heads, head_dim] and yields the layer's Attention. The caller then runs
        `attend_cached(q_out, out=attn_out)` and resumes the generator; the next piece starts from
        attn_out [T, heads, head_dim]. Returns the final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.rope_for_step(positions, hidden.dtype)
        residual = None
        attn_out_rows = attn_out.view(attn_out.shape[0], -1)
        for index, layer in enumerate(self.layers):
            if self.aux_slots:  # EAGLE-3: copied inside the piece before the core (see keep_aux_hidden)
                self._keep_aux(index, hidden, residual)
            partial = residual is not None and not self.aux_slots  # the mlp outputs' sums wait for the norms
            hidden, residual = layer.norm_input(hidden, residual, partial)
            q_out.copy_(layer.self_attn.write_kv(hidden, rope))
            yield layer.self_attn.attn
            attention_partial = layer.self_attn.o_proj.forward(attn_out_rows, reduce=False)
            hidden, residual = layer.feed_forward(attention_partial, residual, partial=not self.aux_slots)
        if self.aux_slots:
            self._keep_aux(len(self.layers), hidden, residual)
            hidden, _ = self.norm(hidden, residual)
            return hidden
        hidden, _ = self.norm.forward_sum(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """Base of the family classes: a family sets `decoder_spec(config)` and nothing else.

    `model(input_ids [T], positions [T]) -> hidden [T, hidden]` inside `forward_context`;
    `compute_logits(hidden [N, hidden]) -> [N, vocab]` (float32 on the CPU, the model dtype on CUDA);
    `load_weights((hf_name, tensor), ...) -> names of the parameters now fully loaded`.
    """

    # checkpoint module name -> (packed module name, shard id)
    packed_modules_mapping: dict[str, tuple[str, ShardId]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint tensors that are derived state, not parameters
    skipped_weight_suffixes: tuple[str, ...] = (
        "rotary_emb.inv_freq",
        "rotary_emb.cos_cached",
        "rotary_emb.sin_cached",
    )

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.decoder_spec(config))
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None  # on the last pipeline stage only
        if pp().is_last:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, tie_to=self.model.embed_tokens if tie else None
            )

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        raise NotImplementedError(f"{cls.__name__} must define decoder_spec(config)")

    @property
    def attention_layers(self) -> list[Attention]:
        """The attention of this stage's layers (every layer's without pipeline parallel)."""
        model = self.model
        return [layer.self_attn.attn for layer in model.layers[model.start_layer : model.end_layer]]

    @property
    def kv_scale_layers(self) -> list[Any]:
        """Indexed by decoder layer: where a checkpoint's KV cache scales go (models/weights.py
        take_kv_scales); a layer of another pipeline stage gets a stand-in that keeps them unused."""
        return [
            layer.self_attn.attn if isinstance(layer, DecoderLayer) else _UnusedScales()
            for layer in self.model.layers
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if intermediate is None:
            return self.model(input_ids, positions)
        return self.model(input_ids, positions, intermediate)

    def forward_in_pieces(
        self, input_ids: torch.Tensor, positions: torch.Tensor, q_out: torch.Tensor, attn_out: torch.Tensor
    ) -> Generator[Attention, None, torch.Tensor]:
        """DecoderModel.forward_in_pieces: forward cut at each attention core."""
        return self.model.forward_in_pieces(input_ids, positions, q_out, attn_out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loads = ParameterLoads(self)
        expected_shards: dict[str, set[ShardId]] = {}
        for packed, shard_id in self.packed_modules_mapping.values():
            expected_shards.setdefault(packed, set()).add(shard_id)
        for name, tensor in weights:
            if name.endswith(self.skipped_weight_suffixes) or not self._held_here(name):
                continue
            if self._load_own_form(loads, name, tensor):
                continue
            name = bnb_param_name(name)  # bitsandbytes' dotted names (weight.absmax, ...) -> weight_absmax
            if self.lm_head is not None and self.lm_head.tied and name.startswith("lm_head."):
                continue  # tied: the head reads the embedding, loaded under its own name
            target, packed, shard_id = self._map_checkpoint_name(name)
            loads.load(name, target, tensor, shard_id, expected_shards.get(packed, ()))
        return loads.loaded

    def _load_own_form(self, loads: ParameterLoads, name: str, tensor: torch.Tensor) -> bool:
        """A family's hook for checkpoint tensors it loads its own way (an MoE's per-expert tensors):
        True when it took `name`. The base family has none."""
        return False

    def _held_here(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a module this pipeline stage holds (always, without
        pipeline parallel)."""
        model = self.model
        if not model.pipelined:
            return True
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            return model.start_layer <= index < model.end_layer
        if name.startswith("model.embed_tokens."):
            return model.embed_tokens is not None
        if name.startswith("model.norm."):
            return model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def _map_checkpoint_name(self, name: str) -> tuple[str, str, ShardId | None]:
        """hf name -> (parameter name, packed module name or "", shard id or None)."""
        for module, (packed, shard_id) in self.packed_modules_mapping.items():
            marker = f".{module}."
            if marker in name:
                return name.replace(marker, f".{packed}."), packed, shard_id
        return name, "", None


class _UnusedScales:
    """Takes the KV cache scales of a layer another pipeline stage holds."""

    k_scale: float = 1.0
    v_scale: float = 1.0
