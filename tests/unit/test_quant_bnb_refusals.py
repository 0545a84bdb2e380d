"""bitsandbytes inputs fitserve does not run, each refused with the value, the limit and the fix: 8-bit and
unknown 4-bit types from config.json, and damaged checkpoints (missing quant_state, a truncated code
tensor, an absmax whose length gives no block size fitserve runs, double-quant tensors the config does not
announce) from the safetensors headers, all before any weight loads (plan_settings reads headers only);
a quant_state whose block size contradicts its absmax, at load, naming the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fitserve import LLM
from fitserve.args import EngineArgs
from fitserve.planner.resolve import PlanRequest, plan_settings
from tests.bnb_checkpoints import BnbSpec, write_bnb
from tests.unit.model_helpers import build_hf_model, tiny_hf_config

DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
DOWN = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return build_hf_model(tiny_hf_config("LlamaForCausalLM", **DIMS), seed=5)


def checkpoint(tmp_path: Path, hf_model, spec: BnbSpec = BnbSpec("nf4")) -> Path:
    return write_bnb(tmp_path / spec.name, hf_model, spec).folder


def plan(folder: Path, **kwargs) -> None:
    plan_settings(EngineArgs(model=str(folder), device="cpu", dtype="float32", **kwargs), PlanRequest())


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_8bit_is_refused_with_the_closest_that_runs(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model)
    edit_config(folder, load_in_4bit=False, _load_in_4bit=False, load_in_8bit=True, _load_in_8bit=True)
    with pytest.raises(ValueError, match=r"load_in_8bit=true.*not supported.*--quantization bitsandbytes"):
        plan(folder)


def test_unknown_4bit_type_is_refused(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model)
    edit_config(folder, bnb_4bit_quant_type="int4")
    with pytest.raises(ValueError, match=r"bnb_4bit_quant_type='int4': fitserve runs nf4 and fp4"):
        plan(folder)


def test_missing_quant_state_is_refused_before_loading(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model)
    edit_tensors(folder, lambda tensors: tensors.pop(f"{DOWN}.quant_state.bitsandbytes__nf4"))
    with pytest.raises(ValueError, match=r"down_proj.weight has no quant_state tensor.*re-save it"):
        plan(folder)


def test_truncated_codes_are_refused_before_loading(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model)
    edit_tensors(folder, lambda tensors: tensors.update({DOWN: tensors[DOWN][:-64].clone()}))
    with pytest.raises(
        ValueError, match=r"down_proj.weight holds 16320 bytes of codes, expected 16384.*again"
    ):
        plan(folder)


def test_block_size_fitserve_does_not_run_is_refused_before_loading(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model)
    # 128 x 256 weights in 683 blocks: no block size divides that evenly
    edit_tensors(folder, lambda tensors: tensors.update({f"{DOWN}.absmax": torch.ones(683)}))
    with pytest.raises(ValueError, match=r"683 block scales.*block sizes 32, 64.*blocksize 64"):
        plan(folder)


def test_double_quant_tensors_the_config_does_not_announce(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model, BnbSpec("nf4", double_quant=True))
    edit_config(folder, bnb_4bit_use_double_quant=False)
    with pytest.raises(ValueError, match=r"has nested_absmax \(double quant\).*use_double_quant is false"):
        plan(folder)


def test_quant_state_block_size_contradicting_absmax_is_refused_at_load(tmp_path, hf_model) -> None:
    folder = checkpoint(tmp_path, hf_model)
    key = f"{DOWN}.quant_state.bitsandbytes__nf4"

    def claim_128(tensors) -> None:
        state = json.loads(bytes(tensors[key].tolist()))
        state["blocksize"] = 128
        tensors[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)

    edit_tensors(folder, claim_128)
    plan(folder)  # the headers agree (absmax's length gives 64): the JSON is read at load
    with pytest.raises(ValueError, match=r"down_proj.weight.absmax holds 512 values, expected 256"):
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=8, block_size=8)


def test_flag_on_another_format_is_refused(tmp_path, hf_model) -> None:
    from tests.quant_checkpoints import QuantSpec, write_quantized

    folder = write_quantized(tmp_path / "gptq", hf_model, QuantSpec("gptq", 64)).folder
    with pytest.raises(
        ValueError, match=r"--quantization bitsandbytes but the checkpoint is already quantized"
    ):
        plan(folder, quantization="bitsandbytes")


def test_flag_on_layers_the_block_does_not_divide(tmp_path) -> None:
    model = build_hf_model(tiny_hf_config("LlamaForCausalLM", **{**DIMS, "intermediate_size": 96}), seed=1)
    model.save_pretrained(tmp_path / "bf16")
    with pytest.raises(ValueError, match=r"down_proj's input dim 96 is not a multiple of .* block size 64"):
        plan(tmp_path / "bf16", quantization="bitsandbytes")
