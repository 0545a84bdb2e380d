"""fitserve's Gemma-4 against HF transformers' modeling_gemma4.py on tiny random models (float32, CPU).

As in test_models_vs_hf.py: fitserve's logits for the tokens a step computes equal HF's at the same
positions of the whole sequence run at once. The prompts are longer than the sliding window (8), so the
window's mask, the KV-shared layers' reads and the chunk boundaries all matter.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fitserve.layers.attention.metadata import forward_context
from fitserve.models.registry import get_model_class
from tests.model_folders import save_with_tokenizer
from tests.unit.gemma4_helpers import (
    CASES,
    WINDOW,
    GemmaPagedRunner,
    build_fitserve,
    build_hf,
    conditional_config,
    fitserve_config,
    random_tokens,
    saved_config,
    text_config,
)

TOLERANCE = 1e-4
FORMS = [(case, form) for case in CASES for form in ("causal", "conditional")]


@functools.cache
def models(case: str, form: str, folder: Path) -> tuple[Any, nn.Module, nn.Module]:
    config = text_config(case) if form == "causal" else conditional_config(case)
    hf_model = build_hf(config)
    save_with_tokenizer(hf_model, folder)
    fs_config, model = build_fitserve(folder, hf_model)
    return fs_config, hf_model, model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma4")


def get(model_dir: Path, case: str, form: str) -> tuple[Any, nn.Module, nn.Module]:
    return models(case, form, model_dir / f"{case}-{form}")


@torch.no_grad()
def hf_logits(hf_model: nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf_model(input_ids=torch.tensor([tokens])).logits[0].float()


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    error = (got - want).abs().max().item()
    assert error < TOLERANCE, f"max |logit difference| {error:.3g} >= {TOLERANCE}"


@pytest.mark.parametrize(("case", "form"), FORMS)
def test_prefill_and_chunks_match_hf(model_dir, case, form):
    config, hf_model, model = get(model_dir, case, form)
    prompt = random_tokens(29, seed=1)
    want = hf_logits(hf_model, prompt)
    (whole,) = GemmaPagedRunner(model, config).step([("a", prompt)])
    assert_matches(whole, want)
    runner = GemmaPagedRunner(model, config)  # a long chunk, short ones over a cached prefix, one token
    pieces = [runner.step([("a", prompt[a:b])])[0] for a, b in ((0, 19), (19, 23), (23, 28), (28, 29))]
    assert_matches(torch.cat(pieces), want)


@pytest.mark.parametrize(("case", "form"), FORMS)
def test_greedy_decode_with_mixed_batches_matches_hf(model_dir, case, form):
    """Two prompts prefill then decode past the window; a third joins mid-way (prefill beside decodes)."""
    config, hf_model, model = get(model_dir, case, form)
    runner = GemmaPagedRunner(model, config)
    tokens = {"a": random_tokens(11, seed=5), "b": random_tokens(21, seed=6), "c": random_tokens(7, seed=7)}
    produced: dict[str, list[torch.Tensor]] = {name: [] for name in tokens}
    pending = {"a": tokens["a"], "b": tokens["b"]}
    for step in range(6):
        if step == 2:
            pending["c"] = tokens["c"]
        names = list(pending)
        for name, logits in zip(names, runner.step([(n, pending[n]) for n in names]), strict=True):
            produced[name].append(logits)
            tokens[name] = tokens[name] + [int(logits[-1].argmax())]
            pending[name] = tokens[name][-1:]
    for name, pieces in produced.items():
        computed = torch.cat(pieces)
        assert computed.shape[0] > WINDOW
        assert_matches(computed, hf_logits(hf_model, tokens[name][: computed.shape[0]]))


@pytest.mark.parametrize("case", list(CASES))
def test_forward_without_cache_matches_hf(model_dir, case):
    """The profiling path (no KV cache): one causal sequence, windowed, KV-shared layers fed directly."""
    _, hf_model, model = get(model_dir, case, "causal")
    prompt = random_tokens(23, seed=8)
    with torch.no_grad(), forward_context(None, []):
        logits = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    assert_matches(logits, hf_logits(hf_model, prompt))


def test_the_cases_exercise_every_feature(model_dir):
    """Each feature changes the logits: without the window's mask, or with a plain (1 + weight)-style
    norm, fitserve's model would not match (the tests above could fail)."""
    config, hf_model, model = get(model_dir, "e_model", "causal")
    prompt = random_tokens(29, seed=1)
    want = hf_logits(hf_model, prompt)
    attentions = [layer.self_attn.attn for layer in model.model.layers]
    windows = [a.sliding_window for a in attentions]
    try:
        for attention in attentions:
            attention.sliding_window = None
        (unwindowed,) = GemmaPagedRunner(model, config).step([("a", prompt)])
    finally:
        for attention, window in zip(attentions, windows, strict=True):
            attention.sliding_window = window
    assert (unwindowed - want).abs().max() > 1e-2
    assert [a.kv_cache_layer for a in attentions] == [0, 1, 2, 1, 1, 2]
    mlp_widths = [layer.mlp.down_proj.input_size for layer in model.model.layers]
    assert mlp_widths == [48, 48, 48, 96, 96, 96]
    assert {a.head_dim for a in attentions} == {16, 32}


def test_conditional_checkpoint_skips_the_towers(model_dir, caplog):
    _, hf_model, model = get(model_dir, "moe_k_eq_v", "conditional")
    names = list(hf_model.state_dict())
    assert any(name.startswith("model.vision_tower.") for name in names)
    assert any(name.startswith("model.language_model.") for name in names)
    with caplog.at_level("INFO", logger="fitserve"):
        model.load_weights(hf_model.state_dict().items())
    assert "vision/audio tower tensors" in caplog.text
    assert not any("tower" in name for name, _ in model.named_parameters())
    assert "text_config" in saved_config(model_dir / "moe_k_eq_v-conditional")


@pytest.mark.parametrize("case", ["e_model"])
def test_bf16_model_tracks_hf_fp32(model_dir, case):
    """Built under default dtype bf16 (the checkpoints' dtype): weights and cache bf16, RoPE angles
    float32, logits float32 and close to HF's float32 ones. (Not the MoE case: on its random router a
    bf16 rounding flips some tokens' experts, in HF's own bf16 model as much as here, which moves those
    logits by several units.)"""
    folder = model_dir / f"{case}-causal"
    _, hf_model, _ = get(model_dir, case, "causal")
    config = fitserve_config(folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = get_model_class(config)(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(hf_model.state_dict().items())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(rotary.inv_freq.dtype == torch.float32 for rotary in model.model.rotary.values())
    prompt = random_tokens(30, seed=11)
    runner = GemmaPagedRunner(model, config, dtype=torch.bfloat16)
    logits = torch.cat([runner.step([("a", prompt[:20])])[0], runner.step([("a", prompt[20:])])[0]])
    want = hf_logits(hf_model, prompt)
    assert logits.dtype == torch.float32
    assert (logits - want).abs().max().item() < 0.05 * want.abs().max().item()
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
