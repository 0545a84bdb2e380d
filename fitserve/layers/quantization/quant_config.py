"""Which quantized format a checkpoint is stored in, read from config.json's `quantization_config`, and
every refusal that can be made before a weight is loaded.

`quant_format` returns a format object, `Int4Format` or `Fp8Format` (fp8_format.py), or None; the
linear method of each layer is picked by its type (methods.py). `--quantization` (vLLM's values) wins
when given; it must name the checkpoint's own method, except `fp8` on a 16-bit checkpoint, which is
quantized while loading. `int4_format` is the older name of `quant_format`.

`Int4Format` is what the loader needs: the tensor layout ("gptq",
"awq" or "pack-quantized"), the group size, symmetric or not, act order, the GPTQ v1 zero offset and the
modules left unquantized. The planner imports this module (planner/quantized_checkpoint.py).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from fitserve.layers.quantization.bnb_format import (
    BnbFormat,
    bnb_format,
    check_bnb_flag,
    check_bnb_layer_shapes,
    quantize_while_loading_format,
)
from fitserve.layers.quantization.fp8_format import (
    Fp8Format,
    compressed_tensors_fp8_format,
    hf_fp8_format,
    on_load_format,
)
from fitserve.layers.quantization.quant_formats import (
    RUNS,
    awq_format,
    compressed_tensors_format,
    gptq_format,
)

__all__ = [
    "RUNS",
    "Int4Format",
    "Fp8Format",
    "checkpoint_quant_config",
    "quant_format",
    "int4_format",
    "check_layer_shapes",
]
# The attribute of a model's hf_config that carries --quantization to model construction
# (models/loader.py sets it on a copy; quant_format reads it when no flag is passed).
QUANTIZATION_FLAG_ATTR = "fitserve_quantization"

# --quantization values (vLLM's) -> the checkpoint quant_method family they name.
FLAG_FAMILIES: dict[str, str] = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
    "auto-round": "auto-round",
    "inc": "auto-round",
    "fp8": "fp8",
    "bitsandbytes": "bitsandbytes",
    "bnb": "bitsandbytes",
}
# Methods vLLM runs that fitserve does not run yet, with what to use instead.
NOT_YET: dict[str, str] = {
    "fbgemm_fp8": "fbgemm fp8 weights",
    "modelopt": "ModelOpt fp8 weights",
}
CLOSEST = (
    "the closest that runs is an int4 checkpoint of the model (GPTQ, AWQ, compressed-tensors "
    "pack-quantized W4A16 or AutoRound) or an fp8 one (compressed-tensors float-quantized or quant_method "
    "fp8), served with no --quantization, or --quantization fp8 on the 16-bit checkpoint"
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


def quant_format(hf_config: Any, flag: str | None = None) -> Int4Format | Fp8Format | None:
    """The checkpoint's quantized format (None: not quantized, and no --quantization); ValueError naming
    the value, what fitserve runs and the fix when the format or the flag is one fitserve does not run.
    `flag` defaults to the one models/loader.py attaches to hf_config (QUANTIZATION_FLAG_ATTR)."""
    raw = checkpoint_quant_config(hf_config)
    if flag is None:
        flag = getattr(hf_config, QUANTIZATION_FLAG_ATTR, None)
    if flag is not None:
        _check_flag(flag, raw)
    if raw is None and flag is not None and FLAG_FAMILIES.get(flag.lower()) == "bitsandbytes":
        return quantize_while_loading_format()  # nf4, quantized while loading (bnb_format.py)
    if raw is None:
        return on_load_format() if flag is not None and flag.lower() == "fp8" else None
    method = str(raw.get("quant_method", "")).lower()
    if method == "fp8":
        return hf_fp8_format(raw)
    if method == "bitsandbytes":
        return bnb_format(raw)
    if method == "compressed-tensors" and _is_float_scheme(raw):
        return compressed_tensors_fp8_format(raw)
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


int4_format = quant_format  # the older name, kept for its callers


def with_quantization_flag(hf_config: Any, flag: str | None) -> Any:
    """hf_config as the model is built from it: a shallow copy carrying --quantization (when given)
    under QUANTIZATION_FLAG_ATTR, which quant_format reads; the original is left as it was."""
    if flag is None:
        return hf_config
    marked = copy.copy(hf_config)
    setattr(marked, QUANTIZATION_FLAG_ATTR, flag)
    return marked


def _is_float_scheme(raw: dict[str, Any]) -> bool:
    """A compressed-tensors config whose weights are floats (fp8): format float-quantized, or groups of
    float weights under another format name (naive-quantized)."""
    if str(raw.get("format", "")) == "float-quantized":
        return True
    groups = (raw.get("config_groups") or {}).values()
    return any(str((group.get("weights") or {}).get("type", "int")) == "float" for group in groups)


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
    if key == "fp8":
        _check_fp8_flag(flag, raw)
        return
    if FLAG_FAMILIES[key] == "bitsandbytes":
        check_bnb_flag(flag, raw)
        return
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


def _check_fp8_flag(flag: str, raw: dict[str, Any] | None) -> None:
    """--quantization fp8: quantizes a 16-bit checkpoint while loading, or names an fp8 checkpoint."""
    if raw is None:
        return
    method = str(raw.get("quant_method", "")).lower()
    if method == "fp8":
        return
    if method == "compressed-tensors" and _is_float_scheme(raw):
        raise ValueError(
            f"--quantization {flag} but the checkpoint is quantized with 'compressed-tensors' (fp8 "
            "float-quantized, config.json's quantization_config.quant_method): drop --quantization or set "
            "it to compressed-tensors"
        )
    raise ValueError(
        f"--quantization {flag} but the checkpoint is already quantized with {method!r} (config.json's "
        "quantization_config.quant_method): fitserve quantizes to fp8 only from a 16-bit checkpoint; drop "
        "--quantization, or pass the model's bf16/fp16 release with --quantization fp8"
    )


def check_layer_shapes(fmt: Int4Format | Fp8Format, hf_config: Any) -> None:
    """ValueError when a quantized projection's input dim is not a multiple of the group size (or of the
    8 codes packed per int32), naming the layer, both numbers and the fix. fp8: fp8_shapes.py."""
    if isinstance(fmt, Fp8Format):
        from fitserve.layers.quantization.fp8_shapes import check_fp8_layer_shapes

        check_fp8_layer_shapes(fmt, hf_config)
        return
    if isinstance(fmt, BnbFormat):
        check_bnb_layer_shapes(fmt, hf_config)
        return
    from fitserve.layers.quantization.layer_projections import (
        gemma4_quantized,
        is_gemma4,
        is_qwen3_5,
        qwen3_5_quantized,
    )

    if is_qwen3_5(hf_config):  # each quantized module by its checkpoint name (its layers differ)
        inputs = qwen3_5_quantized(fmt, hf_config)
    elif is_gemma4(hf_config):  # per-layer head dims, KV sharing, the E models' per-layer inputs
        inputs = gemma4_quantized(fmt, hf_config)
    else:
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
