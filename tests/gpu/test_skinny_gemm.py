"""The decode steps' skinny GEMM kernels (skinny_gemm; skinny_split_gemm, split over K, for weights below
4,096 output features) against F.linear in float32, and when linear layers use them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import skinny_split_gemm as split_module  # noqa: E402
from fitserve.kernels.skinny_gemm import (  # noqa: E402
    MAX_ROWS,
    SkinnyGemmConfig,
    skinny_gemm,
    wide_weight_to_cublas,
    worth_it,
)
from fitserve.kernels.skinny_split_gemm import CONFIGS, skinny_split_gemm  # noqa: E402
from fitserve.layers import linear  # noqa: E402
from fitserve.layers.linear import SKINNY_MAX_ROWS, SWAPPED_MAX_ROWS, dense_linear  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "with_bias"),
    [(1, 4096, 4096, False), (7, 6144, 4096, True), (16, 4100, 2064, False), (3, 14336, 8192, True)],
)
def test_matches_float32_linear(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    assert_matches_float32_linear(skinny_gemm, dtype, rows, out_features, in_features, with_bias)


def assert_matches_float32_linear(
    gemm: Callable[..., torch.Tensor],
    dtype: torch.dtype,
    rows: int,
    out_features: int,
    in_features: int,
    with_bias: bool,
) -> None:
    """gemm(x, weight, bias) on random inputs against F.linear in float32."""
    generator = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, in_features, device="cuda", generator=generator).to(dtype)
    weight = (0.02 * torch.randn(out_features, in_features, device="cuda", generator=generator)).to(dtype)
    bias = torch.randn(out_features, device="cuda", generator=generator).to(dtype) if with_bias else None
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    out = gemm(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    # float32 accumulation: only the final rounding to 16 bits differs from the float32 result
    tolerance = 2**-7 if dtype == torch.bfloat16 else 2**-10
    atol = tolerance * expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=atol)


def test_every_swept_tile_gives_the_same_result() -> None:
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    expected = skinny_gemm(x, weight).float()
    for config in (SkinnyGemmConfig(16, 256, 4, 3), SkinnyGemmConfig(64, 128, 8, 5)):
        out = skinny_gemm(x, weight, config=config).float()
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_captured_in_a_cuda_graph() -> None:
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    eager = skinny_gemm(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_gemm(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, skinny_gemm(x, weight))
    assert not torch.equal(captured, eager)


def test_linear_layers_use_it_for_large_weights_and_few_rows_only() -> None:
    assert SKINNY_MAX_ROWS == MAX_ROWS
    big = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.empty(1024, 2048, device="cuda", dtype=torch.bfloat16)  # Qwen3-0.6B's o_proj: split-K
    assert worth_it(torch.empty(MAX_ROWS, 4096, device="cuda", dtype=torch.bfloat16), big)
    assert not worth_it(torch.empty(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16), big)
    assert not worth_it(torch.empty(1, 2048, device="cuda", dtype=torch.bfloat16), small)
    assert not worth_it(torch.empty(1, 4096, device="cuda", dtype=torch.float32), big.float())
    # one rank's weights under tensor parallel (MIN_OUT_FEATURES, MIN_IN_FEATURES)
    one = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert worth_it(one, torch.empty(3072, 4096, device="cuda", dtype=torch.bfloat16))  # 8B qkv, TP 2
    assert worth_it(one[:, :1024], torch.empty(4096, 1024, device="cuda", dtype=torch.bfloat16))  # o, TP 4
    wide = torch.empty(1, 8192, device="cuda", dtype=torch.bfloat16)
    assert not worth_it(wide, torch.empty(2560, 8192, device="cuda", dtype=torch.bfloat16))  # 70B qkv, TP 4
    # wide weights: cuBLAS on the GPUs where it was measured faster (the H200), this kernel elsewhere
    gate_up = torch.empty(28672, 4096, device="cuda", dtype=torch.bfloat16)
    assert worth_it(one, gate_up) is not wide_weight_to_cublas(28672, 4096, torch.cuda.get_device_name())
    x = torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
    # 17 rows: swapped_gemm, which sums K in another order than cuBLAS: outputs near zero differ by more
    # than a relative tolerance allows (the check failed on an H200), so the bound is bf16's step at the
    # largest output, as this file's other checks
    expected = F.linear(x, big.normal_())
    bound = 2**-7 * expected.abs().max().item()
    torch.testing.assert_close(dense_linear(x, big), expected, rtol=2**-7, atol=bound)


def test_refuses_what_it_cannot_take() -> None:
    x = torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \(17, 4096\).*use torch.nn.functional.linear"):
        skinny_gemm(x, torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))


def test_row_head_prefetch_off_and_on_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    from fitserve.kernels import skinny_gemm as module

    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    with_prefetch = skinny_gemm(x, weight)
    monkeypatch.setattr(module, "PREFETCH_ROW_BYTES", 0)
    assert torch.equal(skinny_gemm(x, weight), with_prefetch)


def test_float32_output_is_the_16_bit_result_widened() -> None:
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    wide = dense_linear(x, weight, out_dtype=torch.float32)  # the skinny GEMM's rows
    assert wide.dtype == torch.float32
    assert torch.equal(wide, skinny_gemm(x, weight).float())
    many = torch.randn(SWAPPED_MAX_ROWS + 3, 4096, device="cuda", dtype=torch.bfloat16)  # F.linear
    assert torch.equal(dense_linear(many, weight, out_dtype=torch.float32), F.linear(many, weight).float())


def test_row_head_sizes_that_cannot_be_prefetched_turn_it_off() -> None:
    from fitserve.kernels.l2_prefetch import row_head_bytes

    weight = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert row_head_bytes(weight, 2048, 4) == 2048
    assert row_head_bytes(weight, 40, 4) == 0  # 10-byte pieces
    assert row_head_bytes(weight[:, :512], 2048, 4) == 0  # rows shorter than the head
    assert row_head_bytes(torch.empty(64, 4104, device="cuda", dtype=torch.bfloat16)[:, 4:], 2048, 4) == 0


# skinny_split_gemm: N 256 to 2,816, K 512 to 8,192, K and N multiples of its tiles and not
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16])
@pytest.mark.parametrize(
    ("out_features", "in_features", "with_bias"),
    [
        (256, 2048, False),  # Qwen3.6-35B-A3B's router
        (512, 2048, True),  # its k / v
        (1024, 2048, False),  # its shared expert's gate_up
        (2048, 512, True),  # its shared expert's down
        (2048, 4096, False),  # its o_proj / out_proj
        (2816, 2112, True),  # Gemma-4 26B-A4B's MLP down: K not a multiple of the step
        (1000, 8192, False),  # a ragged N tile
        (3000, 1040, True),
    ],
)
def test_split_k_matches_float32_linear(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    assert_matches_float32_linear(skinny_split_gemm, dtype, rows, out_features, in_features, with_bias)
    assert int(split_module._counters(torch.device("cuda", torch.cuda.current_device())).abs().sum()) == 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_split_config_and_split_count_gives_the_same_result(name: str) -> None:
    x = torch.randn(6, 2112, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2816, 2112, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(2816, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), weight.float(), bias.float())
    config = CONFIGS[name]
    steps = -(-2112 // config.block_k)
    for splits in sorted({None, 1, 2, 3, steps}, key=lambda count: count or 0):
        out = skinny_split_gemm(x, weight, bias, config=config, splits=splits).float()
        torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())


def test_split_k_in_cuda_graphs_chained_and_replayed() -> None:
    """Three split-K GEMMs in a row (the counters shared, each launched while the one before runs, with
    PDL), captured once and replayed with new inputs: the same bits as eager calls, counters back at 0."""
    weights = [
        torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n, k in ((2048, 2048), (512, 2048))
    ]
    weights.append(torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        hidden = x
        for weight in weights:
            hidden = skinny_split_gemm(hidden, weight)
        return hidden

    eager = chain()
    reference = x.float()
    for weight in weights:
        reference = reference @ weight.float().T
    torch.testing.assert_close(eager.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        graph.replay()  # a replay right after a replay finds every counter at 0 again
        torch.cuda.synchronize()
        assert torch.equal(captured, chain())
    assert int(split_module._counters(x.device).abs().sum()) == 0


def test_linear_layers_use_split_k_for_small_weights_and_few_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    assert split_module.worth_it(x, small) and not worth_it(x, small)
    assert torch.equal(dense_linear(x, small), skinny_split_gemm(x, small))
    assert not split_module.worth_it(
        torch.randn(MAX_ROWS + 1, 2048, device="cuda", dtype=torch.bfloat16), small
    )
    assert not split_module.worth_it(x.float(), small.float())
    assert not split_module.worth_it(x, torch.empty(4096, 2048, device="cuda", dtype=torch.bfloat16))
    assert not split_module.worth_it(x, torch.empty(64, 2048, device="cuda", dtype=torch.bfloat16))
    assert not split_module.worth_it(x, torch.empty(2816, 2048, device="cuda", dtype=torch.bfloat16))
    monkeypatch.setattr(linear, "SMALL_WEIGHT_SPLIT_K", False)
    assert torch.equal(dense_linear(x, small), F.linear(x, small))


def test_split_k_prefetch_off_and_on_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    with_prefetch = skinny_split_gemm(x, weight)
    monkeypatch.setattr(split_module, "PREFETCH_STEPS", 0)
    assert torch.equal(skinny_split_gemm(x, weight), with_prefetch)


def test_split_k_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \(17, 4096\).*use torch.nn.functional.linear"):
        skinny_split_gemm(torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match=r"splits=0 must be 1 to 16"):
        skinny_split_gemm(torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), weight, splits=0)
