"""The int4 (W4A16) GEMM kernels against x.float() @ dequantize_reference(...).T, at every group size, row
counts from 1 to 1024 and the Llama-3.1-8B / Llama-3.3-70B weight shapes; split-K, CUDA graphs, bias.

Tolerance: |y - ref| <= tol * max|ref| with tol 2**-6 for bfloat16 and 2**-8 for float16. The kernels
keep scales and zero points in the activation dtype, the tensor-core kernel rounds each dequantized
weight to it, and y is rounded to it; everything else accumulates in float32. (A wrong group, nibble or
zero point gives errors of order max|ref|.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels.int4_gemm import (  # noqa: E402
    GEMV_MAX_ROWS,
    Int4GemmConfig,
    choose_config,
    int4_linear,
)
from fitserve.kernels.int4_repack import (  # noqa: E402
    dequantize_packed,
    dequantize_reference,
    repack_int4,
    unpack_codes,
)

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-8}
ROWS = (1, 3, 16, 17, 64, 257, 1024)
# (K, N) of the Llama-3.1-8B and Llama-3.3-70B linear layers (qkv, o, gate_up, down)
LLAMA_8B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))
LLAMA_70B = ((8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192))


def random_int4(out_features: int, in_features: int, group_size: int, seed: int = 0, integer_zeros=True):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    groups = in_features // group_size
    codes = torch.randint(
        0, 16, (out_features, in_features), dtype=torch.uint8, device="cuda", generator=generator
    )
    scales = 0.002 + 0.01 * torch.rand(out_features, groups, device="cuda", generator=generator)
    zeros = torch.randint(0, 16, (out_features, groups), device="cuda", generator=generator).float()
    if not integer_zeros:
        zeros += 0.5 * torch.rand(out_features, groups, device="cuda", generator=generator)
    return codes, scales, zeros


def check(
    rows: int,
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
    with_bias: bool = False,
    config: Int4GemmConfig | None = None,
    integer_zeros: bool = True,
) -> torch.Tensor:
    codes, scales, zeros = random_int4(out_features, in_features, group_size, rows, integer_zeros)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    generator = torch.Generator(device="cuda").manual_seed(rows + 1)
    x = torch.randn(rows, in_features, device="cuda", generator=generator).to(dtype)
    bias = torch.randn(out_features, device="cuda", generator=generator).to(dtype) if with_bias else None
    y = int4_linear(x, packed, bias, config=config)
    assert y.shape == (rows, out_features) and y.dtype == dtype
    reference = x.float() @ dequantize_reference(codes, scales, zeros, group_size).T
    if bias is not None:
        reference += bias.float()
    tolerance = TOLERANCE[dtype]
    error = (y.float() - reference).abs().max().item()
    assert error <= tolerance * reference.abs().max().item(), (error, reference.abs().max().item())
    assert not packed.counters.any()  # split-K leaves its counters at zero
    return y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, "per-channel"])
@pytest.mark.parametrize("rows", ROWS)
def test_matches_dequantized_reference(rows: int, group_size, dtype: torch.dtype) -> None:
    in_features = 1024
    group_size = in_features if group_size == "per-channel" else group_size
    check(rows, 16 * 37, in_features, group_size, dtype, with_bias=rows % 2 == 1)  # N = 592, odd x 16


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 257])
@pytest.mark.parametrize("in_features", [1056, 4128])  # not multiples of the 256-code block
def test_k_not_a_multiple_of_the_block(rows: int, in_features: int) -> None:
    check(rows, 16 * 5, in_features, 32, torch.bfloat16)
    check(rows, 16 * 5, in_features, in_features, torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 300])
@pytest.mark.parametrize("group_size", [32, 128])
def test_fractional_zero_points(rows: int, group_size: int) -> None:
    check(rows, 16 * 21, 2048, group_size, torch.float16, integer_zeros=False)


@pytest.mark.parametrize("rows", [1, 4, 16, 64, 256, 2048])
@pytest.mark.parametrize(("in_features", "out_features"), LLAMA_8B)
def test_llama_8b_shapes(rows: int, in_features: int, out_features: int) -> None:
    check(rows, out_features, in_features, 128, torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 16, 1024])
@pytest.mark.parametrize(("in_features", "out_features"), LLAMA_70B)
def test_llama_70b_shapes(rows: int, in_features: int, out_features: int) -> None:
    check(rows, out_features, in_features, 128, torch.bfloat16)


SWEEP = [
    Int4GemmConfig("gemv", 1, 16, num_warps=2, num_stages=2, split_k=1),
    Int4GemmConfig("gemv", 1, 64, num_warps=8, num_stages=4, split_k=5),
    Int4GemmConfig("gemv", 4, 32, num_warps=4, num_stages=3, split_k=3),
    Int4GemmConfig("dot", 16, 64, num_warps=4, num_stages=4, split_k=4, swap_ab=True),
    Int4GemmConfig("dot", 16, 128, num_warps=4, num_stages=3, split_k=2),
    Int4GemmConfig("dot", 64, 128, num_warps=4, num_stages=3),
    Int4GemmConfig("dot", 128, 128, num_warps=8, num_stages=2),
    Int4GemmConfig("dot", 128, 256, num_warps=8, num_stages=2, swap_ab=True),
    Int4GemmConfig("dot", 128, 128, num_warps=8, num_stages=2, wide_k=False),
    Int4GemmConfig("dot", 64, 128, num_warps=4, num_stages=3, wide_k=True, swap_ab=True),
    Int4GemmConfig("dot", 16, 64, num_warps=4, num_stages=3, split_k=3, wide_k=True),
]


@pytest.mark.parametrize("config", SWEEP, ids=str)
def test_every_config_matches(config: Int4GemmConfig) -> None:
    rows = min(config.block_m, 4) if config.kernel == "gemv" else 33
    check(rows, 4096, 4096, 128, torch.bfloat16, with_bias=True, config=config)


def test_split_k_is_deterministic() -> None:
    codes, scales, zeros = random_int4(4096, 14336, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    for rows in (1, 4, 32):
        x = torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16)
        config = choose_config(rows, 4096, 14336, torch.cuda.get_device_properties(0).multi_processor_count)
        assert config.split_k > 1
        first = int4_linear(x, packed)
        for _ in range(5):
            assert torch.equal(int4_linear(x, packed), first)


def test_captured_in_a_cuda_graph() -> None:
    codes, scales, zeros = random_int4(4096, 4096, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    for rows in (1, GEMV_MAX_ROWS, 32, 128):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        int4_linear(x, packed)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = int4_linear(x, packed)
        x.copy_(torch.randn_like(x))
        for _ in range(3):  # replays reuse the split-K counters
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, int4_linear(x, packed))
        assert not packed.counters.any()


def test_repack_round_trip_on_the_gpu() -> None:
    codes, scales, zeros = random_int4(16 * 37, 4096 + 64, 64)
    packed = repack_int4(codes, scales, zeros, 64, torch.float16)
    assert packed.qweight.is_cuda and torch.equal(unpack_codes(packed), codes)
    reference = dequantize_reference(codes, scales, zeros, 64)
    torch.testing.assert_close(dequantize_packed(packed), reference, rtol=2**-10, atol=1e-5)


def test_refuses_other_inputs() -> None:
    codes, scales, zeros = random_int4(64, 512, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    with pytest.raises(ValueError, match="int4_linear takes"):
        int4_linear(torch.randn(2, 512, device="cuda", dtype=torch.float16), packed)
    with pytest.raises(ValueError, match="int4_linear takes"):
        int4_linear(torch.randn(2, 256, device="cuda", dtype=torch.bfloat16), packed)
    assert int4_linear(torch.empty(0, 512, device="cuda", dtype=torch.bfloat16), packed).shape == (0, 64)


# --- the prefill path: dequantize_rows and chunked GEMMs (kernels/int4_dequant.py) -----------------------

# One rounding of (q - z) * s (scales and zero points as stored) to the activation dtype.
WEIGHT_RTOL = {torch.bfloat16: 2**-8, torch.float16: 2**-11}


def check_dequantize_rows(
    out_features: int,
    in_features: int,
    group_size: int,
    dtype: torch.dtype,
    row_start: int,
    row_count: int,
    config=None,
    integer_zeros: bool = True,
) -> None:
    from fitserve.kernels.int4_dequant import dequantize_rows

    codes, scales, zeros = random_int4(out_features, in_features, group_size, row_start, integer_zeros)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    # a scratch view with a wider row stride, pre-filled: nothing outside it may be written
    canvas = torch.full((row_count + 1, in_features + 64), 3.0, dtype=dtype, device="cuda")
    out = canvas[:row_count, 32 : 32 + in_features]
    assert dequantize_rows(packed, row_start, row_count, out, config) is out
    rows = slice(row_start, row_start + row_count)
    expected = dequantize_packed(packed)[rows]
    # (q - z) * s in float32 and the reference's rounding may differ where q - z cancels to ~0: an
    # absolute floor of the dtype's rounding at the largest weight (a wrong nibble moves a weight by a
    # whole scale step, far above it)
    floor = WEIGHT_RTOL[dtype] * expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=WEIGHT_RTOL[dtype], atol=floor)
    reference = dequantize_reference(codes, scales, zeros, group_size)[rows]
    error = (out.float() - reference).abs().max().item()
    assert error <= TOLERANCE[dtype] * reference.abs().max().item()
    outside = torch.ones_like(canvas, dtype=torch.bool)
    outside[:row_count, 32 : 32 + in_features] = False
    assert bool((canvas[outside] == 3.0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, "per-channel"])
@pytest.mark.parametrize("in_features", [1024, 4224])  # 4224 = 16.5 blocks of 256 codes
@pytest.mark.parametrize(("row_start", "row_count"), [(0, 592), (100, 300), (591, 1), (16, 37)])
def test_dequantize_rows_matches_reference(
    in_features: int, group_size, dtype: torch.dtype, row_start: int, row_count: int
) -> None:
    group_size = in_features if group_size == "per-channel" else group_size
    check_dequantize_rows(16 * 37, in_features, group_size, dtype, row_start, row_count)


def test_dequantize_rows_every_tile() -> None:
    from fitserve.kernels.int4_dequant import DequantConfig

    for block_n, per_program, num_warps in ((16, 1, 2), (32, 3, 4), (64, 2, 4), (64, 16, 8), (128, 1, 8)):
        config = DequantConfig(block_n, per_program, num_warps)
        check_dequantize_rows(16 * 37, 4224, 128, torch.bfloat16, 7, 500, config)
    check_dequantize_rows(16 * 21, 2048, 64, torch.float16, 3, 300, integer_zeros=False)


def test_dequantize_rows_llama_8b_shapes_and_graph() -> None:
    from fitserve.kernels.int4_dequant import chunk_rows, dequantize_rows

    for in_features, out_features in LLAMA_8B:
        chunk = chunk_rows(out_features, in_features, 2)
        check_dequantize_rows(out_features, in_features, 128, torch.bfloat16, out_features - chunk, chunk)
    codes, scales, zeros = random_int4(4096, 4096, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    out = torch.empty(1024, 4096, dtype=torch.bfloat16, device="cuda")
    dequantize_rows(packed, 1024, 1024, out)  # compile outside the capture
    expected = out.clone()
    out.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dequantize_rows(packed, 1024, 1024, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def check_apply(
    rows: int,
    out_features: int,
    in_features: int,
    dtype: torch.dtype = torch.bfloat16,
    with_bias: bool = False,
    leading: tuple[int, ...] = (),
) -> torch.Tensor:
    from torch import nn

    from fitserve.layers.quantization.int4_cpu import Int4GpuLinearMethod

    codes, scales, zeros = random_int4(out_features, in_features, 128, rows)
    packed = repack_int4(codes, scales, zeros, 128, dtype)
    generator = torch.Generator(device="cuda").manual_seed(rows + 1)
    x = torch.randn(*leading, rows, in_features, device="cuda", generator=generator).to(dtype)
    layer = nn.Module()
    bias = torch.randn(out_features, device="cuda", generator=generator).to(dtype)
    layer.bias = bias if with_bias else None
    y = Int4GpuLinearMethod(packed).apply(layer, x)
    assert y.shape == (*leading, rows, out_features) and y.dtype == dtype
    reference = x.reshape(rows, in_features).float() @ dequantize_reference(codes, scales, zeros, 128).T
    if with_bias:
        reference += layer.bias.float()
    error = (y.reshape(rows, out_features).float() - reference).abs().max().item()
    assert error <= TOLERANCE[dtype] * reference.abs().max().item(), (error, reference.abs().max().item())
    return y


@pytest.mark.parametrize("rows", [1, 16, 33, 300, 2048])
@pytest.mark.parametrize(
    ("in_features", "out_features"),
    [(1024, 16 * 37), (4096, 28672), (8192, 10000)],  # one chunk; 4 of 7168; 3456, 3456, 3088
)
def test_int4_method_apply(rows: int, in_features: int, out_features: int) -> None:
    check_apply(rows, out_features, in_features, with_bias=rows % 2 == 1, leading=(1,) if rows > 16 else ())


@pytest.mark.parametrize("rows", [33, 300])
def test_int4_method_apply_float16(rows: int) -> None:
    check_apply(rows, 10000, 8192, torch.float16, with_bias=True)


@pytest.mark.parametrize("rows", [40, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_small_scratch(rows: int, dtype: torch.dtype) -> None:
    from fitserve.kernels.int4_dequant import chunk_rows, chunked_int4_linear

    out_features, in_features = 16 * 37 + 8, 4224  # N = 600: chunks of 256, 256, 88
    scratch_bytes = 300 * in_features * 2
    assert chunk_rows(out_features, in_features, 2, scratch_bytes) == 256
    codes, scales, zeros = random_int4(out_features, in_features, 64, rows)
    packed = repack_int4(codes, scales, zeros, 64, dtype)
    x = torch.randn(rows, in_features, device="cuda").to(dtype)
    bias = torch.randn(out_features, device="cuda").to(dtype)
    reference = x.float() @ dequantize_reference(codes, scales, zeros, 64).T
    for with_bias in (False, True):
        y = chunked_int4_linear(x, packed, bias if with_bias else None, scratch_bytes=scratch_bytes)
        expected = reference + bias.float() if with_bias else reference
        error = (y.float() - expected).abs().max().item()
        assert error <= TOLERANCE[dtype] * expected.abs().max().item()


def test_apply_dispatch_and_graph_capture(monkeypatch) -> None:
    import fitserve.kernels.int4_dequant as int4_dequant
    from fitserve.layers.quantization.int4_cpu import FUSED_MAX_ROWS, Int4GpuLinearMethod

    calls = []
    chunked = int4_dequant.chunked_int4_linear

    def counted(*args, **kwargs):
        calls.append(1)
        return chunked(*args, **kwargs)

    monkeypatch.setattr(int4_dequant, "chunked_int4_linear", counted)
    codes, scales, zeros = random_int4(10000, 8192, 128)
    method = Int4GpuLinearMethod(repack_int4(codes, scales, zeros, 128, torch.bfloat16))
    layer = torch.nn.Module()
    layer.bias = None
    for rows, expected_calls in ((FUSED_MAX_ROWS, 0), (FUSED_MAX_ROWS + 1, 1)):
        method.apply(layer, torch.randn(rows, 8192, device="cuda", dtype=torch.bfloat16))
        assert len(calls) == expected_calls
    x = torch.randn(128, 8192, device="cuda", dtype=torch.bfloat16)
    method.apply(layer, x)  # compile and allocate the scratch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = method.apply(layer, x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    eager = method.apply(layer, x)  # cuBLAS may pick another algorithm in a capture: one bf16 step apart
    torch.testing.assert_close(captured, eager, rtol=2**-7, atol=2**-7 * eager.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, 1024])
@pytest.mark.parametrize("wide_k", [False, True])
def test_paired_dequantization_is_the_reference_rounded_once(group_size: int, dtype, wide_k: bool) -> None:
    """The packed-pair route (int4_pair_dequant.py) computes each weight as (code - z) * s rounded once to
    the activation dtype: with x one-hot rows, y is that weight column exactly, bit for bit."""
    out_features, in_features = 16 * 9, 1024
    codes, scales, zeros = random_int4(out_features, in_features, group_size, seed=group_size)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    assert packed.paired_zeros
    columns = torch.tensor([0, 31, 32, 127, 128, 255, 256, 777, 1023], device="cuda")
    x = torch.zeros(16, in_features, device="cuda", dtype=dtype)
    x[torch.arange(len(columns)), columns] = 1
    config = Int4GemmConfig(
        "dot", 16, 64, num_warps=4, num_stages=3, swap_ab=True, wide_k=wide_k, paired=True
    )
    y = int4_linear(x, packed, config=config)
    expected = dequantize_packed(packed).to(dtype)[:, columns].T
    assert torch.equal(y[: len(columns)], expected)


def test_paired_and_float_routes_agree_and_fractional_zeros_keep_the_float_route() -> None:
    codes, scales, zeros = random_int4(4096, 4096, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    x = torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16)
    paired = Int4GemmConfig("dot", 64, 64, num_warps=4, num_stages=3, swap_ab=True, paired=True)
    y_paired = int4_linear(x, packed, config=paired)
    y_float = int4_linear(x, packed, config=dataclasses.replace(paired, paired=False))
    reference = x.float() @ dequantize_packed(packed).T
    scale = reference.abs().max().item()
    assert (y_paired.float() - reference).abs().max().item() <= 2**-7 * scale
    assert (y_paired.float() - y_float.float()).abs().max().item() <= 2**-7 * scale
    fractional = repack_int4(codes, scales, zeros + 0.25, 128, torch.bfloat16)
    assert fractional.integer_zeros is False and fractional.paired_zeros is False
    check(33, 4096, 4096, 128, torch.bfloat16, config=paired, integer_zeros=False)
