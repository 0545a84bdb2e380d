"""Reading and checking an EAGLE-3 head in its released checkpoint format (fitserve/spec_decode/eagle3/),
before any weight loads: its config.json and tensor names against the target, the target's layers it
reads, its d2t mapping; the tensors it loads and the target's embedding read whole from the target's
weights; the head's KV cache elements per token (the plan sizes the pool with them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fitserve.models.decoder_blocks import head_dim_of
from fitserve.planner.draft_checkpoint import read_keys, resolve_draft, weight_files
from fitserve.spec_decode.draft_model import check_one_device

if TYPE_CHECKING:
    from fitserve.config import EngineConfig

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# the target's embedding in its checkpoint (the Llama-family decoders EAGLE-3 reads)
TARGET_EMBEDDING_KEY = "model.embed_tokens.weight"
# the keys every EAGLE-3 checkpoint has (embed_tokens, d2t and t2d are optional)
REQUIRED_KEYS = (
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight",
)


@dataclass(frozen=True)
class Eagle3Checkpoint:
    name: str
    path: str
    hf_config: Any
    files: tuple[Path, ...]
    keys: frozenset[str]
    aux_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    has_embedding: bool
    d2t: torch.Tensor | None = field(default=None, compare=False)  # int64 [draft_vocab] offsets


def read_tensor(files: list[Path], key: str) -> torch.Tensor | None:
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                names = set(f.keys())  # noqa: SIM118 - safe_open is not a mapping
                if key in names:
                    return f.get_tensor(key)
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True)
            if key in tensors:
                return tensors[key]
    return None


def target_embedding_file(config: EngineConfig) -> Path | None:
    """The target's weight file that holds its embedding whole, which rank 0 reads for a head without
    its own under tensor parallel (the target's rows are split over the ranks); None with dummy weights
    or a checkpoint without safetensors."""
    from fitserve.models.weights import list_safetensors_files

    if config.model.load_format == "dummy":
        return None
    try:
        files = list_safetensors_files(config.model.model_path)
    except (ValueError, OSError):  # a .gguf file or a folder without safetensors
        return None
    return next((file for file in files if TARGET_EMBEDDING_KEY in read_keys([file])), None)


def whole_target_embedding(config: EngineConfig) -> nn.Embedding:
    """The target's embedding, whole on this rank's device, read from its weights (target_embedding_file)."""
    weight = read_tensor([target_embedding_file(config)], TARGET_EMBEDDING_KEY)
    weight = weight.to(device=config.device.torch_device, dtype=config.model.dtype)
    return nn.Embedding.from_pretrained(weight, freeze=True)


def checkpoint_tensors(files: Iterable[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as f:
                for key in list(f.keys()):  # noqa: SIM118 - safe_open is not a mapping
                    yield key, f.get_tensor(key)
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's default for Llama targets: the streams entering layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def _aux_layer_ids(hf_config: Any, num_layers: int) -> tuple[int, ...]:
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle_config = getattr(hf_config, "eagle_config", None)
    if ids is None and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layer_ids(num_layers)
    return tuple(int(i) for i in ids)


def read_eagle3_checkpoint(
    config: EngineConfig, trust_remote_code: bool = False, dummy: bool = False
) -> Eagle3Checkpoint:
    """The head named by --speculative-config, checked against the target: an EAGLE-3 config and keys,
    the target's hidden size and vocabulary, d2t inside the target's vocabulary, the target's layers.
    `dummy`: random weights (the target's --load-format dummy): the config alone is read."""
    from fitserve.models.loader import load_hf_config

    spec = config.speculative
    assert spec is not None and spec.model is not None
    name = spec.model
    path, _ = resolve_draft(name, spec.revision)
    hf_config = load_hf_config(path, trust_remote_code=trust_remote_code)
    target = config.model.hf_config
    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in EAGLE3_ARCHITECTURES for a in architectures):
        raise ValueError(
            f"--speculative-config model {name} is not an EAGLE-3 head (architectures {architectures}): "
            f"method eagle3 reads {' or '.join(EAGLE3_ARCHITECTURES)} checkpoints; for a plain smaller "
            "model use method draft_model"
        )
    if int(getattr(hf_config, "num_hidden_layers", 1)) != 1:
        raise ValueError(
            f"the EAGLE-3 head {name} has {hf_config.num_hidden_layers} layers: fitserve runs the released "
            "format's one layer (midlayer); use a one-layer head"
        )
    target_hidden = int(target.hidden_size)
    head_target_hidden = int(getattr(hf_config, "target_hidden_size", None) or hf_config.hidden_size)
    if head_target_hidden != target_hidden:
        raise ValueError(
            f"the EAGLE-3 head {name} was trained on a target of hidden size {head_target_hidden}, the "
            f"target {config.model.model} has {target_hidden}: pick the head trained for this target"
        )
    vocab = int(getattr(hf_config, "vocab_size", 0))
    if vocab != config.model.vocab_size:
        raise ValueError(
            f"the EAGLE-3 head {name} has a vocabulary of {vocab} tokens, the target "
            f"{config.model.model} {config.model.vocab_size}: pick the head trained for this target"
        )
    draft_vocab = int(getattr(hf_config, "draft_vocab_size", None) or vocab)
    num_layers = int(target.num_hidden_layers)
    aux_ids = _aux_layer_ids(hf_config, num_layers)
    if len(aux_ids) != 3 or not all(0 <= i <= num_layers for i in aux_ids):
        raise ValueError(
            f"the EAGLE-3 head {name} reads the target's layers {list(aux_ids)}: it needs three of 0.."
            f"{num_layers} (the target has {num_layers} layers); pick the head trained for this target"
        )
    files = [] if dummy else weight_files(path)
    if not dummy and not files:
        raise ValueError(
            f"the EAGLE-3 head {name} has no weights in {path} (*.safetensors or pytorch_model*.bin): "
            "download it again"
        )
    keys = frozenset(read_keys(files)) if files else frozenset()
    if files:
        missing = [k for k in REQUIRED_KEYS if k not in keys]
        if missing:
            raise ValueError(
                f"the checkpoint {name} has no EAGLE-3 tensors {', '.join(missing)}: it is not an EAGLE-3 "
                "head in the released format (midlayer.*, fc, norm, lm_head, d2t); use the head's "
                "checkpoint, or method draft_model for a plain smaller model"
            )
    has_embedding = "embed_tokens.weight" in keys
    tp = config.parallel.tensor_parallel_size
    if tp > 1 and not has_embedding and target_embedding_file(config) is None:
        raise ValueError(
            f"the EAGLE-3 head {name} has no embed_tokens of its own (or --load-format dummy gives it none) "
            f"and reads the target's, which --tensor-parallel-size {tp} splits over the ranks; rank 0 reads "
            f"it whole from the target's safetensors ({TARGET_EMBEDDING_KEY}), which "
            f"{config.model.model} does not have: run the target at --tensor-parallel-size 1, use a head "
            "with its own embedding, or use method draft_model or ngram"
        )
    hidden = int(hf_config.hidden_size)
    if not has_embedding and hidden != target_hidden:
        raise ValueError(
            f"the EAGLE-3 head {name} has hidden size {hidden} and no embedding of its own: it reads the "
            f"target's, of hidden size {target_hidden}; pick the head trained for this target"
        )
    d2t = read_tensor(files, "d2t") if "d2t" in keys else None
    if d2t is not None:
        d2t = d2t.to(torch.long).reshape(-1)
        if d2t.numel() != draft_vocab:
            raise ValueError(
                f"the EAGLE-3 head {name} has d2t of {d2t.numel()} entries, draft_vocab_size {draft_vocab}: "
                "the checkpoint and its config.json disagree; download the head again"
            )
        mapped = torch.arange(draft_vocab) + d2t
        low, high = int(mapped.min()), int(mapped.max())
        if low < 0 or high >= config.model.vocab_size:
            raise ValueError(
                f"the EAGLE-3 head {name} maps draft ids to target ids {low}..{high}, outside the target's "
                f"vocabulary of {config.model.vocab_size}: pick the head trained for this target"
            )
    elif files and draft_vocab != vocab:
        raise ValueError(
            f"the EAGLE-3 head {name} drafts over {draft_vocab} ids of a {vocab} vocabulary but has no d2t "
            "mapping to the target's ids: download the head again (d2t is part of the released format)"
        )
    return Eagle3Checkpoint(
        name, path, hf_config, tuple(files), keys, aux_ids, draft_vocab, has_embedding, d2t
    )


def check_eagle3_target(config: EngineConfig) -> None:
    """Refuses, before any weight loads, a target the head cannot read: a draft_tensor_parallel_size
    other than 1, a family whose decoder does not hand out its layers' streams."""
    from fitserve.models.decoder_blocks import DecoderForCausalLM
    from fitserve.models.registry import get_model_class

    check_one_device(config, "eagle3", "head")
    model_class = get_model_class(config.model.hf_config)
    if not issubclass(model_class, DecoderForCausalLM):
        raise ValueError(
            f"--speculative-config method eagle3 on {model_class.__name__} is not built yet: EAGLE-3 reads "
            "the hidden states of Llama, Mistral, Qwen2 and Qwen3 targets; use method ngram or draft_model "
            "for this model"
        )


def eagle3_kv_elements(config: EngineConfig) -> int:
    """The head's K and V elements per token (its one layer), from its config.json."""
    from fitserve.models.loader import load_hf_config

    spec = config.speculative
    path, _ = resolve_draft(spec.model, spec.revision)
    c = load_hf_config(path, trust_remote_code=config.model.trust_remote_code)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * int(heads) * int(head_dim_of(c))
