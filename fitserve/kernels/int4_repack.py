"""The int4 weight layout that fitserve's int4 GEMM kernels (kernels/int4_gemm.py) stream, the one-time
repack into it from the canonical int4 form, and the torch reference the kernels are tested against.

Plain torch: this module imports on any machine (no Triton), so a loader may repack on the CPU and move
the result to the GPU.

Canonical form (every int4 format, AWQ, GPTQ, compressed-tensors, AutoRound, is unpacked to it first):
`codes` uint8 [N, K], one 4-bit code 0..15 per byte; `scales` [N, K // group_size]; `zeros`
[N, K // group_size] float; a weight is w[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g] with
g = k // group_size. group_size is 32, 64, 128, 256 or any multiple of 256 dividing K, or K itself
(per-channel).

Layout (`PackedInt4`):

- `qweight` int32 [N, Kp // 8], Kp = K rounded up to a multiple of BLOCK_K = 256 (codes past K are 0;
  the kernels mask x there, so they add nothing). Row n is a run of 256-code blocks, each 32 words =
  128 bytes, one full cache line per weight row per block. Within block b, word i (0..31) holds the
  codes of k = 256 b + 32 j + i in its bits 4j..4j+3, for j = 0..7. So the 32 words of one block, taken
  nibble j at a time, are 32 consecutive codes: a kernel unpacks nibble j of a [BLOCK_N, 32] tile of
  words with one AND (no shuffles, no reshape) and gets the [BLOCK_N, 32] weights of K columns
  256 b + 32 j ... + 31, which it multiplies with the matching 32 columns of x (a tl.dot of depth 32,
  or FMAs). Rows stay contiguous along K, so any BLOCK_N works and a split of K is a range of blocks.
- `scale_zero`: [G, N, 2] in the activation dtype (bfloat16 or float16), G = ceil(Kp / group_size)
  (groups past K // group_size are 0): per group and weight row the pair (scale, zero point), so a
  program loads the BLOCK_N pairs of one group as one contiguous run of 4-byte loads (which Triton's
  pipeliner copies asynchronously; it cannot copy 2-byte loads). `scales` and `zeros` are views.
  The zero point is kept as z (not folded into -z * scale): the integer zero points of AWQ / GPTQ /
  compressed-tensors stay exact in 16 bits, and the decode kernel needs z alone
  (with integer zero points, `integer_zeros`, it subtracts z inside the FMA that turns a code into a
  float, see int4_gemm.py). A fractional z is rounded to the activation dtype.
- `counters`: int32 zeros, one per output tile, for the split-K kernels' "last program reduces" step
  (each call leaves them at zero again). They belong to the layer, so two layers never share them.

Reference: `dequantize_reference` (float32 [N, K] from the canonical form).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

BLOCK_K = 256  # codes per row per block: 32 int32 words, 128 bytes
WORDS_PER_BLOCK = BLOCK_K // 8
# The kernels' smallest output tile is 16 weight rows, and a split-K launch has at most this many row
# tiles of x (x rows per launch / the smallest row tile); counters has one slot per output tile.
MIN_BLOCK_N = 16
MAX_SPLIT_ROW_TILES = 8
# Zero points the packed-pair dequantization keeps exact (kernels/int4_pair_dequant.py: 128 + z in
# bfloat16); GPTQ's stored zero + 1 reaches 16.
MAX_PAIRED_ZERO = 16


def packed_int4_bytes(in_features: int, out_features: int, group_size: int, dtype_bytes: int = 2) -> int:
    """The bytes `repack_int4` allocates for one layer (the planner counts these on a GPU): the codes padded
    to BLOCK_K, a (scale, zero point) pair per padded group and output row in the activation dtype, and
    the split-K counters."""
    padded = -(-in_features // BLOCK_K) * BLOCK_K
    groups = -(-padded // group_size)
    counters = -(-out_features // MIN_BLOCK_N) * MAX_SPLIT_ROW_TILES
    return out_features * padded // 2 + groups * out_features * 2 * dtype_bytes + 4 * counters


@dataclass(frozen=True)
class PackedInt4:
    """One linear layer's int4 weight in the kernels' layout (module docstring)."""

    qweight: torch.Tensor  # int32 [N, Kp // 8]
    scale_zero: torch.Tensor  # [G, N, 2]: (scale, zero point) in the activation dtype
    counters: torch.Tensor  # int32 [cdiv(N, MIN_BLOCK_N) * MAX_SPLIT_ROW_TILES], zeros
    group_size: int
    in_features: int  # K
    out_features: int  # N
    integer_zeros: bool  # every zero point (as stored) is an integer: the decode kernel's fast path
    # ... and each is in 0 .. MAX_PAIRED_ZERO: the tensor-core kernel's packed-pair dequantization
    paired_zeros: bool = False

    def to(self, device: torch.device) -> PackedInt4:
        """The same weight with its tensors on `device`."""
        return dataclasses.replace(
            self,
            qweight=self.qweight.to(device),
            scale_zero=self.scale_zero.to(device),
            counters=self.counters.to(device),
        )

    @property
    def scales(self) -> torch.Tensor:
        """[G, N] view."""
        return self.scale_zero[..., 0]

    @property
    def zeros(self) -> torch.Tensor:
        """[G, N] view."""
        return self.scale_zero[..., 1]

    @property
    def dtype(self) -> torch.dtype:
        return self.scale_zero.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def padded_in_features(self) -> int:
        return self.qweight.shape[1] * 8

    def nbytes(self) -> int:
        """Bytes a kernel streams per call (codes, scales, zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale_zero))


def check_group_size(in_features: int, group_size: int) -> None:
    """Raises ValueError unless the kernels take this group size for K = in_features."""
    ok = (
        group_size > 0
        and in_features % group_size == 0
        and (group_size == in_features or group_size % BLOCK_K == 0 or BLOCK_K % group_size == 0)
        and group_size % 32 == 0
    )
    if not ok:
        raise ValueError(
            f"int4 kernels take a group size that divides K = {in_features} and is 32, 64, 128, 256, a "
            f"multiple of 256 or K itself (per-channel); got {group_size}"
        )


def repack_int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
) -> PackedInt4:
    """Canonical int4 (module docstring) -> PackedInt4 on codes' device, scales and zeros in `dtype`
    (the activations' bfloat16 or float16). One-time, at load: it checks the codes (a host sync)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"int4 kernels run bfloat16 or float16 activations; got {dtype}")
    if codes.dim() != 2 or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8 [N, K]; got {codes.dtype} {tuple(codes.shape)}")
    out_features, in_features = codes.shape
    check_group_size(in_features, group_size)
    groups = in_features // group_size
    for name, tensor in (("scales", scales), ("zeros", zeros)):
        if tuple(tensor.shape) != (out_features, groups):
            raise ValueError(
                f"{name} must be [N, K // group_size] = [{out_features}, {groups}]; got {tuple(tensor.shape)}"
            )
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must be 4-bit (0..15); found {int(codes.max())}")
    device = codes.device
    qweight = pack_words(codes)
    scale_zero = scale_zero_pairs(scales, zeros, qweight.shape[1] * 8, group_size, dtype, device)
    counters = torch.zeros(
        -(-out_features // MIN_BLOCK_N) * MAX_SPLIT_ROW_TILES, dtype=torch.int32, device=device
    )
    stored_zeros = scale_zero[..., 1]
    integer_zeros = bool(torch.equal(stored_zeros, stored_zeros.round()))
    in_range = not stored_zeros.numel() or (
        float(stored_zeros.min()) >= 0 and float(stored_zeros.max()) <= MAX_PAIRED_ZERO
    )
    return PackedInt4(
        qweight=qweight,
        scale_zero=scale_zero,
        counters=counters,
        group_size=group_size,
        in_features=in_features,
        out_features=out_features,
        integer_zeros=integer_zeros,
        paired_zeros=integer_zeros and in_range,
    )


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> qweight int32 [N, Kp // 8] in the layout (codes past K are 0)."""
    out_features, in_features = codes.shape
    padded = -(-in_features // BLOCK_K) * BLOCK_K
    blocks = padded // BLOCK_K
    if padded != in_features:
        codes = torch.nn.functional.pad(codes, (0, padded - in_features))
    # [N, blocks, j, i] -> word [N, blocks, i] = sum_j code << 4j
    nibbles = codes.view(out_features, blocks, 8, WORDS_PER_BLOCK).to(torch.int64)
    shifts = (4 * torch.arange(8, device=codes.device, dtype=torch.int64)).view(1, 1, 8, 1)
    words = (nibbles << shifts).sum(dim=2)  # < 2**32
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.reshape(out_features, blocks * WORDS_PER_BLOCK).contiguous()


def scale_zero_pairs(
    scales: torch.Tensor,
    zeros: torch.Tensor,
    padded_in_features: int,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> torch.Tensor:
    """scales and zero points [N, K // group_size] -> the layout's [G, N, 2] pairs in `dtype` on `device`
    (default: the scales'), G counting the groups of the padded K (those past K are 0)."""
    out_features, groups = scales.shape
    device = scales.device if device is None else device
    padded_groups = -(-padded_in_features // group_size)
    scale_zero = torch.zeros(padded_groups, out_features, 2, dtype=dtype, device=device)
    scale_zero[:groups, :, 0] = scales.to(device=device, dtype=torch.float32).t().to(dtype)
    scale_zero[:groups, :, 1] = zeros.to(device=device, dtype=torch.float32).t().to(dtype)
    return scale_zero


def unpack_words(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """qweight int32 [N, Kp // 8] -> the uint8 codes [N, in_features] it was packed from (pack_words'
    inverse)."""
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    n, blocks = qweight.shape[0], qweight.shape[1] // WORDS_PER_BLOCK
    words = words.view(n, blocks, 1, WORDS_PER_BLOCK)
    shifts = (4 * torch.arange(8, device=words.device, dtype=torch.int64)).view(1, 1, 8, 1)
    codes = ((words >> shifts) & 0xF).to(torch.uint8).reshape(n, blocks * BLOCK_K)
    return codes[:, :in_features].contiguous()


def unpack_codes(packed: PackedInt4) -> torch.Tensor:
    """PackedInt4 -> the uint8 codes [N, K] it was packed from (the layout's inverse, for tests)."""
    return unpack_words(packed.qweight, packed.in_features)


def dequantize_packed(packed: PackedInt4) -> torch.Tensor:
    """float32 [N, K] from the packed layout, with scales and zeros as the kernels read them (rounded to
    the activation dtype)."""
    return dequantize_words(packed.qweight, packed.scale_zero, packed.in_features, packed.group_size)


def dequantize_words(
    qweight: torch.Tensor, scale_zero: torch.Tensor, in_features: int, group_size: int
) -> torch.Tensor:
    """float32 [N, in_features] of a weight in the layout (qweight [N, Kp // 8], scale_zero [G, N, 2]), as
    the kernels read it."""
    groups = in_features // group_size
    scales, zeros = scale_zero[:groups, :, 0].t(), scale_zero[:groups, :, 1].t()
    return dequantize_reference(unpack_words(qweight, in_features), scales, zeros, group_size)


def dequantize_reference(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 [N, K]: w[n, k] = (codes[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]."""
    scale = scales.float().repeat_interleave(group_size, dim=1)
    zero = zeros.float().repeat_interleave(group_size, dim=1)
    return (codes.float() - zero) * scale
