"""The 17-to-32-row decode GEMM (weight rows on the MMA's long side) against F.linear in float32, and
when linear layers use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import swapped_gemm as module  # noqa: E402
from fitserve.kernels.swapped_gemm import MAX_ROWS, MIN_ROWS, swapped_gemm, worth_it  # noqa: E402
from fitserve.layers.linear import SWAPPED_MAX_ROWS, dense_linear  # noqa: E402
from tests.gpu.test_skinny_gemm import assert_matches_float32_linear  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "with_bias"),
    [
        (17, 4096, 4096, False),
        (24, 6144, 4096, True),
        (32, 4096, 14336, False),
        (29, 28672, 4096, False),
        (31, 4096, 2048, True),
    ],
)
def test_matches_float32_linear(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    assert_matches_float32_linear(swapped_gemm, dtype, rows, out_features, in_features, with_bias)


def test_rows_of_a_strided_view_and_padding_rows_untouched() -> None:
    base = torch.randn(20, 4096 + 128, device="cuda", dtype=torch.bfloat16)
    x = base[:, :4096]  # row stride 4224: x is not contiguous, its rows are
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    out = swapped_gemm(x, weight)
    assert out.shape == (20, 4096)
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=2**-7, atol=2**-7)


def test_captured_in_a_cuda_graph() -> None:
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    eager = swapped_gemm(x, weight)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = swapped_gemm(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, swapped_gemm(x, weight))
    assert not torch.equal(captured, eager)


def test_linear_layers_use_it_between_17_and_32_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SWAPPED_MAX_ROWS == MAX_ROWS
    calls: list[int] = []

    def counting(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        return swapped_gemm(x, weight, bias)

    monkeypatch.setattr(module, "swapped_gemm", counting)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    for rows in (MIN_ROWS - 1, MIN_ROWS, 24, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(dense_linear(x, weight), F.linear(x, weight))
    assert calls == [MIN_ROWS, 24, MAX_ROWS]
    small = torch.empty(1024, 2048, device="cuda", dtype=torch.bfloat16)  # Qwen3-0.6B's o_proj: cuBLAS
    assert not worth_it(torch.empty(32, 2048, device="cuda", dtype=torch.bfloat16), small)
    assert not worth_it(torch.empty(32, 4096, device="cuda", dtype=torch.float32), weight.float())


def test_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x \(33, 4096\).*use torch.nn.functional.linear"):
        swapped_gemm(torch.randn(MAX_ROWS + 1, 4096, device="cuda", dtype=torch.bfloat16), weight)
    ragged = torch.randn(4100, 4096, device="cuda", dtype=torch.bfloat16)  # N not a multiple of 64
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"N a multiple of 64.*weight \(4100, 4096\)"):
        swapped_gemm(x, ragged)
    assert not worth_it(x, ragged)
    torch.testing.assert_close(dense_linear(x, ragged), F.linear(x, ragged))  # cuBLAS takes it


def test_row_head_prefetch_off_and_on_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    with_prefetch = swapped_gemm(x, weight)
    monkeypatch.setattr(module, "PREFETCH_ROW_BYTES", 0)
    assert torch.equal(swapped_gemm(x, weight), with_prefetch)
