"""The one form a bitsandbytes 4-bit layer takes at load, whatever it came from (a checkpoint, with or
without double quant; a 16-bit weight quantized while loading; dummy weights):

    w[n, k] = code[q(n, k)] * absmax[n, k // blocksize]

`packed` uint8 [N, K / 2] holds the codes q as bitsandbytes packs them, row-major, element 2i in the high
nibble of byte i and 2i + 1 in the low one; `absmax` float32 [N, K / blocksize] (a double-quantized
checkpoint's absmax decoded once, `decode_absmax`); `code` float32 [16] (nf4 or fp4 values). Every block
lies inside one weight row: fitserve takes block sizes dividing K.

`quantize_4bit` is bitsandbytes' round-to-nearest (nearest code of w / absmax of its block), used for
--quantization bitsandbytes; `dequantize` the float32 reference every path is tested against.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from fitserve.layers.quantization.bnb_format import CODES


@dataclass
class Nf4Weight:
    packed: torch.Tensor  # uint8 [N, K // 2]
    absmax: torch.Tensor  # float32 [N, K // blocksize]
    code: torch.Tensor  # float32 [16]
    blocksize: int
    quant_type: str = "nf4"

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def in_features(self) -> int:
        return self.packed.shape[1] * 2

    def to(self, device: torch.device | str) -> Nf4Weight:
        return Nf4Weight(
            self.packed.to(device),
            self.absmax.to(device),
            self.code.to(device),
            self.blocksize,
            self.quant_type,
        )


def code_table(quant_type: str, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.tensor(CODES[quant_type], dtype=torch.float32, device=device)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., B] -> uint8 [..., 2B]: the high nibble first."""
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2B] codes 0..15 -> [..., B] (unpack_codes' inverse)."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def dequantize(weight: Nf4Weight, rows: slice | None = None) -> torch.Tensor:
    """float32 [N, K] (or the rows of `rows`) from the form above."""
    packed = weight.packed if rows is None else weight.packed[rows]
    absmax = weight.absmax if rows is None else weight.absmax[rows]
    values = weight.code.to(packed.device)[unpack_codes(packed).long()]
    blocks = values.view(values.shape[0], -1, weight.blocksize)
    return (blocks * absmax.float().unsqueeze(-1)).view(values.shape[0], -1)


def quantize_4bit(weight: torch.Tensor, blocksize: int, quant_type: str = "nf4") -> Nf4Weight:
    """A 16/32-bit weight [N, K] (K a multiple of blocksize) -> Nf4Weight on its device: each block's
    absmax, and per element the code nearest w / absmax (ties to the lower code, as bitsandbytes'
    bucketize over the midpoints does)."""
    rows, cols = weight.shape
    code = code_table(quant_type, weight.device)
    blocks = weight.float().reshape(rows, cols // blocksize, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks / absmax.clamp(min=1e-38).unsqueeze(-1)).clamp(-1, 1).reshape(rows, cols)
    order = torch.argsort(code)
    ordered = code[order]
    midpoints = (ordered[:-1] + ordered[1:]) / 2
    codes = order[torch.bucketize(scaled, midpoints)].to(torch.uint8)
    return Nf4Weight(pack_codes(codes), absmax, code, blocksize, quant_type)


def decode_absmax(
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor,
    nested_code: torch.Tensor,
    nested_blocksize: int,
    offset: float,
) -> torch.Tensor:
    """A double-quantized absmax (uint8 indices into nested_code, one nested_absmax per nested_blocksize
    of them, plus offset) -> float32 absmax."""
    values = nested_code.float()[absmax.long()]
    index = torch.arange(values.numel(), device=values.device) // nested_blocksize
    return values * nested_absmax.float()[index] + offset


def parse_quant_state(tensor: torch.Tensor, what: str) -> dict:
    """The JSON a `weight.quant_state.bitsandbytes__*` tensor holds (its uint8 bytes); ValueError naming
    the tensor when it is not JSON."""
    try:
        state = json.loads(bytes(tensor.to(torch.uint8).cpu().tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{what}: the bitsandbytes quant_state tensor is not the JSON bitsandbytes writes ({error}): the "
            "checkpoint is damaged; download it again"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{what}: the bitsandbytes quant_state holds {type(state).__name__}, not a dict")
    return state


# Random codes drawn uniformly give E[code^2] of the table; absmax is scaled so the weight has std `std`.
def random_nf4_weight(
    out_features: int,
    in_features: int,
    blocksize: int,
    std: float,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    quant_type: str = "nf4",
) -> Nf4Weight:
    """--load-format dummy: uniform random codes and absmax uniform on [0.75, 1.25] times the value that
    gives the dequantized weight a standard deviation of about `std`."""
    code = code_table(quant_type, device)
    packed = torch.randint(
        0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator, device=device
    )
    base = std / float(code.square().mean()) ** 0.5
    shape = (out_features, in_features // blocksize)
    absmax = (torch.rand(shape, generator=generator, device=device) * 0.5 + 0.75) * base
    return Nf4Weight(packed, absmax, code, blocksize, quant_type)
