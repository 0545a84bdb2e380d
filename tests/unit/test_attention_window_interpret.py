"""The Triton decode (split-K) and prefill (varlen) attention kernels with a sliding window, under Triton's
interpreter on the CPU at tiny shapes, against a float64 softmax over each query's visible keys computed
from the full keys (positions p - window + 1 .. p, as transformers masks them); plus the launch choices
and the layer's window plumbing, in plain Python.

The caches are laid out as a sliding KV cache group's are (fitserve/worker/group_tables.py): block-table
entries for blocks wholly behind the window of a sequence's first query are the null block 0, and block 0
holds NaN, so a kernel that loads any key or value of it (even one it then masks) returns NaN.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child process: this file
run as a script (`python tests/unit/test_attention_window_interpret.py CASES_JSON`) with the variable set
(tests/unit/triton_interpreter.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from tests.unit.triton_interpreter import run_in_interpreter as run_script_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # max |out - ref| / max |ref|


def case(kind: str, seqs: list[list[int]], window: int | None, head_dim: int = 64, **extra) -> dict:
    """seqs: [cached tokens, new tokens] per sequence (decode: new = 1; [0, 0] is a padded batch row)."""
    spec = {"kind": kind, "seqs": seqs, "window": window, "head_dim": head_dim}
    spec.update({"heads": 8, "kv_heads": 2, "block_size": 16, "dtype": "float32", **extra})
    return spec


DECODE_SEQS = [[99, 1], [36, 1], [4, 1], [70, 1]]
# chunked prefill over cached prefixes, a fresh prompt, and a decode row in the same step
PREFILL_SEQS = [[0, 40], [50, 21], [69, 1], [33, 7]]
CASES = [
    # decode: no window, a window shorter than the contexts, one longer than all of them
    *(case("decode", DECODE_SEQS, window) for window in (None, 20, 500)),
    case("decode", DECODE_SEQS, 20, num_partitions=1),  # one partition: the output written directly
    case("decode", DECODE_SEQS, 37, num_partitions=3),  # a window not aligned to the tile or the blocks
    case("decode", [[99, 1], [0, 0], [40, 1]], 17),  # a padded row (seq_len 0) gets zeros
    case("decode", [[120, 1], [30, 1]], 1),  # the window holds only the token itself
    case("decode", DECODE_SEQS, 24, head_dim=256, heads=4, kv_heads=2),
    case("decode", [[60, 1], [9, 1]], 16, head_dim=512, heads=8, kv_heads=1),  # Gemma-4's full-layer GQA 8
    case("decode", DECODE_SEQS, 20, dtype="bfloat16"),
    case("decode", DECODE_SEQS, 20, head_dim=80, heads=6, kv_heads=2),  # head dim below its power of two
    # prefill: the default tile, then small tiles so a tile's key loop has window-edge, unmasked and
    # diagonal tiles
    *(case("prefill", PREFILL_SEQS, window) for window in (None, 12, 300)),
    *(case("prefill", PREFILL_SEQS, window, config=[16, 16]) for window in (24, 5)),
    case("prefill", [[0, 70]], 9, config=[32, 16]),  # a window shorter than a query tile
    case("prefill", PREFILL_SEQS, 20, head_dim=256, heads=4, kv_heads=2),
    case("prefill", [[0, 30], [20, 9]], 12, head_dim=512, heads=8, kv_heads=1),
    case("prefill", [[30, 700]], 24, head_dim=64, heads=2, kv_heads=1),  # the long-query config
    case("prefill", PREFILL_SEQS, 12, dtype="bfloat16"),
    case("prefill", PREFILL_SEQS, 12, head_dim=48, heads=3, kv_heads=1),
    # the backend, reading a cache it does not write (a KV-shared layer), decode and mixed steps
    case("backend", DECODE_SEQS, 20),
    case("backend", PREFILL_SEQS, 12),
    case("backend", PREFILL_SEQS, None),
    case("backend", [[3, 1], [10, 1]], 512),  # every context inside the window
]


def run_in_interpreter(cases: list[dict]) -> list[dict]:
    return run_script_in_interpreter(__file__, cases)


@needs_triton
def test_kernels_match_the_windowed_reference() -> None:
    results = run_in_interpreter(CASES)
    assert len(results) == len(CASES)
    failed = [r for r in results if not r["finite"] or r["error"] > TOLERANCE[r["case"]["dtype"]]]
    assert not failed, failed
    for r in results:
        assert r["padded_rows_zero"], r
    # the window really applies: the same decode/prefill steps with and without it differ
    plain = [r for r in results if r["case"] in [case("decode", DECODE_SEQS, w) for w in (None, 20, 500)]]
    plain += [r for r in results if r["case"] in [case("prefill", PREFILL_SEQS, w) for w in (None, 12)]]
    by_window = {(r["case"]["kind"], r["case"]["window"]): r["checksum"] for r in plain}
    assert len(by_window) == 5
    assert abs(by_window[("decode", 20)] - by_window[("decode", None)]) > 1e-3
    assert abs(by_window[("decode", 500)] - by_window[("decode", None)]) < 1e-3
    assert abs(by_window[("prefill", 12)] - by_window[("prefill", None)]) > 1e-3


# --- launch choices and the layer, plain Python --------------------------------------------------------


@needs_triton
def test_decode_partitions_cover_the_window_not_the_context() -> None:
    from fitserve.kernels.decode_attention import choose_num_partitions

    # one sequence of a 100k-token table, 8 KV heads on 132 SMs: 33 partitions of 32 keys, not 64 of 1.6k
    assert choose_num_partitions(1, 8, 100_000, 132, 32, window=1024) == 33
    assert choose_num_partitions(1, 8, 100_000, 132, 32) == 64
    assert choose_num_partitions(1, 8, 512, 132, 32, window=1024) == 16  # the table is the shorter span
    assert choose_num_partitions(200, 8, 100_000, 132, 32, window=1024) == 1


@needs_triton
def test_head_dim_128_configs_are_unchanged_and_wide_heads_get_their_own() -> None:
    from fitserve.kernels import decode_attention as decode
    from fitserve.kernels import prefill_attention as prefill

    assert decode.choose_config(8, 8, 1, 132) is decode.WHOLE_CONTEXT_CONFIG
    assert decode.choose_config(8, 8, 4, 132, 128) is decode.DEFAULT_DECODE_CONFIG
    assert decode.choose_config(8, 8, 1, 132, 256) is decode.HEAD_256_DECODE_CONFIG
    assert decode.choose_config(8, 2, 1, 132, 512) is decode.WIDE_HEAD_DECODE_CONFIG
    assert decode.DecodeLaunchConfig(64, 4, 2) == decode.DEFAULT_DECODE_CONFIG
    assert decode.DecodeLaunchConfig(128, 4, 5) == decode.WHOLE_CONTEXT_CONFIG
    assert prefill.choose_prefill_config(4096, 1) is prefill.LONG_QUERY_CONFIG
    assert prefill.choose_prefill_config(100, 10, 128) is prefill.DEFAULT_PREFILL_CONFIG
    assert prefill.PrefillLaunchConfig(128, 32, 4, 3) == prefill.LONG_QUERY_CONFIG
    assert prefill.PrefillLaunchConfig(64, 64, 4, 2) == prefill.DEFAULT_PREFILL_CONFIG
    assert prefill.choose_prefill_config(4096, 1, 256) is prefill.HEAD_256_LONG_QUERY_CONFIG
    assert prefill.choose_prefill_config(100, 10, 256) is prefill.HEAD_256_CONFIG
    assert prefill.choose_prefill_config(4096, 1, 512) is prefill.WIDE_HEAD_CONFIG
    # the [BLOCK_M, D] float32 accumulator stays at or under 128 registers a thread
    for config, head_dim in [
        (prefill.HEAD_256_CONFIG, 256),
        (prefill.HEAD_256_LONG_QUERY_CONFIG, 256),
        (prefill.WIDE_HEAD_CONFIG, 512),
    ]:
        assert config.block_m * head_dim // (32 * config.num_warps) <= 128, config


@needs_triton
def test_bad_windows_are_refused() -> None:
    from fitserve.kernels.decode_attention import paged_decode_attention
    from fitserve.kernels.prefill_attention import paged_prefill_attention

    q, cache = torch.zeros(1, 2, 16), torch.zeros(2, 2, 16, 1, 16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="window=0 must be at least 1"):
        paged_decode_attention(q, cache, tables, lens, 1.0, window=0)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="window=-3 must be at least 1"):
        paged_prefill_attention(q, cache, starts, lens, tables, 1, 1.0, window=-3)


class _RecordingBackend:
    """Records the window each call passes; attends to nothing (returns zeros)."""

    name = "recording"
    supports_sliding_window = True
    supports_kv_sharing = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None, bool]] = []

    def fuses_rotary(self, head_dim, rope) -> bool:
        return False

    def forward(self, q, k, v, kv_cache, metadata, scale, k_scale=1.0, v_scale=1.0, rope=None, qk_norm=None,
                window=None, write=True):  # fmt: skip
        self.calls.append(("forward", window, write))
        return torch.zeros_like(q)

    def attend(self, q, kv_cache, metadata, scale, k_scale=1.0, v_scale=1.0, out=None, window=None):
        self.calls.append(("attend", window, True))
        return torch.zeros_like(q)


def _metadata(seq_len: int, query_len: int) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(query_len),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.zeros(1, 8, dtype=torch.int32),
        max_query_len=query_len,
        max_seq_len=seq_len,
        query_lens_cpu=[query_len],
        seq_lens_cpu=[seq_len],
    )


def test_layer_passes_the_window_on_every_path_past_the_window(monkeypatch) -> None:
    """Contexts longer than the window are not refused with a backend that masks it: forward, the
    piecewise runner's attend_cached and a KV-shared layer all hand it the window."""
    import fitserve.layers.attention.layer as layer_module
    from fitserve.layers.attention.layer import Attention

    backend = _RecordingBackend()
    monkeypatch.setattr(layer_module, "get_attention_backend", lambda device: backend)
    sliding = Attention(4, 16, 1.0, 2, layer_idx=0, sliding_window=8)
    shared = Attention(4, 16, 1.0, 2, layer_idx=1, sliding_window=8, kv_cache_layer=0)
    full = Attention(4, 16, 1.0, 2, layer_idx=2)
    q, kv = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    with forward_context(_metadata(100, 3), [torch.zeros(1)] * 3):
        sliding.forward(q, kv, kv)
        sliding.attend_cached(q)
        shared.forward(q, None, None)
        full.forward(q, kv, kv)
        full.attend_cached(q)
    assert backend.calls == [
        ("forward", 8, True),
        ("attend", 8, True),
        ("forward", 8, False),
        ("forward", None, True),
        ("attend", None, True),
    ]


# --- the child ---------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _build(spec: dict) -> dict:
    """The step's tensors: a cache laid out as a sliding group's (null entries behind the window, block 0
    all NaN), the full keys/values per sequence, and q."""
    dtype = getattr(torch, spec["dtype"])
    bs, kv_heads, dim, window = spec["block_size"], spec["kv_heads"], spec["head_dim"], spec["window"]
    # the same data for a step with any window, so the tests can compare them
    generator = torch.Generator().manual_seed(len(json.dumps(spec["seqs"])) + dim)
    totals = [cached + new for cached, new in spec["seqs"]]
    width = max(_cdiv(t, bs) for t in totals) + 2  # full-length rows, padded with 0 past the context
    num_blocks = 1 + sum(_cdiv(t, bs) for t in totals)
    cache = torch.zeros(2, num_blocks, bs, kv_heads, dim, dtype=dtype)
    cache[:, 0] = float("nan")
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    tables = torch.zeros(len(totals), width, dtype=torch.int32)
    keys, values, taken = [], [], 0
    for row, ((cached, _), total) in enumerate(zip(spec["seqs"], totals)):
        k = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
        v = torch.randn(total, kv_heads, dim, generator=generator).to(dtype)
        keys.append(k)
        values.append(v)
        first_live = 0 if window is None else max(0, cached - window + 1) // bs
        for block in range(_cdiv(total, bs)):
            if block < first_live:
                continue  # freed: the table holds the null block, the memory is gone
            tables[row, block] = int(order[taken])
            taken += 1
            tokens = slice(block * bs, min(total, (block + 1) * bs))
            count = tokens.stop - tokens.start
            cache[0, tables[row, block], :count] = k[tokens]
            cache[1, tables[row, block], :count] = v[tokens]
    # decode: one q row per sequence, a padded one too
    num_tokens = len(totals) if spec["kind"] == "decode" else sum(new for _, new in spec["seqs"])
    q = torch.randn(num_tokens, spec["heads"], dim, generator=generator).to(dtype)
    return {"cache": cache, "tables": tables, "keys": keys, "values": values, "q": q, "totals": totals}


def _reference(spec: dict, step: dict, scale: float) -> torch.Tensor:
    """float64 softmax over each query's visible keys (a padded row: zeros)."""
    q, window = step["q"], spec["window"]
    group = spec["heads"] // spec["kv_heads"]
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for (cached, new), k, v in zip(spec["seqs"], step["keys"], step["values"]):
        if new == 0:
            row += 1 if spec["kind"] == "decode" else 0
            continue
        positions = torch.arange(cached, cached + new)
        key_positions = torch.arange(cached + new)
        visible = key_positions[None, :] <= positions[:, None]
        if window is not None:
            visible &= key_positions[None, :] > positions[:, None] - window
        ks = k.double().repeat_interleave(group, dim=1)
        vs = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[row : row + new].double(), ks) * scale
        weights = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
        out[row : row + new] = torch.einsum("hqk,khd->qhd", weights, vs)
        row += new
    return out


def _step_metadata(spec: dict, step: dict) -> AttentionMetadata:
    query_lens = [new for _, new in spec["seqs"]]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # unused: nothing is written
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(step["totals"], dtype=torch.int32),
        block_tables=step["tables"],
        max_query_len=max(query_lens),
        max_seq_len=max(step["totals"]),
        query_lens_cpu=query_lens,
        seq_lens_cpu=step["totals"],
    )


def _import_backend() -> type:
    """TritonAttentionBackend, with its cache-write kernels stubbed: they launch through fast_launch,
    which the interpreter cannot wrap, and a read-only forward (write=False) never calls them."""
    import types

    for name, functions in [
        ("fitserve.kernels.cache_write", ["reshape_and_cache"]),
        ("fitserve.kernels.rotary_cache_write", ["can_fuse", "rotary_cache_write"]),
    ]:
        stub = types.ModuleType(name)
        for function in functions:
            setattr(stub, function, lambda *args, **kwargs: pytest.fail("a read-only forward wrote"))
        sys.modules.setdefault(name, stub)
    from fitserve.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend


def _run_case(spec: dict) -> dict:
    from fitserve.kernels import decode_attention
    from fitserve.kernels.prefill_attention import PrefillLaunchConfig, paged_prefill_attention

    decode_attention._sm_count = lambda index: 16  # no CUDA here: a small GPU, so contexts are split
    step = _build(spec)
    scale = spec["head_dim"] ** -0.5
    window, q = spec["window"], step["q"]
    seq_lens = torch.tensor(step["totals"], dtype=torch.int32)
    if spec["kind"] == "decode":
        out = decode_attention.paged_decode_attention(
            q,
            step["cache"],
            step["tables"],
            seq_lens,
            scale,
            num_partitions=spec.get("num_partitions"),
            window=window,
        )
    elif spec["kind"] == "prefill":
        query_lens = [new for _, new in spec["seqs"]]
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        config = spec.get("config")
        out = paged_prefill_attention(
            q,
            step["cache"],
            starts,
            seq_lens,
            step["tables"],
            max(query_lens),
            scale,
            config=PrefillLaunchConfig(config[0], config[1]) if config else None,
            window=window,
        )
    else:
        metadata = _step_metadata(spec, step)
        out = _import_backend()().forward(
            q, None, None, step["cache"], metadata, scale, window=window, write=False
        )
    reference = _reference(spec, step, scale)
    padded = [i for i, (_, new) in enumerate(spec["seqs"]) if new == 0]
    # a padded decode row has no q row of its own in prefill layouts; in decode it is row i
    padded_zero = all(not out[i].any() for i in padded) if spec["kind"] == "decode" else True
    return {
        "case": spec,
        "finite": bool(out.isfinite().all()),
        "error": (out.double() - reference).abs().max().item() / reference.abs().max().item(),
        "padded_rows_zero": padded_zero,
        "checksum": out.double().sum().item(),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    print(json.dumps([_run_case(spec) for spec in json.loads(sys.argv[1])]))
