"""Speculative decoding's draft model (or EAGLE-3 head, or the target's own MTP layer) in the memory plan:
its weights and its KV per token, read from its config.json and weight headers (nothing loads), so the KV
cache's tokens and max concurrency stay right.

With a tensor-parallel target a draft model or EAGLE-3 head lives whole on rank 0 only, but the plan is one
rank's and alike for every rank (the engine takes the ranks' fewest blocks): the draft is counted whole on
it, so ranks 1.. keep that space unused (conservative). The MTP layer is split like the target's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fitserve.config import Choice
from fitserve.planner.formats import DTYPE_BYTES
from fitserve.planner.memory_estimates import draft_footprint
from fitserve.planner.memory_inputs import DraftFootprint, MemoryInputs
from fitserve.spec_decode.config import SpeculativeConfig, parse_speculative_config


def with_draft(
    inputs: MemoryInputs,
    speculative: SpeculativeConfig | dict[str, Any] | None,
    trust_remote_code: bool = False,
    load_format: str = "auto",
) -> MemoryInputs:
    """`inputs` with the draft model of `speculative` (a parsed config, or --speculative-config's raw
    value) counted; unchanged for other methods or none."""
    from fitserve.planner.model_info import inspect_model

    if not isinstance(speculative, SpeculativeConfig):
        speculative = parse_speculative_config(speculative)
    if speculative is not None:  # a hybrid's state pool keeps k more rows a request (worker/state_rings.py)
        inputs = replace(inputs, speculative_tokens=speculative.num_speculative_tokens)
    if speculative is not None and speculative.method == "eagle3" and speculative.model is not None:
        return replace(inputs, draft=_eagle3_footprint(inputs, speculative, trust_remote_code, load_format))
    if speculative is not None and speculative.method == "mtp":
        return replace(inputs, draft=mtp_footprint(inputs, speculative.num_speculative_tokens))
    if speculative is None or speculative.method != "draft_model" or speculative.model is None:
        return inputs
    dummy = "dummy" if load_format == "dummy" else "auto"
    info = inspect_model(speculative.model, speculative.revision, trust_remote_code, dummy)
    draft = draft_footprint(inputs, speculative.model, info.shape, info.weights, speculative.quantization)
    return replace(inputs, draft=draft)


def _eagle3_footprint(
    inputs: MemoryInputs, speculative: SpeculativeConfig, trust_remote_code: bool, load_format: str
) -> DraftFootprint:
    """An EAGLE-3 head (fitserve/spec_decode/eagle3/) in the target's dtype: its one layer, fc, norm,
    lm_head over the draft vocabulary, its embedding when the checkpoint has one (else under tensor parallel
    the target's, read whole for it), d2t, and the target's
    buffer of the three layers' hidden states (max_num_batched_tokens or max_num_seqs x (k + 1) rows);
    its KV: one layer's K and V per token."""
    from fitserve.models.loader import load_hf_config
    from fitserve.planner.draft_checkpoint import (
        eagle3_parameter_count,
        read_keys,
        resolve_draft,
        weight_files,
    )

    path, _ = resolve_draft(speculative.model, speculative.revision)
    config = load_hf_config(path, trust_remote_code=trust_remote_code)
    keys = set() if load_format == "dummy" else read_keys(weight_files(path))
    element = DTYPE_BYTES[inputs.dtype]
    own_embedding = "embed_tokens.weight" in keys
    weights = eagle3_parameter_count(config, own_embedding) * element
    if not own_embedding and inputs.tensor_parallel_size > 1:  # the target's read whole onto rank 0
        weights += int(config.vocab_size) * inputs.shape.hidden_size * element
    draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
    weights += draft_vocab * 8  # d2t
    k = speculative.num_speculative_tokens
    rows = max(inputs.max_num_batched_tokens, inputs.max_num_seqs * (k + 1))
    weights += rows * 3 * inputs.shape.hidden_size * element
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DraftFootprint(speculative.model, weights, 2 * int(heads) * int(head_dim))


def mtp_footprint(inputs: MemoryInputs, k: int) -> DraftFootprint:
    """The target's MTP layer (fitserve/spec_decode/mtp.py) in the target's dtype (the checkpoints keep it
    unquantized), on one tensor-parallel rank: fc and the norms whole on every rank, the decoder layer
    split like the target's (a rank holds whole K/V heads when ranks outnumber them), and the first rank's
    buffer of the target's output hidden states (max_num_batched_tokens or max_num_seqs x (k + 1) rows);
    its KV: one full-attention layer's K and V per token, of the rank's KV heads."""
    from fitserve.planner.qwen3_5_shape import qwen3_5_mtp_parameter_count

    shape = inputs.shape
    if not shape.model_type.startswith("qwen3_5"):
        raise ValueError(
            f"--speculative-config method mtp (the checkpoint's own MTP layers) on "
            f"{shape.architecture or shape.model_type} is not built: fitserve runs those of Qwen3.5 / "
            "Qwen3.6 checkpoints; use method ngram, draft_model or eagle3 for this model"
        )
    tp = inputs.tensor_parallel_size
    hidden, head_dim = shape.hidden_size, shape.head_dim
    count = qwen3_5_mtp_parameter_count(shape)
    # fc, its three norms, the layer's two norms and q/k norms: replicated (ReplicatedLinear, RMSNorm)
    replicated = 2 * hidden * hidden + 5 * hidden + 2 * head_dim
    kv_heads = shape.kv_heads_per_rank(tp)
    per_rank = replicated + -(-(count - replicated) // tp)
    per_rank += int(2 * hidden * head_dim * (kv_heads - shape.num_kv_heads / tp))  # replicated K/V heads
    element = DTYPE_BYTES[inputs.dtype]
    rows = max(inputs.max_num_batched_tokens, inputs.max_num_seqs * (k + 1))
    weights = (per_rank + rows * hidden) * element
    return DraftFootprint("MTP layer", weights, 2 * kv_heads * head_dim)


# ---- auto-MTP ---------------------------------------------------------------------------------------
# A checkpoint with an MTP layer speculates with it when --speculative-config is not given: the switch.
# The user turns it off with --speculative-config '{}' (speculation off) or any other config (which runs
# as given); vLLM itself never turns speculation on unasked.
AUTO_MTP = True
# draft tokens auto-MTP verifies per step (Qwen's recommendation for its MTP layer, vLLM recipes' 3)
AUTO_MTP_TOKENS = 3
AUTO_MTP_OFF = "--speculative-config '{}' turns it off"


@dataclass(frozen=True)
class AutoMtp:
    """Auto-MTP's decision for a checkpoint with an MTP layer: `config` is the --speculative-config to run
    (None: speculation stays off), `reason` says why, for the plan report."""

    config: dict[str, Any] | None
    reason: str

    def choice(self) -> Choice:
        value = "mtp" if self.config is not None else "off"
        return Choice("speculative_config", value, self.reason)


def auto_mtp(
    speculative_config: Any,
    hf_config: Any,
    model_path: str | None,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    load_format: str = "auto",
) -> AutoMtp | None:
    """Whether a checkpoint with an MTP layer (Qwen3.5 / Qwen3.6's `mtp.*`) speculates with it: None when
    auto-MTP does not apply (the switch is off, --speculative-config was given, '{}' included, or the model
    has no MTP layer fitserve runs); else on with AUTO_MTP_TOKENS draft tokens, or off with the reason (a
    setting method mtp does not run with, weights without the mtp tensors)."""
    from fitserve.models.qwen3_5_mtp import missing_mtp_keys, mtp_keys, mtp_layer_count, runs_mtp

    if not AUTO_MTP or speculative_config is not None:
        return None
    if not runs_mtp(hf_config) or mtp_layer_count(hf_config) != 1:
        return None
    off = "the checkpoint's MTP layer is not used for speculation"
    if pipeline_parallel_size > 1:  # tensor parallel runs it (worker/draft_steps.py)
        return AutoMtp(None, f"{off}; method mtp does not run with pipeline parallel")
    if load_format == "dummy":
        return AutoMtp(None, f"{off}; dummy weights: a random MTP layer's drafts are never accepted")
    if model_path is None:
        return AutoMtp(None, f"{off}; the weights are not local, so their mtp.* tensors are not checked")
    from fitserve.models.weights import list_safetensors_files

    try:
        missing = missing_mtp_keys(mtp_keys(list_safetensors_files(model_path))[1])
    except ValueError:  # no safetensors files: a config-only folder, or a .bin / GGUF checkpoint
        return AutoMtp(None, f"{off}; no safetensors weights here to find its mtp.* tensors in")
    if missing:
        return AutoMtp(None, f"{off}; the weights have no {missing[0]} (the export dropped the MTP layer)")
    config = {"method": "mtp", "num_speculative_tokens": AUTO_MTP_TOKENS}
    return AutoMtp(
        config,
        f"the checkpoint has an MTP layer: method mtp, {AUTO_MTP_TOKENS} draft tokens a step "
        f"({AUTO_MTP_OFF})",
    )
