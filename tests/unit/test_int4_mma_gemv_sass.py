"""kernels/int4_mma_gemv.py compiled here (no GPU: Triton's bundled ptxas, SM 8.0 and 9.0): its layouts must
hold, in each thread, exactly the elements of the MMA's operand layouts, so that the weights and x go from
their loads to `mma.sync` without moving between threads. A layout that put an element in another lane
would still compile, into warp shuffles (or shared memory), so the test reads the SASS of the main loop:
no SHFL, LDS, STS, LDSM or local memory there, its HMMA count, and its length per weight.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")  # Gluon's mma_v2: Triton 3.6+

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from fitserve.kernels import int4_mma_gemv  # noqa: E402

POINTERS = ("x_ptr", "qw_ptr", "sz_ptr", "bias_ptr", "y_ptr", "part_ptr", "counter_ptr")
INTS = (
    "M",
    "N",
    "K",
    "stride_xm",
    "stride_qn",
    "stride_ym",
    "blocks_per_group",
    "blocks_per_split",
    "num_splits",
)
MOVES = ("SHFL", "LDS", "STS", "LDSM", "LDL", "STL")


def sass_of(arch: int, dtype: str, constexprs: dict) -> str:
    kernel = int4_mma_gemv._int4_mma_gemv_kernel
    function = getattr(kernel, "function", kernel)
    types = {"part_ptr": "*fp32", "qw_ptr": "*i32", "counter_ptr": "*i32"}
    signature = {name: types.get(name, f"*{dtype}") for name in POINTERS} | {name: "i32" for name in INTS}
    signature |= {name: "constexpr" for name in constexprs}
    names = list(signature)
    aligned = [*POINTERS, "N", "K", "stride_xm", "stride_qn", "stride_ym"]
    source = GluonASTSource(
        function,
        signature,
        {(names.index(name),): value for name, value in constexprs.items()},
        {(names.index(name),): [["tt.divisibility", 16]] for name in aligned},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
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


@pytest.mark.parametrize(("arch", "dtype"), [(90, "bf16"), (90, "fp16"), (80, "bf16")])
@pytest.mark.parametrize("group_codes", [128, 32, 256])
def test_the_loop_moves_no_data_between_threads(arch: int, dtype: str, group_codes: int) -> None:
    constexprs = {
        "HAS_BIAS": False,
        "BLOCK_M": 8,
        "ROW_TILES": 1,
        "GROUP_CODES": group_codes,
        "EVEN_K": True,
        "SPLIT": True,
        "USE_PDL": arch >= 90,
        "num_warps": 4,
    }
    loop = main_loop(sass_of(arch, dtype, constexprs))
    moved = {opcode: loop[opcode] for opcode in MOVES if loop[opcode]}
    assert not moved, f"the loop moves data between threads: {moved}"
    # a block is 16 k-steps of m16n8k16 per warp (16 weight rows x 256 codes = 4,096 weights a warp)
    assert loop["HMMA"] == 16, dict(loop)
    # instructions a weight at the time of writing: ~3.05 (388-392 a warp a block; groups of 32 codes,
    # with four scales a row a block: ~3.7-3.8); the bound leaves ptxas some room
    bound = 4.0 if group_codes == 32 else 3.3
    assert sum(loop.values()) * 32 / 4096 <= bound, dict(loop)
