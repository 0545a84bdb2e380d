"""kernels/nf4_mma_gemv.py compiled here (no GPU: Triton's bundled ptxas, SM 8.0 and 9.0): its layouts must
hold, in each thread, exactly the elements of the MMA's operand layouts (the codes' values go from the
lookup, x from its loads, to `mma.sync` without moving between threads), so the main loop has no SHFL,
LDS, STS, LDSM or local memory; 16 HMMAs a block (4 groups of 64 codes, 4 k-steps each); and its length
a weight stays near the byte-permute lookup's 21 instructions a word of 8 codes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")  # Gluon's mma_v2: Triton 3.6+

from fitserve.kernels import nf4_mma_gemv  # noqa: E402
from tests.unit.sass_helpers import MOVES, main_loop, sass_of  # noqa: E402

POINTERS = ("x_ptr", "w_ptr", "s_ptr", "bias_ptr", "y_ptr", "part_ptr", "counter_ptr", "table_ptr")
INTS = ("M", "N", "K", "stride_xm", "stride_ym", "stride_wn", "stride_sn", "blocks_per_split", "num_splits")


@pytest.mark.parametrize(("arch", "dtype"), [(90, "bf16"), (90, "fp16"), (80, "bf16")])
@pytest.mark.parametrize("scales", ["fp16", "fp32"])
def test_the_loop_moves_no_data_between_threads(arch: int, dtype: str, scales: str) -> None:
    types = {"part_ptr": "*fp32", "w_ptr": "*i32", "counter_ptr": "*i32", "table_ptr": "*i32"}
    types["s_ptr"] = f"*{scales}"
    signature = {name: types.get(name, f"*{dtype}") for name in POINTERS} | {name: "i32" for name in INTS}
    constexprs = {
        "HAS_BIAS": False,
        "BLOCK_M": 8,
        "ROW_TILES": 1,
        "BLOCKSIZE": 64,
        "SPLIT": True,
        "USE_PDL": arch >= 90,
        "num_warps": 4,
    }
    aligned = [*POINTERS, "N", "K", "stride_xm", "stride_ym", "stride_wn", "stride_sn"]
    loop = main_loop(sass_of(nf4_mma_gemv._nf4_mma_gemv_kernel, arch, signature, constexprs, aligned))
    moved = {opcode: loop[opcode] for opcode in MOVES if loop[opcode]}
    assert not moved, f"the loop moves data between threads: {moved}"
    # a block is 16 k-steps of m16n8k16 per warp (16 weight rows x 256 codes = 4,096 weights a warp)
    assert loop["HMMA"] == 16, dict(loop)
    # 256 PRMTs a block are the lookup's (8 a 4 codes); more would be x's pairs rebuilt in the loop
    assert loop["PRMT"] <= 264, dict(loop)
    # 425 instructions a warp a block at the time of writing, ~3.3 a weight, plus ~130 IMAD.U32 where
    # ptxas keeps the table words in uniform registers and copies them before each PRMT (a per-lane copy
    # of the table avoids those, with 80 registers instead of 126, and measured 15-50% slower on the
    # H100); the bound leaves ptxas some room
    assert sum(loop.values()) * 32 / 4096 <= 4.5, dict(loop)
