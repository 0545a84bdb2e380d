"""The Triton decode and prefill attention kernels with a sliding window, at Gemma-4's sizes (head dims 256
and 512, windows 512 / 1024, contexts past 3,000), against a float32 softmax over each query's visible
keys computed from the full keys (positions p - window + 1 .. p, as transformers masks them).

The caches are laid out as a sliding KV cache group's are (fitserve/worker/group_tables.py): block-table
entries for blocks wholly behind the window of a sequence's first query are the null block 0, and block 0
holds NaN, so a kernel that loads any key or value of it returns NaN. Needs CUDA and triton.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels.decode_attention import DecodeLaunchConfig, paged_decode_attention  # noqa: E402
from fitserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from fitserve.layers.attention.metadata import AttentionMetadata  # noqa: E402
from fitserve.layers.attention.triton_backend import TritonAttentionBackend  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
BLOCK = 16
# (query heads, KV heads, head dim) per layer kind
SHAPES = {
    "26b-a4b sliding": (16, 8, 256),
    "26b-a4b full": (16, 2, 512),
    "31b sliding": (32, 16, 256),
    "31b full": (32, 4, 512),
    "e2b sliding": (8, 1, 256),
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Step:
    """One step over a sliding group's cache. seqs: (cached tokens, new tokens) per sequence."""

    def __init__(self, seqs, shape: str, window: int | None, seed: int = 0, decode: bool = False) -> None:
        heads, kv_heads, dim = SHAPES[shape]
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        self.seqs, self.window, self.heads, self.dim = seqs, window, heads, dim
        self.totals = [cached + new for cached, new in seqs]
        width = max(cdiv(t, BLOCK) for t in self.totals) + 3  # full-length rows, 0 past the context
        num_blocks = 1 + sum(cdiv(t, BLOCK) for t in self.totals)
        self.cache = torch.empty(2, num_blocks, BLOCK, kv_heads, dim, dtype=torch.bfloat16, device=DEVICE)
        self.cache[:, 0] = float("nan")  # the null block: never read
        order = (torch.randperm(num_blocks - 1, device=DEVICE, generator=generator) + 1).tolist()
        self.tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        self.keys, self.values = [], []
        for row, ((cached, _), total) in enumerate(zip(seqs, self.totals)):
            kv = torch.randn(2, total, kv_heads, dim, device=DEVICE, generator=generator).to(torch.bfloat16)
            self.keys.append(kv[0])
            self.values.append(kv[1])
            first_live = 0 if window is None else max(0, cached - window + 1) // BLOCK
            for block in range(first_live, cdiv(total, BLOCK)):
                self.tables[row, block] = order.pop()
                count = min(total, (block + 1) * BLOCK) - block * BLOCK
                self.cache[:, self.tables[row, block], :count] = kv[:, block * BLOCK : block * BLOCK + count]
        self.tables = self.tables.to(DEVICE)
        self.query_lens = [1 if decode else new for _, new in seqs]
        self.q = torch.randn(sum(self.query_lens), heads, dim, device=DEVICE, generator=generator)
        self.q = self.q.to(torch.bfloat16)
        self.seq_lens = torch.tensor(self.totals, dtype=torch.int32, device=DEVICE)
        starts = torch.tensor([0, *torch.tensor(self.query_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.query_start_loc = starts.to(DEVICE)
        self.scale = 1.0  # Gemma-4's

    def reference(self) -> torch.Tensor:
        out, row = torch.zeros(self.q.shape, dtype=torch.float32, device=DEVICE), 0
        group = self.heads // self.keys[0].shape[1]
        for (cached, new), k, v, rows in zip(self.seqs, self.keys, self.values, self.query_lens):
            if new > 0:
                positions = torch.arange(cached, cached + new, device=DEVICE)
                key_positions = torch.arange(cached + new, device=DEVICE)
                visible = key_positions[None, :] <= positions[:, None]
                if self.window is not None:
                    visible &= key_positions[None, :] > positions[:, None] - self.window
                ks = k.float().repeat_interleave(group, dim=1)
                vs = v.float().repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", self.q[row : row + new].float(), ks) * self.scale
                weights = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
                out[row : row + new] = torch.einsum("hqk,khd->qhd", weights, vs)
            row += rows
        return out

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(sum(self.query_lens), dtype=torch.int64, device=DEVICE),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.tables,
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.totals),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.totals,
        )


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 output against a float32 reference: no NaN (block 0 unread), relative norm error under 1e-2."""
    assert not out.isnan().any(), "NaN in the output: a key or value of the null block was read"
    error = (out.float() - expected).norm() / expected.norm().clamp_min(1e-6)
    assert error < 1e-2, f"relative error {error:.2e} is above 1e-2"
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


DECODE_CONTEXTS = [3000, 4100, 1025, 1024, 700, 1, 6000]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window", [1024, 512, None])
def test_decode_matches_reference(shape, window):
    step = Step([(n - 1, 1) for n in DECODE_CONTEXTS], shape, window, decode=True)
    out = paged_decode_attention(step.q, step.cache, step.tables, step.seq_lens, step.scale, window=window)
    assert_attention_close(out, step.reference())


@pytest.mark.parametrize("shape", ["26b-a4b sliding", "31b full"])
@pytest.mark.parametrize("num_partitions", [1, 5, 64])
def test_decode_partitions_with_a_window(shape, num_partitions):
    """Whatever the split: one partition (written directly), a few, more than the window has tiles."""
    step = Step([(n - 1, 1) for n in DECODE_CONTEXTS], shape, 1024, seed=1, decode=True)
    out = paged_decode_attention(
        step.q, step.cache, step.tables, step.seq_lens, step.scale, num_partitions=num_partitions, window=1024
    )
    assert_attention_close(out, step.reference())


def test_decode_large_batch_with_a_window():
    """A batch that fills the GPU (one partition, WRITE_DIRECT), contexts from 1 to 9,000."""
    contexts = torch.randint(1, 9000, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    step = Step([(n - 1, 1) for n in contexts], "26b-a4b sliding", 1024, seed=3, decode=True)
    out = paged_decode_attention(step.q, step.cache, step.tables, step.seq_lens, 1.0, window=1024)
    assert_attention_close(out, step.reference())


def test_decode_graph_replays_with_new_lengths_and_a_window():
    """The launch reads no host value of the step's lengths: a graph captured on one step's buffers
    replays another step's lengths and tables correctly."""
    first = Step([(n - 1, 1) for n in [3000, 200, 5000, 1]], "26b-a4b sliding", 1024, seed=4, decode=True)
    second = Step([(n - 1, 1) for n in [120, 4500, 1030, 2999]], "26b-a4b sliding", 1024, seed=5, decode=True)
    width = max(first.tables.shape[1], second.tables.shape[1])
    tables = torch.zeros(4, width, dtype=torch.int32, device=DEVICE)
    tables[:, : first.tables.shape[1]] = first.tables
    lens, q = first.seq_lens.clone(), first.q.clone()
    num_blocks = max(first.cache.shape[1], second.cache.shape[1])
    cache = torch.empty(2, num_blocks, *first.cache.shape[2:], device=DEVICE, dtype=torch.bfloat16)
    cache[:, : first.cache.shape[1]] = first.cache
    out = torch.empty_like(q)
    config = DecodeLaunchConfig(tile_tokens=32, num_warps=4, num_stages=3)  # split-K and the merge
    paged_decode_attention(q, cache, tables, lens, 1.0, out, 8, config, window=1024)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, cache, tables, lens, 1.0, out, 8, config, window=1024)
    graph.replay()
    assert_attention_close(out, first.reference())
    tables.zero_()
    tables[:, : second.tables.shape[1]] = second.tables
    lens.copy_(second.seq_lens)
    q.copy_(second.q)
    cache[:, : second.cache.shape[1]] = second.cache
    cache[:, 0] = float("nan")
    graph.replay()
    assert_attention_close(out, second.reference())


PREFILL_STEPS = {
    "a fresh prompt past the window": [(0, 3000)],
    "chunks and decodes": [(2500, 700), (4000, 1), (1000, 30), (0, 1200)],
    "a chunk just past the window": [(1020, 10), (3, 1)],
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("step_name", list(PREFILL_STEPS))
@pytest.mark.parametrize("window", [1024, None])
def test_prefill_matches_reference(shape, step_name, window):
    step = Step(PREFILL_STEPS[step_name], shape, window, seed=6)
    out = paged_prefill_attention(
        step.q,
        step.cache,
        step.query_start_loc,
        step.seq_lens,
        step.tables,
        max(step.query_lens),
        step.scale,
        window=window,
    )
    assert_attention_close(out, step.reference())


@pytest.mark.parametrize("decode", [True, False])
def test_backend_reads_a_shared_cache_with_a_window(decode):
    """A KV-shared layer's call: write=False, k = v = None, the window of its source layer (E2B: 512)."""
    seqs = [(n - 1, 1) for n in DECODE_CONTEXTS] if decode else PREFILL_STEPS["chunks and decodes"]
    step = Step(seqs, "e2b sliding", 512, seed=7, decode=decode)
    before = step.cache.clone()
    out = TritonAttentionBackend().forward(
        step.q, None, None, step.cache, step.metadata(), 1.0, window=512, write=False
    )
    assert_attention_close(out, step.reference())
    assert torch.equal(step.cache.view(torch.int16), before.view(torch.int16)), "a read-only forward wrote"
