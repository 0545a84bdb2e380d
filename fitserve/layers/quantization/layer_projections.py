"""The projections of the models whose layers differ one from another, sized from config.json alone, by the
module names their checkpoints give them: Gemma-4 (sliding and full layers with their own head dims and KV
heads, K = V full layers, KV-shared layers, the E models' per-layer inputs) and Qwen3.5 / Qwen3.6 (gated
attention and Gated DeltaNet layers). The checks made before loading a quantized checkpoint and the bytes
its format stores (the planner's count without weight files) read them; the planner's parameter counts
are in planner/gemma4_shape.py and qwen3_5_shape.py.
"""

from __future__ import annotations

from typing import Any

from fitserve.kv_layers import FULL, kv_layer_specs
from fitserve.layers.quantization.projection_shapes import fused_projection_shapes, projection_shapes


def is_gemma4(config: Any) -> bool:
    """A Gemma-4 text config as gemma4_config.py flattens it."""
    return str(getattr(config, "model_type", "")) == "gemma4_text"


def gemma4_projections(config: Any, fused: bool = False) -> dict[str, tuple[int, int]]:
    """Every linear that a quantized checkpoint may store quantized, the MoE's experts one by one, by the
    module name the checkpoint gives it (under `weights_prefix`: `model.language_model.` for the
    ConditionalGeneration form) -> (in_features, out_features). `fused`: q/k/v and gate/up as the one
    layer fitserve fuses each into, keyed by q_proj's and gate_proj's names."""
    specs = kv_layer_specs(config)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
    prefix = getattr(config, "weights_prefix", "model.")
    k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
    shapes: dict[str, tuple[int, int]] = {}
    for index, spec in enumerate(specs):
        layer = f"{prefix}layers.{index}."
        shared = not spec.owns_cache(index)
        q, kv = heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        kv_names = (
            () if shared else ("k_proj",) if k_eq_v and spec.layer_type == FULL else ("k_proj", "v_proj")
        )
        if fused:
            shapes[f"{layer}self_attn.q_proj"] = (hidden, q + kv * len(kv_names))
        else:
            shapes[f"{layer}self_attn.q_proj"] = (hidden, q)
            shapes.update({f"{layer}self_attn.{name}": (hidden, kv) for name in kv_names})
        shapes[f"{layer}self_attn.o_proj"] = (q, hidden)
        double = bool(getattr(config, "use_double_wide_mlp", False)) and shared
        inter = int(config.intermediate_size) * (2 if double else 1)
        if fused:
            shapes[f"{layer}mlp.gate_proj"] = (hidden, 2 * inter)
        else:
            shapes[f"{layer}mlp.gate_proj"] = shapes[f"{layer}mlp.up_proj"] = (hidden, inter)
        shapes[f"{layer}mlp.down_proj"] = (inter, hidden)
        if per_layer:
            shapes[f"{layer}per_layer_input_gate"] = (hidden, per_layer)
            shapes[f"{layer}per_layer_projection"] = (per_layer, hidden)
        if getattr(config, "enable_moe_block", False):
            shapes[f"{layer}router.proj"] = (hidden, int(config.num_experts))
            width = int(config.moe_intermediate_size)
            for expert in range(int(config.num_experts)):
                experts = _gated_mlp(f"{layer}experts.{expert}.", hidden, width)
                shapes.update(_fused_gate_up(experts) if fused else experts)  # as layers/moe_int4.py packs
    if per_layer:
        shapes[f"{prefix}per_layer_model_projection"] = (hidden, int(config.num_hidden_layers) * per_layer)
    return shapes


def gemma4_quantized(fmt: Any, config: Any, fused: bool = False) -> dict[str, tuple[int, int]]:
    """The projections (gemma4_projections) that the quantized format `fmt` holds quantized: those its
    ignore list leaves out under neither the checkpoint's name nor the name fitserve reads it as
    (`model.layers...`), as the model decides."""
    prefix = getattr(config, "weights_prefix", "model.")
    return {
        name: shape
        for name, shape in gemma4_projections(config, fused).items()
        if fmt.quantizes(name) and fmt.quantizes("model." + name.removeprefix(prefix))
    }


def is_qwen3_5(config: Any) -> bool:
    """A Qwen3.5 / Qwen3.6 text config as qwen3_5_config.py flattens it (dense or MoE)."""
    return str(getattr(config, "model_type", "")) in ("qwen3_5_text", "qwen3_5_moe_text")


def qwen3_5_projections(config: Any) -> dict[str, tuple[int, int]]:
    """Every linear of the decoder layers that a quantized checkpoint may store quantized, by the module name
    the checkpoint gives it (under `weights_prefix`: `model.language_model.layers.<i>...` for the
    ConditionalGeneration form, as its quantization_config's ignore list names them) -> (in_features,
    out_features). A MoE's shared expert and each of its experts one by one (its router and the shared
    expert's one-output gate stay 16-bit: models/qwen3_5_layers.py)."""
    hidden, head_dim = int(config.hidden_size), int(config.head_dim)
    heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads) * int(config.head_dim)
    key_size = int(config.linear_num_key_heads) * int(config.linear_key_head_dim)
    value_heads = int(config.linear_num_value_heads)
    value_size = value_heads * int(config.linear_value_head_dim)
    prefix = f"{getattr(config, 'weights_prefix', 'model.')}layers."
    full = {
        "self_attn.q_proj": (hidden, 2 * heads * head_dim),  # query and gate
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (heads * head_dim, hidden),
    }
    delta_net = {
        "linear_attn.in_proj_qkv": (hidden, 2 * key_size + value_size),
        "linear_attn.in_proj_z": (hidden, value_size),
        "linear_attn.in_proj_b": (hidden, value_heads),
        "linear_attn.in_proj_a": (hidden, value_heads),
        "linear_attn.out_proj": (value_size, hidden),
    }
    if getattr(config, "num_experts", None):  # the shared expert and each routed expert
        shared, width = int(config.shared_expert_intermediate_size), int(config.moe_intermediate_size)
        mlp = _gated_mlp("mlp.shared_expert.", hidden, shared)
        for expert in range(int(config.num_experts)):
            mlp.update(_gated_mlp(f"mlp.experts.{expert}.", hidden, width))
    else:
        mlp = _gated_mlp("mlp.", hidden, int(config.intermediate_size))
    shapes: dict[str, tuple[int, int]] = {}
    for index, kind in enumerate(config.layer_types):
        for suffix, shape in {**(full if kind == "full_attention" else delta_net), **mlp}.items():
            shapes[f"{prefix}{index}.{suffix}"] = shape
    return shapes


def _gated_mlp(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, int]]:
    """A gated MLP's three projections under `prefix` (`mlp.`, `mlp.shared_expert.`, `mlp.experts.<e>.`)."""
    return {
        f"{prefix}gate_proj": (hidden, width),
        f"{prefix}up_proj": (hidden, width),
        f"{prefix}down_proj": (width, hidden),
    }


def qwen3_5_fused_projections(config: Any) -> dict[str, tuple[int, int]]:
    """qwen3_5_projections with each gate_proj and up_proj as the one layer fitserve fuses them into (keyed
    by gate_proj's name; an int4 expert's gate and up rows are packed together too, layers/moe_int4.py): the
    layers an int4 GPU form repacks one by one."""
    return _fused_gate_up(qwen3_5_projections(config))


def _fused_gate_up(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """`shapes` with each gate_proj and its up_proj (same width) as one layer of twice the rows, keyed by
    gate_proj's name."""
    fused: dict[str, tuple[int, int]] = {}
    for name, (in_features, out_features) in shapes.items():
        if name.endswith(".up_proj"):
            continue
        if name.endswith(".gate_proj"):
            out_features *= 2
        fused[name] = (in_features, out_features)
    return fused


def qwen3_5_quantized(fmt: Any, config: Any, fused: bool = False) -> dict[str, tuple[int, int]]:
    """The projections (qwen3_5_projections, or qwen3_5_fused_projections when `fused`) that the quantized
    format `fmt` holds quantized: those its ignore list leaves out under neither the checkpoint's name nor
    the name fitserve reads it as (`model.layers...`), as the model decides (models/qwen3_5_layers.py
    linear_method_of)."""
    shapes = qwen3_5_fused_projections(config) if fused else qwen3_5_projections(config)
    prefix = getattr(config, "weights_prefix", "model.")
    return {
        name: shape
        for name, shape in shapes.items()
        if fmt.quantizes(name) and fmt.quantizes("model." + name.removeprefix(prefix))
    }


def is_qwen3_moe(config: Any) -> bool:
    return str(getattr(config, "model_type", "")) == "qwen3_moe"


def moe_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` of a MoE config has the sparse MLP, as transformers builds it: a
    Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step` keep the layers they name dense (Mixtral has
    neither: every layer is sparse)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    experts = int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)
    return (
        experts > 0
        and layer_idx not in (getattr(config, "mlp_only_layers", None) or ())
        and (layer_idx + 1) % step == 0
    )


def qwen3_moe_quantized(fmt: Any, config: Any, fused: bool = False) -> dict[str, tuple[int, int]]:
    """A Qwen3-MoE's projections that `fmt` holds quantized, name -> (in_features, out_features): each
    layer's attention, a dense layer's MLP, a sparse layer's experts one by one (gate and up as one
    `gate_up_proj` of 2 I rows when `fused`, as layers/moe_int4.py packs them)."""
    shapes = fused_projection_shapes(config) if fused else projection_shapes(config)
    hidden, width = config.hidden_size, int(config.moe_intermediate_size)
    experts = (
        {"gate_up_proj": (hidden, 2 * width)}
        if fused
        else {"gate_proj": (hidden, width), "up_proj": (hidden, width)}
    )
    experts["down_proj"] = (width, hidden)
    quantized: dict[str, tuple[int, int]] = {}
    for layer in range(int(config.num_hidden_layers)):
        sparse = moe_sparse_layer(config, layer)
        for suffix, shape in shapes.items():
            name = f"model.layers.{layer}.{suffix}"
            if not (sparse and suffix.startswith("mlp.")) and fmt.quantizes(name):
                quantized[name] = shape
        if not sparse or not fmt.quantizes(f"model.layers.{layer}.mlp.experts.0.gate_proj"):
            continue
        for expert in range(int(config.num_experts)):
            for projection, shape in experts.items():
                quantized[f"model.layers.{layer}.mlp.experts.{expert}.{projection}"] = shape
    return quantized
