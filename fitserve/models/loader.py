"""Loading a resolved model: its HF config, tokenizer, generation defaults, context limit, and weights.

`resolve_model` (resolve.py) turns what the user named into a local folder first; everything here
reads local folders only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fitserve.args import GENERATION_CONFIG_KEYS
from fitserve.config import ModelConfig
from fitserve.layers.quantization.quant_config import with_quantization_flag
from fitserve.models.checkpoint_config import CheckpointConfig
from fitserve.models.cpu_offload import CpuOffload, offloading
from fitserve.models.gemma4_config import with_expert_parallel
from fitserve.models.resolve import ResolvedModel, require_config_json, resolve_model, resolve_tokenizer_path
from fitserve.models.weights import (
    check_safetensors_file,
    initialize_dummy_weights,
    iterate_safetensors,
    list_safetensors_files,
    take_kv_scales,
)

__all__ = [
    "LOAD_FORMATS",
    "ResolvedModel",
    "load_generation_defaults",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "model_max_length",
    "resolve_model",
    "resolve_tokenizer_path",
]

logger = logging.getLogger("fitserve")

# "gguf" is accepted for vLLM compatibility: resolve_model already turned the .gguf into safetensors.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# Config keys that state a context limit, as different model families name it; the smallest wins.
_MAX_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
_FALLBACK_MAX_LENGTH = 2048
# RoPE types whose max_position_embeddings already is the extended length.
_ROPE_TYPES_WITHOUT_EXTENSION = ("default", "su", "longrope", "llama3", "mrope")


def load_hf_config(model_path: str, trust_remote_code: bool = False) -> Any:
    """The folder's config: a CheckpointConfig for the architectures fitserve runs (read without
    importing transformers' model code), else a transformers.PretrainedConfig. ValueError for a missing
    folder or no config.json."""
    require_config_json(model_path)
    config = CheckpointConfig.from_folder(model_path)
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def load_tokenizer(tokenizer_path: str, trust_remote_code: bool = False, use_fast: bool = True) -> Any:
    """A transformers tokenizer from a folder (or a .gguf file or hub id, fetched to a folder first);
    `use_fast` False: the Python ("slow") tokenizer (--tokenizer-mode slow)."""
    from transformers import AutoTokenizer

    folder = resolve_tokenizer_path(tokenizer_path)
    return AutoTokenizer.from_pretrained(
        folder, trust_remote_code=trust_remote_code, use_fast=use_fast, **_class_choice(folder)
    )


def _class_choice(folder: str) -> dict[str, Any]:
    """What AutoTokenizer needs to choose the tokenizer class without building the model's config.

    Given no config, AutoTokenizer builds the model's transformers config only to read its model_type
    and name, and a Llama-family config module imports transformers' modeling stack on the way
    (torch.distributed among it: about 1 s of a 6 s start of the default model on 2 cores). When
    tokenizer_config.json names its class and loads no remote code, a bare config with the folder's
    model_type and path leads AutoTokenizer to the same class (tests/unit/test_tokenizer_class_choice.py
    compares the two); otherwise {} (AutoTokenizer reads the config itself)."""
    from transformers import PretrainedConfig

    try:
        tokenizer_config = json.loads((Path(folder) / "tokenizer_config.json").read_text())
        model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return {}
    if not isinstance(tokenizer_config, dict) or not tokenizer_config.get("tokenizer_class"):
        return {}
    if "auto_map" in tokenizer_config or not isinstance(model_type, str) or not model_type:
        return {}
    config = PretrainedConfig()
    config.model_type = model_type
    config._name_or_path = folder
    return {"config": config}


def load_generation_defaults(model_path: str) -> dict[str, Any]:
    """The sampling defaults the model's authors put in generation_config.json, in SamplingParams names.

    Only keys present (and not null) in the file appear; {} when there is no file.
    """
    raw = read_generation_config(model_path)
    return {
        ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items() if raw.get(theirs) is not None
    }


def read_generation_config(model_path: str) -> dict[str, Any]:
    """The folder's generation_config.json as a dict ({} when there is none)."""
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}): fix or delete it, or pass --generation-config vllm"
        ) from error
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a {type(raw).__name__}, not a JSON object: fix or delete it")
    return raw


def model_max_length(hf_config: Any) -> int:
    """The longest context the model itself supports, counting a RoPE extension (linear, dynamic, yarn)
    that stretches its trained positions by `factor`."""
    config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    lengths = [value for key in _MAX_LENGTH_KEYS if isinstance(value := getattr(config, key, None), int)]
    if not lengths:
        logger.warning(
            "config.json states no context length (none of %s); assuming %d",
            ", ".join(_MAX_LENGTH_KEYS),
            _FALLBACK_MAX_LENGTH,
        )
        return _FALLBACK_MAX_LENGTH
    length = min(lengths)
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict):
        return length
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type is None or rope_type in _ROPE_TYPES_WITHOUT_EXTENSION:
        return length
    factor = float(rope.get("factor") or 1.0)
    if rope_type == "yarn" and rope.get("original_max_position_embeddings"):
        length = int(rope["original_max_position_embeddings"])
    return int(length * factor)


def load_model(model_config: ModelConfig, device: torch.device | str) -> nn.Module:
    """The registry's model class for the config, on `device` in `model_config.dtype`, with weights
    from the folder's safetensors (or dummy weights seeded by `model_config.seed`), in eval mode. With
    `model_config.cpu_offload_gb`, the first decoder layers' weights stay in CPU memory and are copied in
    before each of them runs (fitserve/models/cpu_offload.py); the model keeps that as `.cpu_offload`."""
    from fitserve.models.registry import get_model_class

    load_format = model_config.load_format
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={load_format!r} is not supported: use one of {', '.join(LOAD_FORMATS)}"
        )
    device = torch.device(device)
    model_class = get_model_class(model_config.hf_config)
    files: list[Path] = []
    if load_format != "dummy":
        files = list_safetensors_files(model_config.model_path)
        for path in files:  # refuse a damaged checkpoint before spending time building the model
            check_safetensors_file(path)

    offload = CpuOffload(model_config.cpu_offload_gb, device) if model_config.cpu_offload_gb > 0 else None
    with default_dtype(model_config.dtype), device, offloading(offload):
        hf_config = with_quantization_flag(model_config.hf_config, model_config.quantization)
        model = model_class(with_expert_parallel(hf_config, model_config.enable_expert_parallel))
    fit_positions = getattr(model, "fit_positions", None)
    if fit_positions is not None:  # tables sized by position (Gemma-4's RoPE) need no more than this
        fit_positions(model_config.max_model_len)

    started = time.perf_counter()
    with torch.no_grad(), loading_threads(device):
        if load_format == "dummy":
            initialize_dummy_weights(model, model_config.seed, device)
        else:
            # indexed by decoder layer (kv_scale_layers: pipeline stages hold only some of them)
            scale_layers = getattr(model, "kv_scale_layers", None) or getattr(model, "attention_layers", [])
            tensors = take_kv_scales(iterate_safetensors(files), scale_layers)
            loaded = model.load_weights(tensors)
            _require_all_loaded(model, loaded, model_config.model_path)
    logger.info(
        "Loading weights took %.2f s (%s, %s, %s)",
        time.perf_counter() - started,
        "dummy" if load_format == "dummy" else f"{len(files)} safetensors file(s)",
        str(model_config.dtype).removeprefix("torch."),
        device,
    )
    if offload is not None:
        offload.attach(model)
    return model.eval()


@contextmanager
def loading_threads(device: torch.device) -> Iterator[None]:
    """torch's intra-op threads while weights load on the CPU: one core fewer than the machine has (at
    least one), given back after.

    The engine loads its tokenizer (and `fitserve serve` its web app's modules) on threads beside the
    weights. With an intra-op thread on every core, each of the load's many small parallel ops waits for
    the thread those took the core from: on 2 cores (1-minute load 2.2-3.3) a warm start of the default
    model loaded its weights in 3.4-5.7 s with 2 threads against 1.4-2.6 s with 1, and answered /health
    1.2-2.6 s sooner."""
    before = torch.get_num_threads()
    during = max(1, min(before, (os.cpu_count() or 1) - 1))
    if device.type != "cpu" or during == before:
        yield
        return
    torch.set_num_threads(during)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default dtype set to `dtype` inside the block, the previous one restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _require_all_loaded(model: nn.Module, loaded: set[str], model_path: str) -> None:
    missing = sorted({name for name, _ in model.named_parameters()} - set(loaded))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(
            f"the checkpoint in {model_path} has no weights for {len(missing)} parameter(s) of "
            f"{type(model).__name__}: {shown}: the weights do not match config.json's architecture, or "
            "the download is incomplete (download the model again)"
        )
