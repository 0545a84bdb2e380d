"""kernels/nf4_pack.permute_table: the byte tables nf4_gemm's LOOKUP 4 (one-row GPU kernel) picks from. Each
code's float16 value must be its low byte at byte (c % 4) of word c // 4 and its high byte at the same
place of word 4 + c // 4, for the nf4 and fp4 tables; and past 16 rows the kernels keep tl.gather."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.nf4_pack import permute_table
from fitserve.layers.quantization.bnb_weight import code_table


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_every_code_reassembles_from_its_two_bytes(quant_type: str) -> None:
    code = code_table(quant_type)
    words = [int(w) & 0xFFFFFFFF for w in permute_table(code)]
    assert permute_table(code).dtype == torch.int32 and len(words) == 8
    for c in range(16):
        low = (words[c // 4] >> (8 * (c % 4))) & 0xFF
        high = (words[4 + c // 4] >> (8 * (c % 4))) & 0xFF
        value = torch.tensor([low | (high << 8)], dtype=torch.int32).to(torch.int16).view(torch.float16)
        assert value.item() == code[c].half().item(), (quant_type, c)


def test_up_to_16_rows_take_the_permute_lookup() -> None:
    pytest.importorskip("triton")
    from fitserve.kernels import nf4_gemm

    one_row = nf4_gemm.choose_config(1, 4096, 4096, 64, 132)
    assert one_row.kernel == "gemv" and one_row.lookup == nf4_gemm.PERMUTE_LOOKUP
    assert nf4_gemm.choose_config(16, 4096, 4096, 64, 132).lookup == nf4_gemm.PERMUTE_LOOKUP
    assert nf4_gemm.choose_config(17, 4096, 4096, 64, 132).lookup == nf4_gemm.LOOKUP == 3
    # splits of at least GEMV_MIN_STEPS 64-code steps, at most GEMV_PROGRAMS_PER_SM programs an SM
    assert [
        nf4_gemm.choose_config(1, n, k, 64, 132).split_k
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336))
    ] == [8, 4, 16]
