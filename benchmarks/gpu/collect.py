"""Folds the latest per-workload results into benchmarks/results/h100.json (the issue's keys)."""

from __future__ import annotations

import json

from common import RESULTS


def figures(name: str) -> dict:
    path = RESULTS / f"h100_{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    nano, equal, single, startup = (figures(n) for n in ("nano", "equal", "single8b", "startup8b"))
    cold = figures("startup8b_cold")  # run with an empty TRITON_CACHE_DIR: every kernel compiles
    # the same two runs with transformers 5.23 first on PYTHONPATH (docs/performance.md, "Startup")
    new_tf, new_tf_cold = figures("startup8b_transformers_5_23"), figures("startup8b_cold_transformers_5_23")
    summary = {
        "nano_out_tok_per_s": nano.get("figures", {}).get("out_tok_per_s"),
        "equal_out_tok_per_s": equal.get("figures", {}).get("out_tok_per_s"),
        "single8b_tok_per_s": single.get("figures", {}).get("tok_per_s"),
        "single8b_roofline_frac": single.get("figures", {}).get("roofline_frac"),
        "startup_8b_s": startup.get("figures", {}).get("process_start_to_first_token_s"),
        "startup_8b_cold_triton_cache_s": cold.get("figures", {}).get("process_start_to_first_token_s"),
        "startup_8b_s_transformers_5_23": new_tf.get("figures", {}).get("process_start_to_first_token_s"),
        "startup_8b_cold_triton_cache_s_transformers_5_23": new_tf_cold.get("figures", {}).get(
            "process_start_to_first_token_s"
        ),
        "nano_out_tok_per_s_kv_fp8": figures("nano_kv_fp8").get("figures", {}).get("out_tok_per_s"),
        "equal_out_tok_per_s_kv_fp8": figures("equal_kv_fp8").get("figures", {}).get("out_tok_per_s"),
        "kv_tokens_8b": startup.get("figures", {}).get("kv_cache_tokens"),
        "machine": (single or equal or nano or startup).get("machine"),
        "commands": {
            n: r.get("command")
            for n, r in zip(("nano", "equal", "single8b", "startup8b"), (nano, equal, single, startup))
            if r
        },
        "vllm_0_26_0": {
            "nano_out_tok_per_s": 17603,
            "equal_out_tok_per_s": 23302,
            "single8b_tok_per_s": 152.5,
            "single8b_roofline_frac": 0.81,
            "startup_8b_s": 95,
            "kv_tokens_8b": 444528,
        },
    }
    summary["under_load"] = under_load()
    (RESULTS / "h100.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


def under_load() -> dict:
    """Issue 27's keys: serving from h100_load_suite_final.json (the engine in its own process), the
    offline figures from h100_load_suite_ab.json, vLLM's from h100_load_suite_vs_vllm.json (another
    lease: see each file's note before reading a ratio)."""
    serve = figures("load_suite_final").get("engine_process", {})
    offline = figures("load_suite_ab").get("offline_after_another_lease", {})
    vllm = figures("load_suite_vs_vllm").get("vllm_0_26_0", {})
    keys = [
        f"serve_c{c}_{what}"
        for c in (64, 128, 256)
        for what in ("out_tok_per_s", "mean_tpot_ms", "p99_ttft_ms")
    ]
    offline_keys = ["prefill_heavy_out_tok_per_s", "prefill_32k_ttft_ms", "prefill_tok_per_s_8k_chunks"]
    fitserve = {key: serve.get(key) for key in keys} | {key: offline.get(key) for key in offline_keys}
    fitserve["kv_tokens_8b_serve"] = serve.get("kv_tokens_8b")
    reference = {key: vllm.get(key) for key in keys + offline_keys} | {
        "kv_tokens_8b_serve": vllm.get("kv_tokens_8b")
    }
    return {"fitserve": fitserve, "vllm_0_26_0_first_lease": reference}


if __name__ == "__main__":
    main()
