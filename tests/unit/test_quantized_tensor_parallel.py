"""Quantized checkpoints split across tensor-parallel ranks: every format's layers built for rank 0 and 1
of 2 (set_tensor_parallel, no process group) load the same WHOLE checkpoint tensors as a single-rank
layer, and on the CPU
- column-parallel layers: each rank's output columns (per shard of a fused q/k/v or gate/up layer, KV
  heads replicated when there are fewer than ranks) equal the single-rank layer's rows it holds;
- row-parallel layers: the ranks' partial outputs (linear_method.apply, no all-reduce; the bias is held
  by rank 0 only) sum to the single-rank output.
A rank whose input columns do not start on a group / block boundary is refused, naming the sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel
from fitserve.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from fitserve.layers.quantization.bnb_format import param_name, quantize_while_loading_format
from fitserve.layers.quantization.fp8_format import on_load_format
from fitserve.layers.quantization.fp8_weight import dequantize as dequantize_fp8
from fitserve.layers.quantization.fp8_weight import quantize_fp8
from fitserve.layers.quantization.method_base import QuantizedLinearMethod
from fitserve.layers.quantization.methods import method_class
from fitserve.layers.quantization.quant_config import quant_format
from tests import bnb_checkpoints, fp8_checkpoints, quant_checkpoints
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec

HIDDEN, HEAD_DIM, HEADS = 256, 64, 4
TP = 2
Tensors = dict[str, torch.Tensor]


@pytest.fixture(autouse=True)
def single_rank_after():
    yield
    set_tensor_parallel(TensorParallel())


# --- checkpoint tensors of one projection, by the parameter names the layers load them into ---


def int4_tensors(spec: QuantSpec, weight: torch.Tensor, g_idx: torch.Tensor | None = None) -> Tensors:
    if g_idx is None:
        rounded = quant_checkpoints.round_to_int4(weight, spec, seed=7)  # one seed: fused shards share g_idx
    else:
        rounded = quant_checkpoints.round_to_int4_groups(weight, spec, g_idx)
    return quant_checkpoints.pack_tensors(rounded, spec)


def fp8_tensors(spec: Fp8Spec, weight: torch.Tensor) -> Tensors:
    data, scale, _ = fp8_checkpoints.quantize(weight, spec)
    name = "weight_scale_inv" if spec.fmt == "hf" and spec.strategy == "block" else "weight_scale"
    tensors = {"weight": data, name: scale.float()}
    if spec.activations == "static":
        tensors["input_scale"] = torch.tensor([0.02] if spec.fmt == "ct" else 0.02)
    return tensors


def bnb_tensors(spec: BnbSpec, weight: torch.Tensor) -> Tensors:
    parts, _ = bnb_checkpoints.quantize_spec(weight, spec)
    return {param_name("m.weight" + suffix).removeprefix("m."): value for suffix, value in parts.items()}


def sixteen_bit(weight: torch.Tensor) -> Tensors:
    return {"weight": weight.to(torch.bfloat16)}


def config_format(quantization_config: dict[str, Any] | None, flag: str | None = None) -> Any:
    return quant_format(SimpleNamespace(quantization_config=quantization_config), flag)


INT4 = [
    QuantSpec("gptq", 32),
    QuantSpec("gptq", 64, sym=False),
    QuantSpec("gptq_v2", 32, sym=False),
    QuantSpec("gptq", -1),
    QuantSpec("autoround", 32, sym=False),
    QuantSpec("awq", 32, sym=False),
    QuantSpec("awq", -1, sym=False),
    QuantSpec("ct", 32),
    QuantSpec("ct", 64, sym=False),
    QuantSpec("ct", 32, sym=False, packed_zero_point=False),
    QuantSpec("ct", -1, sym=False),
]
FP8 = [
    Fp8Spec("ct", "tensor"),
    Fp8Spec("ct", "channel", "static"),
    Fp8Spec("ct", "block", block=(32, 32)),
    Fp8Spec("hf", "tensor", "static"),
    Fp8Spec("hf", "block", block=(128, 128)),
]
BNB = [BnbSpec("nf4"), BnbSpec("nf4", double_quant=True), BnbSpec("fp4", double_quant=True, blocksize=128)]


def spec_cases(
    specs: list[Any],
    quantization_config: Callable[[Any], dict[str, Any]],
    tensors: Callable[[Any, torch.Tensor], Tensors],
    id_prefix: str,
) -> list[Any]:
    """(format, the tensors of one projection from its float32 weight) of each spec, with a test id."""
    return [
        pytest.param(
            config_format(quantization_config(spec)),
            lambda w, spec=spec: tensors(spec, w),
            id=id_prefix + spec.name,
        )
        for spec in specs
    ]


CASES: list[Any] = [
    *spec_cases(INT4, quant_checkpoints.quantization_config, int4_tensors, ""),
    *spec_cases(FP8, fp8_checkpoints.quantization_config, fp8_tensors, "fp8-"),
    *spec_cases(BNB, bnb_checkpoints.bnb_quantization_config, bnb_tensors, "bnb-"),
    pytest.param(config_format(None, "bitsandbytes"), sixteen_bit, id="bnb-quantize-while-loading"),
]


# --- layers of one rank, loaded with whole checkpoint tensors ---


def build(make: Callable[[Any], LinearBase], fmt: Any, rank: int, size: int) -> LinearBase:
    set_tensor_parallel(TensorParallel(rank, size, None))
    try:
        return make(method_class(fmt)(fmt, "layer"))
    finally:
        set_tensor_parallel(TensorParallel())


def load(layer: LinearBase, shards: dict[Any, Tensors], biases: dict[Any, torch.Tensor]) -> None:
    """As the model loader does: each checkpoint tensor through its parameter's loader, the parameters
    looked up before (a layer drops them once it is runnable; a late optional g_idx still arrives)."""
    params = dict(layer.named_parameters())
    for shard_id, tensors in shards.items():
        for name, tensor in tensors.items():
            params[name].weight_loader(params[name], tensor, shard_id)
        if shard_id in biases:
            params["bias"].weight_loader(params["bias"], biases[shard_id], shard_id)


def random_weight(rows: int, columns: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)) / 10


def whole_checkpoint(
    shapes: dict[Any, tuple[int, int]], tensors_of: Callable[[torch.Tensor], Tensors], bias: bool
) -> tuple[dict[Any, Tensors], dict[Any, torch.Tensor]]:
    shards = {
        shard: tensors_of(random_weight(*shape, seed=i)) for i, (shard, shape) in enumerate(shapes.items())
    }
    biases = {shard: torch.randn(rows) / 10 for shard, (rows, _) in shapes.items()} if bias else {}
    return shards, biases


def qkv(kv_heads: int) -> Callable[[Any], LinearBase]:
    return lambda method: QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, kv_heads, True, method)


def shapes_of(**rows: int) -> dict[Any, tuple[int, int]]:
    return {int(k) if k.isdigit() else (None if k == "whole" else k): (n, HIDDEN) for k, n in rows.items()}


COLUMN_LAYERS = {
    "qkv": (qkv(2), shapes_of(q=HEADS * HEAD_DIM, k=2 * HEAD_DIM, v=2 * HEAD_DIM)),
    "qkv-replicated-kv": (qkv(1), shapes_of(q=HEADS * HEAD_DIM, k=HEAD_DIM, v=HEAD_DIM)),
    "gate-up": (
        lambda method: MergedColumnParallelLinear(HIDDEN, [512, 512], False, method),
        {0: (512, HIDDEN), 1: (512, HIDDEN)},
    ),
    "column": (lambda method: ColumnParallelLinear(HIDDEN, 384, True, method), shapes_of(whole=384)),
}


def full_rows(layer: LinearBase, shard_id: Any, rank_layer: LinearBase) -> slice:
    """The single-rank layer's output columns that `rank_layer` holds of shard `shard_id`."""
    if shard_id is None:
        size = rank_layer.output_size_per_rank
        return slice(rank_layer.tp_rank * size, (rank_layer.tp_rank + 1) * size)
    start = layer.full_shard_offsets[shard_id][0] if hasattr(layer, "full_shard_offsets") else 0
    first, size = rank_layer.shard_rank_rows(shard_id)
    return slice(start + first, start + first + size)


def rank_columns(rank_layer: LinearBase, shard_id: Any) -> slice:
    if shard_id is None:
        return slice(None)
    start, size = rank_layer.shard_offsets[shard_id]
    return slice(start, start + size)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-4) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale)


def assert_ranks_hold_the_single_rank_rows(
    make: Callable[[Any], LinearBase],
    shapes: dict[Any, tuple[int, int]],
    fmt: Any,
    shards: dict[Any, Tensors],
    biases: dict[Any, torch.Tensor],
) -> None:
    """Each of the TP column-parallel ranks' output columns (per shard) equal the single-rank layer's rows
    it holds, every layer loaded with the whole checkpoint."""
    x = torch.randn(3, HIDDEN)
    whole = build(make, fmt, 0, 1)
    load(whole, shards, biases)
    expected = whole(x)
    for rank in range(TP):
        layer = build(make, fmt, rank, TP)
        load(layer, shards, biases)
        out = layer(x)
        assert out.shape[-1] == layer.output_size_per_rank
        for shard_id in shapes:
            assert_close(
                out[:, rank_columns(layer, shard_id)], expected[:, full_rows(whole, shard_id, layer)]
            )


@pytest.mark.parametrize("kind", list(COLUMN_LAYERS))
@pytest.mark.parametrize(("fmt", "tensors_of"), CASES)
def test_column_parallel_ranks_hold_the_single_rank_rows(fmt, tensors_of, kind) -> None:
    make, shapes = COLUMN_LAYERS[kind]
    shards, biases = whole_checkpoint(shapes, tensors_of, bias=kind != "gate-up")
    assert_ranks_hold_the_single_rank_rows(make, shapes, fmt, shards, biases)


def row_parallel(columns: int) -> Callable[[Any], LinearBase]:
    return lambda method: RowParallelLinear(columns, HIDDEN, True, method)


def ranks_summed(fmt: Any, columns: int, shards: dict[Any, Tensors], biases: dict, x: torch.Tensor):
    """The row-parallel ranks' partial outputs summed (the all-reduce), each applied to its columns of x."""
    total = torch.zeros(x.shape[0], HIDDEN)
    for rank in range(TP):
        layer = build(row_parallel(columns), fmt, rank, TP)
        load(layer, shards, biases)
        own = x[:, rank * columns // TP : (rank + 1) * columns // TP]
        total += layer.linear_method.apply(layer, own)
    return total


@pytest.mark.parametrize(("fmt", "tensors_of"), CASES)
def test_row_parallel_ranks_sum_to_the_single_rank_output(fmt, tensors_of) -> None:
    columns = 512
    shards, biases = whole_checkpoint({None: (HIDDEN, columns)}, tensors_of, bias=True)
    x = torch.randn(3, columns)
    whole = build(row_parallel(columns), fmt, 0, 1)
    load(whole, shards, biases)
    assert_close(ranks_summed(fmt, columns, shards, biases, x), whole(x))


def test_quantized_methods_refuse_tensor_parallel_unless_they_split() -> None:
    class NotSplitting(QuantizedLinearMethod):
        def create_weights(self, layer, input_size, output_size, bias) -> None:
            raise AssertionError("not reached")

    assert QuantizedLinearMethod.splits_for_tensor_parallel is False
    set_tensor_parallel(TensorParallel(0, TP, None))
    with pytest.raises(ValueError, match="NotSplitting weights do not split across ranks"):
        RowParallelLinear(512, HIDDEN, False, NotSplitting(None))


# --- formats whose rank split changes the quantization: quantized after the split ---


def test_fp8_quantize_while_loading_quantizes_each_rank_part() -> None:
    fmt = config_format(None, "fp8")
    assert fmt == on_load_format()
    columns = 512
    shards, biases = whole_checkpoint({None: (HIDDEN, columns)}, sixteen_bit, bias=True)
    x = torch.randn(3, columns)
    # rows split: per-channel scales are the whole layer's
    make = COLUMN_LAYERS["column"][0]
    column_shards, column_biases = whole_checkpoint({None: (384, HIDDEN)}, sixteen_bit, bias=True)
    whole = build(make, fmt, 0, 1)
    load(whole, column_shards, column_biases)
    h = torch.randn(3, HIDDEN)
    outs = []
    for rank in range(TP):
        layer = build(make, fmt, rank, TP)
        load(layer, column_shards, column_biases)
        outs.append(layer(h))
    assert_close(torch.cat(outs, dim=-1), whole(h))
    # columns split: each rank's rows are quantized over its own columns
    weight = shards[None]["weight"].float()
    expected = biases[None].clone()
    for rank in range(TP):
        part = slice(rank * columns // TP, (rank + 1) * columns // TP)
        expected = expected + x[:, part] @ dequantize_fp8(quantize_fp8(weight[:, part])).t()
    assert_close(ranks_summed(fmt, columns, shards, biases, x), expected)


# --- GPTQ act order ---


ACT_ORDER = [QuantSpec("gptq", 32, sym=False, act_order=True), QuantSpec("ct", 32, act_order=True)]


@pytest.mark.parametrize("spec", ACT_ORDER, ids=lambda spec: spec.name)
def test_act_order_column_parallel_keeps_the_whole_g_idx(spec) -> None:
    fmt = config_format(quant_checkpoints.quantization_config(spec))
    make, shapes = COLUMN_LAYERS["qkv"]
    shards, biases = whole_checkpoint(shapes, lambda w: int4_tensors(spec, w), bias=True)
    assert_ranks_hold_the_single_rank_rows(make, shapes, fmt, shards, biases)


@pytest.mark.parametrize("spec", ACT_ORDER, ids=lambda spec: spec.name)
def test_act_order_row_parallel_runs_when_each_group_lies_in_one_rank(spec) -> None:
    fmt = config_format(quant_checkpoints.quantization_config(spec))
    columns = 512
    # groups permuted within each rank's half of the columns
    halves = [torch.randperm(columns // TP, generator=torch.Generator().manual_seed(r)) for r in range(TP)]
    g_idx = torch.cat([half // 32 + r * (columns // TP // 32) for r, half in enumerate(halves)])
    shards, biases = whole_checkpoint({None: (HIDDEN, columns)}, lambda w: int4_tensors(spec, w, g_idx), True)
    x = torch.randn(3, columns)
    whole = build(row_parallel(columns), fmt, 0, 1)
    load(whole, shards, biases)
    assert_close(ranks_summed(fmt, columns, shards, biases, x), whole(x))


@pytest.mark.parametrize("spec", ACT_ORDER, ids=lambda spec: spec.name)
def test_act_order_row_parallel_refuses_groups_spanning_ranks(spec) -> None:
    fmt = config_format(quant_checkpoints.quantization_config(spec))
    shards, biases = whole_checkpoint({None: (HIDDEN, 512)}, lambda w: int4_tensors(spec, w), bias=True)
    layer = build(row_parallel(512), fmt, 1, TP)
    with pytest.raises(
        ValueError, match=r"act order .* on a row-parallel layer: this rank's 256 input columns"
    ):
        load(layer, shards, biases)


# --- refusals: a rank's columns must start on a group / block boundary ---


REFUSED = [
    pytest.param(QuantSpec("gptq", 64), lambda s, w: int4_tensors(s, w), "group", id="gptq-g64"),
    pytest.param(QuantSpec("awq", 64, sym=False), lambda s, w: int4_tensors(s, w), "group", id="awq-g64"),
    pytest.param(QuantSpec("ct", 64), lambda s, w: int4_tensors(s, w), "group", id="ct-g64"),
    pytest.param(
        Fp8Spec("hf", "block", block=(128, 128)), fp8_tensors, "128x128 scale block", id="fp8-block"
    ),
    pytest.param(BnbSpec("nf4", blocksize=64), bnb_tensors, "bitsandbytes block", id="bnb-b64"),
]


def spec_format(spec: Any) -> Any:
    if isinstance(spec, QuantSpec):
        return config_format(quant_checkpoints.quantization_config(spec))
    if isinstance(spec, Fp8Spec):
        return config_format(fp8_checkpoints.quantization_config(spec))
    return config_format(bnb_checkpoints.bnb_quantization_config(spec))


@pytest.mark.parametrize(("spec", "tensors_of", "unit"), REFUSED)
def test_row_parallel_columns_off_a_group_boundary_are_refused(spec, tensors_of, unit) -> None:
    columns = 192 if not isinstance(spec, Fp8Spec) else 384  # 96 (or 192) columns a rank
    per_rank = columns // TP
    shards, biases = whole_checkpoint({None: (HIDDEN, columns)}, lambda w: tensors_of(spec, w), bias=False)
    message = (
        rf"each rank holds {per_rank} input columns \({columns} / tensor_parallel_size 2\), not a multiple "
        rf"of the \d+ columns of [^:]*{unit}.*smaller --tensor-parallel-size"
    )
    with pytest.raises(ValueError, match=message):  # int4, fp8 blocks: as the layer is built
        load(build(row_parallel(columns), spec_format(spec), 0, TP), shards, biases)


def test_bnb_quantize_while_loading_refuses_columns_off_a_block() -> None:
    fmt = quantize_while_loading_format()
    with pytest.raises(ValueError, match=r"96 input columns .* not a multiple of the 64 columns"):
        build(row_parallel(192), fmt, 1, TP)


def test_fused_quantized_tensor_is_refused_under_tensor_parallel() -> None:
    spec = QuantSpec("gptq", 32)
    fmt = config_format(quant_checkpoints.quantization_config(spec))
    layer = build(COLUMN_LAYERS["gate-up"][0], fmt, 0, TP)
    fused = int4_tensors(spec, random_weight(1024, HIDDEN, 0))
    with pytest.raises(ValueError, match="fused projections of a quantized layer as one tensor"):
        layer.qweight.weight_loader(layer.qweight, fused["qweight"], None)


# --- through the engine: TP 2 ranks (gloo, one process each) load a tiny checkpoint as TP 1 does ---


ENGINE_DIMS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
ENGINE_PROMPTS = [[5, 17, 33, 2, 90], list(range(40, 60))]


def greedy_with_logprobs(folder, **kwargs) -> list[tuple[list[int], list[dict]]]:
    from fitserve import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=8, **kwargs)
    try:
        sampling = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
        outputs = llm.generate([{"prompt_token_ids": p} for p in ENGINE_PROMPTS], sampling, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
    finally:
        llm.engine.shutdown()


def write_checkpoint(spec: Any, folder, hf_model) -> Any:
    if isinstance(spec, QuantSpec):
        return quant_checkpoints.write_quantized(folder, hf_model, spec)
    if isinstance(spec, Fp8Spec):
        return fp8_checkpoints.write_fp8(folder, hf_model, spec)
    return bnb_checkpoints.write_bnb(folder, hf_model, spec)


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("gptq", 32, sym=False),
        QuantSpec("awq", 32, sym=False),
        Fp8Spec("ct", "block"),
        BnbSpec("nf4"),
    ],
    ids=lambda spec: type(spec).__name__ + "-" + spec.name,
)
def test_engine_tp2_greedy_equals_tp1(spec, tmp_path) -> None:
    from tests.unit.model_helpers import build_hf_model, tiny_hf_config

    hf_model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **ENGINE_DIMS), seed=7)
    folder = write_checkpoint(spec, tmp_path / "checkpoint", hf_model).folder
    expected = greedy_with_logprobs(folder)
    got = greedy_with_logprobs(folder, tensor_parallel_size=2)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected, strict=True):
        for position_ours, position_theirs in zip(ours, theirs, strict=True):
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < 1e-3
