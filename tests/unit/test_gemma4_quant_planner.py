"""Quantized Gemma-4 without weight files: the planner counts a quantized checkpoint's stored bytes from
config.json's shapes (planner/gemma4_shape.py), here checked against numbers derived independently: by
hand for the 31B with a compressed-tensors W4A16 group-128 block (examples/models/gemma-4-31b-it-awq-int4,
a reconstructed config), and from the tensors a tiny E model's and MoE's int4 checkpoints really hold.
The 31B builds on the meta device with its ignore list honoured; the 26B-A4B's int4 experts are counted
where its ignore list leaves them quantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fitserve.cli.plan import run_plan
from fitserve.layers.linear import UnquantizedLinearMethod
from fitserve.layers.quantization.int4_method import Int4LinearMethod
from fitserve.layers.quantization.methods import stored_from_config
from fitserve.layers.quantization.quant_config import quant_format
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from fitserve.planner.model_info import inspect_model
from fitserve.planner.quantized_checkpoint import check_quantized_checkpoint
from tests.quant_checkpoints import QuantSpec
from tests.unit.gemma4_quant_helpers import GROUP, build_model, int4_ignore, write_int4
from tests.unit.test_planner_cli import parse
from tests.unit.tp_helpers import on_rank

EXAMPLES = Path(__file__).parents[2] / "examples" / "models"
INT4_31B = EXAMPLES / "gemma-4-31b-it-awq-int4"
BF16_31B = EXAMPLES / "gemma-4-31b-it"

# gemma-4-31B: hidden 5376, MLP 21504, 32 heads; 50 sliding layers (16 KV heads of 256: q, k, v, o) and 10
# full ones (4 KV heads of 512, K=V: q, k, o); all int4 but the LM head (tied) and the vision tower.
HIDDEN, MLP = 5376, 21_504
SLIDING = HIDDEN * (32 * 256 + 2 * 16 * 256) + 32 * 256 * HIDDEN
FULL = HIDDEN * (32 * 512 + 4 * 512) + 32 * 512 * HIDDEN
QUANTIZED_PARAMS = 50 * SLIDING + 10 * FULL + 60 * 3 * HIDDEN * MLP
QUANTIZED_LAYERS = 50 * 7 + 10 * 6
# pack-quantized symmetric int4, group 128: half a byte a weight, a float16 scale a group, weight_shape
STORED_BYTES = QUANTIZED_PARAMS // 2 + QUANTIZED_PARAMS // 128 * 2 + QUANTIZED_LAYERS * 16


def test_the_planner_counts_the_31b_int4_bytes():
    config = CheckpointConfig.from_folder(INT4_31B)
    assert stored_from_config(quant_format(config), config) == (QUANTIZED_PARAMS, STORED_BYTES)
    assert STORED_BYTES == 15_100_975_520  # about 29.3 B x 0.5 bytes, plus the scales


def test_dummy_weights_inventory_holds_the_rest_at_16_bits():
    """--load-format dummy: the int4 projections at their stored bytes, the rest (the tied embedding,
    norms) as 16-bit parameters: together the bf16 31B's parameters."""
    weights = inspect_model(str(INT4_31B), load_format="dummy").weights
    whole = inspect_model(str(BF16_31B), load_format="dummy").weights.counts.total
    assert weights.stored_bytes == STORED_BYTES
    assert weights.counts.total == whole - QUANTIZED_PARAMS
    table = 262_144 * HIDDEN
    assert table < weights.counts.total < table + 2_000_000  # + the norms and layer scalars


def test_plan_reports_the_int4_bytes(capsys):
    argv = [str(INT4_31B), "--assume-gpus", "1x79.19@9.0", "--max-model-len", "8192"]
    assert run_plan(parse("plan", argv)) == 0
    out = capsys.readouterr().out
    assert f"compressed-tensors int4 {STORED_BYTES / 2**30:.2f} GiB as stored" in out
    assert "29.29 B quantized" in out


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_the_31b_int4_model_builds_with_its_ignore_list(tensor_parallel_size):
    """Built on the meta device: every decoder linear int4 (K=V full layers' qkv holds q and k), the LM
    head 16-bit; at TP 2 each rank's o_proj input is whole groups of 128."""
    config = CheckpointConfig.from_folder(INT4_31B)
    with on_rank(tensor_parallel_size - 1, tensor_parallel_size), torch.device("meta"):
        model = get_model_class(config)(config)
    methods = [m.linear_method for m in model.model.modules() if hasattr(m, "linear_method")]
    assert len(methods) == 60 * 4 and all(isinstance(method, Int4LinearMethod) for method in methods)
    assert isinstance(
        getattr(model.lm_head, "linear_method", UnquantizedLinearMethod()), UnquantizedLinearMethod
    )
    assert model.model.layers[5].self_attn.qkv_proj.shard_ids == ("q", "k")
    assert model.model.layers[5].self_attn.o_proj.input_size_per_rank == 16_384 // tensor_parallel_size


def _stored_in_files(folder: Path, modules: list[str]) -> tuple[int, int]:
    """(parameters, bytes) of the quantized modules' tensors as the checkpoint file holds them."""
    params = stored = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
            module = name.rsplit(".", 1)[0]
            if module in modules:
                tensor = handle.get_tensor(name)
                stored += tensor.numel() * tensor.element_size()
                if name.endswith("weight_shape"):
                    params += int(tensor.prod())
    return params, stored


@pytest.mark.parametrize("case", ["e_model", "moe_k_eq_v"])
def test_config_bytes_equal_the_checkpoints_tensors(case, tmp_path):
    """A tiny compressed-tensors int4 checkpoint (ConditionalGeneration form: the E model's per-layer
    gate, projection and model projection, KV-shared layers' q-only attention; the MoE's attention and
    dense MLP, its router and experts ignored): the config's count equals its files'."""
    checkpoint = write_int4(
        tmp_path,
        build_model(case, conditional=True, seed=9),
        QuantSpec("ct", GROUP, ignore=int4_ignore("ct")),
    )
    config = CheckpointConfig.from_folder(checkpoint.folder)
    want = _stored_in_files(checkpoint.folder, checkpoint.quantized)
    assert want[0] > 0
    assert stored_from_config(quant_format(config), config) == want


def test_the_plan_counts_int4_experts(tmp_path):
    """The 26B-A4B's config with the 31B's W4A16 block: groups of 128 do not divide the dense MLP's 2112
    inputs (nor the experts' 704), refused naming the module; at groups of 32 the plan's check passes and
    counts the experts int4 where the ignore list leaves them quantized, 16-bit where it names them."""
    raw = json.loads((EXAMPLES / "gemma-4-26b-a4b-it" / "config.json").read_text())
    quant = json.loads((INT4_31B / "config.json").read_text())["quantization_config"]
    raw["quantization_config"] = quant
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError, match=r"group_size=128 does not divide .*layers\.0\.mlp\.down_proj's input dim 2112"
    ):
        check_quantized_checkpoint(inspect_model(str(tmp_path), load_format="dummy"), None)
    group = quant["config_groups"]["group_0"]
    groups = {"group_0": dict(group, weights=dict(group["weights"], group_size=32))}
    # 30 layers' attention (25 sliding: q, k, v, o; 5 full K=V: q, k, o) and dense MLP
    sliding = 2816 * (16 * 256 + 2 * 8 * 256) + 16 * 256 * 2816
    full = 2816 * (16 * 512 + 2 * 512) + 16 * 512 * 2816
    params = 25 * sliding + 5 * full + 30 * 3 * 2816 * 2112
    modules = 25 * 7 + 5 * 6
    experts = 30 * 128 * 3 * 2816 * 704  # 128 experts a layer, gate, up and down of 704
    for ignored, want_params, want_modules in (
        (["re:.*router.*", "re:.*experts.*"], params, modules),
        (["re:.*router.*"], params + experts, modules + 30 * 128 * 3),
    ):
        raw["quantization_config"] = dict(quant, ignore=[*quant["ignore"], *ignored], config_groups=groups)
        (tmp_path / "config.json").write_text(json.dumps(raw))
        model = inspect_model(str(tmp_path), load_format="dummy")
        assert check_quantized_checkpoint(model, None) is not None
        # codes at half a byte, a float16 scale per 32, each module's weight_shape (2 int64)
        want = want_params // 2 + want_params // 32 * 2 + want_modules * 16
        assert model.weights.stored_bytes == want
