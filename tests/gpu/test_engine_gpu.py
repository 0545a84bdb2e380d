"""The CUDA engine against HF transformers on the same random weights (run on the GPU machine).

Shapes are the real ones from shared/models (Qwen3-0.6B whole; Llama-3.1-8B cut to 4 layers so HF and
fitserve fit side by side quickly), bf16, random weights saved as safetensors.
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
SHARED_CANDIDATES = [REPO / "shared", REPO.parent / "shared"]
SHARED = next((p for p in SHARED_CANDIDATES if p.is_dir()), SHARED_CANDIDATES[0])
TOKENIZER = SHARED / "tokenizers" / "smollm2"
GREEDY_TOKENS = 256


def _save_random_model(shape: str, tmp: Path, num_layers: int | None = None) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((SHARED / "models" / shape / "config.json").read_text())
    if num_layers is not None:
        config_dict["num_hidden_layers"] = num_layers
    folder = tmp / shape
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict))
    config = AutoConfig.from_pretrained(folder)
    # A wide init makes the greedy path depend on the weights instead of repeating one token.
    config.initializer_range = 0.05
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((TOKENIZER / name).read_bytes())
    del model
    torch.cuda.empty_cache()
    return folder


@pytest.fixture(scope="module", params=[("qwen3-0.6b", None), ("llama-3.1-8b", 4)], ids=["qwen3", "llama"])
def model_folder(request, tmp_path_factory) -> Path:
    shape, layers = request.param
    return _save_random_model(shape, tmp_path_factory.mktemp("gpu_models"), layers)


def _prompts(n: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(8, 200))] for _ in range(n)]


def _hf_greedy(folder: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt], device="cuda")
        first_logits = model(ids).logits[0, -1].float()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    del model
    torch.cuda.empty_cache()
    return out[0, len(prompt) :].tolist(), torch.log_softmax(first_logits, -1).cpu()


def _llm(folder: Path, **kwargs):
    from fitserve import LLM

    kwargs.setdefault("gpu_memory_utilization", 0.5)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(str(folder), **kwargs)


def _greedy(llm, prompts: list[list[int]], max_tokens: int = GREEDY_TOKENS):
    from fitserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_greedy_and_logprobs_match_hf(model_folder):
    prompt = _prompts(1)[0]
    hf_tokens, hf_first_logprobs = _hf_greedy(model_folder, prompt, GREEDY_TOKENS)
    llm = _llm(model_folder)
    out = _greedy(llm, [prompt])[0]
    agree = sum(a == b for a, b in zip(out.token_ids, hf_tokens)) / GREEDY_TOKENS
    assert agree >= 0.99, f"greedy agreement {agree:.3f} < 0.99"
    first = out.logprobs[0]
    for token_id, entry in first.items():
        assert abs(entry.logprob - hf_first_logprobs[token_id].item()) < 0.05
    del llm
    torch.cuda.empty_cache()


def test_graphs_prefix_cache_chunking_and_preemption_change_nothing(model_folder):
    prompts = _prompts(8)
    prompts[1] = prompts[0][:100] + prompts[1]  # a shared prefix for the prefix cache
    reference_llm = _llm(model_folder, enforce_eager=True, enable_prefix_caching=False)
    reference = [o.token_ids for o in _greedy(reference_llm, prompts, 64)]
    del reference_llm
    torch.cuda.empty_cache()
    variants = {
        "cuda graphs": {},
        "prefix caching": {"enable_prefix_caching": True},
        "chunked prefill": {"max_num_batched_tokens": 64, "enforce_eager": True},
        "preemption": {"num_gpu_blocks_override": 40, "block_size": 16},
    }
    for name, kwargs in variants.items():
        llm = _llm(model_folder, **kwargs)
        got = [o.token_ids for o in _greedy(llm, prompts, 64)]
        if name == "prefix caching":
            got = [o.token_ids for o in _greedy(llm, prompts, 64)]  # second pass: hits
            assert llm.engine.kv_manager.prefix_cache_hits > 0
        if name == "preemption":
            assert llm.engine.scheduler.num_preemptions_total > 0
        same = sum(a == b for a, b in zip(got, reference))
        assert same == len(prompts), f"{name}: {len(prompts) - same} of {len(prompts)} outputs differ"
        del llm
        torch.cuda.empty_cache()
