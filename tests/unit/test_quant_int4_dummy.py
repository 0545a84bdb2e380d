"""--load-format dummy with an int4 checkpoint's config.json (no weight files): every quantized layer gets a
random canonical Int4Weight (int4_weight.random_int4_weight) made runnable as a loaded one is, so the same
kernels run; the engine generates finite tokens, reproducibly for a seed; the planner counts the int4
projections at the bytes the format stores them in, as it does reading a real checkpoint's headers.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fitserve import LLM, SamplingParams
from fitserve.args import EngineArgs
from fitserve.layers.quantization.int4_method import Int4LinearMethod
from fitserve.layers.quantization.int4_weight import dequantize, random_int4_weight
from fitserve.models.loader import load_model
from fitserve.planner.resolve import PlanRequest, create_engine_config, plan_settings
from tests.model_folders import write_config_with_tokenizer
from tests.quant_checkpoints import QuantSpec, quantization_config, write_quantized
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, tiny_hf_config

# hidden 128 and intermediate 256: group sizes 32, 64 and 128 divide every layer's input, N a multiple of 16
DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = [5, 17, 33, 2, 90, 11, 200, 3]
SPECS = [
    QuantSpec("gptq", 64),
    QuantSpec("gptq", 64, sym=False, act_order=True),
    QuantSpec("awq", 128, sym=False),
    QuantSpec("ct", 32),
    QuantSpec("ct", 64, sym=False, act_order=True),
    QuantSpec("autoround", 32, ignore=("model.layers.0.mlp.down_proj",)),
]
IDS = [spec.name + ("-ignore" if spec.ignore else "") for spec in SPECS]


def config_folder(folder: Path, spec: QuantSpec, architecture: str = "Qwen3ForCausalLM") -> Path:
    """config.json (with the spec's quantization_config) and a tokenizer; no weight files."""
    config = tiny_hf_config(architecture, **DIMS).to_dict()
    config["quantization_config"] = quantization_config(spec)
    return write_config_with_tokenizer(folder, config)


def dummy_model(folder: Path, seed: int = 0) -> tuple[torch.nn.Module, object]:
    config = create_engine_config(EngineArgs(model=str(folder), load_format="dummy", device="cpu", seed=seed))
    return load_model(config.model, "cpu"), config.model.hf_config


def int4_methods(model: torch.nn.Module) -> dict[str, Int4LinearMethod]:
    return {
        name: module.linear_method
        for name, module in model.named_modules()
        if isinstance(getattr(module, "linear_method", None), Int4LinearMethod)
    }


def expected_path() -> str:
    from fitserve.layers.cpu.c_kernels.library import load_cpu_kernels
    from fitserve.layers.cpu.int4_linear import kernel_available

    if load_cpu_kernels() is not None:
        return "c-kernel"
    return "torch-int4" if kernel_available() else "dequantized"


def greedy(folder: Path, seed: int) -> list[tuple[list[int], list[float]]]:
    llm = LLM(
        str(folder),
        load_format="dummy",
        seed=seed,
        dtype="float32",
        num_gpu_blocks_override=32,
        block_size=8,
    )
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": TOKENS}, {"prompt_token_ids": list(range(40, 60))}]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        chosen = [
            step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
        ]
        results.append((list(completion.token_ids), chosen))
    return results


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_every_int4_layer_gets_a_runnable_random_weight_on_the_kernel_path(spec, tmp_path) -> None:
    model, hf_config = dummy_model(config_folder(tmp_path / "model", spec))
    methods = int4_methods(model)
    assert len(methods) == 2 * 4 - len(spec.ignore)  # qkv, o, gate_up, down per layer, less those left out
    assert {method.path for method in methods.values()} == {expected_path()}
    for name, method in methods.items():
        assert method.runnable is not None, name
    # no checkpoint-format tensor is left behind; the unquantized floats got today's dummy init
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_parameters()}
    assert not names & {"qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale"}
    norms = [p for name, p in model.named_parameters() if p.ndim == 1 and name.endswith("norm.weight")]
    assert norms and all(torch.all(p == 1.0) for p in norms)
    logits = PagedTestRunner(model, hf_config).step([("seq", TOKENS)])[0]
    assert torch.isfinite(logits).all()
    assert 1e-4 < float(logits.std()) < 10.0


def test_the_kernel_runs_the_same_weights_as_the_dequantized_path(tmp_path, monkeypatch) -> None:
    """FITSERVE_CPU_INT4=0 dequantizes the same random Int4Weight at load: logits agree to the C kernel's
    tolerance (test_quant_int4_formats.py), so the dummy weight goes through make_runnable unchanged."""
    folder = config_folder(tmp_path / "model", QuantSpec("gptq", 64, act_order=True))
    kernel_model, hf_config = dummy_model(folder, seed=5)
    kernel = PagedTestRunner(kernel_model, hf_config).step([("seq", TOKENS)])[0]
    monkeypatch.setenv("FITSERVE_CPU_INT4", "0")
    dense_model, _ = dummy_model(folder, seed=5)
    assert {method.path for method in int4_methods(dense_model).values()} == {"dequantized"}
    dense = PagedTestRunner(dense_model, hf_config).step([("seq", TOKENS)])[0]
    assert float((kernel - dense).abs().max() / dense.abs().max()) < 3e-2


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("gptq", 64),
        QuantSpec("gptq", 64, act_order=True),
        QuantSpec("awq", 128, sym=False),
        SPECS[4],
    ],
    ids=lambda spec: spec.name,
)
def test_llm_generates_finite_reproducible_tokens(architecture, spec, tmp_path) -> None:
    folder = config_folder(tmp_path / "model", spec, architecture)
    first = greedy(folder, seed=11)
    for tokens, logprobs in first:
        assert len(tokens) == 6
        assert all(math.isfinite(value) for value in logprobs)
    assert greedy(folder, seed=11) == first
    assert greedy(folder, seed=12) != first


@pytest.mark.parametrize("symmetric", [True, False])
def test_random_int4_weight_is_seeded_and_has_the_asked_spread(symmetric) -> None:
    def draw(seed: int):
        return random_int4_weight(256, 512, 64, symmetric, 0.02, torch.Generator().manual_seed(seed))

    weight = draw(3)
    assert (
        weight.codes.dtype == torch.uint8 and int(weight.codes.max()) == 15 and int(weight.codes.min()) == 0
    )
    assert weight.perm is None and bool((weight.scales > 0).all())
    if symmetric:
        assert bool((weight.zeros == 8).all())
    else:
        assert weight.zeros.min() >= 4 and weight.zeros.max() <= 11 and len(weight.zeros.unique()) > 4
    assert 0.018 < float(dequantize(weight).std()) < 0.022
    again, other = draw(3), draw(4)
    assert torch.equal(again.codes, weight.codes) and torch.equal(again.scales, weight.scales)
    assert torch.equal(again.zeros, weight.zeros) and not torch.equal(other.codes, weight.codes)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_plan_of_a_dummy_folder_counts_the_int4_bytes_a_checkpoint_stores(spec, tmp_path) -> None:
    """The config-only folder plans the same weight bytes as a real checkpoint of that format."""
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=9)
    real = write_quantized(tmp_path / "real", hf_model, spec).folder
    dummy = config_folder(tmp_path / "dummy", spec, "LlamaForCausalLM")

    def plan(folder: Path, load_format: str):
        args = EngineArgs(model=str(folder), device="cpu", dtype="bfloat16", load_format=load_format)
        return plan_settings(args, PlanRequest(planning_only=True))

    from_headers, from_config = plan(real, "auto"), plan(dummy, "dummy")
    assert from_config.model.weights.checkpoint_quantization == spec_method(spec)
    assert from_config.model.weights.stored_bytes == from_headers.model.weights.stored_bytes > 0
    assert from_config.model.weights.total_params == from_headers.model.weights.total_params
    assert (
        from_config.plan.weights_bytes_per_gpu_before_offload
        == from_headers.plan.weights_bytes_per_gpu_before_offload
    )


def spec_method(spec: QuantSpec) -> str:
    return {"gptq": "gptq", "awq": "awq", "ct": "compressed-tensors", "autoround": "auto-round"}[spec.fmt]
