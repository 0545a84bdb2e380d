"""Qwen3-MoE FP8 checkpoints (layers/moe_fp8.py) on the CPU, against transformers running the dequantized
weights: tiny random Qwen3-MoE models whose attention projections and experts (one tensor set per expert
and projection, as Qwen3-30B-A3B-FP8 stores them) are fp8, written in HF's block form (`weight_scale_inv`
per 32x32 block, Qwen's releases use 128x128) and compressed-tensors' per-channel and per-tensor forms; the
router stays 16-bit. Greedy tokens equal HF's and logprobs are within 2e-3, with prefix caching and chunked
prefill; TP 2 (intermediate split and expert parallel) equals TP 1; --load-format dummy runs the same model
at TP 1 and TP 2. Refused naming the fix: a TP split inside a scale block, an expert weight that is not
fp8; a checkpoint missing an expert's scale is refused naming it. The planner counts the experts' fp8
bytes from config.json. The kernels: tests/unit/test_fused_moe_fp8_interpret.py."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fp8_checkpoints import Fp8Spec, quantization_config
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import fp8_quantizer
from tests.unit.test_engine_vs_hf import PROMPTS, greedy_outputs, make_llm
from tests.unit.test_qwen3_moe import assert_layout_equals_one_rank
from tests.unit.test_qwen3_moe_int4 import (
    MOE,
    assert_chunks_and_cached_prefixes_keep_the_tokens,
    assert_experts_compute_their_dequantized_weights,
    assert_follows_the_reference,
    write_quantized_moe,
)

SPECS = {
    "hf-block": Fp8Spec("hf", "block", block=(32, 32)),
    "ct-channel": Fp8Spec("ct", "channel"),
    "ct-tensor": Fp8Spec("ct", "tensor", activations="static"),
}


@functools.cache
def checkpoint(name: str, root: str) -> tuple[Path, torch.nn.Module]:
    config = tiny_hf_config("Qwen3MoeForCausalLM", **MOE, norm_topk_prob=True)
    folder = Path(root) / name
    spec = SPECS[name]
    quantized = (fp8_quantizer(spec), quantization_config(spec))
    return folder, write_quantized_moe(folder, build_hf_model(config, seed=3), *quantized)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("qwen3_moe_fp8"))


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_and_logprobs_follow_the_dequantized_model(root, name):
    folder, reference = checkpoint(name, root)
    llm = make_llm(folder)
    experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Fp8FusedExperts"
    assert experts.w13.dtype == torch.float8_e4m3fn
    assert_follows_the_reference(llm, reference)


def test_the_fp8_experts_compute_what_their_dequantized_weights_do(root):
    folder, _ = checkpoint("hf-block", root)
    assert_experts_compute_their_dequantized_weights(make_llm(folder).engine.executor.runner.model)


def test_chunked_prefill_and_prefix_caching_keep_the_tokens(root):
    folder, reference = checkpoint("hf-block", root)
    assert_chunks_and_cached_prefixes_keep_the_tokens(folder, reference)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["intermediate_split", "expert_parallel"])
def test_tp2_equals_tp1(root, expert_parallel):
    folder, _ = checkpoint("hf-block", root)
    assert_layout_equals_one_rank(
        folder, {"tensor_parallel_size": 2, "enable_expert_parallel": expert_parallel}
    )


def _copy_without_weights(root: str, name: str, target: str) -> Path:
    source, _ = checkpoint(name, root)
    folder = Path(root) / target
    folder.mkdir(exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


def test_dummy_experts_are_the_same_model_at_tp1_and_tp2(root):
    """The experts' dummy fp8 weights are drawn whole and cut per rank (the attention is kept 16-bit here:
    a dense fp8 layer's dummy weight is drawn per rank)."""
    folder = _copy_without_weights(root, "hf-block", "block-dummy")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("self_attn")
    (folder / "config.json").write_text(json.dumps(config))
    want = greedy_outputs(make_llm(folder, load_format="dummy"), PROMPTS)
    two = make_llm(folder, load_format="dummy", tensor_parallel_size=2)
    try:
        got = greedy_outputs(two, PROMPTS)
    finally:
        two.engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_a_tp_split_inside_a_scale_block_is_refused_naming_expert_parallel(root):
    """Blocks of 32 of the experts' 64 intermediate columns: 4 ranks would start at 16, 32 and 48."""
    folder = _copy_without_weights(root, "hf-block", "block-tp4")
    message = (
        r"each of the 4 tensor-parallel ranks' 16 of them would start inside a block: run with --enable-ex"
    )
    with pytest.raises(ValueError, match=message):
        make_llm(folder, load_format="dummy", tensor_parallel_size=4)


def _edited(root: str, target: str, edit) -> Path:
    source, _ = checkpoint("hf-block", root)
    folder = _copy_without_weights(root, "hf-block", target)
    tensors = load_file(str(source / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_missing_expert_scale_is_named(root):
    name = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"
    folder = _edited(root, "block-missing", lambda tensors: tensors.pop(name))
    with pytest.raises(
        ValueError, match=r"no fp8 tensors for 1 expert projection.*layers\.1\.mlp\.experts\.5\.down"
    ):
        make_llm(folder)


def test_an_expert_weight_that_is_not_fp8_is_refused_naming_it(root):
    name = "model.layers.0.mlp.experts.3.up_proj.weight"

    def to_bf16(tensors):
        tensors[name] = tensors[name].to(torch.bfloat16)

    folder = _edited(root, "block-bf16-expert", to_bf16)
    message = (
        r"quantized tensor model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight is torch\.bfloat16, expected"
    )
    with pytest.raises(ValueError, match=message):
        make_llm(folder)


@pytest.mark.parametrize(("name", "block"), [("hf-block", 32), ("ct-channel", None)])
def test_the_planner_counts_the_fp8_layers_from_config_alone(root, name, block):
    """stored_fp8_from_config on config.json alone: every attention projection and every expert's three
    projections at 1 byte a weight plus a float32 scale per row and 32-column block (or per row)."""
    from transformers import AutoConfig

    from fitserve.layers.quantization.fp8_shapes import stored_fp8_from_config
    from fitserve.layers.quantization.quant_config import quant_format

    folder, _ = checkpoint(name, root)
    config = AutoConfig.from_pretrained(str(folder))
    params, stored = stored_fp8_from_config(quant_format(config), config)
    heads, kv_heads, head_dim, hidden = 4, 2, 32, 64
    attention = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim)]
    attention.append((heads * head_dim, hidden))
    experts = [(hidden, 64), (hidden, 64), (64, hidden)] * 8
    shapes = (attention + experts) * 2  # two layers, both sparse
    assert params == sum(k * n for k, n in shapes)
    assert stored == sum(k * n + 4 * n * (-(-k // block) if block else 1) for k, n in shapes)


def test_the_plan_of_qwen3_30b_a3b_fp8_fits_two_24gb_gpus_and_refuses_ampere(capsys):
    """examples/models/qwen3-30b-a3b-fp8 (Qwen's [128, 128] block config) from config.json alone: 28.71
    GiB of fp8 layers, tensor parallel 2 on two 24 GB Ada GPUs; on Ampere (8.6) refused before loading."""
    from fitserve.cli.plan import run_plan
    from tests.unit.test_planner_cli import parse
    from tests.unit.test_qwen3_moe import EXAMPLES

    folder = str(EXAMPLES / "qwen3-30b-a3b-fp8")
    assert run_plan(parse("plan", [folder, "--assume-gpus", "2x24@8.9"])) == 0
    out = capsys.readouterr().out
    assert "fp8 28.71 GiB as stored, 1/2 per GPU" in out and "tensor_parallel_size     2" in out
    from fitserve.planner.fit_errors import PlanError

    with pytest.raises(
        PlanError, match=r"MoE experts run on GPUs of compute capability 8\.9 and up.*has 8\.6"
    ):
        run_plan(parse("plan", [folder, "--assume-gpus", "2x24@8.6"]))
