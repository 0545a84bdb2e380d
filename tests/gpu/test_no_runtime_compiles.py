"""After startup, requests compile no Triton kernel: a compile is a ~0.5 s stall for every stream in
flight. Startup compiles what the steps of every kind of request will launch (profile run, graph
capture, the sampler's warm-up); this serves a mix of requests and checks that no kernel gained a
compiled variant."""

from __future__ import annotations

import gc
import importlib
import pkgutil

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import fitserve.kernels as kernels_package  # noqa: E402
from fitserve import LLM, SamplingParams  # noqa: E402
from fitserve.kernels.fast_launch import FastLaunchKernel  # noqa: E402
from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR  # noqa: E402

pytestmark = pytest.mark.gpu


def _compiled_variants() -> dict[str, int]:
    """Kernel name -> how many variants Triton has compiled (its own cache, not fast_launch's)."""
    device = torch.cuda.current_device()
    counts = {}
    for module_info in pkgutil.iter_modules(kernels_package.__path__):
        module = importlib.import_module(f"fitserve.kernels.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, FastLaunchKernel):
                counts[f"{module_info.name}.{name}"] = len(value.function.device_caches[device][0])
    return counts


def test_a_mix_of_requests_compiles_nothing_after_startup() -> None:
    llm = LLM(
        str(MODELS_DIR / "qwen3-0.6b"),
        tokenizer=str(SMOLLM2_TOKENIZER_DIR),
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=32,
        gpu_memory_utilization=0.3,
    )
    before = _compiled_variants()
    lengths = [5, 16, 17, 100, 250, 256, 700]  # 1, 16 and more blocks of 16 (block table widths)
    prompts = [{"prompt_token_ids": [(7 * i + 3) % 40000 for i in range(n)]} for n in lengths]
    kinds = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05),
        SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, presence_penalty=0.5),
        SamplingParams(max_tokens=24, ignore_eos=True, min_tokens=10, temperature=0.5),
        SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=11),
    ]
    for params in kinds:
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts * 3, params, use_tqdm=False)  # 21 rows: past the skinny GEMM's 16
    llm.generate(prompts[:1], SamplingParams(max_tokens=300, ignore_eos=True), use_tqdm=False)  # batch 1
    after = _compiled_variants()
    del llm  # hand the KV cache back: later tests (test_plan_vs_measured) need the GPU's memory free
    gc.collect()
    torch.cuda.empty_cache()
    grew = {name: (before[name], after[name]) for name in after if after[name] != before[name]}
    assert not grew, f"kernels compiled after startup (variants before, after): {grew}"
