"""The linear method of a bitsandbytes 4-bit layer (a pre-quantized checkpoint's, or --quantization
bitsandbytes quantizing a 16-bit one while loading).

Parameters carry the checkpoint's tensor names (bnb_format.param_name maps the dotted ones): `weight` and,
for a checkpoint, `weight_absmax`, `weight_quant_map`, `weight_quant_state` and with double quant
`weight_nested_absmax`, `weight_nested_quant_map`. They are empty placeholders whose loaders keep each
projection's tensors (a fused layer's q/k/v or gate/up arrive separately, each with its own quant_state)
until that projection has all of them; the projection is then checked (shape, block size, code table,
each tensor's length: a truncated tensor is refused naming it) and decoded into the layer's rows of the
packed codes, on the device, and its absmax decoded to float32 (double quant: once, here). With
--quantization bitsandbytes each 16-bit projection is quantized to nf4 (blocks of 64) on the device as it
arrives, so the 16-bit layer never exists there. Under tensor parallel each projection is checked and
decoded whole (its quant_state gives the whole shape), then the rank's rows and whole blocks of columns
of the codes and absmax are kept (tp_split.py); --quantization bitsandbytes quantizes the rank's part.
Once every projection is in, the layer becomes runnable (bnb_runtime.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fitserve.layers.quantization.bnb_format import BLOCK_SIZES, CODES
from fitserve.layers.quantization.bnb_runtime import make_bnb_runnable
from fitserve.layers.quantization.bnb_weight import (
    Nf4Weight,
    code_table,
    decode_absmax,
    parse_quant_state,
    quantize_4bit,
    random_nf4_weight,
)
from fitserve.layers.quantization.method_base import QuantizedLinearMethod
from fitserve.layers.quantization.placement import run_device
from fitserve.layers.quantization.tp_split import (
    check_columns_align,
    rank_bias,
    rank_slice,
    take_columns,
    take_rows,
)

CHECKPOINT_NAMES = ("weight", "weight_absmax", "weight_quant_map", "weight_quant_state")
NESTED_NAMES = ("weight_nested_absmax", "weight_nested_quant_map")


class BnbLinearMethod(QuantizedLinearMethod):
    splits_for_tensor_parallel = True  # each projection's rows and columns are cut once decoded (tp_split.py)

    @property
    def path(self) -> str:
        return "" if self.runnable is None else self.runnable.path

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, bias: bool) -> None:
        self.dtype = torch.get_default_dtype()
        if not self.fmt.prequantized:  # refused before anything loads; a checkpoint's block size as it loads
            first_shard = next(iter(getattr(layer, "shard_ids", ())), None)
            part = rank_slice(layer, first_shard, self.prefix)
            check_columns_align(part, self.fmt.blocksize, self.prefix, self._block_unit(self.fmt.blocksize))
        names = ("weight",)
        if self.fmt.prequantized:
            names = CHECKPOINT_NAMES + (NESTED_NAMES if self.fmt.double_quant else ())
        self.names = names
        for name in names:
            param = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
            param.weight_loader = self._loader(layer, name)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        layer.register_buffer("nf4_loading", torch.empty((output_size, input_size // 2), dtype=torch.uint8))
        if bias:
            layer.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False)
            layer.bias.weight_loader = self._loader(layer, "bias")  # type: ignore[attr-defined]
        else:
            layer.register_parameter("bias", None)
        self._pending: dict[Any, dict[str, torch.Tensor]] = {}
        self._absmax: dict[Any, torch.Tensor] = {}  # shard -> float32 [rows, K / blocksize]
        self._blocksize: int | None = None
        self._code: torch.Tensor | None = None
        self._bias_loaded: set[Any] = set()

    def _load(
        self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any
    ) -> None:
        start, rows, what = self._shard_rows(layer, name, shard_id)
        if name == "bias":
            part = rank_slice(layer, shard_id, what)
            if tuple(loaded.shape) != (part.whole_rows,):
                raise ValueError(f"{what} has shape {tuple(loaded.shape)}, expected ({part.whole_rows},)")
            with torch.no_grad():
                layer.bias.narrow(0, start, rows).copy_(rank_bias(layer, loaded, part, what))
            self._bias_loaded.add(shard_id)
        else:
            pending = self._pending.setdefault(shard_id, {})
            if name in pending or shard_id in self._absmax:
                raise ValueError(f"{what} came twice: a checkpoint must hold each tensor once")
            pending[name] = loaded
            if set(pending) == set(self.names):
                del self._pending[shard_id]
                self._decode_shard(layer, pending, start, rows, shard_id)
        if self._complete(layer):
            self._finish(layer)

    def _decode_shard(
        self, layer: nn.Module, tensors: dict[str, torch.Tensor], start: int, rows: int, shard_id: Any
    ) -> None:
        what = self.prefix + ("" if shard_id is None else f" (shard {shard_id!r})")
        part = rank_slice(layer, shard_id, what)
        whole_rows, k = part.whole_rows, part.whole_columns
        target = layer.nf4_loading
        if not self.fmt.prequantized:
            weight = tensors["weight"]
            if tuple(weight.shape) != (whole_rows, k) or not weight.is_floating_point():
                raise ValueError(
                    f"checkpoint tensor {what}.weight is {weight.dtype} {tuple(weight.shape)}: "
                    "--quantization bitsandbytes quantizes 16- or 32-bit float weights of shape "
                    f"({whole_rows}, {k}) while loading; pass the model's bf16/fp16 checkpoint"
                )
            check_columns_align(part, self.fmt.blocksize, what, self._block_unit(self.fmt.blocksize))
            weight = take_columns(take_rows(weight, 0, part, what), 1, part, what)  # quantized once split
            # on the device the layer runs on (a layer --cpu-offload-gb keeps on the host included)
            on = run_device(layer, target.device)
            quantized = quantize_4bit(weight.to(on), self.fmt.blocksize, self.fmt.quant_type)
            self._blocksize, self._code = self.fmt.blocksize, quantized.code.cpu()
            target[start : start + rows].copy_(quantized.packed.to(target.device))
            self._absmax[shard_id] = quantized.absmax.cpu()
            return
        packed, absmax, blocksize, code = self._checkpoint_shard(tensors, whole_rows, k, what)
        # every block lies inside one weight row (checked): the rank's rows and columns of both
        blocks = self._block_unit(blocksize)
        check_columns_align(part, blocksize, what, blocks)
        packed = take_columns(take_rows(packed.view(whole_rows, k // 2), 0, part, what), 1, part, what, 2)
        absmax = take_rows(absmax.view(whole_rows, k // blocksize), 0, part, what)
        absmax = take_columns(absmax, 1, part, what, blocksize, blocks)
        target[start : start + rows].copy_(packed.to(target.device))
        self._absmax[shard_id] = absmax.contiguous()

    @staticmethod
    def _block_unit(blocksize: int) -> str:
        return f"a bitsandbytes block (blocksize {blocksize})"

    def _checkpoint_shard(
        self, tensors: dict[str, torch.Tensor], rows: int, k: int, what: str
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """A projection's checkpoint tensors -> (codes uint8 [rows * K / 2], absmax float32, block size,
        code table), each checked against the quant_state and the layer's shape."""
        state = parse_quant_state(tensors["weight_quant_state"], f"{what}.weight.quant_state")
        fix = "the checkpoint is truncated or does not match config.json (download it again)"
        quant_type = str(state.get("quant_type", ""))
        if quant_type != self.fmt.quant_type:
            raise ValueError(
                f"{what}: quant_state quant_type={quant_type!r} but config.json's bnb_4bit_quant_type is "
                f"{self.fmt.quant_type!r}: every layer must use the config's type; {fix}"
            )
        if list(state.get("shape") or []) != [rows, k]:
            raise ValueError(f"{what}: quant_state shape={state.get('shape')}, expected [{rows}, {k}]; {fix}")
        blocksize = int(state.get("blocksize", 0))
        if blocksize not in BLOCK_SIZES or k % blocksize:
            raise ValueError(
                f"{what}: quant_state blocksize={blocksize}: fitserve runs bitsandbytes block sizes "
                f"{', '.join(map(str, BLOCK_SIZES))} that divide the input dim {k} (each block inside one "
                "weight row); re-quantize with blocksize 64"
            )
        if self._blocksize not in (None, blocksize):
            raise ValueError(
                f"{what}: blocksize={blocksize} but the layer's other projections use {self._blocksize}: "
                "projections fused into one layer must share a block size; re-quantize with one block size"
            )
        blocks = rows * k // blocksize
        packed = _as_bytes(tensors["weight"])
        _expect_numel(packed, rows * k // 2, f"{what}.weight (uint8 codes)", fix)
        code = tensors["weight_quant_map"].float().reshape(-1).cpu()
        _expect_numel(code, 16, f"{what}.weight.quant_map", fix)
        if not torch.allclose(code, code_table(quant_type), atol=1e-4, rtol=0):
            raise ValueError(
                f"{what}.weight.quant_map {[round(v, 4) for v in code.tolist()]} is not bitsandbytes' "
                f"{quant_type} table {[round(v, 4) for v in CODES[quant_type]]}: fitserve runs the standard "
                f"nf4 / fp4 codes; {fix}"
            )
        if self._code is not None and not torch.equal(code, self._code):
            raise ValueError(f"{what}.weight.quant_map differs from the layer's other projections'; {fix}")
        raw = tensors["weight_absmax"].reshape(-1).cpu()
        if self.fmt.double_quant:
            _expect_numel(raw, blocks, f"{what}.weight.absmax (uint8, double quant)", fix)
            nested_size = int(state.get("nested_blocksize", 0))
            if nested_size <= 0 or "nested_offset" not in state:
                raise ValueError(
                    f"{what}: quant_state lacks nested_blocksize / nested_offset, but config.json sets "
                    f"bnb_4bit_use_double_quant; {fix}"
                )
            nested = tensors["weight_nested_absmax"].reshape(-1).cpu()
            _expect_numel(nested, -(-blocks // nested_size), f"{what}.weight.nested_absmax", fix)
            nested_code = tensors["weight_nested_quant_map"].reshape(-1).cpu()
            _expect_numel(nested_code, 256, f"{what}.weight.nested_quant_map", fix)
            absmax = decode_absmax(raw, nested, nested_code, nested_size, float(state["nested_offset"]))
        else:
            if raw.dtype == torch.uint8:
                raise ValueError(
                    f"{what}.weight.absmax is uint8 (double quant) but config.json's "
                    f"bnb_4bit_use_double_quant is false; {fix}"
                )
            _expect_numel(raw, blocks, f"{what}.weight.absmax", fix)
            absmax = raw.float()
        self._blocksize, self._code = blocksize, code
        return packed, absmax, blocksize, code

    def _complete(self, layer: nn.Module) -> bool:
        shards = tuple(getattr(layer, "shard_ids", ())) or (None,)
        decoded = set(self._absmax) == {None} or set(self._absmax) >= set(shards)
        biased = layer.bias is None or None in self._bias_loaded or self._bias_loaded >= set(shards)
        return decoded and biased

    def _finish(self, layer: nn.Module) -> None:
        if None in self._absmax:
            absmax = self._absmax[None]
        else:
            order = sorted(layer.shard_ids, key=lambda shard: layer.shard_offsets[shard][0])
            absmax = torch.cat([self._absmax[shard] for shard in order])
        packed = layer.nf4_loading
        weight = Nf4Weight(packed, absmax, self._code, self._blocksize, self.fmt.quant_type)
        self._make_runnable(layer, weight, packed.device)

    def _make_runnable(self, layer: nn.Module, weight: Nf4Weight, device: torch.device) -> None:
        for name in self.names:
            delattr(layer, name)
        del layer.nf4_loading
        self._absmax.clear()
        # computes on the device it runs on; tensors kept where its parameters were (placement.py)
        run = run_device(layer, device)
        self.runnable = make_bnb_runnable(
            layer, weight, self.dtype, run, self.fmt.describe(), store_on=device
        )

    def initialize_dummy(
        self, layer: nn.Module, seed: int, std: float, device: torch.device | str | None = None
    ) -> None:
        """--load-format dummy: random codes and absmax (bnb_weight.random_nf4_weight, std about `std`)
        drawn on `device` (default: the layer's) from a generator seeded by `seed` and the layer's name,
        made runnable as a loaded weight is; a bias becomes 0."""
        from fitserve.layers.quantization.int4_method import layer_seed

        if self.runnable is not None:
            raise ValueError(f"{self.prefix}: dummy weights for a layer that was already loaded")
        home = layer.nf4_loading.device
        on = home if device is None else torch.device(device)
        generator = torch.Generator(device=on).manual_seed(layer_seed(seed, self.prefix))
        rows, columns = layer.output_size_per_rank, layer.input_size_per_rank
        weight = random_nf4_weight(rows, columns, self.fmt.blocksize, std, generator, on, self.fmt.quant_type)
        if layer.bias is not None:
            with torch.no_grad():
                layer.bias.zero_()
        self._make_runnable(layer, weight, home)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.runnable is None:
            raise RuntimeError(f"{self.prefix}: the bitsandbytes weights were not loaded")
        return self.runnable.apply(layer, x)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the layer becomes runnable once its last tensor arrives (module docstring)."""


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A packed weight stored as uint8, or in another bnb_4bit_quant_storage dtype: its bytes."""
    flat = tensor.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _expect_numel(tensor: torch.Tensor, numel: int, what: str, fix: str) -> None:
    if tensor.numel() != numel:
        raise ValueError(f"quantized tensor {what} holds {tensor.numel()} values, expected {numel}; {fix}")
