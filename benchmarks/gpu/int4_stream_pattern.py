"""How fast HBM delivers an int4 weight in the access pattern of the batch-1 kernels, with no arithmetic:
a Triton kernel XOR-reduces the packed words of a Llama-3.1-8B layer ([N, K / 8] int32, kernels/
int4_repack.py), each program owning ROWS weight rows and a split of K and loading WORDS words of each of
its rows per iteration (the kernels load 32: one 128-byte line per row per 256-code block). Beside it: the
same bytes read as one contiguous stream, and F.linear with a bfloat16 weight of the layer's shape.
CUDA-graph replays, weights rotated past the L2; fractions of the device-to-device copy bandwidth.

  python benchmarks/gpu/int4_stream_pattern.py [--out FILE]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from common import copy_bandwidth_bytes_per_s, save_sweep  # noqa: I001
from int4_gemm import median_graph_us, shapes

L2_BYTES_TO_BEAT = 256 << 20


@triton.jit
def _stream_rows(
    w_ptr,
    out_ptr,
    stride,
    iters_per_split,
    iters,
    ROWS: tl.constexpr,
    WORDS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, WORDS)
    pointers = w_ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :]
    first = pid_k * iters_per_split
    last = tl.minimum(first + iters_per_split, iters)
    acc = tl.zeros((ROWS, WORDS), dtype=tl.int32)
    for it in tl.range(first, last, num_stages=NUM_STAGES):
        acc ^= tl.load(pointers + it * WORDS)
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.reduce(acc, None, _xor))


@triton.jit
def _stream_flat(w_ptr, out_ptr, words_per_program, CHUNK: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    base = w_ptr + pid.to(tl.int64) * words_per_program
    acc = tl.zeros((CHUNK,), dtype=tl.int32)
    for it in tl.range(0, words_per_program // CHUNK, num_stages=NUM_STAGES):
        acc ^= tl.load(base + it * CHUNK + offs)
    tl.store(out_ptr + pid, tl.reduce(acc, None, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", nargs="+", default=["gate_up", "down", "qkv"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    copy_bandwidth = copy_bandwidth_bytes_per_s()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    results = []
    for layer, (in_features, out_features) in shapes("llama-3.1-8b").items():
        if layer not in args.layers:
            continue
        words = in_features // 8
        copies = [
            torch.randint(-(2**31), 2**31 - 1, (out_features, words), dtype=torch.int32, device="cuda")
            for _ in range(max(2, L2_BYTES_TO_BEAT // (out_features * words * 4) + 1))
        ]
        nbytes = out_features * words * 4

        def frac(us: float, nbytes: int = nbytes) -> float:
            return round(nbytes / (us * 1e-6) / copy_bandwidth, 3)

        entry = {"layer": layer, "k": in_features, "n": out_features, "bytes": nbytes, "rows": []}
        for rows, width in (
            (64, 32),
            (32, 64),
            (16, 128),
            (8, 256),
            (128, 32),
            (64, 64),
            (32, 128),
            (16, 256),
        ):
            for warps in (2, 4):
                for stages in (2, 3, 4):
                    iters = words // width
                    for splits in sorted({1, 2, 4, max(1, 4 * sms // (out_features // rows))}):
                        if splits > iters:
                            continue
                        per_split = triton.cdiv(iters, splits)
                        grid = (out_features // rows, triton.cdiv(iters, per_split))

                        def call(
                            w,
                            grid=grid,
                            per_split=per_split,
                            iters=iters,
                            rows=rows,
                            width=width,
                            warps=warps,
                            stages=stages,
                        ):
                            _stream_rows[grid](
                                w, out, w.stride(0), per_split, iters, rows, width, stages, num_warps=warps
                            )

                        us = round(median_graph_us(call, copies), 2)
                        entry["rows"].append(
                            {
                                "rows": rows,
                                "words": width,
                                "warps": warps,
                                "stages": stages,
                                "splits": splits,
                                "us": us,
                                "copy_bw_frac": frac(us),
                            }
                        )
        entry["rows"].sort(key=lambda r: r["us"])
        flat = []
        for chunk in (1024, 2048, 4096):
            for programs in (sms * 4, sms * 8, sms * 16):
                per_program = (out_features * words) // programs // chunk * chunk
                if per_program == 0:
                    continue
                call = functools.partial(
                    lambda w, p, n, c: _stream_flat[(p,)](w, out, n, c, 3, num_warps=4),
                    p=programs,
                    n=per_program,
                    c=chunk,
                )
                us = median_graph_us(call, copies)
                moved = per_program * programs * 4
                flat.append(
                    {
                        "chunk_words": chunk,
                        "programs": programs,
                        "us": round(us, 2),
                        "copy_bw_frac": round(moved / (us * 1e-6) / copy_bandwidth, 3),
                    }
                )
        entry["flat"] = sorted(flat, key=lambda r: -r["copy_bw_frac"])
        weights = [
            torch.empty(out_features, in_features, dtype=torch.bfloat16, device="cuda")
            for _ in range(max(2, L2_BYTES_TO_BEAT // (out_features * in_features * 2) + 1))
        ]
        x = torch.randn(1, in_features, dtype=torch.bfloat16, device="cuda")
        us = median_graph_us(lambda w, x=x: F.linear(x, w), weights)
        entry["bf16_linear"] = {
            "us": round(us, 2),
            "copy_bw_frac": round(out_features * in_features * 2 / (us * 1e-6) / copy_bandwidth, 3),
        }
        print(layer, "best rows pattern", entry["rows"][:5], flush=True)
        print(layer, "flat", entry["flat"][:3], "bf16", entry["bf16_linear"], flush=True)
        results.append(entry)
        del copies, weights
        torch.cuda.empty_cache()
    save_sweep("int4_stream_pattern", copy_bandwidth, sms, "entries", results, args.out)


if __name__ == "__main__":
    main()
