"""The greedy argmax kernel against torch.argmax, ties and -inf rows included, and the sampler using it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.engine.sampling_params import SamplingParams  # noqa: E402
from fitserve.kernels.argmax import CHUNK, argmax_rows  # noqa: E402
from fitserve.worker.sampler import Sampler, SamplingRow  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("width", [1, 100, CHUNK, CHUNK + 1, 128256, 151936])
def test_matches_torch_argmax(rows: int, width: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(width + rows)
    x = torch.randn(rows, width, device="cuda", generator=generator)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_take_the_lowest_index_within_and_across_chunks() -> None:
    x = torch.zeros(4, 3 * CHUNK, device="cuda")
    x[0, [5, 9]] = 2.0  # same chunk
    x[1, [CHUNK + 7, 2 * CHUNK + 1]] = 2.0  # two chunks
    x[2, [2 * CHUNK + 3, 11]] = 2.0  # the later chunk holds the higher index
    x[3] = float("-inf")  # nothing allowed: index 0, as torch.argmax
    assert argmax_rows(x).tolist() == [5, CHUNK + 7, 11, 0]
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rows_and_strided_rows(dtype: torch.dtype) -> None:
    x = torch.randn(5, 2 * 50000, device="cuda").to(dtype)
    view = x[:, :50000]  # rows 100,000 apart
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"\(4, 8\) torch.int64.*use torch.argmax"):
        argmax_rows(torch.zeros(4, 8, dtype=torch.long, device="cuda"))


def test_the_sampler_greedy_choice_on_cuda_is_torch_argmax() -> None:
    logits = torch.randn(6, 128256, device="cuda") * 3
    logits[2, [10, 70000]] = 100.0
    rows = [SamplingRow(SamplingParams(temperature=0.0), [0], []) for _ in range(6)]
    assert Sampler()(logits, rows).sampled_token_ids == logits.argmax(dim=-1).tolist()
