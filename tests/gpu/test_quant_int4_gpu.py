"""Int4 checkpoints on the GPU: every quantized layer runs fitserve's Triton int4 GEMM (repacked at load),
and the model's prompt logprobs match the HF model holding the dequantized weights (float32, CPU).

Tolerance: 0.1 nats on each prompt token's logprob (bfloat16 activations through a 2-layer model whose
logprobs are ~-6; a wrong group, nibble or zero point moves them by whole nats).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve import LLM, SamplingParams  # noqa: E402
from fitserve.layers.quantization.int4_method import Int4LinearMethod  # noqa: E402
from tests.quant_checkpoints import QuantSpec, write_quantized  # noqa: E402
from tests.unit.model_helpers import build_hf_model, tiny_hf_config  # noqa: E402

DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPT = list(range(40, 90))
METHOD = {"gptq": "gptq", "awq": "awq", "autoround": "auto-round", "ct": "compressed-tensors"}


def hf_prompt_logprobs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("gptq", 128),
        QuantSpec("gptq", 64, sym=False, act_order=True),
        QuantSpec("awq", 128, sym=False),
        QuantSpec("ct", 32),
        QuantSpec("ct", -1),
    ],
    ids=lambda spec: spec.name,
)
def test_int4_checkpoint_runs_the_triton_kernel_and_matches_the_dequantized_model(spec, tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **DIMS), seed=11)
    checkpoint = write_quantized(tmp_path / spec.name, hf_model, spec)
    llm = LLM(
        str(checkpoint.folder),
        dtype="bfloat16",
        quantization=METHOD[spec.fmt],
        max_model_len=256,
        gpu_memory_utilization=0.3,
    )
    methods = [
        module.linear_method
        for module in llm.engine.executor.runner.model.modules()
        if isinstance(getattr(module, "linear_method", None), Int4LinearMethod)
    ]
    assert methods and {method.path for method in methods} == {"triton-int4"}
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    got = torch.tensor([output.prompt_logprobs[i][token].logprob for i, token in enumerate(PROMPT) if i > 0])
    expected = hf_prompt_logprobs(checkpoint.dequantized_model.float().eval())
    assert (got - expected).abs().max().item() < 0.1
