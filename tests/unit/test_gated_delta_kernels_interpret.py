"""Gated DeltaNet's Triton kernels (fitserve/kernels/gated_delta_chunk.py, gated_delta_recurrent.py,
causal_conv1d.py) under Triton's CPU interpreter at tiny shapes, against the torch ops of
fitserve/layers/gated_delta_rule.py and a naive per-token float64 reference: packed batches of sequences
of lengths 1, below, at and past the 64-token chunk, from nonzero initial states in slots given out of
order, q/k per key head (two value heads each), raw (normalised in the kernel) or as the layer's torch path
gives them; the decode step fused with the gating, several steps in a row, a padded row (slot -1); the
per-sequence CUDA branches of gated_delta_rule.py; float32 and bfloat16 inputs. Skipped where triton is not
installed (CI installs only torch).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in one child process (this file
run as a script, tests/unit/triton_interpreter.py); it returns one error figure per check and the tests
compare them with the tolerances.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_interpreter import check_errors, run_in_interpreter

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

KEY_HEADS, HEADS, K_DIM, V_DIM, WIDTH = 1, 2, 16, 32, 4
CONV_CHANNELS = 2 * KEY_HEADS * K_DIM + HEADS * V_DIM
LENGTHS = [70, 1, 64, 0, 5]  # one past a chunk, one token, one whole chunk, an empty piece, a short one
SLOTS = [3, 0, 5, 1, 2]
HAS_INITIAL = [True, True, False, True, True]
POOL_SLOTS = 7
# float32 inside the kernels: only summation order differs from the float64 loop (relative to max |ref|)
TOLERANCE = 1e-4
BF16_OUTPUT = 2**-7  # a bfloat16 output rounded once, relative to max |ref|
# the torch path rounds the bfloat16 conv output twice (conv, then SiLU), the kernel once: q, k, v differ
# by an ulp here and there
LAYER_BF16 = 2**-6


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return run_in_interpreter(__file__, "all")


@needs_triton
def test_chunked_rule_matches_float64_loop_and_torch_op(errors: dict[str, float]) -> None:
    check_errors(errors, "chunk/", TOLERANCE)


@needs_triton
def test_recurrent_step_fused_with_gating_matches(errors: dict[str, float]) -> None:
    check_errors(errors, "recurrent/", TOLERANCE)


@needs_triton
def test_causal_conv1d_prefill_and_update_match(errors: dict[str, float]) -> None:
    check_errors(errors, "conv32/", TOLERANCE)
    check_errors(errors, "conv16/", BF16_OUTPUT)


@needs_triton
def test_per_sequence_cuda_branches_match_torch_ops(errors: dict[str, float]) -> None:
    check_errors(errors, "branch/", TOLERANCE)


@needs_triton
def test_prefill_then_decode_continues_the_sequence(errors: dict[str, float]) -> None:
    check_errors(errors, "chain/", TOLERANCE)


@needs_triton
def test_layer_level_prefill_and_decode_match_the_torch_path(errors: dict[str, float]) -> None:
    check_errors(errors, "layer32/", TOLERANCE)
    check_errors(errors, "layer16/", LAYER_BF16)


@needs_triton
def test_untouched_slots_keep_their_state(errors: dict[str, float]) -> None:
    check_errors(errors, "untouched/", 0.0)


# --- references (float64, token by token) ------------------------------------------------------------


def gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """The layer's g and beta from in_proj_a / in_proj_b outputs (beta rounded to b's dtype, as there)."""
    g = -a_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return g, torch.sigmoid(b).double()


def naive_delta_rule(q, k, v, g, beta, state, l2norm: bool, scale: float):
    """One sequence, token by token in float64: q, k [L, key heads, Dk] (normalised here if l2norm, q
    times scale), v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv] or None."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    current = torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float64)
    if state is not None:
        current = state.double().clone()
    outputs = []
    for t in range(v.shape[0]):
        current = current * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", current, k[t])
        current = current + k[t][:, :, None] * ((v[t] - predicted) * beta[t][:, None])[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", current, q[t]))
    out = torch.stack(outputs) if outputs else torch.zeros(0, v.shape[1], v.shape[2], dtype=torch.float64)
    return out, current


def naive_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None):
    """One sequence in float64: x [L, C], weight [C, K], state [C, K - 1] or None -> (silu out, new state)."""
    channels, width = weight.shape
    previous = torch.zeros(channels, width - 1, dtype=torch.float64) if state is None else state.double()
    padded = torch.cat((previous, x.double().t()), dim=1)
    out = torch.zeros(x.shape[0], channels, dtype=torch.float64)
    for t in range(x.shape[0]):
        out[t] = (padded[:, t : t + width] * weight.double()).sum(-1)
    return F.silu(out), padded[:, padded.shape[1] - (width - 1) :]


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) if want.numel() else 1.0
    return float((got.double() - want.double()).abs().max()) / max(scale, 1e-30) if want.numel() else 0.0


# --- the child ------------------------------------------------------------------------------------------


def _inputs(lengths: list[int], seed: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    q, k, v = randn(tokens, KEY_HEADS, K_DIM), randn(tokens, KEY_HEADS, K_DIM), randn(tokens, HEADS, V_DIM)
    a, b = randn(tokens, HEADS), randn(tokens, HEADS)
    # gentle decays (exp(g) ~ 0.97 a token): initial states still matter after a chunk
    a_log = 0.5 * torch.randn(HEADS, generator=generator) - 3.0
    dt_bias = torch.randn(HEADS, generator=generator)
    states = 0.5 * torch.randn(POOL_SLOTS, HEADS, K_DIM, V_DIM, generator=generator)
    return q, k, v, a, b, a_log, dt_bias, states


def _chunk_checks(results: dict[str, float]) -> None:
    from fitserve.kernels.gated_delta_chunk import chunk_gated_delta_rule_kernel
    from fitserve.layers.gated_delta_rule import chunk_gated_delta_rule_varlen

    scale = K_DIM**-0.5
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        q, k, v, a, b, a_log, dt_bias, states = _inputs(LENGTHS, 1, dtype)
        g, beta = gating(a, b, a_log, dt_bias)
        g32, beta32 = g.float(), beta.to(b.dtype)
        pool = states.clone()
        out = chunk_gated_delta_rule_kernel(
            q, k, v, g32, beta32, pool, LENGTHS, SLOTS, HAS_INITIAL, l2norm=True, scale=scale, block_v=16
        )
        torch_pool = states.clone()
        torch_out = chunk_gated_delta_rule_varlen(
            q, k, v, g32, beta32, torch_pool, LENGTHS, SLOTS, HAS_INITIAL, l2norm=True, scale=scale
        )
        results[f"chunk/{name}/vs_torch_op"] = relative(out, torch_out)
        results[f"chunk/{name}/state_vs_torch_op"] = relative(pool, torch_pool)
        start = 0
        for i, (length, slot, initial) in enumerate(zip(LENGTHS, SLOTS, HAS_INITIAL)):
            rows = slice(start, start + length)
            want, want_state = naive_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot] if initial else None, True, scale
            )
            if length:
                results[f"chunk/{name}/seq{i}/out"] = relative(out[rows], want)
                results[f"chunk/{name}/seq{i}/state"] = relative(pool[slot], want_state)
            else:
                results[f"untouched/chunk/{name}/empty_seq"] = relative(pool[slot], states[slot])
            start += length
        for slot in set(range(POOL_SLOTS)) - set(SLOTS):
            results[f"untouched/chunk/{name}/slot{slot}"] = relative(pool[slot], states[slot])
        assert out.dtype == torch.float32 and out.shape == (sum(LENGTHS), HEADS, V_DIM)


def _recurrent_checks(results: dict[str, float]) -> None:
    from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_kernel
    from fitserve.layers.gated_delta_rule import fused_recurrent_gated_delta_rule_update

    scale = K_DIM**-0.5
    slots = torch.tensor([4, -1, 0, 2], dtype=torch.int32)  # out of order, a padded row
    batch = slots.shape[0]
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        *_, states = _inputs([1], 2, dtype)
        pool, torch_pool, naive = states.clone(), states.clone(), states.double().clone()
        for step in range(3):
            q, k, v, a, b, a_log, dt_bias, _ = _inputs([batch], 10 + step, dtype)
            out = fused_recurrent_gated_delta_rule_kernel(
                q, k, v, a, b, pool, slots, a_log=a_log, dt_bias=dt_bias, l2norm=True, scale=scale
            )
            torch_out = fused_recurrent_gated_delta_rule_update(
                q, k, v, a, b, a_log, dt_bias, torch_pool, slots, scale=scale
            )
            g, beta = gating(a, b, a_log, dt_bias)
            results[f"recurrent/{name}/step{step}/vs_torch_op"] = relative(out, torch_out)
            results[f"recurrent/{name}/step{step}/padded_row_zero"] = float(out[1].abs().max())
            for row, slot in enumerate(slots.tolist()):
                if slot < 0:
                    continue
                one = slice(row, row + 1)
                want, naive[slot] = naive_delta_rule(
                    q[one], k[one], v[one], g[one], beta[one], naive[slot], True, scale
                )
                results[f"recurrent/{name}/step{step}/row{row}"] = relative(out[row], want[0])
        results[f"recurrent/{name}/states"] = relative(pool, naive)
        results[f"recurrent/{name}/states_vs_torch_op"] = relative(pool, torch_pool)
        for slot in set(range(POOL_SLOTS)) - set(slots.tolist()):
            results[f"untouched/recurrent/{name}/slot{slot}"] = relative(pool[slot], states[slot])
    # precomputed g and beta, q/k as the layer's torch path gives them (normalised, one per value head)
    q, k, v, a, b, a_log, dt_bias, states = _inputs([batch], 20, torch.float32)
    g, beta = gating(a, b, a_log, dt_bias)
    pool = states.clone()
    live = torch.tensor([3, 1, 6, 5], dtype=torch.int64)
    out = fused_recurrent_gated_delta_rule_kernel(
        q.expand(-1, HEADS, -1), k.expand(-1, HEADS, -1), v, g.float(), beta.float(), pool, live
    )
    for row, slot in enumerate(live.tolist()):
        one = slice(row, row + 1)
        want, want_state = naive_delta_rule(q[one], k[one], v[one], g[one], beta[one], states[slot], False, 1)
        results[f"recurrent/plain/row{row}"] = relative(out[row], want[0])
        results[f"recurrent/plain/state{row}"] = relative(pool[slot], want_state)


def _conv_checks(results: dict[str, float]) -> None:
    from fitserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen

    lengths = [1, 2, 37, 0, 5, 3]  # shorter than the state (1, 2), past a token block (37)
    slots = [4, 0, 2, 1, 5, 6]
    initial = [True, True, False, True, True, True]
    for dtype, prefix in ((torch.float32, "conv32"), (torch.bfloat16, "conv16")):
        generator = torch.Generator().manual_seed(3)
        x = torch.randn(sum(lengths), CONV_CHANNELS, generator=generator).to(dtype)
        weight = (0.5 * torch.randn(CONV_CHANNELS, WIDTH, generator=generator)).to(dtype)
        states = torch.randn(POOL_SLOTS, CONV_CHANNELS, WIDTH - 1, generator=generator).to(dtype)
        pool = states.clone()
        wide = torch.empty(x.shape[0], CONV_CHANNELS + 8, dtype=dtype)  # strided rows, as qkv views are
        wide[:, :CONV_CHANNELS] = x
        out = causal_conv1d_varlen(wide[:, :CONV_CHANNELS], weight, pool, lengths, slots, initial)
        start = 0
        for i, (length, slot, has) in enumerate(zip(lengths, slots, initial)):
            rows = slice(start, start + length)
            want, want_state = naive_conv(x[rows], weight, states[slot] if has else None)
            if length:
                results[f"{prefix}/prefill/seq{i}/out"] = relative(out[rows], want)
                results[f"{prefix}/prefill/seq{i}/state"] = relative(pool[slot], want_state)
            else:
                results[f"untouched/{prefix}/empty_seq"] = relative(pool[slot], states[slot])
            start += length
        results[f"untouched/{prefix}/slot3"] = relative(pool[3], states[3])
        # then two decode steps, slots out of order and a padded row
        step_slots = torch.tensor([2, -1, 4, 6], dtype=torch.int32)
        before = pool.clone()
        for step in range(2):
            xs = torch.randn(4, CONV_CHANNELS, generator=generator).to(dtype)
            out = causal_conv1d_update(xs, weight, pool, step_slots)
            results[f"{prefix}/update/step{step}/padded_row_zero"] = float(out[1].abs().max())
            for row, slot in enumerate(step_slots.tolist()):
                if slot < 0:
                    continue
                want, want_state = naive_conv(xs[row : row + 1], weight, before[slot])
                before[slot] = want_state.to(dtype)
                results[f"{prefix}/update/step{step}/row{row}"] = relative(out[row], want[0])
                results[f"{prefix}/update/step{step}/state{row}"] = relative(pool[slot], want_state)
        for slot in (0, 1, 3, 5):
            results[f"untouched/{prefix}/update_slot{slot}"] = relative(pool[slot], before[slot])


def _branch_checks(results: dict[str, float]) -> None:
    """The per-sequence CUDA branches of gated_delta_rule.py (what the layer calls today) on CPU tensors."""
    from fitserve.layers import gated_delta_rule as ops

    scale = K_DIM**-0.5
    q, k, v, a, b, a_log, dt_bias, states = _inputs([150], 4, torch.float32)
    g, beta = (t.float() for t in gating(a, b, a_log, dt_bias))
    q = (ops.l2_normalize(q) * scale).repeat_interleave(HEADS, dim=1)
    k = ops.l2_normalize(k).repeat_interleave(HEADS, dim=1)
    for state in (None, states[2]):
        tag = "fresh" if state is None else "from_state"
        got, got_state = ops._chunk_cuda(q, k, v, g, beta, state)
        want, want_state = ops.chunk_gated_delta_rule(q, k, v, g, beta, state)
        results[f"branch/chunk/{tag}/out"] = relative(got, want)
        results[f"branch/chunk/{tag}/state"] = relative(got_state, want_state)
    batch = slice(0, 3)
    got, got_state = ops._recurrent_cuda(q[batch], k[batch], v[batch], g[batch], beta[batch], states[:3])
    want, want_state = ops.recurrent_gated_delta_rule(
        q[batch], k[batch], v[batch], g[batch], beta[batch], states[:3]
    )
    results["branch/recurrent/out"] = relative(got, want)
    results["branch/recurrent/state"] = relative(got_state, want_state)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, CONV_CHANNELS, generator=generator)
    weight = torch.randn(CONV_CHANNELS, WIDTH, generator=generator)
    conv_state = torch.randn(CONV_CHANNELS, WIDTH - 1, generator=generator)
    for state in (None, conv_state):
        tag = "fresh" if state is None else "from_state"
        got, got_state = ops._causal_conv1d_cuda(x, weight, state)
        want, want_state = ops.causal_conv1d(x, weight, state)
        results[f"branch/conv/{tag}/out"] = relative(got, want)
        results[f"branch/conv/{tag}/state"] = relative(got_state, want_state)
    conv_states = torch.randn(3, CONV_CHANNELS, WIDTH - 1, generator=generator)
    got, got_state = ops._causal_conv1d_step_cuda(x[:3], weight, conv_states)
    want, want_state = ops.causal_conv1d_step(x[:3], weight, conv_states)
    results["branch/conv_step/out"] = relative(got, want)
    results["branch/conv_step/state"] = relative(got_state, want_state)


def _chain_checks(results: dict[str, float]) -> None:
    """A prompt prefilled in two pieces (the second from the first's state), then decode steps: equal to one
    float64 loop over all the tokens."""
    from fitserve.kernels.gated_delta_chunk import chunk_gated_delta_rule_kernel
    from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_kernel

    scale = K_DIM**-0.5
    total, first, decode = 100, 67, 3
    q, k, v, a, b, a_log, dt_bias, states = _inputs([total], 6, torch.float32)
    g, beta = gating(a, b, a_log, dt_bias)
    want, want_state = naive_delta_rule(q, k, v, g, beta, None, True, scale)
    pool = states.clone()
    slot = 4
    pieces = []
    for rows, initial in ((slice(0, first), False), (slice(first, total - decode), True)):
        pieces.append(
            chunk_gated_delta_rule_kernel(
                q[rows],
                k[rows],
                v[rows],
                g[rows].float(),
                beta[rows].float(),
                pool,
                [rows.stop - rows.start],
                [slot],
                [initial],
                l2norm=True,
                scale=scale,
            )
        )
    slot_t = torch.tensor([slot])
    for t in range(total - decode, total):
        one = slice(t, t + 1)
        pieces.append(
            fused_recurrent_gated_delta_rule_kernel(
                q[one],
                k[one],
                v[one],
                a[one],
                b[one],
                pool,
                slot_t,
                a_log=a_log,
                dt_bias=dt_bias,
                l2norm=True,
                scale=scale,
            )
        )
    results["chain/out"] = relative(torch.cat(pieces), want)
    results["chain/state"] = relative(pool[slot], want_state)


def _layer_checks(results: dict[str, float]) -> None:
    """gated_delta_net_prefill then two gated_delta_net_decode steps (what the layer would call) through
    the kernels (their CUDA branches forced on CPU tensors) against the same functions' torch path."""
    from fitserve.layers import gated_delta_rule as ops

    lengths, slots, initial = [70, 1, 0, 5], [2, 6, 0, 4], [True, False, True, True]
    step_slots = torch.tensor([4, -1, 2], dtype=torch.int32)
    torch_path = ops._use_kernels
    for dtype, prefix in ((torch.float32, "layer32"), (torch.bfloat16, "layer16")):
        generator = torch.Generator().manual_seed(7)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator)  # noqa: B023

        tokens = sum(lengths)
        qkv, decode_qkv = randn(tokens, CONV_CHANNELS).to(dtype), randn(2, 3, CONV_CHANNELS).to(dtype)
        weight = (0.5 * randn(CONV_CHANNELS, WIDTH)).to(dtype)
        a, b = randn(tokens, HEADS).to(dtype), randn(tokens, HEADS).to(dtype)
        decode_a, decode_b = randn(2, 3, HEADS).to(dtype), randn(2, 3, HEADS).to(dtype)
        a_log, dt_bias = 0.5 * randn(HEADS) - 3.0, randn(HEADS)
        g = -a_log.exp() * F.softplus(a.float() + dt_bias)
        beta = torch.sigmoid(b)
        conv_states = randn(POOL_SLOTS, CONV_CHANNELS, WIDTH - 1).to(dtype)
        states = 0.5 * randn(POOL_SLOTS, HEADS, K_DIM, V_DIM)
        found = []
        for kernels in (False, True):
            ops._use_kernels = (lambda t: True) if kernels else torch_path
            try:
                conv_pool, pool = conv_states.clone(), states.clone()
                args = (weight, conv_pool, pool)
                outs = [
                    ops.gated_delta_net_prefill(
                        qkv, g, beta, *args, lengths, slots, initial, KEY_HEADS, K_DIM
                    )
                ]
                for step in range(2):
                    outs.append(
                        ops.gated_delta_net_decode(
                            decode_qkv[step],
                            decode_a[step],
                            decode_b[step],
                            a_log,
                            dt_bias,
                            *args,
                            step_slots,
                            KEY_HEADS,
                            K_DIM,
                        )
                    )
            finally:
                ops._use_kernels = torch_path
            found.append((outs, conv_pool, pool))
        (want, want_conv, want_pool), (got, got_conv, got_pool) = found
        for i, (out, reference) in enumerate(zip(got, want)):
            results[f"{prefix}/out{i}"] = relative(out, reference)
        results[f"{prefix}/recurrent_states"] = relative(got_pool, want_pool)
        results[f"{prefix}/conv_states"] = relative(got_conv, want_conv)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run by the tests with TRITON_INTERPRET=1"
    from tests.unit.triton_interpreter import patch_interpreter

    patch_interpreter()
    assert json.loads(sys.argv[1]) == "all"
    found: dict[str, float] = {}
    for checks in (
        _chunk_checks,
        _recurrent_checks,
        _conv_checks,
        _branch_checks,
        _chain_checks,
        _layer_checks,
    ):
        checks(found)
    print(json.dumps(found))
