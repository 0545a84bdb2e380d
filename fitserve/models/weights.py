"""Checkpoint tensors in, in HF names: safetensors files (single or sharded) and dummy weights.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON (tensor name ->
dtype, shape, data_offsets relative to the data section), then the data section. A file whose size
disagrees with its header was cut short in transfer; one whose header does not parse is damaged.
Both are refused before any tensor is read, naming the file.

A checkpoint may carry each layer's KV cache scales (`...layers.N.self_attn.k_scale`, `v_scale`, or one
`kv_scale` for both, as fp8 checkpoints do): `take_kv_scales` sets them on the attention layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitserve.layers.linear import WholeTensor

SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_REDOWNLOAD = "delete it and download the model again"

# A layer's KV cache scale in a checkpoint: which layer, and k_scale, v_scale or kv_scale (both).
_KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*\.(k_scale|v_scale|kv_scale)$")

# Dummy weights: matrices ~ N(0, DUMMY_STD) keep every layer's activations O(1), norm scales are 1
# and biases 0, so a dummy model's logits are finite for any input.
DUMMY_STD = 0.02


def list_safetensors_files(model_path: str) -> list[Path]:
    """The checkpoint's safetensors files: those the index names when there is one, else *.safetensors."""
    folder = Path(model_path)
    index_file = folder / SAFETENSORS_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{index_file} is not a valid safetensors index ({error}): {_REDOWNLOAD}"
            ) from error
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(
                f"{index_file} names {len(absent)} shard(s) that are not in {folder}: {', '.join(absent)}: "
                "the download is incomplete; download the model again"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        found = f" (it has {', '.join(others)}, which fitserve does not read)" if others else ""
        raise ValueError(
            f"model folder {folder} has no *.safetensors weights{found}: pass a folder with safetensors "
            "weights or a .gguf file, or use --load-format dummy for random weights"
        )
    return files


def check_safetensors_file(path: Path) -> None:
    """Raises ValueError when the file is truncated or its header is corrupt."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"safetensors file {path} is truncated ({size} bytes, no header): {_REDOWNLOAD}")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES:
            raise ValueError(
                f"safetensors file {path} is corrupt: its header length {header_len} exceeds the format's "
                f"limit of {_MAX_HEADER_BYTES} bytes: {_REDOWNLOAD}"
            )
        if 8 + header_len > size:
            raise ValueError(
                f"safetensors file {path} is truncated: its header needs {8 + header_len} bytes but the "
                f"file has {size}: {_REDOWNLOAD}"
            )
        header_bytes = handle.read(header_len)
    try:
        header = json.loads(header_bytes)
        data_end = max(
            (int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"),
            default=0,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(
            f"safetensors file {path} is corrupt: its header is not valid safetensors JSON ({error}): "
            + _REDOWNLOAD
        ) from error
    expected_size = 8 + header_len + data_end
    if size < expected_size:
        raise ValueError(
            f"safetensors file {path} is truncated: its header describes {expected_size} bytes but the file "
            f"has {size}: {_REDOWNLOAD}"
        )


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF name, CPU tensor) for every tensor of every file, one tensor in memory at a time."""
    from safetensors import SafetensorError, safe_open

    for path in files:
        check_safetensors_file(path)
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, reader.get_tensor(name)
        except SafetensorError as error:
            raise ValueError(f"safetensors file {path} is corrupt ({error}): {_REDOWNLOAD}") from error


def initialize_dummy_weights(model: nn.Module, seed: int, device: torch.device | str | None = None) -> None:
    """Fills every floating-point parameter in place, reproducibly for a given seed and device, with the
    same model at every tensor-parallel size: each rank holds its own part of it.

    Matrices (ndim >= 2) ~ N(0, DUMMY_STD); 1-D `*weight` (norm scales) = 1; 1-D `*bias` = 0. A matrix is
    defined by its whole tensor as a checkpoint would hold it: the module's `whole_tensors()`
    (layers/linear.WholeTensor: a packed layer's shards, the vocabulary's rows, one expert's tensors)
    names them, each is drawn from a generator seeded by `seed` and its name (not by parameter order, nor
    by the TP size), and the module's own loading logic cuts this rank's part of it: a split matrix's
    ranks hold different values, a replicated one (no `whole_tensors`) the same. One whole tensor at a
    time is drawn, on `device` (default: each parameter's own), and freed before the next; where this
    rank holds all of it on that device, it is drawn in place. A parameter that lives elsewhere gets a
    copy, so the layers --cpu-offload-gb keeps in CPU memory get the values they would have on the GPU.

    A layer whose linear method has `initialize_dummy` (an int4 checkpoint's layers,
    layers/quantization/int4_method.py), or a module that has one itself (int4 MoE experts,
    layers/moe_int4.py), gets a random weight in its own form first, one layer at a time,
    made runnable as a loaded one is; its remaining floating-point parameters (a bias) follow the rules above.
    """
    draw_device = None if device is None else _indexed(torch.device(device))
    for module in model.modules():
        initialize = getattr(getattr(module, "linear_method", None), "initialize_dummy", None)
        if initialize is not None:
            initialize(module, seed, DUMMY_STD, draw_device)
        elif hasattr(module, "initialize_dummy"):  # int4 MoE experts (layers/moe_int4.py)
            module.initialize_dummy(seed, DUMMY_STD, draw_device)
    drawn: set[int] = set()  # ids of the parameters whole tensors filled
    on_cuda = False
    with torch.no_grad():
        for prefix, module in model.named_modules():
            whole_tensors = getattr(module, "whole_tensors", None)
            if whole_tensors is None:
                continue
            for whole in whole_tensors():
                on = draw_device or whole.param.device
                _draw_whole(whole, f"{prefix}.{whole.key}" if prefix else whole.key, seed, on)
                drawn.add(id(whole.param))
                on_cuda = on_cuda or on.type == "cuda"
        for name, param in model.named_parameters():
            if not param.is_floating_point() or id(param) in drawn:
                continue
            if param.ndim >= 2:  # replicated: every rank holds it whole
                on = draw_device or param.device
                generator = torch.Generator(device=on).manual_seed(dummy_seed(seed, name))
                if param.device == on:
                    param.normal_(0.0, DUMMY_STD, generator=generator)
                else:
                    drawn_tensor = torch.empty(param.shape, dtype=param.dtype, device=on)
                    param.copy_(drawn_tensor.normal_(0.0, DUMMY_STD, generator=generator))
                on_cuda = on_cuda or on.type == "cuda"
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
    if on_cuda:  # the whole tensors' blocks (an embedding's GBs) back to the device before it is profiled
        torch.cuda.empty_cache()


def dummy_seed(seed: int, name: str) -> int:
    """The generator seed of the dummy tensor `name` (a parameter's name, with its shard or expert): the
    same on every rank and at every TP size, different for every tensor."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2^63 - 1


def _draw_whole(whole: WholeTensor, name: str, seed: int, on: torch.device) -> None:
    """Draws the whole tensor on `on` and puts this rank's part of it in its parameter."""
    generator = torch.Generator(device=on).manual_seed(dummy_seed(seed, name))
    into = whole.into
    if into is not None and into.device == on and into.is_contiguous():
        into.normal_(0.0, DUMMY_STD, generator=generator)
        return
    tensor = torch.empty(whole.shape, dtype=whole.param.dtype, device=on)
    whole.load(tensor.normal_(0.0, DUMMY_STD, generator=generator))


def take_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], attention_layers: Sequence[Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes every checkpoint tensor on except KV cache scales, which it sets as host floats on
    `attention_layers[N]` (objects with k_scale and v_scale attributes). A scale must be one positive,
    finite number (vLLM's per-tensor scale); anything else is refused, naming the tensor."""
    for name, tensor in weights:
        match = _KV_SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        layer_index, kind = int(match[1]), match[2]
        if layer_index >= len(attention_layers):
            raise ValueError(
                f"checkpoint tensor {name!r} is a KV cache scale of layer {layer_index}, but the model has "
                f"{len(attention_layers)} attention layers: the checkpoint does not match config.json"
            )
        value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
        if not (math.isfinite(value) and value > 0):
            shown = tensor.float().flatten()[:4].tolist()
            raise ValueError(
                f"checkpoint tensor {name!r} holds {tensor.numel()} value(s) {shown}: a KV cache scale must "
                "be one positive, finite number; fix the checkpoint or drop the tensor"
            )
        layer = attention_layers[layer_index]
        if kind in ("k_scale", "kv_scale"):
            layer.k_scale = value
        if kind in ("v_scale", "kv_scale"):
            layer.v_scale = value


def _indexed(device: torch.device) -> torch.device:
    """A bare cuda device with the index its parameters report ("cuda:0"), so that the two compare equal."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
