"""The sum of a small tensor over the GPUs of one machine, in one kernel: each rank pushes its values into
every rank's buffer over NVLink (or PCIe peer access), raises a flag there, waits for every rank's flag in
its own memory and sums what arrived, in rank order.

A decode step of a tensor-parallel model sums a few KB after every attention and MLP block (65 times a
step for Llama-3.1-8B). NCCL's ring kernel takes ~6 us a call on an H200 inside a CUDA graph, and as a kernel
launched without programmatic dependent launch it also leaves the GPU idle ~2 us before it starts
(benchmarks/gpu/tp_step_profile.py). Here one launch carries one flag round trip between the GPUs, and
the kernel is launched with PDL like fitserve's others.

Layout (distributed/custom_all_reduce.py allocates it in symmetric memory, the same offsets on every rank):
- `data`: 2 parities x WORLD source ranks x SLOT elements. The message is cut in CHUNK-element pieces;
  program p owns piece p on every rank (elements p*CHUNK .. +CHUNK of the message), always at the same
  offset, whatever the message's length.
- `flags`: MAX_PROGRAMS x WORLD int64; rank s sets flags[p, s] on every rank to the epoch of its call once
  its piece p is there.
- `counters` (local, not shared): the epoch of each program's last call. Every rank runs the same calls in
  the same order, and program p runs in a call exactly when piece p exists, so program p's counter is the
  same on every rank: the epoch it computes (counter + 1) is the one its peers compute.

Why two parities: rank r may start its next call while a peer still reads this one (a rank finishes
as soon as its own pieces arrived). Call e writes parity e % 2; a rank cannot reach call e + 2 before
every peer finished call e (it needs their flags of call e + 1, raised only after their call e), so the
parity it writes is never one a peer still reads. Epochs only grow (int64), so a flag left from an
earlier call never satisfies a later wait.

Ordering: a program's threads store their values to the peers, meet at a barrier, and one thread raises
each peer's flag with a release atomic at system scope; the waiting side reads its flags with acquire
atomics at system scope, meets at a barrier, then reads the data (volatile loads: not served from L1).

The sum runs in rank order in float32 on every rank, so every rank gets the same bits (the ranks must
agree exactly: each then computes the same next layer). A peer that never arrives: the wait ends when
the host sets `abort` (a rank died: distributed/custom_all_reduce.py) or at the deadline (the collective
timeout, FITSERVE_DIST_TIMEOUT_S), which traps, so the process sees a CUDA error instead of hanging.
Reference: torch.distributed.all_reduce (NCCL).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.dependent_launch import pdl_kwargs, wait_for_previous_kernel
from fitserve.kernels.fast_launch import fast_launch
from fitserve.kernels.grid_math import cdiv, next_power_of_2

# Elements of a piece (one program): 1024 x 16-bit = 2 KB, 8 values a thread at 4 warps.
CHUNK = 1024
# Pieces a call may have: messages of up to MAX_PROGRAMS * CHUNK elements.
MAX_PROGRAMS = 512
# Ranks the kernel takes pointers for.
MAX_WORLD = 8
# Polls of the flags between two looks at the abort word and the clock.
POLLS_PER_CHECK = 64


@triton.jit
def _pick(i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """p<i>, chosen while compiling."""
    chosen = p0
    if i == 1:
        chosen = p1
    if i == 2:
        chosen = p2
    if i == 3:
        chosen = p3
    if i == 4:
        chosen = p4
    if i == 5:
        chosen = p5
    if i == 6:
        chosen = p6
    if i == 7:
        chosen = p7
    return chosen


@triton.jit
def _global_time_ns():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _trap():
    tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _exchange(
    values,
    offsets,
    mask,
    pid,
    epoch,
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,
    d6,
    d7,
    f0,
    f1,
    f2,
    f3,
    f4,
    f5,
    f6,
    f7,
    abort_ptr,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    WORLD_POW2: tl.constexpr,
    SLOT: tl.constexpr,
    POLLS_PER_CHECK: tl.constexpr,
):
    """Program pid's part of one call (its `epoch`): pushes `values` to every rank at `offsets` of this
    rank's slot of parity epoch % 2, raises its flag there, waits for every rank's flag in its own memory,
    and returns the float32 sum of what arrived, in rank order (the same bits on every rank)."""
    parity = epoch % 2
    mine = (parity * WORLD + RANK) * SLOT + offsets  # this rank's piece, at the same offset on every rank
    for peer in tl.static_range(WORLD):
        tl.store(_pick(peer, d0, d1, d2, d3, d4, d5, d6, d7) + mine, values, mask=mask)
    tl.debug_barrier()  # every thread's stores before the flags
    for peer in tl.static_range(WORLD):
        flag = _pick(peer, f0, f1, f2, f3, f4, f5, f6, f7) + pid * WORLD + RANK
        tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    # one acquire load a rank, all at once; the abort word and the clock between bursts of polls
    sources = tl.arange(0, WORLD_POW2)
    own_flags = _pick(RANK, f0, f1, f2, f3, f4, f5, f6, f7) + pid * WORLD + sources
    present = sources < WORLD
    deadline = _global_time_ns() + timeout_ns
    seen = tl.min(
        tl.where(present, tl.atomic_add(own_flags, 0, mask=present, sem="acquire", scope="sys"), epoch)
    )
    late = 0
    while (seen < epoch) & (late == 0):
        polls = 0
        while (seen < epoch) & (polls < POLLS_PER_CHECK):
            flags = tl.atomic_add(own_flags, 0, mask=present, sem="acquire", scope="sys")
            seen = tl.min(tl.where(present, flags, epoch))
            polls += 1
        if tl.load(abort_ptr, volatile=True) != 0:
            late = 1
        if _global_time_ns() > deadline:
            late = 2
    if late == 2:
        _trap()  # a peer never came (the collective timeout): an error the host sees, not a hang
    tl.debug_barrier()  # the flags' acquire before any thread reads the data
    own = _pick(RANK, d0, d1, d2, d3, d4, d5, d6, d7) + parity * WORLD * SLOT + offsets
    total = tl.load(own, mask=mask, volatile=True).to(tl.float32)
    for source in tl.static_range(1, WORLD):
        total += tl.load(own + source * SLOT, mask=mask, volatile=True).to(tl.float32)
    return total


@fast_launch
@triton.jit(do_not_specialize=["timeout_ns"])
def _one_shot_all_reduce_kernel(
    x_ptr,
    n,
    d0,
    d1,
    d2,
    d3,
    d4,
    d5,
    d6,
    d7,
    f0,
    f1,
    f2,
    f3,
    f4,
    f5,
    f6,
    f7,
    counters_ptr,
    abort_ptr,
    timeout_ns,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    SLOT: tl.constexpr,
    CHUNK: tl.constexpr,
    WORLD_POW2: tl.constexpr,
    POLLS_PER_CHECK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    index = pid * CHUNK + tl.arange(0, CHUNK)
    mask = index < n
    wait_for_previous_kernel(USE_PDL)  # x is the previous kernel's output; counters the last call's
    epoch = tl.load(counters_ptr + pid) + 1
    values = tl.load(x_ptr + index, mask=mask)
    total = _exchange(
        values, index, mask, pid, epoch,
        d0, d1, d2, d3, d4, d5, d6, d7, f0, f1, f2, f3, f4, f5, f6, f7,
        abort_ptr, timeout_ns, RANK, WORLD, WORLD_POW2, SLOT, POLLS_PER_CHECK,
    )  # fmt: skip
    tl.store(x_ptr + index, total.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(counters_ptr + pid, epoch)


def peer_pointers(data: list[torch.Tensor], flags: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """The kernels' d0..d7 and f0..f7 arguments: every rank's data and flags, then this rank's own in the
    places of the ranks a smaller world lacks (never read: WORLD bounds every loop)."""
    spare = MAX_WORLD - len(data)
    return [*data, *[data[rank]] * spare, *flags, *[flags[rank]] * spare]


def one_shot_all_reduce(
    x: torch.Tensor,
    rank: int,
    data: list[torch.Tensor],
    flags: list[torch.Tensor],
    counters: torch.Tensor,
    abort: torch.Tensor,
    timeout_ns: int,
) -> torch.Tensor:
    """Sums contiguous x over the ranks in place and returns it. `data[s]` and `flags[s]`: rank s's data
    region (in x's dtype, 2 x world x MAX_PROGRAMS * CHUNK elements) and flags (int64, MAX_PROGRAMS x world)
    as this rank addresses them; `counters` (int64, MAX_PROGRAMS) and `abort` (int32, 1) this rank's own."""
    world = len(data)
    pieces = cdiv(x.numel(), CHUNK)
    if not 1 <= world <= MAX_WORLD or pieces > MAX_PROGRAMS or not x.is_contiguous():
        raise ValueError(
            f"one_shot_all_reduce takes contiguous tensors of at most {MAX_PROGRAMS * CHUNK} elements over "
            f"1 to {MAX_WORLD} ranks; got {tuple(x.shape)} (contiguous: {x.is_contiguous()}) over {world}: "
            "use torch.distributed.all_reduce"
        )
    if pieces == 0:
        return x
    _one_shot_all_reduce_kernel[(pieces,)](
        x,
        x.numel(),
        *peer_pointers(data, flags, rank),
        counters,
        abort,
        timeout_ns,
        RANK=rank,
        WORLD=world,
        SLOT=MAX_PROGRAMS * CHUNK,
        CHUNK=CHUNK,
        WORLD_POW2=next_power_of_2(world),
        POLLS_PER_CHECK=POLLS_PER_CHECK,
        num_warps=4,
        **pdl_kwargs(x.device),
    )
    return x
