"""Gated DeltaNet's Triton kernels on the GPU at Qwen3.6-27B's linear-attention geometry (16 key heads, 48
value heads, head dims 128, conv width 4), bfloat16 activations, against float64 token loops: the chunked
rule over packed sequences (lengths 1, below / at / past the 64-token chunk, long ones, an empty piece) from
nonzero states in slots out of order, the fused decode step (L2 norms and gating in the kernel, several
steps, a padded row), the causal conv1d (prefill and update), the per-sequence CUDA branches of
layers/gated_delta_rule.py against the same ops on the CPU, and the decode kernels captured in a CUDA graph
and replayed. test_timings prints per-layer times (no assertion). Needs CUDA and triton.

The chunked kernel's dots take float32 operands that the tensor cores run as TF32 (kernels/
gated_delta_chunk.py, DOT_PRECISION): its tolerance is TF32's, not float32's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from fitserve.kernels import gated_delta_chunk  # noqa: E402
from fitserve.kernels.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen  # noqa: E402
from fitserve.kernels.gated_delta_chunk import chunk_gated_delta_rule_kernel  # noqa: E402
from fitserve.kernels.gated_delta_recurrent import fused_recurrent_gated_delta_rule_kernel  # noqa: E402
from fitserve.layers import gated_delta_rule as ops  # noqa: E402

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")
REPO = Path(__file__).resolve().parents[2]


def _geometry() -> tuple[int, int, int, int, int]:
    """(key heads, value heads, k_dim, v_dim, conv width) of Qwen3.6-27B's DeltaNet layers."""
    for root in (REPO / "shared", REPO.parent / "shared"):
        path = root / "models" / "qwen3.6-27b" / "config.json"
        if path.is_file():
            config = json.loads(path.read_text())
            text = config.get("text_config", config)
            return (
                int(text["linear_num_key_heads"]),
                int(text["linear_num_value_heads"]),
                int(text["linear_key_head_dim"]),
                int(text["linear_value_head_dim"]),
                int(text["linear_conv_kernel_dim"]),
            )
    return 16, 48, 128, 128, 4


KEY_HEADS, HEADS, K_DIM, V_DIM, WIDTH = _geometry()
CONV_CHANNELS = 2 * KEY_HEADS * K_DIM + HEADS * V_DIM
SCALE = K_DIM**-0.5
POOL_SLOTS = 9
# relative to max |reference|: TF32 dots (10-bit mantissa) in the chunked kernel; float32 elsewhere
CHUNK_TOLERANCE = 1e-2
RECURRENT_TOLERANCE = 1e-4
BF16_OUTPUT = 2**-7


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def gating(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor):
    """The layer's decay and beta (beta rounded to b's dtype, as the layer does), float64."""
    g = -a_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return g, torch.sigmoid(b).double()


def naive_delta_rule(q, k, v, g, beta, state):
    """One sequence token by token in float64; q, k raw per key head (normalised here, q scaled)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * SCALE
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    repeat = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    current = torch.zeros(v.shape[1], k.shape[2], v.shape[2], dtype=torch.float64, device=v.device)
    if state is not None:
        current = state.double().clone()
    outputs = []
    for t in range(v.shape[0]):
        current = current * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", current, k[t])
        current = current + k[t][:, :, None] * ((v[t] - predicted) * beta[t][:, None])[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", current, q[t]))
    return torch.stack(outputs), current


def naive_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None):
    channels, width = weight.shape
    previous = torch.zeros(channels, width - 1, dtype=torch.float64, device=x.device)
    if state is not None:
        previous = state.double()
    padded = torch.cat((previous, x.double().t()), dim=1)
    windows = padded.unfold(1, width, 1)  # [C, L, K]
    out = (windows * weight.double()[:, None, :]).sum(-1).t()
    return F.silu(out), padded[:, padded.shape[1] - (width - 1) :]


def inputs(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=DEVICE)

    q, k = randn(tokens, KEY_HEADS, K_DIM).to(dtype), randn(tokens, KEY_HEADS, K_DIM).to(dtype)
    v = randn(tokens, HEADS, V_DIM).to(dtype)
    a, b = randn(tokens, HEADS).to(dtype), randn(tokens, HEADS).to(dtype)
    a_log = 0.5 * randn(HEADS) - 2.5  # per-token decays of ~0.9 to ~1: states matter across chunks
    dt_bias = randn(HEADS)
    states = 0.5 * randn(POOL_SLOTS, HEADS, K_DIM, V_DIM)
    return q, k, v, a, b, a_log, dt_bias, states


@pytest.mark.parametrize(("precision", "tolerance"), [("tf32", CHUNK_TOLERANCE), ("ieee", 1e-4)])
def test_chunked_rule_matches_float64_loop(
    precision: str, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TF32 dots (the default) and with float32 ones (the kernel's arithmetic alone)."""
    monkeypatch.setattr(gated_delta_chunk, "DOT_PRECISION", precision)
    lengths = [700, 1, 64, 63, 0, 65, 1500]
    slots = [3, 0, 8, 5, 1, 2, 6]
    initial = [True, True, False, True, True, True, True]
    q, k, v, a, b, a_log, dt_bias, states = inputs(sum(lengths), 1)
    g, beta = gating(a, b, a_log, dt_bias)
    pool = states.clone()
    out = chunk_gated_delta_rule_kernel(
        q, k, v, g.float(), beta.to(b.dtype), pool, lengths, slots, initial, l2norm=True, scale=SCALE
    )
    start = 0
    for length, slot, has in zip(lengths, slots, initial):
        rows = slice(start, start + length)
        if length:
            want, want_state = naive_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot] if has else None
            )
            assert relative(out[rows], want) < tolerance, (length, slot)
            assert relative(pool[slot], want_state) < tolerance, (length, slot)
        else:
            assert torch.equal(pool[slot], states[slot])
        start += length
    assert torch.equal(pool[4], states[4]) and torch.equal(pool[7], states[7])


def test_chunked_rule_matches_the_torch_op_on_cpu() -> None:
    """The batched op on CUDA (the kernels) against the same op's torch path on the CPU in float32."""
    lengths, slots, initial = [130, 1, 64], [2, 7, 4], [True, False, True]
    q, k, v, a, b, a_log, dt_bias, states = inputs(sum(lengths), 2)
    g, beta = gating(a, b, a_log, dt_bias)
    g, beta = g.float(), beta.to(b.dtype)
    pool, cpu_pool = states.clone(), states.cpu()
    args = (lengths, slots, initial)
    out = ops.chunk_gated_delta_rule_varlen(q, k, v, g, beta, pool, *args, l2norm=True, scale=SCALE)
    cpu_inputs = (t.cpu() for t in (q, k, v, g, beta))
    want = ops.chunk_gated_delta_rule_varlen(*cpu_inputs, cpu_pool, *args, l2norm=True, scale=SCALE)
    assert relative(out.cpu(), want) < CHUNK_TOLERANCE
    assert relative(pool.cpu(), cpu_pool) < CHUNK_TOLERANCE


def test_below_sm80_the_chunked_rule_takes_the_torch_ops() -> None:
    """The chunk kernel needs more shared memory than a block has below 8.0: with that target forced, the
    batched op on CUDA runs the torch path (no ValueError) and still matches the CPU."""
    from fitserve.kernels.capability import forced_target

    lengths, slots, initial = [70, 3], [1, 5], [False, True]
    q, k, v, a, b, a_log, dt_bias, states = inputs(sum(lengths), 2)
    g, beta = gating(a, b, a_log, dt_bias)
    g, beta = g.float(), beta.to(b.dtype)
    pool, cpu_pool = states.clone(), states.cpu()
    args = (lengths, slots, initial)
    with forced_target((7, 5)):
        assert not gated_delta_chunk.runs_on(v.device)
        out = ops.chunk_gated_delta_rule_varlen(q, k, v, g, beta, pool, *args, l2norm=True, scale=SCALE)
    cpu_inputs = (t.cpu() for t in (q, k, v, g, beta))
    want = ops.chunk_gated_delta_rule_varlen(*cpu_inputs, cpu_pool, *args, l2norm=True, scale=SCALE)
    assert relative(out.cpu(), want) < CHUNK_TOLERANCE
    assert relative(pool.cpu(), cpu_pool) < CHUNK_TOLERANCE


def test_fused_decode_step_matches_float64_loop() -> None:
    slots = torch.tensor([6, -1, 0, 3, 8, 1, 5], dtype=torch.int32, device=DEVICE)
    batch = slots.shape[0]
    *_, states = inputs(1, 3)
    pool, naive = states.clone(), states.double().clone()
    for step in range(4):
        q, k, v, a, b, a_log, dt_bias, _ = inputs(batch, 10 + step)
        out = fused_recurrent_gated_delta_rule_kernel(
            q, k, v, a, b, pool, slots, a_log=a_log, dt_bias=dt_bias, l2norm=True, scale=SCALE
        )
        g, beta = gating(a, b, a_log, dt_bias)
        assert not out[1].any()
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                one = slice(row, row + 1)
                want, naive[slot] = naive_delta_rule(q[one], k[one], v[one], g[one], beta[one], naive[slot])
                assert relative(out[row], want[0]) < RECURRENT_TOLERANCE, (step, row)
    assert relative(pool, naive) < RECURRENT_TOLERANCE
    assert torch.equal(pool[2], states[2]) and torch.equal(pool[4], states[4])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_conv1d_prefill_then_update(dtype: torch.dtype) -> None:
    lengths, slots, initial = [1, 2, 300, 0, 77], [4, 0, 2, 1, 5], [True, True, False, True, True]
    generator = torch.Generator(device=DEVICE).manual_seed(4)
    x = torch.randn(sum(lengths), CONV_CHANNELS, generator=generator, device=DEVICE).to(dtype)
    weight = (0.3 * torch.randn(CONV_CHANNELS, WIDTH, generator=generator, device=DEVICE)).to(dtype)
    states = torch.randn(POOL_SLOTS, CONV_CHANNELS, WIDTH - 1, generator=generator, device=DEVICE).to(dtype)
    pool = states.clone()
    out = causal_conv1d_varlen(x, weight, pool, lengths, slots, initial)
    start, expected = 0, states.clone()
    for length, slot, has in zip(lengths, slots, initial):
        rows = slice(start, start + length)
        if length:
            want, want_state = naive_conv(x[rows], weight, states[slot] if has else None)
            assert relative(out[rows], want) < BF16_OUTPUT
            assert torch.equal(pool[slot], want_state.to(dtype))
            expected[slot] = want_state.to(dtype)
        start += length
    assert torch.equal(pool, expected)  # slot 1 (an empty piece) and the others untouched
    step_slots = torch.tensor([2, -1, 4, 5], dtype=torch.int32, device=DEVICE)
    for _ in range(3):
        xs = torch.randn(4, CONV_CHANNELS, generator=generator, device=DEVICE).to(dtype)
        out = causal_conv1d_update(xs, weight, pool, step_slots)
        assert not out[1].any()
        for row, slot in enumerate(step_slots.tolist()):
            if slot >= 0:
                want, want_state = naive_conv(xs[row : row + 1], weight, expected[slot])
                expected[slot] = want_state.to(dtype)
                assert relative(out[row], want[0]) < BF16_OUTPUT
    assert torch.equal(pool, expected)


def test_per_sequence_ops_on_cuda_match_cpu() -> None:
    """What the layer calls today (one sequence at a time): each op's CUDA branch against its CPU path."""
    q, k, v, a, b, a_log, dt_bias, states = inputs(200, 5)
    g, beta = gating(a, b, a_log, dt_bias)
    g, beta = g.float(), beta.float()
    repeat = HEADS // KEY_HEADS
    q = (ops.l2_normalize(q.float()) * SCALE).repeat_interleave(repeat, dim=1)
    k = ops.l2_normalize(k.float()).repeat_interleave(repeat, dim=1)
    for state in (None, states[1]):
        out, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, state)
        cpu = (t.cpu() for t in (q, k, v, g, beta))
        want, want_final = ops.chunk_gated_delta_rule(*cpu, None if state is None else state.cpu())
        assert relative(out.cpu(), want) < CHUNK_TOLERANCE
        assert relative(final.cpu(), want_final) < CHUNK_TOLERANCE
    rows = slice(0, 5)
    out, new = ops.recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[:5])
    cpu = (t[rows].cpu() for t in (q, k, v, g, beta))
    want, want_new = ops.recurrent_gated_delta_rule(*cpu, states[:5].cpu())
    assert relative(out.cpu(), want) < RECURRENT_TOLERANCE
    assert relative(new.cpu(), want_new) < RECURRENT_TOLERANCE
    x = torch.randn(37, CONV_CHANNELS, device=DEVICE).to(torch.bfloat16)
    weight = (0.3 * torch.randn(CONV_CHANNELS, WIDTH, device=DEVICE)).to(torch.bfloat16)
    conv_state = torch.randn(CONV_CHANNELS, WIDTH - 1, device=DEVICE).to(torch.bfloat16)
    out, new_state = ops.causal_conv1d(x, weight, conv_state)
    want, want_state = ops.causal_conv1d(x.cpu(), weight.cpu(), conv_state.cpu())
    assert relative(out.cpu(), want) < 2 * BF16_OUTPUT and torch.equal(new_state.cpu(), want_state)
    out, new_states = ops.causal_conv1d_step(x[:3], weight, conv_state.expand(3, -1, -1))
    want, want_states = ops.causal_conv1d_step(x[:3].cpu(), weight.cpu(), conv_state.cpu().expand(3, -1, -1))
    assert relative(out.cpu(), want) < 2 * BF16_OUTPUT and torch.equal(new_states.cpu(), want_states)


def _decode_step(qkv, a, b, weight, a_log, dt_bias, conv_pool, pool, slots) -> torch.Tensor:
    """The layer's decode step on the kernels: conv update, then the fused rule on the conv output."""
    mixed = causal_conv1d_update(qkv, weight, conv_pool, slots)
    key_size = KEY_HEADS * K_DIM
    batch = mixed.shape[0]
    q = mixed[:, :key_size].view(batch, KEY_HEADS, K_DIM)
    k = mixed[:, key_size : 2 * key_size].view(batch, KEY_HEADS, K_DIM)
    v = mixed[:, 2 * key_size :].view(batch, HEADS, V_DIM)
    return fused_recurrent_gated_delta_rule_kernel(
        q, k, v, a, b, pool, slots, a_log=a_log, dt_bias=dt_bias, l2norm=True, scale=SCALE
    )


def test_decode_step_captured_in_a_cuda_graph() -> None:
    batch = 8
    generator = torch.Generator(device=DEVICE).manual_seed(6)
    *_, a_log, dt_bias, states = inputs(1, 6)
    weight = (0.3 * torch.randn(CONV_CHANNELS, WIDTH, generator=generator, device=DEVICE)).to(torch.bfloat16)
    conv_states = torch.randn(POOL_SLOTS, CONV_CHANNELS, WIDTH - 1, generator=generator, device=DEVICE).to(
        torch.bfloat16
    )

    def fresh_inputs():
        qkv = torch.randn(batch, CONV_CHANNELS, generator=generator, device=DEVICE).to(torch.bfloat16)
        a = torch.randn(batch, HEADS, generator=generator, device=DEVICE).to(torch.bfloat16)
        b = torch.randn(batch, HEADS, generator=generator, device=DEVICE).to(torch.bfloat16)
        return qkv, a, b

    static_qkv, static_a, static_b = fresh_inputs()
    static_slots = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.int32, device=DEVICE)
    conv_pool, pool = conv_states.clone(), states.clone()
    args = (weight, a_log, dt_bias, conv_pool, pool, static_slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        _decode_step(static_qkv, static_a, static_b, *args)
    torch.cuda.current_stream().wait_stream(stream)
    conv_pool.copy_(conv_states)
    pool.copy_(states)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _decode_step(static_qkv, static_a, static_b, *args)
    eager_conv, eager_pool = conv_states.clone(), states.clone()
    for slots in ([8, 3, 1, 0, 5, -1, 2, 7], [2, 4, 6, -1, -1, 1, 3, 5]):
        qkv, a, b = fresh_inputs()
        static_qkv.copy_(qkv)
        static_a.copy_(a)
        static_b.copy_(b)
        static_slots.copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        slots_t = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        want = _decode_step(qkv, a, b, weight, a_log, dt_bias, eager_conv, eager_pool, slots_t)
        assert torch.equal(static_out, want)
        assert torch.equal(conv_pool, eager_conv) and torch.equal(pool, eager_pool)
    assert not torch.equal(pool, states)


def _time_ms(function, repeats: int = 20) -> float:
    function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def test_timings() -> None:
    """Per DeltaNet layer, printed (run with -s): prefill of 8k tokens (one sequence, and 4 x 2k), and the
    decode step at a few batch sizes (conv update + fused rule), with its state traffic in GB/s."""
    lines = [
        f"DeltaNet kernels, {torch.cuda.get_device_name()}, heads {KEY_HEADS}/{HEADS}, dims {K_DIM}/{V_DIM}"
    ]
    for lengths in ([8192], [2048] * 4):
        tokens = sum(lengths)
        q, k, v, a, b, a_log, dt_bias, states = inputs(tokens, 7)
        g = (-a_log.exp() * F.softplus(a.float() + dt_bias)).contiguous()
        beta = torch.sigmoid(b)
        slots, initial = list(range(len(lengths))), [True] * len(lengths)
        qkv = torch.randn(tokens, CONV_CHANNELS, device=DEVICE).to(torch.bfloat16)
        weight = torch.randn(CONV_CHANNELS, WIDTH, device=DEVICE).to(torch.bfloat16)
        conv_pool = torch.zeros(POOL_SLOTS, CONV_CHANNELS, WIDTH - 1, device=DEVICE, dtype=torch.bfloat16)
        chunk = functools.partial(chunk_gated_delta_rule_kernel, q, k, v, g, beta, states, lengths, slots)
        times = []
        for block_v in (32, 64):  # 64 is the default
            call = functools.partial(chunk, initial, l2norm=True, scale=SCALE, block_v=block_v)
            times.append(f"block_v {block_v}: {_time_ms(call, 5):.3f} ms")
        conv = functools.partial(causal_conv1d_varlen, qkv, weight, conv_pool, lengths, slots, initial)
        lines.append(
            f"prefill {lengths[0]} x {len(lengths)}: chunked rule {', '.join(times)}; "
            f"conv {_time_ms(conv, 5):.3f} ms"
        )
    for batch in (1, 8, 64):
        *_, a_log, dt_bias, states = inputs(1, 8)
        pool = torch.zeros(batch + 1, HEADS, K_DIM, V_DIM, device=DEVICE)
        conv_pool = torch.zeros(batch + 1, CONV_CHANNELS, WIDTH - 1, device=DEVICE, dtype=torch.bfloat16)
        qkv = torch.randn(batch, CONV_CHANNELS, device=DEVICE).to(torch.bfloat16)
        a = torch.randn(batch, HEADS, device=DEVICE).to(torch.bfloat16)
        b = torch.randn(batch, HEADS, device=DEVICE).to(torch.bfloat16)
        weight = torch.randn(CONV_CHANNELS, WIDTH, device=DEVICE).to(torch.bfloat16)
        slots = torch.arange(1, batch + 1, dtype=torch.int32, device=DEVICE)
        graph = torch.cuda.CUDAGraph()
        _decode_step(qkv, a, b, weight, a_log, dt_bias, conv_pool, pool, slots)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            _decode_step(qkv, a, b, weight, a_log, dt_bias, conv_pool, pool, slots)
        step_ms = _time_ms(graph.replay, 100)
        traffic = 2 * batch * HEADS * K_DIM * V_DIM * 4
        lines.append(
            f"decode batch {batch}: {step_ms * 1000:.1f} us a layer (graph replay), "
            f"state traffic {traffic / step_ms / 1e6:.0f} GB/s"
        )
    print("\n".join(lines))
