"""kernels/nf4_pack.permute_table: the byte tables the byte-permute lookups (nf4_gemm's LOOKUP 4, the
register-fed kernel nf4_mma_gemv) pick from. Each code's float16 (or bfloat16) value must be its low byte at
byte (c % 4) of word c // 4 and its high byte at the same place of word 4 + c // 4, for the nf4 and fp4
tables; past 16 rows the kernels keep tl.gather; up to 8 rows the register-fed kernel runs where it may."""

from __future__ import annotations

import pytest
import torch

from fitserve.kernels.nf4_pack import permute_table
from fitserve.layers.quantization.bnb_weight import code_table


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_every_code_reassembles_from_its_two_bytes(quant_type: str, dtype: torch.dtype) -> None:
    code = code_table(quant_type)
    table = permute_table(code, dtype)
    words = [int(w) & 0xFFFFFFFF for w in table]
    assert table.dtype == torch.int32 and len(words) == 8
    for c in range(16):
        low = (words[c // 4] >> (8 * (c % 4))) & 0xFF
        high = (words[4 + c // 4] >> (8 * (c % 4))) & 0xFF
        value = torch.tensor([low | (high << 8)], dtype=torch.int32).to(torch.int16).view(dtype)
        assert value.item() == code[c].to(dtype).item(), (quant_type, c)


def test_pack_nf4_keeps_the_table_of_its_activation_dtype() -> None:
    from fitserve.kernels.nf4_pack import pack_nf4
    from fitserve.layers.quantization.bnb_weight import random_nf4_weight

    weight = random_nf4_weight(16, 256, 64, 0.02, torch.Generator().manual_seed(0), "cpu")
    for dtype in (torch.bfloat16, torch.float16):
        packed = pack_nf4(weight.packed, weight.absmax, weight.code, 64, dtype)
        assert torch.equal(packed.mma_table, permute_table(weight.code, dtype))
        assert torch.equal(packed.permute_table, permute_table(weight.code))


def test_up_to_8_rows_take_the_register_fed_kernel_where_it_may() -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from fitserve.kernels import nf4_gemm

    for rows in (1, 8):
        config = nf4_gemm.choose_config(rows, 6144, 4096, 64, 132, mma=True)
        assert (config.kernel, config.block_m, config.block_n, config.block_k) == ("mma", 8, 64, 256)
    assert nf4_gemm.choose_config(9, 6144, 4096, 64, 132, mma=True).kernel == "dot"
    assert nf4_gemm.choose_config(1, 6144, 4096, 64, 132, mma=False).kernel == "gemv"
    # even splits of >= 2 blocks of 256 codes, at most MMA_PROGRAMS_PER_SM programs an SM and MMA_MAX_SPLITS:
    # qkv's 96 tiles take 8 splits of 2 blocks, gate_up's 448 two, down's 64 tiles 8 splits of 7 blocks
    assert [
        nf4_gemm.choose_config(1, n, k, 64, 132, mma=True).split_k
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336))
    ] == [8, 2, 8]


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


def test_an_mma_config_where_it_cannot_run_is_refused_with_the_fix(monkeypatch) -> None:
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
    from fitserve.kernels import nf4_gemm
    from fitserve.kernels.nf4_pack import pack_nf4
    from fitserve.layers.quantization.bnb_weight import random_nf4_weight

    # under the interpreter CPU tensors pass `supports`, and the mma kernel (inline PTX) cannot run
    monkeypatch.setattr(nf4_gemm, "INTERPRETING", True)
    weight = random_nf4_weight(64, 512, 64, 0.02, torch.Generator().manual_seed(0), "cpu")
    packed = pack_nf4(weight.packed, weight.absmax, weight.code, 64, torch.bfloat16)
    x = torch.randn(2, 512).to(torch.bfloat16)
    assert not nf4_gemm.mma_kernel_ok(x, packed)
    refusal = r"up to 8 rows \(here 2\).*SM 8.0\+ GPU.*use kernel 'gemv' or 'dot'"
    with pytest.raises(ValueError, match=refusal):
        nf4_gemm.nf4_linear(x, packed, None, nf4_gemm.Nf4Config("mma", 8, 64, 256, 1))
