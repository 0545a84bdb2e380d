"""fitserve's fp8 MoE kernels beside vLLM 0.26.0's, in one process, on the same weights, inputs and routing:
Qwen3-30B-A3B-FP8's experts (128 of them, top 8, hidden 2048, intermediate 768, [128, 128] block scales,
random weights). fitserve's side is the layer as it runs (layers/moe_fp8.py: kernels/fused_moe_fp8.py past
one token); vLLM's is torch.ops.vllm.fused_experts, the Triton fused MoE that vLLM 0.26.0 picks for
block-fp8 experts on Hopper at tensor parallel 1 (fused_moe/oracle/fp8.py puts TRITON first there), with
its tuned tile configs for the GPU, W8A8 with 1 x 128 activation groups as fitserve's.

For each token count T: microseconds a call from CUDA graph replays (16 calls a graph, each routed to
other experts), each engine's output first checked against the dequantized torch reference
(Fp8FusedExperts.reference: fitserve's within 2^-5 of its largest value; vLLM's largest error is
recorded, as its activation quantization differs), and vLLM's time over fitserve's.

  PYTHONPATH=/tmp/site:. python benchmarks/gpu/moe_fp8_vs_vllm.py [--tokens 16 64 256 1024 2048] [--out FILE]
vLLM 0.26.0 from ../shared/vllm_bundle (its README: three device calls).
"""

from __future__ import annotations

import argparse

import torch
from common import save  # noqa: I001
from fused_moe_bench import CALLS_PER_GRAPH, routings
from fused_moe_fp8_bench import MODEL, build_fp8, checked, graph_us

BLOCK = 128  # Qwen's fp8 block: a scale per [128, 128] of each expert's weight


def vllm_fused_experts(fp8, x: torch.Tensor):
    """A call(ids, weights) of vLLM's fused MoE over fitserve's fp8 experts (its block scales are one per
    [128, 128]: fitserve keeps them repeated on every row of a block)."""
    import vllm.model_executor.layers.fused_moe.fused_moe  # noqa: F401 (registers torch.ops.vllm.fused_experts)

    w1_scale = fp8.w13_scale[:, ::BLOCK, :].contiguous()
    w2_scale = fp8.w2_scale[:, ::BLOCK, :].contiguous()

    def call(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return torch.ops.vllm.fused_experts(
            hidden_states=x,
            w1=fp8.w13,
            w2=fp8.w2,
            topk_weights=weights,
            topk_ids=ids,
            activation="silu",
            apply_router_weight_on_input=False,
            use_fp8_w8a8=True,
            use_int8_w8a8=False,
            use_int8_w8a16=False,
            use_int4_w4a16=False,
            ocp_mx_scheme=None,
            per_channel_quant=False,
            global_num_experts=-1,
            expert_map=None,
            w1_scale=w1_scale,
            w2_scale=w2_scale,
            w1_zp=None,
            w2_zp=None,
            a1_scale=None,
            a2_scale=None,
            block_shape=[BLOCK, BLOCK],
            w1_bias=None,
            w2_bias=None,
        )

    return call


def measure(fp8, tokens: int) -> dict:
    x = torch.randn(tokens, fp8.w13.shape[2], device="cuda", dtype=torch.bfloat16)
    routes = routings(MODEL, tokens, CALLS_PER_GRAPH)
    vllm_routes = [(ids.to(torch.int32), weights) for ids, weights in routes]  # vLLM's router gives int32
    reference = lambda ids, weights: fp8.reference(x, ids.long(), weights)  # noqa: E731
    entry = {"tokens": tokens}
    entry["fitserve_us"] = round(checked(lambda ids, w: fp8.run_kernels(x, ids, w), reference, routes), 1)
    try:
        call = vllm_fused_experts(fp8, x)
        ids, weights = vllm_routes[0]
        expected = reference(ids, weights).float()
        error = (call(ids, weights).float() - expected).abs().max() / expected.abs().max()
        entry["vllm_error_of_largest"] = round(error.item(), 4)  # its own numerics: recorded, not gated
        entry["vllm_us"] = round(graph_us(call, vllm_routes), 1)
        entry["vllm_over_fitserve"] = round(entry["vllm_us"] / entry["fitserve_us"], 3)
    except Exception as error:  # noqa: BLE001 (recorded: the figure says why vLLM's side is missing)
        entry["vllm_error"] = f"{type(error).__name__}: {error}"[:400]
    print(entry, flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 1024, 2048])
    parser.add_argument("--out")
    args = parser.parse_args()
    import vllm

    fp8 = build_fp8()
    results = [measure(fp8, tokens) for tokens in args.tokens]
    save("moe_fp8_vs_vllm", {"vllm": vllm.__version__, "results": results}, args.out)


if __name__ == "__main__":
    main()
