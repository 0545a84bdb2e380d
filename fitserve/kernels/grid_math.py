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
