"""Compiling a kernel here (no GPU: Triton's bundled ptxas) and reading its SASS: what the tests of the
register-fed tensor-core kernels (kernels/int4_mma_gemv.py, nf4_mma_gemv.py: Gluon, `sass_of`; import
after pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")) check their loops with,
and the fp8 MoE kernels' (Triton, `triton_sass_of`) their MMA instructions."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# what moves data between threads, or spills: none of it may sit in a register-fed loop
MOVES = ("SHFL", "LDS", "STS", "LDSM", "LDL", "STL")


def sass_of(kernel, arch: int, signature: dict, constexprs: dict, aligned: list[str]) -> str:
    """The SASS of the Gluon `kernel` compiled for sm_`arch` with `signature` (argument -> Triton type),
    the constexprs' values (num_warps among them), and the `aligned` arguments taken as multiples of 16."""
    from triton.experimental.gluon._runtime import GluonASTSource

    num_warps = constexprs.get("num_warps", 4)  # a Gluon kernel's parameter as well
    return _compiled_sass(GluonASTSource, kernel, arch, signature, constexprs, aligned, num_warps)


def triton_sass_of(
    kernel, arch: int, signature: dict, constexprs: dict, aligned: list[str], num_warps: int = 4
) -> str:
    """sass_of for a Triton kernel (a JITFunction, or fast_launch's wrapper of one)."""
    return _compiled_sass(ASTSource, kernel, arch, signature, constexprs, aligned, num_warps)


def _compiled_sass(
    source_type, kernel, arch: int, signature: dict, constexprs: dict, aligned: list[str], num_warps: int
) -> str:
    function = getattr(kernel, "function", kernel)
    signature = dict(signature) | {name: "constexpr" for name in constexprs}
    names = list(function.arg_names)  # the signature in the kernel's own order
    missing = set(names) ^ set(signature)
    assert not missing, f"arguments without a type or not the kernel's: {sorted(missing)}"
    signature = {name: signature[name] for name in names}
    source = source_type(
        function,
        signature,
        {(names.index(name),): value for name, value in constexprs.items()},
        {(names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as cubin:
        cubin.write(compiled.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    try:
        return subprocess.run(
            [f"{tools}/cuobjdump", "-sass", cubin.name], capture_output=True, text=True
        ).stdout
    finally:
        os.unlink(cubin.name)


def main_loop(sass: str) -> collections.Counter:
    """Opcode counts of the loop (a backward branch's body) that holds the HMMAs."""
    instructions = []
    for line in sass.splitlines():
        found = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*);", line)
        if found:
            instructions.append((int(found.group(1), 16), found.group(2), found.group(3)))
    loops = []
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            loops.append(collections.Counter(op for at, op, _ in instructions if start <= at <= address))
    with_mma = [loop for loop in loops if loop["HMMA"]]
    assert len(with_mma) == 1, [dict(loop) for loop in loops]
    return with_mma[0]
