"""Each Triton kernel in fitserve.kernels against its torch reference, and the Triton attention backend
against a dense attention over every sequence's full key/value history. Needs CUDA and triton."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import decode_attention, reference  # noqa: E402
from fitserve.kernels.activation import silu_and_mul  # noqa: E402
from fitserve.kernels.cache_write import reshape_and_cache  # noqa: E402
from fitserve.kernels.decode_attention import DecodeLaunchConfig, paged_decode_attention  # noqa: E402
from fitserve.kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from fitserve.kernels.prefill_attention import (  # noqa: E402
    LONG_QUERY_CONFIG,
    PrefillLaunchConfig,
    paged_prefill_attention,
)
from fitserve.kernels.rotary import rotary_embedding  # noqa: E402
from fitserve.layers.attention.metadata import AttentionMetadata  # noqa: E402
from fitserve.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
MAX_CONTEXT = 4100
# The default tile given explicitly (choose_config cannot swap in WHOLE_CONTEXT_CONFIG): split-K runs as
# the partition kernel and the merge kernel.
TWO_KERNELS = DecodeLaunchConfig()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 output against a float32-computed reference: relative norm error under 1e-2."""
    assert not out.isnan().any(), "kernel output has NaN (an unwritten or 0/0 row)"
    error = (out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6)
    assert error < 1e-2, f"relative error {error:.2e} is above 1e-2"
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def make_paged_cache(
    seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cache; sequences own shuffled, disjoint blocks; tables padded with 0 and 3 spare columns."""
    blocks_per_seq = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    order = torch.randperm(num_blocks).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 3, dtype=torch.int32)
    taken = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = torch.tensor(order[taken : taken + count], dtype=torch.int32)
        taken += count
    return kv_cache, block_tables.to(DEVICE)


def to_device_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


DECODE_CASES = [  # batch, q heads, kv heads, head_dim, block_size, context lengths (None: random 1..4100)
    (1, 32, 8, 128, 16, [384]),
    (1, 8, 8, 64, 16, [MAX_CONTEXT]),
    (3, 16, 8, 128, 32, [1, 17, MAX_CONTEXT]),
    (7, 16, 4, 64, 32, None),
    (64, 32, 4, 128, 16, None),
    (64, 16, 8, 128, 16, None),
    (5, 28, 4, 128, 64, None),
    (2, 8, 1, 128, 128, [1000, 33]),
    (33, 8, 2, 64, 16, None),
]


@pytest.mark.parametrize("batch,q_heads,kv_heads,head_dim,block_size,lens", DECODE_CASES)
def test_decode_attention_matches_reference(
    batch: int, q_heads: int, kv_heads: int, head_dim: int, block_size: int, lens: list[int] | None
) -> None:
    seq_lens = lens or [random.randint(1, MAX_CONTEXT) for _ in range(batch)]
    kv_cache, block_tables = make_paged_cache(seq_lens, kv_heads, head_dim, block_size, torch.bfloat16)
    q = torch.randn(batch, q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    seq_lens_gpu = to_device_int32(seq_lens)
    expected = reference.paged_attention_reference(
        q, kv_cache, torch.arange(batch + 1, dtype=torch.int32), seq_lens_gpu, block_tables, scale
    )
    # auto, auto partitions on the default tile, direct write, split-K merged by the second kernel
    variants = ((None, None), (None, TWO_KERNELS), (1, TWO_KERNELS), (5, TWO_KERNELS))
    for num_partitions, config in variants:
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(
            q,
            kv_cache,
            block_tables,
            seq_lens_gpu,
            scale,
            out=out,
            num_partitions=num_partitions,
            config=config,
        )
        assert_attention_close(out, expected)


@pytest.mark.parametrize(
    "config",
    [
        DecodeLaunchConfig(32, 4, 3),
        DecodeLaunchConfig(128, 8, 2),
        DecodeLaunchConfig(64, 4, 4),
        decode_attention.WHOLE_CONTEXT_CONFIG,
    ],
)
def test_decode_launch_configs_match_reference(config: DecodeLaunchConfig) -> None:
    seq_lens = [random.randint(1, MAX_CONTEXT) for _ in range(6)] + [1, 64, 65]
    kv_cache, block_tables = make_paged_cache(seq_lens, 8, 128, 16, torch.bfloat16)
    q = torch.randn(len(seq_lens), 32, 128, device=DEVICE, dtype=torch.bfloat16)
    seq_lens_gpu = to_device_int32(seq_lens)
    expected = reference.paged_attention_reference(
        q, kv_cache, torch.arange(len(seq_lens) + 1), seq_lens_gpu, block_tables, 0.088
    )
    for num_partitions in (1, 7):
        out = paged_decode_attention(
            q, kv_cache, block_tables, seq_lens_gpu, 0.088, num_partitions=num_partitions, config=config
        )
        assert_attention_close(out, expected)


def test_whole_context_config_only_for_one_partition_of_at_most_two_programs_per_sm() -> None:
    choose = decode_attention.choose_config
    whole, default = decode_attention.WHOLE_CONTEXT_CONFIG, decode_attention.DEFAULT_DECODE_CONFIG
    assert choose(32, 8, 1, 132) is whole  # the 8B shape at concurrency 32: 256 programs
    assert choose(33, 8, 1, 132) is whole  # 264 programs: two per SM
    assert choose(34, 8, 1, 132) is default
    assert choose(64, 8, 1, 132) is default  # Qwen3-0.6B's batch 64: 512 programs
    assert choose(8, 8, 4, 132) is default  # split-K partitions keep the default tile
    assert choose(64, 8, 1, 132, 128, kv_element_bytes=1) is whole  # a float8 cache: any batch


def test_decode_attention_fp16() -> None:
    seq_lens = [3000, 5, 129]
    kv_cache, block_tables = make_paged_cache(seq_lens, 2, 128, 16, torch.float16)
    q = torch.randn(3, 8, 128, device=DEVICE, dtype=torch.float16)
    seq_lens_gpu = to_device_int32(seq_lens)
    expected = reference.paged_attention_reference(
        q, kv_cache, torch.arange(4), seq_lens_gpu, block_tables, 0.1
    )
    assert_attention_close(paged_decode_attention(q, kv_cache, block_tables, seq_lens_gpu, 0.1), expected)


@pytest.mark.parametrize("config", [TWO_KERNELS, decode_attention.WHOLE_CONTEXT_CONFIG])
def test_decode_padded_rows_get_zeros(config: DecodeLaunchConfig) -> None:
    seq_lens = [700, 0, 12, 0]  # rows 1 and 3 are CUDA-graph batch padding
    kv_cache, block_tables = make_paged_cache([700, 1, 12, 1], 8, 128, 16, torch.bfloat16)
    q = torch.randn(4, 16, 128, device=DEVICE, dtype=torch.bfloat16)
    seq_lens_gpu = to_device_int32(seq_lens)
    expected = reference.paged_attention_reference(
        q, kv_cache, torch.arange(5), seq_lens_gpu, block_tables, 0.1
    )
    for num_partitions in (1, 4):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(
            q,
            kv_cache,
            block_tables,
            seq_lens_gpu,
            0.1,
            out=out,
            num_partitions=num_partitions,
            config=config,
        )
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[3], torch.zeros_like(out[3]))
        assert_attention_close(out, expected)


def test_decode_merge_ignores_unused_partitions_that_hold_nan() -> None:
    """Partitions past the context are not written this step and hold whatever the buffer held (here
    NaN, from a freed block the caching allocator hands back); the merge loads only those the context
    used, so none of it reaches the output."""
    seq_lens = [40, 300]  # 1 and 5 of the 64-token partitions used, out of 8
    kv_cache, block_tables = make_paged_cache(seq_lens, 8, 128, 16, torch.bfloat16)
    q = torch.randn(2, 16, 128, device=DEVICE, dtype=torch.bfloat16)
    seq_lens_gpu = to_device_int32(seq_lens)
    expected = reference.paged_attention_reference(
        q, kv_cache, torch.arange(3), seq_lens_gpu, block_tables, 0.1
    )
    for _ in range(3):
        # blocks of the sizes the partial buffers take, full of NaN, freed just before the call
        poison = [torch.full((2, 16, 8), float("nan"), device=DEVICE) for _ in range(2)]
        poison.append(torch.full((2, 16, 8, 128), float("nan"), device=DEVICE))
        del poison
        out = paged_decode_attention(q, kv_cache, block_tables, seq_lens_gpu, 0.1, num_partitions=8)
        assert_attention_close(out, expected)


def test_decode_replays_in_a_cuda_graph_with_new_lengths() -> None:
    """The launch reads no host values: a captured graph serves new seq_lens/block_tables contents."""
    batch, max_blocks = 4, cdiv(MAX_CONTEXT, 16)
    first_lens, second_lens = [5, 100, 1000, MAX_CONTEXT], [MAX_CONTEXT, 1, 333, 0]
    kv_cache, _ = make_paged_cache([MAX_CONTEXT] * batch, 8, 128, 16, torch.bfloat16)
    num_blocks = kv_cache.shape[1]

    def random_tables() -> torch.Tensor:
        return torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in range(batch)]).int().to(DEVICE)

    q = torch.randn(batch, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    block_tables, seq_lens = random_tables(), to_device_int32(first_lens)
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.1, config=TWO_KERNELS)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.1, config=TWO_KERNELS)
    for lens in (first_lens, second_lens):
        q.copy_(torch.randn_like(q))
        block_tables.copy_(random_tables())
        seq_lens.copy_(to_device_int32(lens))
        graph.replay()
        expected = reference.paged_attention_reference(
            q, kv_cache, torch.arange(batch + 1), seq_lens, block_tables, 0.1
        )
        assert_attention_close(out, expected)


PREFILL_CASES = [  # q heads, kv heads, head_dim, block_size, query lengths, context lengths (None: random)
    (16, 8, 128, 16, [1, 17, 300, 64], [1, 17, 300, 64]),
    (32, 4, 128, 32, [100, 513, 1, 7], [1000, MAX_CONTEXT, 2000, 7]),
    (8, 8, 64, 16, [1] * 20 + [250], None),
    (16, 4, 64, 32, [65, 128, 3], [65, 1128, MAX_CONTEXT]),
    (28, 4, 128, 16, [40, 200], [40, 1300]),
    (32, 8, 128, 16, [1024, 1024], [1024, 3000]),
]


def run_prefill_case(
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    lens: list[int] | None,
    config: PrefillLaunchConfig | None = None,
) -> None:
    seq_lens = lens or [q + random.randint(0, MAX_CONTEXT - q) for q in query_lens]
    kv_cache, block_tables = make_paged_cache(seq_lens, kv_heads, head_dim, block_size, torch.bfloat16)
    q = torch.randn(sum(query_lens), q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    query_start_loc = to_device_int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    seq_lens_gpu = to_device_int32(seq_lens)
    scale = head_dim**-0.5
    expected = reference.paged_attention_reference(
        q, kv_cache, query_start_loc, seq_lens_gpu, block_tables, scale
    )
    out = torch.full_like(q, float("nan"))
    extra = {"config": config} if config else {}
    paged_prefill_attention(
        q, kv_cache, query_start_loc, seq_lens_gpu, block_tables, max(query_lens), scale, out=out, **extra
    )
    assert_attention_close(out, expected)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,query_lens,lens", PREFILL_CASES)
def test_prefill_attention_matches_reference(
    q_heads: int, kv_heads: int, head_dim: int, block_size: int, query_lens: list[int], lens: list[int] | None
) -> None:
    run_prefill_case(q_heads, kv_heads, head_dim, block_size, query_lens, lens)


@pytest.mark.parametrize(
    "config", [PrefillLaunchConfig(128, 64, 8, 2), PrefillLaunchConfig(64, 32, 4, 3), LONG_QUERY_CONFIG]
)
def test_prefill_launch_configs_match_reference(config: PrefillLaunchConfig) -> None:
    run_prefill_case(32, 4, 128, 16, [100, 513, 1, 7], [1000, MAX_CONTEXT, 2000, 7], config)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_matches_reference(slot_dtype: torch.dtype) -> None:
    kv_cache = torch.randn(2, 20, 16, 8, 128, device=DEVICE).to(torch.bfloat16)
    key = torch.randn(50, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(20 * 16)[:50]
    slots[[3, 17, 49]] = -1  # padding tokens write nothing
    slots = slots.to(DEVICE, slot_dtype)
    expected = kv_cache.clone()
    reference.reshape_and_cache_reference(key, value, expected, slots)
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("num_rows,hidden", [(1, 1024), (7, 896), (300, 4096), (64, 8192)])
def test_rms_norms_match_reference(num_rows: int, hidden: int) -> None:
    x = torch.randn(num_rows, hidden, device=DEVICE, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(torch.bfloat16)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), reference.rms_norm_reference(x, weight, 1e-6), atol=1e-2, rtol=2e-2
    )
    expected_normed, expected_sum = reference.fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    normed, summed = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(normed, expected_normed, atol=1e-2, rtol=2e-2)


def test_rms_norm_per_head_on_a_strided_view() -> None:
    qkv = torch.randn(33, (16 + 8 + 8) * 128, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, : 16 * 128].view(33, 16, 128)  # Qwen3's per-head q_norm reads this view without a copy
    weight = torch.randn(128, device=DEVICE).to(torch.bfloat16)
    torch.testing.assert_close(
        rms_norm(q, weight, 1e-6), reference.rms_norm_reference(q, weight, 1e-6), atol=1e-2, rtol=2e-2
    )


@pytest.mark.parametrize(
    "num_tokens,q_heads,kv_heads,head_dim,rotary_dim",
    [(1, 32, 8, 128, 128), (77, 16, 8, 128, 128), (300, 14, 2, 64, 64), (5, 8, 8, 128, 64)],
)
def test_rotary_embedding_matches_reference(
    num_tokens: int, q_heads: int, kv_heads: int, head_dim: int, rotary_dim: int
) -> None:
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=torch.bfloat16)
    q = qkv[:, : q_heads * head_dim].view(num_tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    untouched_v = qkv[:, (q_heads + kv_heads) * head_dim :].clone()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim))
    cos_sin_cache = reference.rotary_cos_sin_cache(inv_freq, 4096)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    expected_q, expected_k = reference.rotary_embedding_reference(positions, q, k, cos_sin_cache)
    rotary_embedding(positions, q, k, cos_sin_cache)
    torch.testing.assert_close(q, expected_q, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(k, expected_k, atol=1e-2, rtol=1e-2)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim :], untouched_v)


@pytest.mark.parametrize("num_rows,intermediate", [(1, 3072), (37, 11008), (256, 1536), (3, 1000)])
def test_silu_and_mul_matches_reference(num_rows: int, intermediate: int) -> None:
    x = 3 * torch.randn(num_rows, 2 * intermediate, device=DEVICE, dtype=torch.bfloat16)
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul_reference(x), atol=1e-2, rtol=2e-2)


def dense_causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Independent of the package: row by row softmax over a sequence's whole history, float64."""
    num_queries, num_heads, _ = q.shape
    group = num_heads // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for j in range(num_queries):
        visible = keys.shape[0] - num_queries + j + 1
        for h in range(num_heads):
            k = keys[:visible, h // group].double()
            weights = torch.softmax((k @ q[j, h].double()) * scale, dim=0)
            out[j, h] = weights @ values[:visible, h // group].double()
    return out


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size", [(16, 4, 128, 16), (8, 8, 64, 32)])
def test_backend_steps_match_dense_attention(
    q_heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Prefill, a chunk + decode + prefix-cache-hit mixed step, then decode steps, through the backend."""
    backend = TritonAttentionBackend()
    kv_cache = torch.randn(2, 64, block_size, kv_heads, head_dim, device=DEVICE).to(torch.bfloat16)
    free_blocks = torch.randperm(64).tolist()
    tables: dict[str, list[int]] = {}
    keys: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    shared = (32 // block_size) * block_size  # C reuses A's first full blocks (a prefix-cache hit)
    steps = [
        {"A": 37, "B": 64},
        {"B": 36, "A": 1, "C": 10},
        {"A": 1, "B": 1, "C": 1},
        {"C": 1, "A": 1, "B": 1},
    ]
    scale = head_dim**-0.5
    for step in steps:
        if "C" in step and "C" not in tables:
            tables["C"] = tables["A"][: shared // block_size]
            keys["C"], values["C"] = keys["A"][:shared], values["A"][:shared]
        slot_mapping, query_lens, seq_lens, new_k, new_v = [], [], [], [], []
        for name, num_new in step.items():
            context_before = len(keys.get(name, []))
            table = tables.setdefault(name, [])
            while len(table) * block_size < context_before + num_new:
                table.append(free_blocks.pop())
            positions = range(context_before, context_before + num_new)
            slot_mapping += [table[p // block_size] * block_size + p % block_size for p in positions]
            k = torch.randn(num_new, kv_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            keys[name] = torch.cat([keys[name], k]) if name in keys else k
            values[name] = torch.cat([values[name], v]) if name in values else v
            new_k.append(k)
            new_v.append(v)
            query_lens.append(num_new)
            seq_lens.append(context_before + num_new)
        width = max(len(tables[name]) for name in step) + 2
        block_tables = torch.zeros(len(step), width, dtype=torch.int32)
        for i, name in enumerate(step):
            block_tables[i, : len(tables[name])] = torch.tensor(tables[name], dtype=torch.int32)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=DEVICE),
            query_start_loc=to_device_int32([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
            seq_lens=to_device_int32(seq_lens),
            block_tables=block_tables.to(DEVICE),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        q = torch.randn(sum(query_lens), q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
        out = backend.forward(q, torch.cat(new_k), torch.cat(new_v), kv_cache, metadata, scale)
        start = 0
        for name, num_new in step.items():
            expected = dense_causal_attention(q[start : start + num_new], keys[name], values[name], scale)
            assert_attention_close(out[start : start + num_new], expected)
            cached_k, cached_v = reference.gather_sequence_kv(
                kv_cache, torch.tensor(tables[name], device=DEVICE), len(keys[name])
            )
            assert torch.equal(cached_k, keys[name]) and torch.equal(cached_v, values[name])
            start += num_new


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
