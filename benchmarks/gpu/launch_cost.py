"""Host microseconds per call of what an eager (not graphed) GPU step does hundreds of times.

A prefill chunk runs outside CUDA graphs: on the Qwen3-0.6B shape it launches ~140 Triton kernels and
113 cuBLAS GEMMs from Python, and on the GPU machine's CPU its host time can exceed its ~18 ms of GPU
time. This times, without synchronising (tiny kernels, so the GPU keeps up), one RMSNorm launch four
ways: fitserve's wrapper, Triton's `kernel[grid](...)` (JITFunction.run), fitserve's fast_launch
cache (fitserve/kernels/fast_launch.py), and the compiled kernel's own launcher (the floor); plus
torch.empty and a small F.linear for scale.

  python benchmarks/gpu/launch_cost.py [--out ...]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import save
from triton.runtime import driver

from fitserve.kernels.dependent_launch import pdl_kwargs
from fitserve.kernels.norm import _rms_norm_kernel, fused_add_rms_norm


def host_us(call, calls: int = 3000) -> float:
    for _ in range(100):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(elapsed / calls * 1e6, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    x = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    residual = torch.randn(64, 1024, device=device, dtype=torch.bfloat16)
    weight = torch.ones(1024, device=device, dtype=torch.bfloat16)
    linear_weight = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
    kernel_args = (x, residual, weight, x, 1024, 1, x.stride(0), 0, residual.stride(0), x.stride(0), 1e-6)
    constexprs = dict(HAS_RESIDUAL=True, BLOCK=1024, num_warps=4, **pdl_kwargs(device))
    compiled = _rms_norm_kernel.function.run(*kernel_args, grid=(64,), warmup=False, **constexprs)
    stream = driver.active.get_current_stream(driver.active.get_current_device())
    launcher_args = (*kernel_args, True, 1024, constexprs["USE_PDL"])  # every parameter, in order
    no_hooks = (None, None, None)
    figures = {
        "rms_norm via fitserve's wrapper (fused_add_rms_norm)": host_us(
            lambda: fused_add_rms_norm(x, residual, weight, 1e-6)
        ),
        "rms_norm kernel[grid](...), Triton's JITFunction.run": host_us(
            lambda: _rms_norm_kernel.function[(64,)](*kernel_args, **constexprs)
        ),
        "rms_norm kernel[grid](...), fitserve fast_launch": host_us(
            lambda: _rms_norm_kernel[(64,)](*kernel_args, **constexprs)
        ),
        "rms_norm CompiledKernel.run (the launcher alone)": host_us(
            lambda: compiled.run(
                64, 1, 1, stream, compiled.function, compiled.packed_metadata, *no_hooks, *launcher_args
            )
        ),
        "torch.empty((8192, 1024))": host_us(
            lambda: torch.empty((8192, 1024), dtype=torch.bfloat16, device=device)
        ),
        "F.linear 64 x 1024 -> 4096 (cuBLAS)": host_us(lambda: F.linear(x, linear_weight)),
    }
    save("launch_cost", {"host_us_per_call": figures}, args.out)


if __name__ == "__main__":
    main()
