"""Checkpoint tensors in, in HF names: safetensors files (single or sharded) and dummy weights.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON (tensor name ->
dtype, shape, data_offsets relative to the data section), then the data section. A file whose size
disagrees with its header was cut short in transfer; one whose header does not parse is damaged.
Both are refused before any tensor is read, naming the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
_REDOWNLOAD = "delete it and download the model again"

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


def initialize_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fills every floating-point parameter in place, reproducibly for a given seed and device.

    Matrices (ndim >= 2) ~ N(0, DUMMY_STD); 1-D `*weight` (norm scales) = 1; 1-D `*bias` = 0.
    """
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            if param.ndim >= 2:
                generator = generators.get(param.device)
                if generator is None:
                    generator = torch.Generator(device=param.device).manual_seed(seed)
                    generators[param.device] = generator
                param.normal_(0.0, DUMMY_STD, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)
