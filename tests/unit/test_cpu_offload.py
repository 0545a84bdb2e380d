"""--cpu-offload-gb: which layers (the arithmetic shared by the engine and the planner), the refusals, and
the copy-in mechanism run on the CPU, where "host" and "staging" buffers are both plain CPU tensors.

The mechanism on a real GPU (page-locked memory, CUDA graphs) is tests/gpu/test_cpu_offload_gpu.py.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fitserve.args import EngineArgs
from fitserve.config import EngineConfig, ModelConfig
from fitserve.models.cpu_offload import CpuOffload, FlatLayout
from fitserve.models.loader import load_model
from fitserve.offload_split import (
    NO_OFFLOAD,
    GiB,
    HostChunks,
    OffloadSplit,
    max_offload_gib,
    pinned_host_bytes,
    split_offload,
)
from fitserve.planner.engine_plan import inputs_from_engine_config
from fitserve.planner.hardware import parse_assume_gpus
from fitserve.planner.memory import plan_memory
from fitserve.planner.resolve import create_engine_config
from tests.paths import MODELS_DIR
from tests.unit.model_helpers import PagedTestRunner, build_hf_model, hf_logits, tiny_hf_config

PROMPT_IDS = [3, 17, 101, 5, 250, 42, 7, 99, 180, 33]
NUM_LAYERS = 4
MiB = 1 << 20

# ---- which layers ------------------------------------------------------------------------------------


def test_whole_layers_are_offloaded_first_ones_first_until_enough() -> None:
    layers = [1000] * 8
    assert split_offload(layers, 2500 / GiB) == OffloadSplit(
        num_layers=3, offloaded_bytes=3000, staging_bytes=1000
    )
    assert split_offload(layers, 2000 / GiB) == OffloadSplit(2, 2000, 1000)  # exactly two layers' worth
    assert split_offload(layers, 8000 / GiB) == OffloadSplit(8, 8000, 1000)  # every layer
    assert split_offload(layers, 0) == NO_OFFLOAD
    assert split_offload(layers, 2500 / GiB).gpu_bytes_saved == 2000


def test_layers_of_different_sizes_stage_in_the_largest() -> None:
    assert split_offload([500, 1500, 800, 800], 1800 / GiB) == OffloadSplit(2, 2000, 1500)


def test_more_than_the_decoder_layers_is_refused_naming_the_largest_value_that_works() -> None:
    layers = [int(0.3 * GiB)] * 28  # 8.4 GiB in all, 8.39 after rounding to whole bytes
    with pytest.raises(ValueError) as refusal:
        split_offload(layers, 9)
    assert str(refusal.value) == (
        "cpu_offload_gb=9 is more than the 8.40 GiB of weights in the model's 28 decoder layers, the only "
        "weights kept in CPU memory (the embeddings and LM head stay on the GPU): set --cpu-offload-gb 8.39 "
        "or less"
    )
    assert split_offload(layers, 8.39).num_layers == 28  # the value it names is accepted


def test_largest_value_is_rounded_down_to_two_decimals() -> None:
    assert max_offload_gib(int(1.239 * GiB)) == 1.23
    assert max_offload_gib(2 * GiB) == 2


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_split_refuses_what_is_not_a_size(value: float) -> None:
    with pytest.raises(ValueError, match=rf"cpu_offload_gb={value}"):
        split_offload([1000] * 4, value)


# ---- host memory: power-of-two chunks, as torch's pinned allocator hands them out ---------------------


def test_host_chunks_hold_qwen3_layers_in_two_chunks() -> None:
    layer = 31_461_888  # a Qwen3-0.6B decoder layer in bf16; --cpu-offload-gb 0.5 offloads 18 of them
    chunks = HostChunks(18 * layer)
    placed = [chunks.place(layer) for _ in range(18)]
    assert chunks.sizes == [512 * MiB, 32 * MiB]  # 17 layers fill the first; the 18th opens the second
    assert placed[16] == (0, 16 * layer) and placed[17] == (1, 0)
    assert pinned_host_bytes([layer] * 18) == chunks.total_bytes
    assert split_offload([layer] * 28, 0.5).host_bytes == 544 * MiB  # the planner's, +0.7%
    # one chunk when rounding them all up to a power of two wastes less than a layer
    assert pinned_host_bytes([100 * MiB] * 10) == 1024 * MiB


@pytest.mark.parametrize("layer", [1000 * 256, 3 * MiB + 256, 700 * MiB])
def test_host_chunks_are_powers_of_two_that_lose_less_than_a_layer_each(layer: int) -> None:
    for count in range(1, 64):
        chunks = HostChunks(count * layer)
        places = [chunks.place(layer) for _ in range(count)]
        assert all(size & (size - 1) == 0 for size in chunks.sizes)  # the pinned allocator keeps them
        assert 0 <= chunks.total_bytes - count * layer < layer * len(chunks.sizes)
        assert all(offset + layer <= chunks.sizes[index] for index, offset in places)
        assert len(set(places)) == count


# ---- flags ---------------------------------------------------------------------------------------------

QWEN3_SHAPE = str(MODELS_DIR / "qwen3-0.6b")


def test_negative_and_non_finite_values_are_refused_naming_them() -> None:
    with pytest.raises(
        ValueError, match=r"^cpu_offload_gb=-2\.5 is below the minimum 0: set --cpu-offload-gb"
    ):
        EngineArgs(cpu_offload_gb=-2.5).check_ranges()
    with pytest.raises(ValueError, match=r"^cpu_offload_gb=nan is not a number of GiB: set --cpu-offload-gb"):
        EngineArgs(cpu_offload_gb=math.nan).check_ranges()


def test_on_the_cpu_the_flag_is_accepted_and_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    args = EngineArgs(model=QWEN3_SHAPE, load_format="dummy", device="cpu", cpu_offload_gb=2)
    with caplog.at_level(logging.WARNING, logger="fitserve"):
        config = create_engine_config(args)
    assert config.model.cpu_offload_gb == 0.0
    assert (
        "cpu_offload_gb=2 is ignored on the CPU device: every weight is already in CPU memory" in caplog.text
    )


def test_help_says_what_the_flag_does() -> None:
    from dataclasses import fields

    (flag,) = [f for f in fields(EngineArgs) if f.name == "cpu_offload_gb"]
    assert "not supported" not in flag.metadata["help"]
    assert "GiB of weights per GPU to keep in CPU memory" in flag.metadata["help"]


# ---- the mechanism, on the CPU ---------------------------------------------------------------------------


def _model_config(hf_config: Any, cpu_offload_gb: float = 0.0, **overrides: Any) -> ModelConfig:
    fields: dict[str, Any] = {
        "model": "tiny",
        "model_path": "tiny",
        "model_source": "test",
        "tokenizer": "tiny",
        "hf_config": hf_config,
        "dtype": torch.float32,
        "max_model_len": 512,
        "load_format": "dummy",
        "seed": 7,
        "cpu_offload_gb": cpu_offload_gb,
    }
    return ModelConfig(**{**fields, **overrides})


def _layer_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())


def _gib_for_layers(model: torch.nn.Module, layers: float) -> float:
    return layers * _layer_bytes(model) / GiB


def _steps(model: torch.nn.Module, hf_config: Any) -> list[torch.Tensor]:
    """A prefill, then two decode steps, as the model runner would run them (inference mode)."""
    runner = PagedTestRunner(model, hf_config)
    with torch.inference_mode():
        logits = runner.step([("seq", PROMPT_IDS)])
        logits += runner.step([("seq", [11])])
        logits += runner.step([("seq", [12])])
    return logits


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_offloaded_dummy_model_computes_exactly_what_the_resident_one_does(architecture: str) -> None:
    hf_config = tiny_hf_config(architecture, num_hidden_layers=NUM_LAYERS)
    resident = load_model(_model_config(hf_config), "cpu")
    offloaded = load_model(_model_config(hf_config, _gib_for_layers(resident, 2.5)), "cpu")
    offload = offloaded.cpu_offload
    assert [layer.index for layer in offload.layers] == [0, 1, 2]  # 2.5 layers asked: 3 whole ones
    assert offload.offloaded_bytes == 3 * _layer_bytes(resident)
    # the same seed gives the same weights, wherever they are kept
    for layer in offload.layers:
        views = layer.layout.views(layer.host)
        for name, param in resident.model.layers[layer.index].named_parameters():
            assert torch.equal(views[name], param), name
    for got, expected in zip(_steps(offloaded, hf_config), _steps(resident, hf_config)):
        assert torch.equal(got, expected)


def test_offloaded_layers_share_one_staging_set_fed_by_the_copy_hook() -> None:
    hf_config = tiny_hf_config("Qwen3ForCausalLM", num_hidden_layers=NUM_LAYERS)
    probe = load_model(_model_config(hf_config), "cpu")
    model = load_model(_model_config(hf_config, _gib_for_layers(probe, 2)), "cpu")
    layers = model.model.layers
    weight = "self_attn.qkv_proj.weight"
    first, second, resident = (dict(layers[i].named_parameters())[weight] for i in (0, 1, 2))
    assert first.data_ptr() == second.data_ptr()  # both layers run from the same staging buffer
    assert resident.data_ptr() != first.data_ptr()
    assert model.cpu_offload.staging_bytes == _layer_bytes(probe)  # one layer's worth (these align)
    host_views = [layer.layout.views(layer.host)[weight] for layer in model.cpu_offload.layers]
    assert not torch.equal(host_views[0], host_views[1])
    _steps(model, hf_config)
    # After a forward the staging buffer holds the last offloaded layer: layer 0's parameter now reads
    # layer 1's weights, so each layer computed right only because its hook copied it in first.
    assert torch.equal(first, host_views[1])
    assert not torch.equal(first, host_views[0])


def test_offloaded_checkpoint_matches_hf(tmp_path: Path) -> None:
    hf_config = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=NUM_LAYERS)
    hf_model = build_hf_model(hf_config, seed=3)
    hf_model.save_pretrained(tmp_path)
    checkpoint = {"model_path": str(tmp_path), "load_format": "safetensors"}
    resident = load_model(_model_config(hf_config, **checkpoint), "cpu")
    offloaded = load_model(_model_config(hf_config, _gib_for_layers(resident, 1), **checkpoint), "cpu")
    assert len(offloaded.cpu_offload.layers) == 1
    got = PagedTestRunner(offloaded, hf_config).step([("seq", PROMPT_IDS)])[0]
    expected = PagedTestRunner(resident, hf_config).step([("seq", PROMPT_IDS)])[0]
    # Not bit for bit: a resident float32 weight is stored transposed (UnquantizedLinearMethod), an
    # offloaded one as loaded, and on CPUs without AVX-512 the two GEMMs round differently (seen: last
    # bits of a few logits on an AVX2 AMD EPYC).
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, hf_logits(hf_model, PROMPT_IDS), rtol=1e-4, atol=1e-4)


def test_more_than_every_decoder_layer_is_refused_before_loading() -> None:
    hf_config = tiny_hf_config("LlamaForCausalLM", num_hidden_layers=NUM_LAYERS)
    probe = load_model(_model_config(hf_config), "cpu")
    total = NUM_LAYERS * _layer_bytes(probe)
    with pytest.raises(ValueError, match=rf"the model's {NUM_LAYERS} decoder layers, the only weights kept"):
        load_model(_model_config(hf_config, (total + 1) / GiB), "cpu")
    every_layer = load_model(_model_config(hf_config, total / GiB), "cpu")
    assert len(every_layer.cpu_offload.layers) == NUM_LAYERS


def test_flat_layout_aligns_every_parameter() -> None:
    layer = torch.nn.Module()
    layer.a = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    layer.b = torch.nn.Parameter(torch.zeros(2, 5), requires_grad=False)
    layer.c = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16), requires_grad=False)
    layout = FlatLayout.of(layer)
    offsets = {name: (dtype, start) for name, dtype, start, _ in layout.entries}
    assert offsets == {"a": (torch.float32, 0), "b": (torch.float32, 64), "c": (torch.float16, 0)}
    assert layout.numel == {torch.float32: 74, torch.float16: 4}


def test_host_buffers_are_on_the_cpu_whatever_device_the_model_is_built_on() -> None:
    layer = torch.nn.Linear(8, 8)
    offload = CpuOffload(1e-9, "cpu")
    with torch.device("meta"):  # the loader builds the model inside `with torch.device("cuda")`
        offload.place(0, layer, num_layers=1)
    assert layer.weight.device.type == "cpu" and layer.bias.device.type == "cpu"
    assert all(buffer.device.type == "cpu" for buffer in offload.layers[0].host.values())


def test_host_buffers_are_disjoint_views_of_a_few_chunks_the_planner_counts() -> None:
    hf_config = tiny_hf_config("Qwen3ForCausalLM", num_hidden_layers=NUM_LAYERS)
    probe = load_model(_model_config(hf_config), "cpu")
    offload = load_model(_model_config(hf_config, _gib_for_layers(probe, NUM_LAYERS)), "cpu").cpu_offload
    assert len(offload.layers) == NUM_LAYERS and len(offload.host_chunks) < NUM_LAYERS
    # torch judges a tensor pinned by the start of its storage: every host buffer's storage is a chunk,
    # on CUDA one of torch's own pinned allocations, so every buffer is seen as pinned
    chunks = {chunk.untyped_storage().data_ptr() for chunk in offload.host_chunks}
    buffers = [buffer for layer in offload.layers for buffer in layer.host.values()]
    assert all(buffer.untyped_storage().data_ptr() in chunks for buffer in buffers)
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buffers)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    requests = [layer.layout.host_request_bytes for layer in offload.layers]
    assert offload.host_bytes == pinned_host_bytes(requests) < offload.offloaded_bytes + max(requests) * 2


def test_an_architecture_without_make_layers_is_refused() -> None:
    offload = CpuOffload(0.5, "cpu")
    with pytest.raises(ValueError, match=r"cpu_offload_gb=0.5: Linear does not build its layers"):
        offload.attach(torch.nn.Linear(2, 2))


# ---- the planner counts what the engine does -------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_plan_offloads_the_layers_the_engine_offloads(architecture: str) -> None:
    hf_config = tiny_hf_config(architecture, num_hidden_layers=NUM_LAYERS)
    probe = load_model(_model_config(hf_config), "cpu")
    gib = _gib_for_layers(probe, 1.5)
    model = load_model(_model_config(hf_config, gib), "cpu")
    gpu = parse_assume_gpus("1x80@9.0")[0]
    plan = plan_memory(inputs_from_engine_config(EngineConfig(model=_model_config(hf_config, gib)), gpu))
    resident_plan = plan_memory(inputs_from_engine_config(EngineConfig(model=_model_config(hf_config)), gpu))
    offload = model.cpu_offload
    assert plan.offload.num_layers == len(offload.layers) == 2
    assert plan.weights_offloaded_bytes == offload.offloaded_bytes
    assert plan.offload.host_bytes == offload.host_bytes  # the host RAM, chunks' rounding included
    # the engine's staging buffer is the planner's plus the alignment of each parameter's view
    assert (
        0
        <= offload.staging_bytes - plan.offload.staging_bytes
        < 256 * len(list(probe.model.layers[0].parameters()))
    )
    saved = offload.offloaded_bytes - offload.staging_bytes
    on_device = sum(p.numel() * p.element_size() for p in probe.parameters()) - saved
    assert plan.terms.weights == resident_plan.terms.weights - plan.offload.gpu_bytes_saved
    assert plan.terms.weights == pytest.approx(on_device, abs=256 * 16)
