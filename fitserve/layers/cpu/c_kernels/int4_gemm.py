"""Python side of int4_gemm.c: the ctypes signature, the call, and the self-check run after a build."""

from __future__ import annotations

import ctypes

import torch

from fitserve.layers.cpu.c_kernels.int4_layout import pack_for_kernel


class Int4Gemm:
    """`fs_int4_gemm` of the built library (see int4_gemm.c for the math and the weight layout)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.fs_int4_gemm
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        function.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, i64, ctypes.c_int]
        function.restype = ctypes.c_int
        self._function = function

    def __call__(
        self,
        x: torch.Tensor,
        codes: torch.Tensor,
        scales: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x float32 [M, K] (each row contiguous) -> float32 [M, out_features]. codes and scales: the
        layout of int4_layout.py for a [out_features, K] weight; bias: float32 [out_features] or None."""
        rows, in_features = x.shape
        out = torch.empty(rows, out_features)
        status = self._function(
            x.data_ptr(),
            rows,
            in_features,
            x.stride(0),
            codes.data_ptr(),
            scales.data_ptr(),
            out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"int4 GEMM: no memory for {rows} x {in_features} rounded activations")
        return out

    def bind(self, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> BoundInt4Gemm:
        """The call for one packed weight, its pointers and sizes fixed (the tensors kept alive)."""
        return BoundInt4Gemm(self._function, codes, scales, out_features)

    def self_check(self) -> str | None:
        """A small product against torch's float32 one, or what is wrong with it. The kernel rounds the
        activations to two int8 levels (int4_gemm.c), so it lands within ~1e-4 of it."""
        generator = torch.Generator().manual_seed(0)
        out_features, in_features = 32, 64
        codes = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.int32)
        step = (torch.rand(out_features, in_features // 32, generator=generator) * 0.01 + 0.001).half()
        minimum = (-8 * step.float()).half()
        weight = codes.view(out_features, -1, 32) * step.float()[..., None] + minimum.float()[..., None]
        x = torch.randn(3, in_features, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        expected = x @ weight.view(out_features, in_features).T + bias
        packed_codes, scales = pack_for_kernel(codes, step, minimum)
        got = self(x, packed_codes, scales, out_features, bias)
        error = float((got - expected).norm() / expected.norm())
        if not error < 1e-3:
            return f"the built int4 GEMM is off by {error:.3g} (relative) on a self-check"
        return None


class BoundInt4Gemm:
    """`Int4Gemm` for one packed weight: each call passes only the activations (and a bias). A linear
    layer makes one when its weight is packed; a decode step calls it 120 times for SmolLM2-135M."""

    def __init__(
        self, function: ctypes._CFuncPtr, codes: torch.Tensor, scales: torch.Tensor, out_features: int
    ) -> None:
        self._function = function
        self._weights = (codes, scales)  # kept alive: the pointers below read them
        self.out_features = out_features
        self.in_features = codes.shape[1] * 8
        self._codes, self._scales = codes.data_ptr(), scales.data_ptr()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x float32 [M, in_features], each row contiguous; bias float32 contiguous [out_features] or None."""
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features)
        status = self._function(
            x.data_ptr(),
            rows,
            self.in_features,
            x.stride(0),
            self._codes,
            self._scales,
            self.out_features,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            self.out_features,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError(f"int4 GEMM: no memory for {rows} x {self.in_features} rounded activations")
        return out
