"""Which int4 format a checkpoint is stored in, read from config.json's `quantization_config`, and every
refusal that can be made before a weight is loaded.

`--quantization` (vLLM's values) wins when given, but it must name the checkpoint's own method: fitserve
does not quantize while loading yet. `Int4Format` is what the loader needs: the tensor layout ("gptq",
"awq" or "pack-quantized"), the group size, symmetric or not, act order, the GPTQ v1 zero offset and the
modules left unquantized. The planner imports this module (planner/quantized_checkpoint.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fitserve.layers.quantization.quant_formats import (
    RUNS,
    awq_format,
    compressed_tensors_format,
    gptq_format,
)

__all__ = ["RUNS", "Int4Format", "checkpoint_quant_config", "int4_format", "check_layer_shapes"]

# --quantization values (vLLM's) -> the checkpoint quant_method family they name.
FLAG_FAMILIES: dict[str, str] = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
    "auto-round": "auto-round",
    "inc": "auto-round",
}
# Methods vLLM runs that fitserve does not run yet, with what to use instead.
NOT_YET: dict[str, str] = {
    "fp8": "fp8 weights",
    "fbgemm_fp8": "fp8 weights",
    "modelopt": "fp8 weights",
    "bitsandbytes": "bitsandbytes 4-bit",
    "bnb": "bitsandbytes 4-bit",
}
CLOSEST = (
    "the closest that runs is an int4 checkpoint of the model (GPTQ, AWQ, compressed-tensors "
    "pack-quantized W4A16 or AutoRound), served with no --quantization"
)


@dataclass(frozen=True)
class Int4Format:
    method: str  # the checkpoint's quant_method family: gptq, awq, compressed-tensors, auto-round
    layout: str  # tensor layout: "gptq", "awq" or "pack-quantized"
    group_size: int  # -1: one group per output row (per-channel)
    symmetric: bool
    act_order: bool  # g_idx tensors are stored (GPTQ desc_act, compressed-tensors actorder "group")
    zero_offset: int = 0  # GPTQ v1 checkpoints store z - 1
    ignore: tuple[str, ...] = ()  # module names or patterns ("re:...") left unquantized
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors: modules a scheme applies to

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        order = ", act order (g_idx)" if self.act_order else ""
        return f"{self.method} int4 ({self.layout} layout, {group}, {kind}{order})"

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint stores the linear module `module` (its checkpoint name, e.g.
        "model.layers.0.mlp.down_proj") quantized."""
        if module.split(".")[-1] == "lm_head" or "embed" in module:
            return False
        if any(_matches(pattern, module, self.method) for pattern in self.ignore):
            return False
        return any(target == "Linear" or _matches(target, module, self.method) for target in self.targets)


def _matches(pattern: str, module: str, method: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if method == "compressed-tensors":
        return module == pattern or module.endswith("." + pattern)
    return pattern in module  # AWQ / GPTQ / AutoRound lists hold name fragments


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """config.json's quantization_config as a dict, or None."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    return quant


def int4_format(hf_config: Any, flag: str | None = None) -> Int4Format | None:
    """The checkpoint's int4 format (None: not quantized, and no --quantization); ValueError naming the
    value, what fitserve runs and the fix when the format or the flag is one fitserve does not run."""
    raw = checkpoint_quant_config(hf_config)
    if flag is not None:
        _check_flag(flag, raw)
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method in ("gptq", "auto-round", "intel/auto-round"):
        family = "auto-round" if "auto-round" in method else "gptq"
        return gptq_format(raw, family)
    if method == "awq":
        return awq_format(raw)
    if method == "compressed-tensors":
        return compressed_tensors_format(raw)
    if method in NOT_YET:
        raise ValueError(
            f"not supported yet: a {NOT_YET[method]} checkpoint "
            f"(quantization_config.quant_method={method!r}); "
            f"{CLOSEST}"
        )
    raise ValueError(
        f"quantization_config.quant_method={method!r} is not a format fitserve runs ({RUNS}): use the "
        "model's "
        "unquantized release or one of those formats"
    )


def _check_flag(flag: str, raw: dict[str, Any] | None) -> None:
    key = flag.lower()
    if key in NOT_YET:
        raise ValueError(
            f"not supported yet: --quantization {flag} ({NOT_YET[key]}, quantized while loading); {CLOSEST}"
        )
    if key not in FLAG_FAMILIES:
        raise ValueError(
            f"--quantization {flag} is not a method fitserve runs: use one of {', '.join(FLAG_FAMILIES)} "
            "with a checkpoint quantized that way, or drop --quantization"
        )
    if raw is None:
        raise ValueError(
            f"--quantization {flag} needs a checkpoint quantized with {FLAG_FAMILIES[key]}, but "
            "config.json has "
            "no quantization_config: fitserve does not quantize while loading yet; drop --quantization, or "
            f"pass the model's {FLAG_FAMILIES[key]} release"
        )
    method = str(raw.get("quant_method", "")).lower()
    family = "auto-round" if "auto-round" in method else method
    if FLAG_FAMILIES[key] != family:
        raise ValueError(
            f"--quantization {flag} but the checkpoint is quantized with {method!r} (config.json's "
            f"quantization_config.quant_method): drop --quantization or set it to {family}"
        )


def check_layer_shapes(fmt: Int4Format, hf_config: Any) -> None:
    """ValueError when a quantized projection's input dim is not a multiple of the group size (or of the
    8 codes packed per int32), naming the layer, both numbers and the fix."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inputs = {
        "q_proj/k_proj/v_proj": (hidden, (heads + 2 * kv_heads) * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj/up_proj": (hidden, hf_config.intermediate_size),
        "down_proj": (hf_config.intermediate_size, hidden),
    }
    for names, (in_features, out_features) in inputs.items():
        if fmt.group_size != -1 and in_features % fmt.group_size:
            raise ValueError(
                f"group_size={fmt.group_size} does not divide {names}'s input dim {in_features}: the "
                f"checkpoint does not match config.json (a {fmt.method} group size must divide every "
                "quantized layer's input features); use a checkpoint quantized with a group size that does"
            )
        if in_features % 8 or out_features % 8:
            raise ValueError(
                f"{names} is {out_features} x {in_features}: int4 packing needs both dims to be multiples "
                "of 8; this checkpoint cannot be int4 packed"
            )
