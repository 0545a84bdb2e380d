"""A float8 e4m3 KV cache on the path of GPUs without Triton's e4m3 conversion (below compute capability 8.9,
issues 35, 32), run on the GPU present with the target forced: the kernels get the cache as uint8 and convert
its bytes themselves (fitserve/kernels/fp8_bits.py).
- Decoding: every e4m3 byte decodes (inline PTX, into bfloat16 and float16) to what torch gives.
- Kernels: the cache writes store the bytes Triton's conversion stores (and torch's), and decode and
  prefill attention over the same bytes give what the conversion path gives, with the same launch config.
- Engine: the Qwen3-0.6B shape (random weights) under FITSERVE_KERNEL_TARGET=sm75 with --kv-cache-dtype fp8,
  in a child process (the target is read once a process): every kernel launch got the cache as uint8, the
  first step's logprobs stay as close to the 16-bit cache's as e4m3 does on the H100's own path
  (tests/gpu/test_engine_fp8_gpu.py), and close to that path's fp8 run.
  python -m pytest -q tests/gpu/test_kv_e4m3_bits_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
REPO = Path(__file__).resolve().parents[2]
E4M3 = torch.float8_e4m3fn
BYTES_PATH, CONVERSION_PATH = (8, 6), (8, 9)  # forced capabilities: neither has PDL
# Mean |first-step top-20 logprob difference| against the 16-bit cache: e4m3's own bound on this random
# model (test_engine_fp8_gpu.py's FP8_FIRST_STEP_LOGPROB_ERROR).
FP8_FIRST_STEP_LOGPROB_ERROR = 0.3
# The same against the H100's own fp8 run: the cached values are the same bytes, only the kernels' tiles
# (sm_75's: smaller, another summation order) and the conversion differ.
PATHS_FIRST_STEP_LOGPROB_DIFFERENCE = 0.1


def _paged(
    contexts: list[int], block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables (shuffled blocks from 1 on) and int32 lengths, on the GPU."""
    blocks = [-(-n // block_size) for n in contexts]
    order = torch.randperm(sum(blocks), generator=generator) + 1
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32)
    for i, count in enumerate(blocks):
        tables[i, :count] = order[sum(blocks[:i]) : sum(blocks[:i]) + count].to(torch.int32)
    return tables.cuda(), torch.tensor(contexts, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_e4m3_byte_decodes_to_what_torch_gives(dtype: torch.dtype) -> None:
    """fp8_bits.e4m3_bytes_to_bfloat16 / e4m3_bytes_to_float16 (inline PTX), which stored_values and
    stored_values use on a GPU: every finite code exact (-0 included), the NaN codes +-480."""
    import triton
    import triton.language as tl

    from fitserve.kernels.fp8_bits import e4m3_bytes_to_bfloat16, e4m3_bytes_to_float16

    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bfloat16 math from 8.0")

    @triton.jit
    def decode(bytes_ptr, out_ptr, BLOCK: tl.constexpr, BF16: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        codes = tl.load(bytes_ptr + offs)
        values = e4m3_bytes_to_bfloat16(codes) if BF16 else e4m3_bytes_to_float16(codes)
        tl.store(out_ptr + offs, values)

    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    out = torch.empty(256, dtype=dtype, device="cuda")
    decode[(1,)](codes, out, BLOCK=256, BF16=dtype == torch.bfloat16)
    expected = codes.view(E4M3).to(dtype)
    finite = (codes & 0x7F) != 0x7F
    assert torch.equal(out[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert out[~finite].float().abs().eq(480).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernels_on_the_bytes_path_match_the_conversion_path(dtype: torch.dtype, monkeypatch) -> None:
    from fitserve.kernels import fp8_bits, reference
    from fitserve.kernels.attention_inputs import kv_cache_for_kernels
    from fitserve.kernels.cache_write import reshape_and_cache
    from fitserve.kernels.capability import forced_target
    from fitserve.kernels.decode_attention import DEFAULT_DECODE_CONFIG, paged_decode_attention
    from fitserve.kernels.kv_format import quantize_kv
    from fitserve.kernels.prefill_attention import DEFAULT_PREFILL_CONFIG, paged_prefill_attention
    from fitserve.kernels.rotary_cache_write import rotary_cache_write

    # Triton's conversion on the conversion path beside bfloat16 queries too (else bytes both ways)
    monkeypatch.setattr(fp8_bits, "BF16_FROM_BYTES", False)
    if torch.cuda.get_device_capability() < CONVERSION_PATH:
        pytest.skip("the comparison needs Triton's e4m3 conversion (compute capability 8.9)")
    generator = torch.Generator().manual_seed(0)
    block_size, kv_heads, q_heads, head_dim = 16, 2, 8, 128
    contexts = [300, 17, 1000, 64]
    tables, lens = _paged(contexts, block_size, generator)
    num_blocks = int(tables.max()) + 1
    tokens = sum(contexts)
    k = (3 * torch.randn(tokens, kv_heads, head_dim, generator=generator)).to(dtype).cuda()
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype).cuda()
    # clamped (with k_scale 0.5: past 448), subnormal, a tie (2**-6 x 1.0625 once scaled), signed zeros
    edges = [1000.0, -1000.0, 2.0**-12, -(2.0**-8), 0.0, -0.0, 464.0, 2.0**-7 * 1.0625]
    k[0, 0, :8] = torch.tensor(edges, dtype=dtype, device="cuda")
    slots = []
    for i, n in enumerate(contexts):
        positions = torch.arange(n, device="cuda")
        slots.append(tables[i, positions // block_size].long() * block_size + positions % block_size)
    slots = torch.cat(slots)
    k_scale, v_scale = 0.5, 2.0
    caches = {}
    for capability in (BYTES_PATH, CONVERSION_PATH):
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=E4M3, device="cuda")
        with forced_target(capability):
            assert kv_cache_for_kernels(cache).dtype == (torch.uint8 if capability == BYTES_PATH else E4M3)
            reshape_and_cache(k, v, cache, slots, k_scale, v_scale)
        caches[capability] = cache
    written = caches[BYTES_PATH].view(torch.uint8).view(2, -1, kv_heads, head_dim)[:, slots]
    assert torch.equal(
        written, caches[CONVERSION_PATH].view(torch.uint8).view(2, -1, kv_heads, head_dim)[:, slots]
    )
    assert torch.equal(written[0], quantize_kv(k, E4M3, k_scale).view(torch.uint8))
    assert torch.equal(written[1], quantize_kv(v, E4M3, v_scale).view(torch.uint8))

    # the fused rotary write: the same bytes both ways
    cos_sin = torch.randn(4096, head_dim, generator=generator).cuda()
    positions = torch.randint(0, 4096, (tokens,), generator=generator).cuda()
    rotary = {}
    for capability in (BYTES_PATH, CONVERSION_PATH):
        cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=E4M3, device="cuda")
        q = torch.zeros(tokens, q_heads, head_dim, dtype=dtype, device="cuda")
        with forced_target(capability):
            rotary_cache_write(positions, q, k, v, cos_sin, cache, slots, k_scale, v_scale)
        rotary[capability] = cache.view(torch.uint8)
    assert torch.equal(rotary[BYTES_PATH], rotary[CONVERSION_PATH])

    scale = head_dim**-0.5
    cache = caches[CONVERSION_PATH]
    q = torch.randn(len(contexts), q_heads, head_dim, generator=generator).to(dtype).cuda()
    query_lens = [1, 5, 40, 1]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q_prefill = torch.randn(sum(query_lens), q_heads, head_dim, generator=generator).to(dtype).cuda()

    def decode() -> torch.Tensor:
        return paged_decode_attention(
            q, cache, tables, lens, scale, None, 4, DEFAULT_DECODE_CONFIG, k_scale, v_scale
        )

    def prefill() -> torch.Tensor:
        return paged_prefill_attention(
            q_prefill, cache, starts, lens, tables, 40, scale, None, DEFAULT_PREFILL_CONFIG, k_scale, v_scale
        )

    one_each = torch.arange(len(contexts) + 1, dtype=torch.int32)
    for name, run, query, query_starts in [
        ("decode", decode, q, one_each),
        ("prefill", prefill, q_prefill, starts),
    ]:
        outputs = {}
        for capability in (BYTES_PATH, CONVERSION_PATH):
            with forced_target(capability):
                outputs[capability] = run()
        bits, converted = outputs[BYTES_PATH], outputs[CONVERSION_PATH]
        # the decoded keys and values are exact both ways and the tiles the same: equal up to the compiler
        difference = (bits.float() - converted.float()).abs().max().item()
        assert difference <= 1e-3 * converted.float().abs().max().item(), (name, difference)
        ref = reference.paged_attention_reference(
            query.float().cpu(),
            cache.cpu(),
            query_starts.cpu(),
            lens.cpu(),
            tables.cpu(),
            scale,
            k_scale,
            v_scale,
        )
        error = (bits.float().cpu() - ref).abs().max().item() / ref.abs().max().item()
        assert error < (4e-3 if dtype == torch.float16 else 2e-2), (name, error)


def _run_engine(folder: Path, kernel_target: str | None, kv_cache_dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("FITSERVE_KERNEL_TARGET", "TRITON_INTERPRET")}
    if kernel_target is not None:
        env["FITSERVE_KERNEL_TARGET"] = kernel_target
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    request = json.dumps({"folder": str(folder), "kv_cache_dtype": kv_cache_dtype})
    done = subprocess.run(
        [sys.executable, __file__, request], env=env, cwd=REPO, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_engine_on_the_sm75_path_with_an_e4m3_cache(tmp_path_factory) -> None:
    from tests.gpu.test_engine_gpu import _save_random_model

    folder = _save_random_model("qwen3-0.6b", tmp_path_factory.mktemp("e4m3_bits_models"))
    sm75_fp8 = _run_engine(folder, "sm75", "fp8")
    sm75_auto = _run_engine(folder, "sm75", "auto")
    assert sm75_fp8["kernel_target"] == [7, 5]
    # the bytes path was taken: every launcher that touched the cache got it as uint8, never as float8
    assert set(sm75_fp8["cache_dtypes"]) >= {"decode_attention", "prefill_attention"}, sm75_fp8[
        "cache_dtypes"
    ]
    assert {"cache_write", "rotary_cache_write"} & set(sm75_fp8["cache_dtypes"]), sm75_fp8["cache_dtypes"]
    for launcher, dtypes in sm75_fp8["cache_dtypes"].items():
        assert dtypes == ["torch.uint8"], (launcher, dtypes)
    sixteen_bit = {"torch.bfloat16", "torch.float16"}
    assert all(set(dtypes) <= sixteen_bit for dtypes in sm75_auto["cache_dtypes"].values()), sm75_auto
    assert sm75_fp8["num_blocks"] >= 1.9 * sm75_auto["num_blocks"]  # one byte an element
    error = _first_step_difference(sm75_fp8, sm75_auto)
    assert error < FP8_FIRST_STEP_LOGPROB_ERROR, error
    if torch.cuda.get_device_capability() >= CONVERSION_PATH:
        default_fp8 = _run_engine(folder, None, "fp8")
        # the writes convert with Triton; the attention kernels read bytes beside the bfloat16 queries
        attention = {"decode_attention", "prefill_attention"}
        for launcher, dtypes in default_fp8["cache_dtypes"].items():
            expected = "torch.uint8" if launcher in attention else str(E4M3)
            assert dtypes == [expected], (launcher, dtypes)
        difference = _first_step_difference(sm75_fp8, default_fp8)
        assert difference < PATHS_FIRST_STEP_LOGPROB_DIFFERENCE, difference
    print(f"first-step logprob error vs the 16-bit cache {error:.4f}")


def _first_step_difference(ours: dict, reference: dict) -> float:
    """Mean |logprob difference| over the first generated token's top-20 entries both runs have."""
    errors = [
        abs(logprob - ref_step[token])
        for step, ref_step in zip(ours["first_step"], reference["first_step"], strict=True)
        for token, logprob in step.items()
        if token in ref_step
    ]
    assert len(errors) >= 10 * len(ours["first_step"]), len(errors)
    return sum(errors) / len(errors)


def _engine_child(request: dict) -> dict:
    """One engine run in this process (the kernel target as the environment sets it): greedy outputs'
    first-step top-20 logprobs, the KV blocks, and the cache dtype each kernel launcher passed on."""
    from fitserve.kernels import (
        attention_inputs,
        cache_write,
        capability,
        decode_attention,
        prefill_attention,
        rotary_cache_write,
    )
    from tests.gpu.test_engine_gpu import _greedy, _llm, _prompts

    seen: dict[str, set[str]] = {}
    for module in (cache_write, rotary_cache_write, decode_attention, prefill_attention):
        name = module.__name__.rsplit(".", 1)[-1]

        def recording(kv_cache, queries=None, name=name):
            viewed = attention_inputs.kv_cache_for_kernels(kv_cache, queries)
            seen.setdefault(name, set()).add(str(viewed.dtype))
            return viewed

        module.kv_cache_for_kernels = recording
    llm = _llm(Path(request["folder"]), kv_cache_dtype=request["kv_cache_dtype"])
    outputs = _greedy(llm, _prompts(8), 16)
    return {
        "kernel_target": capability.forced(),
        "cache_dtypes": {name: sorted(dtypes) for name, dtypes in seen.items()},
        "num_blocks": llm.engine.kv_manager.pool.num_blocks,
        "first_step": [{str(t): e.logprob for t, e in out.logprobs[0].items()} for out in outputs],
        "tokens": [list(out.token_ids) for out in outputs],
    }


if __name__ == "__main__":
    print(json.dumps(_engine_child(json.loads(sys.argv[1]))))
