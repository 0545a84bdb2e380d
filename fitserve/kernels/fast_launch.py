"""Launching fitserve's Triton kernels with less host work per call than `kernel[grid](...)`.

On every launch Triton's `JITFunction.run` binds the arguments, works out their specialization,
builds a cache key (formatting the compile options as a string) and checks the kernel's globals. On
the GPU machine's CPU one RMSNorm launch took 22.1 us that way, 12.5 us through this module and 5.9 us
for the compiled kernel's own launcher alone (`benchmarks/gpu/launch_cost.py`; 31.5 against 6.9 us on
a slower moment of that CPU). Decode steps replay CUDA graphs and do not care, but an eager step (a
prefill chunk, a mixed batch) launches ~140 Triton kernels on the Qwen3-0.6B shape, and on a slow CPU
its host time, not the GPU's, sets the step's length.

`fast_launch(jit_function)` returns a kernel that launches the same way (`kernel[grid](*args,
**kwargs)`) but keeps each compiled kernel under a key computed here from what Triton specializes on:
each tensor's dtype and 16-byte alignment; each int's range (32/64-bit, unsigned), whether it is 1 and
whether it is a multiple of 16; a TMA descriptor's dtype, box, padding and 16-byte alignments; the type
of every other argument (a bool's value too); every keyword argument (constexprs and launch options) by
value; and the device. That key is at least as fine as Triton's own, so a hit never picks a kernel
compiled for other arguments; a miss goes through `JITFunction.run`, which compiles (or finds) and
launches the right one, and is remembered. While a Triton launch hook is installed (Triton's profiler,
proton), every launch takes `JITFunction.run` so the hook sees it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
from triton import knobs
from triton.runtime import driver
from triton.tools.tensor_descriptor import TensorDescriptor

_INT32_MIN, _INT32_MAX, _UINT64_FROM = -(1 << 31), (1 << 31) - 1, 1 << 63


# Triton's CPU interpreter (the unit tests' TRITON_INTERPRET=1, read once at import as Triton does): kernels
# run as Python functions there, with no inline PTX and no Gluon
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def specialization_key(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Per positional argument, the properties Triton may compile a kernel differently for; None when
    an argument is of a type not listed here (that launch then takes JITFunction.run)."""
    key: list[Any] = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            key.append((arg == 1, arg % 16 == 0, _INT32_MIN <= arg <= _INT32_MAX, arg >= _UINT64_FROM))
        elif kind is torch.Tensor or isinstance(arg, torch.Tensor):
            key.append((arg.dtype, arg.data_ptr() % 16 == 0))
        elif kind is float or arg is None:  # floats are passed as fp32, never specialized
            key.append(kind)
        elif kind is bool:
            key.append((bool, arg))
        elif kind is TensorDescriptor:  # a host-side TMA descriptor: its tensor's and its box's properties
            sixteens = tuple(int(n) % 16 == 0 for n in (*arg.shape, *arg.strides))
            aligned = arg.base.data_ptr() % 16 == 0
            key.append((kind, arg.base.dtype, tuple(arg.block_shape), arg.padding, aligned, sixteens))
        else:
            return None
    return tuple(key)


def launch_hooks_installed() -> bool:
    """Whether a Triton launch hook is set (Triton 3.6 keeps an empty HookChain when none is)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLaunchKernel:
    """A JITFunction whose `[grid](...)` launches skip JITFunction.run after the first call of each
    specialization. Other attributes are the JITFunction's."""

    def __init__(self, function: triton.JITFunction) -> None:
        self.function = function
        self._defaults = {param.name: param.default for param in function.params if param.has_default}
        self._names = function.arg_names
        self._compiled: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.function, name)

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        device = driver.active.get_current_device()
        arguments = specialization_key(args)
        key = (device, arguments, tuple(kwargs.items()))
        kernel = self._compiled.get(key)
        if kernel is None or launch_hooks_installed():
            kernel = self.function.run(*args, grid=grid, warmup=False, **kwargs)
            if arguments is not None:
                self._compiled[key] = kernel
            return
        # The launcher takes every parameter in signature order (constexprs too, which it skips).
        values = list(args)
        for name in self._names[len(args) :]:
            values.append(kwargs[name] if name in kwargs else self._defaults[name])
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        stream = driver.active.get_current_stream(device)
        no_hooks = (None, None, None)  # launch metadata, enter hook, exit hook (none installed, above)
        launch = kernel.run
        launch(grid[0], grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, *no_hooks, *values)


def fast_launch(function: triton.JITFunction) -> FastLaunchKernel:
    """Decorator, above `@triton.jit`, for a kernel launched from the host (not one called by
    other kernels)."""
    return FastLaunchKernel(function)


def host_launched(function: triton.JITFunction) -> FastLaunchKernel | triton.JITFunction:
    """A kernel launched from the host: `fast_launch`'s wrapper, or the function itself under the
    interpreter (INTERPRETING), which runs it."""
    return function if INTERPRETING else fast_launch(function)
