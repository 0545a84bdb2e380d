"""Int4 checkpoints through the whole engine (fitserve.LLM) and the planner.

(c) Greedy output of fitserve's LLM equals HF transformers loading the same checkpoint where HF can load it
    on this CPU (compressed-tensors, symmetric: transformers decompresses it through the compressed-tensors
    package). HF cannot load the others here: GPTQ and AutoRound need optimum + gptqmodel, AWQ needs
    gptqmodel, asymmetric pack-quantized fails in transformers' own loader (it expects an unpacked zero point
    and then unpacks it); for those the reference is the HF model holding the dequantized weights.
The planner counts an int4 checkpoint's stored bytes (packed codes, zeros, g_idx, scales) as stored.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve import LLM, SamplingParams
from fitserve.args import EngineArgs
from fitserve.planner.resolve import PlanRequest, plan_settings
from tests.quant_checkpoints import QuantSpec, write_quantized
from tests.unit.model_helpers import build_hf_model, tiny_hf_config

DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 77))]
NEW_TOKENS = 10


def greedy_hf(model: torch.nn.Module) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def greedy_fitserve(folder: Path, **kwargs) -> list[list[int]]:
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=8, **kwargs)
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("spec", [QuantSpec("ct", 32), QuantSpec("ct", -1)], ids=lambda spec: spec.name)
def test_greedy_matches_hf_loading_the_same_checkpoint(architecture, spec, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    hf_model = build_hf_model(tiny_hf_config(architecture, **DIMS), seed=7)
    checkpoint = write_quantized(tmp_path / spec.name, hf_model, spec)
    hf_quantized = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint.folder), dtype=torch.float32
    )
    expected = greedy_hf(hf_quantized.eval())
    assert greedy_fitserve(checkpoint.folder) == expected


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("gptq", 64, sym=False, act_order=True),
        QuantSpec("gptq", 128, act_order=True),
        QuantSpec("awq", 128, sym=False),
        QuantSpec("autoround", 32),
        QuantSpec("ct", 64, sym=False),
    ],
    ids=lambda spec: spec.name,
)
def test_greedy_matches_the_dequantized_model(spec, tmp_path, monkeypatch) -> None:
    if not spec.sym:
        # The C int4 kernel's float16 minimum (-z * scale) moves asymmetric logits by ~1e-3 relative
        # (test_quant_int4_formats.py bounds it), enough to flip a near-tie of a random tiny model: the
        # engine runs these dequantized at load (FITSERVE_CPU_INT4=0), symmetric ones on the kernel.
        monkeypatch.setenv("FITSERVE_CPU_INT4", "0")
    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **DIMS), seed=8)
    checkpoint = write_quantized(tmp_path / spec.name, hf_model, spec)
    quantization = {"gptq": "gptq", "awq": "awq", "autoround": "auto-round", "ct": "compressed-tensors"}[
        spec.fmt
    ]
    assert greedy_fitserve(checkpoint.folder, quantization=quantization) == greedy_hf(
        checkpoint.dequantized_model
    )


def test_plan_counts_the_stored_int4_bytes(tmp_path) -> None:
    from safetensors import safe_open

    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=9)
    spec = QuantSpec("gptq", 64, sym=False, act_order=True, ignore=("model.layers.1.mlp.down_proj",))
    folder = write_quantized(tmp_path / "gptq", hf_model, spec).folder
    stored = floats = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open has no iterator)
            tensor = handle.get_tensor(name)
            if name.endswith((".qweight", ".qzeros", ".g_idx", ".scales")):
                stored += tensor.numel() * tensor.element_size()
            else:
                floats += tensor.numel()
    fit = plan_settings(
        EngineArgs(model=str(folder), device="cpu", dtype="bfloat16"), PlanRequest(planning_only=True)
    )
    weights = fit.model.weights
    assert weights.checkpoint_quantization == "gptq"
    assert weights.stored_bytes == stored
    # the unquantized layers (embeddings, head, norms, the ignored down_proj) count in the model dtype
    assert weights.total_params == floats
    assert fit.plan.weights_bytes_per_gpu_before_offload == stored + 2 * floats
