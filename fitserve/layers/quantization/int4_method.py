"""The linear method of a layer an int4 checkpoint stores quantized.

`create_weights` makes one parameter per checkpoint tensor of the format (int4_formats.ParamSpec: qweight,
qzeros, scales, g_idx for GPTQ; ...), sized for the whole layer; a fused layer (q/k/v, gate/up) loads
each projection's tensors into its rows, as the unquantized layers do. Each loader checks the tensor's
shape, naming it, before copying. Once every tensor of every shard is in, the layer's tensors become one
Int4Weight (int4_formats.to_int4_weight), then the form it computes with (int4_cpu.make_runnable), and
the packed checkpoint tensors are dropped.

Under tensor parallel the parameters hold the rank's part and each loader takes it from the whole
checkpoint tensor first (int4_tp.py: output rows of a column-parallel layer, input columns of a
row-parallel one), so the unpack and repack see only the rank's part.

With --load-format dummy no tensor arrives: `initialize_dummy` builds a random Int4Weight
(int4_weight.random_int4_weight) in place of the checkpoint's and makes it runnable the same way.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from fitserve.layers.quantization.int4_cpu import make_runnable
from fitserve.layers.quantization.int4_formats import (
    optional_params,
    pack_zero_point_rows,
    param_specs,
    to_int4_weight,
)
from fitserve.layers.quantization.int4_tp import (
    act_order_groups,
    check_rank_columns,
    keeps_all_groups,
    rank_part,
    rank_specs,
    select_groups,
)
from fitserve.layers.quantization.int4_weight import Int4Weight, random_int4_weight
from fitserve.layers.quantization.method_base import QuantizedLinearMethod
from fitserve.layers.quantization.placement import run_device
from fitserve.layers.quantization.quant_config import Int4Format
from fitserve.layers.quantization.tp_split import RankSlice, rank_bias, rank_slice


class Int4LinearMethod(QuantizedLinearMethod):
    splits_for_tensor_parallel = True  # each loader takes the rank's part (int4_tp.py)

    def __init__(self, fmt: Int4Format, prefix: str = "") -> None:
        super().__init__(fmt, prefix)
        self.path = ""  # "triton-int4", "c-kernel", "torch-int4" or "dequantized", once loaded

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        self.dtype = torch.get_default_dtype()
        first_shard = next(iter(getattr(layer, "shard_ids", ())), None)
        part = rank_slice(layer, first_shard, self.prefix)
        check_rank_columns(self.fmt, part, self.prefix)  # refused before anything loads
        self.specs = rank_specs(self.fmt, param_specs(self.fmt, input_size, output_size), part)
        for name, spec in self.specs.items():
            param = nn.Parameter(torch.zeros(spec.shape, dtype=spec.dtype), requires_grad=False)
            param.weight_loader = self._loader(layer, name)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        if bias:
            layer.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False)
            layer.bias.weight_loader = self._loader(layer, "bias")  # type: ignore[attr-defined]
        else:
            layer.register_parameter("bias", None)
        self._loaded: set[tuple[str, Any]] = set()
        self._g_idx_source: str | None = None
        self._rank_groups: torch.Tensor | None = None  # act order, row-parallel: int4_tp.py

    def _load(
        self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any
    ) -> None:
        if self.runnable is not None:
            if name in optional_params(self.fmt):  # a g_idx without act order, after the rest: k // group
                groups = torch.arange(loaded.numel()) // self.fmt.group_for(loaded.numel())
                if torch.equal(loaded.to(torch.int64), groups):
                    return
            raise ValueError(f"{self.prefix}: {name} came after the layer was loaded and repacked")
        shard = None if shard_id is None else layer.shard_offsets[shard_id]
        what = f"{self.prefix}.{name}" + ("" if shard_id is None else f" (shard {shard_id!r})")
        part = rank_slice(layer, shard_id, what)
        spec = self.specs.get(name)
        if name == "bias":
            target = param if shard is None else param.narrow(0, *shard)
            loaded = rank_bias(layer, loaded, part, what)
        elif spec.shard_dim is None or shard is None:
            target = param
        else:
            start, size = shard
            if start % spec.rows_per or size % spec.rows_per:
                raise ValueError(f"{what}: shard rows {start}+{size} are not a multiple of {spec.rows_per}")
            target = param.narrow(spec.shard_dim, start // spec.rows_per, -(-size // spec.rows_per))
        unpacked_rows = 8 * -(-part.whole_rows // 8)
        if name == "weight_zero_point" and loaded.dim() == 2 and loaded.shape[0] == unpacked_rows:
            loaded = pack_zero_point_rows(loaded)  # an unpacked [N, G] signed zero point (older writers)
        if name == "weight_shape":
            self._check_weight_shape(loaded, part, what)
        elif name != "bias" and tuple(loaded.shape) != self._whole_shape(name, part):
            self._refuse_shape(loaded, self._whole_shape(name, part), what)
        else:
            if name != "bias":
                loaded = rank_part(self.fmt, name, spec, loaded, part, what)
            self._copy(name, param, target, loaded, what, part)
        self._loaded.add((name, shard_id))
        if name.endswith("g_idx") and self._g_idx_source is None:
            self._g_idx_source = what
        if self._complete(layer):
            self._finish(layer)

    def _whole_shape(self, name: str, part: RankSlice) -> tuple[int, ...]:
        """The shape of checkpoint tensor `name` of the whole projection (or shard)."""
        return param_specs(self.fmt, part.whole_columns, part.whole_rows)[name].shape

    def _refuse_shape(self, loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
        raise ValueError(
            f"quantized tensor {what} has shape {tuple(loaded.shape)}, expected {tuple(expected)} "
            f"for {self.fmt.describe()}: the checkpoint is truncated or does not match config.json "
            "(download it again, or check its quantization_config)"
        )

    def _copy(
        self,
        name: str,
        param: nn.Parameter,
        target: torch.Tensor,
        loaded: torch.Tensor,
        what: str,
        part: RankSlice,
    ) -> None:
        """Copies the rank's part of a tensor into its rows of the parameter (a g_idx shared by a fused
        layer's projections: checked against the first's)."""
        spec = self.specs.get(name)
        if tuple(loaded.shape) != tuple(target.shape):
            self._refuse_shape(loaded, tuple(target.shape), what)
        if spec is not None and spec.shard_dim is None and (name, None) in self._loaded_names():
            self._check_shared(param, loaded, what)
            return
        if name.endswith("g_idx") and keeps_all_groups(self.fmt, part):
            self._rank_groups = act_order_groups(
                loaded, self.fmt.group_size, part.whole_columns // self.fmt.group_size, what
            )
        with torch.no_grad():
            target.copy_(loaded)

    def _loaded_names(self) -> set[tuple[str, None]]:
        return {(name, None) for name, _ in self._loaded}

    def _check_shared(self, param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
        if not torch.equal(param.detach().cpu().to(loaded.dtype), loaded.cpu()):
            raise ValueError(
                f"{what} differs from {self._g_idx_source}: the projections fused into {self.prefix} must "
                "share "
                "one g_idx (act order) as real GPTQ checkpoints do; this checkpoint cannot be fused"
            )

    def _check_weight_shape(self, loaded: torch.Tensor, part: RankSlice, what: str) -> None:
        expected = [part.whole_rows, part.whole_columns]
        if loaded.tolist() != expected:
            raise ValueError(f"quantized tensor {what} says {loaded.tolist()}, expected {expected}")

    def _complete(self, layer: nn.Module) -> bool:
        shards = tuple(getattr(layer, "shard_ids", ())) or (None,)
        names = [name for name in self.specs if name not in optional_params(self.fmt)]
        if layer.bias is not None:
            names.append("bias")
        loaded = self._loaded
        return all(
            (name, shard) in loaded or (shard is not None and (name, None) in loaded)
            for name in names
            for shard in shards
        )

    def _finish(self, layer: nn.Module) -> None:
        # The canonical form is built on the CPU (a one-time unpack); make_runnable puts the layer's
        # runnable form on the device its parameters live on, in the form for the device it runs on
        # (placement.py: they differ for a layer --cpu-offload-gb keeps in CPU memory).
        device = next(iter(getattr(layer, name) for name in self.specs)).device
        tensors = {name: getattr(layer, name).data.cpu() for name in self.specs}
        if ("g_idx", None) not in self._loaded_names() and "g_idx" in tensors:
            del tensors["g_idx"]
        if self._rank_groups is not None:
            g_idx_name = "g_idx" if "g_idx" in tensors else "weight_g_idx"
            tensors = select_groups(self.fmt, tensors, g_idx_name, self._rank_groups)
        weight = to_int4_weight(self.fmt, tensors, layer.input_size_per_rank, self.prefix)
        for name in self.specs:
            delattr(layer, name)
        self.runnable, self.path = make_runnable(
            layer, weight, self.dtype, self.fmt.method, run_device(layer, device), store_on=device
        )

    def initialize_dummy(
        self, layer: nn.Module, seed: int, std: float, device: torch.device | str | None = None
    ) -> None:
        """--load-format dummy: a random int4 weight (random_int4_weight, dequantized std about `std`)
        instead of the checkpoint's tensors, drawn on `device` (default: the layer's parameters') from a
        generator seeded by `seed` and the layer's name, then made runnable on the parameters' device as a
        loaded weight is (the same kernels run); a bias becomes 0.

        The same model at every tensor-parallel size: each projection (shard) is drawn whole, from its own
        generator, and this rank keeps its rows and columns of it (rank_slice, as a checkpoint's are cut);
        a fused layer's shards are stacked. One projection is drawn at a time."""
        if self.runnable is not None:
            raise ValueError(f"{self.prefix}: dummy weights for a layer that was already loaded")
        home = next(iter(getattr(layer, name) for name in self.specs)).device
        on = home if device is None else torch.device(device)
        parts = []
        for shard_id in tuple(getattr(layer, "shard_ids", ())) or (None,):
            name = self.prefix if shard_id is None else f"{self.prefix}.{shard_id}"
            part = rank_slice(layer, shard_id, name)
            generator = torch.Generator(device=on).manual_seed(layer_seed(seed, name))
            group = self.fmt.group_for(part.whole_columns)
            whole = random_int4_weight(
                part.whole_rows, part.whole_columns, group, self.fmt.symmetric, std, generator, on
            )
            parts.append(_rank_cut(whole, part))
        weight = parts[0]
        if len(parts) > 1:
            weight = Int4Weight(
                torch.cat([p.codes for p in parts]),
                torch.cat([p.scales for p in parts]),
                torch.cat([p.zeros for p in parts]),
                weight.group_size,
            )
        if layer.bias is not None:
            with torch.no_grad():
                layer.bias.zero_()
        for name in self.specs:
            delattr(layer, name)
        self.runnable, self.path = make_runnable(
            layer, weight, self.dtype, self.fmt.method, run_device(layer, home), store_on=home
        )

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.runnable is None:
            raise RuntimeError(f"{self.prefix}: the quantized weights were not loaded")
        return self.runnable.apply(layer, x)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the layer repacks itself once its last tensor arrives (see the module doc)."""


def _rank_cut(whole: Int4Weight, part: RankSlice) -> Int4Weight:
    """This rank's rows and columns of a whole projection's Int4Weight: its columns start on a group
    boundary (create_weights checked); a per-channel weight keeps its one group's scale and zero point."""
    codes = whole.codes.narrow(0, part.rows_start, part.rows)
    scales = whole.scales.narrow(0, part.rows_start, part.rows)
    zeros = whole.zeros.narrow(0, part.rows_start, part.rows)
    group = whole.group_size
    if part.splits_columns:
        codes = codes.narrow(1, part.columns_start, part.columns)
        if group == part.whole_columns:  # per channel
            group = part.columns
        else:
            scales = scales.narrow(1, part.columns_start // group, part.columns // group)
            zeros = zeros.narrow(1, part.columns_start // group, part.columns // group)
    weight = Int4Weight(codes.contiguous(), scales.contiguous(), zeros.contiguous(), group)
    weight.check()
    return weight


def layer_seed(seed: int, name: str) -> int:
    """A generator seed from the model's seed and a layer's name: each layer's dummy weight is the same
    whatever order the layers are initialized in."""
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63


def linear_method_for(fmt: Any, layer_name: str, modules: list[str]) -> Any:
    """methods.linear_method_for (every format's method, picked by the format's type), kept here for
    its callers."""
    from fitserve.layers.quantization.methods import linear_method_for as for_any_format

    return for_any_format(fmt, layer_name, modules)
