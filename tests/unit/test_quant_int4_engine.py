"""Int4 checkpoints through the whole engine (fitserve.LLM) and the planner.

(c) Greedy output of fitserve's LLM equals HF transformers loading the same checkpoint where HF can load it
    on this CPU (compressed-tensors, symmetric: transformers decompresses it through the compressed-tensors
    package). HF cannot load the others here: GPTQ and AutoRound need optimum + gptqmodel, AWQ needs
    gptqmodel, asymmetric pack-quantized fails in transformers' own loader (it expects an unpacked zero point
    and then unpacks it); for those the reference is the HF model holding the dequantized weights.
The planner counts an int4 checkpoint's stored bytes (packed codes, zeros, g_idx, scales) as stored.
"""

from __future__ import annotations

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.planner.resolve import PlanRequest, plan_settings
from tests.quant_checkpoints import QuantSpec, write_quantized
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import DIMS, fitserve_llm, greedy_fitserve, greedy_hf


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
    assert greedy_fitserve(fitserve_llm(checkpoint.folder)) == expected


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
    got = greedy_fitserve(fitserve_llm(checkpoint.folder, quantization=quantization))
    assert got == greedy_hf(checkpoint.dequantized_model)


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
