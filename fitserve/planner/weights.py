"""What the weights hold, without reading them: safetensors headers or index, a GGUF header, or config.json.

A safetensors file starts with an 8-byte little-endian length N and N bytes of JSON naming each tensor's
dtype, shape and byte range; only those N + 8 bytes are read. A GGUF file's header lists its tensors
(name, shape, type, byte size); gguf.GGUFReader maps the file and reads only that part.

Floating-point tensors are counted in parameters, because fitserve loads them in the model dtype
whatever dtype the file stores. Other tensors (an AWQ/GPTQ checkpoint's packed int32 weights, zeros and
g_idx, fp8 weights) are counted in bytes: they are loaded as stored, and so are an int4 checkpoint's
float scales. Its unquantized layers (embeddings, LM head, an ignore list's) count at the model dtype.
GGUF tensors are all counted in parameters:
fitserve dequantizes a GGUF file into the model dtype when it converts it (models/gguf_convert.py).

On the CPU the engine then keeps some of them in a smaller form (`CpuKeptForms`): decoder matrices that
are 4-bit groups of 32 (a Q4_0 / Q4_1 GGUF's) stay int4 (layers/cpu/int4_linear.py), and an LM head whose
values float16 holds exactly gets a float16 copy (layers/cpu/fp16_matmul.py). The engine checks the
values; the plan, which reads no values, goes by the GGUF's tensor types: from its header for a .gguf
file, from the matrix types its cache record (fitserve_cache_entry.json) counts for a converted folder.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fitserve.planner.bnb_headers import bnb_held_bytes
from fitserve.planner.model_shape import ModelShape, ParamCounts

SAFETENSORS_INDEX = "model.safetensors.index.json"
_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# Decoder-layer tensors: HF "model.layers.3.", GPT-2 style "h.3.", GGUF "blk.3.".
_LAYER_PATTERN = re.compile(r"(^|\.)(layers|h|blk)\.\d+\.")
# A multimodal checkpoint's towers (Gemma-4's), which fitserve does not load when serving text.
TOWER_PREFIXES = (
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
    "model.visual.",  # Qwen3.5 / Qwen3.6: the vision tower
    "mtp.",  # Qwen3.5 / Qwen3.6: the MTP layer (loaded by method mtp's drafter, counted as its draft)
)
# A quantized checkpoint's float scales (GPTQ / AWQ `scales`, compressed-tensors `weight_scale`, fp8's
# `weight_scale_inv` and static `input_scale`): loaded as stored, beside the packed int32 codes, zeros,
# g_idx and fp8 weights (which are not float, so stored already).
QUANT_SCALE_SUFFIXES = (".scales", ".weight_scale", ".weight_scale_inv", ".input_scale")
# MoE routers: small, kept whole on every tensor-parallel rank, never quantized.
_ROUTER_PATTERN = re.compile(r"(mlp\.gate|block_sparse_moe\.gate|shared_expert_gate|ffn_gate_inp)\.weight$")
# GGUF tensor types whose matrices are 4-bit groups of 32 (w = d q or d q + m, q in 0..15): the CPU
# engine keeps them int4.
INT4_GGUF_TYPES = frozenset({"Q4_0", "Q4_1"})
# The int4 form: half a byte per weight, plus a 16-bit scale and a 16-bit minimum (or zero) per group of
# 32, for fitserve's C kernel and for torch's kernel alike.
INT4_BYTES_PER_WEIGHT = 0.5 + 2 * 2 / 32
# One of those types in a GGUF file's name: "SmolLM2-135M-Instruct.Q4_1.gguf" -> Q4_1 (not Q4_K_M).
_INT4_TYPE_IN_NAME = re.compile(r"(?<![A-Za-z0-9])Q4_[01](?![A-Za-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class CpuKeptForms:
    """What the CPU engine keeps in place of the model dtype (bytes on this host, see the module doc)."""

    int4_params: int = 0  # decoder-matrix parameters kept as int4
    int4_bytes_per_weight: float = INT4_BYTES_PER_WEIGHT  # the int4 form, plus torch's float16 copy if any
    fp16_head: bool = False  # the LM head also held as float16 (2 bytes a parameter more)
    gguf_type: str = ""  # the GGUF type the forms were read from, for the plan's text


NO_CPU_FORMS = CpuKeptForms()


@dataclass(frozen=True)
class WeightInventory:
    counts: ParamCounts  # floating-point parameters, loaded in the model dtype
    stored_bytes: int  # non-float tensors (packed quantized weights), loaded as stored
    file_bytes: int | None  # tensor bytes on disk; None when no weight file was read
    source: str  # one line: where the numbers came from
    checkpoint_quantization: str | None = None  # config.json's quantization_config.quant_method
    file_tensor_types: tuple[str, ...] = ()  # the dtypes / GGML types the file stores
    cpu_forms: CpuKeptForms = NO_CPU_FORMS  # on the CPU: what the engine keeps smaller than the dtype
    # on a GPU: bytes the engine's forms of quantized weights take beyond stored_bytes (int4 repacked for
    # the Triton kernels: layers/quantization/int4_formats.gpu_extra_from_config)
    gpu_extra_bytes: int = 0

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
    headers: Iterable[Mapping[str, Any]],
    source: str,
    checkpoint_quantization: str | None = None,
    int4_gguf_type: str | None = None,
) -> WeightInventory:
    """`int4_gguf_type`: the folder was converted from a GGUF of that type (Q4_0 / Q4_1): its decoder
    matrices are 4-bit groups, its LM head float16 values (see the module doc)."""
    linear = other = replicated = stored = file_bytes = int4 = towers = 0
    types: set[str] = set()
    row_block = int4_row_block() if int4_gguf_type else 0
    for header in headers:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = str(entry["dtype"]), list(entry["shape"])
            start, end = entry["data_offsets"]
            file_bytes += int(end) - int(start)
            if name.startswith(TOWER_PREFIXES):
                towers += 1
                continue
            types.add(dtype)
            held = bnb_held_bytes(name, shape) if checkpoint_quantization == "bitsandbytes" else None
            if held is not None:  # a bitsandbytes block-scale tensor: what fitserve holds for it
                stored += held
                continue
            quant_scale = checkpoint_quantization is not None and name.endswith(QUANT_SCALE_SUFFIXES)
            if dtype not in _FLOAT_DTYPES or quant_scale:
                stored += int(end) - int(start)
                continue
            kind = classify_tensor(name, len(shape))
            numel = _product(shape)
            linear += numel if kind == "linear" else 0
            other += numel if kind != "linear" else 0
            replicated += numel if kind == "replicated" else 0
            if row_block and kind == "linear" and int4_packable(shape[0], shape[-1], row_block):
                int4 += numel
    return WeightInventory(
        counts=ParamCounts(linear, other, replicated),
        stored_bytes=stored,
        file_bytes=file_bytes,
        source=source
        + (f"; converted from a {int4_gguf_type} GGUF" if int4_gguf_type else "")
        + (f"; {towers} vision/audio tower tensors not counted (not loaded)" if towers else ""),
        checkpoint_quantization=checkpoint_quantization,
        file_tensor_types=tuple(sorted(types)),
        cpu_forms=forms_kept_on_this_host(int4, bool(int4_gguf_type), int4_gguf_type or ""),
    )


def forms_kept_on_this_host(int4_params: int, fp16_head: bool, gguf_type: str) -> CpuKeptForms:
    """The forms the CPU engine keeps on this host: no int4 with FITSERVE_CPU_INT4=0; torch's int4 kernel
    (where fitserve's C kernel cannot run) adds a float16 copy of each int4 matrix; both float16 forms
    need fbgemm."""
    from fitserve.layers.cpu.int4_linear import cpu_int4_enabled, fp16_copy_enabled

    if not int4_params and not fp16_head:
        return NO_CPU_FORMS
    import torch

    fbgemm = "fbgemm" in torch.backends.quantized.supported_engines
    per_weight = INT4_BYTES_PER_WEIGHT
    if not c_int4_kernel_expected() and fp16_copy_enabled() and fbgemm:
        per_weight += 2
    return CpuKeptForms(int4_params if cpu_int4_enabled() else 0, per_weight, fp16_head and fbgemm, gguf_type)


def c_int4_kernel_expected() -> bool:
    """Whether fitserve's C int4 kernel should build here (layers/cpu/c_kernels/library.py decides by
    building it; the plan goes by the switch, the machine, a compiler and the CPU's flags: an AVX2, AVX-VNNI
    or AVX-512 kernel set)."""
    from fitserve.layers.cpu.c_kernels.library import expected_set

    return expected_set() is not None


def int4_row_block() -> int:
    """Rows an int4 matrix is packed in blocks of: 16 for the C kernel, else torch's layout's 32 or 64."""
    from fitserve.layers.cpu.c_kernels.int4_layout import BLOCK_COLUMNS
    from fitserve.layers.cpu.int4_linear import torch_block_rows

    return BLOCK_COLUMNS if c_int4_kernel_expected() else torch_block_rows()


def int4_packable(out_features: int, in_features: int, row_block: int) -> bool:
    """The engine's shape rule for an int4 matrix: groups of 32 along a row, whole blocks of rows."""
    from fitserve.layers.cpu.int4_linear import GROUP_SIZE

    return out_features % row_block == 0 and in_features % GROUP_SIZE == 0


def converted_gguf_int4_type(folder: Path) -> str | None:
    """Q4_0 or Q4_1 when `folder` is fitserve's conversion of a GGUF file whose matrices are mostly of that
    type; None for any other folder or type. The cache record (fitserve_cache_entry.json) counts the
    file's matrix types (`gguf_matrix_types`); records written before it did are read by the file name
    they keep (`source_gguf`, and `origin` for the default model's)."""
    from fitserve.models.model_cache import COMPLETE_MARKER

    try:
        record = json.loads((folder / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    counts = record.get("gguf_matrix_types")
    if isinstance(counts, dict) and counts:
        most_common = max(counts, key=lambda name: counts[name])
        return most_common if most_common in INT4_GGUF_TYPES else None
    names = [record.get(key) for key in ("origin", "source_gguf")]
    for name in names:
        # origin is "<wheel>:<member path>", source_gguf a path: the file name is the last part of either
        match = (
            _INT4_TYPE_IN_NAME.search(Path(name.rsplit(":", 1)[-1]).name) if isinstance(name, str) else None
        )
        if match:
            return match[0].upper()
    return None


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
    return inventory_from_headers(
        headers, f"safetensors headers ({count})", checkpoint_quantization, converted_gguf_int4_type(folder)
    )


def inventory_from_gguf(path: Path) -> WeightInventory:
    """From the GGUF header: every tensor's element count and stored bytes (n_bytes)."""
    from gguf import GGUFReader

    from fitserve.models.gguf_convert import check_gguf_file

    check_gguf_file(path)
    linear = other = replicated = file_bytes = int4 = 0
    types: set[str] = set()
    head_type = ""
    row_block = int4_row_block()
    for tensor in GGUFReader(path).tensors:
        numel, ndim = int(tensor.n_elements), len(tensor.shape)
        file_bytes += int(tensor.n_bytes)
        type_name = tensor.tensor_type.name
        types.add(type_name)
        kind = classify_tensor(tensor.name, ndim)
        linear += numel if kind == "linear" else 0
        other += numel if kind != "linear" else 0
        replicated += numel if kind == "replicated" else 0
        # GGUF shapes run fastest dimension first: [in_features, out_features]
        if (
            kind == "linear"
            and type_name in INT4_GGUF_TYPES
            and int4_packable(int(tensor.shape[-1]), int(tensor.shape[0]), row_block)
        ):
            int4 += numel
        if tensor.name == "output.weight" or (tensor.name == "token_embd.weight" and not head_type):
            head_type = type_name
    # A quantized or float16 head dequantizes to values float16 holds (fp16 scales times small integers).
    fp16_head = head_type not in ("", "F32", "BF16")
    int4_types = sorted(types & INT4_GGUF_TYPES)
    return WeightInventory(
        counts=ParamCounts(linear, other, replicated),
        stored_bytes=0,
        file_bytes=file_bytes,
        source=f"GGUF header ({path.name}; dequantized to the model dtype when fitserve converts it)",
        file_tensor_types=tuple(sorted(types)),
        cpu_forms=forms_kept_on_this_host(int4, fp16_head, "/".join(int4_types) or head_type),
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
