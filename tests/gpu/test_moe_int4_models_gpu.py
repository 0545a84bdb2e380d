"""Int4 MoE checkpoints of Qwen3.5 / Qwen3.6 MoE and Gemma-4 MoE on CUDA (run on the GPU machine): the tiny
models of tests/unit/test_qwen3_5_moe_int4.py (AWQ: int4 experts one tensor set per expert, int4 shared
expert, attention and DeltaNet) and tests/unit/test_gemma4_moe_int4.py (AWQ: int4 experts beside the int4
dense MLP) in bfloat16, against the float32 CPU engine on the same checkpoint (which those files check
against transformers): greedy tokens agree where the CPU engine's top-2 margin is clear of bf16 noise, with
CUDA graphs (the decode-sized int4 MoE kernels, kernels/moe_int4_decode.py), eagerly with chunked prompts
(the grouped int4 kernels), and at TP 2 with expert parallel where two GPUs exist."""

from __future__ import annotations

import pytest
import torch

from tests.gpu import test_qwen3_5_gpu as base

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RUNS = {
    "graphs": {},
    "eager-chunked": {"enforce_eager": True, "max_num_batched_tokens": 16, "max_num_seqs": 4},
    "tp2-expert-parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.unit import test_gemma4_moe_int4, test_qwen3_5_moe_int4

    qwen, gemma = (str(tmp_path_factory.mktemp(name)) for name in ("qwen35moe_int4", "gemma4moe_int4"))
    return {
        "qwen3.5-moe": test_qwen3_5_moe_int4.checkpoint("awq", qwen)[0],
        "gemma4-moe": test_gemma4_moe_int4.checkpoint("awq", gemma)[0],
    }


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("model", ["qwen3.5-moe", "gemma4-moe"])
def test_greedy_follows_the_cpu_engine(folders, model, run):
    from fitserve import LLM, SamplingParams

    folder = folders[model]
    settings = RUNS[run]
    if settings.get("tensor_parallel_size", 1) > torch.cuda.device_count():
        pytest.skip("needs two CUDA GPUs")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (12, 40, 25)]
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3, **settings)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    clear_total = 0
    for prompt, output in zip(prompts[:2], outputs[:2], strict=True):
        tokens = list(output.outputs[0].token_ids)
        best, margins = base._cpu_reference(folder, prompt + tokens, len(prompt))
        clear = margins > base.CLEAR_MARGIN
        clear_total += int(clear.sum())
        agree = (torch.tensor(tokens) == torch.tensor(best))[clear].float().mean().item()
        wanted = base.wanted_agreement(moe=True)
        assert agree >= wanted, f"{run}: agreement {agree:.3f} < {wanted} on {int(clear.sum())} clear tokens"
    assert clear_total >= 20, "too few clear positions to judge"
