"""Qwen3-MoE (models/qwen3_moe.py) against transformers' modeling_qwen3_moe on tiny random models (fp32).

Model level (HF's in-memory state dict: the fused expert tensors): logits of prefill, chunked prefill and
greedy decode with mixed steps within 1e-4 of HF's, with the top-k renormalised and not, a dense first layer
(`mlp_only_layers`) and every other layer sparse (`decoder_sparse_step` 2). Engine level (a saved folder: the
per-expert tensors HF writes): greedy tokens equal HF's generate with prefix caching on and off, chunked
prefill and preemption; logprobs within 1e-4; tensor parallel 2 (gloo) equal to TP 1, with the experts'
intermediate size split, with --enable-expert-parallel and over two pipeline stages. A quantized checkpoint
that would quantize the experts is refused before building, naming what runs; the planner counts what
transformers builds, and the 30B-A3B's shape.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.layers.quantization.layer_projections import moe_sparse_layer
from fitserve.models.qwen3_moe import Qwen3MoeForCausalLM
from fitserve.planner.model_shape import ModelShape
from tests.model_folders import save_with_tokenizer
from tests.unit.model_helpers import (
    PagedTestRunner,
    build_fitserve_model,
    build_hf_model,
    greedy_with_mixed_steps,
    hf_logits,
    tiny_hf_config,
)
from tests.unit.test_engine_vs_hf import ENGINE_VARIANTS, PROMPTS, greedy_outputs, hf_greedy, make_llm
from tests.unit.test_models_vs_hf import TOLERANCE, assert_matches, random_tokens

MOE = {
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
CASES: dict[str, dict[str, Any]] = {
    "renormalised": {},
    "not_renormalised": {"norm_topk_prob": False},
    "dense_first_layer": {"mlp_only_layers": [0]},
    "every_other_layer": {"decoder_sparse_step": 2, "num_hidden_layers": 3},
}


def config_of(case: str) -> Any:
    return tiny_hf_config("Qwen3MoeForCausalLM", **{**MOE, **CASES[case]})


@functools.cache
def models(case: str) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    config = config_of(case)
    hf_model = build_hf_model(config)
    return config, hf_model, build_fitserve_model(config, hf_model.state_dict())


def test_the_layers_are_sparse_where_transformers_makes_them_so():
    _, _, dense_first = models("dense_first_layer")
    kinds = [type(layer.mlp).__name__ for layer in dense_first.model.layers]
    assert kinds == ["GatedMLP", "Qwen3MoeSparseBlock"]
    _, _, every_other = models("every_other_layer")
    kinds = [type(layer.mlp).__name__ for layer in every_other.model.layers]
    assert kinds == ["GatedMLP", "Qwen3MoeSparseBlock", "GatedMLP"]
    assert [moe_sparse_layer(config_of("renormalised"), i) for i in range(2)] == [True, True]


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_chunked_prefill_match_hf(case: str) -> None:
    config, hf_model, model = models(case)
    prompt = random_tokens(37, seed=1)
    (whole,) = PagedTestRunner(model, config).step([("a", prompt)])
    assert_matches(whole, hf_logits(hf_model, prompt))
    runner = PagedTestRunner(model, config, block_size=4)
    pieces = [runner.step([("b", prompt[a:b])])[0] for a, b in ((0, 21), (21, 26), (26, 37))]
    assert_matches(torch.cat(pieces), hf_logits(hf_model, prompt))


@pytest.mark.parametrize("case", ["renormalised", "dense_first_layer"])
def test_greedy_decode_with_mixed_steps_matches_hf(case: str) -> None:
    config, hf_model, model = models(case)
    runner = PagedTestRunner(model, config, block_size=4)
    prompts = {"a": random_tokens(19, seed=5), "b": random_tokens(33, seed=6), "c": random_tokens(12, seed=7)}
    for computed, sequence in greedy_with_mixed_steps(runner, prompts, late="c").values():
        assert_matches(computed, hf_logits(hf_model, sequence[: computed.shape[0]]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A folder as save_pretrained writes it: one tensor per expert and projection."""
    config = config_of("renormalised")
    hf_model = build_hf_model(config, seed=3)
    folder = save_with_tokenizer(hf_model, tmp_path_factory.mktemp("qwen3_moe"))
    return folder, hf_model


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
def test_engine_greedy_matches_hf_generate(saved, variant):
    folder, hf_model = saved
    expected = [hf_greedy(hf_model, p) for p in PROMPTS]
    llm = make_llm(folder, **ENGINE_VARIANTS[variant])
    for _ in range(2):  # the second pass reads the first's prefix blocks where caching is on
        assert [o.outputs[0].token_ids for o in greedy_outputs(llm, PROMPTS)] == expected
    if variant == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    if variant == "prefix caching on":
        assert llm.engine.kv_manager.prefix_cache_hits > 0


def test_engine_logprobs_match_hf(saved):
    folder, hf_model = saved
    prompt = PROMPTS[1]
    out = greedy_outputs(make_llm(folder), [prompt], logprobs=5)[0]
    with torch.no_grad():
        full = torch.tensor([prompt + out.outputs[0].token_ids])
        reference = torch.log_softmax(hf_model(full).logits[0].float(), dim=-1)
    for step, position in enumerate(out.outputs[0].logprobs):
        for token_id, entry in position.items():
            assert abs(entry.logprob - reference[len(prompt) - 1 + step][token_id].item()) < TOLERANCE


LAYOUTS = {
    "tp2_intermediate_split": {"tensor_parallel_size": 2},
    "tp2_expert_parallel": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_equal_one_rank(saved, layout):
    folder, _ = saved
    assert_layout_equals_one_rank(folder, LAYOUTS[layout])


def assert_layout_equals_one_rank(folder: Path, layout: dict[str, Any]) -> None:
    """Greedy tokens and top-3 logprobs (within TOLERANCE) of the engine with `layout` (TP, PP) equal one
    rank's on PROMPTS."""
    want = greedy_outputs(make_llm(folder), PROMPTS, logprobs=3)
    parallel = make_llm(folder, **layout)
    try:
        got = greedy_outputs(parallel, PROMPTS, logprobs=3)
    finally:
        parallel.engine.shutdown()
    for ours, theirs in zip(got, want, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for mine, other in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            for token_id, entry in other.items():
                assert abs(mine[token_id].logprob - entry.logprob) < TOLERANCE


def _awq(config: Any, ignore: list[str] | None = None) -> Any:
    config.quantization_config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": ignore,
    }
    return config


def test_experts_quantized_in_a_form_they_do_not_run_are_refused_before_building():
    """bitsandbytes (--quantization on the 16-bit checkpoint) and int4 with act order; an int4 checkpoint
    builds (tests/unit/test_qwen3_moe_int4.py runs them, test_qwen3_moe_fp8.py fp8)."""
    from fitserve.layers.moe_int4 import Int4FusedExperts
    from fitserve.layers.quantization.quant_config import with_quantization_flag

    with pytest.raises(
        ValueError, match=r"Qwen3-MoE model \(8 experts\).*16-bit, int4 .* or fp8 weights, not this format"
    ):
        Qwen3MoeForCausalLM(with_quantization_flag(config_of("renormalised"), "bitsandbytes"))
    act_order = _awq(config_of("renormalised"))
    act_order.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    with pytest.raises(ValueError, match=r"gptq int4 .*not int4 with act order \(g_idx\).*desc_act false"):
        Qwen3MoeForCausalLM(act_order)
    assert isinstance(
        Qwen3MoeForCausalLM(_awq(config_of("renormalised"))).model.layers[0].mlp.experts, Int4FusedExperts
    )


def test_an_ignore_list_naming_the_experts_lets_the_rest_be_quantized():
    from fitserve.layers.quantization.quant_config import quant_format
    from fitserve.models.qwen3_moe_config import refuse_quantized_experts

    config = _awq(config_of("renormalised"), ["experts"])
    refuse_quantized_experts(config, quant_format(config))  # no error


def test_the_planner_counts_the_30b_a3b():
    import json

    import transformers

    folder = Path(__file__).resolve().parents[2] / "examples" / "models" / "qwen3-30b-a3b"
    config = transformers.Qwen3MoeConfig(**json.loads((folder / "config.json").read_text()))
    shape = ModelShape.from_hf_config(config)
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (128, 8, 768)
    total = shape.parameter_counts().total
    assert 30.4e9 < total < 30.6e9, total  # "30B": 30.53 B parameters
    assert 3.3e9 < shape.active_params < 3.4e9, shape.active_params  # "A3B": 3.35 B a token


@pytest.mark.parametrize("case", list(CASES))
def test_the_planner_counts_what_transformers_builds(case):
    config, hf_model, _ = models(case)
    shape = ModelShape.from_hf_config(config)
    assert shape.parameter_counts().total == sum(p.numel() for p in hf_model.parameters())
    sparse = sum(moe_sparse_layer(config, i) for i in range(config.num_hidden_layers))
    assert shape.num_sparse_layers == sparse
    idle = sparse * (config.num_experts - config.num_experts_per_tok) * 3 * 64 * config.moe_intermediate_size
    assert shape.active_params == shape.parameter_counts().total - idle


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"


@pytest.mark.parametrize(
    ("model", "fitserves"), [("qwen3-30b-a3b", {"awq or gptq"}), ("gemma-4-26b-a4b-it", {"awq or gptq"})]
)
def test_the_plans_advice_for_a_moe_offers_only_the_quantization_its_experts_run(model, fitserves):
    """A MoE too big for a 24 GB GPU: the advice that fitserve runs comes first (offload, an int4 checkpoint
    where its experts run int4, tensor parallel); the 4-bit methods fitserve's engine would refuse for this
    MoE follow, each saying so and that vLLM runs them."""
    from fitserve.cli.plan import run_plan
    from fitserve.planner.engine_support import MOE_QUANTIZATION
    from fitserve.planner.fit_errors import PlanError
    from tests.unit.test_planner_cli import parse

    with pytest.raises(PlanError) as error:
        run_plan(parse("plan", [str(EXAMPLES / model), "--assume-gpus", "1x24"]))
    options = str(error.value).split("What would fit (any one line):\n", 1)[1].splitlines()
    assert options[0].lstrip().startswith("--cpu-offload-gb")
    methods = {
        line.split("--quantization ", 1)[1].split(" (")[0]: line
        for line in options
        if "--quantization" in line
    }
    assert "bitsandbytes" in methods, "a 4-bit method fits this GPU: the advice should still name it"
    for method, line in methods.items():
        assert line.endswith(f"({MOE_QUANTIZATION})") is (method not in fitserves), line
    last_run = max(i for i, line in enumerate(options) if not line.endswith(f"({MOE_QUANTIZATION})"))
    assert all(line.endswith(f"({MOE_QUANTIZATION})") for line in options[last_run + 1 :])


def test_a_plan_with_quantized_moe_experts_says_fitserve_does_not_run_it(capsys):
    from fitserve.cli.plan import run_plan
    from tests.unit.test_planner_cli import parse

    argv = [str(EXAMPLES / "qwen3-30b-a3b"), "--assume-gpus", "1x80@9.0"]
    assert run_plan(parse("plan", [*argv, "--quantization", "bitsandbytes"])) == 0
    assert (
        "planned only: --quantization bitsandbytes (fitserve runs MoE experts 16-bit, int4 or fp8"
        in capsys.readouterr().out
    )
    assert run_plan(parse("plan", argv)) == 0
    assert "planned only" not in capsys.readouterr().out


def test_the_serve_paths_check_refuses_act_order_experts_naming_qwen3_moe(tmp_path):
    import json

    from fitserve.planner.model_info import inspect_model
    from fitserve.planner.quantized_checkpoint import check_quantized_checkpoint

    config = _awq(config_of("renormalised")).to_dict()
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"for a Qwen3-MoE model \(8 experts\)"):  # act order: refused
        check_quantized_checkpoint(inspect_model(str(tmp_path)), None)
    config["quantization_config"]["modules_to_not_convert"] = ["experts"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert check_quantized_checkpoint(inspect_model(str(tmp_path)), None) is not None  # experts stay 16-bit
    config["quantization_config"] = _awq(config_of("renormalised")).quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert check_quantized_checkpoint(inspect_model(str(tmp_path)), None) is not None  # int4 experts run
