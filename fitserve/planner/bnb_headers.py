"""A bitsandbytes 4-bit checkpoint's tensors as fitserve holds them, from their safetensors headers.

The packed codes (`X.weight`, uint8, half a byte a weight) are held as stored, like any non-float tensor.
Each block's absmax (`X.weight.absmax`: float32, or uint8 with double quant) becomes one float16 scale
(layers/quantization/bnb_sizes.py); the code tables, the nested (double quant) absmax and the quant_state
JSON are read at load and dropped. `check_bnb_checkpoint` refuses a damaged or mismatched checkpoint from
the same headers before anything loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fitserve.layers.quantization.bnb_sizes import SCALE_BYTES

_DROPPED = (".weight.quant_map", ".weight.nested_absmax", ".weight.nested_quant_map")


def bnb_held_bytes(name: str, shape: Sequence[int]) -> int | None:
    """Bytes fitserve holds for the bitsandbytes tensor `name` (0 for one it drops); None for a tensor
    that is not one of bitsandbytes' block-scale tensors."""
    if name.endswith(".weight.absmax"):
        blocks = 1
        for size in shape:
            blocks *= int(size)
        return blocks * SCALE_BYTES
    if name.endswith(_DROPPED) or ".weight.quant_state." in name:
        return 0
    return None


def check_bnb_checkpoint(fmt: Any, folder: str, hf_config: Any) -> None:
    """A pre-quantized bitsandbytes checkpoint's tensors checked from its safetensors headers, before
    anything loads (layers/quantization/bnb_checks.py holds the rules and the messages)."""
    from fitserve.layers.quantization.bnb_checks import check_bnb_tensors
    from fitserve.models.weights import list_safetensors_files
    from fitserve.planner.weights import read_safetensors_header

    tensors: dict[str, tuple[str, Sequence[int]]] = {}
    for path in list_safetensors_files(folder):
        for name, entry in read_safetensors_header(path).items():
            if name != "__metadata__":
                tensors[name] = (str(entry["dtype"]), list(entry["shape"]))
    if tensors:
        check_bnb_tensors(fmt, tensors, hf_config)
