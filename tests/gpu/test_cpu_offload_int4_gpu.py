"""--cpu-offload-gb with int4 weights on a CUDA GPU (run on the GPU machine): the Qwen3-0.6B shape with a GPTQ
group-128 quantization_config and dummy int4 weights. Offloaded layers keep the Triton kernels' int4 layout
in page-locked CPU memory and run the same kernels from the staging buffer: the same greedy tokens as the
resident model, eagerly and replaying CUDA graphs, with less GPU memory held.
"""

from __future__ import annotations

import gc
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.paths import MODELS_DIR, SMOLLM2_TOKENIZER_DIR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
OFFLOAD_GB = 0.1


@pytest.fixture(scope="module")
def int4_shape(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-0.6b-gptq")
    shutil.copytree(MODELS_DIR / "qwen3-0.6b", folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = GPTQ
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _run(folder: Path, cpu_offload_gb: float, enforce_eager: bool) -> dict[str, Any]:
    from fitserve import LLM, SamplingParams

    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(
        str(folder),
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
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randint(8, 120))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = llm.engine.executor.runner.model
    offload = getattr(model, "cpu_offload", None)
    first = model.model.layers[0].self_attn.qkv_proj
    tensors = [*model.parameters(), *model.buffers()]
    result = {
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "path": first.linear_method.path,
        # distinct CUDA storages: every offloaded layer's tensors are views of the one staging set
        "gpu_bytes": sum(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda
            }.values()
        ),
        "layers": None if offload is None else len(offload.layers),
        "offloaded_bytes": 0 if offload is None else offload.offloaded_bytes,
        "staging_bytes": 0 if offload is None else offload.staging_bytes,
        "pinned": None if offload is None else all(chunk.is_pinned() for chunk in offload.host_chunks),
    }
    del llm, model, offload, first, tensors, outputs
    gc.collect()
    torch.cuda.empty_cache()
    return result


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
def test_offloaded_int4_layers_run_the_triton_kernels_and_change_no_token(int4_shape, enforce_eager) -> None:
    resident = _run(int4_shape, 0.0, enforce_eager)
    offloaded = _run(int4_shape, OFFLOAD_GB, enforce_eager)
    assert resident["path"] == offloaded["path"] == "triton-int4"
    assert offloaded["layers"] and offloaded["pinned"]
    assert offloaded["offloaded_bytes"] >= OFFLOAD_GB * (1 << 30)
    assert offloaded["tokens"] == resident["tokens"], "offloading int4 layers changed the greedy output"
    saved = resident["gpu_bytes"] - offloaded["gpu_bytes"]
    # each offloaded layer's int4 tensors (4-byte aligned in the staging set) are gone but for one set
    assert saved == pytest.approx(offloaded["offloaded_bytes"] - offloaded["staging_bytes"], abs=1 << 20)
