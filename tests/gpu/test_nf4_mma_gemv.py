"""The register-fed tensor-core nf4 / fp4 GEMM (kernels/nf4_mma_gemv.py) on the GPU, 1 to 8 rows.

Two references: the kernel's own arithmetic (each code's value rounded to x's dtype, times the float32
absmax, summed in float32), which it must match to float32 summation noise (|y - ref| <= 2**-12 max|ref|
before y's rounding to x's dtype: a wrong nibble, pair, group or row gives errors of order max|ref|); and
the dequantized weight (nf4_pack.dequantize_packed), within the fused kernels' tolerance. Also: Llama-3.1-8B
and Qwen3-8B shapes, block sizes 64 to 4096, fp4, bias, split-K determinism and counters left at zero,
strided x, CUDA-graph capture, and the shapes and configs it refuses.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import nf4_gemm  # noqa: E402
from fitserve.kernels.nf4_gemm import Nf4Config, choose_config, mma_kernel_ok, nf4_linear  # noqa: E402
from fitserve.kernels.nf4_pack import dequantize_packed, pack_nf4  # noqa: E402
from fitserve.layers.quantization.bnb_weight import random_nf4_weight  # noqa: E402

pytestmark = pytest.mark.gpu

# (K, N): Llama-3.1-8B's qkv, o, gate_up, down; Qwen3-8B's qkv and down
SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 8192), (12288, 4096))
TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-8}


def packed_of(out_features, in_features, blocksize, dtype, quant_type="nf4", seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight = random_nf4_weight(out_features, in_features, blocksize, 0.02, generator, "cuda", quant_type)
    return pack_nf4(weight.packed, weight.absmax, weight.code, blocksize, dtype)


def kernel_reference(x: torch.Tensor, packed) -> torch.Tensor:
    """x @ W.T computed as the kernel does: code values rounded to x's dtype, scaled in float32."""
    code = packed.code.to(x.dtype).float()
    low = packed.packed & 15
    high = packed.packed >> 4
    codes = torch.stack((high, low), dim=-1).reshape(packed.out_features, -1).long()
    values = code[codes].view(packed.out_features, -1, packed.blocksize)
    weight = (values * packed.scales.float().unsqueeze(-1)).view(packed.out_features, -1)
    return x.float() @ weight.T


def close(y: torch.Tensor, reference: torch.Tensor, tolerance: float) -> float:
    error = ((y.float() - reference).abs().max() / reference.abs().max()).item()
    assert error <= tolerance, error
    return error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_model_shapes_one_to_eight_rows(in_features: int, out_features: int, dtype) -> None:
    packed = packed_of(out_features, in_features, 64, dtype)
    dequantized = dequantize_packed(packed)
    for rows in (1, 2, 3, 5, 8):
        x = torch.randn(rows, in_features, device="cuda").to(dtype)
        assert mma_kernel_ok(x, packed)
        y = nf4_linear(x, packed)
        # y is rounded to x's dtype once (half an ulp: 2**-9 of bfloat16, 2**-12 of float16) past the sum
        close(y, kernel_reference(x, packed), 2**-12 + (2**-8 if dtype == torch.bfloat16 else 2**-11))
        close(y, x.float() @ dequantized.T, TOLERANCE[dtype])
        assert not packed.counters.any()
        assert torch.equal(y, nf4_linear(x, packed)), "split-K must be deterministic"


@pytest.mark.parametrize(
    ("blocksize", "quant_type"), [(64, "fp4"), (128, "nf4"), (256, "fp4"), (4096, "nf4")]
)
def test_block_sizes_fp4_and_bias(blocksize: int, quant_type: str) -> None:
    packed = packed_of(3072, 8192, blocksize, torch.bfloat16, quant_type, seed=1)
    bias = torch.randn(3072, device="cuda").to(torch.bfloat16)
    x = torch.randn(4, 8192, device="cuda").to(torch.bfloat16)
    y = nf4_linear(x, packed, bias)
    close(y, kernel_reference(x, packed) + bias.float(), 2**-12 + 2**-8)


def test_every_split_and_row_tiling_gives_the_same_product() -> None:
    packed = packed_of(1000, 4096, 64, torch.bfloat16, seed=2)  # N not a multiple of the 64-row tile
    x = torch.randn(6, 4096, device="cuda").to(torch.bfloat16)
    reference = kernel_reference(x, packed)
    for split in (1, 2, 3, 16):
        for warps, tiles in ((4, 1), (2, 2), (8, 1)):
            config = Nf4Config("mma", 8, 16 * warps * tiles, 256, split, num_warps=warps)
            close(nf4_linear(x, packed, None, config), reference, 2**-12 + 2**-8)
            assert not packed.counters.any()


def test_strided_x_and_cuda_graphs() -> None:
    packed = packed_of(4096, 4096, 64, torch.bfloat16, seed=3)
    wide = torch.randn(3, 4096 + 512, device="cuda").to(torch.bfloat16)
    x = wide[:, 256 : 256 + 4096]  # rows 4608 apart, starting 512 bytes in
    assert mma_kernel_ok(x, packed)
    close(nf4_linear(x, packed), kernel_reference(x, packed), 2**-12 + 2**-8)
    static = torch.randn(2, 4096, device="cuda").to(torch.bfloat16)
    nf4_linear(static, packed)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nf4_linear(static, packed)
    static.copy_(torch.randn(2, 4096, device="cuda").to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    close(out, kernel_reference(static, packed), 2**-12 + 2**-8)


def test_what_it_does_not_take_goes_to_the_other_kernels() -> None:
    x = torch.randn(2, 4096 + 64, device="cuda").to(torch.bfloat16)
    odd_k = packed_of(512, 4096 + 64, 64, torch.bfloat16)  # K not a multiple of 256
    assert not mma_kernel_ok(x, odd_k)
    assert choose_config(2, 512, 4096 + 64, 64, 132, mma=False).kernel == "dot"
    close(nf4_linear(x, odd_k), x.float() @ dequantize_packed(odd_k).T, TOLERANCE[torch.bfloat16])
    small_blocks = packed_of(512, 4096, 32, torch.bfloat16)
    assert not mma_kernel_ok(x[:, :4096], small_blocks)
    nine = torch.randn(9, 4096, device="cuda").to(torch.bfloat16)
    packed = packed_of(512, 4096, 64, torch.bfloat16)
    assert choose_config(9, 512, 4096, 64, 132, mma=True).kernel == "dot"
    with pytest.raises(ValueError, match="the mma kernel takes up to 8 rows"):
        nf4_linear(nine, packed, None, Nf4Config("mma", 8, 64, 256, 1))
    with pytest.raises(ValueError, match="absmax blocks of >= 64 codes"):
        nf4_linear(x[:, :4096], small_blocks, None, Nf4Config("mma", 8, 64, 256, 1))
    nf4_gemm.MMA_DECODE = False
    try:
        assert not mma_kernel_ok(nine[:1], packed)
    finally:
        nf4_gemm.MMA_DECODE = True
