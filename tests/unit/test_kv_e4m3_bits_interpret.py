"""A float8 e4m3 KV cache where Triton has no e4m3 conversion (compute capability below 8.9; issues 35, 32):
the launchers pass the cache as its bytes (uint8) and the kernels encode and decode them in integer
operations (fitserve/kernels/fp8_bits.py). Under Triton's interpreter on the CPU, with the kernel target
forced to sm_75 so every launcher takes that path:
- the attention kernels (decode and prefill) decode all 256 bytes as torch's float8_e4m3fn does (NaN as NaN);
- the cache writes (reshape_and_cache, rotary_cache_write) store the bytes of torch's
  clamp(x / scale).to(float8_e4m3fn) for float32, fp16 and bf16 inputs: every e4m3 value, the ties
  between neighbours and the floats beside them, subnormals, values above 448, infinities, +-0;
- a cache written that way and read by decode and prefill attention matches kernels/reference.py.

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child process: this file
run as a script (`python tests/unit/test_kv_e4m3_bits_interpret.py CASES_JSON`) with the variable set
(tests/unit/triton_interpreter.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from fitserve.kernels.kv_format import quantize_kv
from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
E4M3 = torch.float8_e4m3fn
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
HEADS, HEAD_DIM, BLOCK_SIZE = 2, 64, 16
SCALES = [(1.0, 1.0), (0.5, 3.0)]  # (k_scale, v_scale)
# max |out - ref| / max |ref| of attention over the same e4m3 values: the kernels round p to the query dtype
ATTENTION_TOLERANCE = {"float16": 4e-3, "bfloat16": 2e-2}


def e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value as float32 (bytes 0x00-0x7e and 0x80-0xfe), in byte order."""
    codes = torch.cat([torch.arange(0, 0x7F), torch.arange(0x80, 0xFF)]).to(torch.uint8)
    return codes.view(E4M3).float()


def sweep(dtype: torch.dtype, infinities: bool = True) -> torch.Tensor:
    """Values in `dtype` that exercise every rounding case of float -> e4m3, both signs."""
    magnitudes = e4m3_values()[:0x7F]  # 0 .. 448, ascending
    ties = (magnitudes[:-1] + magnitudes[1:]) / 2  # exact in float32, fp16 and bf16
    values = [magnitudes, ties.to(dtype).float()]
    ties = ties.to(dtype)
    values.append(torch.nextafter(ties, torch.full_like(ties, float("inf"))).float())
    values.append(torch.nextafter(ties, torch.zeros_like(ties)).float())
    values.append(torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 2.0**-12, 2.0**-20, 2.0**-24, 2.0**-130]))
    values.append(torch.tensor([448.0, 449.0, 464.0, 465.0, 470.0, 480.0, 1000.0, 6e4]))
    if infinities:
        values.append(torch.tensor([float("inf")]))
    generator = torch.Generator().manual_seed(0)
    values.append(2.0 ** (torch.rand(600, generator=generator) * 24 - 15))  # 2**-15 .. 2**9
    positive = torch.cat(values).to(dtype)
    return torch.cat([positive, -positive, torch.tensor([0.0, -0.0], dtype=dtype)])


def as_tokens(values: torch.Tensor) -> torch.Tensor:
    """values, zero-padded, as [tokens, HEADS, HEAD_DIM]."""
    per_token = HEADS * HEAD_DIM
    padded = torch.zeros(-(-values.numel() // per_token) * per_token, dtype=values.dtype)
    padded[: values.numel()] = values
    return padded.view(-1, HEADS, HEAD_DIM)


def slot_order(num_tokens: int) -> torch.Tensor:
    return torch.randperm(num_tokens, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def results() -> dict:
    cases = [{"kind": "decode_bytes", "dtype": name} for name in ("float16", "bfloat16", "float32")]
    cases += [{"kind": "encode", "dtype": name, "scales": scales} for name in DTYPES for scales in SCALES]
    cases += [{"kind": "attention", "dtype": name} for name in ATTENTION_TOLERANCE]
    answers = run_in_interpreter(__file__, cases)
    return {json.dumps(case, sort_keys=True): answer for case, answer in zip(cases, answers, strict=True)}


def answer(results: dict, **case) -> dict:
    return results[json.dumps(case, sort_keys=True)]


@needs_triton
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_attention_kernels_decode_every_byte_as_torch(results: dict, dtype: str) -> None:
    got = answer(results, kind="decode_bytes", dtype=dtype)
    assert got["kernel_cache_dtype"] == "torch.uint8"  # the sm_75 path: the kernels got the bytes
    expected = torch.arange(256).to(torch.uint8).view(E4M3).float()
    for kernel in ("decode", "prefill"):
        decoded = torch.tensor(got[kernel], dtype=torch.float32)
        assert torch.equal(decoded.isnan(), expected.isnan()), kernel
        finite = ~expected.isnan()
        wrong = (decoded[finite] != expected[finite]).nonzero().flatten().tolist()
        assert not wrong, (kernel, [(hex(i), decoded[i].item(), expected[i].item()) for i in wrong[:8]])


@needs_triton
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scales", SCALES)
def test_cache_writes_store_torchs_bytes(results: dict, dtype: str, scales: tuple[float, float]) -> None:
    got = answer(results, kind="encode", dtype=dtype, scales=list(scales))
    assert got["kernel_cache_dtype"] == "torch.uint8"
    k_scale, v_scale = scales
    for writer, infinities in (("reshape_and_cache", True), ("rotary_cache_write", False)):
        k = as_tokens(sweep(DTYPES[dtype], infinities))
        v = k.flip(0)
        if writer == "rotary_cache_write":
            # the rotated k as the same kernel stores it in a cache of k's dtype (cos 1, sin 0: the
            # rotation is exact, but signed zeros and subnormals follow the kernel's float operations)
            k = torch.tensor(got[writer]["rotated_k"], dtype=k.dtype).view(k.shape)
        for name, values, scale in (("k", k, k_scale), ("v", v, v_scale)):
            expected = quantize_kv(values, E4M3, scale).view(torch.uint8)
            stored = torch.tensor(got[writer][name], dtype=torch.uint8).view(expected.shape)
            wrong = (stored != expected).nonzero().tolist()
            described = [
                (values[tuple(i)].item(), stored[tuple(i)].item(), expected[tuple(i)].item()) for i in wrong
            ]
            assert not wrong, (writer, name, len(wrong), described[:8])


@needs_triton
@pytest.mark.parametrize("dtype", list(ATTENTION_TOLERANCE))
def test_written_cache_read_by_attention_matches_the_reference(results: dict, dtype: str) -> None:
    got = answer(results, kind="attention", dtype=dtype)
    assert got["kernel_cache_dtype"] == "torch.uint8"
    for kernel in ("decode", "prefill"):
        assert got[kernel]["finite"], kernel
        assert got[kernel]["error"] <= ATTENTION_TOLERANCE[dtype], (kernel, got[kernel])
        assert got[kernel]["max_ref"] > 0.1, kernel  # a real output, not zeros against zeros


def test_the_launchers_view_e4m3_as_bytes_below_sm_8_9_and_beside_bfloat16() -> None:
    from fitserve.kernels import capability
    from fitserve.kernels.attention_inputs import kv_cache_for_kernels
    from fitserve.kernels.fp8_bits import decodes_bf16_from_bytes

    cache = torch.zeros(2, 1, 16, 1, 8, dtype=E4M3)
    assert kv_cache_for_kernels(cache) is cache  # the CPU, no target forced: Triton's own conversion
    for target, expected in [
        ((7, 0), torch.uint8),
        ((7, 5), torch.uint8),
        ((8, 6), torch.uint8),
        ((8, 9), E4M3),
    ]:
        with capability.forced_target(target):
            viewed = kv_cache_for_kernels(cache)
            assert viewed.dtype == expected, target
            assert viewed.data_ptr() == cache.data_ptr()  # a view: the same bytes
            for other in (torch.float8_e5m2, torch.float16, torch.bfloat16):
                assert kv_cache_for_kernels(cache.to(other)).dtype == other
            # beside queries: float16 ones as without; bfloat16 ones take the bytes (not in the interpreter,
            # which cannot run e4m3_bytes_to_bfloat16's inline PTX)
            assert kv_cache_for_kernels(cache, torch.float16).dtype == expected, target
            beside_bf16 = torch.uint8 if decodes_bf16_from_bytes(cache.device, torch.bfloat16) else expected
            assert kv_cache_for_kernels(cache, torch.bfloat16).dtype == beside_bf16, target
    with capability.forced_target((8, 9)):
        assert decodes_bf16_from_bytes(cache.device, torch.bfloat16) == (
            os.environ.get("TRITON_INTERPRET") != "1"
        )


# --- the child process: runs the kernels under the interpreter -------------------------------------------


def _decode_bytes(dtype: torch.dtype) -> dict:
    """All 256 bytes as values of 4 one-token sequences: with one key the output is that value (-0 as 0:
    P @ V accumulates from +0)."""
    from fitserve.kernels.attention_inputs import kv_cache_for_kernels
    from fitserve.kernels.decode_attention import paged_decode_attention
    from fitserve.kernels.prefill_attention import paged_prefill_attention

    cache = torch.zeros(2, 4, BLOCK_SIZE, 1, HEAD_DIM, dtype=torch.uint8)
    cache[1, :, 0, 0] = torch.arange(256).to(torch.uint8).view(4, HEAD_DIM)
    cache = cache.view(E4M3)
    q = torch.randn(4, 1, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
    tables = torch.arange(4, dtype=torch.int32)[:, None]
    lens = torch.ones(4, dtype=torch.int32)
    decode = paged_decode_attention(q, cache, tables, lens, 0.125, num_partitions=1)
    starts = torch.arange(5, dtype=torch.int32)
    prefill = paged_prefill_attention(q, cache, starts, lens, tables, 1, 0.125)
    return {
        "kernel_cache_dtype": str(kv_cache_for_kernels(cache).dtype),
        "decode": decode.float().flatten().tolist(),
        "prefill": prefill.float().flatten().tolist(),
    }


def _encode(dtype: torch.dtype, k_scale: float, v_scale: float) -> dict:
    from fitserve.kernels.attention_inputs import kv_cache_for_kernels
    from fitserve.kernels.cache_write import reshape_and_cache
    from fitserve.kernels.rotary_cache_write import rotary_cache_write

    stored = {}
    for writer, infinities in (("reshape_and_cache", True), ("rotary_cache_write", False)):
        k = as_tokens(sweep(dtype, infinities))
        v = k.flip(0)
        tokens = k.shape[0]
        slots = slot_order(tokens)
        shape = (2, -(-tokens // BLOCK_SIZE), BLOCK_SIZE, HEADS, HEAD_DIM)
        cache = torch.zeros(shape, dtype=E4M3)
        if writer == "reshape_and_cache":
            reshape_and_cache(k, v, cache, slots, k_scale, v_scale)
        else:
            identity = torch.cat([torch.ones(4, HEAD_DIM // 2), torch.zeros(4, HEAD_DIM // 2)], dim=1)
            positions = torch.arange(tokens) % 4
            plain = torch.zeros(shape, dtype=dtype)
            for target in (cache, plain):
                q = torch.zeros(tokens, HEADS, HEAD_DIM, dtype=dtype)
                rotary_cache_write(positions, q, k, v, identity, target, slots, k_scale, v_scale)
            rotated_k = plain.view(2, -1, HEADS, HEAD_DIM)[0, slots]
        flat = cache.view(torch.uint8).view(2, -1, HEADS, HEAD_DIM)[:, slots]
        stored[writer] = {"k": flat[0].flatten().tolist(), "v": flat[1].flatten().tolist()}
    stored["rotary_cache_write"]["rotated_k"] = rotated_k.float().flatten().tolist()
    stored["kernel_cache_dtype"] = str(kv_cache_for_kernels(cache).dtype)
    return stored


def _attention(dtype: torch.dtype) -> dict:
    """Keys and values written by reshape_and_cache, read by decode and prefill attention, against
    kernels/reference.py over the same cache (torch's e4m3 conversion). Scales 0.5 and 2.0."""
    from fitserve.kernels import decode_attention, reference
    from fitserve.kernels.attention_inputs import kv_cache_for_kernels
    from fitserve.kernels.cache_write import reshape_and_cache
    from fitserve.kernels.prefill_attention import paged_prefill_attention

    generator = torch.Generator().manual_seed(3)
    k_scale, v_scale, q_heads = 0.5, 2.0, 4
    contexts = [37, 5, 20]
    blocks = [-(-n // BLOCK_SIZE) for n in contexts]
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    cache = torch.zeros(2, sum(blocks) + 1, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=E4M3)
    order = torch.randperm(sum(blocks), generator=generator) + 1  # block 0 stays unused
    for i, count in enumerate(blocks):
        tables[i, :count] = order[sum(blocks[:i]) : sum(blocks[:i]) + count].to(torch.int32)
        positions = torch.arange(contexts[i])
        slots = tables[i, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
        k = (2 * torch.randn(contexts[i], HEADS, HEAD_DIM, generator=generator)).to(dtype)
        v = torch.randn(contexts[i], HEADS, HEAD_DIM, generator=generator).to(dtype)
        reshape_and_cache(k, v, cache, slots, k_scale, v_scale)
    lens = torch.tensor(contexts, dtype=torch.int32)
    scale = HEAD_DIM**-0.5
    result = {"kernel_cache_dtype": str(kv_cache_for_kernels(cache).dtype)}
    # decode: one query per sequence; prefill: the last 6, 1 and 9 positions of the contexts
    for kernel, query_lens in (("decode", [1, 1, 1]), ("prefill", [6, 1, 9])):
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(starts[-1]), q_heads, HEAD_DIM, generator=generator).to(dtype)
        if kernel == "decode":
            out = decode_attention.paged_decode_attention(q, cache, tables, lens, scale, None, None, None,
                                                          k_scale, v_scale)  # fmt: skip
        else:
            out = paged_prefill_attention(q, cache, starts, lens, tables, max(query_lens), scale,
                                          k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        ref = reference.paged_attention_reference(
            q.float(), cache, starts, lens, tables, scale, k_scale, v_scale
        )
        result[kernel] = {
            "finite": bool(out.isfinite().all()),
            "error": (out.float() - ref).abs().max().item() / ref.abs().max().item(),
            "max_ref": ref.abs().max().item(),
        }
    return result


def _run(case: dict) -> dict:
    dtype = DTYPES[case["dtype"]]
    if case["kind"] == "decode_bytes":
        return _decode_bytes(dtype)
    if case["kind"] == "encode":
        return _encode(dtype, *case["scales"])
    return _attention(dtype)


if __name__ == "__main__":
    import triton  # noqa: F401  (after TRITON_INTERPRET, before the kernels)

    from fitserve.kernels import decode_attention
    from fitserve.kernels.capability import forced_target
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    decode_attention._sm_count = lambda index: 16  # no CUDA here: a small GPU, so contexts are split
    with forced_target((7, 5)):  # a T4 / RTX 2080 Ti: no e4m3 conversion in Triton
        print(json.dumps([_run(case) for case in json.loads(sys.argv[1])]))
