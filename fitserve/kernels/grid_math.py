"""Block and grid sizes computed on the host, in plain Python.

`triton.next_power_of_2` and `triton.cdiv` are constexpr functions: called from host code each goes
through Triton's constexpr wrapper (a few microseconds on the GPU machine's CPU), and an eager step
computes hundreds of them. These give the same values.
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n; 0 for 0, as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints."""
    return (a + b - 1) // b


def even_splits(steps: int, most: int, min_steps: int) -> int:
    """The most splits, up to `most`, of `steps` loop steps into parts of cdiv(steps, splits) and at least
    `min_steps` steps whose last part is at most one step shorter than the others (16 steps: 4 or 8
    splits, never 6, which leaves a last part of 1 beside five of 3 and the SMs holding those waiting).
    Used by the split-K rules of the batch-1 GEMMs (int4_gemm, fp8_w8a16)."""
    for splits in range(max(1, min(most, steps // min_steps)), 1, -1):
        part = cdiv(steps, splits)
        if steps - (splits - 1) * part >= part - 1:
            return splits
    return 1


def heads_per_program(num_heads: int, block_d: int, tile: int = 1024) -> int:
    """How many heads of `block_d` values (a power of two) a per-head kernel gives one program: enough to
    fill `tile` values, no more than the heads there are (rounded up to a power of two), at least one."""
    return max(1, min(next_power_of_2(num_heads), tile // block_d))
