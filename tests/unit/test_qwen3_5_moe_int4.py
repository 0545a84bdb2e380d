"""Qwen3.5 / Qwen3.6 MoE int4 checkpoints (Qwen3.6-35B-A3B's form) on the CPU, against transformers running
the dequantized weights: a tiny random Qwen3_5MoeForConditionalGeneration written as an AWQ, GPTQ or
compressed-tensors checkpoint whose experts are int4 one tensor set per expert and projection (as the hub's
releases store them), whose shared expert, attention and DeltaNet projections are int4 too, and whose
router and shared-expert gate stay 16-bit (in_proj_b / in_proj_a in the ignore list, as the Qwen3.6-27B
AWQ-INT4 config has them). One whole-sequence forward's logits match HF's, the engine's greedy tokens
equal HF's, TP 2 (intermediate split and expert parallel) equals TP 1. Refused before loading, naming the
fix: act order in the experts, bitsandbytes on the MoE; a checkpoint missing an expert's tensors names it.
--load-format dummy gives the same model at TP 1 and TP 2."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fitserve.layers.quantization.int4_method import Int4LinearMethod
from tests.quant_checkpoints import QuantSpec
from tests.unit.quant_helpers import int4_expert_tensors, load_model
from tests.unit.qwen3_5_helpers import build_hf, hf_greedy, hf_logits, make_config
from tests.unit.qwen3_5_quant_helpers import SIZES, int4_ignore, write_int4

TOKENS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5)).tolist()
MOE_SIZES = {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
SPECS = {
    "awq": QuantSpec("awq", 32, sym=False),
    "gptq": QuantSpec("gptq", 32, sym=True),
    "ct": QuantSpec("ct", 32, sym=False),
}


def build_moe(seed: int) -> torch.nn.Module:
    config = make_config(moe=True, conditional=True)
    for key, value in {**SIZES, **MOE_SIZES}.items():
        setattr(config.text_config, key, value)
    return build_hf(config, seed=seed)


def quantize_experts(folder: Path, reference: torch.nn.Module, spec: QuantSpec) -> None:
    """The checkpoint's fused 16-bit experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`) rewritten
    as int4 tensors per expert and projection, and the reference given their dequantized weights."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    state = reference.state_dict()
    seed = 0
    for name in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
        seed += 1000
        per_expert, dequantized = int4_expert_tensors(name, tensors.pop(name), spec, seed)
        tensors.update(per_expert)
        with torch.no_grad():
            state[name].copy_(dequantized)
    save_file(tensors, str(path))


@functools.cache
def checkpoint(fmt: str, root: str) -> tuple[Path, torch.nn.Module]:
    base = SPECS[fmt]
    hf_model = build_moe(seed=4)
    spec = QuantSpec(base.fmt, base.group_size, base.sym, base.act_order, int4_ignore(base.fmt, hf_model))
    written = write_int4(Path(root) / fmt, hf_model, spec)
    quantize_experts(written.folder, written.reference, spec)
    return written.folder, written.reference


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("qwen3_5_moe_int4"))


def _engine_greedy(folder: Path, prompts: list[list[int]], **kwargs: Any) -> list[list[int]]:
    from fitserve import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=48, block_size=16, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("fmt", list(SPECS))
def test_logits_follow_the_dequantized_model(root, fmt):
    folder, reference = checkpoint(fmt, root)
    model = load_model(folder)
    block = model.model.layers[0].mlp
    assert type(block.experts).__name__ == "Int4FusedExperts"
    assert isinstance(block.shared_expert.gate_up_proj.linear_method, Int4LinearMethod)
    assert isinstance(block.shared_expert.down_proj.linear_method, Int4LinearMethod)
    from fitserve.layers.attention.metadata import forward_context

    with torch.no_grad(), forward_context(None, []):
        got = model.compute_logits(model(torch.tensor(TOKENS), torch.arange(len(TOKENS)))).float()
    want = hf_logits(reference, TOKENS)
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error < 1e-2, f"logits differ by {error:.2e} (relative)"
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.95


def test_the_engine_decodes_as_transformers(root):
    folder, reference = checkpoint("awq", root)
    prompts = [TOKENS[:12], TOKENS[5:30]]
    assert _engine_greedy(folder, prompts) == [hf_greedy(reference, p, 8) for p in prompts]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["intermediate_split", "expert_parallel"])
def test_tp2_equals_tp1(root, expert_parallel):
    folder, _ = checkpoint("gptq", root)
    prompts = [TOKENS[:12], TOKENS[5:30]]
    want = _engine_greedy(folder, prompts)
    got = _engine_greedy(folder, prompts, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    assert got == want


def _with_config(root: str, name: str, change: dict[str, Any]) -> Path:
    """A copy of the GPTQ checkpoint's folder whose config.json's quantization_config is updated by `change`
    (an empty quant_method drops it: the 16-bit config)."""
    source, _ = checkpoint("gptq", root)
    folder = Path(root) / name
    folder.mkdir(exist_ok=True)
    for path in source.iterdir():
        target = folder / path.name
        if not target.exists():
            target.symlink_to(path)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"].update(change)
    if not config["quantization_config"]["quant_method"]:
        del config["quantization_config"]
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_act_order_experts_are_refused_before_loading(root):
    folder = _with_config(root, "gptq-actorder", {"desc_act": True})
    with pytest.raises(ValueError, match=r"Qwen3\.5 MoE model .*not int4 with act order \(g_idx\)"):
        _engine_greedy(folder, [TOKENS[:4]], load_format="dummy")


def test_bitsandbytes_on_the_moe_is_refused_before_loading(root):
    folder = _with_config(root, "bf16", {"quant_method": ""})
    with pytest.raises(
        ValueError, match=r"Qwen3\.5 MoE model \(Qwen3_5MoeForConditionalGeneration, 4 experts\).*not this"
    ):
        _engine_greedy(folder, [TOKENS[:4]], load_format="dummy", quantization="bitsandbytes")


def test_a_missing_expert_is_refused_naming_it(root, tmp_path):
    source, _ = checkpoint("awq", root)
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (tmp_path / path.name).symlink_to(path)
    tensors = load_file(str(source / "model.safetensors"))
    dropped = [name for name in tensors if ".layers.1.mlp.experts.3.up_proj." in name]
    assert dropped
    save_file({k: v for k, v in tensors.items() if k not in dropped}, str(tmp_path / "model.safetensors"))
    missing = r"no int4 tensors for 1 expert projection\(s\), e\.g\. model\.layers\.1\.mlp\.experts\.3\.up_"
    with pytest.raises(ValueError, match=missing):
        load_model(tmp_path)


def test_dummy_weights_are_the_same_model_at_tp1_and_tp2(root):
    """--load-format dummy draws every int4 expert whole from its own seed: the same model on two ranks."""
    folder = _with_config(root, "gptq-dummy", {})
    prompts = [TOKENS[:12]]
    want = _engine_greedy(folder, prompts, load_format="dummy")
    assert _engine_greedy(folder, prompts, load_format="dummy", tensor_parallel_size=2) == want
