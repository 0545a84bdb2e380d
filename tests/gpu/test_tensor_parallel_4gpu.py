"""Tensor parallel on four GPUs (NCCL): greedy tokens against HF's fp32 forward on the same random weights.

Gemma-4's 31B and 26B-A4B geometries cut to 6 layers (31B: 16 / 4 KV heads, so each rank keeps 4 sliding
and 1 full KV head; 26B-A4B: 2 KV heads on its full layers, replicated across 4 ranks; 128 experts split
by their width, or whole with expert parallelism), within the window (the CUDA kernels have none yet), and
Llama-3.1-8B's cut to 4 layers with CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.gpu.gemma4_cut_models import CLEAR_MARGIN
from tests.gpu.gemma4_cut_models import hf_logprobs as _hf_gemma4_logprobs
from tests.gpu.gemma4_cut_models import save_cut_model as _save_cut_model
from tests.gpu.test_engine_gpu import _greedy, _prompts, _save_random_model
from tests.gpu.test_engine_gpu import _hf_logprobs as _hf_causal_lm_logprobs
from tests.gpu.test_gemma4_gpu import _llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs"),
]


def _agreement(
    reference_logprobs, prompt: list[int], token_ids: list[int], min_clear: int
) -> tuple[float, int]:
    """Greedy agreement with HF's fp32 argmax where its top-2 margin is clear of bf16 noise."""
    reference = reference_logprobs(prompt + token_ids)[len(prompt) - 1 : -1]
    top2 = reference.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
    assert clear.sum() >= min_clear, "too few clear positions to judge"
    agree = (torch.tensor(token_ids) == top2.indices[:, 0])[clear].float().mean().item()
    return agree, int(clear.sum())


@pytest.mark.parametrize(
    ("shape", "expert_parallel", "agreement"),
    [
        ("gemma-4-31b-it", False, 0.99),
        ("gemma-4-26b-a4b-it", False, 0.95),
        ("gemma-4-26b-a4b-it", True, 0.95),
    ],
    ids=["31b", "26b-a4b", "26b-a4b-expert-parallel"],
)
def test_gemma4_tp4_greedy_matches_hf(shape, expert_parallel, agreement, tmp_path):
    from fitserve import SamplingParams

    folder = _save_cut_model(shape, 6, tmp_path)
    prompt = [random.Random(0).randrange(49152) for _ in range(300)]
    llm = _llm(folder, tensor_parallel_size=4, enable_expert_parallel=expert_parallel)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    agree, clear = _agreement(lambda ids: _hf_gemma4_logprobs(folder, ids), prompt, list(out.token_ids), 40)
    assert agree >= agreement, f"TP 4 greedy agreement {agree:.3f} < {agreement} on {clear} positions"


def test_llama_tp4_greedy_matches_hf_with_graphs(tmp_path):
    folder = _save_random_model("llama-3.1-8b", tmp_path, 4)
    prompts = _prompts(4)
    llm = _llm(folder, tensor_parallel_size=4)
    outs = _greedy(llm, prompts)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    for prompt, out in zip(prompts[:2], outs[:2]):
        reference = lambda ids: _hf_causal_lm_logprobs(folder, ids, torch.float32)  # noqa: E731
        agree, clear = _agreement(reference, prompt, list(out.token_ids), 50)
        assert agree >= 0.99, f"TP 4 greedy agreement {agree:.3f} < 0.99 on {clear} positions"
