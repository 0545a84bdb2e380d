"""The compute capability fitserve's kernel config choosers and feature gates go by, and what each GPU
generation's blocks may use.

`kernel_capability(device)` is the GPU's own capability, unless a target is forced:
- FITSERVE_KERNEL_TARGET=sm75 (or sm_75, 7.5; read once, at first use) makes every chooser pick what it
  would pick on that GPU (no PDL below 9.0, the small shared-memory tiles) on whatever GPU runs, so the
  older GPUs' choices can be run and timed on an H100 (benchmarks/gpu/sm75_path.py);
- `forced_target((7, 5))`, a context manager, does the same for a block of code (kernels/variants.py
  compiles every variant for each target that way, on a machine without a GPU).

Shared memory a block may opt into (cudaDevAttrMaxSharedMemoryPerBlockOptin), in bytes, by capability:
the choosers size their tiles by it. Registers: 64K 32-bit registers per SM on every one of these, at
most 255 a thread.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

KERNEL_TARGET_ENV = "FITSERVE_KERNEL_TARGET"

SHARED_MEMORY_PER_BLOCK: dict[tuple[int, int], int] = {
    (7, 0): 96 * 1024,  # V100
    (7, 5): 64 * 1024,  # T4, RTX 20xx
    (8, 0): 163 * 1024,  # A100
    (8, 6): 99 * 1024,  # A10, RTX 30xx
    (8, 7): 163 * 1024,  # Jetson Orin
    (8, 9): 99 * 1024,  # L4, L40, RTX 40xx
    (9, 0): 227 * 1024,  # H100, H200
    (10, 0): 227 * 1024,  # B200
    (12, 0): 99 * 1024,  # RTX 50xx
}
DEFAULT_SM_COUNT = 132  # an H100 SXM; used only where no CUDA device is at hand (the interpreter)
REGISTERS_PER_SM = 64 * 1024
MAX_REGISTERS_PER_THREAD = 255
# Triton converts float8 e4m3 (its fp8e4nv type) from this capability on; below it the kernels convert a
# float8 e4m3 KV cache's bytes themselves (kernels/fp8_bits.py). e5m2 converts on every target.
E4M3_CONVERSION_MIN_CAPABILITY = (8, 9)
# fp8 weights (the MoE experts' kernels, the dense W8A16 decode kernel) run on 16-bit tensor cores from
# Turing on: below 8.9 from their bytes (kernels/fp8_bits.py), without fp8 (W8A8) products
FP8_WEIGHTS_MIN_CAPABILITY = (7, 5)

_forced: tuple[int, int] | None = None


def parse_target(text: str) -> tuple[int, int]:
    """'sm75', 'sm_75', '7.5' or '75' -> (7, 5)."""
    digits = text.strip().lower().removeprefix("sm").lstrip("_")
    if "." in digits:
        major, minor = digits.split(".", 1)
    else:
        major, minor = digits[:-1], digits[-1:]
    if not (major.isdigit() and minor.isdigit()):
        raise ValueError(
            f"{KERNEL_TARGET_ENV}={text!r} is not a compute capability: write it as sm75, sm_75 or 7.5"
        )
    return int(major), int(minor)


@functools.cache
def _env_target() -> tuple[int, int] | None:
    text = os.environ.get(KERNEL_TARGET_ENV, "")
    return parse_target(text) if text else None


def forced() -> tuple[int, int] | None:
    """The target forced by forced_target() or FITSERVE_KERNEL_TARGET, or None."""
    return _forced if _forced is not None else _env_target()


@contextlib.contextmanager
def forced_target(capability: tuple[int, int]) -> Iterator[None]:
    """Within the block, kernel_capability() answers `capability` for every device (CPU tensors too)."""
    global _forced
    before, _forced = _forced, capability
    try:
        yield
    finally:
        _forced = before


@functools.cache
def _device_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def kernel_capability(device: torch.device) -> tuple[int, int] | None:
    """The capability the kernels on `device` are chosen for: the forced target if any, else the CUDA
    device's own; None for a device that is not CUDA."""
    target = forced()
    if target is not None:
        return target
    if device.type != "cuda":
        return None
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


def shared_memory_per_block(capability: tuple[int, int] | None) -> int:
    """Bytes of shared memory a block may use on `capability` (the H100's for None or newer GPUs, whose
    tuned configs fit it; the nearest older generation's for an unlisted one)."""
    if capability is None:
        return SHARED_MEMORY_PER_BLOCK[(9, 0)]
    known = [cap for cap in SHARED_MEMORY_PER_BLOCK if cap <= capability]
    return SHARED_MEMORY_PER_BLOCK[max(known)] if known else SHARED_MEMORY_PER_BLOCK[(7, 5)]


def has_e4m3_conversion(capability: tuple[int, int] | None) -> bool:
    """Whether Triton converts float8 e4m3 on `capability` (None: not a CUDA device, such as the unit
    tests' interpreter, which converts it on the CPU)."""
    return capability is None or capability >= E4M3_CONVERSION_MIN_CAPABILITY


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (DEFAULT_SM_COUNT off CUDA, for the interpreter)."""
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
