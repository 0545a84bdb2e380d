"""The decode-sized MoE kernels (fitserve/kernels/moe_decode.py) under Triton's interpreter on the CPU at tiny
shapes, against FusedExperts' torch path plus Qwen3.5's shared expert in torch (skipped where triton is not
installed; CI installs only torch).

The kernels run in a child process (this file as a script, TRITON_INTERPRET=1; see
tests/unit/triton_interpreter.py).
float32 inputs give a tight check of the slots, the masks and the epilogue; bfloat16 and float16 a check at
their rounding. Experts that no token chose hold NaN weights, so reading one would spoil the output.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.moe import FusedExperts
from tests.unit.triton_interpreter import answer_cases, run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# |out - ref| <= TOLERANCE * max|ref|, ref in float32 from the same rounded inputs
TOLERANCE = {"float32": 1e-5, "bfloat16": 2**-7, "float16": 2**-9}
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}
# several N tiles and K chunks per slot; the down kernel's slots split as down_splits decides (one per
# split at these sizes), or forced: 2 a split (the last may hold one), all in one program
SMALL_TILES = [[16, 16, 4, 2], [16, 16, 4, 2], None]
SPLIT_BY_TWO = [[16, 16, 4, 2], [16, 16, 4, 2], 2]
NO_SPLIT = [[16, 16, 4, 2], [16, 16, 4, 2], 99]


def case(
    tokens: int,
    dtype: str = "float32",
    act: str = "silu",
    top_k: int = 2,
    shared: bool = False,
    ep: tuple[int, int] | None = None,
    tiles: list | None = None,
    hidden: int = 64,
    inter: int = 32,
    ids_dtype: str = "int64",
    low: bool = False,
) -> dict:
    """8 experts. ep: (rank, size) for expert parallel. low: tokens choose among experts 0-3 only (with
    ep (1, 2) none of this rank's). tiles: [gate_up, down] GemmTile fields instead of the default."""
    return {
        "tokens": tokens,
        "dtype": dtype,
        "act": act,
        "top_k": top_k,
        "shared": shared,
        "ep": list(ep) if ep else None,
        "tiles": tiles,
        "hidden": hidden,
        "inter": inter,
        "ids_dtype": ids_dtype,
        "low": low,
    }


CASES = [
    # float32: tight
    case(1),
    case(3, act="gelu_tanh", top_k=3, ids_dtype="int32"),
    case(2, act="gelu"),
    case(1, shared=True),
    case(4, shared=True, top_k=3, tiles=SMALL_TILES),
    case(2, shared=True, top_k=4, tiles=SPLIT_BY_TWO),
    case(1, top_k=3, tiles=SPLIT_BY_TWO),
    case(2, shared=True, top_k=3, tiles=NO_SPLIT),
    case(3, act="gelu_tanh", tiles=NO_SPLIT),
    case(3, shared=True, tiles=SMALL_TILES, hidden=40, inter=24),  # neither a multiple of the tiles
    case(2, top_k=3, ep=(1, 2)),
    case(2, shared=True, ep=(0, 2), tiles=SMALL_TILES),
    case(2, ep=(1, 2), low=True),  # none of this rank's experts chosen: zeros
    case(2, shared=True, ep=(1, 2), low=True),  # ... but the shared expert still counts
    # 16-bit
    case(1, "bfloat16", "gelu_tanh", top_k=3),
    case(4, "bfloat16", shared=True, top_k=3),
    case(3, "bfloat16", shared=True, ep=(1, 2), tiles=SMALL_TILES),
    case(2, "float16", shared=True, tiles=SMALL_TILES),
    case(2, "bfloat16", shared=True, top_k=4, tiles=SPLIT_BY_TWO),
]


def _case_id(spec: dict) -> str:
    parts = [f"T{spec['tokens']}", f"k{spec['top_k']}", spec["dtype"], spec["act"]]
    parts += ["shared" if spec["shared"] else "", f"ep{spec['ep']}" if spec["ep"] else ""]
    parts += ["tiles" if spec["tiles"] else "", "low" if spec["low"] else "", f"h{spec['hidden']}"]
    return "-".join(filter(None, parts))


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_in_interpreter(__file__, CASES)


@needs_triton
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_kernels_match_torch_path(results: list[dict], index: int) -> None:
    spec, result = CASES[index], results[index]
    assert result["case"] == spec
    assert result["error"] <= TOLERANCE[spec["dtype"]], result
    assert result["shape_dtype_ok"] and result["repeat_equal"], result
    assert result["unchosen_experts"] > 0, result  # the NaN experts were there to be misread
    if spec["low"] and not spec["shared"]:
        assert result["max_abs"] == 0.0, result
    else:
        assert result["max_abs"] > 0.0, result
    if not spec["shared"] and spec["tiles"] is None and spec["tokens"] == 1:  # fused_moe sends it here
        assert result["fused_moe_equal"], result


# --- host code --------------------------------------------------------------------------------------


def _tensors(tokens: int = 2, hidden: int = 16, inter: int = 8, experts: int = 4):
    x = torch.zeros(tokens, hidden)
    gate_up, down = torch.zeros(experts, 2 * inter, hidden), torch.zeros(experts, hidden, inter)
    ids, weights = torch.zeros(tokens, 2, dtype=torch.int64), torch.zeros(tokens, 2)
    return x, gate_up, down, ids, weights


@needs_triton
def test_shared_expert_that_does_not_fit_is_refused() -> None:
    from fitserve.kernels.moe_decode import SharedExpert, moe_decode

    x, gate_up, down, ids, weights = _tensors()
    good = SharedExpert(torch.zeros(16, 16), torch.zeros(16, 8), torch.zeros(1, 16))
    bad = {
        "gate_up_proj must be \\[2 x 8, 16\\]": SharedExpert(
            torch.zeros(32, 16), good.down_proj, good.gate_weight
        ),
        "down_proj must be \\[16, 8\\]": SharedExpert(
            good.gate_up_proj, torch.zeros(16, 4), good.gate_weight
        ),
        "gate weight must hold 16": SharedExpert(good.gate_up_proj, good.down_proj, torch.zeros(1, 8)),
        "x's dtype": SharedExpert(good.gate_up_proj.half(), good.down_proj, good.gate_weight),
    }
    for message, shared in bad.items():
        with pytest.raises(ValueError, match=message):
            moe_decode(x, gate_up, down, ids, weights, "silu", shared=shared)
    with pytest.raises(ValueError, match="activation 'relu'"):
        moe_decode(x, gate_up, down, ids, weights, "relu")


@needs_triton
def test_fused_moe_takes_a_shared_expert_only_on_the_decode_path() -> None:
    from fitserve.kernels import moe_decode
    from fitserve.kernels.fused_moe import fused_moe

    tokens = moe_decode.MAX_TOKENS_WITH_SHARED + 1
    x, gate_up, down, ids, weights = _tensors(tokens)
    shared = moe_decode.SharedExpert(torch.zeros(16, 16), torch.zeros(16, 8), torch.zeros(1, 16))
    with pytest.raises(
        ValueError, match=f"1 to {moe_decode.MAX_TOKENS_WITH_SHARED} tokens.*got {tokens} tokens"
    ):
        fused_moe(x, gate_up, down, ids, weights, "silu", shared=shared)
    assert moe_decode.takes(1) and not moe_decode.takes(moe_decode.MAX_TOKENS + 1)
    assert moe_decode.takes(moe_decode.MAX_TOKENS_WITH_SHARED, with_shared=True)
    assert not moe_decode.takes(0) and not moe_decode.takes(tokens, with_shared=True)


@needs_triton
def test_down_splits_fill_the_gpu_without_empty_splits() -> None:
    from fitserve.kernels.moe_decode import COUNTER_SLOTS, down_splits

    # Qwen3.6-35B-A3B at batch 1 on an H100: 128 tiles of 16 columns, 8 routed slots + the shared one
    assert down_splits(128, 1, 9, 132, 3) == (3, 3)
    assert down_splits(176, 1, 8, 132, 3) == (2, 4)  # Gemma-4 26B-A4B (hidden 2816)
    assert down_splits(128, 4, 9, 132, 3) == (1, 9)  # enough programs without splitting
    assert down_splits(4, 1, 3, 132, 3) == (3, 1)  # at most one split a slot
    assert down_splits(COUNTER_SLOTS + 1, 1, 9, 100_000, 3) == (1, 9)  # more tiles than counters
    for tiles in range(1, 300, 7):
        for tokens in range(1, 9):
            for slots in range(1, 12):
                splits, per_split = down_splits(tiles, tokens, slots, 132, 3)
                assert 1 <= splits <= slots and (splits - 1) * per_split < slots <= splits * per_split


# --- the child ---------------------------------------------------------------------------------------


def _routing_ids(spec: dict, generator: torch.Generator) -> torch.Tensor:
    pool = range(4) if spec["low"] else range(8)
    rows = [
        torch.randperm(len(pool), generator=generator)[: spec["top_k"]].tolist()
        for _ in range(spec["tokens"])
    ]
    return torch.tensor([[pool[i] for i in row] for row in rows], dtype=getattr(torch, spec["ids_dtype"]))


def _shared_reference(x, gate_up, down, gate_weight, activation) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return torch.sigmoid(F.linear(x, gate_weight)) * F.linear(activation(gate) * up, down)


def _run_case(spec: dict) -> dict:
    from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel
    from fitserve.kernels import moe_decode as md
    from fitserve.kernels.fused_moe import fused_moe

    hidden, inter, tokens, top_k = spec["hidden"], spec["inter"], spec["tokens"], spec["top_k"]
    dtype = getattr(torch, spec["dtype"])
    rank, size = spec["ep"] or (0, 1)
    set_tensor_parallel(TensorParallel(rank, size))
    activation = ACTIVATIONS[spec["act"]]
    module = FusedExperts(8, hidden, inter, activation, expert_parallel=spec["ep"] is not None)
    set_tensor_parallel(TensorParallel())
    first, local = module.first_expert, module.local_experts
    generator = torch.Generator().manual_seed(tokens * 31 + top_k + 7 * spec["shared"])
    gate_up = (0.2 * torch.randn(local, 2 * inter, hidden, generator=generator)).to(dtype)
    down = (0.2 * torch.randn(local, hidden, inter, generator=generator)).to(dtype)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    ids = _routing_ids(spec, generator)
    weights = torch.rand(tokens, top_k, generator=generator)
    unchosen = [e for e in range(local) if not (ids == first + e).any()]
    gate_up[unchosen] = float("nan")
    down[unchosen] = float("nan")
    module.gate_up_proj.data, module.down_proj.data = gate_up.float(), down.float()
    reference = module.reference(x.float(), ids.long(), weights)
    shared = None
    if spec["shared"]:
        shared = md.SharedExpert(
            (0.2 * torch.randn(2 * inter, hidden, generator=generator)).to(dtype),
            (0.2 * torch.randn(hidden, inter, generator=generator)).to(dtype),
            (0.3 * torch.randn(1, hidden, generator=generator)).to(dtype),
        )
        parts = (shared.gate_up_proj.float(), shared.down_proj.float(), shared.gate_weight.float())
        reference = reference + _shared_reference(x.float(), *parts, F.silu)
    config = None
    if spec["tiles"]:
        gate_up_tile, down_tile, per_split = spec["tiles"]
        tiles = md.GemmTile(*gate_up_tile), md.GemmTile(*down_tile)
        config = md.MoeDecodeConfig(*tiles, down_slots_per_split=per_split)
    out = md.moe_decode(x, gate_up, down, ids, weights, spec["act"], first, shared, config)
    again = md.moe_decode(x, gate_up, down, ids, weights, spec["act"], first, shared, config)
    scale = max(reference.abs().max().item(), 1e-30)
    result = {
        "case": spec,
        "error": (out.float() - reference).abs().max().item() / scale,
        "max_abs": out.float().abs().max().item(),
        "unchosen_experts": len(unchosen),
        "shape_dtype_ok": tuple(out.shape) == (tokens, hidden) and out.dtype == dtype,
        "repeat_equal": torch.equal(out, again),
    }
    if shared is None and config is None and md.takes(tokens):
        result["fused_moe_equal"] = torch.equal(
            fused_moe(x, gate_up, down, ids, weights, spec["act"], first), out
        )
    return result


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    answer_cases(_run_case)


@needs_triton
def test_qwen_block_hands_over_only_a_16_bit_shared_expert() -> None:
    """Qwen3.5's MoE block gives the decode kernels its shared expert only as plain 16-bit weights (a
    quantized one keeps its own kernels), and FusedExperts takes it only on CUDA at decode-sized steps."""
    from types import SimpleNamespace

    from fitserve.kernels.moe_decode import SharedExpert
    from fitserve.models.qwen3_5_layers import Qwen3_5SparseMoeBlock

    config = SimpleNamespace(
        hidden_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    block = Qwen3_5SparseMoeBlock(config).to(torch.bfloat16)
    shared = block._shared_expert_tensors()
    assert isinstance(shared, SharedExpert)
    assert shared.gate_up_proj.shape == (64, 64) and shared.down_proj.shape == (64, 32)
    assert shared.gate_weight.shape == (1, 64)
    assert not block.experts.takes_shared_expert(torch.zeros(1, 64, dtype=torch.bfloat16), shared)  # CPU
    block.shared_expert.down_proj.weight.data = block.shared_expert.down_proj.weight.data.to(
        torch.float8_e4m3fn
    )
    assert block._shared_expert_tensors() is None
    del block.shared_expert.gate_up_proj.weight  # as a quantized layer's packed tensors replace it
    assert block._shared_expert_tensors() is None
