"""The fused MoE kernels (fitserve/kernels/fused_moe.py) under Triton's interpreter on the CPU at tiny shapes,
against FusedExperts' torch path (skipped where triton is not installed; CI installs only torch).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in a child process: this file run
as a script (`python tests/unit/test_fused_moe_interpret.py CASES_JSON`) with the variable set; the child
patches the interpreter's bfloat16 dots and casts (tests/unit/triton_interpreter.py). float32 inputs (exact
dots) give a tight check of the routing, the gathers and the epilogues; bfloat16 and float16 a check at
their rounding. Each case also checks the routing buffers themselves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.moe import FusedExperts, kernel_activation
from tests.unit.triton_interpreter import run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# |out - ref| <= TOLERANCE * max|ref|; ref in float32 from the same (rounded) inputs and weights. 16-bit
# kernels round act(gate) * up, each weighted row and the sum to the dtype.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2**-7, "float16": 2**-9}
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def case(
    tokens: int,
    dtype: str = "float32",
    act: str = "silu",
    top_k: int = 2,
    hit: str = "all",
    ep: tuple[int, int] | None = None,
    config: dict | None = None,
    one_program: bool = True,
    ids_dtype: str = "int64",
) -> dict:
    """E 8, hidden 64, I 32. hit: "all" experts get pairs, "some" (experts 1, 4, 6 only), "low" (experts
    0-3 only: with ep (1, 2) this rank gets nothing). ep: (rank, size) for expert parallel. config: tiles
    used instead of choose_config's. one_program=False sends the routing's scatter to its multi-program
    kernel. Experts that no token chose hold NaN weights (reading one would spoil the output)."""
    return {
        "experts": 8,
        "hidden": 64,
        "inter": 32,
        "tokens": tokens,
        "dtype": dtype,
        "act": act,
        "top_k": top_k,
        "hit": hit,
        "ep": list(ep) if ep else None,
        "config": config,
        "one_program": one_program,
        "ids_dtype": ids_dtype,
    }


SMALL_TILES = {"block_m": 32, "gate_up": [16, 32, 4, 2], "down": [16, 16, 4, 2]}  # several K steps
CASES = [
    # float32: tight
    case(1),
    case(5, top_k=3, ids_dtype="int32"),
    case(17, top_k=3, act="gelu_tanh"),
    case(17, hit="some", act="gelu"),
    case(5, hit="some", config=SMALL_TILES),
    case(17, top_k=3, one_program=False),
    case(17, top_k=3, ep=(1, 2)),
    case(17, top_k=3, ep=(0, 4), hit="some", act="gelu_tanh", one_program=False),
    case(5, ep=(1, 2), hit="low"),  # none of this rank's experts chosen: zeros
    # 16-bit
    case(1, "bfloat16", "gelu_tanh", top_k=3),
    case(17, "bfloat16", "gelu_tanh", top_k=3),
    case(5, "bfloat16", "silu", hit="some", ep=(1, 2), ids_dtype="int32"),
    case(17, "float16", "silu", config=SMALL_TILES),
]


def _case_id(spec: dict) -> str:
    extras = [f"ep{spec['ep']}" if spec["ep"] else "", "tiles" if spec["config"] else ""]
    extras += ["" if spec["one_program"] else "scatter", "" if spec["ids_dtype"] == "int64" else "ids32"]
    name = f"T{spec['tokens']}-k{spec['top_k']}-{spec['dtype']}-{spec['act']}-{spec['hit']}"
    return "-".join([name, *filter(None, extras)])


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_in_interpreter(__file__, CASES)


@needs_triton
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_kernel_matches_torch_path(results: list[dict], index: int) -> None:
    result = results[index]
    assert result["case"] == CASES[index]
    assert result["routing"] == "ok", result
    assert result["error"] <= TOLERANCE[CASES[index]["dtype"]], result
    assert result["shape_dtype_ok"] and result["repeat_equal"], result
    if CASES[index]["hit"] != "all":
        assert result["unchosen_experts"] > 0, result
    if CASES[index]["hit"] == "low" and CASES[index]["ep"] == [1, 2]:
        assert result["num_blocks"] == 0 and result["max_abs"] == 0.0, result
    else:
        assert result["num_blocks"] > 0 and result["max_abs"] > 0.0, result


# --- plain torch / host code (no interpreter) --------------------------------------------------------


def test_activations_are_recognized() -> None:
    assert kernel_activation(F.silu) == "silu"
    assert kernel_activation(lambda x: F.gelu(x, approximate="tanh")) == "gelu_tanh"
    assert kernel_activation(F.gelu) == "gelu"
    assert kernel_activation(torch.tanh) is None
    assert kernel_activation(lambda x: F.silu(x) * 1.001) is None


def test_cpu_forward_is_the_torch_path() -> None:
    torch.manual_seed(0)
    experts = FusedExperts(4, 16, 8, F.silu)
    experts.gate_up_proj.data.normal_()
    experts.down_proj.data.normal_()
    x = torch.randn(3, 16)
    ids = torch.tensor([[0, 2], [3, 2], [1, 0]])
    weights = torch.rand(3, 2)
    out = experts(x, ids, weights, reduce=False)
    torch.testing.assert_close(out, experts.reference(x, ids, weights))
    # token 0 by hand: its two experts' outputs, weighted
    expected = torch.zeros(16)
    for slot in range(2):
        gate, up = (experts.gate_up_proj[ids[0, slot]] @ x[0]).chunk(2)
        expected += weights[0, slot] * (experts.down_proj[ids[0, slot]] @ (F.silu(gate) * up))
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


@needs_triton
def test_worst_case_blocks_bound_every_routing() -> None:
    from fitserve.kernels.fused_moe import max_blocks

    rng = random.Random(0)
    for _ in range(300):
        experts, block_m = rng.choice([4, 8, 128]), rng.choice([16, 64])
        pairs = rng.randint(1, 300)
        ids = [rng.randrange(experts) for _ in range(pairs)]
        if rng.random() < 0.3:  # one pair on as many experts as possible: most partly filled blocks
            ids = [i % experts for i in range(pairs)]
        needed = sum(-(-ids.count(e) // block_m) for e in range(experts))
        assert needed <= max_blocks(pairs, experts, block_m), (experts, block_m, pairs)
        assert max_blocks(pairs, experts, block_m) * block_m <= pairs + experts * (block_m - 1)
        assert max_blocks(pairs, experts, block_m) <= pairs


@needs_triton
def test_configs_split_n_at_batch_1() -> None:
    from fitserve.kernels.fused_moe import TARGET_PROGRAMS, choose_config

    for hidden, inter, experts in ((2816, 704, 128), (2048, 512, 256)):
        config = choose_config(1, hidden, inter, 8, experts)
        assert config.block_m == 16
        assert 8 * -(-inter // config.gate_up.block_n) >= TARGET_PROGRAMS / 2
        assert 8 * -(-hidden // config.down.block_n) >= TARGET_PROGRAMS
        assert choose_config(4096, hidden, inter, 8, experts).block_m == 64


@needs_triton
def test_bad_inputs_are_refused() -> None:
    from fitserve.kernels.fused_moe import fused_moe

    x = torch.zeros(2, 16)
    gate_up, down = torch.zeros(4, 8, 16), torch.zeros(4, 16, 4)
    ids, weights = torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2)
    with pytest.raises(ValueError, match="down_proj must be"):
        fused_moe(x, gate_up, torch.zeros(4, 16, 8), ids, weights, "silu")
    with pytest.raises(ValueError, match="x's dtype"):
        fused_moe(x, gate_up.half(), down.half(), ids, weights, "silu")
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe(x, gate_up, down, ids[:1], weights[:1], "silu")
    with pytest.raises(ValueError, match="activation 'relu'"):
        fused_moe(x, gate_up, down, ids, weights, "relu")


# pointer arguments' element types at the bfloat16 Gemma-4 shape; every other argument is an i32
POINTER_TYPES = {"topk_ids_ptr": "*i64", "topk_weights_ptr": "*fp32", "x_ptr": "*bf16", "w_ptr": "*bf16"}
POINTER_TYPES.update(dict.fromkeys(("mid_ptr", "per_pair_ptr", "out_ptr"), "*bf16"))
POINTER_TYPES.update(dict.fromkeys(("sorted_pairs_ptr", "block_expert_ptr", "num_blocks_ptr"), "*i32"))
POINTER_TYPES["cursor_ptr"] = "*i32"


def _compile_for_hopper(kernel, constexprs: dict, num_warps: int):
    """Compiles a kernel for SM 9.0 with the triton wheel's ptxas (no GPU needed), telling it what the
    launcher would: pointers, sizes and strides are multiples of 16 (so its loads pipeline as on the GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.function.arg_names
    signature = {n: "constexpr" if n in constexprs else POINTER_TYPES.get(n, "i32") for n in names}
    aligned = [n.endswith("_ptr") or n.startswith(("stride", "hidden", "inter")) for n in names]
    divisible = [["tt.divisibility", 16]]
    attrs = {(i,): divisible for i, n in enumerate(names) if aligned[i] and n not in constexprs}
    source = ASTSource(kernel.function, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@needs_triton
def test_kernels_compile_for_hopper() -> None:
    """Both buckets' variants at the Gemma-4 26B shape compile to PTX and SASS, with their weight loads
    pipelined through shared memory (cp.async); GPU-only lowering errors show here without a GPU."""
    import triton

    from fitserve.kernels import fused_moe as fm

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("the triton wheel has no ptxas")
    pdl = {"USE_PDL": True}
    for tokens in (1, 4096):
        config = fm.choose_config(tokens, 2816, 704, 8, 128)
        routing = {"BLOCK_M": config.block_m, "EXPERTS": 128, "CHUNK": fm.ALIGN_CHUNK}
        routing.update(BLOCK_CHUNK=fm.EXPERT_OF_BLOCK_CHUNK, SCATTER=config.one_program_routing, **pdl)
        _compile_for_hopper(fm._moe_align_kernel, routing, 8)
        for kernel, tile, extra in (
            (fm._moe_gate_up_kernel, config.gate_up, {"ACTIVATION": fm.GELU_TANH}),
            (fm._moe_down_kernel, config.down, {}),
        ):
            tiles = {"BLOCK_M": config.block_m, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k}
            constexprs = {**extra, "FP32": False, **tiles, "NUM_STAGES": tile.num_stages, **pdl}
            assert "cp.async" in _compile_for_hopper(kernel, constexprs, tile.num_warps).asm["ptx"], config
    _compile_for_hopper(fm._moe_scatter_kernel, {"BLOCK": fm.SCATTER_BLOCK, **pdl}, 4)
    _compile_for_hopper(fm._moe_sum_kernel, {"TOP_K": 8, "BLOCK": fm.SUM_BLOCK, **pdl}, 4)


# --- the child ---------------------------------------------------------------------------------------


def _check_routing(fm, ids: torch.Tensor, first: int, local: int, config) -> tuple[str, int]:
    """("ok" or what is wrong with moe_route's buffers for these ids, the number of blocks in use)."""
    block_m = config.block_m
    routed = fm.moe_route(ids.contiguous(), local, first, block_m, config.one_program_routing)
    sorted_pairs, block_expert, num_blocks = routed
    flat = (ids.reshape(-1).long() - first).tolist()
    used = int(num_blocks[0])
    counts = [flat.count(expert) for expert in range(local)]
    if used != sum(-(-c // block_m) for c in counts):
        return f"num_blocks {used} for counts {counts}", used
    seen = []
    for block in range(used):
        expert = int(block_expert[block])
        for pair in sorted_pairs[block * block_m : (block + 1) * block_m].tolist():
            if pair != len(flat):  # not padding
                if flat[pair] != expert:
                    return f"block {block} of expert {expert} holds pair {pair} of expert {flat[pair]}", used
                seen.append(pair)
    mine = [p for p, e in enumerate(flat) if 0 <= e < local]
    if sorted(seen) != mine:
        return f"pairs placed {sorted(seen)} != this rank's {mine}", used
    if block_expert[:used].tolist() != sorted(block_expert[:used].tolist()):
        return "blocks not in expert order", used
    return "ok", used


def _routing_ids(spec: dict, generator: torch.Generator) -> torch.Tensor:
    pool = {"all": range(spec["experts"]), "some": (1, 4, 6), "low": range(4)}[spec["hit"]]
    rows = []
    for t in range(spec["tokens"]):
        order = torch.randperm(len(pool), generator=generator).tolist()
        if spec["hit"] == "all":  # token t's first expert cycles, so every expert gets a pair
            order.remove(t % spec["experts"])
            order.insert(0, t % spec["experts"])
        rows.append([pool[i] for i in order[: spec["top_k"]]])
    return torch.tensor(rows, dtype=getattr(torch, spec["ids_dtype"]))


def _run_case(spec: dict) -> dict:
    from fitserve.distributed.parallel_state import TensorParallel, set_tensor_parallel
    from fitserve.kernels import fused_moe as fm

    experts, hidden, inter = spec["experts"], spec["hidden"], spec["inter"]
    tokens, top_k = spec["tokens"], spec["top_k"]
    dtype = getattr(torch, spec["dtype"])
    rank, size = spec["ep"] or (0, 1)
    set_tensor_parallel(TensorParallel(rank, size))
    activation = ACTIVATIONS[spec["act"]]
    module = FusedExperts(experts, hidden, inter, activation, expert_parallel=spec["ep"] is not None)
    set_tensor_parallel(TensorParallel())
    first, local = module.first_expert, module.local_experts
    generator = torch.Generator().manual_seed(tokens * 31 + top_k)
    gate_up = (0.2 * torch.randn(local, 2 * inter, hidden, generator=generator)).to(dtype)
    down = (0.2 * torch.randn(local, hidden, inter, generator=generator)).to(dtype)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    ids = _routing_ids(spec, generator)
    weights = torch.rand(tokens, top_k, generator=generator)
    # NaN in this rank's experts that no token chose: reading any of them would spoil the output
    unchosen = [e for e in range(local) if not (ids == first + e).any()]
    gate_up[unchosen] = float("nan")
    down[unchosen] = float("nan")
    module.gate_up_proj.data, module.down_proj.data = gate_up.float(), down.float()
    config = fm.choose_config(tokens, hidden, inter, top_k, local)
    if spec["config"]:
        tiles = spec["config"]
        gate_up_tile, down_tile = fm.GemmTile(*tiles["gate_up"]), fm.GemmTile(*tiles["down"])
        config = fm.FusedMoeConfig(tiles["block_m"], gate_up_tile, down_tile)
    config = dataclasses.replace(config, one_program_routing=spec["one_program"])
    out = fm.fused_moe(x, gate_up, down, ids, weights, spec["act"], first, config)
    reference = module.reference(x.float(), ids.long(), weights)
    scale = max(reference.abs().max().item(), 1e-30)
    again = fm.fused_moe(x, gate_up, down, ids, weights, spec["act"], first, config)
    routing, used_blocks = _check_routing(fm, ids, first, local, config)
    return {
        "case": spec,
        "error": (out.float() - reference).abs().max().item() / scale,
        "max_abs": out.float().abs().max().item(),
        "num_blocks": used_blocks,
        "unchosen_experts": len(unchosen),
        "routing": routing,
        "shape_dtype_ok": tuple(out.shape) == (tokens, hidden) and out.dtype == dtype,
        "repeat_equal": torch.equal(out, again),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    print(json.dumps([_run_case(spec) for spec in json.loads(sys.argv[1])]))
