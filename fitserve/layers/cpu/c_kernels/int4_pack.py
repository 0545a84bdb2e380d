"""Python side of int4_pack.c: the ctypes signature, the call, and the self-check run after a build."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from fitserve.layers.cpu.c_kernels.int4_layout import BLOCK_COLUMNS, GROUP_SIZE, pack_for_kernel

_NOT_INT4, _BAD_SHAPE = 1, 2


@dataclass(frozen=True)
class PackedInt4:
    """A weight in the int4 GEMM's layout (int4_layout.py) and how closely that layout reproduces it."""

    codes: torch.Tensor  # uint8 [N / 16, K / 8, 64]
    scales: torch.Tensor  # float16 [N / 16, K / 32, 2, 16]
    max_deviation: float  # largest |stored form - loaded| / the group's largest |weight|


class Int4Pack:
    """`fs_int4_pack` of the built library: find_int4_groups(w, "kernel") and pack_for_kernel in one pass."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.fs_int4_pack
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, ctypes.c_int, i64, i64, ctypes.c_float, ptr, ptr, ptr, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    def __call__(self, weight: torch.Tensor, tolerance: float) -> PackedInt4 | None:
        """The packed form of a float32 or bfloat16 [N, K] weight made of 4-bit groups of 32 reproduced
        within `tolerance` of each group's largest |weight| by float16 steps and minimums; None for any
        other. A bfloat16 weight packs as the float32 one holding the same values does."""
        if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16) or weight.is_cuda:
            return None
        out_features, in_features = weight.shape
        if out_features % BLOCK_COLUMNS or in_features % GROUP_SIZE:
            return None
        weight = weight.detach().contiguous()
        blocks, groups = out_features // BLOCK_COLUMNS, in_features // GROUP_SIZE
        codes = torch.empty(blocks, in_features // 8, 64, dtype=torch.uint8)
        scales = torch.empty(blocks, groups, 2, BLOCK_COLUMNS, dtype=torch.float16)
        deviation = ctypes.c_float()
        status = self._function(
            weight.data_ptr(),
            int(weight.dtype == torch.bfloat16),
            out_features,
            in_features,
            tolerance,
            codes.data_ptr(),
            scales.data_ptr(),
            ctypes.byref(deviation),
            torch.get_num_threads(),
        )
        if status == _BAD_SHAPE:
            raise ValueError(f"int4 pack: a {out_features} x {in_features} weight does not fit the layout")
        if status == _NOT_INT4:
            return None
        return PackedInt4(codes, scales, deviation.value)

    def self_check(self) -> str | None:
        """A small matrix of 4-bit groups packed here and by torch (int4_layout.pack_for_kernel), or what
        differs; and a matrix that is not such groups must be refused."""
        generator = torch.Generator().manual_seed(0)
        out_features, in_features = 32, 64
        codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32)
        step = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01 + 0.001).half()
        minimum = (-8 * step.float()).half()
        codes[:, ::32], codes[:, 1::32] = 0, 15  # every group spans all 16 codes, so its step is found again
        weight = codes.view(out_features, -1, 32) * step.float()[..., None] + minimum.float()[..., None]
        packed = self(weight.view(out_features, in_features), tolerance=2.0**-6)
        expected_codes, expected_scales = pack_for_kernel(codes, step, minimum)
        if packed is None or not torch.equal(packed.codes, expected_codes):
            return "the built int4 packer does not reproduce the packed codes of a self-check"
        if not torch.equal(packed.scales, expected_scales):
            return "the built int4 packer does not reproduce the float16 steps and minimums of a self-check"
        if self(torch.randn(out_features, in_features, generator=generator), tolerance=2.0**-6) is not None:
            return "the built int4 packer took random weights for 4-bit groups"
        return None
