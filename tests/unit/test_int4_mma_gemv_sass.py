"""kernels/int4_mma_gemv.py compiled here (no GPU: Triton's bundled ptxas, SM 8.0 and 9.0): its layouts must
hold, in each thread, exactly the elements of the MMA's operand layouts, so that the weights and x go from
their loads to `mma.sync` without moving between threads. A layout that put an element in another lane
would still compile, into warp shuffles (or shared memory), so the test reads the SASS of the main loop:
no SHFL, LDS, STS, LDSM or local memory there, its HMMA count, and its length per weight.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")  # Gluon's mma_v2: Triton 3.6+

from fitserve.kernels import int4_mma_gemv  # noqa: E402
from tests.unit.sass_helpers import MOVES, main_loop, sass_of  # noqa: E402

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
    types = {"part_ptr": "*fp32", "qw_ptr": "*i32", "counter_ptr": "*i32"}
    signature = {name: types.get(name, f"*{dtype}") for name in POINTERS} | {name: "i32" for name in INTS}
    aligned = [*POINTERS, "N", "K", "stride_xm", "stride_qn", "stride_ym"]
    loop = main_loop(sass_of(int4_mma_gemv._int4_mma_gemv_kernel, arch, signature, constexprs, aligned))
    moved = {opcode: loop[opcode] for opcode in MOVES if loop[opcode]}
    assert not moved, f"the loop moves data between threads: {moved}"
    # a block is 16 k-steps of m16n8k16 per warp (16 weight rows x 256 codes = 4,096 weights a warp)
    assert loop["HMMA"] == 16, dict(loop)
    # instructions a weight at the time of writing: ~2.8 (360-361 a warp a block; groups of 32 codes,
    # with four scales a row a block: ~3.6); the bound leaves ptxas some room
    bound = 4.0 if group_codes == 32 else 3.3
    assert sum(loop.values()) * 32 / 4096 <= bound, dict(loop)
