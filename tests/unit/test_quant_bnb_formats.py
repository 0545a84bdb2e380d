"""bitsandbytes 4-bit checkpoints (nf4 / fp4, with and without double quant, block sizes 64 / 128, a
skipped module), written by tests/bnb_checkpoints.py from the format's specification (and by the
bitsandbytes package itself where it imports), loaded into tiny Llama / Qwen3 models:

(a) the weight fitserve decodes equals the reference weight the checkpoint dequantizes to (float32
    arithmetic, same order of operations: within 1e-6 relative);
(b) the model's logits equal those of the HF model holding the dequantized float32 weights within 1e-3
    of the largest logit (the CPU dequantizes each layer per call in float32 from a float16 absmax, as
    fitserve holds it: a relative 2^-11 per block; measured up to 4.7e-4);
(c) --quantization bitsandbytes on a 16-bit checkpoint gives, layer by layer, exactly bitsandbytes'
    nf4 round-to-nearest with blocks of 64 (checked against tests/bnb_checkpoints.py's quantizer).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import fitserve.layers.quantization.bnb_method as bnb_method
from fitserve.layers.quantization.bnb_weight import dequantize
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.loader import load_hf_config
from fitserve.models.registry import get_model_class
from fitserve.models.weights import iterate_safetensors, list_safetensors_files
from tests.bnb_checkpoints import BnbSpec, quantize_spec, write_bnb
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config

DIMS = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
TOKENS = [5, 17, 33, 2, 90, 11, 200, 3]
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
SPECS = [
    BnbSpec("nf4"),
    BnbSpec("fp4"),
    BnbSpec("nf4", double_quant=True),
    BnbSpec("fp4", double_quant=True, blocksize=128),
    BnbSpec("nf4", skip=("model.layers.1.mlp.down_proj",)),
    pytest.param(
        BnbSpec("nf4", double_quant=True, use_bitsandbytes=True),
        marks=pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes"),
    ),
    pytest.param(
        BnbSpec("fp4", use_bitsandbytes=True),
        marks=pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes"),
    ),
]
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def hf_model(request) -> torch.nn.Module:
    return build_hf_model(tiny_hf_config(request.param, **DIMS), seed=3)


def load_capturing(folder: Path, monkeypatch: pytest.MonkeyPatch, flag: str | None = None):
    """The fitserve model of `folder` and each bitsandbytes layer's decoded Nf4Weight by layer name."""
    captured: dict[int, object] = {}
    make = bnb_method.make_bnb_runnable

    def capture(layer, weight, dtype, device, what, store_on=None):
        captured[id(layer)] = weight
        return make(layer, weight, dtype, device, what, store_on)

    monkeypatch.setattr(bnb_method, "make_bnb_runnable", capture)
    config = with_quantization_flag(load_hf_config(str(folder)), flag)
    model = get_model_class(config)(config).eval()
    loaded = model.load_weights(iterate_safetensors(list_safetensors_files(str(folder))))
    assert not {name for name, _ in model.named_parameters()} - loaded
    weights = {name: captured[id(module)] for name, module in model.named_modules() if id(module) in captured}
    return model, weights, config


def reference_of(references: dict[str, torch.Tensor], layer_name: str) -> torch.Tensor:
    prefix, _, layer = layer_name.rpartition(".")
    return torch.cat([references[f"{prefix}.{part}"] for part in FUSED.get(layer, (layer,))])


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: spec.name)
def test_bnb_checkpoint_loads_to_the_reference(hf_model, spec, tmp_path, monkeypatch) -> None:
    checkpoint = write_bnb(tmp_path / spec.name, hf_model, spec)
    model, weights, config = load_capturing(checkpoint.folder, monkeypatch)
    quantized_modules = len(checkpoint.reference)
    assert quantized_modules == 2 * 7 - len(spec.skip)
    fused_away = sum(len(parts) - 1 for name in weights for key, parts in FUSED.items() if name.endswith(key))
    assert len(weights) + fused_away == quantized_modules
    for name, weight in weights.items():
        expected = reference_of(checkpoint.reference, name)
        torch.testing.assert_close(dequantize(weight), expected, rtol=1e-6, atol=1e-7)
        assert weight.packed.dtype == torch.uint8 and weight.packed.shape[1] * 2 == expected.shape[1]
    runner = PagedTestRunner(model, config, num_blocks=16, block_size=8)
    ours = runner.step([("seq", TOKENS)])[0]
    theirs = hf_logits(checkpoint.dequantized_model, TOKENS)
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-3 * scale


def test_quantize_while_loading_is_bitsandbytes_nf4(hf_model, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "bf16"
    hf_model.save_pretrained(folder)
    model, weights, config = load_capturing(folder, monkeypatch, flag="bitsandbytes")
    assert len(weights) == 2 * 4  # qkv, o, gate_up, down per layer
    state = hf_model.state_dict()
    references = {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight"):
            references[name.removesuffix(".weight")] = quantize_spec(tensor, BnbSpec("nf4"))[1]
    for name, weight in weights.items():
        assert weight.blocksize == 64 and weight.quant_type == "nf4"
        torch.testing.assert_close(dequantize(weight), reference_of(references, name), rtol=1e-6, atol=1e-7)
    runner = PagedTestRunner(model, config, num_blocks=16, block_size=8)
    assert torch.isfinite(runner.step([("seq", TOKENS)])[0]).all()


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_spec_writer_matches_bitsandbytes(quant_type: str) -> None:
    """tests/bnb_checkpoints.py's own quantizer writes the values bitsandbytes writes (for nf4 the same
    bytes; fp4 has two codes for zero, +0 and -0, which the two pick differently)."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    ours, ours_values = quantize_spec(weight, BnbSpec(quant_type))
    theirs, their_values = quantize_spec(weight, BnbSpec(quant_type, use_bitsandbytes=True))
    if quant_type == "nf4":
        assert torch.equal(ours[""], theirs[""])
    torch.testing.assert_close(ours[".absmax"], theirs[".absmax"], rtol=0, atol=0)
    torch.testing.assert_close(ours_values, their_values, rtol=0, atol=0)
