"""Which part of a WHOLE quantized checkpoint tensor a tensor-parallel rank holds.

A quantized method's loaders receive whole checkpoint tensors (a projection's, with its shard id in a fused
layer). `rank_slice` says which of the tensor's output rows and input columns this rank holds (the split
of layers/linear.py: a column-parallel layer splits the rows, per shard; a row-parallel layer the
columns); `take_rows` and `take_columns` cut them out of a tensor that stores the rows or columns along
`dim`, `per` rows or columns an element (8 codes packed in an int32, a group's one scale). A rank's
columns must start on a group (or block) boundary: `take_columns` refuses, naming the sizes and the fix,
when they do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SMALLER_TP = "use a smaller --tensor-parallel-size (or 1)"


@dataclass(frozen=True)
class RankSlice:
    whole_rows: int  # output rows of the checkpoint tensor (its shard's, or the layer's)
    rows_start: int  # the first of them this rank holds
    rows: int
    whole_columns: int  # input columns of the checkpoint tensor
    columns_start: int  # the first of them this rank holds
    columns: int
    tp_size: int

    @property
    def splits_rows(self) -> bool:
        return self.rows != self.whole_rows

    @property
    def splits_columns(self) -> bool:
        return self.columns != self.whole_columns


def rank_slice(layer: nn.Module, shard_id: object, what: str) -> RankSlice:
    """This rank's rows and columns of checkpoint tensor `what` of shard `shard_id` (None: the layer's)."""
    size = getattr(layer, "tp_size", 1)
    rank = getattr(layer, "tp_rank", 0)
    whole_columns = layer.input_size
    columns = getattr(layer, "input_size_per_rank", whole_columns)
    columns_start = rank * columns if columns != whole_columns else 0
    if shard_id is None:
        if size > 1 and hasattr(layer, "full_shard_offsets"):
            raise ValueError(
                f"{what}: the checkpoint stores the fused projections of a quantized layer as one tensor, "
                "which fitserve does not split across ranks (only separate q/k/v or gate/up projections); "
                "run it with --tensor-parallel-size 1"
            )
        whole_rows = layer.output_size
        rows = getattr(layer, "output_size_per_rank", whole_rows)
        rows_start = rank * rows if rows != whole_rows else 0
    else:
        whole_rows = getattr(layer, "full_shard_offsets", layer.shard_offsets)[shard_id][1]
        rows_start, rows = layer.shard_rank_rows(shard_id) if size > 1 else (0, whole_rows)
    return RankSlice(whole_rows, rows_start, rows, whole_columns, columns_start, columns, size)


def take_rows(tensor: torch.Tensor, dim: int, part: RankSlice, what: str, per: int = 1) -> torch.Tensor:
    """The rank's output rows of `tensor`, stored along `dim`, `per` rows an element (8 in an int32)."""
    if not part.splits_rows:
        return tensor
    if part.rows_start % per or part.rows % per:
        raise ValueError(
            f"{what}: this rank holds output rows [{part.rows_start}, {part.rows_start + part.rows}) of "
            f"{part.whole_rows}, but {per} rows are packed together in the checkpoint: a rank's rows must "
            f"start and end on a multiple of {per}; {SMALLER_TP}"
        )
    return _narrow(tensor, dim, part.rows_start // per, part.rows // per, what)


def take_columns(
    tensor: torch.Tensor, dim: int, part: RankSlice, what: str, per: int = 1, unit: str = "packed codes"
) -> torch.Tensor:
    """The rank's input columns of `tensor`, stored along `dim`, `per` columns an element: 8 packed codes,
    or a group (`unit` names it for the message)."""
    if not part.splits_columns:
        return tensor
    check_columns_align(part, per, what, unit)
    return _narrow(tensor, dim, part.columns_start // per, part.columns // per, what)


def check_columns_align(part: RankSlice, per: int, what: str, unit: str) -> None:
    """ValueError unless the rank's input columns start and end on a multiple of `per`."""
    if part.splits_columns and part.columns % per:
        raise ValueError(
            f"{what}: each rank holds {part.columns} input columns ({part.whole_columns} / "
            f"tensor_parallel_size {part.tp_size}), not a multiple of the {per} columns of {unit}: a rank's "
            f"columns must start on a boundary of {per}; {SMALLER_TP}, one that makes "
            f"{part.whole_columns} / size a multiple of {per}"
        )


def rank_bias(layer: nn.Module, bias: torch.Tensor, part: RankSlice, what: str) -> torch.Tensor:
    """A whole bias -> this rank's: its rows (column-parallel), or all of it on the first rank of a
    row-parallel layer and zeros on the others (the ranks' outputs are summed)."""
    if part.splits_columns:
        return bias if getattr(layer, "tp_rank", 0) == 0 else torch.zeros_like(bias)
    return take_rows(bias, 0, part, what)


def _narrow(tensor: torch.Tensor, dim: int, start: int, size: int, what: str) -> torch.Tensor:
    if start + size > tensor.shape[dim]:
        raise ValueError(
            f"quantized tensor {what} has shape {tuple(tensor.shape)}, this rank reads [{start}, "
            f"{start + size}) along dim {dim}: the checkpoint is truncated or does not match config.json"
        )
    return tensor.narrow(dim, start, size)
