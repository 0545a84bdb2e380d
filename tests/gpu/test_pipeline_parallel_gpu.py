"""Pipeline parallel on two GPUs (NCCL send/recv between the stages): greedy tokens against HF's fp32
forward on the same random weights, against PP 1 on the same engine settings, the per-stage KV pool, and
the engine stopping with the rank named when a stage dies. TP 2 x PP 2 runs where four GPUs are.

  python -m pytest -q tests/gpu/test_pipeline_parallel_gpu.py   (nvidia-h100-x2; the TP 2 x PP 2 case
  skips unless four GPUs are visible)
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.gpu.test_engine_gpu import _greedy, _llm, _prompts, _save_random_model
from tests.gpu.test_tensor_parallel_gpu import _agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.fixture(scope="module", params=[("qwen3-0.6b", None), ("llama-3.1-8b", 5)], ids=["qwen3", "llama"])
def model_folder(request, tmp_path_factory):
    """Qwen3-0.6B's shape (28 layers, tied head: the last stage holds the embedding too) and 5 layers of
    Llama-3.1-8B's (an uneven split: 3 + 2)."""
    shape, layers = request.param
    return _save_random_model(shape, tmp_path_factory.mktemp("pp_models"), layers)


def _release(engines: dict) -> None:
    """Stops the engine held in engines["llm"] and gives its GPU memory back: the dict holds the only
    reference (a name in the test's frame would keep the engine alive through the HF reference after it;
    on 4x H100 that reference ran out of memory)."""
    import gc

    engines.pop("llm").engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def test_pp2_greedy_matches_hf_and_pp1(model_folder):
    prompts = _prompts(4)
    engines = {"llm": _llm(model_folder, enforce_eager=True)}
    expected = _greedy(engines["llm"], prompts)
    blocks_one = engines["llm"].engine.memory_plan.num_kv_blocks
    _release(engines)
    engines["llm"] = _llm(model_folder, pipeline_parallel_size=2)
    assert engines["llm"].engine.executor.runner.graph_runner is None  # stages run eagerly
    got = _greedy(engines["llm"], prompts)
    # each rank holds about half the weights and half the KV per token: more blocks fit
    blocks_two = engines["llm"].engine.memory_plan.num_kv_blocks
    _release(engines)
    assert blocks_two > blocks_one
    for prompt, out in zip(prompts[:2], got[:2]):
        agree = _agreement(model_folder, prompt, out)
        assert agree >= 0.99, f"PP 2 greedy agreement {agree:.3f} < 0.99"
    # the same kernels over the same batches as PP 1 eager: the hidden states cross the stages unchanged
    identical = sum(ours.token_ids == theirs.token_ids for ours, theirs in zip(got, expected))
    assert identical >= 3, f"only {identical} of 4 prompts give PP 1's tokens"


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
def test_tp2_x_pp2_greedy_matches_hf(model_folder):
    prompts = _prompts(2)
    engines = {"llm": _llm(model_folder, tensor_parallel_size=2, pipeline_parallel_size=2)}
    outs = _greedy(engines["llm"], prompts)
    _release(engines)
    for prompt, out in zip(prompts, outs):
        agree = _agreement(model_folder, prompt, out)
        assert agree >= 0.99, f"TP 2 x PP 2 greedy agreement {agree:.3f} < 0.99"


def test_a_dead_stage_stops_the_engine_with_its_rank(model_folder):
    from fitserve import SamplingParams
    from fitserve.worker.rank_failure import RankFailedError

    llm = _llm(model_folder, pipeline_parallel_size=2)
    executor = llm.engine.executor
    os.kill(executor.ranks[0].process.pid, signal.SIGKILL)
    started = time.perf_counter()
    with pytest.raises(RankFailedError, match=r"rank 1 \(pipeline stage 1, tensor-parallel rank 0\) failed"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=64), use_tqdm=False)
    assert time.perf_counter() - started < 60
    llm.engine.shutdown()
