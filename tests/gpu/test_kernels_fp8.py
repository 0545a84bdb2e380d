"""The Triton kernels over a float8 KV cache (--kv-cache-dtype fp8) against the torch references, with
per-layer k/v scales. Needs CUDA and triton; e4m3 needs compute capability 8.9 (Ada, Hopper)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import reference  # noqa: E402
from fitserve.kernels.cache_write import reshape_and_cache  # noqa: E402
from fitserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from fitserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from fitserve.layers.attention.cpu_backend import CpuAttentionBackend  # noqa: E402
from fitserve.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from tests.gpu.test_kernels import (  # noqa: E402
    DEVICE,
    MAX_CONTEXT,
    TWO_KERNELS,
    cdiv,
    make_paged_cache,
    to_device_int32,
)
from tests.unit.model_helpers import (  # noqa: E402
    ChunkSpec,
    attention_reference_from_metadata,
    build_attention_metadata,
)

pytestmark = pytest.mark.gpu
E4M3 = pytest.param(
    torch.float8_e4m3fn,
    id="e4m3",
    marks=pytest.mark.skipif(
        torch.cuda.get_device_capability() < (8, 9), reason="Triton converts to e4m3 from capability 8.9"
    ),
)
E5M2 = pytest.param(torch.float8_e5m2, id="e5m2")
SCALES = [pytest.param((1.0, 1.0), id="unscaled"), pytest.param((0.37, 2.5), id="scaled")]


def fp8_paged_cache(seq_lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype):
    """make_paged_cache's layout with float8 contents that use the format's range (4 N(0, 1): up to ~20)."""
    kv_cache, block_tables = make_paged_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32)
    return (4 * kv_cache).to(dtype), block_tables


def fp8_attention_atol(kv_cache: torch.Tensor, v_scale: float, dtype: torch.dtype) -> float:
    """The absolute tolerance of attention over a float8 cache, from the arithmetic the kernels share with
    a cache in the model dtype.

    Reading the cache is exact (every e4m3/e5m2 value is a bf16 and fp16 value; the scales are applied in
    float32). What remains is the flash-attention rounding: the P @ V tensor-core dot takes the softmax
    weights p rounded to the query dtype (unit roundoff u: 2**-8 for bf16, 2**-11 for fp16) while the
    normaliser l sums them unrounded, so an output element sum_j p_j v_j / l moves by at most
    u * sum_j p_j |v_j| / l <= u * max|V|, V being the dequantized values (stored * v_scale). The final
    rounding to the output dtype is relative, under the 2e-2 rtol. The bf16 tests' atol of 2e-2 is this
    bound for their N(0, 1) values (max ~5: 5 / 256 ~ 2e-2). fp8_paged_cache's values are 4 N(0, 1) times
    v_scale, max|V| ~ 50 at v_scale 2.5: an output element near zero whose few visible keys hold large
    values lands 0.02-0.03 from the float32 reference (seen on an H100: 1 element in 0.2-2.5 million per
    case, only at v_scale 2.5), well inside u * max|V| ~ 0.2. The bound follows the values, so it means the
    same at every v_scale; the relative-norm check (1e-2) is unchanged and catches systematic errors such
    as a wrong or doubled scale.
    """
    max_value = kv_cache[1].float().abs().max().item() * v_scale
    return max(2e-2, torch.finfo(dtype).eps / 2 * max_value)


def assert_fp8_attention_close(
    out: torch.Tensor, expected: torch.Tensor, kv_cache: torch.Tensor, v_scale: float
) -> None:
    """assert_attention_close with fp8_attention_atol for the absolute tolerance."""
    assert not out.isnan().any(), "kernel output has NaN (an unwritten or 0/0 row)"
    error = (out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-6)
    assert error < 1e-2, f"relative error {error:.2e} is above 1e-2"
    atol = fp8_attention_atol(kv_cache, v_scale, out.dtype)
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=2e-2)


@pytest.mark.parametrize("kv_scales", SCALES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache_fp8_stores_the_reference_bytes(dtype, kv_scales, slot_dtype) -> None:
    k_scale, v_scale = kv_scales
    kv_cache = torch.randn(2, 20, 16, 8, 128, device=DEVICE).to(dtype)
    key = (5 * torch.randn(50, 8, 128, device=DEVICE)).to(torch.bfloat16)
    value = (5 * torch.randn_like(key.float())).to(torch.bfloat16)
    key[0, 0, :4] = torch.tensor([1e5, -1e5, 448.5, -60000.0], device=DEVICE)  # clamped to the range
    slots = torch.randperm(20 * 16)[:50]
    slots[[3, 17, 49]] = -1  # padding tokens write nothing
    slots = slots.to(DEVICE, slot_dtype)
    expected = kv_cache.clone()
    reference.reshape_and_cache_reference(key, value, expected, slots, k_scale, v_scale)
    reshape_and_cache(key, value, kv_cache, slots, k_scale, v_scale)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    limit = torch.finfo(dtype).max
    first_key = kv_cache.view(2, -1, 8, 128)[0, int(slots[0])]
    assert first_key[0, :2].float().tolist() == [limit, -limit]


DECODE_CASES = [  # batch, q heads, kv heads, head_dim, block_size, context lengths (None: random 1..4100)
    (1, 32, 8, 128, 16, [384]),
    (3, 16, 8, 128, 32, [1, 17, MAX_CONTEXT]),
    (7, 16, 4, 64, 32, None),
    (64, 32, 4, 128, 16, None),
    (2, 8, 1, 128, 128, [1000, 33]),
]


@pytest.mark.parametrize("kv_scales", SCALES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("batch,q_heads,kv_heads,head_dim,block_size,lens", DECODE_CASES)
def test_decode_attention_fp8_matches_reference(
    batch, q_heads, kv_heads, head_dim, block_size, lens, dtype, kv_scales
) -> None:
    k_scale, v_scale = kv_scales
    seq_lens = lens or [random.randint(1, MAX_CONTEXT) for _ in range(batch)]
    kv_cache, block_tables = fp8_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(batch, q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    seq_lens_gpu = to_device_int32(seq_lens)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    expected = reference.paged_attention_reference(
        q, kv_cache, query_start_loc, seq_lens_gpu, block_tables, scale, k_scale, v_scale
    )
    for num_partitions, config in ((None, TWO_KERNELS), (1, TWO_KERNELS), (5, TWO_KERNELS)):
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
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert_fp8_attention_close(out, expected, kv_cache, v_scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_decode_attention_fp8_with_fp16_queries(dtype) -> None:
    seq_lens = [3000, 5, 129]
    kv_cache, block_tables = fp8_paged_cache(seq_lens, 2, 128, 16, dtype)
    q = torch.randn(3, 8, 128, device=DEVICE, dtype=torch.float16)
    seq_lens_gpu = to_device_int32(seq_lens)
    expected = reference.paged_attention_reference(
        q, kv_cache, torch.arange(4), seq_lens_gpu, block_tables, 0.1, 0.5, 3.0
    )
    out = paged_decode_attention(q, kv_cache, block_tables, seq_lens_gpu, 0.1, k_scale=0.5, v_scale=3.0)
    assert_fp8_attention_close(out, expected, kv_cache, 3.0)


PREFILL_CASES = [  # q heads, kv heads, head_dim, block_size, query lengths, context lengths
    (16, 8, 128, 16, [1, 17, 300, 64], [1, 17, 300, 64]),
    (32, 4, 128, 32, [100, 513, 1, 7], [1000, MAX_CONTEXT, 2000, 7]),
    (16, 4, 64, 32, [65, 128, 3], [65, 1128, MAX_CONTEXT]),
    (28, 4, 128, 16, [40, 200], [40, 1300]),
    # long queries (a mean of 512+): the long-query tiles, FLOAT8_LONG_QUERY_CONFIG on Hopper
    (32, 8, 128, 16, [2048], [2048]),
    (32, 8, 128, 16, [1024, 600], [1024, 2000]),
]


@pytest.mark.parametrize("kv_scales", SCALES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,block_size,query_lens,lens", PREFILL_CASES)
def test_prefill_attention_fp8_matches_reference(
    q_heads, kv_heads, head_dim, block_size, query_lens, lens, dtype, kv_scales
) -> None:
    k_scale, v_scale = kv_scales
    kv_cache, block_tables = fp8_paged_cache(lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(sum(query_lens), q_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    query_start_loc = to_device_int32([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    seq_lens_gpu = to_device_int32(lens)
    scale = head_dim**-0.5
    expected = reference.paged_attention_reference(
        q, kv_cache, query_start_loc, seq_lens_gpu, block_tables, scale, k_scale, v_scale
    )
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q,
        kv_cache,
        query_start_loc,
        seq_lens_gpu,
        block_tables,
        max(query_lens),
        scale,
        out=out,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    assert_fp8_attention_close(out, expected, kv_cache, v_scale)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_decode_fp8_replays_in_a_cuda_graph(dtype) -> None:
    """The scales are runtime arguments: a captured graph needs no host value and serves new lengths."""
    batch, max_blocks = 4, cdiv(MAX_CONTEXT, 16)
    kv_cache, _ = fp8_paged_cache([MAX_CONTEXT] * batch, 8, 128, 16, dtype)
    num_blocks = kv_cache.shape[1]

    def random_tables() -> torch.Tensor:
        return torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in range(batch)]).int().to(DEVICE)

    q = torch.randn(batch, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    block_tables, seq_lens = random_tables(), to_device_int32([5, 100, 1000, MAX_CONTEXT])
    scales = {"k_scale": 0.6, "v_scale": 1.7}
    paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.1, **scales)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.1, **scales)
    for lens in ([5, 100, 1000, MAX_CONTEXT], [MAX_CONTEXT, 1, 333, 0]):
        q.copy_(torch.randn_like(q))
        block_tables.copy_(random_tables())
        seq_lens.copy_(to_device_int32(lens))
        graph.replay()
        expected = reference.paged_attention_reference(
            q, kv_cache, torch.arange(batch + 1), seq_lens, block_tables, 0.1, 0.6, 1.7
        )
        assert_fp8_attention_close(out, expected, kv_cache, 1.7)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_triton_backend_fp8_matches_the_reference_backend(dtype) -> None:
    """A prefill + cached-prefix chunk + decode step, then a decode step, through both backends on the
    GPU: the same cache bytes, and each backend's output within the kernels' tolerance of the float32
    attention over those bytes. (Each against the other would add up two bf16 approximations: SDPA's
    flash kernels round the softmax weights to bf16 as the Triton kernels do.)"""
    block_size, kv_heads, head_dim, k_scale, v_scale = 16, 4, 128, 0.8, 1.6
    triton_cache = torch.zeros(2, 40, block_size, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    reference_cache = triton_cache.clone()
    steps = [
        [ChunkSpec(0, 70, [3, 9, 1, 30, 7]), ChunkSpec(0, 20, [12, 5])],
        [ChunkSpec(70, 1, [3, 9, 1, 30, 7]), ChunkSpec(20, 33, [12, 5, 22, 8])],
        [ChunkSpec(71, 1, [3, 9, 1, 30, 7]), ChunkSpec(53, 1, [12, 5, 22, 8])],
    ]
    for chunks in steps:
        metadata = build_attention_metadata(chunks, block_size)
        metadata.slot_mapping = metadata.slot_mapping.to(DEVICE)
        metadata.query_start_loc = metadata.query_start_loc.to(DEVICE)
        metadata.seq_lens = metadata.seq_lens.to(DEVICE)
        metadata.block_tables = metadata.block_tables.to(DEVICE)
        num_tokens = sum(c.query_len for c in chunks)
        q = torch.randn(num_tokens, 16, head_dim, device=DEVICE, dtype=torch.bfloat16)
        k = (3 * torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE)).to(torch.bfloat16)
        v = (3 * torch.randn(num_tokens, kv_heads, head_dim, device=DEVICE)).to(torch.bfloat16)
        args = (metadata, head_dim**-0.5, k_scale, v_scale)
        out = TritonAttentionBackend().forward(q, k, v, triton_cache, *args)
        expected = CpuAttentionBackend().forward(q, k, v, reference_cache, *args)
        assert torch.equal(triton_cache.view(torch.uint8), reference_cache.view(torch.uint8))
        exact = attention_reference_from_metadata(q, triton_cache, *args)
        assert_fp8_attention_close(out, exact, triton_cache, v_scale)
        assert_fp8_attention_close(expected, exact, triton_cache, v_scale)
