"""Gemma-4 on the CUDA engine against HF transformers (run on the GPU machine).

The real geometries from shared/models cut to a few layers (26B-A4B: head dims 256 / 512, K=V full layers,
128 experts top-8; 31B: 16 / 4 KV heads; E2B: KV-shared layers, window 512), bf16, random weights saved as
safetensors. Contexts within the sliding window (1,024) and past it (the Triton kernels mask the window and
skip the blocks behind it), and KV-shared layers reading an earlier layer's cache.
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


def _llm(folder: Path, **kwargs):
    from fitserve import LLM

    kwargs.setdefault("gpu_memory_utilization", 0.5)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(str(folder), **kwargs)


def _greedy_agreement(folder: Path, prompt_len: int, **llm_kwargs) -> tuple[float, int]:
    """Greedy fitserve tokens against HF's top-1 over the positions whose top-2 gap is clear: (agreement,
    number of clear positions)."""
    from fitserve import SamplingParams

    prompt = [random.Random(0).randrange(49152) for _ in range(prompt_len)]
    llm = _llm(folder, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    del llm
    torch.cuda.empty_cache()
    reference = hf_logprobs(folder, prompt + out.token_ids)[len(prompt) - 1 : -1]
    top2 = reference.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
    agree = (torch.tensor(out.token_ids) == top2.indices[:, 0])[clear].float().mean().item()
    return agree, int(clear.sum())


@pytest.mark.parametrize(("shape", "agreement"), [("gemma-4-26b-a4b-it", 0.95), ("gemma-4-31b-it", 0.99)])
@pytest.mark.parametrize(
    ("prompt_len", "max_model_len"),
    [(300, 1024), (1500, 2048)],  # within the window of 1,024; past it
)
def test_greedy_matches_hf(shape, agreement, prompt_len, max_model_len, tmp_path):
    """Past the window, steps of at most 512 tokens: the prompt runs in 3 chunks, and the sliding layers
    get a KV cache group of their own (kv_groups.py), whose tables hold the null block behind the window."""
    folder = save_cut_model(shape, 6, tmp_path)
    kwargs = {"max_model_len": max_model_len}
    if max_model_len > 1024:
        kwargs["max_num_batched_tokens"] = 512
    agree, clear = _greedy_agreement(folder, prompt_len, **kwargs)
    assert clear >= 40, "too few clear positions to judge"
    assert agree >= agreement, f"greedy agreement {agree:.3f} < {agreement} on {clear} positions"


def test_kv_shared_layers_match_hf_past_the_window(tmp_path):
    """E2B-like: the last 5 of 10 layers read layers 3's (sliding, window 512) and 4's (full) caches; a
    700-token prompt (2 chunks of at most 512: the sliding layers get a KV cache group of their own) and
    200 tokens take every context past the window."""
    folder = save_cut_model("gemma-4-e2b-it", 10, tmp_path, num_kv_shared_layers=5)
    agree, clear = _greedy_agreement(folder, 700, max_model_len=2048, max_num_batched_tokens=512)
    assert clear >= 40, "too few clear positions to judge"
    assert agree >= 0.95, f"greedy agreement {agree:.3f} < 0.95 on {clear} positions"


def test_ngram_speculation_past_the_window_follows_the_plain_engine(tmp_path):
    """E2B-like with KV-shared layers, the sliding layers in a KV cache group of their own (window 512,
    max_model_len 2,048): n-gram drafts verified in decode-shaped steps (CUDA graphs) give the plain
    engine's greedy tokens where its top-2 gap is clear, on prompts that repeat themselves (drafts found)."""
    from fitserve import SamplingParams

    folder = save_cut_model("gemma-4-e2b-it", 10, tmp_path, num_kv_shared_layers=5)
    rng = random.Random(1)
    motif = [rng.randrange(49152) for _ in range(40)]
    prompts = [motif * 16 + [rng.randrange(49152) for _ in range(60)] for _ in range(3)]  # 700 tokens
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True, logprobs=2)
    kwargs = {"max_model_len": 2048, "max_num_batched_tokens": 512}
    runs = []
    for speculative in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}):
        llm = _llm(folder, speculative_config=speculative, **kwargs)
        assert len(llm.engine.config.kv_groups) == 2
        runs.append([o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)])
        if speculative:
            assert llm.engine.speculator.stats.num_accepted_tokens > 0
        del llm
        torch.cuda.empty_cache()
    for plain, spec in zip(*runs, strict=True):
        for position, (want, have) in enumerate(zip(plain.token_ids, spec.token_ids)):
            if want == have:
                continue
            top = sorted(plain.logprobs[position].values(), key=lambda lp: -lp.logprob)
            assert top[0].logprob - top[1].logprob < CLEAR_MARGIN, f"left the plain run at {position}"
            break
