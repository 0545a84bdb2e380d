"""The bitsandbytes 4-bit (nf4 / fp4) layout fitserve's nf4 kernels (kernels/nf4_gemm.py, nf4_dequant.py)
read, made once at load from layers/quantization/bnb_weight.Nf4Weight, and its torch reference.

Plain torch: imports on any machine (no Triton).

`PackedNf4`:
- `packed` uint8 [N, K / 2]: the codes as bitsandbytes packs them (element 2i of a row in the high nibble
  of byte i, 2i + 1 in the low one), so a row's bytes are its K codes in order;
- `scales` [N, K / blocksize]: each block's absmax (a double-quantized checkpoint's decoded at load), in
  float16 when every value is a normal float16 (2 bytes a block, what the planner counts), else float32;
- `pair_table` int64 [256]: for each byte value, the float32 bits of code[byte >> 4] (low word) and of
  code[byte & 15] (high word), so a kernel turns one byte into the two weights it holds (before scaling)
  with one 8-byte load from a 2 KB table that stays in L1: nf4's 16 values are not evenly spaced, so no
  arithmetic trick turns a code into its value;
- `counters` int32: one per output tile, for the split-K "last program reduces" step (kernels/int4_gemm
  ._finish), left at zero after each call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

MIN_BLOCK_N = 16  # the smallest output tile (weight rows) of the kernels
MAX_SPLIT_ROW_TILES = 8  # row tiles of x a split-K launch may have (counters: one slot per tile)
FP16_NORMAL = (6.2e-5, 65000.0)  # absmax kept float16 when all lie in here (or are 0)


@dataclass(frozen=True)
class PackedNf4:
    packed: torch.Tensor  # uint8 [N, K // 2]
    scales: torch.Tensor  # float16 or float32 [N, K // blocksize]
    pair_table: torch.Tensor  # int64 [256]
    code: torch.Tensor  # float32 [16]: the code table (kernels whose lookup is not the pair table)
    permute_table: torch.Tensor  # int32 [8]: the code table as float16 bytes (nf4_gemm's LOOKUP 4)
    mma_table: torch.Tensor  # int32 [8]: the same in the activation dtype (kernels/nf4_mma_gemv.py)
    counters: torch.Tensor  # int32 zeros
    blocksize: int
    in_features: int
    out_features: int
    dtype: torch.dtype  # the activations' (bfloat16 / float16)

    def to(self, device: torch.device | str) -> PackedNf4:
        return dataclasses.replace(
            self,
            packed=self.packed.to(device),
            scales=self.scales.to(device),
            pair_table=self.pair_table.to(device),
            code=self.code.to(device),
            permute_table=self.permute_table.to(device),
            mma_table=self.mma_table.to(device),
            counters=self.counters.to(device),
        )

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def nbytes(self) -> int:
        """Bytes a call streams: the codes and the block scales."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def permute_table(code: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """int32 [8]: the 16 code values rounded to `dtype` (float16 / bfloat16), low bytes of entries 0-3,
    4-7, 8-11, 12-15 (byte k of a word = entry first + k), then their high bytes: what the byte-permute
    lookups (nf4_gemm's LOOKUP 4, nf4_mma_gemv) pick bytes from."""
    bits = code.detach().float().cpu().to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF
    words = []
    for shift in (0, 8):
        for first in (0, 4, 8, 12):
            words.append(sum(((int(bits[first + k]) >> shift) & 0xFF) << (8 * k) for k in range(4)))
    return torch.tensor(words, dtype=torch.int64).to(torch.int32).to(code.device)


def pair_table(code: torch.Tensor) -> torch.Tensor:
    """int64 [256]: float32 bits of code[b >> 4] in the low 32 bits, of code[b & 15] in the high 32."""
    bits = code.detach().float().cpu().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    byte = torch.arange(256)
    return (bits[byte >> 4] | (bits[byte & 0xF] << 32)).to(code.device)


def check_blocksize(in_features: int, blocksize: int) -> None:
    if blocksize < 32 or blocksize & (blocksize - 1) or in_features % blocksize:
        raise ValueError(
            f"nf4 kernels take a power-of-two block size >= 32 that divides K = {in_features}; "
            f"got {blocksize}"
        )


def scale_dtype(absmax: torch.Tensor) -> torch.dtype:
    """float16 when every absmax is 0 or a normal float16 (FP16_NORMAL), else float32."""
    magnitude = absmax.abs()
    normal = (magnitude == 0) | ((magnitude >= FP16_NORMAL[0]) & (magnitude <= FP16_NORMAL[1]))
    return torch.float16 if bool(normal.all()) else torch.float32


def pack_nf4(
    packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, dtype: torch.dtype
) -> PackedNf4:
    """Nf4Weight's tensors -> PackedNf4 on packed's device for activations in `dtype`. One-time, at load
    (it checks the absmax range: a host sync)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nf4 kernels run bfloat16 or float16 activations; got {dtype}")
    out_features, half = packed.shape
    in_features = 2 * half
    check_blocksize(in_features, blocksize)
    if tuple(absmax.shape) != (out_features, in_features // blocksize):
        raise ValueError(
            f"absmax must be [N, K // blocksize] = [{out_features}, {in_features // blocksize}]; got "
            f"{tuple(absmax.shape)}"
        )
    device = packed.device
    tiles = -(-out_features // MIN_BLOCK_N) * MAX_SPLIT_ROW_TILES
    return PackedNf4(
        packed=packed.contiguous(),
        scales=absmax.to(scale_dtype(absmax)).contiguous(),
        pair_table=pair_table(code).to(device),
        code=code.float().to(device).contiguous(),
        permute_table=permute_table(code).to(device),
        mma_table=permute_table(code, dtype).to(device),
        counters=torch.zeros(tiles, dtype=torch.int32, device=device),
        blocksize=blocksize,
        in_features=in_features,
        out_features=out_features,
        dtype=dtype,
    )


def dequantize_packed(packed: PackedNf4, rows: slice | None = None) -> torch.Tensor:
    """float32 [N, K] (or `rows` of it) as the kernels compute it: code values from the pair table,
    scales as stored."""
    data = packed.packed if rows is None else packed.packed[rows]
    scales = packed.scales if rows is None else packed.scales[rows]
    pairs = packed.pair_table.to(data.device)[data.long()]
    low = (pairs & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    high = ((pairs >> 32) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    values = torch.stack((low, high), dim=-1).reshape(data.shape[0], -1)
    blocks = values.view(data.shape[0], -1, packed.blocksize) * scales.float().unsqueeze(-1)
    return blocks.view(data.shape[0], -1)
