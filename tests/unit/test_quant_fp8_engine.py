"""FP8 through the whole engine (fitserve.LLM) and the planner, on the CPU (weight-only: exact fp8 weights,
float32 activations):

(c) Greedy output equals HF transformers loading the same compressed-tensors checkpoint (weight-only
    schemes: transformers decompresses them through the compressed-tensors package; for W8A8 ones HF fake-
    quantizes activations, which the CPU path does not) and equals the HF model holding the dequantized
    weights for every format, quant_method fp8 included (transformers needs accelerate and a GPU for it).
(d) `--quantization fp8` on a bf16 checkpoint: each projection quantized per channel while loading
    (held as float8_e4m3fn), greedy output equal to the HF model holding those per-channel fp8 weights.
(e) --load-format dummy with an fp8 config or --quantization fp8: random fp8 weights, finite tokens,
    reproducible for a seed.
(f) The planner counts fp8 bytes: a checkpoint's fp8 weights and scales as stored, --quantization fp8 as 1
    byte a weight + a float32 scale per output row, exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.layers.quantization.fp8_method import Fp8LinearMethod
from fitserve.planner.resolve import PlanRequest, plan_settings
from tests.fp8_checkpoints import Fp8Spec, quantization_config, quantize, write_bf16, write_fp8
from tests.model_folders import write_config_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import DIMS, NEW_TOKENS, fitserve_llm, greedy_fitserve, greedy_hf, model_of


def run_llm(folder: Path, **kwargs) -> tuple[list[list[int]], list[Fp8LinearMethod]]:
    llm = fitserve_llm(folder, **kwargs)
    tokens = greedy_fitserve(llm)
    methods = [
        m.linear_method
        for m in model_of(llm).modules()
        if isinstance(getattr(m, "linear_method", None), Fp8LinearMethod)
    ]
    return tokens, methods


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize(
    "spec",
    [Fp8Spec("ct", "channel", "none"), Fp8Spec("ct", "block", "none"), Fp8Spec("ct", "tensor", "none")],
    ids=lambda spec: spec.name,
)
def test_greedy_matches_hf_loading_the_same_checkpoint(architecture, spec, tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    hf_model = build_hf_model(tiny_hf_config(architecture, **DIMS), seed=7)
    checkpoint = write_fp8(tmp_path / spec.name, hf_model, spec)
    hf_fp8 = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint.folder), dtype=torch.float32)
    expected = greedy_hf(hf_fp8.eval())
    assert expected == greedy_hf(checkpoint.dequantized_model)  # HF's decompression is our reference
    got, methods = run_llm(checkpoint.folder)
    assert got == expected
    assert len(methods) == 2 * 4 and all(m.path == "weight-only" for m in methods)


@pytest.mark.parametrize(
    "spec",
    [
        Fp8Spec("ct", "channel", "dynamic"),
        Fp8Spec("ct", "tensor", "static", ignore=("model.layers.0.mlp.down_proj",)),
        Fp8Spec("hf", "block", "dynamic", block=(128, 128)),
        Fp8Spec("hf", "tensor", "static"),
    ],
    ids=lambda spec: spec.name,
)
def test_greedy_matches_the_dequantized_model(spec, tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **DIMS), seed=8)
    checkpoint = write_fp8(tmp_path / spec.name, hf_model, spec)
    flag = "fp8" if spec.fmt == "hf" else "compressed-tensors"
    got, methods = run_llm(checkpoint.folder, quantization=flag)
    assert got == greedy_hf(checkpoint.dequantized_model)
    assert len(methods) == 2 * 4 - len(spec.ignore)


def test_quantization_fp8_quantizes_a_bf16_checkpoint_while_loading(tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=9)
    folder = write_bf16(tmp_path / "bf16", hf_model)
    reference = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=9)
    with torch.no_grad():  # the per-channel fp8 weights fitserve should hold, from the bf16 values
        for name, param in reference.named_parameters():
            param.copy_(param.to(torch.bfloat16).float())
            if name.endswith("_proj.weight"):
                param.copy_(quantize(param, Fp8Spec("ct", "channel"))[2])
    got, methods = run_llm(folder, quantization="fp8")
    assert len(methods) == 2 * 4
    for method in methods:
        assert method.fmt.quantize_on_load and method.path == "weight-only"
    assert got == greedy_hf(reference.eval())


def config_folder(folder: Path, quantization: dict | None) -> Path:
    config = tiny_hf_config("Qwen3ForCausalLM", **DIMS).to_dict()
    if quantization is not None:
        config["quantization_config"] = quantization
    return write_config_with_tokenizer(folder, config)


@pytest.mark.parametrize(
    ("quantization", "flag"),
    [
        (quantization_config(Fp8Spec("hf", "block", "dynamic", block=(128, 128))), None),
        (quantization_config(Fp8Spec("ct", "tensor", "static")), None),
        (None, "fp8"),
    ],
    ids=["hf-block", "ct-tensor-static", "flag"],
)
def test_dummy_fp8_weights_generate_reproducibly(quantization, flag, tmp_path) -> None:
    folder = config_folder(tmp_path / "dummy", quantization)
    first, methods = run_llm(folder, load_format="dummy", quantization=flag, seed=3)
    again, _ = run_llm(folder, load_format="dummy", quantization=flag, seed=3)
    assert first == again and all(len(tokens) == NEW_TOKENS for tokens in first)
    assert len(methods) == 2 * 4 and all(m.path == "weight-only" for m in methods)


def test_plan_counts_fp8_checkpoint_bytes_as_stored(tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=10)
    spec = Fp8Spec("hf", "block", "dynamic", block=(128, 128), ignore=("model.layers.1.mlp.down_proj",))
    checkpoint = write_fp8(tmp_path / "fp8", hf_model, spec)
    stored = sum(
        t.numel() * t.element_size()
        for name, t in checkpoint.tensors.items()
        if t.dtype == torch.float8_e4m3fn or name.endswith(("weight_scale_inv", "input_scale"))
    )
    floats = sum(t.numel() for t in checkpoint.tensors.values() if t.dtype == torch.float32) - sum(
        t.numel() for name, t in checkpoint.tensors.items() if name.endswith("weight_scale_inv")
    )
    fit = plan_settings(
        EngineArgs(model=str(checkpoint.folder), device="cpu", dtype="bfloat16"),
        PlanRequest(planning_only=True),
    )
    weights = fit.model.weights
    assert weights.checkpoint_quantization == "fp8"
    assert weights.stored_bytes == stored
    assert weights.total_params == floats  # embeddings, head, norms, the ignored down_proj
    assert fit.plan.weights_bytes_per_gpu_before_offload == stored + 2 * floats


def test_plan_counts_quantization_fp8_exactly(tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=11)
    folder = write_bf16(tmp_path / "bf16", hf_model)
    fit = plan_settings(
        EngineArgs(model=str(folder), device="cpu", dtype="bfloat16", quantization="fp8"),
        PlanRequest(planning_only=True),
    )
    projections = {n: p for n, p in hf_model.named_parameters() if n.endswith("_proj.weight")}
    fp8_bytes = sum(p.numel() + 4 * p.shape[0] for p in projections.values())  # 1 byte + a scale a row
    others = sum(p.numel() for n, p in hf_model.named_parameters() if n not in projections)
    assert fit.plan.weights_bytes_per_gpu_before_offload == fp8_bytes + 2 * others


def test_plan_of_a_config_only_fp8_folder_counts_what_fitserve_holds(tmp_path) -> None:
    """--load-format dummy: no headers to read; the fp8 projections count 1 byte a weight plus their
    scales in the form the layers hold ([N, K/128] float32 for 128-column blocks)."""
    spec = Fp8Spec("hf", "block", "dynamic", block=(128, 128), ignore=("model.layers.0.self_attn.o_proj",))
    folder = config_folder(tmp_path / "cfg", quantization_config(spec))
    fit = plan_settings(
        EngineArgs(model=str(folder), device="cpu", dtype="bfloat16", load_format="dummy"),
        PlanRequest(planning_only=True),
    )
    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **DIMS), seed=0)
    held = other = 0
    for name, param in hf_model.named_parameters():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight") and module not in spec.ignore:
            rows, cols = param.shape
            held += rows * cols + 4 * rows * -(-cols // 128)
        else:
            other += param.numel()
    assert fit.model.weights.stored_bytes == held
    assert fit.plan.weights_bytes_per_gpu_before_offload == held + 2 * other
