"""Qwen3.5 / Qwen3.6 hybrids under tensor parallel on the CPU (gloo, one process per rank).

On tiny random models (qwen3_5_helpers: 2 DeltaNet key heads serving 4 value heads, 4 attention heads on 2
KV heads; the MoE with 4 experts and a shared expert): the engine at TP 2 gives TP 1's greedy tokens and
logprobs (within 1e-4, float32) for a long prompt prefilled in chunks beside short whole ones, and for a
second chat turn that resumes from the first's recurrent-state snapshot (a prefix-cache hit); the MoE also
with --enable-expert-parallel. A config with 4 key heads runs at TP 4 (the full layer's 2 KV heads each on
two ranks). A rank keeps its heads' share of every DeltaNet tensor and state; per-expert checkpoint
tensors load as the fused ones do on each rank; a TP size that does not divide the heads is refused naming
them; the planner counts a rank's state pool at 1/n.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fitserve import LLM, SamplingParams
from fitserve.cli.plan import run_plan
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.gemma4_config import with_expert_parallel
from fitserve.models.registry import get_model_class
from fitserve.planner.fit_errors import PlanError
from fitserve.planner.memory import plan_memory
from fitserve.worker.recurrent_state import recurrent_state_layers, state_bytes_per_slot
from tests.model_folders import save_with_tokenizer
from tests.unit.planner_helpers import memory_inputs
from tests.unit.qwen3_5_helpers import TEXT, build_hf, make_config
from tests.unit.test_planner_cli import parse
from tests.unit.tp_helpers import on_rank

BLOCK = 16
NEW_TOKENS = 12
TOLERANCE = 1e-4
_generator = torch.Generator().manual_seed(7)
# 150 tokens prefilled in chunks of 64 (max_num_batched_tokens), beside two prompts that fit one step
PROMPTS = [torch.randint(0, 256, (n,), generator=_generator).tolist() for n in (150, 37, 5)]
NEXT_USER = torch.randint(0, 256, (23,), generator=_generator).tolist()
# name -> (model folder, --enable-expert-parallel)
RUNS: dict[str, tuple[str, bool]] = {
    "dense": ("dense", False),
    "moe": ("moe", False),
    "moe_expert_parallel": ("moe", True),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    dense = build_hf(make_config(moe=False, conditional=False), seed=3)
    moe = build_hf(make_config(moe=True, conditional=True), seed=4)
    return {
        "dense": save_with_tokenizer(dense, tmp_path_factory.mktemp("d")),
        "moe": save_with_tokenizer(moe, tmp_path_factory.mktemp("m")),
    }


def make_llm(folder: Path, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(str(folder), dtype="float32", block_size=BLOCK, **kwargs)


def generate(llm: LLM, prompts: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def conversation(llm: LLM) -> dict[str, Any]:
    """The prompts as one batch, then a second turn of the long one: its outputs and prefix-cache hit."""
    batch = generate(llm, PROMPTS)
    second = PROMPTS[0] + list(batch[0].outputs[0].token_ids) + NEXT_USER
    before = llm.engine.get_stats().prefix_cache_hits
    turn = generate(llm, [second])[0]
    return {
        "batch": batch,
        "turn": turn,
        "hits": llm.engine.get_stats().prefix_cache_hits - before,
    }


def assert_same(got: Any, want: Any) -> None:
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for ours, theirs in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        for token_id, entry in theirs.items():
            assert abs(ours[token_id].logprob - entry.logprob) < TOLERANCE


@pytest.fixture(scope="module")
def single(folders) -> dict[str, dict[str, Any]]:
    """Each model's conversation at TP 1, whole prompts (one step each)."""
    return {name: conversation(make_llm(folder)) for name, folder in folders.items()}


@pytest.mark.parametrize("name", list(RUNS))
def test_tp2_equals_tp1(folders, single, name):
    folder, expert_parallel = RUNS[name]
    two = make_llm(
        folders[folder],
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        max_num_batched_tokens=64,
    )
    try:
        got = conversation(two)
    finally:
        two.engine.shutdown()
    want = single[folder]
    for ours, theirs in zip(got["batch"], want["batch"], strict=True):
        assert_same(ours, theirs)
    # the first turn's state snapshot at its last block boundary: 150 prompt + 11 computed outputs -> 160
    assert got["hits"] == want["hits"] == 160
    assert got["turn"].num_cached_tokens == 160
    assert_same(got["turn"], want["turn"])


def test_tp4_equals_tp1(tmp_path):
    """4 key heads, 8 value heads: one key head and its two value heads per rank; the full layer's 2 KV
    heads each replicated on two ranks."""
    text = dict(TEXT, linear_num_key_heads=4, linear_num_value_heads=8)
    config = make_config(moe=False, conditional=False)
    for key, value in text.items():
        setattr(config, key, value)
    folder = save_with_tokenizer(build_hf(config, seed=6), tmp_path)
    prompts = PROMPTS[1:]
    want = generate(make_llm(folder), prompts)
    four = make_llm(folder, tensor_parallel_size=4)
    try:
        assert four.engine.config.rank_kv_layers[2].num_kv_heads == 1
        got = generate(four, prompts)
    finally:
        four.engine.shutdown()
    for ours, theirs in zip(got, want, strict=True):
        assert_same(ours, theirs)


def rank_model(folder: Path, weights: dict[str, torch.Tensor], expert_parallel: bool = False) -> Any:
    config = with_expert_parallel(CheckpointConfig.from_folder(folder), expert_parallel)
    model = get_model_class(config)(config)
    loaded = model.load_weights(weights.items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert not missing, f"parameters left unloaded: {sorted(missing)}"
    return model


def test_a_rank_holds_its_heads_of_every_delta_net_tensor(folders):
    """Rank 1 of 2 holds key head 1 (with value heads 2 and 3): its rows of in_proj_qkv's q, k and v parts
    and of the conv1d's channels, its value heads' rows of z, a, b, A_log and dt_bias, and out_proj's
    columns of them; its state pool is half of one rank's."""
    folder = folders["dense"]
    weights = load_file(folder / "model.safetensors")
    with on_rank(1, 2):
        model = rank_model(folder, weights)
    layer = model.model.layers[0].linear_attn
    assert (layer.num_k_heads, layer.num_v_heads, layer.conv_dim) == (1, 2, 32)
    prefix = "model.layers.0.linear_attn."
    key, value = 8, 16  # one key head (k_dim 8), two value heads (v_dim 8)
    whole_key = 16
    rows = [*range(key, 2 * key), *range(whole_key + key, whole_key + 2 * key)]
    rows += range(2 * whole_key + value, 2 * whole_key + 2 * value)
    # the 16-bit projections in one matrix: this rank's [q | k | v | z | b | a] rows
    assert layer.merged_in_proj
    qkv, z, b, a = layer.in_proj.weight.split((32, value, 2, 2))
    assert torch.equal(qkv, weights[prefix + "in_proj_qkv.weight"][rows])
    assert torch.equal(layer.conv_weight, weights[prefix + "conv1d.weight"][rows, 0])
    assert torch.equal(z, weights[prefix + "in_proj_z.weight"][value:])
    assert torch.equal(b, weights[prefix + "in_proj_b.weight"][2:])
    assert torch.equal(a, weights[prefix + "in_proj_a.weight"][2:])
    assert torch.equal(layer.A_log, weights[prefix + "A_log"][2:])
    assert torch.equal(layer.dt_bias, weights[prefix + "dt_bias"][2:])
    assert torch.equal(layer.out_proj.weight, weights[prefix + "out_proj.weight"][:, value:])
    attention = model.model.layers[2].self_attn
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
    config = CheckpointConfig.from_folder(folder)
    shape = recurrent_state_layers(config, 2)[0]
    assert shape.conv_shape == (32, 3) and shape.recurrent_shape == (2, 8, 8)
    assert 2 * state_bytes_per_slot(config, 4, 2) == state_bytes_per_slot(config, 4)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_per_expert_tensors_load_as_the_fused_ones_on_each_rank(folders, expert_parallel):
    """transformers saves the per-expert form (`experts.<e>.gate_proj.weight` ...); the same experts as
    fused tensors (`experts.gate_up_proj` [E, 2I, hidden], `experts.down_proj` [E, hidden, I]) load into
    the same rank parameters."""
    folder = folders["moe"]
    per_expert = load_file(folder / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, list[torch.Tensor]]] = {}
    for name, tensor in per_expert.items():
        base, marker, rest = name.partition(".mlp.experts.")
        if not marker:
            fused[name] = tensor
            continue
        expert, projection, _ = rest.split(".")
        experts.setdefault(base + marker, {}).setdefault(projection, []).insert(int(expert), tensor)
    for base, projections in experts.items():
        gate_up = zip(projections["gate_proj"], projections["up_proj"], strict=True)
        fused[base + "gate_up_proj"] = torch.stack([torch.cat(pair) for pair in gate_up])
        fused[base + "down_proj"] = torch.stack(projections["down_proj"])
    assert len(per_expert) > len(fused)
    for rank in range(2):
        with on_rank(rank, 2):
            want = rank_model(folder, fused, expert_parallel).state_dict()
            got = rank_model(folder, per_expert, expert_parallel).state_dict()
        names = [name for name in want if ".experts." in name]
        assert names and all(torch.equal(got[name], want[name]) for name in names)
        local = 2 if expert_parallel else 4
        assert want[names[0]].shape[0] == local


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(folders):
    config = CheckpointConfig.from_folder(folders["dense"])  # 2 key heads, 4 value heads
    with on_rank(0, 4), pytest.raises(ValueError) as error:
        get_model_class(config)(config)
    message = str(error.value)
    assert "tensor_parallel_size=4" in message
    assert "linear_num_key_heads=2" in message and "linear_num_value_heads=4" in message
    assert "choose --tensor-parallel-size among [1, 2]" in message
    with pytest.raises(ValueError, match=r"linear_num_key_heads=2, linear_num_value_heads=4"):
        recurrent_state_layers(config, 4)


def test_planner_counts_a_ranks_share_of_the_state():
    """Qwen3.6-27B on two 22 GB cards (the field report's RTX 2080 Ti pair): each rank's state pool is
    half of one rank's at TP 1, live and snapshot slots alike."""
    inputs = memory_inputs(
        "qwen3.6-27b",
        gpus="2x22@7.5",
        dtype="float16",
        max_model_len=262_144,
        max_num_seqs=1,
        mamba_cache_mode="align",
    )
    one = plan_memory(inputs)
    two = plan_memory(dataclasses.replace(inputs, tensor_parallel_size=2))
    # 48 DeltaNet layers x (10,240 conv channels x 3 fp16 + 48 value heads x 128 x 128 float32), 2 slots
    assert (
        one.recurrent_state_bytes == 2 * 48 * (10_240 * 3 * 2 + 48 * 128 * 128 * 4) + one.state_snapshot_bytes
    )
    assert two.recurrent_state_bytes * 2 == one.recurrent_state_bytes
    assert two.state_snapshot_bytes * 2 == one.state_snapshot_bytes > 0


def test_plan_shows_each_ranks_state_pool(capsys):
    """`fitserve plan examples/models/qwen3.6-27b --tensor-parallel-size 2` on two 80 GB GPUs: each GPU's
    live and snapshot slots at half of TP 1's 146.8 MiB (48 value heads -> 24 per rank)."""
    folder = Path(__file__).parents[2] / "examples" / "models" / "qwen3.6-27b"
    texts = {}
    for size in (1, 2):
        argv = [str(folder), "--assume-gpus", "2x79.19@9.0", "--tensor-parallel-size", str(size)]
        assert run_plan(parse("plan", [*argv, "--max-model-len", "262144", "--max-num-seqs", "1"])) == 0
        texts[size] = capsys.readouterr().out
    for size, mib in ((1, "146.8"), (2, "73.4")):
        assert f"recurrent state (2 slots x {mib} MiB)" in texts[size]
        assert f"state snapshots (2 x {mib} MiB)" in texts[size]


def test_plan_refuses_a_tp_size_that_splits_attention_but_not_the_delta_net_heads(tmp_path):
    """Qwen3.6-27B with 12 linear-attention key heads (a variant): --tensor-parallel-size 8 divides its 24
    attention heads and is a multiple of its 4 KV heads, but not a divisor of 12: the plan refuses it
    before any rank starts, naming the heads and the nearest sizes that work."""
    source = Path(__file__).parents[2] / "examples" / "models" / "qwen3.6-27b" / "config.json"
    config = json.loads(source.read_text())
    config["text_config"]["linear_num_key_heads"] = 12
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = [str(tmp_path), "--assume-gpus", "8x79.19@9.0", "--tensor-parallel-size", "8"]
    with pytest.raises(PlanError) as error:
        run_plan(parse("plan", argv))
    message = str(error.value)
    assert "does not divide the model's 12 linear-attention (Gated DeltaNet) heads" in message
    assert "set --tensor-parallel-size 4 or 12" in message
