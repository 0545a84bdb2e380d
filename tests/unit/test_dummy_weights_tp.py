"""Dummy weights (--load-format dummy) are one model at every tensor-parallel size.

Each matrix is drawn whole (as a checkpoint holds it) from a generator seeded by the seed and its name,
and each rank keeps its part through the layer's own loading logic (models/weights.py). On tiny Llama,
Qwen3, Gemma-4 (E model; MoE with and without expert parallel) and Qwen3.5 (dense; MoE with and without
expert parallel) configs: every rank's parameters at TP 2 (and TP 4 for one) are its part of the TP 1
model's, and the engine at TP 2 gives TP 1's greedy tokens and logprobs (float32, gloo on the CPU). A
split matrix differs between ranks (the LM head's shards), a replicated one is equal; the same seed
gives the same weights, another seed others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fitserve import LLM, SamplingParams
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.gemma4_config import with_expert_parallel
from fitserve.models.registry import get_model_class
from fitserve.models.weights import initialize_dummy_weights
from tests.model_folders import save_with_tokenizer
from tests.quant_checkpoints import QuantSpec
from tests.unit import gemma4_helpers, qwen3_5_helpers
from tests.unit.model_helpers import tiny_hf_config
from tests.unit.test_quant_int4_dummy import config_folder as int4_config_folder
from tests.unit.tp_helpers import on_rank

SEED = 11
TOLERANCE = 1e-4
INT4_TOLERANCE = 1e-3  # the int4 matmuls round partial sums in bfloat16
NEW_TOKENS = 10
PROMPTS = [[5, 6, 7, 8, 60, 61], list(range(30, 53)), [3]]
# name -> (folder, --enable-expert-parallel)
CASES: dict[str, tuple[str, bool]] = {
    "llama": ("llama", False),
    "qwen3": ("qwen3", False),
    "gemma4_e": ("gemma4_e", False),
    "gemma4_moe": ("gemma4_moe", False),
    "gemma4_moe_expert_parallel": ("gemma4_moe", True),
    "qwen3_5_dense": ("qwen3_5_dense", False),
    "qwen3_5_moe": ("qwen3_5_moe", False),
    "qwen3_5_moe_expert_parallel": ("qwen3_5_moe", True),
}


def _configs() -> dict[str, Any]:
    """name -> HF config. Llama's vocabulary (251) leaves the last rank's LM head rows padded at TP 2."""
    return {
        "llama": tiny_hf_config("LlamaForCausalLM", vocab_size=251),
        "qwen3": tiny_hf_config("Qwen3ForCausalLM", tie_word_embeddings=True),
        "gemma4_e": gemma4_helpers.text_config("e_model"),
        "gemma4_moe": gemma4_helpers.text_config("moe_k_eq_v"),
        "qwen3_5_dense": qwen3_5_helpers.make_config(moe=False, conditional=False),
        "qwen3_5_moe": qwen3_5_helpers.make_config(moe=True, conditional=True),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Folders with a config.json and a tokenizer, no weights: dummy loads need none."""
    paths = {}
    for name, config in _configs().items():
        folder = tmp_path_factory.mktemp(name)
        save_with_tokenizer(config, folder)
        paths[name] = folder
    return paths


def dummy_model(folder: Path, expert_parallel: bool = False, seed: int = SEED) -> nn.Module:
    """This process's rank's model (tp() as set by the caller) with dummy weights, float32 on the CPU."""
    config = with_expert_parallel(CheckpointConfig.from_folder(folder), expert_parallel)
    model = get_model_class(config)(config)
    initialize_dummy_weights(model, seed)
    return model


def whole_tensors(model: nn.Module) -> dict[tuple[str, str], Any]:
    return {
        (prefix, whole.key): whole
        for prefix, module in model.named_modules()
        for whole in getattr(module, "whole_tensors", list)()
    }


def assert_parts_of(
    single: nn.Module, folder: Path, expert_parallel: bool, rank: int, size: int
) -> nn.Module:
    """Rank `rank` of `size`'s dummy model holds its part of `single` (the TP 1 model): each whole tensor
    of `single`, cut by the rank's loader, gives the rank's values; every other parameter equals
    `single`'s (replicated). Returns the rank's model."""
    with on_rank(rank, size):
        model = dummy_model(folder, expert_parallel)
        ours, theirs = whole_tensors(model), whole_tensors(single)
        covered = set()
        with torch.no_grad():
            for key, whole in ours.items():
                source = theirs[key].into  # at TP 1 the parameter holds every whole tensor itself
                assert source is not None and tuple(source.shape) == whole.shape, key
                drawn = whole.param.detach().clone()
                whole.load(source)  # the rank's part of the one-rank model's tensor
                assert torch.equal(whole.param, drawn), f"{key} on rank {rank} of {size}"
                covered.add(id(whole.param))
    reference = dict(single.named_parameters())
    for name, param in model.named_parameters():
        if id(param) in covered:
            continue
        if param.ndim >= 2:
            assert param.shape == reference[name].shape, f"{name} is split but draws its own shape"
            assert torch.equal(param, reference[name]), name
        else:  # 1 or 0 everywhere (a rank's share of A_log is shorter, and the same)
            assert torch.equal(param, torch.full_like(param, reference[name][0].item())), name
    return model


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_its_part_of_the_one_rank_model(folders, name):
    folder_name, expert_parallel = CASES[name]
    folder = folders[folder_name]
    single = dummy_model(folder, expert_parallel)
    first, second = (assert_parts_of(single, folder, expert_parallel, rank, 2) for rank in range(2))
    # a split matrix's ranks differ: the vocabulary's halves
    embedding = "model.embed_tokens.weight"
    ours, theirs = dict(first.named_parameters())[embedding], dict(second.named_parameters())[embedding]
    assert ours.shape == theirs.shape and not torch.allclose(ours, theirs)


def test_tp4_with_replicated_kv_heads(tmp_path):
    """Qwen3.5 with 4 key heads at TP 4: its full layer's 2 KV heads each on two ranks."""
    config = qwen3_5_helpers.make_config(moe=False, conditional=False)
    config.linear_num_key_heads, config.linear_num_value_heads = 4, 8
    config.save_pretrained(tmp_path)
    single = dummy_model(tmp_path)
    models = [assert_parts_of(single, tmp_path, False, rank, 4) for rank in range(4)]
    k_proj = [dict(m.named_parameters())["model.layers.2.self_attn.k_proj.weight"] for m in models]
    assert torch.equal(k_proj[0], k_proj[1]) and not torch.allclose(k_proj[1], k_proj[2])


def test_lm_head_shards_differ_and_replicated_matrices_agree(folders):
    ranks = []
    for rank in range(2):
        with on_rank(rank, 2):
            ranks.append(dict(dummy_model(folders["llama"]).named_parameters()))
    single = dict(dummy_model(folders["llama"]).named_parameters())
    head = [params["lm_head.weight"] for params in ranks]
    assert head[0].shape == head[1].shape == (126, 64)
    assert not torch.allclose(head[0], head[1])
    assert torch.equal(head[0], single["lm_head.weight"][:126])
    assert torch.equal(head[1][:125], single["lm_head.weight"][126:])
    assert not head[1][125].any()  # the row past the vocabulary
    assert head[0].std() == pytest.approx(0.02, rel=0.1)
    # the Qwen3.5 MoE router (a replicated linear) is whole and equal on both ranks
    routers = []
    for rank in range(2):
        with on_rank(rank, 2):
            model = dummy_model(folders["qwen3_5_moe"])
            routers.append(model.model.layers[0].mlp.gate.weight)
    assert routers[0].shape == (4, 32) and torch.equal(routers[0], routers[1])
    assert routers[0].abs().sum() > 0


def test_same_seed_same_weights_other_seed_others(folders):
    folder = folders["gemma4_moe"]
    first, again = (dict(dummy_model(folder).named_parameters()) for _ in range(2))
    other = dict(dummy_model(folder, seed=SEED + 1).named_parameters())
    for name, param in first.items():
        assert torch.equal(param, again[name]), name
        if param.ndim >= 2:
            assert not torch.equal(param, other[name]), name
        else:  # norm scales 1, biases 0 whatever the seed
            assert torch.equal(param, other[name]), name


def test_matrices_are_independent_of_each_other(folders):
    """Each matrix is its own draw: no two of a model's matrices (nor two experts) repeat values."""
    params = dict(dummy_model(folders["qwen3_5_moe"]).named_parameters())
    firsts = [p.flatten()[:8] for p in params.values() if p.ndim >= 2]
    experts = params["model.layers.0.mlp.experts.gate_up_proj"]
    firsts += [expert.flatten()[:8] for expert in experts[1:]]  # expert 0's opened the tensor's
    assert len({tuple(values.tolist()) for values in firsts}) == len(firsts)


def _greedy(llm: LLM) -> list[Any]:
    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sampling, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def make_llm(folder: Path, **kwargs: Any) -> LLM:
    return LLM(
        str(folder),
        load_format="dummy",
        seed=SEED,
        dtype="float32",
        block_size=8,
        num_gpu_blocks_override=64,
        **kwargs,
    )


@pytest.fixture(scope="module")
def single(folders) -> dict[str, list[Any]]:
    """Each folder's greedy outputs at TP 1."""
    return {name: _greedy(make_llm(folder)) for name, folder in folders.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_engine_tp2_equals_tp1(folders, single, name):
    folder_name, expert_parallel = CASES[name]
    two = make_llm(folders[folder_name], tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        got = _greedy(two)
    finally:
        two.engine.shutdown()
    want = single[folder_name]
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    distinct = set()
    for (_, ours), (_, theirs) in zip(got, want, strict=True):
        for position_ours, position_theirs in zip(ours, theirs, strict=True):
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < TOLERANCE
            top = sorted((entry.logprob for entry in position_ours.values()), reverse=True)
            assert top[0] - top[1] > 0  # no repeated logits (a vocab shard's copy of another's)
            distinct.update(position_ours)
    assert len(distinct) > 3


@pytest.mark.parametrize("spec", [QuantSpec("gptq", 32), QuantSpec("ct", 32, sym=False)], ids=["gptq", "ct"])
def test_int4_engine_tp2_equals_tp1(tmp_path, spec):
    """An int4 checkpoint's config.json: each projection's random int4 weight is drawn whole and cut as
    a checkpoint's is, so TP 2 runs TP 1's model (Qwen3 with hidden 128: group 32 splits evenly)."""
    folder = int4_config_folder(tmp_path, spec)
    want = _greedy(make_llm(folder))
    two = make_llm(folder, tensor_parallel_size=2)
    try:
        got = _greedy(two)
    finally:
        two.engine.shutdown()
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, ours), (_, theirs) in zip(got, want, strict=True):
        for position_ours, position_theirs in zip(ours, theirs, strict=True):
            for token_id, entry in position_theirs.items():
                assert abs(position_ours[token_id].logprob - entry.logprob) < INT4_TOLERANCE
