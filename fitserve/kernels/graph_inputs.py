"""A decode step's inputs copied into a CUDA graph's static buffers in one launch.

A captured decode graph reads fixed buffers: token ids, positions, KV slots, context lengths and block
tables. Copying a step's inputs in took five copies, plus two index kernels writing in the tokens
still in flight (asynchronous scheduling: the previous step's sampled ids, on the device), plus fills
of the padded rows: ~7 launches, each ~2.5 us on the device and ~5 us on the host, for a few KB.

Here one program per row of the padded batch does all of it. Rows below `batch` copy their inputs;
a row whose token is in flight carries -1 as its token id and is written from `last_sampled` by the
program that handles its fill entry instead, so no two programs write one place. Padded rows get slot
0 (the null block), context length 1 and a zeroed block-table row, as the graph's capture expects.

Reference: CudaGraphRunner's torch copies (fitserve/worker/cuda_graphs.py, `copy_inputs_torch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fitserve.kernels.fast_launch import fast_launch

BLOCK_COLUMNS = 128


@fast_launch
# Per-step values, not specialized on: a width of 1 or a multiple of 16 would compile another variant
# mid-serving (tests/gpu/test_no_runtime_compiles.py).
@triton.jit(do_not_specialize=["stride_tables_src", "batch", "width", "num_fills"])
def _stage_decode_inputs_kernel(
    ids_src,
    positions_src,
    slots_src,
    seq_lens_src,
    tables_src,
    stride_tables_src,
    fill_rows,
    fill_sources,
    last_sampled,
    num_fills,
    ids_dst,
    positions_dst,
    slots_dst,
    seq_lens_dst,
    tables_dst,
    stride_tables_dst,
    batch,
    width,
    dst_width,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    columns = tl.arange(0, BLOCK)
    if row < batch:
        token = tl.load(ids_src + row)
        if token >= 0:
            tl.store(ids_dst + row, token)
        tl.store(positions_dst + row, tl.load(positions_src + row))
        tl.store(slots_dst + row, tl.load(slots_src + row))
        tl.store(seq_lens_dst + row, tl.load(seq_lens_src + row))
        for start in range(0, width, BLOCK):
            mask = start + columns < width
            blocks = tl.load(tables_src + row64 * stride_tables_src + start + columns, mask=mask)
            tl.store(tables_dst + row64 * stride_tables_dst + start + columns, blocks, mask=mask)
    else:
        tl.store(slots_dst + row, 0)
        tl.store(seq_lens_dst + row, 1)
        for start in range(0, dst_width, BLOCK):
            mask = start + columns < dst_width
            zeros = tl.zeros([BLOCK], dtype=tables_dst.dtype.element_ty)
            tl.store(tables_dst + row64 * stride_tables_dst + start + columns, zeros, mask=mask)
    if row < num_fills:
        target = tl.load(fill_rows + row)
        tl.store(ids_dst + target, tl.load(last_sampled + tl.load(fill_sources + row)))


def stage_decode_inputs(
    sources: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    padded_size: int,
    fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """sources: (token ids with -1 where a token is in flight, positions, slots, seq_lens, block
    tables [batch, width]); targets: the graph's static buffers, the same five, at least padded_size
    rows; fill: (rows, source indices, last_sampled) for the in-flight tokens, or None."""
    ids, positions, slots, seq_lens, tables = sources
    ids_dst, positions_dst, slots_dst, seq_lens_dst, tables_dst = targets
    batch, width = tables.shape
    if not batch <= padded_size <= ids_dst.shape[0] or width > tables_dst.shape[1]:
        raise ValueError(
            f"a batch of {batch} rows x {width} blocks padded to {padded_size} does not fit graph buffers "
            f"of {ids_dst.shape[0]} rows x {tables_dst.shape[1]} blocks"
        )
    if tables.stride(1) != 1 or tables_dst.stride(1) != 1:
        raise ValueError(
            f"block tables must have contiguous rows (column stride 1); got strides {tables.stride()} and "
            f"{tables_dst.stride()}: pass .contiguous() tables"
        )
    fill_rows, fill_sources, last_sampled = fill if fill is not None else (ids, ids, ids)
    num_fills = fill_rows.shape[0] if fill is not None else 0
    _stage_decode_inputs_kernel[(padded_size,)](
        ids,
        positions,
        slots,
        seq_lens,
        tables,
        tables.stride(0),
        fill_rows,
        fill_sources,
        last_sampled,
        num_fills,
        ids_dst,
        positions_dst,
        slots_dst,
        seq_lens_dst,
        tables_dst,
        tables_dst.stride(0),
        batch,
        width,
        tables_dst.shape[1],
        BLOCK=BLOCK_COLUMNS,
        num_warps=1,
    )
