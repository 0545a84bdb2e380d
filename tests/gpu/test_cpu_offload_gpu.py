"""--cpu-offload-gb on a CUDA GPU (run on the GPU machine): the Qwen3-0.6B shape with dummy weights and half
a GiB of decoder layers in page-locked CPU memory gives the same greedy tokens as the same weights kept on
the GPU, eagerly and replaying CUDA graphs, while the GPU holds about half a GiB less.

Dummy weights are drawn from the seed on the GPU in the same order whether or not a layer is offloaded
(fitserve/models/weights.py), so both engines hold the same weights: the first test checks that.

GPU memory is counted from what this process holds when each model or engine starts (after a garbage
collection), so that nothing an earlier test left behind counts as this one's.
"""

from __future__ import annotations

import gc
import random
from typing import Any

import pytest
import torch

from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GiB = 1 << 30
MiB = 1 << 20
SHAPE = MODELS_DIR / "qwen3-0.6b"  # config.json only: 28 layers of 31.5 MB in bf16, 1.11 GiB in all
OFFLOAD_GB = 0.5  # 18 of the 28 layers


def _free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _model_config(cpu_offload_gb: float) -> Any:
    from fitserve.config import ModelConfig
    from fitserve.models.loader import load_hf_config

    return ModelConfig(
        model=str(SHAPE),
        model_path=str(SHAPE),
        model_source="test",
        tokenizer=str(SMOLLM2_TOKENIZER_DIR),
        hf_config=load_hf_config(str(SHAPE)),
        dtype=torch.bfloat16,
        max_model_len=1024,
        load_format="dummy",
        seed=0,
        cpu_offload_gb=cpu_offload_gb,
    )


def _gpu_bytes(tensors: Any) -> int:
    """Bytes of the distinct CUDA storages behind `tensors` (a tied or shared one counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


def _compare(resident: Any, offloaded: Any) -> dict[str, Any]:
    """What the test asserts on, as plain values, so that a failing assertion holds no model in its frame."""
    offload = offloaded.cpu_offload
    differing = []
    for layer in offload.layers:
        views = layer.layout.views(layer.host)
        for name, param in resident.model.layers[layer.index].named_parameters():
            if not (param.is_cuda and torch.equal(views[name].cuda(), param)):
                differing.append(f"model.layers.{layer.index}.{name}")
    offloaded_prefixes = tuple(f"model.layers.{layer.index}." for layer in offload.layers)
    resident_params = dict(resident.named_parameters())
    for name, param in offloaded.named_parameters():
        if name.startswith(offloaded_prefixes):
            continue
        if not (param.is_cuda and torch.equal(param, resident_params[name])):
            differing.append(name)
    return {
        "layers": [layer.index for layer in offload.layers],
        "offloaded_bytes": offload.offloaded_bytes,
        "gpu_tensor_bytes": _gpu_bytes([*offloaded.parameters(), *offloaded.buffers()]),
        "chunks_pinned": [chunk.is_pinned() for chunk in offload.host_chunks],
        "buffers_pinned": [buffer.is_pinned() for layer in offload.layers for buffer in layer.host.values()],
        "host_bytes": offload.host_bytes,
        "host_requests": [layer.layout.host_request_bytes for layer in offload.layers],
        "differing": differing,
    }


def test_the_seed_gives_the_same_weights_with_and_without_offload() -> None:
    from fitserve.models.loader import load_model
    from fitserve.offload_split import pinned_host_bytes

    _free_gpu()
    resident = load_model(_model_config(0.0), "cuda")
    before = torch.cuda.memory_allocated()
    offloaded = load_model(_model_config(OFFLOAD_GB), "cuda")
    held = torch.cuda.memory_allocated() - before
    facts = _compare(resident, offloaded)
    del resident, offloaded
    _free_gpu()
    assert facts["layers"] == list(range(18))
    assert facts["offloaded_bytes"] >= OFFLOAD_GB * GiB
    # The GPU holds what the model's tensors hold and nothing more: no device copy of an offloaded layer
    # (each is built on the GPU, and its dummy weights drawn there) outlives the loading.
    assert held == pytest.approx(facts["gpu_tensor_bytes"], abs=MiB)
    # Views of torch's own pinned allocations (an asynchronous copy needs it, a CUDA graph capture
    # requires it), in power-of-two chunks: 512 MiB for 17 layers, 32 MiB for the 18th.
    assert facts["chunks_pinned"] == [True, True]
    assert all(facts["buffers_pinned"]) and len(facts["buffers_pinned"]) == 18
    assert facts["host_bytes"] == pinned_host_bytes(facts["host_requests"]) == 544 * MiB
    assert facts["differing"] == []  # the same weights, offloaded layers or not


def _prompts(n: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 120))] for _ in range(n)]


def _run(cpu_offload_gb: float, enforce_eager: bool) -> dict[str, Any]:
    """Greedy tokens of 6 prompts, the weights the engine measured on the GPU (less what the process held
    before it started), the bytes of its parameters' GPU storage, the offload and the plan."""
    from fitserve import LLM, SamplingParams
    from fitserve.planner.engine_plan import gpu_device_spec, inputs_from_engine_config
    from fitserve.planner.memory import plan_memory

    _free_gpu()
    llm = LLM(
        str(SHAPE),
        tokenizer=str(SMOLLM2_TOKENIZER_DIR),
        load_format="dummy",
        seed=0,
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        enforce_eager=enforce_eager,
        compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]},
        cpu_offload_gb=cpu_offload_gb,
    )
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(6)], params, use_tqdm=False)
    runner = llm.engine.executor.runner
    offload = getattr(runner.model, "cpu_offload", None)
    result = {
        "graphs": runner.graph_runner is not None,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        # memory_allocated() after loading less what the process held before the engine started (e.g.
        # cuBLAS's workspace, allocated on a process's first GEMM and kept)
        "weights": runner.platform.weights_bytes,
        "gpu_params": _gpu_bytes(runner.model.parameters()),
        "plan": plan_memory(inputs_from_engine_config(llm.engine.config, gpu_device_spec(0))),
        "offload": None
        if offload is None
        else (len(offload.layers), offload.offloaded_bytes, offload.staging_bytes),
    }
    del llm, runner, offload, outputs
    _free_gpu()
    return result


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_offload_changes_no_token_and_frees_the_offloaded_bytes(enforce_eager: bool) -> None:
    resident = _run(0.0, enforce_eager)
    offloaded = _run(OFFLOAD_GB, enforce_eager)
    assert resident["graphs"] == offloaded["graphs"] == (not enforce_eager)
    assert resident["offload"] is None
    assert offloaded["tokens"] == resident["tokens"], "CPU offload changed the greedy output"
    num_layers, offloaded_bytes, staging_bytes = offloaded["offload"]
    assert num_layers == 18 and offloaded_bytes >= OFFLOAD_GB * GiB
    # The GPU holds the offloaded layers' bytes less, plus one layer's staging buffer.
    saved = resident["weights"] - offloaded["weights"]
    assert saved == pytest.approx(offloaded_bytes - staging_bytes, abs=16 * MiB)
    assert resident["gpu_params"] - offloaded["gpu_params"] == offloaded_bytes - staging_bytes
    assert saved > 0.45 * GiB
    # The planner chose the same layers and counts the staging buffer: its weights are the parameters the
    # GPU holds (the engine's measured weights also count a few small buffers of its own, the same
    # tens of MiB with or without offload, which cancel in `saved`).
    plan, resident_plan = offloaded["plan"], resident["plan"]
    assert (plan.offload.num_layers, plan.weights_offloaded_bytes) == (num_layers, offloaded_bytes)
    assert abs(staging_bytes - plan.offload.staging_bytes) < 64 * 1024
    assert plan.terms.weights == pytest.approx(offloaded["gpu_params"], abs=MiB)
    assert resident_plan.terms.weights == pytest.approx(resident["gpu_params"], abs=MiB)
    assert resident_plan.terms.weights - plan.terms.weights == pytest.approx(saved, abs=16 * MiB)


def test_more_than_the_decoder_layers_is_refused_naming_the_largest_value() -> None:
    from fitserve.models.loader import load_model

    with pytest.raises(ValueError, match=r"set --cpu-offload-gb 0\.82 or less"):
        load_model(_model_config(1.0), "cuda")
    _free_gpu()
