"""bitsandbytes 4-bit through the whole engine (fitserve.LLM) and the planner, on the CPU.

- Greedy output of a bitsandbytes checkpoint (written by tests/bnb_checkpoints.py) equals HF transformers
  generating with the dequantized weights; and HF transformers loading the same checkpoint itself where it
  can on this CPU (it needs bitsandbytes and accelerate; skipped without them).
- --quantization bitsandbytes on a 16-bit checkpoint: greedy output equals HF with the nf4-rounded weights.
- --load-format dummy with a bitsandbytes config and with --quantization bitsandbytes: it runs, the same
  seed gives the same tokens, the layers hold 4-bit codes.
- The planner counts what fitserve holds: the packed codes as stored and one float16 absmax a block (a
  double-quantized absmax decoded), for a checkpoint and for --quantization bitsandbytes; and that is what
  the loaded model holds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fitserve import LLM
from fitserve.args import EngineArgs
from fitserve.planner.resolve import PlanRequest, plan_settings
from fitserve.worker.model_runner import loaded_model_bytes
from tests.bnb_checkpoints import BnbSpec, quantize_spec, write_bnb
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import DIMS, fitserve_llm, greedy_fitserve, greedy_hf, model_of


@pytest.mark.parametrize(
    "spec",
    [
        BnbSpec("nf4", double_quant=True, reference_fp16_absmax=True),
        BnbSpec("fp4", reference_fp16_absmax=True),
    ],
    ids=lambda s: s.name,
)
def test_greedy_matches_the_dequantized_model(spec, tmp_path) -> None:
    """The reference holds each block's absmax rounded to float16, as fitserve does (bnb_runtime.py)."""
    hf_model = build_hf_model(tiny_hf_config("Qwen3ForCausalLM", **DIMS), seed=8)
    checkpoint = write_bnb(tmp_path / spec.name, hf_model, spec)
    assert greedy_fitserve(fitserve_llm(checkpoint.folder)) == greedy_hf(checkpoint.dequantized_model)


@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("bitsandbytes", "accelerate")),
    reason="HF transformers loads bitsandbytes checkpoints through bitsandbytes and accelerate",
)
def test_greedy_matches_hf_loading_the_same_checkpoint(tmp_path) -> None:
    import transformers

    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=8)
    spec = BnbSpec("nf4", double_quant=True, use_bitsandbytes=True)
    checkpoint = write_bnb(tmp_path / spec.name, hf_model, spec)
    hf_quantized = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint.folder), dtype=torch.float32
    )
    assert greedy_fitserve(fitserve_llm(checkpoint.folder)) == greedy_hf(hf_quantized.eval())


def test_quantize_while_loading_matches_hf_with_nf4_weights(tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=9)
    folder = save_with_tokenizer(hf_model, tmp_path / "bf16")
    reference = build_hf_model(hf_model.config, seed=9)
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():
            if name.endswith("_proj.weight"):
                tensor.copy_(quantize_spec(tensor, BnbSpec("nf4", reference_fp16_absmax=True))[1])
    llm = fitserve_llm(folder, quantization="bitsandbytes")
    assert greedy_fitserve(llm) == greedy_hf(reference.eval())
    layers = [m for m in model_of(llm).modules() if hasattr(m, "nf4_packed")]
    assert len(layers) == 2 * 4 and all(layer.nf4_packed.dtype == torch.uint8 for layer in layers)


@pytest.mark.parametrize("how", ["checkpoint config", "--quantization"])
def test_dummy_weights_run_in_4bit(how, tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=10)
    if how == "checkpoint config":
        folder, kwargs = write_bnb(tmp_path / "nf4", hf_model, BnbSpec("nf4")).folder, {}
    else:
        folder, kwargs = save_with_tokenizer(hf_model, tmp_path / "bf16"), {"quantization": "bitsandbytes"}
    first = fitserve_llm(folder, load_format="dummy", seed=3, **kwargs)
    tokens = greedy_fitserve(first)
    assert tokens == greedy_fitserve(fitserve_llm(folder, load_format="dummy", seed=3, **kwargs))
    layers = [m for m in model_of(first).modules() if hasattr(m, "nf4_packed")]
    assert len(layers) == 2 * 4
    weight_std = torch.stack([layer.linear_method.runnable.weight.absmax.float().mean() for layer in layers])
    assert torch.isfinite(weight_std).all() and (weight_std > 0).all()


def measured_weight_bytes(llm: LLM) -> int:
    """What the loaded model holds, less RoPE's inv_freq table (a buffer the planner does not count)."""
    model = model_of(llm)
    rope = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if "rotary" in name)
    return loaded_model_bytes(model) - rope


def held_bytes(folder: Path) -> tuple[int, int]:
    """(bytes fitserve holds for the quantized projections, floating-point parameters of the rest)."""
    held = floats = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open has no iterator)
            tensor = handle.get_tensor(name)
            if name.endswith(".weight") and tensor.dtype == torch.uint8:
                held += tensor.numel()
            elif name.endswith(".weight.absmax"):
                held += 2 * tensor.numel()
            elif ".weight." not in name:
                floats += tensor.numel()
    return held, floats


@pytest.mark.parametrize("spec", [BnbSpec("nf4", double_quant=True), BnbSpec("fp4", blocksize=128)])
def test_plan_counts_what_fitserve_holds(spec, tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=11)
    folder = write_bnb(tmp_path / spec.name, hf_model, spec).folder
    held, floats = held_bytes(folder)
    fit = plan_settings(
        EngineArgs(model=str(folder), device="cpu", dtype="float32"), PlanRequest(planning_only=True)
    )
    weights = fit.model.weights
    assert weights.checkpoint_quantization == "bitsandbytes"
    assert weights.stored_bytes == held and weights.total_params == floats
    planned = fit.plan.weights_bytes_per_gpu_before_offload
    assert planned == held + 4 * floats
    assert measured_weight_bytes(fitserve_llm(folder)) == planned


def test_plan_of_quantize_while_loading_counts_nf4(tmp_path) -> None:
    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=12)
    folder = save_with_tokenizer(hf_model, tmp_path / "bf16")
    args = EngineArgs(model=str(folder), device="cpu", dtype="float32", quantization="bitsandbytes")
    fit = plan_settings(args, PlanRequest(planning_only=True))
    linear = fit.model.weights.counts.linear
    other = fit.model.weights.counts.other
    planned = fit.plan.weights_bytes_per_gpu_before_offload
    assert planned == linear // 2 + linear // 64 * 2 + 4 * other
    assert measured_weight_bytes(fitserve_llm(folder, quantization="bitsandbytes")) == planned
