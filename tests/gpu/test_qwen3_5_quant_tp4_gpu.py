"""Issue 34's int4 hybrid at TP 4 on four GPUs (NCCL), on saved weights instead of dummy ones.

The tiny AWQ-INT4 Qwen3.5 of tests/unit/test_qwen3_5_quant_tp.py's TP 4 case (4 DeltaNet key heads
serving 8 value heads: one key head a rank; the full layers' 2 KV heads each on two ranks), hidden size
raised to 256 so each rank's row-parallel input spans whole int4 groups on the GPU kernels' tiles: bf16 at
TP 4 with CUDA graphs against the float32 CPU engine at TP 1 on the same checkpoint. Greedy tokens agree
where the CPU engine's top-2 margin is clear of bf16 noise, and the first token's logprob is close.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_qwen3_5_gpu import CLEAR_MARGIN, _cpu_reference
from tests.quant_checkpoints import QuantSpec
from tests.unit.qwen3_5_quant_helpers import SMALL, build_model, write_int4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs"),
]


def test_awq_int4_tp4_follows_the_cpu_engine(tmp_path):
    from fitserve import LLM, SamplingParams

    hf_model = build_model(
        conditional=False,
        seed=15,
        hidden_size=256,
        intermediate_size=512,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        max_position_embeddings=4096,  # the CPU reference runs at max_model_len 2048
    )
    folder = write_int4(tmp_path, hf_model, QuantSpec("awq", 32, sym=False, ignore=SMALL)).folder
    prompts = [[(7 * i + 3 * j) % 200 + 5 for j in range(48 + 16 * i)] for i in range(4)]
    llm = LLM(
        str(folder),
        tensor_parallel_size=4,
        max_model_len=1024,
        gpu_memory_utilization=0.3,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4]},
    )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.shutdown()
    clear_total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        best, margins = _cpu_reference(folder, prompt + tokens, len(prompt))
        clear = margins > CLEAR_MARGIN
        clear_total += int(clear.sum())
        agree = (torch.tensor(tokens) == torch.tensor(best))[clear].float().mean().item()
        assert agree >= 0.99, f"TP 4 int4 greedy agreement {agree:.3f} on {int(clear.sum())} clear positions"
    assert clear_total >= 20, f"only {clear_total} clear positions to judge"
