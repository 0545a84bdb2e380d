"""Gemma-4 decode steps in CUDA graphs (run on the GPU machine): the sliding-window KV cache group's own
tables are staged beside the main ones (worker/cuda_graphs.py), the fused MoE and the windowed attention
replay without host decisions.

Cut models of the real geometries with a short window (64 tokens), so prompts and outputs run past it and
the sliding group's blocks behind the window are freed (the null block in their place): the greedy tokens
of the graph run must follow HF's fp32 argmax where its top-2 margin is clear of bf16 noise, as the eager
run's do, and the graphs must really have been captured (not skipped for the model).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.gpu.gemma4_cut_models import CLEAR_MARGIN, hf_logprobs, save_cut_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WINDOW = 64


def _hf_top2(folder: Path, token_ids: list[int]) -> torch.return_types.topk:
    return hf_logprobs(folder, token_ids).topk(2, dim=-1)


def _generate(folder: Path, prompts: list[list[int]], enforce_eager: bool) -> tuple[list[list[int]], bool]:
    from fitserve import LLM, SamplingParams

    llm = LLM(
        str(folder),
        max_model_len=1024,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
    )
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    captured = llm.engine.executor.runner.graph_runner is not None
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs], captured


@pytest.mark.parametrize(
    ("shape", "changes"),
    [
        ("gemma-4-26b-a4b-it", {}),  # MoE, K=V full layers, head dims 256 / 512
        ("gemma-4-e2b-it", {"num_kv_shared_layers": 3}),  # per-layer inputs, KV-shared layers
    ],
)
def test_graph_decode_past_the_window_follows_hf(shape, changes, tmp_path):
    folder = save_cut_model(shape, 8, tmp_path, sliding_window=WINDOW, **changes)
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(n)] for n in (20, 70, 150, 300, 41)]
    graph_tokens, captured = _generate(folder, prompts, enforce_eager=False)
    assert captured, "the decode steps ran eagerly: no CUDA graphs were captured for this model"
    eager_tokens, _ = _generate(folder, prompts, enforce_eager=True)
    clear_total = 0
    for prompt, graph, eager in zip(prompts, graph_tokens, eager_tokens):
        top2 = _hf_top2(folder, prompt + graph)
        reference = top2.indices[len(prompt) - 1 : -1, 0]
        values = top2.values[len(prompt) - 1 : -1]
        clear = (values[:, 0] - values[:, 1]) > CLEAR_MARGIN
        clear_total += int(clear.sum())
        agree = (torch.tensor(graph) == reference)[clear].float().mean().item()
        assert agree >= 0.95, f"graph run: greedy agreement {agree:.3f} on {int(clear.sum())} clear positions"
        # the eager run follows the same tokens until bf16 noise parts them at a near-tie
        same = next((i for i, (a, b) in enumerate(zip(graph, eager)) if a != b), len(graph))
        assert same == len(graph) or not clear[same], f"graph and eager part at a clear position {same}"
    assert clear_total >= 100, "too few clear positions to judge"
