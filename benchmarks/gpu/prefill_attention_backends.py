"""Long-prompt attention: fitserve's paged kernel beside the attention kernels torch ships.

Llama-3.1-8B heads (32 query heads, 8 KV heads, head_dim 128, bf16, KV blocks of 16 in a shuffled pool).
Each case runs fitserve's kernel (the one the engine runs for the step) over the paged cache, then each
torch path over the same keys and values gathered into one contiguous copy (the gather is timed on its
own and inside each path's figure): torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen, GQA,
bottom-right causal) and scaled_dot_product_attention on the cuDNN / flash / efficient backends (fresh
prompts only: their causal mask is top-left). Every path's output is compared with fitserve's. TFLOP/s
counts the causal pairs' two matmuls.
  python benchmarks/gpu/prefill_attention_backends.py [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from common import save  # noqa: I001
from prefill_attention_configs import BLOCK, HEAD_DIM, KV_HEADS, Q_HEADS, causal_pairs, paged_inputs
from triton.testing import do_bench

from fitserve.kernels.prefill_attention import paged_prefill_attention

CASES = {
    "1 x 8192 fresh": ([8192], [8192]),
    "4096 chunk at 28k-32k": ([4096], [32768]),
    "8192 chunk at 24k-32k": ([8192], [32768]),
    "4 x 2048 fresh": ([2048] * 4, [2048] * 4),
    "1 x 2048 fresh": ([2048], [2048]),
}


def paged_inputs_with_slots(query_lens: list[int], seq_lens: list[int]) -> dict:
    q, cache, q_starts, lens, tables = paged_inputs(query_lens, seq_lens)
    slots = []  # the flat slot of every key of every sequence, in order: the gather's index
    for row, length in enumerate(seq_lens):
        positions = torch.arange(length, device="cuda")
        slots.append(tables[row, positions // BLOCK].long() * BLOCK + positions % BLOCK)
    k_starts = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return {"cache": cache, "tables": tables, "q": q, "q_starts": q_starts, "k_starts": k_starts,
            "seq_lens": lens, "slots": torch.cat(slots)}  # fmt: skip


def gather_kv(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    flat = inputs["cache"].view(2, -1, KV_HEADS, HEAD_DIM)
    return flat[0].index_select(0, inputs["slots"]), flat[1].index_select(0, inputs["slots"])


def torch_paths(inputs: dict, query_lens: list[int], seq_lens: list[int]) -> dict:
    """name -> a function returning the output [T, Hq, D], for the torch paths this case can use."""
    q, scale = inputs["q"], HEAD_DIM**-0.5
    paths = {}

    def varlen() -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        k, v = gather_kv(inputs)
        return varlen_attn(
            q, k, v, inputs["q_starts"], inputs["k_starts"], max(query_lens), max(seq_lens),
            scale=scale, window_size=(-1, 0), enable_gqa=True,
        )  # fmt: skip

    paths["varlen_fa2"] = varlen
    if query_lens == seq_lens:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for name, backend in (
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
            ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
        ):
            for gqa in (True, False):

                def sdpa(backend: SDPBackend = backend, gqa: bool = gqa) -> torch.Tensor:
                    k, v = gather_kv(inputs)
                    outs = []
                    for row, length in enumerate(seq_lens):
                        lo, hi = int(inputs["q_starts"][row]), int(inputs["q_starts"][row + 1])
                        klo = int(inputs["k_starts"][row])
                        qs = q[lo:hi].transpose(0, 1).unsqueeze(0)
                        ks = k[klo : klo + length].transpose(0, 1).unsqueeze(0)
                        vs = v[klo : klo + length].transpose(0, 1).unsqueeze(0)
                        if not gqa:
                            ks = ks.repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
                            vs = vs.repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
                        with sdpa_kernel([backend]):
                            o = torch.nn.functional.scaled_dot_product_attention(
                                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa
                            )
                        outs.append(o[0].transpose(0, 1))
                    return torch.cat(outs)

                paths[f"{name}{'_gqa' if gqa else '_expanded'}"] = sdpa
    return paths


def run_case(query_lens: list[int], seq_lens: list[int]) -> dict:
    inputs = paged_inputs_with_slots(query_lens, seq_lens)
    flops = 4 * causal_pairs(query_lens, seq_lens) * Q_HEADS * HEAD_DIM
    out = torch.empty_like(inputs["q"])

    def fitserve() -> torch.Tensor:
        return paged_prefill_attention(
            inputs["q"], inputs["cache"], inputs["q_starts"], inputs["seq_lens"], inputs["tables"],
            max(query_lens), HEAD_DIM**-0.5, out,
        )  # fmt: skip

    reference = fitserve().clone()
    rows = {}
    ms = do_bench(fitserve, warmup=25, rep=200, return_mode="median")
    rows["fitserve"] = {"us": round(ms * 1e3, 1), "tflops": round(flops / ms / 1e9, 1)}
    ms = do_bench(lambda: gather_kv(inputs), warmup=10, rep=100, return_mode="median")
    rows["gather_only"] = {"us": round(ms * 1e3, 1)}
    for name, path in torch_paths(inputs, query_lens, seq_lens).items():
        try:
            result = path()
            torch.cuda.synchronize()
        except Exception as error:  # a backend this torch build or GPU does not offer for the case
            rows[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            continue
        difference = (result.float() - reference.float()).abs().max().item()
        ms = do_bench(path, warmup=10, rep=100, return_mode="median")
        rows[name] = {
            "us": round(ms * 1e3, 1),
            "tflops": round(flops / ms / 1e9, 1),
            "max_abs_difference_from_fitserve": difference,
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from torch.nn import attention

    figures = {"flash_impls": str(getattr(attention, "list_flash_attention_impls", lambda: None)())}
    for name, (query_lens, seq_lens) in CASES.items():
        figures[name] = run_case(query_lens, seq_lens)
        print(name, figures[name], flush=True)
    save("prefill_attention_backends", figures, args.out)


if __name__ == "__main__":
    main()
