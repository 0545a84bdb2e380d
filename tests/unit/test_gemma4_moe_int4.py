"""Gemma-4 MoE (26B-A4B's form) int4 checkpoints whose experts are int4 on the CPU, against transformers
running the dequantized weights: gemma4_quant_helpers' tiny 26B-like model with experts of 64 columns,
written as a compressed-tensors or AWQ checkpoint whose attention, dense MLP and experts are int4 (the
experts one tensor set per expert and projection) and whose router stays 16-bit. One whole-sequence
forward's logits match HF's; TP 2 with expert parallel equals TP 1; an act-order checkpoint is refused
naming the fix, and a missing expert's tensors are named."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fitserve.layers.quantization.int4_method import Int4LinearMethod
from tests.quant_checkpoints import QuantSpec
from tests.unit.gemma4_quant_helpers import GROUP, build_model, hf_logits, logits_of, write_int4
from tests.unit.quant_helpers import int4_expert_tensors, load_model, without_tensors

SPECS = {  # the router (6 rows: too few for int4's packing) stays 16-bit through the ignore list
    "ct": QuantSpec("ct", GROUP, ignore=("re:.*router.*",)),
    "awq": QuantSpec("awq", GROUP, sym=False, ignore=("router",)),
}


@functools.cache
def checkpoint(fmt: str, root: str) -> tuple[Path, torch.nn.Module]:
    hf_model = build_model("moe_k_eq_v", conditional=fmt == "ct", seed=6, moe_intermediate_size=64)
    written = write_int4(Path(root) / fmt, hf_model, SPECS[fmt])
    path = written.folder / "model.safetensors"
    tensors, state, seed = load_file(str(path)), written.reference.state_dict(), 0
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        seed += 1000
        per_expert, dequantized = int4_expert_tensors(name, tensors.pop(name), SPECS[fmt], seed)
        tensors.update(per_expert)
        with torch.no_grad():
            state[name].copy_(dequantized)
    save_file(tensors, str(path))
    return written.folder, written.reference


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gemma4_moe_int4"))


@pytest.mark.parametrize("fmt", list(SPECS))
def test_logits_follow_the_dequantized_model(root, fmt):
    folder, reference = checkpoint(fmt, root)
    model = load_model(folder)
    layer = model.model.layers[1]
    assert type(layer.experts).__name__ == "Int4FusedExperts"
    assert isinstance(layer.mlp.gate_up_proj.linear_method, Int4LinearMethod)
    want, got = hf_logits(reference), logits_of(model)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < 1e-2, f"logits differ by {error:.2e} (relative)"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95


def _engine_greedy(folder: Path, **kwargs) -> list[int]:
    from fitserve import LLM, SamplingParams

    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=48, block_size=16, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return list(
            llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0].outputs[0].token_ids
        )
    finally:
        llm.engine.shutdown()


def test_tp2_with_expert_parallel_equals_tp1(root):
    folder, _ = checkpoint("awq", root)
    assert _engine_greedy(folder, tensor_parallel_size=2, enable_expert_parallel=True) == _engine_greedy(
        folder
    )


def test_act_order_experts_are_refused_before_loading(root, tmp_path):
    source, _ = checkpoint("awq", root)
    for path in source.iterdir():
        if path.name != "config.json":
            (tmp_path / path.name).symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"Gemma-4 MoE model \(Gemma4ForCausalLM, 6 experts\).*not int4 with act"
    ):
        _engine_greedy(tmp_path, load_format="dummy")


def test_a_missing_expert_is_refused_naming_it(root, tmp_path):
    source, _ = checkpoint("awq", root)
    without_tensors(source, tmp_path, ".layers.0.experts.2.down_proj.")
    missing = r"no int4 tensors for 1 expert projection\(s\), e\.g\. model\.layers\.0\.experts\.2"
    with pytest.raises(ValueError, match=missing):
        load_model(tmp_path)
