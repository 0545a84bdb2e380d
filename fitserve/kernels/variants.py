"""Every Triton kernel variant fitserve launches, compiled for a GPU it may not have, and checked against
that GPU's shared memory and registers (issue 35; tests/unit/test_kernel_targets.py).

A variant is what Triton compiles once: a kernel with its constexprs (tile sizes, flags such as USE_PDL,
the head dim's block), its argument dtypes and its launch options (num_warps, num_stages). Rather than
restating each launcher's choices, `compile_variants` runs the launchers themselves (the public functions
of fitserve/kernels/*.py) on CPU tensors over the shapes of LAUNCH_CASES (kernels/launch_cases.py), with
the capability forced to the target (kernels/capability.py) and the GPU's SM count faked, so every config
chooser picks what it would pick on that GPU. Each launch becomes a compile for the target (Triton's JIT
with warmup=True, under a stand-in driver that names the target): nothing runs, and no GPU or CUDA driver
is needed. Triton 3.6 bundles ptxas 12.8, which still assembles sm_70 (CUDA 13 dropped Volta: a V100 needs
a torch build for CUDA 12.x, such as cu126 or cu128; Triton uses its own ptxas either way).

Each compiled variant's shared memory comes from Triton's metadata (what the launch asks for), its registers
and local (spill) bytes a thread from cuobjdump --dump-resource-usage on the cubin; `launch_problems` says
what would keep it from launching. A variant that would not launch raises OutOfResources as its first
launch would on that GPU, so a launcher that falls back (gated_delta_chunk: one stage fewer) is seen
doing so. Registers never stop a launch in practice (Triton gives ptxas the block size, so it spills
instead), but the check stays.

Dtypes: fp16 activations on every target, bf16 from sm_80 (fitserve's auto-fit picks fp16 below 8.0);
KV caches in the activation dtype, float8 e5m2 and e4m3 on every target (Triton converts e4m3 from sm_89
on; below, the launchers pass the cache as uint8 and kernels/fp8_bits.py converts its bytes).
Below sm_80 Triton 3.6 lowers tl.dot to FMAs (no mma.sync for sm_70 or sm_75): those kernels run, on CUDA
cores, with their operands staged as float32 in shared memory, which sizes the choosers' tiles there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

from fitserve.kernels import capability
from fitserve.kernels.fast_launch import FastLaunchKernel
from fitserve.kernels.launch_cases import LAUNCH_CASES, Case


@dataclass(frozen=True)
class Target:
    name: str  # sm_75
    capability: tuple[int, int]
    gpu: str  # the GPU whose SM count the choosers see
    sms: int
    shared_per_block: int  # bytes a block may opt into

    @property
    def arch(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


def _target(name: str, gpu: str, sms: int) -> Target:
    cap = capability.parse_target(name)
    return Target(name, cap, gpu, sms, capability.SHARED_MEMORY_PER_BLOCK[cap])


TARGETS: tuple[Target, ...] = (
    _target("sm_70", "V100", 80),
    _target("sm_75", "T4", 40),
    _target("sm_80", "A100", 108),
    _target("sm_86", "A10", 72),
    _target("sm_89", "L4", 58),
    _target("sm_90", "H100", 132),
)
TARGETS_BY_NAME = {target.name: target for target in TARGETS}


@dataclass
class Variant:
    case: str  # the LAUNCH_CASES entry that reached it (the first one)
    kernel: str
    options: dict[str, Any]  # constexprs and launch options, as the launcher passed them
    signature: str  # the argument types Triton compiled for (pointer dtypes, int widths)
    usage: Usage | None = None  # None: it did not compile
    problems: list[str] = dataclasses.field(default_factory=list)  # why it would not launch on the target
    # the launcher caught the OutOfResources this variant raises and launched another (gated_delta_chunk)
    fell_back: bool = False
    key: str = ""  # Triton's hash of the compiled kernel

    def describe(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options.items() if k != "launch_pdl")
        return f"{self.kernel}({options}) [{self.signature}] from {self.case}"


@dataclass(frozen=True)
class Usage:
    shared: int  # bytes of shared memory a block requests
    registers: int  # a thread
    local: int  # bytes of local memory a thread (spills, stack arrays)
    num_warps: int

    def registers_per_block(self) -> int:
        # registers are allocated per warp in units of 256 (8 a thread)
        return self.num_warps * 32 * -(-self.registers // 8) * 8


def launch_problems(usage: Usage, target: Target) -> list[str]:
    """What keeps a kernel of this usage from launching on `target` (empty when it launches)."""
    problems = []
    if usage.shared > target.shared_per_block:
        problems.append(
            f"shared memory {usage.shared} B > {target.shared_per_block} B a block may use on {target.name}"
        )
    if usage.registers_per_block() > capability.REGISTERS_PER_SM:
        problems.append(
            f"registers {usage.registers} a thread x {usage.num_warps} warps = {usage.registers_per_block()}"
            f" > {capability.REGISTERS_PER_SM} on an SM"
        )
    return problems


# -- compiling without a GPU ---------------------------------------------------------------------------


class _TargetDriver:
    """Stands in for Triton's CUDA driver while compiling: names the target, never touches a GPU."""

    def __init__(self, target: Target) -> None:
        self.target = GPUTarget("cuda", target.arch, 32)
        self.device = 1000 + target.arch  # Triton keys its per-device caches by this

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"compiling for a target without a GPU: Triton asked its driver for {name!r}")


def _clear_caches() -> None:
    """Forgets what fitserve.kernels' cached functions remember of the GPU (SM counts, capability)."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("fitserve.kernels"):
            continue
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()


class TargetOutOfResources(OutOfResources):
    """What loading a variant that does not fit would raise on the target (launchers may catch it)."""

    def __init__(self, variant: Variant) -> None:
        super().__init__(0, 0, "; ".join(variant.problems))
        self.message = f"{variant.describe()}: {'; '.join(variant.problems)}"

    def __str__(self) -> str:
        return self.message


@contextlib.contextmanager
def compiling_for(
    target: Target, record: Callable[[Variant], None], case: Callable[[], str]
) -> Iterator[None]:
    """Within the block a kernel launch compiles the kernel for `target`, records it as a Variant and
    does not run it; one that would not launch on the target raises (TargetOutOfResources, or Triton's
    compile error) as the launch would. The choosers see the target's capability and SM count."""
    original_run = JITFunction.run
    original_launch = FastLaunchKernel.launch
    saved = {name: getattr(torch.cuda, name) for name in ("get_device_properties", "current_device")}
    properties = types.SimpleNamespace(
        name=target.gpu,
        major=target.capability[0],
        minor=target.capability[1],
        multi_processor_count=target.sms,
        shared_memory_per_block_optin=target.shared_per_block,
    )

    def compile_run(self, *args, grid, warmup, **kwargs):
        options = {k: v for k, v in kwargs.items() if k not in ("debug", "instrumentation_mode")}
        try:
            compiled = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:
            lines = str(error).strip().splitlines() or [""]
            problem = f"does not compile for {target.name}: {type(error).__name__}: {lines[-1][:300]}"
            record(Variant(case(), self.__name__, options, "", None, [problem]))
            raise
        signature = ", ".join(str(v) for v in compiled.src.signature.values() if v != "constexpr")
        usage = _usage(compiled)
        variant = Variant(case(), self.__name__, options, signature, usage, launch_problems(usage, target))
        variant.key = compiled.hash
        record(variant)
        if variant.problems:
            raise TargetOutOfResources(variant)
        return compiled

    def launch(self, grid, args, kwargs):
        self.function.run(*args, grid=grid, warmup=False, **kwargs)

    # some launchers accept CUDA tensors only (or the interpreter's) and count SMs off CUDA as the
    # interpreter's default: stand-ins that take the cases' CPU tensors (whose shapes the launchers take)
    # and answer the target's SM count
    standins = {"supports": lambda *args: True, "sm_count": lambda device: target.sms}
    patched = []
    names = (
        "int4_gemm",
        "nf4_gemm",
        "int4_dequant",
        "argmax",
        "skinny_gemm",
        "skinny_split_gemm",
        "swapped_gemm",
    )
    # every module imported before any is patched: one that imports another's function by name (as
    # skinny_split_gemm imports skinny_gemm's `supports`) would otherwise bind the stand-in for good
    modules = [importlib.import_module(f"fitserve.kernels.{name}") for name in names]
    for module in modules:
        for attribute, standin in standins.items():
            if hasattr(module, attribute):
                patched.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, standin)
    _clear_caches()
    active = driver._active  # None until a driver was needed (none is on a machine without a GPU)
    driver.set_active(_TargetDriver(target))
    JITFunction.run = compile_run
    FastLaunchKernel.launch = launch
    torch.cuda.get_device_properties = lambda device=None: properties
    torch.cuda.current_device = lambda: 0
    try:
        with capability.forced_target(target.capability):
            yield
    finally:
        JITFunction.run = original_run
        FastLaunchKernel.launch = original_launch
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
        driver._active = active
        for module, attribute, original in patched:
            setattr(module, attribute, original)
        _clear_caches()


def compile_variants(
    target: Target, full: bool = False, cases: dict[str, Case] | None = None
) -> Iterator[Variant]:
    """Runs each launch case for `target` (the whole sweep with full, else its representative subset) and
    yields the distinct variants compiled, case by case (with the first case that reached each one). A
    variant that would not launch and whose launcher did not fall back ends its case (as it would end
    the run on that GPU); one whose launcher caught it and launched another is marked fell_back. A case
    that fails otherwise yields a Variant of kernel '<case failed>' carrying the error."""
    variants: dict[Any, Variant] = {}
    current = [""]

    def record(variant: Variant) -> None:
        key = variant.key or (variant.kernel, repr(variant.options), variant.problems[0])
        variants.setdefault(key, variant)

    with compiling_for(target, record, lambda: current[0]):
        for name, case in (cases or LAUNCH_CASES).items():
            current[0] = name
            seen = len(variants)
            failed = None
            try:
                case(target, full)
            except Exception as error:  # noqa: BLE001 - reported with the case's name
                failed = error
            new = list(variants.values())[seen:]
            troubled = [variant for variant in new if variant.problems]
            # the launchers caught every one (the case went on), or all but the last (which ended it)
            for variant in troubled if failed is None else troubled[:-1]:
                variant.fell_back = True
            if failed is not None and not troubled:
                lines = str(failed).strip().splitlines() or [""]
                message = f"{type(failed).__name__}: {lines[-1][:400]}"
                new.append(Variant(name, "<case failed>", {}, "", None, [message]))
            yield from new


@functools.cache
def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _usage(compiled: Any) -> Usage:
    """Shared memory (Triton's metadata), registers and local bytes a thread (cuobjdump of the cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        done = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        )
    found = _USAGE.search(done.stdout)
    if found is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {done.stdout[-500:]}")
    registers, stack, static_shared, local = map(int, found.groups())
    shared = max(compiled.metadata.shared, static_shared)
    return Usage(shared, registers, max(local, stack), compiled.metadata.num_warps)


def report(
    target: Target, full: bool = False, cases: dict[str, Case] | None = None
) -> Iterator[dict[str, Any]]:
    """One JSON-able row per variant for `target`: case, kernel, options, signature, usage, problems
    (those that keep it from launching; empty for one that launches or whose launcher fell back)."""
    for variant in compile_variants(target, full, cases):
        row: dict[str, Any] = {"case": variant.case, "kernel": variant.kernel, "options": variant.options}
        row["signature"] = variant.signature
        if variant.usage is not None:
            row.update(dataclasses.asdict(variant.usage))
        row["problems"] = [] if variant.fell_back else variant.problems
        if variant.fell_back:
            row["fell_back"] = variant.problems
        yield row


def main(argv: list[str]) -> None:
    """python -m fitserve.kernels.variants [--full] sm_75 [case ...]: a JSON line per variant."""
    import json

    full = "--full" in argv
    argv = [arg for arg in argv if arg != "--full"]
    if not argv or argv[0] not in TARGETS_BY_NAME:
        raise SystemExit(
            f"usage: python -m fitserve.kernels.variants [--full] TARGET [CASE ...]; TARGET one of "
            f"{', '.join(TARGETS_BY_NAME)}, CASE of {', '.join(LAUNCH_CASES)}"
        )
    names = argv[1:] or list(LAUNCH_CASES)
    for row in report(TARGETS_BY_NAME[argv[0]], full, {name: LAUNCH_CASES[name] for name in names}):
        print(json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
