"""Python side of elementwise.c (RMSNorm with the residual add, rotary embedding, SiLU-and-mul): which
tensors each takes, the ctypes calls, and the post-build check. The checks are kept to cheap attribute
reads: they run ~100 times a decode step."""

from __future__ import annotations

import ctypes

import torch


class Elementwise:
    """`fs_rms_norm`, `fs_rotary` and `fs_silu_and_mul` of the built library."""

    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._rms_norm = library.fs_rms_norm
        self._rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, ctypes.c_float, i64, i64, ptr, ptr]
        self._rms_norm.restype = None
        self._rotary = library.fs_rotary
        self._rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]
        self._rotary.restype = None
        self._silu_and_mul = library.fs_silu_and_mul
        self._silu_and_mul.argtypes = [ptr, i64, i64, i64, ptr]
        self._silu_and_mul.restype = None

    @staticmethod
    def rms_norm_supports(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
        """Contiguous 2-D float32 CPU rows (H a multiple of 16), the residual alike, a float32 weight."""
        if x.dtype != torch.float32 or x.is_cuda or x.dim() != 2 or x.shape[1] % 16 or not x.is_contiguous():
            return False
        if weight.dtype != torch.float32 or not weight.is_contiguous():
            return False
        return residual is None or (
            residual.dtype == torch.float32 and residual.is_contiguous() and residual.shape == x.shape
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x), a new tensor."""
        rows, hidden = x.shape
        out = torch.empty(rows, hidden)
        self._rms_norm(
            x.data_ptr(), hidden, None, 0, weight.data_ptr(), eps, rows, hidden, out.data_ptr(), None
        )
        return out

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place: residual becomes s = x + residual and x becomes weight * s / rms(s); returns
        (x, residual). As on CUDA, the caller reads neither input again."""
        rows, hidden = x.shape
        x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
        self._rms_norm(
            x_ptr, hidden, residual_ptr, hidden, weight.data_ptr(), eps, rows, hidden, x_ptr, residual_ptr
        )
        return x, residual

    @staticmethod
    def rotary_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """x [T, heads, D] float32 (heads and dims contiguous within a token, D a multiple of 32); cos and
        sin [T, 1, D] contiguous float32."""
        head_dim = x.shape[-1]
        return (
            x.dim() == 3
            and head_dim % 32 == 0
            and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.device.type == "cpu"
            and x.stride(2) == 1
            and x.stride(1) == head_dim
            and cos.is_contiguous()
            and sin.is_contiguous()
        )

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x in place (StepRope.rotate's values, bit for bit) and returns it."""
        tokens, heads, head_dim = x.shape
        self._rotary(x.data_ptr(), tokens, heads, head_dim, x.stride(0), cos.data_ptr(), sin.data_ptr())
        return x

    @staticmethod
    def silu_and_mul_supports(x: torch.Tensor) -> bool:
        """2-D float32 CPU rows of [gate | up], contiguous within a row, each half a multiple of 16."""
        return (
            x.dtype == torch.float32
            and not x.is_cuda
            and x.dim() == 2
            and x.shape[1] % 32 == 0
            and x.stride(1) == 1
        )

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[gate | up] rows -> silu(gate) * up, a new [rows, width / 2] tensor."""
        rows, width = x.shape
        out = torch.empty(rows, width // 2)
        self._silu_and_mul(x.data_ptr(), rows, width // 2, x.stride(0), out.data_ptr())
        return out

    def self_check(self) -> str | None:
        """Both kernels against their torch formulas on a small input, or what is wrong."""
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(3, 64, generator=generator)
        residual = torch.randn(3, 64, generator=generator)
        weight = torch.randn(64, generator=generator)
        s = x + residual
        want = weight * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
        normed, summed = self.add_rms_norm_(x.clone(), residual.clone(), weight, 1e-6)
        if not torch.equal(summed, s) or not torch.allclose(normed, want, rtol=1e-5, atol=1e-6):
            return "the built RMSNorm kernel disagrees with torch on a self-check"
        gate_up = torch.randn(2, 64, generator=generator) * 10
        want = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
        if not torch.allclose(self.silu_and_mul(gate_up), want, rtol=1e-5, atol=1e-6):
            return "the built SiLU-and-mul kernel disagrees with torch on a self-check"
        heads = torch.randn(2, 3, 32, generator=generator)
        cos = torch.randn(2, 1, 32, generator=generator)
        sin = torch.randn(2, 1, 32, generator=generator)
        want = heads * cos + heads.roll(16, dims=-1) * sin
        if not torch.equal(self.rotary_(heads.clone(), cos, sin), want):
            return "the built rotary kernel disagrees with torch on a self-check"
        return None
