"""Qwen3.5 hybrids under tensor parallel on two GPUs (NCCL; run on the GPU machine): the small random
Qwen3.5 of tests/gpu/test_qwen3_5_gpu.py (2 DeltaNet key heads serving 4 value heads, 4 attention heads
on 2 KV heads: one of each per rank) and a MoE of the same shape with 8 experts, in bf16 at TP 2, against
the float32 CPU engine at TP 1 on the same weights: greedy tokens agree where the CPU engine's top-2
margin is clear of bf16 noise, with CUDA graphs and eagerly, whole and chunked prompts; the MoE also with
--enable-expert-parallel; a second turn resumes from the first's state snapshot and answers as a cold run.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tests.gpu import test_qwen3_5_gpu as base

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

CLEAR_MARGIN = base.CLEAR_MARGIN
checkpoint = base.checkpoint  # the module fixture: the dense small Qwen3.5


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5MoeTextConfig"):
        pytest.skip("this transformers has no Qwen3.5 MoE")
    from tests.model_folders import save_with_tokenizer
    from tests.unit import qwen3_5_helpers as helpers

    text = dict(helpers.TEXT, vocab_size=4096, hidden_size=256, num_hidden_layers=6)
    text.update(
        head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=4096
    )
    text["layer_types"] = (
        ["linear_attention"] * 2 + ["full_attention"] + ["linear_attention"] * 2 + ["full_attention"]
    )
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[8, 4, 4])
    moe = {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "shared_expert_intermediate_size": 256,
    }
    config = transformers.Qwen3_5MoeTextConfig(**text, **moe)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    model = helpers.build_hf(config).to(torch.bfloat16)
    return save_with_tokenizer(model, tmp_path_factory.mktemp("qwen35moe"))


def _run(folder: Path, turns, **kwargs) -> tuple[list[list[list[int]]], int]:
    """Each turn (prompts, max_tokens, or a function of the earlier turns' tokens giving them) by one TP 2
    engine; the tokens of each turn and the prefix-cache hits. The engine is shut down and freed."""
    from fitserve import LLM

    kwargs.setdefault("max_num_seqs", 8)
    llm = LLM(
        str(folder),
        tensor_parallel_size=2,
        max_model_len=2048,
        gpu_memory_utilization=0.4,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
        **kwargs,
    )
    tokens = []
    for turn in turns:
        prompts, max_tokens = turn(tokens) if callable(turn) else turn
        tokens.append(base._greedy(llm, prompts, max_tokens))
    hits = llm.engine.get_stats().prefix_cache_hits
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, hits


def _assert_follows_the_cpu_engine(folder: Path, prompts, outputs, moe: bool) -> None:
    wanted = base.wanted_agreement(moe)
    clear_total = 0
    for prompt, output in zip(prompts[:2], outputs[:2]):
        best, margins = base._cpu_reference(folder, prompt + output, len(prompt))
        clear = margins > CLEAR_MARGIN
        clear_total += int(clear.sum())
        agree = (torch.tensor(output) == torch.tensor(best))[clear].float().mean().item()
        assert agree >= wanted, (
            f"TP 2 greedy agreement {agree:.3f} < {wanted} on {int(clear.sum())} clear positions"
        )
    assert clear_total >= 20, "too few clear positions to judge"


CASES = {
    "dense-graphs": ("dense", False, 8192, False),
    "dense-eager-chunked": ("dense", False, 96, True),
    "moe-graphs": ("moe", False, 8192, False),
    "moe-expert-parallel-chunked": ("moe", True, 96, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_follows_the_cpu_engine(checkpoint, moe_checkpoint, case):
    model, expert_parallel, batched, eager = CASES[case]
    folder = checkpoint if model == "dense" else moe_checkpoint
    prompts = base._prompts(4)
    (outputs,), _ = _run(
        folder,
        [(prompts, 160)],
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=batched,
        enforce_eager=eager,
    )
    _assert_follows_the_cpu_engine(folder, prompts, outputs, moe=model == "moe")


def test_tp2_second_turn_resumes_from_the_snapshot(checkpoint):
    first = base._prompts(1)[0]

    def second(done):
        return [first + done[0][0] + [7, 8, 9, 10, 11]], 48

    warm, hits = _run(checkpoint, [([first], 40), second])
    assert hits >= 16 * ((len(first) - 1) // 16), f"{hits} prefix-cache hits on the second turn"
    prompt = second(warm)[0][0]
    (cold,), _ = _run(checkpoint, [([prompt], 48)], enable_prefix_caching=False)
    got, want = warm[1][0], cold[0]
    if got != want:  # bf16 sums of a resumed state differ from a whole pass: only at a near-tie
        step = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        _, margins = base._cpu_reference(checkpoint, prompt + want, len(prompt))
        assert margins[step] < CLEAR_MARGIN, (
            f"diverged at step {step} where the margin was {margins[step]:.3f}"
        )
