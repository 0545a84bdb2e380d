"""The whole engine on the H100 with the kernels forced onto the SM75 (T4, RTX 20xx) choices (issue 35):
FITSERVE_KERNEL_TARGET=sm75 (fitserve/kernels/capability.py) turns PDL off and makes every config chooser
pick the tiles of a 64 KB shared-memory GPU; the model runs in fp16, as auto-fit picks below 8.0.

Llama-3.1-8B shape, dummy weights, 128 prompt tokens, 256 greedy output tokens. Three runs, each in its
own process (the target is read once per process): the default path in fp16 (the reference for the
tokens), the SM75 path in fp16, and the default path in bf16 (the H100's usual speed). Records batch-1
and batch-32 tok/s of each and whether the SM75 path's greedy tokens equal the fp16 default's (the
choosers change tile shapes and so summation order: a near-tie of two logits could flip; the count of
equal sequences and the first differing position say how far they agree). A fourth run,
`default_fp16_split_tile` (in --runs), is the default path with the SM75 path's decode attention tile: equal
tokens there against the SM75 run say the two paths differ only in that tile's rounding.
  python benchmarks/gpu/sm75_path.py   -> benchmarks/results/h100_sm75_path.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from common import MODELS, TOKENIZER, run_figure_process, save  # noqa: I001

PROMPT_TOKENS, OUTPUT_TOKENS, BATCH = 128, 256, 32


def one(dtype: str, split_decode_tile: bool = False) -> dict:
    """The figure of one run (this process's kernel target): tok/s at batch 1 and 32, and the tokens.
    split_decode_tile: decode attention never takes its whole-context tile (which needs 144 KB of shared
    memory, so the SM75 choices never do), whatever the GPU: the default path with the SM75 path's decode
    tile, to tell rounding from a fault when the two paths' tokens differ."""
    from fitserve import LLM, SamplingParams
    from fitserve.kernels import capability, decode_attention

    if split_decode_tile:
        decode_attention.WHOLE_CONTEXT_MIN_SHARED = 1 << 40
    llm = LLM(
        str(MODELS / "llama-3.1-8b"),
        tokenizer=str(TOKENIZER),
        load_format="dummy",
        max_model_len=4096,
        dtype=dtype,
        seed=0,
    )
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(PROMPT_TOKENS)]} for _ in range(BATCH)
    ]
    figure: dict = {
        "kernel_target": capability.forced(),
        "dtype": dtype,
        "split_decode_tile": split_decode_tile,
    }
    for batch in (1, BATCH):
        times = []
        for i in range(4):  # the first run warms up
            start = time.perf_counter()
            outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
            if i > 0:
                times.append(time.perf_counter() - start)
        figure[f"batch{batch}_tok_per_s"] = round(batch * OUTPUT_TOKENS / min(times), 1)
        figure[f"batch{batch}_seconds"] = [round(t, 4) for t in times]
        figure[f"batch{batch}_tokens"] = [list(output.outputs[0].token_ids) for output in outputs]
    return figure


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Equal sequences, the first position where any differs (None: all equal), and each sequence's
    first differing position (None where it is equal)."""
    per_sequence: list[int | None] = []
    for a, b in zip(reference, other, strict=True):
        per_sequence.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None))
    differing = [position for position in per_sequence if position is not None]
    return {
        "equal_sequences": len(per_sequence) - len(differing),
        "sequences": len(reference),
        "first_difference": min(differing) if differing else None,
        "first_difference_per_sequence": per_sequence,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", choices=["float16", "bfloat16"], help="(internal) run one figure")
    parser.add_argument("--split-decode-tile", action="store_true", help="(internal) see one()")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--runs",
        default="default_fp16,sm75_fp16,default_bf16",
        help="which runs (comma-separated; the comparison needs the first two; default_fp16_split_tile "
        "is the default path with the SM75 path's decode attention tile)",
    )
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.split_decode_tile)), flush=True)
        return
    script = os.path.abspath(__file__)
    runs = {}
    wanted = args.runs.split(",")
    known = (
        ("default_fp16", None, "float16", []),
        ("sm75_fp16", "sm75", "float16", []),
        ("default_fp16_split_tile", None, "float16", ["--split-decode-tile"]),
        ("default_bf16", None, "bfloat16", []),
    )
    unknown = sorted(set(wanted) - {name for name, *_ in known})
    if unknown:
        parser.error(f"--runs {','.join(unknown)}: not a run; choose from {', '.join(n for n, *_ in known)}")
    for name, target, dtype, extra in known:
        if name not in wanted:
            continue
        os.environ.pop("FITSERVE_KERNEL_TARGET", None)
        if target:
            os.environ["FITSERVE_KERNEL_TARGET"] = target
        runs[name] = run_figure_process(script, ["--one", dtype, *extra], timeout_s=1200)
        print(name, {k: v for k, v in runs[name].items() if not k.endswith("_tokens")}, file=sys.stderr)
    os.environ.pop("FITSERVE_KERNEL_TARGET", None)
    figures: dict = {}
    for name, run in runs.items():
        figures[name] = {k: v for k, v in run.items() if not k.endswith("_tokens")}
        # the noise floor of the comparison: the same prompt alone and as row 0 of the batch, on the same
        # path (other GEMM and attention configs, so other summation orders)
        if "batch1_tokens" in run and f"batch{BATCH}_tokens" in run:
            figures[name]["batch1_vs_batch32_row0"] = agreement(
                run["batch1_tokens"][:1], run[f"batch{BATCH}_tokens"][:1]
            )
        # the first 8 tokens of the first 4 sequences: enough to see a degenerate (repeating) output
        figures[name]["token_heads"] = {
            key: [tokens[:8] for tokens in run[key][:4]] for key in run if key.endswith("_tokens")
        }
    reference, sm75 = runs.get("default_fp16", {}), runs.get("sm75_fp16", {})
    for batch in (1, BATCH):
        key = f"batch{batch}_tokens"
        if key in reference and key in sm75:
            figures[f"sm75_vs_default_fp16_batch{batch}"] = agreement(reference[key], sm75[key])
            default_speed = reference[f"batch{batch}_tok_per_s"]
            figures[f"sm75_speed_ratio_batch{batch}"] = round(
                sm75[f"batch{batch}_tok_per_s"] / default_speed, 3
            )
    split = runs.get("default_fp16_split_tile", {})
    for batch in (1, BATCH):
        key = f"batch{batch}_tokens"
        if key in split and key in sm75:  # the same decode tile on both: equal unless something else differs
            figures[f"sm75_vs_default_fp16_split_tile_batch{batch}"] = agreement(split[key], sm75[key])
    save("sm75_path", figures, args.out)


if __name__ == "__main__":
    main()
