"""Each decoder layer's KV cache geometry, read from a model's (text) config.

Most models give every layer the same cache: `num_key_value_heads` heads of `head_dim`. Gemma-4 does not
(transformers' modeling_gemma4.py is the reference):

- `layer_types` mixes "sliding_attention" and "full_attention" layers. A sliding layer has `head_dim` and
  `num_key_value_heads`; a full layer has `global_head_dim`, and `num_global_key_value_heads` KV heads when
  `attention_k_eq_v` is set (otherwise `num_key_value_heads`, as the reference's config decides).
- `attention_k_eq_v`: full layers take their values from the key projection, but the values are normed
  differently (no scale, no rotation), so the cache still stores K and V: it saves weights, not cache.
- the last `num_kv_shared_layers` layers compute no keys or values: each reads the cache of the last
  earlier layer of its own type, and owns no cache.

The KV cache, the planner and the startup log all size the cache from `kv_layer_specs` (bytes per token
are the sum over the layers that own a cache of 2 x heads x head_dim x element bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
# Qwen3.5's Gated DeltaNet layers: per-request recurrent state (worker/recurrent_state.py), no KV cache
LINEAR = "linear_attention"
GEMMA4_MODEL_TYPES = ("gemma4", "gemma4_text")
QWEN3_5_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# The reference's default for a config that leaves global_head_dim out (Gemma4TextConfig.__post_init__).
GEMMA4_DEFAULT_GLOBAL_HEAD_DIM = 512


@dataclass(frozen=True)
class KvLayerSpec:
    """One decoder layer's attention cache: `cache_layer` is the layer whose cache it reads (itself unless
    it shares an earlier layer's); `sliding_window` None for full attention."""

    num_kv_heads: int
    head_dim: int
    cache_layer: int
    sliding_window: int | None = None
    layer_type: str = FULL

    def owns_cache(self, layer_idx: int) -> bool:
        return self.cache_layer == layer_idx


def is_gemma4(config: Any) -> bool:
    return str(getattr(config, "model_type", "")) in GEMMA4_MODEL_TYPES


def is_qwen3_5(config: Any) -> bool:
    """Qwen3.5 / Qwen3.6 (dense or MoE): Gated DeltaNet layers beside full attention (models/qwen3_5.py)."""
    return str(getattr(config, "model_type", "")) in QWEN3_5_MODEL_TYPES


def cuda_graphs_unsupported(model_type: str) -> str | None:
    """Why a model's steps cannot be captured in CUDA graphs yet (None: they can): the engine then runs
    them eagerly, and the planner reserves no graph memory for them."""
    return None


def gemma4_layer_types(config: Any) -> list[str]:
    """layer_types as the reference resolves them: 5 sliding then 1 full when absent; the last layer full."""
    num_layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(
            f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}: "
            "config.json must list one type per layer"
        )
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types holds {unknown}: fitserve runs {SLIDING!r} and {FULL!r} layers")
    if types and types[-1] != FULL:
        types[-1] = FULL  # the reference forces the last layer to full attention (with a warning)
    return types


def gemma4_kv_sources(config: Any, types: list[str]) -> list[int]:
    """For each layer, the layer whose keys and values it attends over (itself unless KV-shared)."""
    num_layers = len(types)
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared == 0:
        return list(range(num_layers))
    first_shared = num_layers - shared
    if shared < 0 or first_shared <= 0:
        raise ValueError(
            f"num_kv_shared_layers={shared} with {num_layers} layers leaves no layer to compute keys and "
            f"values: it must be between 0 and {num_layers - 1}"
        )
    last_of_type: dict[str, int] = {}
    for index in range(first_shared):
        last_of_type[types[index]] = index
    sources = list(range(first_shared))
    for index in range(first_shared, num_layers):
        if types[index] not in last_of_type:
            raise ValueError(
                f"layer {index} ({types[index]}) shares the KV cache of an earlier {types[index]} layer, but "
                f"none of the first {first_shared} layers is one: the config's layer_types and "
                "num_kv_shared_layers do not fit together"
            )
        sources.append(last_of_type[types[index]])
    return sources


def gemma4_layer_geometry(config: Any, layer_type: str) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a Gemma-4 layer of `layer_type`."""
    if layer_type == SLIDING:
        return int(config.num_key_value_heads), int(config.head_dim)
    head_dim = getattr(config, "global_head_dim", None) or GEMMA4_DEFAULT_GLOBAL_HEAD_DIM
    global_heads = getattr(config, "num_global_key_value_heads", None)
    if getattr(config, "attention_k_eq_v", False) and global_heads:
        return int(global_heads), int(head_dim)
    return int(config.num_key_value_heads), int(head_dim)


def gemma4_per_layer_overrides(config: Any) -> dict[int, dict[str, Any]]:
    """`per_layer_config` of a config re-saved by transformers >= 5.x ({"05": {"head_dim": 512,
    "num_key_value_heads": 2}, ...}: layer index -> the values that differ), which such files write in
    place of global_head_dim and num_global_key_value_heads; {} when absent."""
    raw = getattr(config, "per_layer_config", None)
    if not isinstance(raw, dict):
        return {}
    overrides = {}
    for key, values in raw.items():
        try:
            overrides[int(key)] = dict(values)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"per_layer_config has the entry {key!r}: {values!r}: each key must be a layer index and "
                "each value a dict of that layer's head_dim / num_key_value_heads"
            ) from error
    return overrides


def kv_layer_specs(config: Any) -> tuple[KvLayerSpec, ...]:
    """Every decoder layer's cache geometry (config: the text config of a multimodal model)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if is_qwen3_5(config):  # DeltaNet layers own no cache (cache_layer -1); full layers a plain one
        heads, head_dim = int(config.num_key_value_heads), int(config.head_dim)
        return tuple(
            KvLayerSpec(0, 0, -1, layer_type=LINEAR) if kind == LINEAR else KvLayerSpec(heads, head_dim, i)
            for i, kind in enumerate(config.layer_types)
        )
    if is_gemma4(config):
        types = gemma4_layer_types(config)
        sources = gemma4_kv_sources(config, types)
        window = getattr(config, "sliding_window", None)
        overrides = gemma4_per_layer_overrides(config)
        specs = []
        for index, kind in enumerate(types):
            if overrides:
                values = overrides.get(index, {})
                heads = int(values.get("num_key_value_heads", config.num_key_value_heads))
                head_dim = int(values.get("head_dim", config.head_dim))
            else:
                heads, head_dim = gemma4_layer_geometry(config, kind)
            specs.append(
                KvLayerSpec(heads, head_dim, sources[index], window if kind == SLIDING else None, kind)
            )
        return tuple(specs)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return tuple(KvLayerSpec(int(heads), int(head_dim), i) for i in range(config.num_hidden_layers))


def kv_elements_per_token(specs: tuple[KvLayerSpec, ...], tensor_parallel_size: int = 1) -> int:
    """K and V elements one token takes over the layers that own a cache, on one rank (a rank holds at
    least one KV head of each layer)."""
    total = 0
    for index, spec in enumerate(specs):
        if spec.owns_cache(index):
            total += 2 * max(1, spec.num_kv_heads // tensor_parallel_size) * spec.head_dim
    return total


def describe_kv_layers(specs: tuple[KvLayerSpec, ...], element_bytes: int) -> str:
    """'2 (K, V) x 36 layers x 8 KV heads x 128 x 2 bytes' for a uniform model; one term per group of
    alike layers otherwise ('12 sliding layers x 1 x 256 + 3 full layers x 1 x 512 ...; 20 KV-shared')."""
    owners = [spec for index, spec in enumerate(specs) if spec.owns_cache(index)]
    groups: dict[tuple[str, int, int], int] = {}
    for spec in owners:
        key = (spec.layer_type, spec.num_kv_heads, spec.head_dim)
        groups[key] = groups.get(key, 0) + 1
    linear = sum(1 for spec in specs if spec.layer_type == LINEAR)
    shared = len(specs) - len(owners) - linear
    if len(groups) == 1 and not shared and not linear:
        ((_, heads, head_dim), count) = next(iter(groups.items()))
        return f"2 (K, V) x {count} layers x {heads} KV heads x {head_dim} x {element_bytes} bytes"
    terms = [
        f"{count} {kind.removesuffix('_attention')} layers x {heads} KV heads x {head_dim}"
        for (kind, heads, head_dim), count in groups.items()
    ]
    text = f"2 (K, V) x {element_bytes} bytes x (" + " + ".join(terms) + ")"
    text += f"; {shared} KV-shared layers store none" if shared else ""
    return text + (f"; {linear} linear-attention layers keep recurrent state instead" if linear else "")
