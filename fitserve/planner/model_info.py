"""What the planner knows about a model before loading it: config.json and the weight files' headers.

a folder            -> its config.json, and its safetensors headers (or index) when present
a .gguf file        -> its GGUF header (config and tensors); nothing is converted
a hub id (org/name) -> config.json and the safetensors headers from the hub, read by range requests
None                -> the default model, resolved as the engine resolves it
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fitserve.planner.model_shape import ModelShape, ParamCounts
from fitserve.planner.weights import (
    SAFETENSORS_INDEX,
    WeightInventory,
    inventory_from_config,
    inventory_from_folder,
    inventory_from_gguf,
    inventory_from_hub_metadata,
)

if TYPE_CHECKING:
    from fitserve.models.resolve import ResolvedModel


@dataclass(frozen=True)
class ModelInfo:
    name: str  # as the user named it
    source: str  # one line: where config.json and the weight sizes came from
    hf_config: Any
    shape: ModelShape
    weights: WeightInventory
    max_model_len: int  # the model's own context limit
    # The local folder the engine loads, when inspecting found it (the default model, a local folder);
    # None for a .gguf file (converted only when the engine starts) and a hub id (fetched then).
    resolved: ResolvedModel | None = None

    @classmethod
    def from_hf_config(
        cls,
        name: str,
        source: str,
        hf_config: Any,
        weights: WeightInventory | None = None,
        resolved: ResolvedModel | None = None,
    ) -> ModelInfo:
        from fitserve.models.loader import model_max_length

        shape = ModelShape.from_hf_config(hf_config)
        inventory = weights or inventory_from_config(shape, checkpoint_quantization(hf_config))
        return cls(name, source, hf_config, shape, inventory, model_max_length(hf_config), resolved)


def checkpoint_quantization(hf_config: Any) -> str | None:
    """The quant_method of config.json's quantization_config (an already-quantized checkpoint)."""
    quant = getattr(hf_config, "quantization_config", None)
    if isinstance(quant, dict):
        return quant.get("quant_method")
    return getattr(quant, "quant_method", None) if quant is not None else None


def inspect_model(
    model: str | None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    load_format: str = "auto",
) -> ModelInfo:
    """Reads config.json and the weights' headers; never loads or converts a weight.

    `load_format == "dummy"` skips the weight files: dummy weights have the config's shapes.
    """
    from fitserve.models.default_model import DEFAULT_MODEL_ID
    from fitserve.models.loader import load_hf_config
    from fitserve.models.resolve import resolve_model

    path = Path(model).expanduser() if model is not None else None
    if path is not None and path.is_file() and path.suffix.lower() == ".gguf":
        return _inspect_gguf(path)
    if (path is not None and path.is_dir()) or model in (None, DEFAULT_MODEL_ID):
        resolved = resolve_model(model, revision, log=False)
        folder, source = Path(resolved.model_path), resolved.source
        name = resolved.model_path if model is None else model
    else:
        return _inspect_hub(model, revision, trust_remote_code, load_format)
    hf_config = load_hf_config(str(folder), trust_remote_code=trust_remote_code)
    shape = ModelShape.from_hf_config(hf_config)
    weights = weights_inventory(folder, shape, hf_config, load_format == "dummy")
    return ModelInfo.from_hf_config(name, source, hf_config, weights, resolved)


def weights_inventory(folder: Path, shape: ModelShape, hf_config: Any, dummy: bool) -> WeightInventory:
    """The weights the engine holds: from the safetensors headers, or config.json's shapes for dummy
    weights (a quantized checkpoint's projections at the bytes its format stores); on a GPU, int4 weights
    also count what their repacked form takes beyond that (`gpu_extra_bytes`)."""
    quant = checkpoint_quantization(hf_config)
    fmt = _quantized_format(hf_config) if quant is not None else None
    if dummy:
        source = "config.json shapes (--load-format dummy)"
        weights = _config_inventory(shape, hf_config, quant, source, fmt)
    elif not _holds_weight_files(folder):  # a config to plan (examples/models): as its checkpoint stores it
        weights = _config_inventory(shape, hf_config, quant, "config.json shapes (no weight files)", fmt)
    else:
        weights = inventory_from_folder(folder, shape, quant)
    return _with_gpu_form(weights, fmt, hf_config)


def _holds_weight_files(folder: Path) -> bool:
    return (folder / SAFETENSORS_INDEX).is_file() or any(folder.glob("*.safetensors"))


def _quantized_format(hf_config: Any) -> Any:
    """The checkpoint's quantized format, or None where it is refused (with its message, where the
    format is checked)."""
    from fitserve.layers.quantization.quant_config import quant_format

    try:
        return quant_format(hf_config)
    except ValueError:
        return None


def _with_gpu_form(weights: WeightInventory, fmt: Any, hf_config: Any) -> WeightInventory:
    """`weights` with the bytes an int4 format's repacked GPU form takes beyond what it stores."""
    from fitserve.layers.quantization.int4_formats import gpu_extra_from_config, stored_int4_from_config
    from fitserve.layers.quantization.quant_config import Int4Format

    if not isinstance(fmt, Int4Format):
        return weights
    sized = stored_int4_from_config(fmt, hf_config)
    # Files that hold other quantized tensors than config.json describes (a partial checkpoint) are
    # counted as stored: the repack's extra is worked out from the config's shapes.
    if sized is None or abs(weights.stored_bytes - sized[1]) > 0.01 * sized[1]:
        return weights
    return replace(weights, gpu_extra_bytes=gpu_extra_from_config(fmt, hf_config))


def _config_inventory(
    shape: ModelShape, hf_config: Any, quant: str | None, source: str, fmt: Any = None
) -> WeightInventory:
    """The weights from config.json's shapes; a quantized checkpoint's projections (`fmt`, its parsed
    format) at the bytes its format stores them in (layers/quantization/methods.stored_from_config), as
    the headers would."""
    inventory = inventory_from_config(shape, quant, source=source)
    if fmt is None:
        return inventory
    from fitserve.layers.quantization.methods import stored_from_config

    sized = stored_from_config(fmt, hf_config)
    if sized is None:
        return inventory
    params, stored = sized
    counts = inventory.counts
    return replace(
        inventory,
        counts=ParamCounts(counts.linear - params, counts.other, counts.replicated),
        stored_bytes=stored,
    )


def _inspect_gguf(path: Path) -> ModelInfo:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, OSError) as error:
        raise ValueError(f"cannot read the GGUF header of {path}: {error}") from error
    return ModelInfo.from_hf_config(
        str(path), f"GGUF file {path.resolve()}", hf_config, inventory_from_gguf(path)
    )


def _inspect_hub(model: str, revision: str | None, trust_remote_code: bool, load_format: str) -> ModelInfo:
    from fitserve.models.hub import HubUnavailableError, download_snapshot, hub_offline, looks_like_hub_id
    from fitserve.models.loader import load_hf_config

    if not looks_like_hub_id(model):
        raise ValueError(
            f"model path {model} does not exist: pass a local folder with config.json, a .gguf file or a "
            "Hugging Face id"
        )
    try:
        folder = download_snapshot(model, revision, ("config.json",))
    except HubUnavailableError as error:
        raise ValueError(
            f"cannot read config.json of {model!r}: {error}: download the model folder and pass its path"
        ) from error
    hf_config = load_hf_config(folder, trust_remote_code=trust_remote_code)
    shape = ModelShape.from_hf_config(hf_config)
    quant = checkpoint_quantization(hf_config)
    weights = None
    if load_format != "dummy" and not hub_offline():
        from huggingface_hub import get_safetensors_metadata

        try:
            metadata = get_safetensors_metadata(model, revision=revision)
            weights = inventory_from_hub_metadata(metadata.files_metadata, quant)
        except Exception:  # no safetensors on the hub, or the hub went away: the shapes still size it
            weights = None
    if weights is None:
        fmt = _quantized_format(hf_config) if quant is not None else None
        weights = _config_inventory(shape, hf_config, quant, "config.json shapes (no weight files)", fmt)
    return ModelInfo.from_hf_config(model, f"Hugging Face model {model} ({folder})", hf_config, weights)
