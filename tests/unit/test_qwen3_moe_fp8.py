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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fp8_checkpoints import Fp8Spec, quantization_config
from tests.unit.model_helpers import build_hf_model, tiny_hf_config
from tests.unit.quant_helpers import fp8_quantizer
from tests.unit.test_engine_vs_hf import make_llm
from tests.unit.test_qwen3_moe import assert_layout_equals_one_rank
from tests.unit.test_qwen3_moe_int4 import (
    MOE,
    assert_chunks_and_cached_prefixes_keep_the_tokens,
    assert_dummy_weights_are_one_model_at_tp1_and_tp2,
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


def test_dummy_weights_are_the_same_model_at_tp1_and_tp2(root):
    """Every fp8 weight (attention and experts) is drawn whole and cut per rank, as a checkpoint's is."""
    assert_dummy_weights_are_one_model_at_tp1_and_tp2(_copy_without_weights(root, "hf-block", "block-dummy"))


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


def test_the_plan_of_qwen3_30b_a3b_fp8_fits_two_24gb_gpus_and_refuses_volta(capsys):
    """examples/models/qwen3-30b-a3b-fp8 (Qwen's [128, 128] block config) from config.json alone: 28.71
    GiB of fp8 layers, tensor parallel 2 on two 24 GB Ada or Ampere GPUs (W8A16 on the weights' bytes
    there); on Volta (7.0) refused before loading."""
    from fitserve.cli.plan import run_plan
    from tests.unit.test_planner_cli import parse
    from tests.unit.test_qwen3_moe import EXAMPLES

    folder = str(EXAMPLES / "qwen3-30b-a3b-fp8")
    assert run_plan(parse("plan", [folder, "--assume-gpus", "2x24@8.9"])) == 0
    out = capsys.readouterr().out
    assert "fp8 28.71 GiB as stored, 1/2 per GPU" in out and "tensor_parallel_size     2" in out
    assert run_plan(parse("plan", [folder, "--assume-gpus", "2x24@8.6"])) == 0
    from fitserve.planner.fit_errors import PlanError

    with pytest.raises(
        PlanError, match=r"fp8 MoE experts .* run on GPUs of compute capability 7\.5 and up.*has 7\.0"
    ):
        run_plan(parse("plan", [folder, "--assume-gpus", "2x32@7.0"]))


@functools.cache
def bf16_checkpoint(form: str, root: str) -> tuple[Path, torch.nn.Module]:
    """A 16-bit checkpoint of the same model, its experts fused (transformers 5's `gate_up_proj`) or one
    tensor per expert and projection (the hub's form), and the HF reference with what --quantization fp8
    makes of it: attention and every expert projection rounded to fp8 with one scale a row (written from
    the format's definition, tests/fp8_checkpoints.py)."""
    config = tiny_hf_config("Qwen3MoeForCausalLM", **MOE, norm_topk_prob=True)
    hf_model = build_hf_model(config, seed=3)
    per_channel = Fp8Spec("ct", "channel")
    folder = Path(root) / f"bf16-{form}"
    quantize = fp8_quantizer(per_channel)

    def as_stored(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {".weight": weight}, quantize(module, weight)[1]  # 16-bit in the file, fp8 in the reference

    write_quantized_moe(folder, hf_model, as_stored, None)
    tensors = load_file(str(folder / "model.safetensors"))
    if form == "fused":
        state = hf_model.state_dict()
        tensors = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
        tensors.update(
            {n: t.contiguous() for n, t in state.items() if n.endswith(("gate_up_proj", "down_proj"))}
        )
    save_file(tensors, str(folder / "model.safetensors"))
    reference = write_quantized_moe(
        Path(root) / f"ref-{form}", hf_model, quantize, quantization_config(per_channel)
    )
    return folder, reference


@pytest.mark.parametrize("form", ["fused", "per_expert"])
def test_quantization_fp8_on_a_16bit_moe_quantizes_its_experts_while_loading(root, form):
    """vLLM's `--quantization fp8` on a bf16 Qwen3-MoE: the experts become fp8 as they load (one scale a
    row), and the engine decodes as HF does with those weights."""
    folder, reference = bf16_checkpoint(form, root)
    llm = make_llm(folder, quantization="fp8")
    experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Fp8FusedExperts" and experts.w13_scale.shape[-1] == 1
    assert_follows_the_reference(llm, reference)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["intermediate_split", "expert_parallel"])
def test_quantization_fp8_experts_of_two_ranks_sum_to_one_ranks(expert_parallel):
    """The fused 16-bit experts quantized while loading on each of two ranks (each its experts, or its
    slice of every expert's intermediate columns) give, summed, what one rank's give: each row is quantized
    whole before it is cut. (The engine's TP 2 differs from TP 1 under --quantization fp8 through the
    attention's o_proj, whose rows each rank quantizes over its own columns.)"""
    from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel
    from fitserve.layers.moe_fp8 import Fp8FusedExperts
    from fitserve.layers.quantization.fp8_format import on_load_format

    generator = torch.Generator().manual_seed(4)
    gate_up, down = torch.randn(8, 128, 64, generator=generator), torch.randn(8, 64, 64, generator=generator)

    def loaded(rank: int, size: int) -> Fp8FusedExperts:
        set_tensor_parallel(TensorParallel(rank, size))
        try:
            silu = torch.nn.functional.silu
            experts = Fp8FusedExperts(8, 64, 64, silu, on_load_format(), "experts", expert_parallel)
        finally:
            set_tensor_parallel(TensorParallel())
        experts.load_fused("gate_up_proj", gate_up)
        experts.load_fused("down_proj", down)
        assert experts.missing() == []
        return experts

    x = torch.randn(5, 64, generator=generator)
    ids = torch.randint(0, 8, (5, 2), generator=generator)
    weights = torch.rand(5, 2, generator=generator)
    whole = loaded(0, 1)(x, ids, weights, reduce=False)
    parts = sum(loaded(rank, 2)(x, ids, weights, reduce=False) for rank in range(2))
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-4)  # a split sum: float32 rounding


@pytest.mark.parametrize("sm", ["8.9", "8.6"])
def test_the_plan_offers_quantization_fp8_for_the_bf16_moe_where_it_runs(sm):
    """The bf16 Qwen3-30B-A3B on one 48 GB GPU does not fit; `--quantization fp8` does (29.11 GiB), and is
    offered as fitserve's on Ada / Hopper and on Ampere (W8A16 there)."""
    from fitserve.cli.plan import run_plan
    from fitserve.planner.fit_errors import PlanError
    from tests.unit.test_planner_cli import parse
    from tests.unit.test_qwen3_moe import EXAMPLES

    with pytest.raises(PlanError) as error:
        run_plan(parse("plan", [str(EXAMPLES / "qwen3-30b-a3b"), "--assume-gpus", f"1x48@{sm}"]))
    line = next(
        line for line in str(error.value).splitlines() if line.strip().startswith("--quantization fp8")
    )
    assert "weights 29.11 GiB per GPU" in line and "vLLM runs them" not in line


def test_expert_tensors_of_the_wrong_shape_are_refused_naming_them():
    """A weight must be [N, K], a block scale [N / bn, K / bk]; only a per-channel scale may be [N]."""
    from fitserve.layers.moe_fp8 import Fp8FusedExperts
    from fitserve.layers.quantization.fp8_format import Fp8Format

    silu = torch.nn.functional.silu
    block = Fp8FusedExperts(8, 64, 64, silu, Fp8Format("fp8", "block", (32, 32)), "experts")
    with pytest.raises(
        ValueError, match=r"experts\.0\.gate_proj\.weight has shape \(64,\), expected \(64, 64\)"
    ):
        block.load_tensor(0, "gate_proj", "weight", torch.zeros(64, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2,\), expected \(2, 2\)"):
        block.load_tensor(0, "gate_proj", "weight_scale_inv", torch.ones(2))
    channel = Fp8FusedExperts(8, 64, 64, silu, Fp8Format("compressed-tensors", "channel"), "experts")
    channel.load_tensor(0, "down_proj", "weight", torch.zeros(64, 64, dtype=torch.float8_e4m3fn))
    channel.load_tensor(0, "down_proj", "weight_scale", torch.full((64,), 0.5))  # [N]: taken as [N, 1]
    assert (channel.w2_scale[0] == 0.5).all() and "experts.0.down_proj" not in channel.missing()


def test_expert_scales_stay_float32_in_a_16bit_model():
    """The loader builds a bf16 model with bf16 as torch's default dtype; the kernels read float32 scales
    (fused_moe_fp8.check_inputs refuses any other), so the scale buffers must not follow the default."""
    from fitserve.kernels.fused_moe_fp8 import Fp8Experts, check_inputs
    from fitserve.layers.moe_fp8 import Fp8FusedExperts
    from fitserve.layers.quantization.fp8_format import Fp8Format

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        silu = torch.nn.functional.silu
        experts = Fp8FusedExperts(8, 64, 64, silu, Fp8Format("fp8", "block", (32, 32)), "experts")
        experts.initialize_dummy(seed=0, std=0.05)
    finally:
        torch.set_default_dtype(previous)
    assert experts.w13_scale.dtype == experts.w2_scale.dtype == torch.float32
    gate_up = Fp8Experts(experts.w13, experts.w13_scale, experts.group_up)
    down = Fp8Experts(experts.w2, experts.w2_scale, experts.group_down)
    tokens = torch.zeros(3, 64, dtype=torch.bfloat16)
    check_inputs(tokens, gate_up, down, torch.zeros(3, 2, dtype=torch.int32))  # raises on a bf16 scale
