"""Tensor parallel on two GPUs (NCCL): greedy tokens and logprobs against HF's fp32 forward on the same
random weights, with CUDA graphs and without; the engine stops with the rank named when one dies."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.gpu.test_engine_gpu import CLEAR_MARGIN, _greedy, _hf_logprobs, _llm, _prompts, _save_random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module", params=[("qwen3-0.6b", None), ("llama-3.1-8b", 4)], ids=["qwen3", "llama"])
def model_folder(request, tmp_path_factory):
    shape, layers = request.param
    return _save_random_model(shape, tmp_path_factory.mktemp("tp_models"), layers)


def _agreement(folder, prompt, out) -> float:
    sequence = prompt + out.token_ids
    reference = _hf_logprobs(folder, sequence, torch.float32)[len(prompt) - 1 : -1]
    top2 = reference.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
    assert clear.sum() >= 50, "too few clear positions to judge"
    return (torch.tensor(out.token_ids) == top2.indices[:, 0])[clear].float().mean().item()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tp2_greedy_matches_hf(model_folder, enforce_eager):
    prompts = _prompts(4)
    llm = _llm(model_folder, tensor_parallel_size=2, enforce_eager=enforce_eager)
    outs = _greedy(llm, prompts)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    for prompt, out in zip(prompts[:2], outs[:2]):
        agree = _agreement(model_folder, prompt, out)
        assert agree >= 0.99, f"TP 2 greedy agreement {agree:.3f} < 0.99"


def test_a_dead_rank_stops_the_engine_with_its_rank(model_folder):
    from fitserve import SamplingParams
    from fitserve.worker.rank_failure import RankFailedError

    llm = _llm(model_folder, tensor_parallel_size=2)
    executor = llm.engine.executor
    os.kill(executor.ranks[0].process.pid, signal.SIGKILL)
    started = time.perf_counter()
    with pytest.raises(RankFailedError, match="tensor-parallel rank 1 failed: its process exited"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=64), use_tqdm=False)
    assert time.perf_counter() - started < 60
