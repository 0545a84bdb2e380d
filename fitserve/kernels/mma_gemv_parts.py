"""Gluon pieces the register-fed tensor-core GEMMs for a few rows share (kernels/int4_mma_gemv.py,
kernels/nf4_mma_gemv.py): index tensors of many-dimensional tiles, the programmatic-dependent-launch wait
(kernels/dependent_launch.py's, for Gluon), and the end of every program (y's
tile written, or with split-K the partials summed in split order by the program that arrives last at
the tile's counter: deterministic, no host sync, the counter left at zero for the next call)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def _only_dim(layout, dim, rank):
    """`layout` with every dim but `dim` sliced away (the layout of an arange along `dim`)."""
    for other in reversed(range(rank)):
        if other != dim:
            layout = gl.SliceLayout(other, layout)
    return layout


@gluon.jit
def _index(SIZE: gl.constexpr, DIM: gl.constexpr, RANK: gl.constexpr, layout: gl.constexpr):
    """0..SIZE-1 along DIM of a RANK-d tensor in `layout` (size 1 along every other dim)."""
    index = gl.arange(0, SIZE, layout=_only_dim(layout, DIM, RANK))
    for other in gl.static_range(RANK):
        if other != DIM:
            index = gl.expand_dims(index, other)
    return index


@gluon.jit
def _write_out(acc, offs_n, offs_m, M, N, y_ptr, stride_ym, bias_ptr, HAS_BIAS: gl.constexpr):
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    y = y_ptr + offs_m.to(gl.int64)[None, :] * stride_ym + offs_n[:, None]
    gl.store(y, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_m < M)[None, :])


@gluon.jit
def _finish(acc, pid_n, pid_k, M, N, y_ptr, stride_ym, bias_ptr, part_ptr, counter, num_splits,
            BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
            layout: gl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_M] (y's tile, transposed) to y, or with split-K: this split's partial to the
    workspace [splits, M, N] and, in the program that arrives last at the tile's counter, the sum of
    all partials in split order."""
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
    if SPLIT:
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        part = part_ptr + offs_m.to(gl.int64)[None, :] * N + offs_n[:, None]
        gl.store(part + pid_k * M * N, acc, mask=mask)
        gl.thread_barrier()  # every thread's partial is written before the release below
        arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            total = gl.zeros_like(acc)
            for split in range(0, num_splits):
                total += gl.load(part + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _write_out(total, offs_n, offs_m, M, N, y_ptr, stride_ym, bias_ptr, HAS_BIAS)
            gl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next call
    else:
        _write_out(acc, offs_n, offs_m, M, N, y_ptr, stride_ym, bias_ptr, HAS_BIAS)


@gluon.jit
def _wait_for_previous_kernel(USE_PDL: gl.constexpr):
    """With PDL: wait until the kernel before has finished (its writes visible), then let the next one
    launch. Everything before the call may only read what no kernel of the step writes (the weights)."""
    if USE_PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
