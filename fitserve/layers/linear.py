"""Linear layers whose parameters know how to load themselves from a checkpoint.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`. A packed layer (q/k/v in one
matrix, gate/up in one matrix) takes each checkpoint tensor with its shard id and copies it into its rows;
the model maps checkpoint names to (parameter, shard id) and never touches the rows itself.

The classes are named for the split a tensor-parallel run gives them (column: output rows split across
ranks; row: input columns split, results summed over the ranks, layers/tp_shards.py). A layer reads its
rank as it is built (distributed/parallel_state.py): its parameters hold that rank's part, and its weight
loaders take whole checkpoint tensors and copy in that part. How the weights are created and applied is a
`LinearMethod`:
the unquantized one below is the default; a quantized method creates its own parameters (with their own
weight loaders) and its own `apply`.

Once a layer's whole weight is loaded (every shard of a packed one), its method's
`process_weights_after_loading` may store it in another form for the device. On the CPU, a matrix
made of 4-bit groups (a converted Q4 GGUF's) becomes int4 (cpu/int4_linear.py); a float32 one keeps
its values in a transposed memory layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fitserve.distributed.collectives import all_reduce
from fitserve.distributed.parallel_state import tp
from fitserve.layers.tp_shards import first_kv_head, kv_heads_per_rank, rank_rows, split_evenly

ShardId = int | str
# kernels/skinny_gemm.MAX_ROWS and kernels/swapped_gemm.MAX_ROWS, repeated so that this module imports
# without Triton (CPU builds).
SKINNY_MAX_ROWS = 16
SWAPPED_MAX_ROWS = 32
# Off: the weights kernels/skinny_split_gemm.py takes (`takes_weight`: at most 2,048 output features) stay
# on cuBLAS at <= 16 rows (for comparisons: benchmarks, tests).
SMALL_WEIGHT_SPLIT_K = True


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copies a checkpoint tensor into `param` (or a view of it), casting its dtype; shapes must match."""
    check_loaded_shape(param.shape, loaded_weight)
    with torch.no_grad():
        param.copy_(loaded_weight)


def check_loaded_shape(expected: torch.Size, loaded_weight: torch.Tensor) -> None:
    if expected != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)} but the parameter expects "
            f"{tuple(expected)}: the checkpoint does not match the model's config.json"
        )


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias), in x's dtype, then widened to out_dtype if given: a decode step's few rows
    on the GPU stream the weight through fitserve's own kernels (faster than cuBLAS there): up to 16
    rows kernels/skinny_gemm.py, or kernels/skinny_split_gemm.py (split over K) for weights of at
    most 2,048 output features; up to 32 kernels/swapped_gemm.py; everything else is F.linear. Each
    kernel's `worth_it` says which shapes it takes."""
    out = None
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= SWAPPED_MAX_ROWS:
        if x.shape[0] <= SKINNY_MAX_ROWS:
            from fitserve.kernels import skinny_gemm, skinny_split_gemm

            if skinny_gemm.worth_it(x, weight):
                out = skinny_gemm.skinny_gemm(x, weight, bias)
            elif SMALL_WEIGHT_SPLIT_K and skinny_split_gemm.worth_it(x, weight):
                out = skinny_split_gemm.skinny_split_gemm(x, weight, bias)
        else:
            from fitserve.kernels.swapped_gemm import swapped_gemm, worth_it

            if worth_it(x, weight):
                out = swapped_gemm(x, weight, bias)
    if out is None:
        out = F.linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


class WholeTensor(NamedTuple):
    """One tensor of a parameter as a checkpoint holds it, whole (every rank's part of it): what
    --load-format dummy draws (models/weights.py), so that the model is the same at every tensor-parallel
    size. `key` names it within its module ("weight", a packed layer's "weight.q", one expert's
    "gate_up_proj.3"); `load(whole)` copies this rank's part into the parameter, cut as a real
    checkpoint tensor is (without the layer's post-load step); `into` is the view of the parameter that
    holds all of it when this rank does (drawn there in place, no copy), else None."""

    param: nn.Parameter
    key: str
    shape: tuple[int, ...]
    load: Callable[[torch.Tensor], None]
    into: torch.Tensor | None


def whole_tensor(
    param: nn.Parameter,
    key: str,
    shape: tuple[int, ...],
    target: torch.Tensor,
    cut: Callable[[torch.Tensor], torch.Tensor],
) -> WholeTensor:
    """A WholeTensor whose rank part `cut(whole)` lands in `target` (`param` or a view of it); the rank
    holds all of it where the two shapes agree (a cut of the whole's own size is the whole)."""

    def load(whole: torch.Tensor) -> None:
        default_weight_loader(target, cut(whole))

    return WholeTensor(param, key, shape, load, target if tuple(target.shape) == shape else None)


def _set_weight_loader(param: nn.Parameter, loader: object) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


class LinearMethod(Protocol):
    """Creates a linear layer's parameters and computes its output."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool) -> None: ...

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor: ...

    def process_weights_after_loading(self, layer: LinearBase) -> None: ...


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
        return dense_linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """On the CPU: a weight of 4-bit groups is packed as int4 and the layer applies it as such; a
        float32 weight keeps its values but is stored transposed ([in, out] in memory, the same [out, in]
        tensor to every reader), the layout whose GEMM MKL runs ~2x faster for a few rows (a batch of
        decode steps) on 2 threads, and no slower for 1 or hundreds."""
        if not _owns_cpu_storage(layer.weight):
            return
        from fitserve.layers.cpu.int4_linear import convert_to_int4

        held = layer.take_held_weight()
        int4_method = convert_to_int4(layer, held)
        if int4_method is not None:
            layer.linear_method = int4_method
            return
        if held is not None:  # not 4-bit groups: the float32 weight after all
            with torch.no_grad():
                layer.weight.copy_(held)
        if layer.weight.dtype == torch.float32 and layer.weight.dim() == 2:
            layer.weight.data = layer.weight.data.t().contiguous().t()


def _owns_cpu_storage(weight: torch.Tensor) -> bool:
    """A CPU tensor that is its own storage, not a view of a larger buffer (as --cpu-offload-gb makes
    an offloaded layer's parameters, which must keep their shape and dtype)."""
    return (
        weight.device.type == "cpu"
        and weight.storage_offset() == 0
        and weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    )


class LinearBase(nn.Module):
    """y = x W^T (+ b). Subclasses say how checkpoint shards land in the output rows."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, linear_method: LinearMethod | None = None
    ) -> None:
        """input_size and output_size are the whole matrix's; the parameters hold this rank's part
        (input_size_per_rank x output_size_per_rank)."""
        super().__init__()
        state = tp()
        self.tp_rank, self.tp_size = state.rank, state.size
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank, self.output_size_per_rank = self._rank_sizes()
        self.linear_method: LinearMethod = linear_method or UnquantizedLinearMethod()
        if self.tp_size > 1 and not getattr(self.linear_method, "splits_for_tensor_parallel", True):
            raise ValueError(
                f"{type(self.linear_method).__name__} weights do not split across ranks yet: run this "
                "checkpoint with --tensor-parallel-size 1, or an unquantized (bf16/fp16) checkpoint with "
                f"--tensor-parallel-size {self.tp_size}"
            )
        self.linear_method.create_weights(self, self.input_size_per_rank, self.output_size_per_rank, bias)
        self._loaded_shards: set[ShardId | None] = set()
        # Checkpoint tensors (or shards) of the weight held as loaded until the weight is whole; see
        # `_holds`.
        self._held: dict[ShardId | None, torch.Tensor] = {}

    def _rank_sizes(self) -> tuple[int, int]:
        """(input, output) sizes of this rank's part: the whole matrix unless a subclass splits it."""
        return self.input_size, self.output_size

    def rank_part(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> torch.Tensor:
        """The part of a whole checkpoint tensor this rank's `param` holds (all of it unless split)."""
        return loaded_weight

    @property
    def shard_ids(self) -> tuple[ShardId, ...]:
        return ()

    def whole_tensors(self) -> list[WholeTensor]:
        """The weight as a checkpoint holds it ([output_size, input_size], this rank's part cut by
        `rank_part`), for dummy weights; none for a quantized method's weight (its `initialize_dummy`
        draws it) and none for the bias (dummy biases are 0)."""
        if not isinstance(self.linear_method, UnquantizedLinearMethod):
            return []
        weight = self.weight
        shape = (self.output_size, self.input_size)
        return [whole_tensor(weight, "weight", shape, weight, lambda whole: self.rank_part(weight, whole))]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not packed: it takes no shard id (got {shard_id!r})")
        self._check_loadable(param)
        loaded_weight = self.rank_part(param, loaded_weight)
        if self._holds(param, loaded_weight):
            check_loaded_shape(param.shape, loaded_weight)
            self._held[None] = loaded_weight
        else:
            default_weight_loader(param, loaded_weight)
        self._after_load(param, shard_id)

    def _holds(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> bool:
        """Whether a checkpoint tensor of the weight is held as loaded instead of copied in: a bfloat16
        checkpoint's matrix for a float32 weight on the CPU (a converted GGUF's, say). Once the weight is
        whole it is packed as int4 straight from the held tensors when it is 4-bit groups, and copied into
        the float32 weight only when it is not: the default model's 106 M projection weights skip a
        float32 copy (about 0.8 s of its start on 2 cores, and 0.4 GB of memory) that packing discards."""
        return (
            param is self.weight
            and loaded_weight.dtype == torch.bfloat16
            and param.dtype == torch.float32
            and loaded_weight.device.type == "cpu"
            and isinstance(self.linear_method, UnquantizedLinearMethod)
            and _owns_cpu_storage(param)
        )

    def take_held_weight(self) -> torch.Tensor | None:
        """The held checkpoint tensors as the whole weight (bfloat16 [out, in]), forgotten here; None
        when the weight was copied in as it loaded."""
        held, self._held = self._held, {}
        if not held:
            return None
        if None in held:
            return held[None]
        whole = torch.empty(self.weight.shape, dtype=torch.bfloat16)
        for shard_id, tensor in held.items():
            start, size = self.shard_offsets[shard_id]  # type: ignore[attr-defined]
            whole.narrow(0, start, size).copy_(tensor)
        return whole

    def _check_loadable(self, param: nn.Parameter) -> None:
        repacked = not isinstance(self.linear_method, UnquantizedLinearMethod)
        if (param is not self.weight and param is not self.bias) or (repacked and param is self.weight):
            raise ValueError(
                f"{type(self).__name__}'s weight was already loaded and repacked "
                f"({type(self.linear_method).__name__}): a checkpoint must hold each tensor once"
            )

    def _after_load(self, param: nn.Parameter, shard_id: ShardId | None) -> None:
        """Runs the method's post-load step once the weight is whole: its one tensor, or every shard."""
        if param is not self.weight:
            return
        self._loaded_shards.add(shard_id)
        if None in self._loaded_shards or self._loaded_shards >= set(self.shard_ids):
            self._loaded_shards.clear()
            process = getattr(self.linear_method, "process_weights_after_loading", None)
            if process is not None:
                process(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A linear layer every tensor-parallel rank holds whole (a router, a small projection whose output
    every rank needs): no split, no communication."""


class ColumnParallelLinear(LinearBase):
    """A linear layer whose output rows a tensor-parallel run splits across ranks: each rank computes
    its slice of the output, no communication."""

    def _rank_sizes(self) -> tuple[int, int]:
        return self.input_size, split_evenly(self.output_size, self.tp_size, f"{type(self).__name__}'s rows")

    def rank_part(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return loaded_weight
        size = self.output_size_per_rank
        return rank_rows(loaded_weight, 0, self.tp_rank * size, size)


class RowParallelLinear(LinearBase):
    """A linear layer whose input columns a tensor-parallel run splits: each rank multiplies its slice
    of the input (the column-parallel layer before it left it there) and the ranks' outputs are summed.
    The bias is added once: only the first rank holds it, the others hold zeros."""

    def _rank_sizes(self) -> tuple[int, int]:
        return split_evenly(
            self.input_size, self.tp_size, f"{type(self).__name__}'s columns"
        ), self.output_size

    def rank_part(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return loaded_weight
        if param is self.bias:
            return loaded_weight if self.tp_rank == 0 else torch.zeros_like(loaded_weight)
        size = self.input_size_per_rank
        return rank_rows(loaded_weight, loaded_weight.dim() - 1, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """This rank's x @ W.T summed over the ranks; reduce=False leaves this rank's partial sum to the
        layer after it (RMSNorm.forward_sum adds it up with the norm)."""
        out = self.linear_method.apply(self, x)
        return all_reduce(out) if reduce else out


class PackedColumnLinear(ColumnParallelLinear):
    """Column linears stacked along the output rows; `shard_offsets` maps shard id -> (start, size)."""

    def __init__(
        self,
        input_size: int,
        shard_offsets: dict[ShardId, tuple[int, int]],
        bias: bool,
        linear_method: LinearMethod | None = None,
        rank_offsets: dict[ShardId, tuple[int, int]] | None = None,
    ) -> None:
        """shard_offsets: each shard's rows in the whole matrix; rank_offsets: in this rank's part (each
        shard split evenly unless given)."""
        self.full_shard_offsets = shard_offsets
        size = tp().size
        if rank_offsets is None:
            rank_offsets, start = {}, 0
            for shard_id, (_, rows) in shard_offsets.items():
                per_rank = split_evenly(rows, size, f"shard {shard_id!r}'s rows")
                rank_offsets[shard_id] = (start, per_rank)
                start += per_rank
        self.shard_offsets = rank_offsets
        output_size = sum(rows for _, rows in shard_offsets.values())
        super().__init__(input_size, output_size, bias, linear_method)

    def _rank_sizes(self) -> tuple[int, int]:
        return self.input_size, sum(rows for _, rows in self.shard_offsets.values())

    @property
    def shard_ids(self) -> tuple[ShardId, ...]:
        return tuple(self.shard_offsets)

    def shard_rank_rows(self, shard_id: ShardId) -> tuple[int, int]:
        """(start, size): the rows of a checkpoint's whole `shard_id` tensor that this rank holds."""
        size = self.shard_offsets[shard_id][1]
        return self.tp_rank * size, size

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None = None
    ) -> None:
        self._check_loadable(param)
        if shard_id is not None and shard_id not in self.shard_offsets:
            raise ValueError(
                f"shard id {shard_id!r} is not one of {list(self.shard_offsets)} for {type(self).__name__}"
            )
        if shard_id is None and self.tp_size > 1:
            # a checkpoint that stores the packed matrix: each shard's rows, then this rank's part of each
            for packed_id, (start, rows) in self.full_shard_offsets.items():
                self.weight_loader(param, loaded_weight.narrow(0, start, rows), packed_id)
            return
        target, loaded_weight = self._shard_part(param, loaded_weight, shard_id)
        if self._holds(param, loaded_weight):
            check_loaded_shape(target.shape, loaded_weight)
            self._held[shard_id] = loaded_weight
        else:
            default_weight_loader(target, loaded_weight)
        self._after_load(param, shard_id)

    def _shard_part(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows of `param` that shard `shard_id` fills, this rank's rows of its whole checkpoint
        tensor); shard None: a checkpoint that already stores the (rank's) packed matrix, all of param."""
        if shard_id is None:
            return param, loaded_weight
        if self.tp_size > 1:
            loaded_weight = rank_rows(loaded_weight, 0, *self.shard_rank_rows(shard_id))
        return param.narrow(0, *self.shard_offsets[shard_id]), loaded_weight

    def whole_tensors(self) -> list[WholeTensor]:
        """Each shard's whole checkpoint tensor ([its rows, input_size]: q, k, v or gate, up), cut as
        `weight_loader` cuts it with that shard id."""
        if not isinstance(self.linear_method, UnquantizedLinearMethod):
            return []
        weight, tensors = self.weight, []
        for shard_id, (_, rows) in self.full_shard_offsets.items():
            target = weight.narrow(0, *self.shard_offsets[shard_id])

            def cut(whole: torch.Tensor, shard_id: ShardId = shard_id) -> torch.Tensor:
                return self._shard_part(weight, whole, shard_id)[1]

            tensors.append(whole_tensor(weight, f"weight.{shard_id}", (rows, self.input_size), target, cut))
        return tensors


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
    """Query, key and value projections in one matrix: rows [q | k | v] of this rank's heads, shard ids
    "q", "k", "v". `shards` leaves some out: Gemma-4's full layers with attention_k_eq_v have no v (the
    values are the keys' projection), its KV-shared layers only q."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        linear_method: LinearMethod | None = None,
        shards: tuple[str, ...] = ("q", "k", "v"),
    ) -> None:
        state = tp()
        self.num_heads = split_evenly(num_heads, state.size, "the number of attention heads")
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, state.size)
        self.first_kv_head = first_kv_head(num_kv_heads, state.rank, state.size)
        self.head_dim = head_dim
        # this rank's sizes
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        whole = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        mine = {"q": self.q_size, "k": self.kv_size, "v": self.kv_size}
        offsets: dict[ShardId, tuple[int, int]] = {}
        rank_offsets: dict[ShardId, tuple[int, int]] = {}
        start = rank_start = 0
        for shard in shards:
            offsets[shard] = (start, whole[shard])
            rank_offsets[shard] = (rank_start, mine[shard])
            start, rank_start = start + whole[shard], rank_start + mine[shard]
        super().__init__(hidden_size, offsets, bias, linear_method, rank_offsets)

    def shard_rank_rows(self, shard_id: ShardId) -> tuple[int, int]:
        if shard_id == "q":
            return self.tp_rank * self.q_size, self.q_size
        return self.first_kv_head * self.head_dim, self.kv_size
