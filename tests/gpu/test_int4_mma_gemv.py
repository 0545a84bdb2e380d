"""The register-fed tensor-core int4 kernel (kernels/int4_mma_gemv.py) that int4_linear runs for 1 to 8
rows on SM 8.0+ (its 16-column form is tested through explicit configs): against x.float() @
dequantize_reference(...).T at every group size and dtype, bit for bit on one-hot rows (each weight
(code - z) * s rounded once), against the kernels it replaces, with split-K, bias, K not a multiple of
the block, N not a multiple of the tile, and in CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
    pytest.skip("needs a CUDA GPU of SM 8.0 or newer", allow_module_level=True)

from fitserve.kernels import int4_gemm  # noqa: E402
from fitserve.kernels.int4_gemm import Int4GemmConfig, choose_config, int4_linear  # noqa: E402
from fitserve.kernels.int4_repack import dequantize_packed, dequantize_reference, repack_int4  # noqa: E402

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2**-6, torch.float16: 2**-8}


def random_int4(out_features: int, in_features: int, group_size: int, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    groups = -(-in_features // group_size)
    codes = torch.randint(
        0, 16, (out_features, in_features), dtype=torch.uint8, device="cuda", generator=generator
    )
    scales = 0.002 + 0.01 * torch.rand(out_features, groups, device="cuda", generator=generator)
    zeros = torch.randint(0, 17, (out_features, groups), device="cuda", generator=generator).float()
    return codes, scales, zeros


def check(rows, out_features, in_features, group_size, dtype, bias=False, config=None, seed=0):
    codes, scales, zeros = random_int4(out_features, in_features, group_size, seed)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    assert int4_gemm.mma_kernel_ok(torch.empty(1, device="cuda", dtype=dtype), packed)
    generator = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(rows, in_features, device="cuda", generator=generator).to(dtype)
    b = torch.randn(out_features, device="cuda", generator=generator).to(dtype) if bias else None
    y = int4_linear(x, packed, b, config=config)
    reference = x.float() @ dequantize_reference(codes, scales, zeros, group_size).T
    if b is not None:
        reference += b.float()
    error = (y.float() - reference).abs().max().item()
    assert error <= TOLERANCE[dtype] * reference.abs().max().item(), (error, reference.abs().max().item())
    assert not packed.counters.any()  # split-K leaves its counters at zero
    return packed, x, y


def test_choose_config_takes_the_mma_kernel_up_to_8_rows() -> None:
    for rows in (1, 8):
        config = choose_config(rows, 4096, 4096, 132, mma=True)
        assert config.kernel == "mma" and config.block_m == 8
    assert choose_config(9, 4096, 4096, 132, mma=True).kernel == "dot"
    assert choose_config(1, 4096, 4096, 132, mma=False).kernel == "gemv"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, 256, 512, "per-channel"])
@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16])
def test_matches_dequantized_reference(rows: int, group_size, dtype: torch.dtype) -> None:
    in_features = 1024
    group_size = in_features if group_size == "per-channel" else group_size
    check(rows, 16 * 37, in_features, group_size, dtype, bias=rows % 2 == 1)  # N = 592: a ragged last tile


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("in_features", [1056, 4128, 160])  # not multiples of the 256-code block
def test_k_not_a_multiple_of_the_block(rows: int, in_features: int) -> None:
    check(rows, 16 * 5, in_features, 32 if in_features % 32 == 0 else in_features, torch.bfloat16)
    check(rows, 16 * 5 + 3, in_features, in_features, torch.float16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [32, 64, 128, 1024])
def test_each_weight_is_the_reference_rounded_once(group_size: int, dtype) -> None:
    """x one-hot rows: y is one weight column each, which must be (code - z) * s rounded once, exactly."""
    codes, scales, zeros = random_int4(16 * 9, 1024, group_size, seed=group_size)
    packed = repack_int4(codes, scales, zeros, group_size, dtype)
    columns = torch.tensor(
        [0, 31, 32, 127, 128, 255, 256, 777, 1023, 511, 64, 200, 300, 900, 1, 129], device="cuda"
    )
    x = torch.zeros(16, 1024, device="cuda", dtype=dtype)
    x[torch.arange(16), columns] = 1
    y = int4_linear(x, packed, config=Int4GemmConfig("mma", 16, 64, num_warps=4, split_k=3))
    assert torch.equal(y, dequantize_packed(packed).to(dtype)[:, columns].T)


CONFIGS = [
    Int4GemmConfig("mma", 8, 32, num_warps=2, split_k=1),
    Int4GemmConfig("mma", 8, 64, num_warps=2, split_k=5),
    Int4GemmConfig("mma", 8, 128, num_warps=4, split_k=2),
    Int4GemmConfig("mma", 16, 128, num_warps=8, split_k=16),
    Int4GemmConfig("mma", 16, 64, num_warps=4, split_k=None),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_config_matches(config: Int4GemmConfig) -> None:
    check(min(config.block_m, 7), 4096 + 48, 4096, 128, torch.bfloat16, bias=True, config=config)


@pytest.mark.parametrize(("in_features", "out_features"), [(4096, 6144), (4096, 28672), (14336, 4096)])
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_llama_8b_shapes_agree_with_the_previous_kernels(
    rows, in_features, out_features, monkeypatch
) -> None:
    packed, x, y = check(rows, out_features, in_features, 128, torch.bfloat16)
    monkeypatch.setattr(int4_gemm, "MMA_DECODE", False)
    previous = int4_linear(x, packed)
    scale = previous.float().abs().max().item()
    assert (y.float() - previous.float()).abs().max().item() <= 2**-7 * scale


def test_split_k_is_deterministic_and_graph_replays_match() -> None:
    codes, scales, zeros = random_int4(4096, 14336, 128)
    packed = repack_int4(codes, scales, zeros, 128, torch.bfloat16)
    for rows in (1, 2, 16):
        x = torch.randn(rows, 14336, device="cuda", dtype=torch.bfloat16)
        first = int4_linear(x, packed)
        for _ in range(3):
            assert torch.equal(int4_linear(x, packed), first)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = int4_linear(x, packed)
        x.copy_(torch.randn_like(x))
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, int4_linear(x, packed))
        assert not packed.counters.any()


def test_fractional_zero_points_take_the_previous_kernels() -> None:
    codes, scales, zeros = random_int4(16 * 8, 1024, 128)
    packed = repack_int4(codes, scales, zeros + 0.5, 128, torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    assert not int4_gemm.mma_kernel_ok(x, packed)
    reference = x.float() @ dequantize_packed(packed).T
    error = (int4_linear(x, packed).float() - reference).abs().max().item()
    assert error <= 2**-6 * reference.abs().max().item()
