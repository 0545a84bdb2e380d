"""fitserve's Llama / Mistral / Qwen2 / Qwen3 against HF transformers on tiny random models (fp32, CPU).

Every check compares fitserve's logits for the tokens a step computes with HF's logits at the same
positions of the whole sequence run at once: a causal model's logits at position p depend only on
tokens 0..p, so prefill, chunked prefill, batching and decode must all reproduce them.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from fitserve.layers.attention.metadata import forward_context
from fitserve.layers.rotary_embedding import compute_inv_freq, rope_settings_from_config
from fitserve.models.registry import get_model_class, supported_architectures
from tests.unit.model_helpers import (
    PagedTestRunner,
    build_fitserve_model,
    build_hf_model,
    greedy_with_mixed_steps,
    hf_logits,
    tiny_hf_config,
)

TOLERANCE = 1e-4
REPO_ROOT = Path(__file__).resolve().parents[2]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so the 16-dim heads have frequencies in all three bands (kept, smoothed, divided)
    "original_max_position_embeddings": 64,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_llama3_rope_tied": (
        "LlamaForCausalLM",
        {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True},
    ),
    "llama_biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen2_tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),  # head_dim != hidden / heads, as in real Qwen3
}


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def models(case: str) -> tuple[Any, nn.Module, nn.Module]:
    architecture, overrides = CASES[case]
    config = tiny_hf_config(architecture, **overrides)
    hf_model = build_hf_model(config)
    return config, hf_model, build_fitserve_model(config, hf_model.state_dict())


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    error = (got - want).abs().max().item()
    assert error < TOLERANCE, f"max |logit difference| {error:.3g} >= {TOLERANCE}"


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_matches_hf(case: str) -> None:
    config, hf_model, model = models(case)
    prompt = random_tokens(37, seed=1)
    (logits,) = PagedTestRunner(model, config).step([("a", prompt)])
    assert_matches(logits, hf_logits(hf_model, prompt))


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_matches_hf(case: str) -> None:
    """Chunks of 21, 5 and 11 tokens: a long one and short ones over a cached prefix."""
    config, hf_model, model = models(case)
    prompt = random_tokens(37, seed=2)
    runner = PagedTestRunner(model, config, block_size=4)
    pieces = [runner.step([("a", prompt[a:b])])[0] for a, b in ((0, 21), (21, 26), (26, 37))]
    assert_matches(torch.cat(pieces), hf_logits(hf_model, prompt))


@pytest.mark.parametrize("case", list(CASES))
def test_batch_of_two_lengths_matches_hf(case: str) -> None:
    config, hf_model, model = models(case)
    long_prompt, short_prompt = random_tokens(29, seed=3), random_tokens(9, seed=4)
    long_logits, short_logits = PagedTestRunner(model, config).step([("a", long_prompt), ("b", short_prompt)])
    assert_matches(long_logits, hf_logits(hf_model, long_prompt))
    assert_matches(short_logits, hf_logits(hf_model, short_prompt))


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decode_with_mixed_steps_matches_hf(case: str) -> None:
    """Two prompts prefill, then decode greedily; a third prompt joins mid-way (prefill beside decodes)."""
    config, hf_model, model = models(case)
    runner = PagedTestRunner(model, config, block_size=4)
    prompts = {"a": random_tokens(19, seed=5), "b": random_tokens(33, seed=6), "c": random_tokens(12, seed=7)}
    for computed, tokens in greedy_with_mixed_steps(runner, prompts, late="c").values():
        assert_matches(computed, hf_logits(hf_model, tokens[: computed.shape[0]]))


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_forward_without_metadata_matches_hf(case: str) -> None:
    """The profiling path (no KV cache yet) runs the tokens as one causal sequence."""
    _, hf_model, model = models(case)
    prompt = random_tokens(23, seed=8)
    with torch.no_grad(), forward_context(None, []):
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    assert_matches(logits, hf_logits(hf_model, prompt))


@pytest.mark.parametrize("case", ["llama_llama3_rope_tied", "qwen3"])
def test_bf16_model_tracks_hf_fp32(case: str) -> None:
    """Built under default dtype bf16: weights bf16, RoPE angles still float32, logits float32."""
    config, hf_model, _ = models(case)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = get_model_class(config)(config)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(hf_model.state_dict().items())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    prompt = random_tokens(30, seed=11)
    runner = PagedTestRunner(model, config, dtype=torch.bfloat16, block_size=4)
    logits = torch.cat([runner.step([("a", prompt[:20])])[0], runner.step([("a", prompt[20:])])[0]])
    want = hf_logits(hf_model, prompt)
    assert logits.dtype == torch.float32
    # bf16 keeps ~3 significant digits: errors stay within 2% of the largest logit
    assert (logits - want).abs().max().item() < 0.02 * want.abs().max().item()
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_llama3_rope_scaling_is_applied() -> None:
    """The same weights under default RoPE give different logits: the comparison above can fail."""
    config, hf_model, _ = models("llama_llama3_rope_tied")
    plain = build_fitserve_model(
        tiny_hf_config("LlamaForCausalLM", tie_word_embeddings=True), hf_model.state_dict()
    )
    prompt = random_tokens(37, seed=1)
    (logits,) = PagedTestRunner(plain, config).step([("a", prompt)])
    assert (logits - hf_logits(hf_model, prompt)).abs().max().item() > 1e-2


def test_rope_settings_from_legacy_attributes_match_hf() -> None:
    """A transformers-4 style config (rope_theta + rope_scaling with 'type') gives HF's frequencies."""
    legacy = SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling={
            k if k != "rope_type" else "type": v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"
        },
        max_position_embeddings=512,
    )
    settings = rope_settings_from_config(legacy)
    assert settings.rope_type == "llama3" and settings.original_max_position_embeddings == 64
    _, hf_model, _ = models("llama_llama3_rope_tied")
    assert torch.equal(compute_inv_freq(16, settings), hf_model.model.rotary_emb.inv_freq)
    plain = SimpleNamespace(rope_theta=500000.0, rope_scaling=None)
    assert rope_settings_from_config(plain).theta == 500000.0


def test_unsupported_rope_type_is_refused() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(
        ValueError, match=r"rope_type='yarn' is not supported.*\['default', 'linear', 'llama3'\]"
    ):
        rope_settings_from_config(config)


def test_tied_model_ignores_checkpoint_lm_head() -> None:
    config, hf_model, _ = models("qwen2_tied")
    state = dict(hf_model.state_dict())
    state["lm_head.weight"] = torch.randn_like(state["lm_head.weight"])  # must not be used
    model = build_fitserve_model(config, state)
    prompt = random_tokens(10, seed=9)
    (logits,) = PagedTestRunner(model, config).step([("a", prompt)])
    assert_matches(logits, hf_logits(hf_model, prompt))
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_load_weights_reports_only_complete_parameters() -> None:
    config, hf_model, _ = models("llama")
    state = {k: v for k, v in hf_model.state_dict().items() if k not in ("lm_head.weight",)}
    del state["model.layers.0.self_attn.k_proj.weight"]
    state["model.layers.0.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints carry this; skipped
    model = get_model_class(config)(config)
    loaded = model.load_weights(state.items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert missing == {"lm_head.weight", "model.layers.0.self_attn.qkv_proj.weight"}


def test_load_weights_names_bad_tensors() -> None:
    config, hf_model, _ = models("llama")
    model = get_model_class(config)(config)
    wrong = torch.zeros(3, 64)
    with pytest.raises(
        ValueError, match=r"'model.layers.1.mlp.up_proj.weight'.*shape \(3, 64\).*\(128, 64\)"
    ):
        model.load_weights([("model.layers.1.mlp.up_proj.weight", wrong)])
    with pytest.raises(
        ValueError, match="'model.vision_tower.weight' matches no parameter of LlamaForCausalLM"
    ):
        model.load_weights([("model.vision_tower.weight", wrong)])


def test_sliding_window_masks_older_keys_on_the_cpu() -> None:
    """Mistral with a 16-token window: contexts longer than the window match HF, whose mask hides the
    keys older than the window (the CPU backend masks them too; the CUDA path still refuses them:
    tests/unit/test_gemma4_window_attention.py), in one prefill and in chunks."""
    config = tiny_hf_config("MistralForCausalLM", sliding_window=16)
    hf_model = build_hf_model(config)
    model = build_fitserve_model(config, hf_model.state_dict())
    prompt = random_tokens(41, seed=10)
    want = hf_logits(hf_model, prompt)
    (logits,) = PagedTestRunner(model, config).step([("a", prompt)])
    assert_matches(logits, want)
    runner = PagedTestRunner(model, config, block_size=4)
    pieces = [runner.step([("a", prompt[a:b])])[0] for a, b in ((0, 20), (20, 23), (23, 40), (40, 41))]
    assert_matches(torch.cat(pieces), want)


def test_unknown_architecture_lists_supported() -> None:
    config = SimpleNamespace(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as error:
        get_model_class(config)
    message = str(error.value)
    assert "'GPT2LMHeadModel' is not supported" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message
    assert supported_architectures() == sorted(supported_architectures())
    with pytest.raises(ValueError, match="no 'architectures' entry"):
        get_model_class(SimpleNamespace(architectures=None))


def test_registry_imports_a_family_only_when_asked() -> None:
    code = (
        "import sys\n"
        "from types import SimpleNamespace\n"
        "from fitserve.models.registry import get_model_class\n"
        "assert not any(m in sys.modules for m in ('fitserve.models.llama', 'fitserve.models.qwen3'))\n"
        "get_model_class(SimpleNamespace(architectures=['Qwen3ForCausalLM']))\n"
        "assert 'fitserve.models.qwen3' in sys.modules and 'fitserve.models.llama' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
