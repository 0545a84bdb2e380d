"""The greedy argmax kernel against torch.argmax, ties and -inf rows included, and the sampler using it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.core.sampling_params import SamplingParams  # noqa: E402
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


def test_race_rows_samples_the_softmax_distribution() -> None:
    from fitserve.kernels.argmax import race_rows

    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0, 0.0, 0.0], device="cuda")
    logits = probs.log().expand(40000, -1).contiguous()  # log(0) = -inf: never drawn
    seed = torch.randint(0, 2**62, (1,), device="cuda")
    counts = torch.bincount(race_rows(logits, seed), minlength=8).float() / logits.shape[0]
    torch.testing.assert_close(counts, probs, atol=0.012, rtol=0.0)
    assert torch.equal(race_rows(logits, seed), race_rows(logits, seed))  # the seed decides
    assert not torch.equal(race_rows(logits, seed), race_rows(logits, seed + 1))


def test_race_rows_across_chunks_and_in_the_sampler() -> None:
    from fitserve.kernels.argmax import race_rows

    width = 3 * CHUNK + 5
    logits = torch.full((20000, width), float("-inf"), device="cuda")
    hot = [3, CHUNK + 11, 3 * CHUNK + 4]  # three chunks, the last one partial
    logits[:, hot] = torch.tensor([0.0, 0.0, 1.0], device="cuda")
    drawn = race_rows(logits, torch.tensor([7], device="cuda"))
    assert set(drawn.unique().tolist()) == set(hot)
    share = (drawn == hot[2]).float().mean().item()
    expected = torch.softmax(torch.tensor([0.0, 0.0, 1.0]), 0)[2].item()
    assert abs(share - expected) < 0.02

    rows = [SamplingRow(SamplingParams(temperature=0.7), [0], []) for _ in range(64)]
    row_logits = torch.full((64, width), float("-inf"), device="cuda")
    row_logits[:, hot] = 1.0
    torch.manual_seed(1)
    first = Sampler()(row_logits, rows).sampled_token_ids
    torch.manual_seed(1)
    assert Sampler()(row_logits, rows).sampled_token_ids == first  # torch's seed decides
    assert set(first) <= set(hot) and len(set(first)) > 1


def test_race_rows_scales_each_row_by_its_inverse_temperature() -> None:
    from fitserve.kernels.argmax import race_rows

    probs = torch.tensor([0.64, 0.16, 0.16, 0.04], device="cuda")
    logits = probs.log().expand(40000, -1).contiguous()
    scale = torch.full((40000,), 0.5, device="cuda")  # temperature 2: probabilities ~ sqrt(p)
    counts = torch.bincount(race_rows(logits, torch.tensor([3], device="cuda"), scale), minlength=4)
    expected = probs.sqrt() / probs.sqrt().sum()
    torch.testing.assert_close(counts.float() / 40000, expected, atol=0.012, rtol=0.0)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9, top_k=50)],
    ids=["race only", "filters"],
)
def test_random_sampling_on_cuda_leaves_the_callers_logits(params: SamplingParams) -> None:
    logits = torch.randn(8, 5000, device="cuda")
    before = logits.clone()
    Sampler()(logits, [SamplingRow(params, [0], []) for _ in range(8)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.0, 0.6])
def test_bf16_logits_sample_as_their_float32_values(temperature: float) -> None:
    """The LM head hands the sampler bf16 logits past 16 rows on CUDA: the tokens must be the ones
    the float32 conversion gave (greedy exactly, random for the same torch seed)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(40, 151936, device="cuda", generator=generator) * 4).to(torch.bfloat16)
    rows = [SamplingRow(SamplingParams(temperature=temperature), [0], []) for _ in range(40)]
    torch.manual_seed(5)
    from_bf16 = Sampler()(logits, rows).sampled_token_ids
    torch.manual_seed(5)
    from_float32 = Sampler()(logits.float(), rows).sampled_token_ids
    assert from_bf16 == from_float32


def test_lm_head_logits_stay_in_the_model_dtype_on_cuda() -> None:
    from fitserve.layers.vocab_embedding import ParallelLMHead

    head = ParallelLMHead(32000, 4096).to(device="cuda", dtype=torch.bfloat16)
    head.weight.normal_(std=0.02)
    hidden = torch.randn(17, 4096, device="cuda", dtype=torch.bfloat16)
    skinny, wide = head(hidden[:16]), head(hidden)  # the skinny GEMM's rows and cuBLAS's
    assert skinny.dtype == wide.dtype == torch.bfloat16
    torch.testing.assert_close(skinny.float(), wide[:16].float(), rtol=1e-2, atol=1e-2)
