"""Gated DeltaNet's torch ops (fitserve/layers/gated_delta_rule.py) against a naive per-token float64
reference: the chunked delta rule (shorter than a chunk, whole chunks, ragged, from a state), the recurrent
step, and the causal conv1d with its carried state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitserve.layers.gated_delta_rule import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

HEADS, K_DIM, V_DIM = 3, 16, 8


def naive_delta_rule(q, k, v, g, beta, state):
    """Token by token in float64: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    current = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    if state is not None:
        current = state.double().clone()
    outputs = []
    for t in range(q.shape[0]):
        current = current * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", current, k[t])
        current = current + k[t][:, :, None] * ((v[t] - predicted) * beta[t][:, None])[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", current, q[t]))
    return torch.stack(outputs), current


def random_inputs(length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(length, HEADS, K_DIM, generator=generator)) * K_DIM**-0.5
    k = l2_normalize(torch.randn(length, HEADS, K_DIM, generator=generator))
    v = torch.randn(length, HEADS, V_DIM, generator=generator)
    g = -F.softplus(torch.randn(length, HEADS, generator=generator)) * 0.5
    beta = torch.rand(length, HEADS, generator=generator)
    return q, k, v, g, beta


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("length", [1, 7, 64, 128, 150, 300])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_matches_the_token_loop(length, with_state):
    q, k, v, g, beta = random_inputs(length, seed=length)
    state = torch.randn(HEADS, K_DIM, V_DIM) if with_state else None
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    want_out, want_final = naive_delta_rule(q, k, v, g, beta, state)
    assert out.dtype == torch.float32 and out.shape == (length, HEADS, V_DIM)
    assert relative_error(out, want_out) < 1e-4
    assert relative_error(final, want_final) < 1e-4


def test_chunks_carried_across_calls_equal_one_call():
    """Chunked prefill over steps: the state leaving one piece enters the next."""
    q, k, v, g, beta = random_inputs(200, seed=1)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, None)
    first, state = chunk_gated_delta_rule(q[:77], k[:77], v[:77], g[:77], beta[:77], None)
    second, final = chunk_gated_delta_rule(q[77:], k[77:], v[77:], g[77:], beta[77:], state)
    assert relative_error(torch.cat((first, second)), whole.double()) < 1e-5
    assert relative_error(final, whole_state.double()) < 1e-5


def test_recurrent_step_matches_the_token_loop():
    """A batch of decode steps, each sequence from its own state, then several steps in a row."""
    batch = 4
    state = torch.randn(batch, HEADS, K_DIM, V_DIM)
    steps = [random_inputs(batch, seed=10 + s) for s in range(5)]
    current = state
    for q, k, v, g, beta in steps:
        out, current_next = recurrent_gated_delta_rule(q, k, v, g, beta, current)
        for b in range(batch):
            want_out, want_state = naive_delta_rule(
                q[b : b + 1], k[b : b + 1], v[b : b + 1], g[b : b + 1], beta[b : b + 1], current[b]
            )
            assert relative_error(out[b], want_out[0]) < 1e-5
            assert relative_error(current_next[b], want_state) < 1e-5
        current = current_next


def test_causal_conv1d_carries_its_state():
    channels, width, length = 12, 4, 20
    torch.manual_seed(0)
    x = torch.randn(length, channels)
    weight = torch.randn(channels, width)
    reference = F.silu(
        F.conv1d(x.t().unsqueeze(0), weight.unsqueeze(1), padding=width - 1, groups=channels)[0, :, :length]
    ).t()
    whole, state = causal_conv1d(x, weight, None)
    assert torch.allclose(whole, reference, atol=1e-6)
    # in pieces (one shorter than the state), then token by token
    first, state = causal_conv1d(x[:2], weight, None)
    second, state = causal_conv1d(x[2:9], weight, state)
    pieces = [first, second]
    states = state.unsqueeze(0)
    for t in range(9, length):
        out, states = causal_conv1d_step(x[t : t + 1], weight, states)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces), reference, atol=1e-6)
    assert torch.equal(states[0], x[length - width + 1 :].t())
