"""Shared by the GPU workload scripts: machine facts, the model shapes, and saving results.

Each script prints one JSON object and saves it as benchmarks/results/h100_<workload>.json (or
--out); `collect.py` folds the latest ones into benchmarks/results/h100.json.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
SHARED = next((p for p in (REPO / "shared", REPO.parent / "shared") if p.is_dir()), REPO / "shared")
MODELS = SHARED / "models"
TOKENIZER = SHARED / "tokenizers" / "smollm2"
PROCESS_START = time.perf_counter()  # the scripts import this module first


# vLLM's environment in the comparison scripts: its own sampler (not FlashInfer's), no usage reports, no hub
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}


def engine_classes(engine: str) -> tuple[type, type]:
    """(LLM, SamplingParams) of "fitserve" or "vllm" (with VLLM_ENV set), for the scripts that run either."""
    if engine == "fitserve":
        from fitserve import LLM, SamplingParams
    else:
        os.environ.update(VLLM_ENV)
        from vllm import LLM, SamplingParams
    return LLM, SamplingParams


def machine() -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    import transformers  # its import time is part of every startup (the tokenizer, the config)

    info["transformers"] = transformers.__version__
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / (1 << 30), 2)
    return info


def copy_bandwidth_bytes_per_s(num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy, counting bytes read and written (as the issue's roofline does)."""
    import torch

    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / repeats
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / elapsed


def batch1_decode_seconds(llm, rng, runs: int = 3) -> list[float]:
    """Seconds per request of `runs` batch-1 requests, 128 random prompt tokens and 256 greedy output
    tokens each, after one untimed warm-up request."""
    from fitserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    times = []
    for i in range(runs + 1):
        prompt = {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(128)]}
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        if i > 0:
            times.append(time.perf_counter() - start)
    return times


def engine_generate(llm, sampling_params, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of one offline generate over token-id prompts, greedy with eos ignored, on
    either engine (`sampling_params`: fitserve's or vLLM's SamplingParams class; the scripts that compare
    the two run the same code on each)."""
    params = sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    begin = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return time.perf_counter() - begin, sum(len(o.outputs[0].token_ids) for o in outputs)


def engine_single_request(llm, sampling_params, rng) -> tuple[float, list[float]]:
    """(output tok/s of the fastest, seconds of each) of 3 batch-1 requests of 128 random prompt tokens and
    256 output tokens after an untimed warm-up one, on either engine (engine_generate)."""
    times = []
    for i in range(4):
        seconds, _ = engine_generate(llm, sampling_params, [[rng.randint(0, 10000) for _ in range(128)]], 256)
        if i:
            times.append(seconds)
    return 256 / min(times), times


def save(workload: str, figures: dict, out: str | None = None) -> dict:
    result = {
        "workload": workload,
        "command": " ".join(["python"] + sys.argv),
        "machine": machine(),
        "figures": figures,
    }
    print(json.dumps(result, indent=2))
    path = Path(out) if out else RESULTS / f"h100_{workload}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def replay_ms(graph, repeats: int) -> float:
    """Mean milliseconds of one replay of a captured CUDA graph, after one untimed replay."""
    import torch

    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_call_ms(call, calls: int = 1, repeats: int = 20) -> float:
    """Mean milliseconds of one `call()`: run once untimed (compiles, picks algorithms), captured
    `calls` times into one CUDA graph, timed over `repeats` replays."""
    import torch

    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return replay_ms(graph, repeats) / calls


def run_figure_process(script: str, figure_args: list[str], timeout_s: float) -> dict:
    """Runs `python script *figure_args` (a suite's `one` mode, which prints its figure as one
    `RESULT {json}` line) in its own process, so one engine's GPU memory is gone before the next starts;
    returns that figure, or {"error": ...} with the process's last output when it failed or timed out."""
    import subprocess

    try:
        done = subprocess.run(
            [sys.executable, script, *figure_args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as expired:
        return {"error": f"timed out after {timeout_s} s", "tail": str(expired.stderr)[-2000:]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": (done.stderr or done.stdout)[-3000:]}
    return json.loads(lines[-1][len("RESULT ") :])


def random_prompts(rng, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` random token ids below 30,000 (every tokenizer here has them)."""
    return [[rng.randint(0, 30000) for _ in range(length)] for _ in range(n)]


def greedy_params(max_tokens: int):
    """Greedy sampling of exactly max_tokens tokens (eos ignored)."""
    from fitserve import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def timed_offline_run(llm, workload) -> tuple[int, float]:
    """(output tokens, seconds) of one offline run of a named workload (fitserve.bench.workloads), after
    an untimed pass that gives every prompt 2 tokens: Triton compiles a kernel variant the first time a
    shape class meets it (graph capture at startup covers the decode batches; this pass the prefill
    chunks and the mixed prefill + decode steps), and the prefix cache is reset after it."""
    from fitserve import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [
        SamplingParams(temperature=workload.temperature, max_tokens=r.max_tokens, ignore_eos=True)
        for r in workload.requests
    ]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs), elapsed


def save_sweep(
    workload: str, copy_bandwidth: float, sms: int, name: str, results: list, out: str | None
) -> dict:
    """save() for a kernel sweep: its results under `name` beside the run's copy bandwidth and SM count."""
    figures = {"copy_bandwidth_gb_per_s": round(copy_bandwidth / 1e9, 1), "sm_count": sms, name: results}
    return save(workload, figures, out)
