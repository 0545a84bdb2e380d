"""Qwen3.5 hybrids on the CUDA engine (run on the GPU machine): a small random Qwen3.5 (head dims 128, as
the released models; 4 DeltaNet and 2 full-attention layers), and its MoE form (16 experts, top 4, and the
shared expert), in bf16 against the CPU engine in float32 on the same weights (the CPU engine is checked
against HF transformers in tests/unit/test_qwen3_5_*.py).

The checkpoint: FITSERVE_QWEN35_CHECKPOINT names a saved one, else it is built with transformers' Qwen3.5
classes (skipped when this transformers has none).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CLEAR_MARGIN = 0.5  # as tests/gpu/test_engine_gpu.py: bf16 noise flips closer top-2 logits either way


def _build_checkpoint(tmp_path_factory, moe: bool) -> Path:
    transformers = pytest.importorskip("transformers")
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    if not hasattr(transformers, f"{family}TextConfig"):
        pytest.skip(f"this transformers has no {family} and FITSERVE_QWEN35_CHECKPOINT is unset")
    from tests.model_folders import save_with_tokenizer
    from tests.unit import qwen3_5_helpers as helpers

    text = dict(helpers.TEXT, vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6)
    text.update(
        head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=4096
    )
    text["layer_types"] = (
        ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2 + ["full_attention"]
    )
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[8, 4, 4])
    if moe:  # 16 experts, top 4, beside the shared expert (the fused MoE, the router and gate kernels)
        text.update(
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=256,
        )
    config = getattr(transformers, f"{family}TextConfig")(**text)
    config.architectures = [f"{family}ForCausalLM"]
    model = helpers.build_hf(config).to(torch.bfloat16)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("qwen35moe" if moe else "qwen35"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    given = os.environ.get("FITSERVE_QWEN35_CHECKPOINT")
    if given:
        return Path(given)
    return _build_checkpoint(tmp_path_factory, moe=False)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    return _build_checkpoint(tmp_path_factory, moe=True)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4096) for _ in range(rng.randint(70, 300))] for _ in range(n)]


def _greedy(llm, prompts, max_tokens: int) -> list[list[int]]:
    from fitserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def wanted_agreement(moe: bool) -> float:
    """The share of clear positions greedy decoding must agree on. MoE: a router near-tie in bfloat16 picks
    another expert, which can move a clear margin (as tests/gpu/test_gemma4_gpu.py's 26B-A4B);
    test_qwen3_5_fused_gpu.py checks the block's kernels."""
    return 0.95 if moe else 0.99


def _cpu_reference(checkpoint: Path, sequence: list[int], prompt_len: int) -> tuple[list[int], torch.Tensor]:
    """The float32 CPU engine's argmax and top-2 margin at each position after the prompt."""
    from fitserve import LLM, SamplingParams

    length = len(sequence) + 1  # within the tiny models' own limits (512 for the int4 MoE ones)
    llm = LLM(
        str(checkpoint), device="cpu", dtype="float32", max_model_len=length, enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    entries = llm.generate([{"prompt_token_ids": sequence}], params, use_tqdm=False)[0].prompt_logprobs
    llm.engine.shutdown()
    best, margins = [], []
    for position in range(prompt_len, len(sequence)):
        ranked = sorted(entries[position].items(), key=lambda item: item[1].logprob, reverse=True)
        best.append(ranked[0][0])
        margins.append(ranked[0][1].logprob - ranked[1][1].logprob)
    return best, torch.tensor(margins)


@pytest.mark.parametrize(
    ("moe", "max_num_batched_tokens"),
    [(False, 8192), (False, 96), (True, 8192)],
    ids=["whole-prompts", "chunked", "moe"],
)
def test_greedy_matches_the_cpu_engine(request, moe, max_num_batched_tokens):
    from fitserve import LLM

    checkpoint = request.getfixturevalue("moe_checkpoint" if moe else "checkpoint")
    prompts = _prompts(4)
    llm = LLM(
        str(checkpoint),
        max_model_len=2048,
        gpu_memory_utilization=0.4,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=8,
    )
    outputs = _greedy(llm, prompts, 240)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    for prompt, output in zip(prompts[:2], outputs[:2]):
        best, margins = _cpu_reference(checkpoint, prompt + output, len(prompt))
        clear = margins > CLEAR_MARGIN
        agree = (torch.tensor(output) == torch.tensor(best))[clear].float().mean().item()
        assert clear.sum() >= 20, "too few clear positions to judge"
        wanted = wanted_agreement(moe)
        assert agree >= wanted, (
            f"greedy agreement {agree:.3f} < {wanted} on {int(clear.sum())} clear positions"
        )


def test_a_second_turn_reuses_the_first_and_answers_as_a_cold_run(checkpoint):
    from fitserve import LLM

    first = _prompts(1)[0]
    llm = LLM(str(checkpoint), max_model_len=2048, gpu_memory_utilization=0.4)
    reply = _greedy(llm, [first], 40)[0]
    second = first + reply + [7, 8, 9, 10, 11]
    warm = _greedy(llm, [second], 40)[0]
    hits = llm.engine.get_stats().prefix_cache_hits
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    assert hits >= 16 * ((len(first) - 1) // 16)
    cold_llm = LLM(
        str(checkpoint), max_model_len=2048, gpu_memory_utilization=0.4, enable_prefix_caching=False
    )
    cold = _greedy(cold_llm, [second], 40)[0]
    cold_llm.engine.shutdown()
    if warm != cold:  # bf16 sums of a resumed state differ from a whole pass: only at a near-tie
        step = next(i for i, (a, b) in enumerate(zip(warm, cold)) if a != b)
        _, margins = _cpu_reference(checkpoint, second + cold, len(second))
        assert margins[step] < CLEAR_MARGIN, (
            f"diverged at step {step} where the margin was {margins[step]:.3f}"
        )
