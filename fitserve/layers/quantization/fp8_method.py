"""The linear method of a layer held in fp8 (an fp8 checkpoint's, or --quantization fp8's).

`create_weights` makes `weight` (float8_e4m3fn [N, K], N the fused layer's rows) and, for a checkpoint,
its scale (`weight_scale` or `weight_scale_inv`, kept in the canonical float32 [N, G] form: fp8_weight.py)
and `input_scale` (static activations, one per shard). A fused layer (q/k/v, gate/up) loads each
projection's tensors into its rows; each shard's scale, whatever its form (per tensor, per channel, per
block), becomes that shard's rows of the canonical scale, so fused projections keep their own scales.
`--quantization fp8`: each 16-bit shard is quantized per channel as it arrives, on the device, so the
16-bit layer never exists there. Once every tensor is in, the layer becomes runnable (fp8_compute.py).
Every tensor's shape and dtype are checked, naming it, before it is copied. Under tensor parallel each
whole tensor is checked, then the rank's rows / columns are taken (tp_split.py): a scale in canonical
form, block scales by whole blocks of columns; `--quantization fp8` quantizes the rank's part.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitserve.layers.quantization.fp8_compute import make_fp8_runnable
from fitserve.layers.quantization.fp8_weight import FP8, Fp8Weight, quantize_fp8, random_fp8_weight
from fitserve.layers.quantization.method_base import QuantizedLinearMethod
from fitserve.layers.quantization.placement import run_device
from fitserve.layers.quantization.tp_split import (
    RankSlice,
    check_columns_align,
    rank_bias,
    rank_slice,
    take_columns,
    take_rows,
)


class Fp8LinearMethod(QuantizedLinearMethod):
    splits_for_tensor_parallel = True  # each loader takes the rank's part (tp_split.py)

    @property
    def path(self) -> str:
        return "" if self.runnable is None else self.runnable.path

    def group_k(self, in_features: int) -> int:
        return self.fmt.block[1] if self.fmt.strategy == "block" and self.fmt.block else in_features

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        self.dtype = torch.get_default_dtype()
        if self.fmt.strategy == "block":  # refused before anything loads
            first_shard = next(iter(getattr(layer, "shard_ids", ())), None)
            part = rank_slice(layer, first_shard, self.prefix)
            check_columns_align(part, self.fmt.block[1], self.prefix, self._block_unit())
        groups = -(-input_size // self.group_k(input_size))
        self.names = ["weight"]
        self._add(layer, "weight", torch.empty((output_size, input_size), dtype=FP8))
        if self.fmt.quantize_on_load:
            layer.fp8_loading_scale = torch.ones((output_size, 1))  # filled as each shard is quantized
        else:
            self._add(layer, self.fmt.scale_name, torch.ones((output_size, groups)))
            self.names.append(self.fmt.scale_name)
            if self.fmt.activations == "static":
                shards = max(1, len(tuple(getattr(layer, "shard_ids", ()))))
                self._add(layer, "input_scale", torch.zeros(shards))
                self.names.append("input_scale")
        if bias:
            self._add(layer, "bias", torch.zeros(output_size, dtype=self.dtype))
        else:
            layer.register_parameter("bias", None)
        self._loaded: set[tuple[str, Any]] = set()

    def _add(self, layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
        param = nn.Parameter(tensor, requires_grad=False)
        param.weight_loader = self._loader(layer, name)  # type: ignore[attr-defined]
        layer.register_parameter(name, param)

    def _load(
        self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any
    ) -> None:
        start, rows, what = self._shard_rows(layer, name, shard_id)
        part = rank_slice(layer, shard_id, what)
        with torch.no_grad():
            if name == "bias":
                self._expect(loaded, (part.whole_rows,), what)
                param.narrow(0, start, rows).copy_(rank_bias(layer, loaded, part, what))
            elif name == "weight":
                self._load_weight(layer, param, loaded, start, part, what)
            elif name == "input_scale":
                self._expect_single(loaded, what)
                index = 0 if shard_id is None else list(layer.shard_ids).index(shard_id)
                param[index] = loaded.float().reshape(())
            else:
                canonical = self._canonical_scale(loaded, part.whole_rows, part.whole_columns, what)
                param.narrow(0, start, rows).copy_(self._rank_scale(canonical, part, what))
        self._loaded.add((name, shard_id))
        if self._complete(layer):
            self._finish(layer)

    def _rank_scale(self, canonical: torch.Tensor, part: RankSlice, what: str) -> torch.Tensor:
        """The whole projection's canonical scale -> the rank's rows, and its blocks' columns (per-tensor
        and per-channel scales have one column, which every rank keeps)."""
        rows = take_rows(canonical, 0, part, what)
        if self.fmt.strategy != "block":
            return rows
        return take_columns(rows, 1, part, what, self.fmt.block[1], self._block_unit())

    def _block_unit(self) -> str:
        return f"a {self.fmt.block[0]}x{self.fmt.block[1]} scale block"

    def _load_weight(
        self,
        layer: nn.Module,
        param: nn.Parameter,
        loaded: torch.Tensor,
        start: int,
        part: RankSlice,
        what: str,
    ) -> None:
        self._expect(loaded, (part.whole_rows, part.whole_columns), what)
        if self.fmt.strategy == "block":
            check_columns_align(part, self.fmt.block[1], what, self._block_unit())
        loaded = take_columns(take_rows(loaded, 0, part, what), 1, part, what)  # quantized after the split
        rows = part.rows
        if self.fmt.quantize_on_load:
            if not loaded.is_floating_point() or loaded.dtype == FP8:
                raise ValueError(
                    f"checkpoint tensor {what} is {loaded.dtype}: --quantization fp8 quantizes 16- or 32-bit "
                    "float weights while loading; pass the model's bf16/fp16 checkpoint"
                )
            quantized = quantize_fp8(loaded.to(param.device))  # one shard at a time, on the device
            param.narrow(0, start, rows).copy_(quantized.data)
            layer.fp8_loading_scale[start : start + rows] = quantized.scale.to(layer.fp8_loading_scale.device)
            return
        if loaded.dtype != FP8:
            raise ValueError(
                f"quantized tensor {what} is {loaded.dtype}, expected float8_e4m3fn for "
                f"{self.fmt.describe()}: the checkpoint does not match config.json's quantization_config "
                "(check it, or download the model again)"
            )
        param.narrow(0, start, rows).copy_(loaded)

    def _expect(self, loaded: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
        if tuple(loaded.shape) != shape:
            raise ValueError(
                f"quantized tensor {what} has shape {tuple(loaded.shape)}, expected {shape} for "
                f"{self.fmt.describe()}: the checkpoint is truncated or does not match config.json "
                "(download it again, or check its quantization_config)"
            )

    def _expect_single(self, loaded: torch.Tensor, what: str) -> None:
        if loaded.numel() != 1:
            raise ValueError(
                f"quantized tensor {what} has shape {tuple(loaded.shape)}, expected one value (a per-tensor "
                f"scale) for {self.fmt.describe()}: the checkpoint does not match config.json's "
                "quantization_config (check its strategy, or download the model again)"
            )
        value = float(loaded.float().reshape(()))
        if not (value > 0 and value < float("inf")):
            raise ValueError(
                f"{what} = {value}: a scale must be positive and finite; the checkpoint is damaged (download "
                "it again)"
            )

    def _canonical_scale(self, loaded: torch.Tensor, rows: int, in_features: int, what: str) -> torch.Tensor:
        """A shard's checkpoint scale -> its rows of the canonical [rows, G] float32 scale."""
        strategy = self.fmt.strategy
        if strategy == "tensor":
            self._expect_single(loaded, what)
            return loaded.float().reshape(1, 1).expand(rows, 1)
        if strategy == "channel":
            if loaded.shape not in ((rows,), (rows, 1)):
                self._expect(loaded, (rows, 1), what)
            return loaded.float().reshape(rows, 1)
        block_rows, block_cols = self.fmt.block or (0, 0)
        shape = (-(-rows // block_rows), -(-in_features // block_cols))
        self._expect(loaded, shape, what)
        return loaded.float().repeat_interleave(block_rows, dim=0)[:rows]

    def _complete(self, layer: nn.Module) -> bool:
        shards = tuple(getattr(layer, "shard_ids", ())) or (None,)
        names = [*self.names, *(["bias"] if layer.bias is not None else [])]
        loaded = self._loaded
        return all(
            (name, shard) in loaded or (shard is not None and (name, None) in loaded)
            for name in names
            for shard in shards
        )

    def _finish(self, layer: nn.Module) -> None:
        device = layer.weight.device
        if self.fmt.quantize_on_load:
            scale, group_k = layer.fp8_loading_scale.to(device), layer.input_size_per_rank
            del layer.fp8_loading_scale
        else:
            columns = layer.input_size_per_rank
            scale, group_k = getattr(layer, self.fmt.scale_name).data, self.group_k(columns)
        weight = Fp8Weight(layer.weight.data, scale.float().contiguous(), group_k)
        input_scale = layer.input_scale.data.max() if "input_scale" in self.names else None
        self._make_runnable(layer, weight, input_scale, device)

    def _make_runnable(
        self, layer: nn.Module, weight: Fp8Weight, input_scale: torch.Tensor | None, home: torch.device
    ) -> None:
        """The form for the device the layer computes on (placement.run_device: the GPU for a layer
        --cpu-offload-gb keeps in CPU memory), its tensors kept on `home` (where its parameters were)."""
        for name in self.names:
            delattr(layer, name)
        self.runnable = make_fp8_runnable(
            layer,
            weight,
            input_scale,
            self.dtype,
            self.fmt.activations,
            self.fmt.method,
            run_device(layer, home),
            home,
        )

    def initialize_dummy(
        self, layer: nn.Module, seed: int, std: float, device: torch.device | str | None = None
    ) -> None:
        """--load-format dummy: a random fp8 weight (N(0, std) quantized per channel, or per block for a
        block-scaled format) drawn on `device` (default: the layer's) from a generator seeded by `seed`
        and the projection's name; static activation scales get 1/448 of a unit activation. A bias becomes 0.

        The same model at every tensor-parallel size: each projection (shard) is drawn whole and this rank
        keeps its rows and columns of it and of its scale, as a checkpoint's are cut; a fused layer's shards
        are stacked."""
        from fitserve.layers.quantization.int4_method import layer_seed

        if self.runnable is not None:
            raise ValueError(f"{self.prefix}: dummy weights for a layer that was already loaded")
        home = layer.weight.device
        on = home if device is None else torch.device(device)
        block = self.fmt.strategy == "block"
        data, scales = [], []
        for shard_id in tuple(getattr(layer, "shard_ids", ())) or (None,):
            name = self.prefix if shard_id is None else f"{self.prefix}.{shard_id}"
            part = rank_slice(layer, shard_id, name)
            generator = torch.Generator(device=on).manual_seed(layer_seed(seed, name))
            group = self.group_k(part.whole_columns) if block else None
            block_rows = self.fmt.block[0] if block else 1
            whole = random_fp8_weight(
                part.whole_rows, part.whole_columns, group, std, generator, on, block_rows
            )
            data.append(take_columns(take_rows(whole.data, 0, part, name), 1, part, name).to(home))
            scales.append(self._rank_scale(whole.scale, part, name).to(home))
        columns = layer.input_size_per_rank
        weight = Fp8Weight(torch.cat(data), torch.cat(scales).contiguous(), self.group_k(columns))
        if layer.bias is not None:
            with torch.no_grad():
                layer.bias.zero_()
        if self.fmt.quantize_on_load:
            del layer.fp8_loading_scale
        input_scale = torch.tensor(1.0 / 448) if self.fmt.activations == "static" else None
        self._make_runnable(layer, weight, input_scale, home)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.runnable is None:
            raise RuntimeError(f"{self.prefix}: the fp8 weights were not loaded")
        return self.runnable.apply(layer, x)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the layer becomes runnable once its last tensor arrives (see the module doc)."""
