"""kernels/prefill_attention_sm90.py (the Hopper Gluon prefill attention) against the float32 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fitserve.kernels import prefill_attention, reference  # noqa: E402
from fitserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from fitserve.kernels.prefill_attention_sm90 import (  # noqa: E402
    LONG_QUERY_SM90_CONFIG,
    SHORT_QUERY_SM90_CONFIG,
    Sm90PrefillConfig,
    paged_prefill_attention_sm90,
)
from tests.gpu.test_kernels import (  # noqa: E402
    DEVICE,
    PREFILL_CASES,
    assert_attention_close,
    make_paged_cache,
    to_device_int32,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="the Gluon kernel compiles for sm_90 only",
    ),
]
CONFIGS = [LONG_QUERY_SM90_CONFIG, SHORT_QUERY_SM90_CONFIG, Sm90PrefillConfig(128, 64, 3, 8)]


def inputs(q_heads, kv_heads, head_dim, block_size, query_lens, seq_lens, dtype):
    kv_cache, block_tables = make_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(sum(query_lens), q_heads, head_dim, device=DEVICE, dtype=dtype)
    starts = to_device_int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    return q, kv_cache, starts, to_device_int32(seq_lens), block_tables


def poison_unowned_slots(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: list[int]) -> None:
    """NaN in every slot no sequence owns (spare blocks, the tails of last blocks): a kernel that reads a
    key it must not see returns NaN."""
    block_size = kv_cache.shape[2]
    owned = torch.zeros(kv_cache.shape[1], block_size, dtype=torch.bool, device=DEVICE)
    for row, length in enumerate(seq_lens):
        positions = torch.arange(length, device=DEVICE)
        owned[block_tables[row, positions // block_size].long(), positions % block_size] = True
    kv_cache[:, ~owned] = float("nan")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.block_m}x{c.block_n}w{c.num_warps}")
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,query_lens,lens", PREFILL_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(config, q_heads, kv_heads, head_dim, block_size, query_lens, lens, dtype) -> None:
    torch.manual_seed(0)
    seq_lens = lens or [q + 3 * q % 997 for q in query_lens]
    q, kv_cache, starts, lens_gpu, tables = inputs(
        q_heads, kv_heads, head_dim, block_size, query_lens, seq_lens, dtype
    )
    poison_unowned_slots(kv_cache, tables, seq_lens)
    scale = head_dim**-0.5
    expected = reference.paged_attention_reference(q, kv_cache, starts, lens_gpu, tables, scale)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention_sm90(q, kv_cache, starts, lens_gpu, tables, max(query_lens), scale, out, config)
    assert_attention_close(out, expected)


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_long_prompt_with_a_cached_prefix(block_size: int) -> None:
    """A 1,500-token chunk after 2,600 cached tokens, beside decode rows: the tiles that need no causal
    mask, the diagonal ones and the rows past the tile's last query."""
    torch.manual_seed(1)
    query_lens, seq_lens = [1500, 1, 1, 9], [4100, 3000, 1, 9]
    q, kv_cache, starts, lens_gpu, tables = inputs(
        32, 8, 128, block_size, query_lens, seq_lens, torch.bfloat16
    )
    expected = reference.paged_attention_reference(q, kv_cache, starts, lens_gpu, tables, 0.088)
    for config in CONFIGS:
        out = paged_prefill_attention_sm90(
            q, kv_cache, starts, lens_gpu, tables, 1500, 0.088, torch.empty_like(q), config
        )
        assert_attention_close(out, expected)


def test_the_default_path_takes_it_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """paged_prefill_attention without a config runs the Gluon kernel for a bf16 cache at head dim 128, and
    the Triton kernel for a float8 cache, a window or head dim 256; both agree with the reference."""
    calls = []
    real = prefill_attention.paged_prefill_attention_sm90
    monkeypatch.setattr(
        prefill_attention,
        "paged_prefill_attention_sm90",
        lambda *a, **k: calls.append(a[-1]) or real(*a, **k),
    )
    query_lens, seq_lens = [600, 1, 33], [900, 40, 33]
    q, kv_cache, starts, lens_gpu, tables = inputs(32, 8, 128, 16, query_lens, seq_lens, torch.bfloat16)
    expected = reference.paged_attention_reference(q, kv_cache, starts, lens_gpu, tables, 0.1)
    assert_attention_close(paged_prefill_attention(q, kv_cache, starts, lens_gpu, tables, 600, 0.1), expected)
    assert calls == [SHORT_QUERY_SM90_CONFIG]  # 634 tokens over 3 sequences: a mean under 512
    paged_prefill_attention(q[:600], kv_cache, starts[:2], lens_gpu[:1], tables[:1], 600, 0.1)
    assert calls[-1] == LONG_QUERY_SM90_CONFIG
    calls.clear()
    paged_prefill_attention(q, kv_cache, starts, lens_gpu, tables, 600, 0.1, window=64)
    paged_prefill_attention(q, kv_cache.to(torch.float8_e4m3fn), starts, lens_gpu, tables, 600, 0.1)
    wide = inputs(16, 4, 256, 16, query_lens, seq_lens, torch.bfloat16)
    paged_prefill_attention(*wide, 600, 0.1)
    assert calls == []


def test_replays_in_a_cuda_graph_with_new_inputs() -> None:
    """Captured once (the speculative verify step's graphs run prefill attention), replayed over other
    lengths and cache contents: each replay matches the reference."""
    torch.manual_seed(2)
    query_lens, seq_lens = [40, 3, 3], [700, 64, 5]
    q, kv_cache, starts, lens_gpu, tables = inputs(32, 8, 128, 16, query_lens, seq_lens, torch.bfloat16)
    out = torch.empty_like(q)
    paged_prefill_attention(q, kv_cache, starts, lens_gpu, tables, 40, 0.1, out=out)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention(q, kv_cache, starts, lens_gpu, tables, 40, 0.1, out=out)
    for new_lens in ([650, 50, 3], [41, 3, 3]):
        lens_gpu.copy_(to_device_int32(new_lens))
        q.copy_(torch.randn_like(q))
        kv_cache.copy_(torch.randn_like(kv_cache))
        graph.replay()
        expected = reference.paged_attention_reference(q, kv_cache, starts, lens_gpu, tables, 0.1)
        assert_attention_close(out, expected)
