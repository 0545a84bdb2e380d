"""The launch cases of kernels/variants.py: each runs fitserve's kernel launchers over the shapes that select
their configs (head dims 64 to 512, GQA groups, decode batches on either side of the choosers' thresholds,
which scale with the target's SM count, prefill chunks, the models' hidden and intermediate sizes), on CPU
tensors (torch.empty of a large shape reserves address space only). variants.compile_variants runs them with
the capability forced to a target, so every launch compiles for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from fitserve.kernels.capability import has_e4m3_conversion

if TYPE_CHECKING:
    from fitserve.kernels.variants import Target

Case = Callable[["Target", bool], None]  # (target, full): runs launchers; full: the whole sweep
HEAD_DIMS = (64, 80, 96, 128, 256, 512)


def activation_dtypes(target: Target, full: bool = True) -> tuple[torch.dtype, ...]:
    """fp16 everywhere, bf16 where the GPU has it (8.0+); the subset: the dtype auto-fit picks there."""
    if not full:
        return (torch.bfloat16,) if target.capability >= (8, 0) else (torch.float16,)
    return (torch.float16, torch.bfloat16) if target.capability >= (8, 0) else (torch.float16,)


def kv_dtypes(target: Target, dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cache in the model dtype, float8 e5m2 and e4m3 (decoded from its bytes by kernels/fp8_bits.py
    below 8.9 and beside bfloat16 queries, else converted by Triton)."""
    return (dtype, torch.float8_e5m2, torch.float8_e4m3fn)


def _empty(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _attention_shapes(full: bool) -> Iterator[tuple[int, int, int]]:
    """(head_dim, q heads, kv heads): MHA, GQA 4 and 8 at every head dim; the subset: GQA 4 at 128 (the
    8B shape), 80 (a head dim that is not a power of two), 256 and GQA 8 at 512 (Gemma-4's)."""
    if not full:
        yield from ((128, 32, 8), (80, 32, 8), (256, 16, 4), (512, 16, 2))
        return
    for head_dim in HEAD_DIMS:
        for q_heads, kv_heads in ((8, 8), (32, 8), (16, 2)):
            yield head_dim, q_heads, kv_heads


def _windows(full: bool) -> tuple[int | None, ...]:
    """Without and with a sliding window; the subset: with one (its variant holds the most registers)."""
    return (None, 512) if full else (512,)


def _decode_attention(target: Target, full: bool) -> None:
    from fitserve.kernels.decode_attention import paged_decode_attention

    block_size, blocks = 16, 64
    for dtype in activation_dtypes(target, full):
        for head_dim, q_heads, kv_heads in _attention_shapes(full):
            for cache_dtype in kv_dtypes(target, dtype):
                kv_cache = _empty(2, 512, block_size, kv_heads, head_dim, dtype=cache_dtype)
                # batch 1 (split-K), a batch that fills the GPU once (whole contexts), a large one
                for batch in (1, max(1, target.sms // kv_heads), 4 * target.sms):
                    q = _empty(batch, q_heads, head_dim, dtype=dtype)
                    tables = torch.zeros(batch, blocks, dtype=torch.int32)
                    seq_lens = torch.ones(batch, dtype=torch.int32)
                    for window in _windows(full):
                        paged_decode_attention(q, kv_cache, tables, seq_lens, 0.1, window=window)


def _prefill_attention(target: Target, full: bool) -> None:
    from fitserve.kernels.prefill_attention import paged_prefill_attention
    from fitserve.kernels.prefill_attention_sm90 import CAPABILITY as SM90_CAPABILITY

    block_size = 16
    for dtype in activation_dtypes(target, full):
        for head_dim, q_heads, kv_heads in _attention_shapes(full):
            if not full and head_dim == 80:
                continue  # the subset: the three configs' head dims (a compile takes ~10 s)
            # the subset: float8 caches at 128 only (their tiles hold 1-byte keys, the model dtype's more)
            for cache_dtype in kv_dtypes(target, dtype) if full or head_dim == 128 else (dtype,):
                kv_cache = _empty(2, 512, block_size, kv_heads, head_dim, dtype=cache_dtype)
                # a mixed step (short queries) and a long prompt (the long-query configs)
                for tokens, seqs in ((64, 8), (2048, 1)):
                    q = _empty(tokens, q_heads, head_dim, dtype=dtype)
                    starts = torch.arange(seqs + 1, dtype=torch.int32) * (tokens // seqs)
                    seq_lens = torch.full((seqs,), tokens // seqs, dtype=torch.int32)
                    tables = torch.zeros(seqs, 256, dtype=torch.int32)
                    windows = _windows(full)
                    sm90 = target.capability == SM90_CAPABILITY and cache_dtype == dtype
                    if not full and sm90 and head_dim == 128:
                        windows = (None, *windows)  # the subset reaches kernels/prefill_attention_sm90.py too
                    for window in windows:
                        paged_prefill_attention(
                            q, kv_cache, starts, seq_lens, tables, tokens // seqs, 0.1, window=window
                        )


def _cache_writes(target: Target, full: bool) -> None:
    from fitserve.kernels.cache_write import reshape_and_cache
    from fitserve.kernels.rotary_cache_write import norm_rotate_q, rotary_cache_write

    for dtype in activation_dtypes(target, full):
        for head_dim, q_heads, kv_heads in _attention_shapes(full):
            cos_sin = _empty(4096, head_dim, dtype=torch.float32)
            for cache_dtype in kv_dtypes(target, dtype):
                kv_cache = _empty(2, 64, 16, kv_heads, head_dim, dtype=cache_dtype)
                for tokens in (1, 512):
                    k = _empty(tokens, kv_heads, head_dim, dtype=dtype)
                    v = _empty(tokens, kv_heads, head_dim, dtype=dtype)
                    q = _empty(tokens, q_heads, head_dim, dtype=dtype)
                    slots = torch.zeros(tokens, dtype=torch.int64)
                    positions = torch.zeros(tokens, dtype=torch.int64)
                    reshape_and_cache(k, v, kv_cache, slots)
                    rotary_cache_write(positions, q, k, v, cos_sin, kv_cache, slots)
                    norm = (_empty(head_dim, dtype=dtype), 1e-6, _empty(head_dim, dtype=dtype), 1e-6)
                    rotary_cache_write(positions, q, k, v, cos_sin, kv_cache, slots, qk_norm=norm)
            q = _empty(8, q_heads, head_dim, dtype=dtype)
            positions = torch.zeros(8, dtype=torch.int64)
            norm_rotate_q(positions, q, cos_sin, (_empty(head_dim, dtype=dtype), 1e-6))


def _norms_rotary_activations(target: Target, full: bool) -> None:
    from fitserve.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from fitserve.kernels.norm import fused_add_rms_norm, gemma_norm_add, gemma_rms_norm, rms_norm
    from fitserve.kernels.rotary import rotary_embedding

    for dtype in activation_dtypes(target, full):
        for hidden in (64, 128, 256, 512, 896, 2048, 4096, 5376, 8192, 16384):
            for rows in (1, 64):
                x = _empty(rows, hidden, dtype=dtype)
                weight = _empty(hidden, dtype=dtype)
                rms_norm(x, weight, 1e-6)
                fused_add_rms_norm(x, _empty(rows, hidden, dtype=dtype), weight, 1e-6)
                gemma_rms_norm(x, weight, 1e-6)
                gemma_rms_norm(x, None, 1e-6)
                gemma_norm_add(x, _empty(rows, hidden, dtype=dtype), weight, 1e-6)
                gemma_norm_add(
                    x, _empty(rows, hidden, dtype=dtype), weight, 1e-6, _empty(1, dtype=dtype), weight
                )
        for intermediate in (768, 3072, 14336, 21504):
            for rows in (1, 64):
                silu_and_mul(_empty(rows, 2 * intermediate, dtype=dtype))
                gelu_tanh_and_mul(_empty(rows, 2 * intermediate, dtype=dtype))
        for head_dim, q_heads, kv_heads in _attention_shapes(full):
            for tokens in (1, 256):
                q = _empty(tokens, q_heads, head_dim, dtype=dtype)
                k = _empty(tokens, kv_heads, head_dim, dtype=dtype)
                rotary_embedding(
                    torch.zeros(tokens, dtype=torch.int64), q, k, _empty(4096, head_dim, dtype=torch.float32)
                )


def _gemms_and_sampling(target: Target, full: bool) -> None:
    from fitserve.kernels.argmax import argmax_rows, race_rows
    from fitserve.kernels.skinny_gemm import MAX_ROWS as SKINNY_ROWS
    from fitserve.kernels.skinny_gemm import skinny_gemm
    from fitserve.kernels.skinny_split_gemm import skinny_split_gemm
    from fitserve.kernels.swapped_gemm import MAX_ROWS as SWAPPED_ROWS
    from fitserve.kernels.swapped_gemm import swapped_gemm

    for dtype in activation_dtypes(target, full):
        # Llama-3.1-8B's and Qwen3-0.6B's weights, and Qwen3.6-27B's down_proj (choose_config's narrow tiles)
        for n, k in (
            (4096, 4096),
            (6144, 4096),
            (28672, 4096),
            (4096, 14336),
            (1024, 896),
            (151936, 896),
            (5120, 17408),
        ):
            weight = _empty(n, k, dtype=dtype)
            for rows in sorted({1, 2, 4, 8, SKINNY_ROWS}):
                skinny_gemm(_empty(rows, k, dtype=dtype), weight)
                skinny_gemm(_empty(rows, k, dtype=dtype), weight, _empty(n, dtype=dtype))
            for rows in sorted({SKINNY_ROWS + 1, 24, SWAPPED_ROWS}):
                swapped_gemm(_empty(rows, k, dtype=dtype), weight)
                swapped_gemm(_empty(rows, k, dtype=dtype), weight, _empty(n, dtype=dtype))
        # skinny_split_gemm's weights (split, or not on GPUs of few SMs): Qwen3.6-35B-A3B's router and
        # shared expert down, a K not a multiple of the step (2112), a ragged N, a long K
        for n, k in ((256, 2048), (2048, 512), (2816, 2112), (1000, 4096), (1024, 8192)):
            weight = _empty(n, k, dtype=dtype)
            for rows in sorted({1, 2, 4, 8, SKINNY_ROWS}):
                skinny_split_gemm(_empty(rows, k, dtype=dtype), weight)
                skinny_split_gemm(_empty(rows, k, dtype=dtype), weight, _empty(n, dtype=dtype))
        for width in (32000, 128256, 151936, 262144):
            for rows in (1, 32):
                logits = _empty(rows, width, dtype=dtype)
                argmax_rows(logits)
                race_rows(logits, torch.zeros(rows, dtype=torch.int64))
                race_rows(logits, torch.zeros(rows, dtype=torch.int64), torch.ones(rows))
            argmax_rows(_empty(1, width, dtype=torch.float32))


def _graph_inputs(target: Target, full: bool) -> None:
    from fitserve.kernels.graph_inputs import stage_decode_inputs

    for batch, width in ((1, 64), (32, 512)):
        sources = (
            torch.zeros(batch, dtype=torch.int64),
            torch.zeros(batch, dtype=torch.int64),
            torch.zeros(batch, dtype=torch.int64),
            torch.zeros(batch, dtype=torch.int32),
            torch.zeros(batch, width, dtype=torch.int32),
        )
        targets = tuple(torch.zeros(2 * batch, *t.shape[1:], dtype=t.dtype) for t in sources)
        stage_decode_inputs(sources, targets, 2 * batch)


def _int4(target: Target, full: bool) -> None:
    from fitserve.kernels.int4_dequant import dequantize_rows
    from fitserve.kernels.int4_gemm import int4_linear
    from fitserve.kernels.int4_repack import repack_int4

    for dtype in activation_dtypes(target, full):
        shapes = ((4096, 4096, 128), (14336, 4096, 128), (4096, 14336, 128), (1024, 896, 64))
        for n, k, group in shapes if full else shapes[:1]:
            codes = torch.zeros(n, k, dtype=torch.uint8)
            scales = torch.ones(n, k // group)
            for zeros in (torch.full((n, k // group), 8.0), torch.full((n, k // group), 7.5)):
                packed = repack_int4(codes, scales, zeros, group, dtype)
                for rows in (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096):
                    int4_linear(_empty(rows, k, dtype=dtype), packed)
                int4_linear(_empty(1, k, dtype=dtype), packed, _empty(n, dtype=dtype))
                dequantize_rows(packed, 0, n, _empty(n, k, dtype=dtype))


def _nf4(target: Target, full: bool) -> None:
    from fitserve.kernels.nf4_dequant import dequantize_rows
    from fitserve.kernels.nf4_gemm import nf4_linear
    from fitserve.kernels.nf4_pack import pack_nf4

    code = torch.linspace(-1, 1, 16)
    for dtype in activation_dtypes(target, full):
        shapes = ((4096, 4096), (14336, 4096), (4096, 14336))
        for n, k in shapes if full else shapes[:1]:
            packed = pack_nf4(
                torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // 64), code, 64, dtype
            )
            for rows in (1, 2, 4, 8, 16, 32, 64, 256):
                nf4_linear(_empty(rows, k, dtype=dtype), packed)
            dequantize_rows(packed, 0, n, _empty(n, k, dtype=dtype))


def _fp8_linear(target: Target, full: bool) -> None:
    from fitserve.kernels.fp8_quant import quantize_groups, quantize_rows
    from fitserve.kernels.fp8_w8a16 import fp8_w8a16_linear, split_counters, w8a16_layer_ok

    if not w8a16_layer_ok(torch.device("cuda"), 128, 1):
        return  # float8 weights run the W8A16 kernel from 7.5 on (as their bytes below 8.9)
    w8a8 = has_e4m3_conversion(target.capability)  # activations quantized to e4m3 from 8.9 on
    for dtype in activation_dtypes(target, full):
        for n, k in ((4096, 4096), (14336, 4096)):
            weight = _empty(n, k, dtype=torch.float8_e4m3fn)
            for rows in (1, 16):
                fp8_w8a16_linear(_empty(rows, k, dtype=dtype), weight, torch.ones(n, 1))
                fp8_w8a16_linear(_empty(rows, k, dtype=dtype), weight, torch.ones(n, k // 128))
                counters = split_counters(n, "cpu")  # split-K where the grid leaves SMs idle
                fp8_w8a16_linear(_empty(rows, k, dtype=dtype), weight, torch.ones(n, 1), counters=counters)
            for rows in (1, 256) if w8a8 else ():
                quantize_rows(_empty(rows, k, dtype=dtype))
                quantize_rows(_empty(rows, k, dtype=dtype), torch.ones(1))
                quantize_groups(_empty(rows, k, dtype=dtype))


def _fused_moe(target: Target, full: bool) -> None:
    from fitserve.kernels.fused_moe import fused_moe
    from fitserve.kernels.moe_decode import SharedExpert

    # Qwen3-30B-A3B (128 experts, top 8, 2048 / 768), Qwen3.5 MoE (256, top 8, 2048 / 512), Gemma-4 MoE
    models = ((128, 8, 2048, 768, "silu"), (256, 8, 2048, 512, "silu"), (128, 8, 2816, 704, "gelu_tanh"))
    for experts, top_k, hidden, intermediate, activation in models if full else models[:1]:
        for dtype in activation_dtypes(target, full):
            gate_up = _empty(experts, 2 * intermediate, hidden, dtype=dtype)
            down = _empty(experts, hidden, intermediate, dtype=dtype)
            for tokens in (1, 16, 256, 4096):
                topk_ids = torch.zeros(tokens, top_k, dtype=torch.int32)
                weights = torch.ones(tokens, top_k, dtype=torch.float32)
                fused_moe(_empty(tokens, hidden, dtype=dtype), gate_up, down, topk_ids, weights, activation)
            if experts == 256:  # Qwen3.5's shared expert beside the routed ones (decode-sized batches)
                shared = SharedExpert(
                    _empty(2 * intermediate, hidden, dtype=dtype),
                    _empty(hidden, intermediate, dtype=dtype),
                    _empty(1, hidden, dtype=dtype),
                )
                topk_ids, weights = torch.zeros(1, top_k, dtype=torch.int32), torch.ones(1, top_k)
                x = _empty(1, hidden, dtype=dtype)
                fused_moe(x, gate_up, down, topk_ids, weights, activation, shared=shared)


def _fused_moe_int4(target: Target, full: bool) -> None:
    from fitserve.kernels.fused_moe_int4 import PackedExperts, fused_moe_int4

    def packed(experts: int, n: int, k: int, group: int, dtype: torch.dtype) -> PackedExperts:
        padded = -(-k // 256) * 256
        qweight = torch.empty(experts, n, padded // 8, dtype=torch.int32)
        return PackedExperts(qweight, _empty(experts, -(-padded // group), n, 2, dtype=dtype), group, k, n)

    # Qwen3-30B-A3B int4 (128 experts, top 8, 2048 / 768, group 128; 384 a rank at TP 2), Gemma-4 26B-A4B's
    # experts (2816 / 704, group 64)
    models = (
        (128, 8, 2048, 768, 128, "silu"),
        (128, 8, 2048, 384, 128, "silu"),
        (128, 8, 2816, 704, 64, "gelu_tanh"),
    )
    for experts, top_k, hidden, intermediate, group, activation in models if full else models[:1]:
        for dtype in activation_dtypes(target, full):
            gate_up = packed(experts, 2 * intermediate, hidden, group, dtype)
            down = packed(experts, hidden, intermediate, group, dtype)
            # W8A8's tile rows by the pairs an expert gets (fused_moe_fp8.w8a8_block_m): 16, 32 and 64
            for tokens in (1, 256, 1024, 2048) if full else (1, 256):
                topk_ids = torch.zeros(tokens, top_k, dtype=torch.int32)
                weights = torch.ones(tokens, top_k, dtype=torch.float32)
                x = _empty(tokens, hidden, dtype=dtype)
                fused_moe_int4(x, gate_up, down, topk_ids, weights, activation)


def _fused_moe_fp8(target: Target, full: bool) -> None:
    from fitserve.kernels import moe_decode
    from fitserve.kernels.fused_moe_fp8 import Fp8Experts, fp8_experts_run_on, fused_moe_fp8

    if not fp8_experts_run_on(torch.device("cuda")):
        return  # float8 experts run from 7.5 on (W8A16 on their bytes below 8.9)

    def experts(count: int, n: int, k: int, group: int | None) -> Fp8Experts:
        groups = 1 if group is None else -(-k // group)
        data = _empty(count, n, k, dtype=torch.float8_e4m3fn)
        return Fp8Experts(data, torch.ones(count, n, groups), group or k)

    # Qwen3-30B-A3B-FP8 and Qwen3.6-35B-A3B-FP8 ([128, 128] blocks), a per-channel Gemma-4 26B-A4B FP8
    models = ((128, 8, 2048, 768, 128, "silu"), (256, 8, 2048, 512, 128, "silu"))
    models += ((128, 8, 2816, 704, None, "gelu_tanh"),)
    for count, top_k, hidden, intermediate, group, activation in models if full else models[:1]:
        for dtype in activation_dtypes(target, full):
            gate_up = experts(count, 2 * intermediate, hidden, group)
            down = experts(count, hidden, intermediate, group)
            # W8A8's tile rows by the pairs an expert gets (fused_moe_fp8.w8a8_block_m): 16, 32 and 64
            for tokens in (1, 256, 1024, 2048) if full else (1, 256):
                topk_ids = torch.zeros(tokens, top_k, dtype=torch.int32)
                weights = torch.ones(tokens, top_k, dtype=torch.float32)
                x = _empty(tokens, hidden, dtype=dtype)
                fused_moe_fp8(x, gate_up, down, topk_ids, weights, activation)
                if moe_decode.takes(tokens):  # layers/moe_fp8.py's path for one token
                    moe_decode.moe_decode(x, gate_up, down, topk_ids, weights, activation)


def _gemma_moe(target: Target, full: bool) -> None:
    from fitserve.kernels.gemma_moe_norms import gemma_moe_head, gemma_moe_tail
    from fitserve.kernels.moe_router import router_topk

    # Gemma-4 26B-A4B: 128 experts, top 8, hidden 2816
    for dtype in activation_dtypes(target, full):
        for rows in (1, 64):
            x = _empty(rows, 2816, dtype=dtype)
            weight = _empty(2816, dtype=dtype)
            gemma_moe_head(x, x, weight, weight, weight, _empty(2816, dtype=torch.float32), 1e-6)
            gemma_moe_tail(x, x, x, weight, weight, weight, 1e-6, _empty(1, dtype=dtype))
            router_topk(_empty(rows, 128, dtype=dtype), _empty(128, dtype=dtype), 8)


def _gated_delta(target: Target, full: bool) -> None:
    from fitserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
    from fitserve.kernels.gated_delta_chunk import chunk_gated_delta_rule_kernel, runs_on
    from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_kernel

    # Qwen3.5/3.6's linear attention: 16 key heads x 128, 32 (or 48) value heads x 128; conv width 4
    for dtype in activation_dtypes(target, full):
        for key_heads, value_heads in ((16, 32), (16, 48), (8, 16)) if full else ((16, 32),):
            dim = 128
            channels = 2 * key_heads * dim + value_heads * dim
            weight = _empty(channels, 4, dtype=dtype)
            states = _empty(8, channels, 3, dtype=dtype)
            for tokens in (7, 300):
                x = _empty(tokens, channels, dtype=dtype)
                causal_conv1d_varlen(x, weight, states, [tokens], [0], [False])
                causal_conv1d_varlen(x, weight, states, [tokens], [0], [True], silu=False)
            for batch in (1, 32):
                causal_conv1d_update(
                    _empty(batch, channels, dtype=dtype),
                    weight,
                    states,
                    torch.zeros(batch, dtype=torch.int32),
                )
            recurrent_states = _empty(8, value_heads, dim, dim, dtype=torch.float32)
            for tokens in (7, 300):
                q = _empty(tokens, key_heads, dim, dtype=dtype)
                k = _empty(tokens, key_heads, dim, dtype=dtype)
                v = _empty(tokens, value_heads, dim, dtype=dtype)
                g = _empty(tokens, value_heads, dtype=torch.float32)
                beta = _empty(tokens, value_heads, dtype=dtype)
                for l2norm in (False, True) if runs_on(torch.device("cuda")) else ():
                    chunk_gated_delta_rule_kernel(
                        q,
                        k,
                        v,
                        g,
                        beta,
                        recurrent_states,
                        [tokens],
                        [0],
                        [False],
                        l2norm=l2norm,
                        out_dtype=dtype,
                    )
            for batch in (1, 32):
                q = _empty(batch, key_heads, dim, dtype=dtype)
                k = _empty(batch, key_heads, dim, dtype=dtype)
                v = _empty(batch, value_heads, dim, dtype=dtype)
                g = _empty(batch, value_heads, dtype=dtype)
                beta = _empty(batch, value_heads, dtype=dtype)
                slots = torch.zeros(batch, dtype=torch.int32)
                for l2norm in (False, True):
                    fused_recurrent_gated_delta_rule_kernel(
                        q, k, v, g, beta, recurrent_states, slots, l2norm=l2norm, out_dtype=dtype
                    )
                fused_recurrent_gated_delta_rule_kernel(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    recurrent_states,
                    slots,
                    a_log=_empty(value_heads, dtype=torch.float32),
                    dt_bias=_empty(value_heads, dtype=torch.float32),
                    l2norm=True,
                    out_dtype=dtype,
                )


def _qwen3_5_fused(target: Target, full: bool) -> None:
    """Qwen3.5/3.6's fused norms and gates, at batch 1 and a prefill chunk: the layer norms (weight stored
    as the offset from 1, alone and with the residual add; hidden 5120 and 2048), DeltaNet's gated output norm
    (value heads of 128: 48 and 32 of the models at TP 1, 16 at a higher TP), the full layers' q/k norm with
    partial rope (16 or 32 q heads and 2 or 4 kv heads of 256, a quarter rotated; heads of 128 rotated whole)
    and their attention output gate; the MLP's activation rounded as torch rounds it; the sparse MoE
    block's router (256 experts, top 8, weights rounded to the dtype) and its shared expert's gate with the
    sum."""
    from fitserve.kernels.activation import sigmoid_gate_mul, silu_and_mul
    from fitserve.kernels.gated_rms_norm import gated_rms_norm
    from fitserve.kernels.moe_router import router_topk
    from fitserve.kernels.norm import fused_add_rms_norm, rms_norm
    from fitserve.kernels.qk_norm_partial_rope import qk_norm_partial_rope
    from fitserve.kernels.shared_expert_gate import add_gated_shared_expert

    for dtype in activation_dtypes(target, full):
        for tokens in (1, 512):
            for hidden in (5120, 2048):
                x = _empty(tokens, hidden, dtype=dtype)
                weight = _empty(hidden, dtype=dtype)
                rms_norm(x, weight, 1e-6, weight_offset=1.0, round_normed=False)
                fused_add_rms_norm(x, x, weight, 1e-6, weight_offset=1.0, round_normed=False)
            silu_and_mul(_empty(tokens, 2 * 17408, dtype=dtype), as_torch=True)
            x = _empty(tokens, 2048, dtype=dtype)
            router_topk(_empty(tokens, 256, dtype=dtype), None, 8, round_to_scores_dtype=True)
            add_gated_shared_expert(x, x, x, _empty(1, 2048, dtype=dtype))
            for value_heads in (48, 32, 16) if full else (48, 16):
                core = _empty(tokens, value_heads, 128, dtype=torch.float32)
                z = _empty(tokens, value_heads * 128, dtype=dtype)
                gated_rms_norm(core, z, _empty(128, dtype=dtype), 1e-6, dtype)
            for head_dim, q_heads, kv_heads, rotary_dim in (
                (256, 16, 2, 64),
                (256, 32, 4, 64),
                (128, 8, 2, 128),
            ):
                query_gate = _empty(tokens, q_heads, 2 * head_dim, dtype=dtype)
                k = _empty(tokens, kv_heads, head_dim, dtype=dtype)
                weight = _empty(head_dim, dtype=dtype)
                cos = _empty(tokens, rotary_dim, dtype=dtype)
                qk_norm_partial_rope(query_gate, k, weight, weight, 1e-6, cos, cos)
                sigmoid_gate_mul(_empty(tokens, q_heads * head_dim, dtype=dtype), query_gate)


def _e4m3_kv_cache(target: Target, full: bool) -> None:
    """The four kernels that touch a float8 e4m3 cache, at the 8B shape (head dim 128, GQA 4) and the
    subset's dtype: what tests/unit/test_kernel_targets.py compiles for every target from sm_70 to sm_89
    and tests/unit/test_e4m3_kv_sass.py for sm_90; the cache goes to them as its bytes (below 8.9 always,
    from 8.9 on beside bfloat16 queries: kernels/attention_inputs.kv_cache_for_kernels)."""
    from fitserve.kernels.cache_write import reshape_and_cache
    from fitserve.kernels.decode_attention import paged_decode_attention
    from fitserve.kernels.prefill_attention import paged_prefill_attention
    from fitserve.kernels.rotary_cache_write import rotary_cache_write

    dtype = activation_dtypes(target, full=False)[0]
    head_dim, q_heads, kv_heads = 128, 32, 8
    kv_cache = _empty(2, 512, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn)
    k = _empty(4, kv_heads, head_dim, dtype=dtype)
    q = _empty(4, q_heads, head_dim, dtype=dtype)
    positions = torch.zeros(4, dtype=torch.int64)
    reshape_and_cache(k, k, kv_cache, positions)
    rotary_cache_write(positions, q, k, k, _empty(4096, head_dim, dtype=torch.float32), kv_cache, positions)
    tables = torch.zeros(4, 64, dtype=torch.int32)
    seq_lens = torch.ones(4, dtype=torch.int32)
    paged_decode_attention(q, kv_cache, tables, seq_lens, 0.1)
    starts = torch.arange(5, dtype=torch.int32)
    paged_prefill_attention(q, kv_cache, starts, seq_lens, tables, 1, 0.1)


def _tp_all_reduce(target: Target, full: bool) -> None:
    """The custom all-reduce (distributed/custom_all_reduce.py) and its fused RMSNorm at 2, 4 and 8 ranks (the
    subset: 2), every rank's buffers as the launchers take them, a decode step's rows at hidden 4,096 and
    8,192 (and float32, which the plain one takes)."""
    from fitserve.kernels import one_shot_all_reduce as plain
    from fitserve.kernels import one_shot_all_reduce_norm as fused

    for world in (2, 4, 8) if full else (2,):
        flags = [torch.zeros(plain.MAX_PROGRAMS * world, dtype=torch.int64) for _ in range(world)]
        timeout_ns = 600 * 10**9  # the default collective timeout: an int64 argument, as the engine passes it
        counters = torch.zeros(plain.MAX_PROGRAMS, dtype=torch.int64)
        sync = (counters, torch.zeros(1, dtype=torch.int32), timeout_ns)
        for dtype in (*activation_dtypes(target, full), torch.float32):
            data = [_empty(2 * world * plain.MAX_PROGRAMS * plain.CHUNK, dtype=dtype) for _ in range(world)]
            plain.one_shot_all_reduce(_empty(4096, dtype=dtype), world - 1, data, flags, *sync)
        for dtype in activation_dtypes(target, full):
            data = [_empty(2 * world * fused.MAX_ROWS * fused.ROW_SLOT, dtype=dtype) for _ in range(world)]
            for hidden in (4096, 8192):
                rows, weight = _empty(4, hidden, dtype=dtype), _empty(hidden, dtype=dtype)
                fused.one_shot_all_reduce_norm(rows, rows, weight, 1e-6, 0, data, flags, *sync)


LAUNCH_CASES: dict[str, Case] = {
    "decode_attention": _decode_attention,
    "prefill_attention": _prefill_attention,
    "cache_writes": _cache_writes,
    "norms_rotary_activations": _norms_rotary_activations,
    "gemms_and_sampling": _gemms_and_sampling,
    "graph_inputs": _graph_inputs,
    "int4": _int4,
    "nf4": _nf4,
    "fp8_linear": _fp8_linear,
    "fused_moe": _fused_moe,
    "fused_moe_int4": _fused_moe_int4,
    "fused_moe_fp8": _fused_moe_fp8,
    "gemma_moe": _gemma_moe,
    "gated_delta": _gated_delta,
    "qwen3_5_fused": _qwen3_5_fused,
    "e4m3_kv_cache": _e4m3_kv_cache,
    "tp_all_reduce": _tp_all_reduce,
}
