"""float16 weights for a CPU matmul, used only where float16 holds the loaded weights exactly.

fbgemm's fp16 GEMM (`torch.ops.quantized.linear_dynamic_fp16`) reads a prepacked float16 matrix and
computes in float32: float32 activations in and out, half the weight bytes of float32. When every
loaded weight converts to float16 and back unchanged (a checkpoint stored in bfloat16 from a Q8_0
GGUF, like the default model's embedding and tied LM head), the result is the float32 product of the
same weights, summed in another order. Any other weight (a float32 checkpoint) is left alone.

For SmolLM2's LM head it is faster than F.linear on the float32 weight at 1 and at 16 rows
(docs/performance.md, section "On the CPU").
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger("fitserve")

_announced = False


def pack_fp16_in_background(weight: torch.Tensor) -> Future | None:
    """The prepacked float16 copy of `weight` [N, K] (a CPU float32 matrix), packed (0.7 s for SmolLM2's
    49152 x 576 LM head on 2 cores) on a thread of its own, so the engine's start goes on beside it; None
    at once when float16 would change a value or the fbgemm kernels are not available. The future's result
    is the packed copy, or None if fbgemm refused it."""
    if not fp16_holds_exactly(weight):
        return None
    _announce(tuple(weight.shape))
    packer = ThreadPoolExecutor(1, thread_name_prefix="fitserve-fp16-pack")
    future = packer.submit(prepack_fp16, weight)
    packer.shutdown(wait=False)
    return future


def fp16_holds_exactly(weight: torch.Tensor) -> bool:
    """A CPU float32 matrix that float16 holds exactly, and fbgemm here to multiply it."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return False
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    with torch.no_grad():
        return torch.equal(weight.to(torch.float16).to(torch.float32), weight)


def prepack_fp16(weight: torch.Tensor) -> Any | None:
    """`weight` [N, K] rounded to float16 and prepacked for fbgemm's fp16 GEMM, or None when fbgemm
    refuses it."""
    try:
        with torch.no_grad():
            return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None


_fp16_linear: Any = None


def fp16_linear_op() -> Any:
    """fbgemm's fp16 GEMM as its overload (float32 x [M, K], prepacked weight -> float32 [M, N]). Called
    as `torch.ops.quantized.linear_dynamic_fp16(...)`, the op first scans its arguments for script
    objects in Python (~2 us a call, warm), 121 times a SmolLM2 decode step."""
    global _fp16_linear
    if _fp16_linear is None:
        _fp16_linear = torch.ops.quantized.linear_dynamic_fp16.default
    return _fp16_linear


def fp16_matmul(x: torch.Tensor, packed: Any) -> torch.Tensor:
    """x [..., K] float32 @ the packed weight^T -> float32 [..., N]."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    return fp16_linear_op()(x, packed)


def _announce(shape: tuple[int, ...]) -> None:
    global _announced
    if _announced:
        return
    _announced = True
    logger.info(
        "CPU weights: the %d x %d LM head is held exactly by float16, so it runs as a float16-weight, "
        "float32-compute matmul (half the bytes read per token)",
        *shape,
    )
