"""Which prefill attention kernel a step gets: the Hopper Gluon kernel (kernels/prefill_attention_sm90.py)
where it applies, the Triton kernel elsewhere. No kernel runs here (the Gluon one needs an sm_90 GPU; its
compile for sm_90 is checked by tests/unit/test_kernel_targets.py, its output by tests/gpu)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fitserve.kernels import prefill_attention, prefill_attention_sm90  # noqa: E402
from fitserve.kernels.capability import forced_target  # noqa: E402
from fitserve.kernels.prefill_attention_sm90 import (  # noqa: E402
    LONG_QUERY_SM90_CONFIG,
    SHORT_QUERY_SM90_CONFIG,
    Sm90PrefillConfig,
    choose_sm90_config,
    supports_sm90,
)


def tensors(head_dim: int = 128, dtype=torch.bfloat16, cache_dtype=None, tokens: int = 64):
    q = torch.empty(tokens, 8, head_dim, dtype=dtype)
    cache = torch.empty(2, 8, 16, 2, head_dim, dtype=cache_dtype or dtype)
    return q, cache


@pytest.fixture
def compiled_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_attention_sm90, "INTERPRETING", False)  # read from TRITON_INTERPRET at import


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_supported_on_sm90_for_16_bit_caches_at_head_dims_64_and_128(head_dim, dtype) -> None:
    assert supports_sm90(*tensors(head_dim, dtype), None, (9, 0))


@pytest.mark.usefixtures("compiled_kernels")
@pytest.mark.parametrize(
    "case,window,capability",
    [
        ((80, torch.bfloat16, None), None, (9, 0)),  # head dim not 64 or 128
        ((256, torch.bfloat16, None), None, (9, 0)),
        ((128, torch.bfloat16, torch.float8_e4m3fn), None, (9, 0)),  # float8 cache
        ((128, torch.float16, torch.bfloat16), None, (9, 0)),  # cache dtype differs
        ((128, torch.float32, None), None, (9, 0)),
        ((128, torch.bfloat16, None), 512, (9, 0)),  # a sliding window
        ((128, torch.bfloat16, None), None, (8, 0)),  # no warpgroup MMA
        ((128, torch.bfloat16, None), None, (10, 0)),
        ((128, torch.bfloat16, None), None, None),  # not a CUDA device
    ],
)
def test_not_supported_elsewhere(case, window, capability) -> None:
    assert not supports_sm90(*tensors(*case), window, capability)


def test_not_under_the_triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_attention_sm90, "INTERPRETING", True)
    assert not supports_sm90(*tensors(), None, (9, 0))


def test_long_queries_get_two_warpgroups_from_a_mean_of_512_tokens() -> None:
    assert choose_sm90_config(8192, 1, 512) == LONG_QUERY_SM90_CONFIG
    assert choose_sm90_config(1024, 2, 512) == LONG_QUERY_SM90_CONFIG
    assert choose_sm90_config(1023, 2, 512) == SHORT_QUERY_SM90_CONFIG
    assert choose_sm90_config(768 + 128, 129, 512) == SHORT_QUERY_SM90_CONFIG
    assert LONG_QUERY_SM90_CONFIG.num_warps == 8 and SHORT_QUERY_SM90_CONFIG.num_warps == 4


@pytest.mark.usefixtures("compiled_kernels")
def test_the_default_path_routes_sm90_steps_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(q, kv_cache, starts, seq_lens, tables, max_query_len, scale, out, config):
        calls.append((max_query_len, config))
        return out

    monkeypatch.setattr(prefill_attention, "paged_prefill_attention_sm90", spy)
    q, cache = tensors(tokens=1024)
    starts = torch.tensor([0, 1024], dtype=torch.int32)
    lens = torch.tensor([1500], dtype=torch.int32)
    tables = torch.zeros(1, 128, dtype=torch.int32)
    with forced_target((9, 0)):
        out = prefill_attention.paged_prefill_attention(q, cache, starts, lens, tables, 1024, 0.1)
    assert out.shape == q.shape
    assert calls == [(1024, LONG_QUERY_SM90_CONFIG)]


def test_one_compile_for_every_block_table_width() -> None:
    """The block table's row stride is the step's widest table: a compile per width class would stall a
    server mid-run (tests/gpu/test_no_runtime_compiles.py), so it is not specialized on."""
    from fitserve.kernels import variants

    def steps_of_three_widths(target, full) -> None:
        q = torch.empty(2048, 32, 128, dtype=torch.bfloat16)
        cache = torch.empty(2, 512, 16, 8, 128, dtype=torch.bfloat16)
        starts = torch.tensor([0, 2048], dtype=torch.int32)
        lens = torch.tensor([2048], dtype=torch.int32)
        for width in (128, 129, 131):
            tables = torch.zeros(1, width, dtype=torch.int32)
            prefill_attention.paged_prefill_attention(q, cache, starts, lens, tables, 2048, 0.1)

    compiled = list(
        variants.compile_variants(variants.TARGETS_BY_NAME["sm_90"], cases={"widths": steps_of_three_widths})
    )
    assert [variant.kernel for variant in compiled] == ["_prefill_sm90_kernel"]
    assert not compiled[0].problems


@pytest.mark.parametrize(
    "fields,named",
    [
        ((128, 32, 2, 8), "num_stages=2 is below 3"),
        ((128, 32, 3, 2), "num_warps=2 is not 4 or 8"),
        ((64, 32, 3, 8), "block_m=64 is not a power of two of at least 16 a warp"),
        ((96, 32, 3, 4), "block_m=96"),
        ((64, 8, 3, 4), "block_n=8 is not a power of two of at least 16"),
    ],
)
def test_a_config_the_kernel_cannot_run_is_refused(fields, named) -> None:
    with pytest.raises(ValueError, match=named) as refused:
        Sm90PrefillConfig(*fields)
    assert "LONG_QUERY_SM90_CONFIG" in str(refused.value)
