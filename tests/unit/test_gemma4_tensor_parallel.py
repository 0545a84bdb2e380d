"""Gemma-4 under tensor parallel on the CPU (gloo, 2 processes): rank 0's logits equal one rank's.

Tiny random models (gemma4_helpers.CASES): the E model (per-layer inputs, KV-shared layers, double-wide
MLPs) and the MoE model (K=V full layers with 1 KV head, replicated on both ranks; sliding layers' 2 KV
heads split), the MoE one with each expert's intermediate dim split and with expert parallel (3 of the 6
experts per rank). Each rank loads the whole checkpoint and keeps its part; a batch of two prompts
prefills over paged caches of the rank's KV heads, then decodes greedily (rank 0 picks, the token is
broadcast); the profiling path (no cache) runs too. Rank 1's compute_logits returns None.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fitserve.distributed.collectives import broadcast_from_first
from fitserve.distributed.parallel_state import tp
from fitserve.layers.attention.metadata import forward_context
from fitserve.layers.moe import FusedExperts
from fitserve.models.gemma4_config import with_expert_parallel
from fitserve.models.registry import get_model_class
from tests.unit.gemma4_helpers import GemmaRankRunner, build_hf, fitserve_config, random_tokens, text_config
from tests.unit.tp_helpers import on_rank, run_ranks

TOLERANCE = 1e-4
DECODE_STEPS = 4
# name -> (case, expert parallel)
RUNS: dict[str, tuple[str, bool]] = {
    "dense": ("e_model", False),
    "moe": ("moe_k_eq_v", False),
    "moe_expert_parallel": ("moe_k_eq_v", True),
}


def build_rank_model(folder: Path, expert_parallel: bool) -> tuple[Any, torch.nn.Module]:
    """This rank's model from the folder's config.json and the whole checkpoint."""
    config = with_expert_parallel(fitserve_config(folder), expert_parallel)
    model = get_model_class(config)(config).eval()
    loaded = model.load_weights(load_file(folder / "model.safetensors").items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert not missing, f"parameters left unloaded: {sorted(missing)}"
    return config, model


@torch.no_grad()
def generate(folder: Path, expert_parallel: bool) -> dict[str, Any]:
    """Prefill two prompts, decode greedily; the logits of every step (None off rank 0), the tokens, the
    no-cache forward's logits and the rank's head counts and expert shapes."""
    config, model = build_rank_model(folder, expert_parallel)
    runner = GemmaRankRunner(model, config)
    tokens = {"a": random_tokens(13, seed=1), "b": random_tokens(9, seed=2)}
    pending = dict(tokens)
    steps: list[list[torch.Tensor] | None] = []
    for _ in range(DECODE_STEPS):
        logits = runner.step(list(pending.items()))
        steps.append(logits)
        chosen = torch.zeros(len(pending), dtype=torch.int64)
        if logits is not None:
            chosen = torch.stack([rows[-1].argmax() for rows in logits])
        chosen = broadcast_from_first(chosen)  # every rank feeds rank 0's choice back
        for name, token in zip(list(pending), chosen.tolist(), strict=True):
            tokens[name] = tokens[name] + [token]
            pending[name] = [token]
    prompt = random_tokens(17, seed=3)
    with forward_context(None, []):
        no_cache = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt))))
    layers = model.model.layers
    return {
        "steps": steps,
        "tokens": tokens,
        "no_cache": no_cache,
        "heads": [(layer.self_attn.num_heads, layer.self_attn.num_kv_heads) for layer in layers],
        "experts": [tuple(layer.experts.gate_up_proj.shape) for layer in layers if layer.moe],
    }


def rank_main(rank: int, folders: dict[str, str]) -> dict[str, Any]:
    del rank  # the rank is the process's (parallel_state.tp())
    return {name: generate(Path(folders[case]), ep) for name, (case, ep) in RUNS.items()}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemma4_tp")
    paths = {}
    for case in {case for case, _ in RUNS.values()}:
        build_hf(text_config(case)).save_pretrained(root / case)
        paths[case] = str(root / case)
    return paths


@pytest.fixture(scope="module")
def results(folders) -> dict[int, dict[str, Any]]:
    """name -> result at TP=1 (this process) and on each rank of TP=2."""
    assert tp().size == 1
    single = rank_main(0, folders)
    first, second = run_ranks(rank_main, 2, folders)
    return {1: single, 2: first, 3: second}


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    error = (got - want).abs().max().item()
    assert error < TOLERANCE, f"max |logit difference| {error:.3g} >= {TOLERANCE}"


@pytest.mark.parametrize("name", list(RUNS))
def test_rank0_logits_match_one_rank(results, name):
    single, first = results[1][name], results[2][name]
    assert first["tokens"] == single["tokens"]  # greedy picks equal, so both ran the same sequences
    for got, want in zip(first["steps"], single["steps"], strict=True):
        assert got is not None
        for got_rows, want_rows in zip(got, want, strict=True):
            assert_close(got_rows, want_rows)
            assert torch.equal(got_rows.argmax(-1), want_rows.argmax(-1))
    assert_close(first["no_cache"], single["no_cache"])


@pytest.mark.parametrize("name", list(RUNS))
def test_other_ranks_get_no_logits(results, name):
    second = results[3][name]
    assert second["no_cache"] is None
    assert all(step is None for step in second["steps"])
    assert second["tokens"] == results[1][name]["tokens"]  # the broadcast tokens reached rank 1


def test_ranks_hold_their_share(results):
    # 4 q heads -> 2 per rank; sliding layers' 2 KV heads split, the full layers' K=V single head replicated
    assert results[1]["moe"]["heads"] == [(4, 2), (4, 1), (4, 2), (4, 1)]
    assert results[2]["moe"]["heads"] == [(2, 1)] * 4
    assert results[2]["dense"]["heads"] == [(2, 1)] * 6
    # 6 experts of intermediate 16: [6, 2 x 8, 32] split by intermediate, [3, 2 x 16, 32] by expert
    assert results[2]["moe"]["experts"] == [(6, 16, 32)] * 4
    assert results[3]["moe_expert_parallel"]["experts"] == [(3, 32, 32)] * 4


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_expert_partials_sum_to_the_whole(expert_parallel):
    """Each rank's experts (or intermediate slices), loaded from the whole tensors, give partial outputs
    that sum to the one-rank output; reduce=False leaves them unreduced."""
    torch.manual_seed(0)
    num_experts, hidden, width, tokens, top_k = 4, 8, 6, 5, 2
    gate_up = torch.randn(num_experts, 2 * width, hidden)
    down = torch.randn(num_experts, hidden, width)
    x = torch.randn(tokens, hidden)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)

    def build() -> FusedExperts:
        experts = FusedExperts(num_experts, hidden, width, torch.nn.functional.silu, expert_parallel)
        experts.gate_up_proj.weight_loader(experts.gate_up_proj, gate_up)
        experts.down_proj.weight_loader(experts.down_proj, down)
        return experts

    want = build()(x, ids, weights)
    partials = []
    for rank in range(2):
        with on_rank(rank, 2):
            partials.append(build()(x, ids, weights, reduce=False))
    assert (partials[0] - want).abs().max() > 1e-3  # each rank's part is only part of it
    assert torch.allclose(partials[0] + partials[1], want, atol=1e-5)


def test_tp_must_divide_heads_and_experts(folders):
    config = fitserve_config(Path(folders["moe_k_eq_v"]))
    model_class = get_model_class(config)
    with on_rank(0, 3), pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by .*=3"):
        model_class(config)
    with on_rank(0, 4):
        model_class(config)  # without expert parallel: each expert's 16 intermediate rows split 4 ways
        with pytest.raises(ValueError) as error:
            model_class(with_expert_parallel(config, True))
    message = str(error.value)
    assert "6 experts" in message and "tensor_parallel_size=4" in message
    assert "--tensor-parallel-size that divides 6" in message and "--enable-expert-parallel" in message
    with (
        on_rank(0, 4),
        pytest.raises(ValueError, match=r"intermediate size .*\(6\) is not divisible by .*=4"),
    ):
        FusedExperts(4, 8, 6, torch.nn.functional.silu)


def test_kv_heads_neither_dividing_nor_multiple_is_refused(folders):
    config = fitserve_config(Path(folders["e_model"]))
    config.num_attention_heads, config.num_key_value_heads = 12, 3  # 3 KV heads on 2 ranks
    with on_rank(0, 2), pytest.raises(ValueError, match=r"KV heads \(3\) is not divisible by .*=2"):
        get_model_class(config)(config)
