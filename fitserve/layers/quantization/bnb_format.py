"""bitsandbytes 4-bit: the format read from config.json's quantization_config (quant_method "bitsandbytes")
or asked for with `--quantization bitsandbytes` on a 16-bit checkpoint (nf4, blocks of 64, quantized while
loading), every refusal made before a weight loads, and the checkpoint tensor names.

A pre-quantized checkpoint (transformers' save_pretrained of a load_in_4bit model) stores for each
quantized linear `X`:
- `X.weight` uint8 [N * K / 2, 1] (bnb_4bit_quant_storage uint8): the weight [N, K] flattened row-major,
  two 4-bit codes a byte, the even element in the high nibble;
- `X.weight.absmax`: one value per block of `blocksize` consecutive elements (float32, or with double
  quant (bnb_4bit_use_double_quant) uint8 indices into `X.weight.nested_quant_map` [256] float32, scaled
  by `X.weight.nested_absmax` float32 per block of `nested_blocksize` absmax values, plus `nested_offset`);
- `X.weight.quant_map` float32 [16]: the code table (nf4 or fp4 values in [-1, 1]);
- `X.weight.quant_state.bitsandbytes__nf4` (or __fp4) uint8: JSON bytes holding quant_type, blocksize,
  dtype, shape and (double quant) nested_blocksize, nested_dtype, nested_offset.
So w[n, k] = quant_map[code] * absmax[(n * K + k) // blocksize].

fitserve's parameters cannot hold dots in their names: `param_name` maps `X.weight.absmax` to
`X.weight_absmax` (and the quant_state to `X.weight_quant_state`) before the model looks them up.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The 16 code values of each 4-bit type, as bitsandbytes defines them (its quant_map tensors hold these).
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# fp4 (e2m1, bitsandbytes' bias): the sign in bit 3, magnitudes 0, 1/192 (subnormal), 2/3, 1, 1/3, 1/2,
# 1/6, 1/4, normalised by the largest magnitude (12 in units of 1/16).
_FP4_MAGNITUDES = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)
FP4_CODE = tuple(m / 12 for m in _FP4_MAGNITUDES) + tuple(-m / 12 for m in _FP4_MAGNITUDES)
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}
# Block sizes bitsandbytes writes (quantize_4bit's blocksize); the kernels take any that divides K.
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_BLOCKSIZE = 64  # what --quantization bitsandbytes quantizes with (bitsandbytes' and vLLM's default)
FLAG_NAMES = ("bitsandbytes", "bnb")
CLOSEST_4BIT = (
    "the closest that runs is a bitsandbytes 4-bit checkpoint (load_in_4bit, nf4 or fp4), or the model's "
    "16-bit checkpoint served with --quantization bitsandbytes (nf4, quantized while loading)"
)
# Checkpoint suffix -> parameter suffix (module docstring).
_SUFFIXES = {
    ".weight.absmax": ".weight_absmax",
    ".weight.quant_map": ".weight_quant_map",
    ".weight.nested_absmax": ".weight_nested_absmax",
    ".weight.nested_quant_map": ".weight_nested_quant_map",
}
_QUANT_STATE = re.compile(r"\.weight\.quant_state\.bitsandbytes__(nf4|fp4)$")


@dataclass(frozen=True)
class BnbFormat:
    method: str = "bitsandbytes"
    quant_type: str = "nf4"  # "nf4" or "fp4"
    double_quant: bool = False  # absmax stored as uint8 with nested_* tensors
    prequantized: bool = True  # False: --quantization bitsandbytes, quantized from 16-bit while loading
    blocksize: int = DEFAULT_BLOCKSIZE  # while loading; a checkpoint's own is in each quant_state
    skip: tuple[str, ...] = ()  # llm_int8_skip_modules: module name fragments left unquantized

    def describe(self) -> str:
        if not self.prequantized:
            return f"bitsandbytes {self.quant_type}, blocks of {self.blocksize}, quantized while loading"
        nested = ", double quant" if self.double_quant else ""
        return f"bitsandbytes 4-bit {self.quant_type} checkpoint{nested}"

    def quantizes(self, module: str) -> bool:
        """Whether the linear `module` (checkpoint name) is stored (or made) 4-bit: every decoder linear
        except lm_head, embeddings and llm_int8_skip_modules' (name fragments, as transformers matches)."""
        if module.split(".")[-1] == "lm_head" or "embed" in module:
            return False
        return not any(fragment in module for fragment in self.skip)


def bnb_format(raw: Mapping[str, Any]) -> BnbFormat:
    """A bitsandbytes quantization_config -> BnbFormat; ValueError naming the value, what runs and the
    fix for 8-bit and for anything else fitserve does not run."""
    if raw.get("load_in_8bit") or raw.get("_load_in_8bit"):
        raise ValueError(
            "bitsandbytes 8-bit (quantization_config.load_in_8bit=true, LLM.int8): not supported; "
            f"{CLOSEST_4BIT}"
        )
    if not (raw.get("load_in_4bit") or raw.get("_load_in_4bit")):
        raise ValueError(
            "bitsandbytes quantization_config sets neither load_in_4bit nor load_in_8bit: fitserve runs "
            f"load_in_4bit checkpoints; {CLOSEST_4BIT}"
        )
    quant_type = str(raw.get("bnb_4bit_quant_type", "fp4")).lower()  # transformers' default is fp4
    if quant_type not in CODES:
        raise ValueError(
            f"bitsandbytes bnb_4bit_quant_type={quant_type!r}: fitserve runs nf4 and fp4; {CLOSEST_4BIT}"
        )
    skip = raw.get("llm_int8_skip_modules") or ()
    if isinstance(skip, str):
        skip = (skip,)
    return BnbFormat(
        quant_type=quant_type,
        double_quant=bool(raw.get("bnb_4bit_use_double_quant", False)),
        prequantized=True,
        skip=tuple(str(name) for name in skip),
    )


def quantize_while_loading_format() -> BnbFormat:
    """`--quantization bitsandbytes` on a checkpoint without quantization_config."""
    return BnbFormat(prequantized=False)


def param_name(name: str) -> str:
    """A checkpoint tensor name -> the parameter name fitserve loads it into (module docstring); other
    names unchanged."""
    if ".weight." not in name:
        return name
    for suffix, replacement in _SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)] + replacement
    if _QUANT_STATE.search(name):
        return _QUANT_STATE.sub(".weight_quant_state", name)
    return name


def check_bnb_flag(flag: str, raw: Mapping[str, Any] | None) -> None:
    """--quantization bitsandbytes: quantizes a 16-bit checkpoint while loading, or names a bitsandbytes
    checkpoint; ValueError for a checkpoint quantized another way."""
    if raw is None:
        return
    method = str(raw.get("quant_method", "")).lower()
    if method != "bitsandbytes":
        raise ValueError(
            f"--quantization {flag} but the checkpoint is already quantized with {method!r} (config.json's "
            "quantization_config.quant_method): fitserve quantizes to bitsandbytes nf4 only from a 16-bit "
            "checkpoint; drop --quantization, or pass the model's bf16/fp16 release with --quantization "
            "bitsandbytes"
        )


def check_bnb_layer_shapes(fmt: BnbFormat, hf_config: Any) -> None:
    """ValueError when a quantized projection's input dim is odd, or (quantizing while loading) not a
    multiple of the block size: fitserve keeps every block inside one weight row."""
    from fitserve.layers.quantization.layer_projections import (
        gemma4_quantized,
        is_gemma4,
        is_qwen3_5,
        qwen3_5_quantized,
    )

    if is_qwen3_5(hf_config):  # each quantized module by its checkpoint name (its layers differ)
        inputs = {name: k for name, (k, _) in qwen3_5_quantized(fmt, hf_config).items()}
    elif is_gemma4(hf_config):
        inputs = {name: k for name, (k, _) in gemma4_quantized(fmt, hf_config).items()}
    else:
        hidden = hf_config.hidden_size
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        inputs = {
            "q_proj/k_proj/v_proj": hidden,
            "o_proj": heads * head_dim,
            "gate_proj/up_proj": hidden,
            "down_proj": hf_config.intermediate_size,
        }
    for names, k in inputs.items():
        if k % 2 or (not fmt.prequantized and k % fmt.blocksize):
            raise ValueError(
                f"{names}'s input dim {k} is not a multiple of the bitsandbytes block size {fmt.blocksize}: "
                "fitserve keeps every block inside one weight row; serve the model unquantized (drop "
                "--quantization) or use a bitsandbytes 4-bit checkpoint of it"
            )
