"""Folds issue 28's quantization results into benchmarks/results/h100_quant.json: the keys the issue names,
each goal's status, and the 70B runs' planned-beside-measured memory, from the files the scripts saved:

  h100_quant_single.json   quant_suite.py all --figures single (batch 1, every format, one lease)
  h100_quant_b64.json      quant_suite.py all --formats bf16,int4 (batch-64 decode step)
  h100_offload70b_*.json   offload70b.py --format int4 / bnb4

  python benchmarks/gpu/collect_quant.py
"""

from __future__ import annotations

import json

from common import RESULTS  # noqa: I001


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def main() -> None:
    single, b64 = load("h100_quant_single.json"), load("h100_quant_b64.json")
    offload = {fmt: load(f"h100_offload70b_{fmt}.json")["figures"] for fmt in ("int4", "bnb4")}
    k = single["figures"]["keys"]
    bf16 = k["bf16_single8b_tok_per_s"]
    ratio = {fmt: round(k[f"{fmt}_single8b_tok_per_s"] / bf16, 3) for fmt in ("int4", "fp8", "bnb4")}
    keys = {
        "int4_single8b_tok_per_s": k["int4_single8b_tok_per_s"],
        "bf16_single8b_tok_per_s": bf16,
        "int4_single8b_roofline_frac": k["int4_single8b_roofline_frac"],
        "fp8_single8b_tok_per_s": k["fp8_single8b_tok_per_s"],
        "bnb4_single8b_tok_per_s": k["bnb4_single8b_tok_per_s"],
        **{f"{fmt}_vs_bf16_single8b": value for fmt, value in ratio.items()},
        "int4_b64_decode_ms": b64["figures"]["keys"]["int4_b64_decode_ms"],
        "bf16_b64_decode_ms": b64["figures"]["keys"]["bf16_b64_decode_ms"],
        "r1_70b_int4_offload_tok_per_s": offload["int4"]["decode_tok_per_s"],
        "r1_70b_int4_offload_frac_of_pcie_limit": offload["int4"]["frac_of_limit"],
        "r1_70b_bnb4_offload_tok_per_s": offload["bnb4"]["decode_tok_per_s"],
        "r1_70b_bnb4_offload_frac_of_pcie_limit": offload["bnb4"]["frac_of_limit"],
        "h2d_gb_per_s": offload["int4"]["h2d_gb_per_s"],
    }

    def met(ok: bool) -> str:
        return "met" if ok else "NOT MET"

    b64_ok = keys["int4_b64_decode_ms"] <= keys["bf16_b64_decode_ms"]
    goals = {
        "int4 >= 2.5x bf16 at batch 1": f"{met(ratio['int4'] >= 2.5)} ({ratio['int4']:.2f}x)",
        "int4 >= 0.85 of its roofline": f"{met(keys['int4_single8b_roofline_frac'] >= 0.85)} "
        f"({keys['int4_single8b_roofline_frac']:.3f})",
        "fp8 >= 1.6x bf16 at batch 1": f"{met(ratio['fp8'] >= 1.6)} ({ratio['fp8']:.2f}x)",
        "fp8_equal_out_tok_per_s >= bf16": "not measured",
        "bnb4 >= 2x bf16 at batch 1": f"{met(ratio['bnb4'] >= 2)} ({ratio['bnb4']:.2f}x)",
        "int4 batch-64 step no slower than bf16": f"{met(b64_ok)} ({keys['int4_b64_decode_ms']:.1f} against "
        f"{keys['bf16_b64_decode_ms']:.1f} ms)",
        "70B int4 offload >= 0.80 of the PCIe limit": f"{met(offload['int4']['frac_of_limit'] >= 0.8)} "
        f"({offload['int4']['frac_of_limit']:.3f})",
    }
    result = {
        "workload": "quant",
        "machine": single["machine"],
        "sources": {
            "h100_quant_single.json": single["command"],
            "h100_quant_b64.json": b64["command"] + " (an earlier lease, same machine kind)",
            "h100_offload70b_int4.json": "offload70b.py --format int4 (the lease of h100_quant_single.json)",
            "h100_offload70b_bnb4.json": "offload70b.py --format bnb4 (the lease of h100_quant_single.json)",
        },
        "keys": keys,
        "goals": goals,
        "planned_vs_measured_70b": {
            fmt: {
                "advice_cpu_offload_gb": figures["plan_advice_cpu_offload_gb"],
                "planned": figures["planned"],
                "measured": figures["measured"],
            }
            for fmt, figures in offload.items()
        },
        "notes": "Dummy weights in each format: the Llama-3.1-8B shape for batch 1 and 64, the "
        "DeepSeek-R1-Distill-Llama-70B shape for the offload runs (the engine given 24 GiB through "
        "gpu_memory_utilization, max_num_seqs 16, max_num_batched_tokens 2048). Roofline: the bytes a step "
        "reads (every tensor on the GPU but the input embedding table) over the copy bandwidth of the run.",
    }
    (RESULTS / "h100_quant.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["goals"], indent=1))


if __name__ == "__main__":
    main()
