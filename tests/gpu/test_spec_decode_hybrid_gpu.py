"""Speculative decoding on Qwen3.5 hybrids on the GPU (run on the GPU machine): the verify step's chain
kernels (causal_conv1d_chain, fused_recurrent_gated_delta_rule_chain) at Qwen3.6-27B's DeltaNet geometry in
bf16 against the decode kernels run depth by depth (the same math: the outputs and every pool row agree to
float32 rounding), and the CUDA engine with ngram and the oracle on a small random Qwen3.5
(tests/gpu/test_qwen3_5_gpu.py's checkpoint) against itself without speculation, where bf16 noise allows
(a verify step runs eagerly, its GEMMs over batch x (k + 1) rows rounding apart from a graph-replayed
decode step's).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.core.state_slots import StepStateSlots  # noqa: E402
from fitserve.layers import gated_delta_rule as ops  # noqa: E402
from fitserve.models.delta_net_chain import ChainedStepSlots, chained_decode  # noqa: E402
from fitserve.worker.state_rings import StateRings  # noqa: E402
from tests.gpu.test_engine_gpu import _first_divergence_is_a_near_tie, _greedy, _llm  # noqa: E402
from tests.gpu.test_gated_delta_kernels_gpu import _geometry  # noqa: E402
from tests.gpu.test_qwen3_5_gpu import checkpoint  # noqa: E402, F401  (the module's fixture)

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
K = 3


def _verify_rows(rings: StateRings) -> tuple[StepStateSlots, ChainedStepSlots, int]:
    """A decode-only verify step: chains of 4 (a full one, from ring position 2: it wraps), 2 and 3 rows
    beside two plain decode rows, in a scrambled order of slots. Returns the pool rows, the step's device
    slots and its row count."""
    layout = [(5, 3), (2, None), (1, 1), (7, None), (3, 2)]  # (live slot, drafts; None: a plain row)
    rings._position[5] = 2
    scheduled, slots = [], []
    for slot, drafts in layout:
        request = SimpleNamespace(state_slot=slot)
        for j in range((drafts or 0) + 1):
            scheduled.append(
                SimpleNamespace(request=request, start=40 + j, num_new_tokens=1, draft_token_ids=(9,) * j)
            )
            slots.append(slot)
    n = len(scheduled)
    rows, chain = rings.place(scheduled, StepStateSlots(slots), [1] * n, [41 + i for i in range(n)])
    assert chain is not None
    host = ops.split_state_rows([1] * n, [41 + i for i in range(n)], rows)
    upload = [torch.from_numpy(a).to(DEVICE) for a in host.arrays()]
    chain_arrays = [torch.from_numpy(a).to(DEVICE) for a in chain.arrays()]
    return rows, ChainedStepSlots.from_uploaded(host, upload, chain_arrays, chain.sizes), n


def test_chain_kernels_match_the_decode_kernels_depth_by_depth():
    key_heads, value_heads, k_dim, v_dim, width = _geometry()
    conv_dim = 2 * key_heads * k_dim + value_heads * v_dim
    rings = StateRings(max_num_seqs=8, num_snapshots=0, speculative_tokens=K)
    num_rows = rings.row(8, K) + 1
    rows, step, n = _verify_rows(rings)
    generator = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=generator, device=DEVICE) * scale).to(dtype)

    conv_states = randn(num_rows, conv_dim, width - 1)
    recurrent_states = randn(num_rows, value_heads, k_dim, v_dim, dtype=torch.float32, scale=0.05)
    qkv, a, b = randn(n, conv_dim), randn(n, value_heads), randn(n, value_heads)
    weight = randn(conv_dim, width, scale=0.5)
    a_log = torch.rand(value_heads, generator=generator, device=DEVICE).log().to(torch.bfloat16)
    dt_bias = randn(value_heads, scale=0.3)

    inputs = (qkv, a, b, a_log, dt_bias, weight)
    conv, recurrent = conv_states.clone(), recurrent_states.clone()
    got = chained_decode(*inputs, conv, recurrent, step, key_heads, k_dim)
    # the reference: each depth's copies, then the decode kernels on its rows (chained_decode's torch
    # path, with the CUDA decode kernels)
    conv_ref, recurrent_ref = conv_states.clone(), recurrent_states.clone()
    want = torch.empty_like(got)
    for depth in step.depths:
        if depth.copies is not None:
            for states in (conv_ref, recurrent_ref):
                states.index_copy_(0, depth.copies[1], states.index_select(0, depth.copies[0]))
        r = depth.rows
        want[r] = ops.gated_delta_net_decode(
            qkv[r], a[r], b[r], a_log, dt_bias, weight, conv_ref, recurrent_ref, depth.slots, key_heads, k_dim
        )
    torch.cuda.synchronize()

    def relative(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x.double() - y.double()).abs().max() / y.double().abs().max())

    assert relative(got, want) < 1e-5
    written = sorted(set(rows))
    assert relative(recurrent[written], recurrent_ref[written]) < 1e-5
    assert torch.equal(conv[written], conv_ref[written])
    # a full chain wraps onto the row it read: slot 5 started at position 2 and ends there
    assert rows[3] == rings.row(5, 2)
    others = [r for r in range(num_rows) if r not in written]
    assert torch.equal(recurrent[others], recurrent_states[others])
    assert torch.equal(conv[others], conv_states[others])


def _prompts(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase (prompt lookup finds it) of random tokens."""
    rng = random.Random(1)
    return [[rng.randrange(4096) for _ in range(rng.randint(12, 30))] * 4 for _ in range(n)]


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"max_num_batched_tokens": 96, "max_num_seqs": 8, "num_gpu_blocks_override": 40, "block_size": 16}],
    ids=["graphs-prefix-cache", "chunked-preemption"],
)
def test_ngram_and_oracle_follow_the_plain_engine(checkpoint, engine_kwargs):  # noqa: F811
    prompts = _prompts(6)
    plain_llm = _llm(checkpoint, **engine_kwargs)
    plain = _greedy(plain_llm, prompts, 64)
    plain_llm.engine.shutdown()
    del plain_llm
    torch.cuda.empty_cache()
    ngram_config = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 4,
    }
    ngram_llm = _llm(checkpoint, speculative_config=ngram_config, **engine_kwargs)
    _first_divergence_is_a_near_tie(_greedy(ngram_llm, prompts, 64), plain)
    ngram_llm.engine.shutdown()
    del ngram_llm
    torch.cuda.empty_cache()

    oracle_llm = _llm(
        checkpoint, speculative_config={"method": "oracle", "num_speculative_tokens": K}, **engine_kwargs
    )
    vocab = oracle_llm.engine.config.model.vocab_size
    oracle_llm.engine.speculator.proposer.load(prompts, [list(o.token_ids) for o in plain], vocab)
    oracle = _greedy(oracle_llm, prompts, 64)
    stats = oracle_llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    _first_divergence_is_a_near_tie(oracle, plain)
    oracle_llm.engine.shutdown()
