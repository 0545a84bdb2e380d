"""Issue 29's speed and capacity figures for Gemma-4 on one GPU (dummy weights, the shared/models configs).

  python benchmarks/gpu/gemma4_suite.py [--out FILE] [--figure-timeout-s 300]

Each figure runs in its own process through tp_suite.py (`one --figure ...`), so one engine's memory is gone
before the next starts:
- gemma4_{26b,31b,e4b}_single_tok_per_s: batch 1, 128 prompt tokens, 256 greedy output tokens (best of 3),
  and each one's fraction of the weight-streaming roofline (the bytes a token reads, the active experts only,
  over the copy bandwidth measured in the run);
- gemma4_26b_equal_out_tok_per_s: 256 requests of 512 prompt and 512 output tokens, greedy;
- gemma4_{26b,31b}_kv_tokens_131072 and their max concurrency at max_model_len 131072, gmu 0.9.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS, machine, run_figure_process, save  # noqa: I001

FIGURES = {
    "26b_single": "singleg26_tp1",
    "31b_single": "singleg31_tp1",
    "e4b_single": "singlege4_tp1",
    "26b_equal": "equalg26_tp1",
    "26b_kv": "kvg26_tp1",
    "31b_kv": "kvg31_tp1",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(RESULTS / "h100_gemma4.json"))
    parser.add_argument("--figures", default=",".join(FIGURES), help="of: " + ", ".join(FIGURES))
    parser.add_argument("--figure-timeout-s", type=float, default=300)
    args = parser.parse_args()
    figures: dict = {"machine_detail": machine()}
    for name in args.figures.split(","):
        script = str(Path(__file__).resolve().parent / "tp_suite.py")
        raw = run_figure_process(script, ["one", "--figure", FIGURES[name]], args.figure_timeout_s)
        model, kind = name.split("_")
        figures[f"gemma4_{name}_run"] = raw
        if "error" in raw:
            print(name, json.dumps(raw)[:2000], flush=True)
            continue
        if kind == "single":
            figures[f"gemma4_{model}_single_tok_per_s"] = raw["tok_per_s"]
            figures[f"gemma4_{model}_single_roofline_frac"] = raw["roofline_frac"]
        elif kind == "equal":
            figures[f"gemma4_{model}_equal_out_tok_per_s"] = raw["out_tok_per_s"]
        else:
            figures[f"gemma4_{model}_kv_tokens_131072"] = raw["kv_cache_tokens_per_rank"]
            figures[f"gemma4_{model}_max_concurrency_131072"] = raw["max_concurrency"]
        print(name, json.dumps(raw), flush=True)
    save("gemma4_suite", figures, args.out)


if __name__ == "__main__":
    main()
