"""Quantized Gemma-4 on the CUDA engine against HF transformers with the dequantized weights (run on the
GPU machine).

The real geometries (tests/gpu/gemma4_cut_models.py) cut to a few layers, every linear outside the experts
stored as compressed-tensors int4 pack-quantized by tests/unit/gemma4_quant_helpers.py (the router and
experts ignored): 31B (group 128, K=V full layers), E2B (group 128: per-layer inputs, KV-shared layers),
26B-A4B (group 64: its dense MLP of 2112 is not whole groups of 128; experts 16-bit). fitserve runs them in
bfloat16 (the Triton int4 GEMM); the reference is HF in float32 with each int4 weight dequantized. Greedy
tokens agree with the reference's top-1 wherever its top-2 gap is clear; TP 2 gives TP 1's tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.gpu.gemma4_cut_models import CLEAR_MARGIN, save_cut_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# shape -> (layers, group size, config changes)
SHAPES = {
    "gemma-4-31b-it": (4, 128, {}),
    "gemma-4-e2b-it": (6, 128, {"num_kv_shared_layers": 3}),
    "gemma-4-26b-a4b-it": (4, 64, {}),
}


def _int4_folder(shape: str, tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """The cut model's int4 checkpoint and the float32 HF reference holding its dequantized weights."""
    from transformers import Gemma4ForCausalLM

    from tests.quant_checkpoints import QuantSpec
    from tests.unit.gemma4_quant_helpers import int4_ignore, write_int4

    layers, group, changes = SHAPES[shape]
    folder = save_cut_model(shape, layers, tmp_path, **changes)
    model = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    checkpoint = write_int4(tmp_path / "int4", model, QuantSpec("ct", group, ignore=int4_ignore("ct")))
    assert checkpoint.quantized, "nothing was quantized"
    return checkpoint.folder, checkpoint.reference


def _greedy(folder: Path, prompt: list[int], **kwargs) -> list[int]:
    from fitserve import LLM, SamplingParams

    kwargs.setdefault("gpu_memory_utilization", 0.5)
    kwargs.setdefault("max_model_len", 1024)
    llm = LLM(str(folder), dtype="bfloat16", **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return list(output.outputs[0].token_ids)
    finally:
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()


def _agreement(reference: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[float, int]:
    with torch.inference_mode():
        model = reference.cuda()
        logits = model(torch.tensor([prompt + tokens], device="cuda")).logits[0].float()
        reference.cpu()
    torch.cuda.empty_cache()
    rows = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].cpu()
    top2 = rows.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
    agree = (torch.tensor(tokens) == top2.indices[:, 0])[clear].float().mean().item()
    return agree, int(clear.sum())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_int4_greedy_matches_the_dequantized_reference(shape, tmp_path):
    folder, reference = _int4_folder(shape, tmp_path)
    prompt = [random.Random(0).randrange(49152) for _ in range(300)]
    tokens = _greedy(folder, prompt)
    agree, clear = _agreement(reference, prompt, tokens)
    assert clear >= 30, "too few clear positions to judge"
    assert agree >= 0.95, f"greedy agreement {agree:.3f} < 0.95 on {clear} positions"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("shape", ["gemma-4-31b-it", "gemma-4-e2b-it"])
def test_int4_tp2_matches_tp1(shape, tmp_path):
    """TP 2 splits each rank's int4 rows and row-parallel input groups: the greedy tokens equal TP 1's for
    at least the first 16 (bf16 partial sums round differently, so a near-tie may part them later; a wrong
    rank slice parts them at once)."""
    folder, _ = _int4_folder(shape, tmp_path)
    prompt = [random.Random(1).randrange(49152) for _ in range(200)]
    one = _greedy(folder, prompt)
    two = _greedy(folder, prompt, tensor_parallel_size=2)
    first = next((i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b), len(one))
    assert first >= 16, f"TP 2 parts from TP 1 at token {first}"
