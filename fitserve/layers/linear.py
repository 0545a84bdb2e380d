"""Linear layers whose parameters know how to load themselves from a checkpoint.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`. A packed layer (q/k/v in one
matrix, gate/up in one matrix) takes each checkpoint tensor with its shard id and copies it into its rows;
the model maps checkpoint names to (parameter, shard id) and never touches the rows itself.

The classes are named for the split a tensor-parallel run gives them (column: output rows split across
ranks; row: input columns split, results summed). Today every rank holds the whole matrix (tensor-parallel
size 1), so each forward is one matmul. How the weights are created and applied is a `LinearMethod`:
the unquantized one below is the default; a quantized method creates its own parameters (with their own
weight loaders) and its own `apply`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

ShardId = int | str


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copies a checkpoint tensor into `param` (or a view of it), casting its dtype; shapes must match."""
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)} but the parameter expects "
            f"{tuple(param.shape)}: the checkpoint does not match the model's config.json"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)


def _set_weight_loader(param: nn.Parameter, loader: object) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class LinearMethod(Protocol):
    """Creates a linear layer's parameters and computes its output."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool) -> None: ...

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """A dense weight [output_size, input_size] in the default dtype, and an optional bias."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        _set_weight_loader(layer.weight, layer.weight_loader)
        if bias:
            layer.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            _set_weight_loader(layer.bias, layer.weight_loader)
        else:
            layer.register_parameter("bias", None)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b). Subclasses say how checkpoint shards land in the output rows."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, linear_method: LinearMethod | None = None
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.linear_method: LinearMethod = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, input_size, output_size, bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not packed: it takes no shard id (got {shard_id!r})")
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ColumnParallelLinear(LinearBase):
    """A linear layer whose output rows a tensor-parallel run splits across ranks."""


class RowParallelLinear(LinearBase):
    """A linear layer whose input columns a tensor-parallel run splits (outputs summed across ranks)."""


class PackedColumnLinear(ColumnParallelLinear):
    """Column linears stacked along the output rows; `shard_offsets` maps shard id -> (start, size)."""

    def __init__(
        self,
        input_size: int,
        shard_offsets: dict[ShardId, tuple[int, int]],
        bias: bool,
        linear_method: LinearMethod | None = None,
    ) -> None:
        self.shard_offsets = shard_offsets
        output_size = sum(size for _, size in shard_offsets.values())
        super().__init__(input_size, output_size, bias, linear_method)

    @property
    def shard_ids(self) -> tuple[ShardId, ...]:
        return tuple(self.shard_offsets)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is None:  # a checkpoint that already stores the packed matrix
            default_weight_loader(param, loaded_weight)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"shard id {shard_id!r} is not one of {list(self.shard_offsets)} for {type(self).__name__}"
            )
        start, size = self.shard_offsets[shard_id]
        default_weight_loader(param.narrow(0, start, size), loaded_weight)


class MergedColumnParallelLinear(PackedColumnLinear):
    """Column linears of sizes `output_sizes` in one matrix; shard id i is the i-th (gate=0, up=1)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        linear_method: LinearMethod | None = None,
    ) -> None:
        offsets: dict[ShardId, tuple[int, int]] = {}
        start = 0
        for index, size in enumerate(output_sizes):
            offsets[index] = (start, size)
            start += size
        super().__init__(input_size, offsets, bias, linear_method)


class QKVParallelLinear(PackedColumnLinear):
    """Query, key and value projections in one matrix: rows [q | k | v], shard ids "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        linear_method: LinearMethod | None = None,
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        offsets: dict[ShardId, tuple[int, int]] = {
            "q": (0, self.q_size),
            "k": (self.q_size, self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size),
        }
        super().__init__(hidden_size, offsets, bias, linear_method)
