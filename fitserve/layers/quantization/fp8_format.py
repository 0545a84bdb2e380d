"""FP8 weights: which checkpoints and flags fitserve runs as fp8 (`Fp8Format`), read from config.json's
`quantization_config` or from `--quantization fp8`; every refusal names the value, what runs and the fix.

- compressed-tensors `float-quantized` (llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes): weights
  float8_e4m3fn with `weight_scale` per tensor ([1] or []), per channel ([N, 1]) or per block
  ([N/bn, K/bk]); input_activations null (weight-only), dynamic per token, or static per tensor
  (`input_scale`).
- quant_method "fp8" (HF transformers / vLLM FP8 checkpoints): `weight_block_size` [bn, bk] with block
  scales `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (DeepSeek / Qwen FP8 releases), else one per-tensor
  `weight_scale`; `activation_scheme` dynamic or static (`input_scale`); `modules_to_not_convert`.
- `--quantization fp8` on a 16-bit checkpoint: each projection quantized while it loads, per channel.

In every case w = fp8 value * scale (the scale multiplies; `weight_scale_inv` is named for the inverse
quantization step but holds the same multiplier).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FP8_RUNS = (
    "fp8 compressed-tensors float-quantized (num_bits 8, type float; strategy tensor, channel or block), "
    "quant_method fp8 (per-tensor or weight_block_size), and --quantization fp8 on a 16-bit checkpoint"
)
STRATEGIES = ("tensor", "channel", "block")


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "compressed-tensors" or "fp8" (the checkpoint's quant_method; "fp8" for the flag too)
    strategy: str  # weight scales: "tensor", "channel" or "block"
    block: tuple[int, int] | None = None  # (rows, columns) of a block, strategy "block"
    activations: str = "dynamic"  # "dynamic" (per token), "static" (per-tensor input_scale) or "none"
    quantize_on_load: bool = False  # --quantization fp8 on a 16-bit checkpoint
    ignore: tuple[str, ...] = ()  # module names or patterns ("re:...") left unquantized
    targets: tuple[str, ...] = ("Linear",)

    @property
    def scale_name(self) -> str:
        """The checkpoint's weight scale tensor: block scales of quant_method fp8 are `weight_scale_inv`."""
        return "weight_scale_inv" if self.method == "fp8" and self.strategy == "block" else "weight_scale"

    def describe(self) -> str:
        scales = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.strategy}"
        acts = {"none": "weight-only", "dynamic": "dynamic per-token activations"}.get(
            self.activations, "static per-tensor activation scales"
        )
        source = "quantized while loading" if self.quantize_on_load else f"{self.method} checkpoint"
        return f"fp8 e4m3 weights ({source}, {scales} scales, {acts})"

    def quantizes(self, module: str) -> bool:
        """Whether the linear module `module` (checkpoint name) holds fp8 weights."""
        if module.split(".")[-1] == "lm_head" or "embed" in module:
            return False
        if any(_matches(pattern, module, self.method) for pattern in self.ignore):
            return False
        return any(target == "Linear" or _matches(target, module, self.method) for target in self.targets)


def _matches(pattern: str, module: str, method: str) -> bool:
    """compressed-tensors: a module name, a suffix of one or "re:" + a regex; HF's modules_to_not_convert:
    a fragment of the name (transformers tests `pattern in name`)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if method == "compressed-tensors":
        return module == pattern or module.endswith("." + pattern)
    return pattern in module


def on_load_format() -> Fp8Format:
    """--quantization fp8 on a 16-bit checkpoint: per-channel weight scales, dynamic per-token activations."""
    return Fp8Format(method="fp8", strategy="channel", quantize_on_load=True)


def hf_fp8_format(raw: dict[str, Any]) -> Fp8Format:
    """quant_method "fp8" (transformers' FineGrainedFP8 / vLLM's serialized fp8)."""
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(
            f"fp8 quantization_config.fmt={fmt!r}: fitserve runs float8 e4m3 weights (fmt e4m3); use an "
            "e4m3 fp8 checkpoint of the model"
        )
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ValueError(
            f"fp8 activation_scheme={scheme!r}: fitserve runs activation_scheme dynamic or static; use a "
            "checkpoint with one of them"
        )
    block = raw.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise ValueError(
                f"fp8 weight_block_size={block!r}: fitserve runs two positive sizes [rows, columns] (e.g. "
                "[128, 128]); fix config.json's quantization_config"
            )
        if scheme == "static":
            raise ValueError(
                "fp8 weight_block_size with activation_scheme 'static': block-wise fp8 checkpoints quantize "
                "activations dynamically; set activation_scheme to dynamic"
            )
    ignore = list(raw.get("modules_to_not_convert") or raw.get("ignored_layers") or [])
    return Fp8Format(
        method="fp8",
        strategy="block" if block else "tensor",
        block=(int(block[0]), int(block[1])) if block else None,
        activations=scheme,
        ignore=tuple(ignore),
    )


def compressed_tensors_fp8_format(raw: dict[str, Any]) -> Fp8Format:
    """compressed-tensors float-quantized (or naive-quantized with float weights)."""
    groups = raw.get("config_groups") or {}
    if not groups:
        raise ValueError(
            "compressed-tensors float-quantized checkpoint without config_groups: fitserve needs its weight "
            "scheme (num_bits, strategy); the checkpoint's config.json is incomplete, download it again"
        )
    schemes = set()
    targets: list[str] = []
    for name, group in groups.items():
        weights = group.get("weights") or {}
        bits, kind = weights.get("num_bits"), str(weights.get("type", "int"))
        if bits != 8 or kind != "float":
            raise ValueError(
                f"compressed-tensors {name} weights num_bits={bits} type={kind!r} in a float-quantized "
                "checkpoint: fitserve runs fp8 weights (num_bits 8, type float); use an FP8 checkpoint"
            )
        if not weights.get("symmetric", True):
            raise ValueError(
                f"compressed-tensors {name} fp8 weights symmetric=false: fitserve runs symmetric fp8 "
                "weights (no zero point); use an FP8 / FP8_DYNAMIC checkpoint"
            )
        strategy = str(weights.get("strategy", "tensor"))
        if strategy not in STRATEGIES:
            raise ValueError(
                f"compressed-tensors {name} fp8 weights strategy={strategy!r}: fitserve runs strategy "
                f"{', '.join(STRATEGIES)}; use a checkpoint quantized with one of them"
            )
        block = weights.get("block_structure") if strategy == "block" else None
        if strategy == "block" and not (isinstance(block, list | tuple) and len(block) == 2):
            raise ValueError(
                f"compressed-tensors {name} strategy block with block_structure={block!r}: fitserve needs "
                "[rows, columns] (e.g. [128, 128]); fix config.json's quantization_config"
            )
        schemes.add((strategy, tuple(block) if block else None, _activations(name, group)))
        targets += list(group.get("targets") or ["Linear"])
    if len(schemes) != 1:
        raise ValueError(
            f"compressed-tensors config_groups hold {len(schemes)} different fp8 schemes: fitserve runs one "
            "fp8 scheme for every quantized layer; use a uniform FP8 checkpoint"
        )
    strategy, block, activations = schemes.pop()
    return Fp8Format(
        method="compressed-tensors",
        strategy=strategy,
        block=(int(block[0]), int(block[1])) if block else None,
        activations=activations,
        ignore=tuple(raw.get("ignore") or ()),
        targets=tuple(targets),
    )


def _activations(name: str, group: dict[str, Any]) -> str:
    if group.get("output_activations"):
        raise ValueError(
            f"compressed-tensors {name} quantizes output activations: fitserve runs fp8 weights with "
            "input activations only; use an FP8 or FP8_DYNAMIC checkpoint"
        )
    acts = group.get("input_activations")
    if not acts:
        return "none"
    bits, kind, strategy = acts.get("num_bits"), str(acts.get("type", "int")), acts.get("strategy")
    if bits != 8 or kind != "float":
        raise ValueError(
            f"compressed-tensors {name} input_activations num_bits={bits} type={kind!r}: fitserve runs fp8 "
            "activations (num_bits 8, type float) or none; use an FP8 or FP8_DYNAMIC checkpoint"
        )
    if acts.get("dynamic") and strategy in ("token", "tensor", "group"):
        return "dynamic"  # fitserve quantizes each token's row (finer than per tensor or group)
    if not acts.get("dynamic") and strategy == "tensor":
        return "static"
    raise ValueError(
        f"compressed-tensors {name} input_activations strategy={strategy!r} dynamic={acts.get('dynamic')}: "
        "fitserve runs dynamic per-token or static per-tensor fp8 activations; use an FP8 or FP8_DYNAMIC "
        "checkpoint"
    )
