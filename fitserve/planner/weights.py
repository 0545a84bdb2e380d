"""What the weights hold, without reading them: safetensors headers or index, a GGUF header, or config.json.

A safetensors file starts with an 8-byte little-endian length N and N bytes of JSON naming each tensor's
dtype, shape and byte range; only those N + 8 bytes are read. A GGUF file's header lists its tensors
(name, shape, type, byte size); gguf.GGUFReader maps the file and reads only that part.

Floating-point tensors are counted in parameters, because fitserve loads them in the model dtype
whatever dtype the file stores. Other tensors (an AWQ/GPTQ checkpoint's packed int32 weights, fp8
weights) are counted in bytes: they are loaded as stored. GGUF tensors are all counted in parameters:
fitserve dequantizes a GGUF file into the model dtype when it converts it (models/gguf_convert.py).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitserve.planner.model_shape import ModelShape, ParamCounts

SAFETENSORS_INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# Decoder-layer tensors: HF "model.layers.3.", GPT-2 style "h.3.", GGUF "blk.3.".
_LAYER_PATTERN = re.compile(r"(^|\.)(layers|h|blk)\.\d+\.")
# MoE routers: small, kept whole on every tensor-parallel rank, never quantized.
_ROUTER_PATTERN = re.compile(r"(mlp\.gate|block_sparse_moe\.gate|shared_expert_gate|ffn_gate_inp)\.weight$")


@dataclass(frozen=True)
class WeightInventory:
    counts: ParamCounts  # floating-point parameters, loaded in the model dtype
    stored_bytes: int  # non-float tensors (packed quantized weights), loaded as stored
    file_bytes: int | None  # tensor bytes on disk; None when no weight file was read
    source: str  # one line: where the numbers came from
    checkpoint_quantization: str | None = None  # config.json's quantization_config.quant_method
    file_tensor_types: tuple[str, ...] = ()  # the dtypes / GGML types the file stores

    @property
    def total_params(self) -> int:
        return self.counts.total


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (tensor name -> dtype, shape, data_offsets)."""
    from fitserve.models.weights import check_safetensors_file

    check_safetensors_file(path)  # refuses a truncated file or a corrupt header, naming it
    with path.open("rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(header_len))


def inventory_from_headers(
    headers: Iterable[Mapping[str, Any]], source: str, checkpoint_quantization: str | None = None
) -> WeightInventory:
    linear = other = replicated = stored = file_bytes = 0
    types: set[str] = set()
    for header in headers:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = str(entry["dtype"]), list(entry["shape"])
            start, end = entry["data_offsets"]
            file_bytes += int(end) - int(start)
            types.add(dtype)
            if dtype not in _FLOAT_DTYPES:
                stored += int(end) - int(start)
                continue
            kind = classify_tensor(name, len(shape))
            numel = _product(shape)
            linear += numel if kind == "linear" else 0
            other += numel if kind != "linear" else 0
            replicated += numel if kind == "replicated" else 0
    return WeightInventory(
        counts=ParamCounts(linear, other, replicated),
        stored_bytes=stored,
        file_bytes=file_bytes,
        source=source,
        checkpoint_quantization=checkpoint_quantization,
        file_tensor_types=tuple(sorted(types)),
    )


def classify_tensor(name: str, ndim: int) -> str:
    """The tensor's class: "linear" (a decoder projection matrix), "replicated" (norm, router) or "other"."""
    in_layer = _LAYER_PATTERN.search(name) is not None
    if _ROUTER_PATTERN.search(name) or ("norm" in name and ndim == 1):
        return "replicated"
    if in_layer and ndim >= 2 and "norm" not in name and "embed" not in name:
        return "linear"
    return "other"


def inventory_from_folder(
    folder: Path, shape: ModelShape, checkpoint_quantization: str | None = None
) -> WeightInventory:
    """From the folder's safetensors headers; its index alone when the shards are absent; else config.json."""
    index_file = folder / SAFETENSORS_INDEX
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        shard_names = sorted(set(index.get("weight_map", {}).values()))
        if shard_names and all((folder / name).is_file() for name in shard_names):
            files = [folder / name for name in shard_names]
        else:
            total = index.get("metadata", {}).get("total_size")
            return inventory_from_config(
                shape,
                checkpoint_quantization,
                file_bytes=int(total) if total is not None else None,
                source=f"config.json shapes ({SAFETENSORS_INDEX} only: shards not downloaded)",
            )
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        return inventory_from_config(shape, checkpoint_quantization)
    count = f"{len(files)} file{'s' if len(files) > 1 else ''}"
    headers = [read_safetensors_header(path) for path in files]
    return inventory_from_headers(headers, f"safetensors headers ({count})", checkpoint_quantization)


def inventory_from_gguf(path: Path) -> WeightInventory:
    """From the GGUF header: every tensor's element count and stored bytes (n_bytes)."""
    from gguf import GGUFReader

    from fitserve.models.gguf_convert import check_gguf_file

    check_gguf_file(path)
    linear = other = replicated = file_bytes = 0
    types: set[str] = set()
    for tensor in GGUFReader(path).tensors:
        numel, ndim = int(tensor.n_elements), len(tensor.shape)
        file_bytes += int(tensor.n_bytes)
        types.add(tensor.tensor_type.name)
        kind = classify_tensor(tensor.name, ndim)
        linear += numel if kind == "linear" else 0
        other += numel if kind != "linear" else 0
        replicated += numel if kind == "replicated" else 0
    return WeightInventory(
        counts=ParamCounts(linear, other, replicated),
        stored_bytes=0,
        file_bytes=file_bytes,
        source=f"GGUF header ({path.name}; dequantized to the model dtype when fitserve converts it)",
        file_tensor_types=tuple(sorted(types)),
    )


def inventory_from_config(
    shape: ModelShape,
    checkpoint_quantization: str | None = None,
    file_bytes: int | None = None,
    source: str = "config.json shapes (no weight files)",
) -> WeightInventory:
    return WeightInventory(
        counts=shape.parameter_counts(),
        stored_bytes=0,
        file_bytes=file_bytes,
        source=source,
        checkpoint_quantization=checkpoint_quantization,
    )


def inventory_from_hub_metadata(
    files_metadata: Mapping[str, Any], checkpoint_quantization: str | None
) -> WeightInventory:
    """From huggingface_hub.get_safetensors_metadata(...).files_metadata (headers read by range requests)."""
    headers = [
        {
            name: {"dtype": info.dtype, "shape": info.shape, "data_offsets": info.data_offsets}
            for name, info in file_metadata.tensors.items()
        }
        for file_metadata in files_metadata.values()
    ]
    count = len(headers)
    return inventory_from_headers(
        headers,
        f"safetensors headers on the hub ({count} file{'s' if count > 1 else ''})",
        checkpoint_quantization,
    )


def _product(shape: list[int]) -> int:
    result = 1
    for size in shape:
        result *= int(size)
    return result
