"""Quantized Qwen3.5 under tensor parallel on the CPU (qwen3_5_quant_helpers' tiny models).

- One rank's layers (built as rank r of n, loading the whole checkpoint): in_proj_qkv, which the
  checkpoint stores as one [q | k | v] matrix, gives the rank's rows of each of q, k and v (its key and
  value heads), in every format that splits (int4 AWQ / compressed-tensors, fp8, nf4 while loading); the
  row-parallel out_proj's and down_proj's partial outputs sum to the single-rank output.
- The engine at TP 2 (and TP 4: one DeltaNet key head a rank, the 2 KV heads each on two ranks) gives TP
  1's greedy tokens and logprobs for int4 checkpoints.
- A TP size whose per-rank input of a row-parallel layer is not a multiple of the group size is refused
  as the model is built, naming both numbers; a pre-quantized bitsandbytes in_proj_qkv under TP is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fitserve import LLM, SamplingParams
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.registry import get_model_class
from tests.bnb_checkpoints import BnbSpec
from tests.fp8_checkpoints import Fp8Spec
from tests.quant_checkpoints import QuantSpec
from tests.unit.qwen3_5_quant_helpers import (
    SMALL,
    build_model,
    int4_ignore,
    write_16bit,
    write_bnb,
    write_fp8,
    write_int4,
)
from tests.unit.tp_helpers import on_rank

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], list(range(40, 75))]
NEW_TOKENS = 8


def rank_model(folder: Path, rank: int, size: int, flag: str | None = None) -> torch.nn.Module:
    config = with_quantization_flag(CheckpointConfig.from_folder(folder), flag)
    with on_rank(rank, size):
        model = get_model_class(config)(config).eval()
        loaded = model.load_weights(load_file(folder / "model.safetensors").items())
    missing = {name for name, _ in model.named_parameters()} - loaded
    assert not missing, f"parameters left unloaded: {sorted(missing)}"
    return model


def apply(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own product (no all-reduce: a row-parallel rank's partial sum)."""
    with torch.no_grad():
        return layer.linear_method.apply(layer, x).float()


def qkv_rows(rank: int, size: int, key_size: int, value_size: int) -> list[int]:
    """The rows of in_proj_qkv's whole output that rank `rank` of `size` holds: its q, k and v parts."""
    key, value = key_size // size, value_size // size
    rows = [*range(rank * key, (rank + 1) * key), *range(key_size + rank * key, key_size + (rank + 1) * key)]
    return rows + list(range(2 * key_size + rank * value, 2 * key_size + (rank + 1) * value))


def write(kind: str, folder: Path, hf_model: torch.nn.Module) -> tuple[Path, str | None]:
    if kind == "awq":
        return write_int4(folder, hf_model, QuantSpec("awq", 32, sym=False, ignore=SMALL)).folder, None
    if kind == "ct":
        spec = QuantSpec("ct", 32, ignore=int4_ignore("ct", hf_model))
        return write_int4(folder, hf_model, spec).folder, None
    if kind == "gptq":
        return write_int4(folder, hf_model, QuantSpec("gptq", 32, sym=False, ignore=SMALL)).folder, None
    if kind == "gptq-actorder":
        return write_int4(folder, hf_model, QuantSpec("gptq", 32, act_order=True, ignore=SMALL)).folder, None
    if kind == "fp8-block":
        return write_fp8(folder, hf_model, Fp8Spec("hf", "block", block=(16, 32))).folder, None
    if kind == "fp8-tensor":
        return write_fp8(folder, hf_model, Fp8Spec("ct", "tensor", activations="static")).folder, None
    return write_16bit(folder, hf_model), "bitsandbytes"


@pytest.mark.parametrize("kind", ["awq", "ct", "gptq", "fp8-block", "fp8-tensor", "nf4-on-load"])
def test_a_rank_computes_its_rows_and_columns(kind, tmp_path):
    # nf4 blocks of 64 columns: each rank's row-parallel input a multiple of 64
    sizes = (
        {"linear_value_head_dim": 32, "intermediate_size": 128, "head_dim": 32}
        if kind == "nf4-on-load"
        else {}
    )
    hf_model = build_model(conditional=kind == "ct", seed=11, **sizes)
    folder, flag = write(kind, tmp_path, hf_model)
    whole = rank_model(folder, 0, 1, flag)
    ranks = [rank_model(folder, rank, 2, flag) for rank in range(2)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    delta_net = whole.model.layers[0].linear_attn
    want = apply(delta_net.in_proj_qkv, x)
    key_size, value_size = delta_net.key_size, delta_net.value_size
    for rank, model in enumerate(ranks):
        got = apply(model.model.layers[0].linear_attn.in_proj_qkv, x)
        assert torch.allclose(got, want[:, qkv_rows(rank, 2, key_size, value_size)], atol=1e-4, rtol=1e-4)
    # row-parallel: each rank multiplies its half of the input; the halves' sums are the whole product
    for path, width in (
        ("linear_attn.out_proj", value_size),
        ("mlp.down_proj", whole.config.intermediate_size),
    ):
        h = torch.randn(5, width, generator=torch.Generator().manual_seed(1))
        want = apply(whole.model.layers[0].get_submodule(path), h)
        half = width // 2
        parts = [
            apply(m.model.layers[0].get_submodule(path), h[:, r * half : (r + 1) * half])
            for r, m in enumerate(ranks)
        ]
        assert torch.allclose(parts[0] + parts[1], want, atol=2e-3, rtol=2e-3)


def test_a_rank_input_off_a_group_is_refused(tmp_path):
    """out_proj's input is 2 value heads x 16 = 32 columns: at TP 2 a rank holds 16, not a multiple of the
    group of 32: refused as the model is built, naming both numbers and the fix."""
    hf_model = build_model(conditional=False, seed=12, linear_value_head_dim=8)
    folder = write_int4(tmp_path, hf_model, QuantSpec("awq", 32, ignore=SMALL)).folder
    config = CheckpointConfig.from_folder(folder)
    with on_rank(0, 2), pytest.raises(ValueError) as error:
        get_model_class(config)(config)
    message = str(error.value)
    assert "model.layers.0.linear_attn.out_proj" in message
    assert "each rank holds 16 input columns (32 / tensor_parallel_size 2)" in message
    assert "not a multiple of the 32 columns of a group (group_size 32)" in message
    assert "smaller --tensor-parallel-size" in message


def test_act_order_groups_spanning_ranks_are_refused(tmp_path):
    """GPTQ desc_act with a random column order: a row-parallel rank's columns hold parts of groups whose
    other columns lie on the other rank, which no int4 path runs: refused naming the layer and the fix."""
    folder, _ = write("gptq-actorder", tmp_path, build_model(conditional=False, seed=16))
    rank_model(folder, 0, 1)  # one rank: act order loads
    with pytest.raises(ValueError, match=r"out_proj\.g_idx: act order .* --tensor-parallel-size 1"):
        rank_model(folder, 0, 2)


def test_a_prequantized_bnb_in_proj_qkv_is_refused_under_tp(tmp_path):
    folder = write_bnb(tmp_path, build_model(conditional=False, seed=13), BnbSpec("nf4")).folder
    with pytest.raises(
        ValueError, match=r"in_proj_qkv.*pre-quantized bitsandbytes.*--tensor-parallel-size 1"
    ):
        rank_model(folder, 0, 2)


def generate(folder: Path, **kwargs: Any) -> list[Any]:
    llm = LLM(
        str(folder), dtype="float32", num_gpu_blocks_override=64, block_size=16, max_num_seqs=4, **kwargs
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def assert_same(got: list[Any], want: list[Any]) -> None:
    for ours, theirs in zip(got, want, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for position_ours, position_theirs in zip(
            ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True
        ):
            lowest_ours = min(e.logprob for e in position_ours.values())
            for token_id, entry in position_theirs.items():
                if token_id in position_ours:
                    assert abs(position_ours[token_id].logprob - entry.logprob) < 1e-3
                else:  # a near-tie at the edge of the top logprobs, ordered the other way by TP's sums
                    assert entry.logprob - lowest_ours < 1e-3


@pytest.mark.parametrize("kind", ["ct", "awq"])
def test_engine_tp2_equals_tp1(kind, tmp_path):
    """The Qwen3.6-27B AWQ-INT4 layout (compressed-tensors pack-quantized, symmetric, group 32, in_proj_b
    / in_proj_a left 16-bit by full name) and AWQ: TP 2 gives TP 1's tokens and logprobs."""
    folder, _ = write(kind, tmp_path, build_model(conditional=kind == "ct", seed=14))
    assert_same(generate(folder, tensor_parallel_size=2), generate(folder))


def test_engine_tp4_equals_tp1(tmp_path):
    """4 DeltaNet key heads serving 8 value heads (one key head a rank), head_dim 32 (each rank's o_proj
    input one group), the full layer's 2 KV heads each on two ranks (KvHeadsLinear's replicated rows)."""
    hf_model = build_model(
        conditional=False,
        seed=15,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        intermediate_size=128,
    )
    folder = write_int4(tmp_path, hf_model, QuantSpec("awq", 32, sym=False, ignore=SMALL)).folder
    assert_same(generate(folder, tensor_parallel_size=4), generate(folder))


def test_block_scales_spanning_two_projections_are_refused_under_tp(tmp_path):
    """fp8 blocks of 32 rows over in_proj_qkv's 16 q rows and 16 k rows: each block's one scale serves two
    projections, which a rank's split cannot cut apart: refused naming the shard and the rows (TP 1
    loads it)."""
    folder = write_fp8(
        tmp_path, build_model(conditional=False, seed=17), Fp8Spec("hf", "block", block=(32, 32))
    ).folder
    rank_model(folder, 0, 1)
    with pytest.raises(
        ValueError, match=r"in_proj_qkv\.weight_scale_inv: shard 'q' holds rows \[0, 16\).* 32 rows"
    ):
        rank_model(folder, 0, 2)
