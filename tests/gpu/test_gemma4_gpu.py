"""Gemma-4 on the CUDA engine against HF transformers (run on the GPU machine).

The real geometries from shared/models cut to a few layers (26B-A4B: head dims 256 / 512, K=V full layers,
128 experts top-8; 31B: 16 / 4 KV heads), bf16, random weights saved as safetensors. The CUDA kernels have
no sliding window yet, so contexts stay within the window (1,024) and longer ones must be refused; KV-shared
layers (E2B / E4B) must be refused too, naming the fix.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
SHARED = next((p for p in (REPO / "shared", REPO.parent / "shared") if p.is_dir()), REPO / "shared")
TOKENIZER = SHARED / "tokenizers" / "smollm2"
CLEAR_MARGIN = 0.5  # as tests/gpu/test_engine_gpu.py: bf16 noise breaks closer top-2 logits either way


def _save_cut_model(shape: str, num_layers: int, tmp: Path, **changes: object) -> Path:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4ForCausalLM"):
        pytest.skip("this transformers has no Gemma-4")
    text = json.loads((SHARED / "models" / shape / "config.json").read_text())["text_config"]
    text.update(num_hidden_layers=num_layers, layer_types=text["layer_types"][:num_layers], **changes)
    text["layer_types"][-1] = "full_attention"
    config = transformers.Gemma4TextConfig(**text)
    config.architectures = ["Gemma4ForCausalLM"]
    config.initializer_range = 0.05
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Gemma4ForCausalLM(config).to(torch.bfloat16)
    folder = tmp / shape
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((TOKENIZER / name).read_bytes())
    del model
    torch.cuda.empty_cache()
    return folder


def _hf_logprobs(folder: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids], device="cuda")).logits[0].float()
    del model
    torch.cuda.empty_cache()
    return torch.log_softmax(logits, dim=-1).cpu()


def _llm(folder: Path, **kwargs):
    from fitserve import LLM

    kwargs.setdefault("gpu_memory_utilization", 0.5)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(str(folder), **kwargs)


@pytest.mark.parametrize(("shape", "agreement"), [("gemma-4-26b-a4b-it", 0.95), ("gemma-4-31b-it", 0.99)])
def test_greedy_matches_hf_within_the_window(shape, agreement, tmp_path):
    from fitserve import SamplingParams

    folder = _save_cut_model(shape, 6, tmp_path)
    prompt = [random.Random(0).randrange(49152) for _ in range(300)]
    llm = _llm(folder)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    del llm
    torch.cuda.empty_cache()
    reference = _hf_logprobs(folder, prompt + out.token_ids)[len(prompt) - 1 : -1]
    top2 = reference.topk(2, dim=-1)
    clear = (top2.values[:, 0] - top2.values[:, 1]) > CLEAR_MARGIN
    agree = (torch.tensor(out.token_ids) == top2.indices[:, 0])[clear].float().mean().item()
    assert clear.sum() >= 40, "too few clear positions to judge"
    assert agree >= agreement, f"greedy agreement {agree:.3f} < {agreement} on {int(clear.sum())} positions"


def test_kv_shared_layers_are_refused_on_cuda(tmp_path):
    folder = _save_cut_model("gemma-4-e2b-it", 10, tmp_path, num_kv_shared_layers=5)
    with pytest.raises(ValueError, match="reads layer .* KV cache .*--device cpu"):
        _llm(
            folder, max_model_len=512
        )  # within E2B's window of 512: the window's refusal does not come first


def test_contexts_past_the_window_are_refused_on_cuda(tmp_path):
    """The startup's profiling step already attends over max_model_len tokens: refused there, naming the
    window and the fixes."""
    folder = _save_cut_model("gemma-4-31b-it", 6, tmp_path)
    with pytest.raises(
        ValueError, match="sliding window of 1024.*max_model_len to 1024 or less.*--device cpu"
    ):
        _llm(folder, max_model_len=2048, max_num_batched_tokens=2048)
