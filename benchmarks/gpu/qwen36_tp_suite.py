"""Qwen3.6 hybrids under tensor parallel (dummy weights, the GPUs of one machine): tp_suite.py's figures
for the Qwen3.6-27B and 35B-A3B shapes, at TP 1 and TP N on the same machine.

Each figure runs in its own process (`one`), so one engine's GPU memory is gone before the next starts;
`all` runs them in turn and writes one results file (benchmarks/results/h100x2_qwen36_tp.json by default).

  python benchmarks/gpu/qwen36_tp_suite.py all [--figures singleq27_tp1,singleq27_tp2,...] [--out FILE]
  python benchmarks/gpu/qwen36_tp_suite.py one --figure singleq27_tp2

Figures (tp_suite.py says what each measures): single<model>_tp<N> (batch-1 decode tok/s and its fraction of
the weight-streaming roofline of one rank's parameters), equal<model>_tp<N> (256 x 512 in / 512 out,
offline), kv<model>_tp<N> (the KV cache at max_model_len 131072); a trailing `_ep` adds
--enable-expert-parallel; greedy<model>_tp<N> (greedy tokens and top-2 margins, compared with TP 1's).
Models: q27 = Qwen3.6-27B, q35 = Qwen3.6-35B-A3B, q27a = Qwen3.6-27B-AWQ-INT4 (compressed-tensors int4,
group 32; shared/models/). The
roofline leaves out the recurrent state a decode step reads and writes (~150 MB / ~63 MB per request over
all DeltaNet layers at TP 1, 1/N per rank), a few % of the weights at batch 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import tp_suite
from common import machine, run_figure_process, save

tp_suite.SHAPES.update({"q27": "qwen3.6-27b", "q35": "qwen3.6-35b-a3b", "q27a": "qwen3.6-27b-awq-int4"})
DEFAULT_FIGURES = "singleq27_tp1,singleq27_tp2,singleq35_tp1,singleq35_tp2,singleq35_tp2_ep,equalq27_tp2"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["all", "one"])
    parser.add_argument("--figure", default="singleq27_tp2")
    parser.add_argument("--figures", default=DEFAULT_FIGURES)
    parser.add_argument("--out", default=None)
    parser.add_argument("--figure-timeout-s", type=float, default=900)
    args = parser.parse_args()
    if args.mode == "one":
        tp_suite.run_one(args.figure)
        return
    figures: dict[str, object] = {}
    for figure in args.figures.split(","):
        figures[figure] = run_figure_process(__file__, ["one", "--figure", figure], args.figure_timeout_s)
        print(figure, json.dumps(figures[figure]), flush=True)
    figures.update(tp_suite.speedups_over_tp1(figures))
    figures.update(tp_suite.greedy_agreement(figures))
    out = args.out or str(Path(__file__).resolve().parents[1] / "results" / "h100x2_qwen36_tp.json")
    save("qwen36_tp_suite", {"machine_detail": machine(), **figures}, out)


if __name__ == "__main__":
    main()
