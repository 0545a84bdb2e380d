"""Turn a .gguf file into a cached Hugging Face-style folder the rest of fitserve loads like any other.

The folder holds config.json (with `architectures` and `dtype` filled in), the weights dequantized
to one dtype in model.safetensors (sharded with an index past `MAX_SHARD_BYTES`), the tokenizer
(tokenizer.json, tokenizer_config.json, chat template) and generation_config.json when the GGUF
names its special tokens. transformers' GGUF support does the dequantization and the
GGUF -> HF tensor-name mapping (including llama.cpp's q/k row permutation).

Cache key: the file's absolute path, size and mtime, and the dtype. Touching or replacing the file
gives a new key, so a stale conversion is never served.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fitserve.models.model_cache import (
    converted_models_dir,
    exclusive_lock,
    is_complete_entry,
    publish_folder,
)

logger = logging.getLogger("fitserve")

MAX_SHARD_BYTES = 4 * 1024**3
# llama.cpp's metadata key -> generation_config.json key
_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_conversion_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """None means "auto": pick from the file (see `read_gguf_facts`)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(
                f"dtype={dtype} is not a GGUF conversion dtype: use float32, float16 or bfloat16"
            )
        return dtype
    if dtype == "auto":
        return None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"dtype={dtype!r} is not a GGUF conversion dtype: use auto, float32, float16 or bfloat16"
        )
    return _DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class GgufFacts:
    """What the conversion needs from the file's metadata beyond what transformers reads."""

    auto_dtype: torch.dtype
    sampling_defaults: dict[str, float | int]  # generation_config.json names
    matrix_types: dict[str, int]  # GGUF type name -> how many matrices (2-D and up) are stored in it


def read_gguf_facts(reader: Any) -> GgufFacts:
    """From a parsed file's metadata (a gguf.GGUFReader): the dtype "auto" means for this file, and the
    sampling defaults llama.cpp copies from the original generation_config.json into `general.sampling.*`.

    auto: the file's own float type when its matrices are unquantized, else bfloat16 (a quantized
    matrix dequantizes to values whose bfloat16 rounding is far below the quantization error
    already in them, at half the disk and memory of float32).
    """
    matrix_types = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    if matrix_types and matrix_types.keys() <= {"F32"}:
        auto_dtype = torch.float32
    elif matrix_types and matrix_types.keys() <= {"F32", "F16"}:
        auto_dtype = torch.float16
    else:
        auto_dtype = torch.bfloat16
    sampling: dict[str, float | int] = {}
    for gguf_key, hf_key in _GGUF_SAMPLING_KEYS.items():
        field = reader.fields.get(gguf_key)
        if field is not None:
            value = field.contents()
            sampling[hf_key] = value if isinstance(value, int) else round(float(value), 6)
    return GgufFacts(auto_dtype, sampling, dict(sorted(matrix_types.items())))


def gguf_cache_folder(gguf_path: Path, requested_dtype: torch.dtype | None) -> Path:
    """Keyed by the requested dtype ("auto" included), so a cache hit never has to open the file."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    dtype_part = dtype_name(requested_dtype) if requested_dtype is not None else "auto"
    return converted_models_dir() / f"{gguf_path.stem}-{digest}-{dtype_part}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def convert_gguf_cached(gguf_path: Path, dtype: str | torch.dtype = "auto") -> tuple[Path, bool]:
    """Returns (folder, converted_now). Converts only when no complete cache entry exists."""
    gguf_path = gguf_path.resolve()
    requested = parse_conversion_dtype(dtype)
    folder = gguf_cache_folder(gguf_path, requested)
    if is_complete_entry(folder):
        logger.info("Using converted GGUF cache %s (from %s)", folder, gguf_path)
        return folder, False
    with exclusive_lock(folder):
        if is_complete_entry(folder):  # another process converted it while we waited
            return folder, False
        convert_gguf_to_folder(gguf_path, folder, requested)
    return folder, True


def convert_gguf_to_folder(
    gguf_path: Path, target: Path, dtype: torch.dtype | None, origin: str | None = None
) -> None:
    """Converts `gguf_path` into `target`, published atomically (see model_cache.publish_folder).

    dtype None picks one from the file (`read_gguf_facts`); `origin` (where the file came from,
    when it is a temporary copy) goes into the cache entry's record.
    """
    check_gguf_file(gguf_path)
    with collector_on(), gguf_parsed_once(gguf_path) as reader:
        _convert_parsed(gguf_path, reader, target, dtype, origin)


@contextmanager
def collector_on() -> Iterator[None]:
    """Python's cyclic garbage collector enabled inside the block, as it was after it.

    `fitserve serve` pauses the collector while it starts (fitserve/server/startup_gc.py); a conversion
    makes garbage cycles (the parsed GGUF's fields, tensors) that, left to the end of the start, raised a
    first start's peak RSS from 1.74 to 2.05 GiB. When it was paused, one collection at the end frees
    what the block left before the weights load."""
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        if not was_enabled:
            gc.collect()
            gc.disable()


@contextmanager
def gguf_parsed_once(gguf_path: Path) -> Iterator[Any]:
    """Yields one gguf.GGUFReader of `gguf_path` that every reader of that file inside the block shares.

    transformers opens the file once for the config, once for the tokenizer and once for the weights,
    and gguf-py parses every metadata field (the whole vocabulary, element by element) at each open;
    it also rebuilds the architecture's tensor-name map once per module of the model. On a 2-core
    machine that was 5 s a parse and 6 s of maps for the 135M default model, 20 s of a 21 s conversion.
    Inside the block the file is parsed once and the map is built once per (architecture, layers).
    transformers' per-tensor progress bar shows only on a terminal: in a log file (a server's) the
    "Converting" and "Converted" lines say the same.
    """
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    reader = gguf.GGUFReader(gguf_path)
    open_reader, name_map, progress_bar = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.tqdm
    shared_path = gguf_path.resolve()

    def shared_reader(path: Any, mode: str = "r") -> Any:
        if mode == "r" and Path(path).resolve() == shared_path:
            return reader
        return open_reader(path, mode)

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    gguf_loading.tqdm = functools.partial(progress_bar, disable=not sys.stderr.isatty())
    try:
        yield reader
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_loading.tqdm = open_reader, name_map, progress_bar


def _convert_parsed(
    gguf_path: Path, reader: Any, target: Path, dtype: torch.dtype | None, origin: str | None
) -> None:
    facts = read_gguf_facts(reader)
    if dtype is None:
        dtype = facts.auto_dtype
    stat = gguf_path.stat()
    record: dict[str, Any] = {
        "source_gguf": str(gguf_path),
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
        "dtype": dtype_name(dtype),
        "gguf_matrix_types": facts.matrix_types,  # what the plan counts as kept int4 on the CPU
    }
    if origin is not None:
        record["origin"] = origin
    logger.info(
        "Converting GGUF %s to %s safetensors (one time; cached at %s)", gguf_path, record["dtype"], target
    )
    started = time.perf_counter()
    with publish_folder(target, record) as staging:
        record.update(_write_hf_folder(gguf_path, staging, dtype, facts.sampling_defaults))
        record["conversion_seconds"] = round(time.perf_counter() - started, 2)
    logger.info(
        "Converted GGUF %s in %.1f s; cached at %s", gguf_path.name, record["conversion_seconds"], target
    )


def check_gguf_file(gguf_path: Path) -> None:
    with gguf_path.open("rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ValueError(
            f"{gguf_path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): "
            "pass a .gguf model file, or re-download it if it is damaged"
        )


def _write_hf_folder(
    gguf_path: Path, out_dir: Path, dtype: torch.dtype, sampling_defaults: dict[str, float | int]
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES, load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except ValueError as error:
        raise ValueError(
            f"cannot convert {gguf_path}: {error} (transformers reads GGUF architectures "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))})"
        ) from error
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # only its parameter names are used
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=dtype
    )
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    expected = {param_name for param_name, _ in skeleton.named_parameters()}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(
            f"{gguf_path} has no tensors for {len(missing)} parameters of {type(skeleton).__name__} "
            f"(e.g. {', '.join(missing[:5])}): the file is incomplete or its architecture metadata is wrong"
        )

    config.architectures = [type(skeleton).__name__]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    num_shards = save_safetensors_shards(tensors, out_dir)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    tokenizer.save_pretrained(out_dir)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning(
            "%s has no tokenizer.chat_template: chat requests will need --chat-template", gguf_path
        )

    write_generation_config(config, sampling_defaults, out_dir)
    return {
        "architecture": config.architectures[0],
        "num_tensors": len(tensors),
        "num_shards": num_shards,
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
    }


def write_generation_config(config: Any, sampling_defaults: dict[str, float | int], out_dir: Path) -> None:
    """generation_config.json from the special token ids and sampling defaults the GGUF states;
    none when it states neither."""
    token_ids = {key: getattr(config, key, None) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    content: dict[str, Any] = {key: value for key, value in token_ids.items() if value is not None}
    if sampling_defaults:
        content.update(do_sample=True, **sampling_defaults)
    if content:
        (out_dir / "generation_config.json").write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def save_safetensors_shards(tensors: dict[str, torch.Tensor], out_dir: Path) -> int:
    """Writes model.safetensors, or model-0000i-of-0000n.safetensors plus the HF index json."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for tensor_name in sorted(tensors):
        tensor = tensors[tensor_name].contiguous()
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > MAX_SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][tensor_name] = tensor
        shard_bytes += size
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return 1
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return len(shards)
