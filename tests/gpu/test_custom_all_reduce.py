"""The custom all-reduce (distributed/custom_all_reduce.py, kernels/one_shot_all_reduce.py and
one_shot_all_reduce_norm.py) on two GPUs: bit-exact sums in rank order for every size and dtype it takes,
called directly and replayed in CUDA graphs (the graph runners' forwards, where collectives.all_reduce
sends them: collectives.graph_forwards), in long runs of calls of changing sizes beside NCCL's; the fused
all-reduce + RMSNorm equals the two kernels; a rank left waiting for a peer ends when aborted, and traps at
its timeout instead of hanging."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tests.unit.tp_helpers import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

# element counts around the piece size (1024) and up to the largest message (512 KB of bf16)
SIZES = [1, 7, 1023, 1024, 1025, 4096, 8 * 4096 + 8, 64 * 4096]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _values(rank: int, call: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(numel, generator=generator) * (call % 7 + 1)).to(dtype)


def _expected(world: int, call: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float32)
    for rank in range(world):  # the kernel's order: float32, rank by rank
        total += _values(rank, call, numel, dtype).float()
    return total.to(dtype)


def _sizes_and_dtypes(calls: int, seed: int) -> list[tuple[int, torch.dtype]]:
    picker = random.Random(seed)  # the same on every rank
    return [(picker.choice(SIZES), picker.choice(DTYPES)) for _ in range(calls)]


def _eager_sums(rank: int) -> list[bool]:
    from fitserve.distributed.parallel_state import tp

    custom = tp().custom_all_reduce
    assert custom is not None, "the custom all-reduce is off on two peer GPUs"
    exact = []
    for call, (numel, dtype) in enumerate(_sizes_and_dtypes(300, seed=1)):
        x = _values(rank, call, numel, dtype).cuda()
        if numel * x.element_size() > 512 << 10:
            continue
        assert custom.takes(x)
        out = custom(x)
        exact.append(bool(torch.equal(out.cpu(), _expected(2, call, numel, dtype))))
    return exact


def test_eager_sums_are_bit_exact_in_rank_order():
    for exact in run_ranks(_eager_sums, 2, device_type="cuda"):
        assert exact and all(exact), f"{exact.count(False)} of {len(exact)} sums differ"


def _graph_sums(rank: int) -> list[bool]:
    import torch.distributed as dist

    from fitserve.distributed.collectives import all_reduce, all_reduce_add_rms_norm, graph_forwards
    from fitserve.distributed.parallel_state import tp
    from fitserve.kernels.norm import fused_add_rms_norm

    sizes = [
        (4096, torch.bfloat16),
        (16 * 4096, torch.bfloat16),
        (5000, torch.float32),
        (2 << 20, torch.bfloat16),
    ]
    inputs = [torch.zeros(numel, dtype=dtype, device="cuda") for numel, dtype in sizes]
    outputs = [torch.empty_like(x) for x in inputs]
    assert not tp().custom_all_reduce.takes(inputs[-1])  # 4 MB: NCCL, in the same graph
    # and the fused all-reduce + RMSNorm of 4 rows, as a decode step's norms run it
    partial = torch.zeros(4, 4096, dtype=torch.bfloat16, device="cuda")
    residual = torch.zeros_like(partial)  # the same on every rank
    weight = torch.full((4096,), 1.5, dtype=torch.bfloat16, device="cuda")
    normed, new_residual = torch.empty_like(partial), torch.empty_like(partial)

    def body():
        for x, out in zip(inputs, outputs):
            out.copy_(x)
            all_reduce(out)
        normed.copy_(partial)
        new_residual.copy_(residual)
        all_reduce_add_rms_norm(normed, new_residual, weight, 1e-5)

    # as the graph runners do: a warm-up forward (the kernels compile there), then the capture
    with graph_forwards():
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
    exact = []
    for replay in range(40):
        for i, ((numel, dtype), x) in enumerate(zip(sizes, inputs)):
            x.copy_(_values(rank, 100 * replay + i, numel, dtype))
        partial.copy_(_values(rank, 100 * replay + 50, 4 * 4096, torch.bfloat16).view(4, 4096))
        residual.copy_(_values(9, 100 * replay, 4 * 4096, torch.bfloat16).view(4, 4096))
        graph.replay()
        if replay % 3 == 0:  # NCCL and direct custom calls between replays keep the epochs in step
            extra = _values(rank, 7, 2048, torch.bfloat16).cuda()
            tp().custom_all_reduce(extra)
            all_reduce(extra)  # outside a capture: NCCL
            dist.all_reduce(torch.ones(8, device="cuda"))
        for i, ((numel, dtype), out) in enumerate(zip(sizes, outputs)):
            exact.append(bool(torch.equal(out.cpu(), _expected(2, 100 * replay + i, numel, dtype))))
        summed = _expected(2, 100 * replay + 50, 4 * 4096, torch.bfloat16).view(4, 4096).cuda()
        want_normed, want_residual = fused_add_rms_norm(summed, residual.clone(), weight, 1e-5)
        exact.append(bool(torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)))
    return exact


def test_graph_replays_sum_exactly_beside_nccl():
    for exact in run_ranks(_graph_sums, 2, device_type="cuda"):
        assert exact and all(exact), f"{exact.count(False)} of {len(exact)} sums differ"


def _back_to_back(rank: int) -> bool:
    """2,000 calls queued without a sync (each rank runs ahead as far as its peer lets it): the parities
    and epochs must keep every call's data apart."""
    from fitserve.distributed.parallel_state import tp

    all_reduce = tp().custom_all_reduce
    plan = _sizes_and_dtypes(2000, seed=2)
    tensors = [_values(rank, call, numel, dtype).cuda() for call, (numel, dtype) in enumerate(plan)]
    torch.cuda.synchronize()
    for x in tensors:
        all_reduce(x)
    torch.cuda.synchronize()
    return all(
        torch.equal(x.cpu(), _expected(2, call, numel, dtype))
        for call, ((numel, dtype), x) in enumerate(zip(plan, tensors))
    )


def test_long_runs_of_queued_calls_keep_their_data_apart():
    assert all(run_ranks(_back_to_back, 2, device_type="cuda", timeout_s=600))


def _left_waiting(rank: int) -> float:
    """Rank 1 never joins the call: rank 0 waits until its host aborts (as the engine's monitor thread
    does when a rank dies)."""
    from fitserve.distributed.parallel_state import tp

    custom = tp().custom_all_reduce
    if rank == 1:
        return 0.0
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    custom(x)
    time.sleep(1.0)
    started = time.perf_counter()
    custom.abort()
    torch.cuda.synchronize()  # returns: the kernel stopped waiting
    return time.perf_counter() - started


def test_a_wait_for_a_missing_rank_ends_when_aborted():
    waited, _ = run_ranks(_left_waiting, 2, device_type="cuda", timeout_s=120)
    assert waited < 10.0


def _times_out(rank: int) -> str:
    from fitserve.distributed.parallel_state import tp

    custom = tp().custom_all_reduce
    if rank == 1:
        return ""
    custom.timeout_ns = int(0.5e9)
    x = torch.ones(4096, dtype=torch.bfloat16, device="cuda")
    custom(x)
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:  # the trap: this process's CUDA context is gone, as after an NCCL timeout
        return str(error)
    return "no error"


def test_a_wait_past_the_timeout_fails_instead_of_hanging():
    message, _ = run_ranks(_times_out, 2, device_type="cuda", timeout_s=120)
    assert "CUDA error" in message, message


def _fused_norms(rank: int) -> list[bool]:
    """The all-reduce + residual add + RMSNorm kernel against the all-reduce followed by kernels/norm.py's
    fused_add_rms_norm, bit for bit: rows 1 to 64, hidden sizes of the 8B and 70B shapes and one not a power
    of two, bf16 and fp16."""
    from fitserve.distributed.parallel_state import tp
    from fitserve.kernels.norm import fused_add_rms_norm

    exact = []
    call = 0
    for rows, hidden, dtype in [
        (1, 4096, torch.bfloat16),
        (3, 5120, torch.bfloat16),
        (16, 8192, torch.bfloat16),
        (64, 4096, torch.float16),
        (1, 8192, torch.float16),
    ]:
        for _ in range(3):
            call += 1
            partial = _values(rank, call, rows * hidden, dtype).view(rows, hidden).cuda()
            # the same residual on every rank
            residual = _values(99, call, rows * hidden, dtype).view(rows, hidden).cuda()
            weight = (_values(98, call, hidden, dtype).float() * 0.1 + 1).to(dtype).cuda()
            assert tp().custom_all_reduce.takes_norm(partial, residual, weight)
            summed = _expected(2, call, rows * hidden, dtype).view(rows, hidden).cuda()
            want_normed, want_residual = fused_add_rms_norm(summed, residual.clone(), weight, 1e-5)
            normed, new_residual = tp().custom_all_reduce.add_rms_norm(partial, residual, weight, 1e-5)
            exact.append(bool(torch.equal(normed, want_normed) and torch.equal(new_residual, want_residual)))
    return exact


def test_the_fused_all_reduce_and_norm_equals_the_two_kernels():
    for exact in run_ranks(_fused_norms, 2, device_type="cuda"):
        assert exact and all(exact), f"{exact.count(False)} of {len(exact)} rows differ"
