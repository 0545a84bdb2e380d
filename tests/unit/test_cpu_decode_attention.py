"""fitserve's C decode attention (fitserve/layers/cpu/c_kernels/decode_attention.c) against the CPU
backend's general torch path: same outputs within float32 summation-order noise, the same cache contents
bit for bit; each test once per kernel set this CPU has."""

from __future__ import annotations

import pytest
import torch

from fitserve.layers.attention.cpu_backend import CpuAttentionBackend
from fitserve.layers.cpu.c_kernels import library
from fitserve.layers.cpu.c_kernels.decode_attention import BoundDecodeAttention, DecodeAttention
from tests.unit.cpu_kernel_sets import KERNEL_SET_NAMES, use_kernel_set
from tests.unit.test_paged_decode import CASES, decode_step, general_path, run_layers


@pytest.fixture(autouse=True, params=KERNEL_SET_NAMES)
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> library.CpuKernels:
    return use_kernel_set(request.param, monkeypatch)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_general_path(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    tables, seq_lens = CASES[case]
    caches, metadata, inputs = decode_step(tables, seq_lens)
    calls = []
    real_call = BoundDecodeAttention.__call__

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(BoundDecodeAttention, "__call__", counted)
    kernel_caches = [cache.clone() for cache in caches]
    got = run_layers(kernel_caches, metadata, inputs)
    assert len(calls) == len(caches)  # every layer took the kernel
    general_path(monkeypatch)
    want = run_layers(caches, metadata, inputs)
    for kernel_out, general_out in zip(got, want, strict=True):
        torch.testing.assert_close(kernel_out, general_out, atol=2e-6, rtol=1e-5)
    for kernel_cache, general_cache in zip(kernel_caches, caches, strict=True):
        assert torch.equal(kernel_cache, general_cache)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 4, 32), (16, 1, 16), (8, 2, 128), (9, 3, 64), (12, 2, 64), (6, 1, 128)],
)
def test_kernel_handles_head_groupings(
    kernels: library.CpuKernels, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads)
    block_size, num_blocks = 16, 12
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([37, 16, 1], dtype=torch.int32)
    tables = torch.tensor([[9, 2, 5], [4, 0, 0], [11, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([5 * block_size + 4, 4 * block_size + 15, 11 * block_size])
    q = torch.randn(3, num_heads, head_dim, generator=gen)
    k = torch.randn(3, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(3, num_kv_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    got = kernels.decode_attention(q, k, v, cache, slots, tables, seq_lens, scale)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    for b, length in enumerate(seq_lens.tolist()):
        positions = torch.arange(length)
        rows = tables[b, positions // block_size].long() * block_size + positions % block_size
        keys = flat[0, rows].double().repeat_interleave(group, dim=1)
        values = flat[1, rows].double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), keys) * scale, dim=-1)
        want = torch.einsum("ht,thd->hd", weights, values)
        torch.testing.assert_close(got[b].double(), want, atol=1e-5, rtol=1e-5)  # float32 sums


def test_kernel_reads_strided_queries_and_keys(kernels: library.CpuKernels) -> None:
    """q and k as the model hands them: views of one [T, heads + kv_heads, D] rotation output."""
    caches, metadata, _ = decode_step([[3, 8], [6]], [6, 2])
    gen = torch.Generator().manual_seed(5)
    qk = torch.randn(2, 8, 16, generator=gen)
    v = torch.randn(2, 40, generator=gen)[:, 8:40].view(2, 2, 16)
    q, k = qk[:, :6], qk[:, 6:]
    assert DecodeAttention.supports(q, k, v, caches[0])
    backend = CpuAttentionBackend()
    got = backend.forward(q, k, v, caches[0], metadata, 0.3)
    contiguous_cache = caches[1]
    contiguous_cache.copy_(caches[0])  # both now hold the written k and v
    want = kernels.decode_attention(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        contiguous_cache,
        metadata.slot_mapping,
        metadata.block_tables,
        metadata.seq_lens,
        0.3,
    )
    assert torch.equal(got, want)


def test_kernel_declines_what_it_does_not_hold() -> None:
    q, k, v = torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    cache = torch.zeros(2, 4, 16, 2, 32)
    assert DecodeAttention.supports(q, k, v, cache)
    assert not DecodeAttention.supports(q, k, v, cache.bfloat16())
    assert not DecodeAttention.supports(q[..., :24], k[..., :24], v[..., :24], cache[..., :24])
    assert not DecodeAttention.supports(torch.randn(1, 34, 32), k, v, cache)  # 17 query heads per kv head
