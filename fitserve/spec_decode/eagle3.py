"""`eagle3` speculation: an EAGLE-3 draft head, in its released checkpoint format, drafts k tokens per
request from the target's own hidden states.

The checkpoint (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B; config `LlamaForCausalLMEagle3`): one decoder
layer `midlayer` whose q/k/v projections read [input_layernorm(embedding(token)), hidden_norm(hidden)]
(2 x hidden in), its MLP, `fc` (3 x the target's hidden -> hidden) over the target's residual streams at
three layers, `norm`, `lm_head` over a reduced draft vocabulary (`draft_vocab_size`) and `d2t` (draft id
-> target id offset; `t2d` is not needed). The embedding is the target's, unless the checkpoint has one.

The target's layers read: the config's `eagle_aux_hidden_state_layer_ids` (or `eagle_config`'s), else
vLLM's default for Llama, (2, L // 2, L - 3): the residual stream entering those layers, as HF's
`output_hidden_states` numbers them. The target copies them into a preallocated buffer inside its
forward (DecoderModel.keep_aux_hidden, only once this head is configured: a model without it runs its
forward unchanged), so its CUDA graphs, captured after this head is built, replay the copies too.

The head's row at position p reads (token p + 1, the target's streams at p) and predicts token p + 2. Its
own paged KV cache (one layer, a pool of as many blocks as the target's) holds the positions whose
streams came from the target. After each target step the engine hands the step's rows here
(`after_launch`): kept per request until their next token is known, and computed into the head's cache
(no logits) once more than `EAGER_ROWS` wait, so a long prompt or a long pause in speculation never
holds more than that many rows of streams per request. At a draft, per request:

1. catch up: the positions up to the last known token's predecessor (their streams from the target;
   zeros for those the target never computed here: a prefix-cache hit), all requests in one forward
   (split at max_num_batched_tokens); the last row's argmax over the draft vocabulary, mapped through
   d2t, is the first draft;
2. k - 1 more steps, one forward for the whole batch each: token = the draft before, hidden = the head's
   own output before the final norm at the row before (EAGLE's recurrence), on the device.

Drafts are greedy (point mass): the verify step keeps the target's distribution as it is. What the head
computes past the known tokens (its own drafts) is never kept: the next draft recomputes from the target's
streams at the accepted positions, written over those slots. With a tensor-parallel target the head lives
on rank 0's device only, built and run inside single_rank (distributed/parallel_state.py) as at tensor
parallel 1, reading rank 0's copy of the streams (the residual stream is whole on every rank); a head
without its own embedding reads the target's whole from the target's weights there (the target's rows
are split over the ranks), refused when they have none (dummy weights). The head's steps run eagerly (one
host sync per draft, the tokens' copy).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fitserve.core.scheduler import ScheduledRequest
from fitserve.distributed.parallel_state import single_rank
from fitserve.layers.attention.metadata import forward_context
from fitserve.layers.layernorm import RMSNorm
from fitserve.layers.linear import QKVParallelLinear, ReplicatedLinear
from fitserve.layers.rotary_embedding import RotaryEmbedding, rope_settings_from_config
from fitserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fitserve.models.decoder_blocks import DecoderAttention, DecoderSpec, GatedMLP, head_dim_of
from fitserve.models.parameter_loads import ParameterLoads
from fitserve.planner.draft_checkpoint import read_keys, resolve_draft, weight_files
from fitserve.spec_decode.draft_model import DraftModel, _DraftSequence, check_one_device
from fitserve.worker.step_inputs import build_host_inputs, upload_inputs

if TYPE_CHECKING:
    from fitserve.config import EngineConfig
    from fitserve.core.request import Request
    from fitserve.core.scheduler import SchedulerOutput

logger = logging.getLogger("fitserve")

GiB = 1 << 30
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# rows of target streams a request keeps before they are computed into the head's cache without a draft
EAGER_ROWS = 32
# a step of more rows than this copies out the rows still waiting after it (few: a prompt's last one)
COMPACT_ROWS = 256
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


# ---- the checkpoint: its config, its tensors, the checks (before any weight loads) ------------------
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


def _read_tensor(files: list[Path], key: str) -> torch.Tensor | None:
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


def _whole_target_embedding(config: EngineConfig) -> nn.Embedding:
    """The target's embedding, whole on this rank's device, read from its weights (target_embedding_file)."""
    weight = _read_tensor([target_embedding_file(config)], TARGET_EMBEDDING_KEY)
    weight = weight.to(device=config.device.torch_device, dtype=config.model.dtype)
    return nn.Embedding.from_pretrained(weight, freeze=True)


def _iterate(files: Iterable[Path]) -> Iterable[tuple[str, torch.Tensor]]:
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
    d2t = _read_tensor(files, "d2t") if "d2t" in keys else None
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


def aux_buffer_rows(config: EngineConfig) -> int:
    """Rows of the target's stream buffer: the most tokens one step computes (a prefill chunk, a verify
    step of every sequence with k drafts, a CUDA graph's padded batch)."""
    k = config.speculative.num_speculative_tokens
    scheduler = config.scheduler
    return max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * (k + 1))


# ---- the head as a module -------------------------------------------------------------------------
class Eagle3Head(nn.Module):
    """The checkpoint's modules, under its names (midlayer.*, fc, norm, lm_head, embed_tokens)."""

    def __init__(self, hf_config: Any, target_hidden: int, max_positions: int, own_embedding: bool) -> None:
        super().__init__()
        c = hf_config
        hidden = int(c.hidden_size)
        self.hidden_size = hidden
        self.draft_vocab_size = int(getattr(c, "draft_vocab_size", None) or c.vocab_size)
        self.norm_before_residual = bool(getattr(c, "norm_before_residual", False))
        bias = bool(getattr(c, "attention_bias", False))
        self.midlayer = nn.Module()
        self.midlayer.hidden_norm = RMSNorm(hidden, c.rms_norm_eps)
        self.midlayer.input_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        self.midlayer.post_attention_layernorm = RMSNorm(hidden, c.rms_norm_eps)
        attention = DecoderAttention(c, DecoderSpec(qkv_bias=bias, o_bias=bias), 0, None)
        # q/k/v read [embedding, hidden]: twice the hidden size in
        attention.qkv_proj = QKVParallelLinear(
            2 * hidden, attention.head_dim, c.num_attention_heads, attention.num_kv_heads, bias=bias
        )
        self.midlayer.self_attn = attention
        self.midlayer.mlp = GatedMLP(
            hidden, c.intermediate_size, bool(getattr(c, "mlp_bias", False)), c.hidden_act
        )
        self.fc = ReplicatedLinear(3 * target_hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, c.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.embed_tokens = VocabParallelEmbedding(int(c.vocab_size), hidden) if own_embedding else None
        self.rotary_emb = RotaryEmbedding(head_dim_of(c), rope_settings_from_config(c), max_positions)
        # draft id -> target id offset (zeros: the draft vocabulary is the target's first ids)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long), persistent=False)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embeddings [T, H], hidden [T, H]: fc of the target's streams, or the head's own output
        before) -> (normed output for the logits, output before the final norm: the next step's hidden)."""
        layer = self.midlayer
        rope = self.rotary_emb.rope_for_step(positions, embeds.dtype)
        embeds = layer.input_layernorm.forward(embeds)
        if self.norm_before_residual:
            hidden = layer.hidden_norm.forward(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = layer.hidden_norm.forward(hidden)
        x = torch.cat([embeds, hidden], dim=-1)
        attend = layer.self_attn.forward_cpu if rope.cos is not None else layer.self_attn.forward
        x = attend(x, rope)
        x, residual = layer.post_attention_layernorm.forward(x, residual)
        x = layer.mlp.forward(x)
        return self.norm.forward(x, residual)

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy over the draft vocabulary, as target ids."""
        ids = self.lm_head(normed).argmax(dim=-1)
        return ids + self.d2t[ids]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loads = ParameterLoads(self)
        packed = {
            "q_proj": ("qkv_proj", "q"),
            "k_proj": ("qkv_proj", "k"),
            "v_proj": ("qkv_proj", "v"),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
        for name, tensor in weights:
            if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.long).reshape(-1))
                continue
            name = name.removeprefix("model.")
            if name.startswith("layers.0."):  # some conversions name the midlayer as layer 0
                name = "midlayer." + name.removeprefix("layers.0.")
            if name.startswith("embed_tokens.") and self.embed_tokens is None:
                continue
            target, module, shard_id = name, "", None
            for checkpoint_module, (packed_module, shard) in packed.items():
                marker = f".{checkpoint_module}."
                if marker in name:
                    target, module, shard_id = (
                        name.replace(marker, f".{packed_module}."),
                        packed_module,
                        shard,
                    )
                    break
            loads.load(name, target, tensor, shard_id, shards.get(module, ()))
        return loads.loaded

    def initialize_dummy(self, seed: int) -> None:
        """Random weights (the target's --load-format dummy): normal(0, 0.02) matrices, unit norms, d2t 0."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed + 3)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                values = torch.randn(param.shape, generator=generator) * 0.02
                param.data.copy_(values.to(param.dtype))


# ---- the drafter at run time ------------------------------------------------------------------------
class _Shifted:
    """A request's tokens seen from the head: its row p reads token p + 1, so its known tokens are the
    request's less the first (what build_host_inputs reads: len and slices)."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens) - 1

    def __getitem__(self, index: slice) -> list[int]:
        start = (index.start or 0) + 1
        stop = None if index.stop is None else index.stop + 1
        return self.tokens[start:stop]


@dataclass
class _HeadSequence(_DraftSequence):
    # the target's streams not yet computed into the head's cache: (first position, rows [n, 3 x H])
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class Eagle3Drafter(DraftModel):
    """DraftModel's bookkeeping (pool, block tables, room, release) around the head: it is a DraftModel
    whose `_sequence` and `_draft` follow EAGLE's recurrence."""

    def __init__(self, config: EngineConfig, checkpoint: Eagle3Checkpoint, target: nn.Module) -> None:
        from fitserve.kv_layers import kv_layer_specs
        from fitserve.worker.block_table_rows import BlockTableRows
        from fitserve.worker.transfer import PinnedStagingRing

        self.config = config
        self.checkpoint = checkpoint
        self.model_config = config.model  # the pool's dtype is the target's
        self.k = config.speculative.num_speculative_tokens
        self.device = config.device.torch_device
        self.block_size = config.cache.block_size
        started = time.perf_counter()
        max_positions = max(
            int(getattr(checkpoint.hf_config, "max_position_embeddings", 0)),
            config.model.max_model_len + self.k,
        )
        target_hidden = int(config.model.hf_config.hidden_size)
        from fitserve.models.loader import default_dtype

        with default_dtype(config.model.dtype), self.device, single_rank():  # whole, on this rank's device
            self.head = Eagle3Head(
                checkpoint.hf_config, target_hidden, max_positions, checkpoint.has_embedding
            )
        with torch.no_grad():
            if checkpoint.files:
                loaded = self.head.load_weights(_iterate(checkpoint.files))
                wanted = {name for name, _ in self.head.named_parameters()}
                missing = sorted(wanted - loaded)
                if missing:
                    raise ValueError(
                        f"the EAGLE-3 head {checkpoint.name} has no weights for {', '.join(missing[:6])}: "
                        "the checkpoint does not match its config.json; download it again"
                    )
            else:
                self.head.initialize_dummy(config.model.seed)
        self.head.eval()
        self.embed = self.head.embed_tokens or target.model.embed_tokens
        if self.head.embed_tokens is None and config.parallel.tensor_parallel_size > 1:
            self.embed = _whole_target_embedding(config)  # the target's own is split over the ranks
        # the target keeps its streams at the head's layers from now on (before its graphs are captured)
        self.aux = target.model.keep_aux_hidden(checkpoint.aux_layer_ids, aux_buffer_rows(config))
        self.weight_bytes = sum(t.numel() * t.element_size() for t in self.head.parameters())
        if isinstance(self.embed, nn.Embedding):  # the target's embedding read whole for the head
            self.weight_bytes += self.embed.weight.numel() * self.embed.weight.element_size()
        self.weight_bytes += self.aux.numel() * self.aux.element_size()
        logger.info(
            "EAGLE-3 head %s loaded: %.2f GiB (with the target's stream buffer) in %.1f s, reading the "
            "target's layers %s, %d draft ids",
            checkpoint.name,
            self.weight_bytes / GiB,
            time.perf_counter() - started,
            list(checkpoint.aux_layer_ids),
            checkpoint.draft_vocab_size,
        )
        self.vocab_size = config.model.vocab_size
        self.specs = kv_layer_specs(checkpoint.hf_config)
        self.layer_group = [0]
        self.staging = PinnedStagingRing(self.device)
        self.table_rows = BlockTableRows(-(-(config.model.max_model_len + self.k) // self.block_size))
        self.kv_manager = None
        self.kv_caches = []
        self.sequences: dict[str, _HeadSequence] = {}  # type: ignore[assignment]
        self._zeros: torch.Tensor | None = None

    # ---- the target's streams -----------------------------------------------------------------------
    @torch.inference_mode()
    def after_launch(self, scheduler_output: SchedulerOutput) -> None:
        """Keeps the step's streams (queued on the device after its forward, before the next one writes
        the buffer over), per request by position; a request with more than EAGER_ROWS waiting computes
        those whose next token is known into the head's cache now (one forward for all such requests)."""
        if self.kv_manager is None:
            return
        items = scheduler_output.scheduled
        total = sum(item.num_new_tokens for item in items)
        rows = min(total, self.aux.shape[0])
        if rows == 0:
            return
        step = self.aux[:rows].clone()
        offset = 0
        eager: list[tuple[_HeadSequence, int]] = []
        touched: list[_HeadSequence] = []
        for item in items:
            request, n = item.request, item.num_new_tokens
            first = offset
            offset += n
            if first >= rows:
                continue
            seq = self._sequence_of(request)
            kept = step[first : min(first + n, rows)]
            start = item.start
            pending = seq.pending
            if pending and pending[-1][0] + pending[-1][1].shape[0] > start:  # recomputed: later rows win
                pending = [(s, t[: start - s]) for s, t in pending if s < start]
                seq.pending = pending
            pending.append((start, kept))
            touched.append(seq)
            waiting = sum(t.shape[0] for _, t in seq.pending)
            # rows whose stream the target has computed (not a later prompt chunk's) and next token is known
            upto = min(len(request.all_token_ids) - 2, start + n - 1)
            if waiting > EAGER_ROWS and upto >= seq.num_computed_tokens:
                eager.append((seq, upto))
        if eager:
            self._catch_up(eager, sample=False)
        if rows > COMPACT_ROWS:  # a large step's copy is not kept alive by the few rows still waiting
            storage = step.untyped_storage().data_ptr()

            def compact(t: torch.Tensor) -> torch.Tensor:
                viewed = t.untyped_storage().data_ptr() == storage  # (inference tensors keep no _base)
                return t.clone() if viewed and t.shape[0] * 4 < rows else t

            for seq in touched:
                seq.pending = [(s, compact(t)) for s, t in seq.pending]

    def _sequence_of(self, request: Request) -> _HeadSequence:
        seq = self.sequences.get(request.request_id)
        if seq is not None and seq.num_preemptions != request.num_preemptions:
            self._free(request.request_id)  # recomputed from its start, as the target recomputes it
            seq = None
        if seq is None:
            seq = _HeadSequence(
                request.request_id,
                _Shifted(request.all_token_ids),  # type: ignore[arg-type]
                request.num_prompt_tokens,
                request.num_preemptions,
            )
            self.sequences[request.request_id] = seq
        else:
            seq.all_token_ids = _Shifted(request.all_token_ids)  # type: ignore[assignment]
        return seq

    def _aux_rows(self, seq: _HeadSequence, first: int, last: int) -> list[torch.Tensor]:
        """The target's streams at positions first..last (zeros where none was kept: a prefix-cache hit,
        a head state started over)."""
        pieces: list[torch.Tensor] = []
        position = first
        for start, rows in seq.pending:
            end = start + rows.shape[0]
            if end <= position:
                continue
            if start > last:
                break
            if start > position:
                pieces.append(self._zero_rows(start - position))
                position = start
            take = min(end, last + 1) - position
            pieces.append(rows[position - start : position - start + take])
            position += take
            if position > last:
                break
        if position <= last:
            pieces.append(self._zero_rows(last + 1 - position))
        return pieces

    def _zero_rows(self, n: int) -> torch.Tensor:
        if self._zeros is None or self._zeros.shape[0] < n:
            self._zeros = torch.zeros(max(n, 64), self.aux.shape[1], dtype=self.aux.dtype, device=self.device)
        return self._zeros[:n]

    # ---- DraftModel's hooks -------------------------------------------------------------------------
    def _free(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.kv_manager.free(seq)  # nothing to give back for one that never drafted
            self.table_rows.release(request_id)

    def _sequence(self, request: Request) -> _HeadSequence:
        """The request's head state: what it computed is kept (it came from the target's streams at known
        positions), except the last known token's predecessor, recomputed to give the first draft."""
        seq = self._sequence_of(request)
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(request.all_token_ids) - 2)
        return seq

    def _room(self, request: Request) -> int:
        if request.num_tokens < 2:  # the head's first row reads the second token
            return 0
        return super()._room(request)

    @torch.inference_mode()
    def propose(self, requests: list[Request], running_ids: set[str]) -> list[list[int]]:
        for request_id in [r for r in self.sequences if r not in running_ids]:
            self._free(request_id)
        wanted: list[tuple[_HeadSequence, int]] = []
        for request in requests:
            count = self._room(request)
            if count <= 0:
                continue
            seq = self._sequence(request)
            # slots up to the last draft fed back: position N - 2 + count - 1
            need = len(request.all_token_ids) - 2 + count - seq.num_computed_tokens
            if not self._allocate(seq, need):
                continue
            wanted.append((seq, count))
        drafts: dict[str, list[int]] = {}
        if wanted:
            drafts = self._draft(wanted)
        return [drafts.get(r.request_id, []) for r in requests]

    def _allocate(self, seq: _HeadSequence, need: int) -> bool:
        if not self.kv_manager.allocate_slots(seq, max(need, 0)):
            self._free(seq.request_id)  # the pool is short: this request starts over later
            return False
        return True

    def _draft(self, wanted: list[tuple[_HeadSequence, int]]) -> dict[str, list[int]]:
        """Catch-up forwards whose last rows give the first drafts, then k - 1 recurrent steps."""
        count_of = {seq.request_id: count for seq, count in wanted}
        tokens, prenorm, index = self._catch_up(
            [(seq, len(seq.all_token_ids.tokens) - 2) for seq, _ in wanted],
            sample=True,  # type: ignore
        )
        steps = [(tokens, dict(index))]
        for j in range(1, max(count_of.values())):
            active = [seq for seq, count in wanted if count > j]
            items = [self._item(seq, len(seq.all_token_ids) + j - 1, 1, samples=True) for seq in active]
            tokens, prenorm = self._step(items, (tokens, index), prenorm)
            index = {seq.request_id: i for i, seq in enumerate(active)}
            steps.append((tokens, dict(index)))
        host = torch.cat([t for t, _ in steps]).tolist()
        starts = [0]
        for t, _ in steps:
            starts.append(starts[-1] + t.shape[0])
        return {
            seq.request_id: [host[starts[j] + steps[j][1][seq.request_id]] for j in range(count)]
            for seq, count in wanted
        }

    def _catch_up(
        self, targets: list[tuple[_HeadSequence, int]], sample: bool
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
        """Computes each sequence's positions up to its `last` from the target's streams, in forwards of at
        most max_num_batched_tokens rows. `sample`: each sequence's last row gives (its first draft, its
        output before the final norm), returned in one tensor each with the row of each request."""
        budget = self.config.scheduler.max_num_batched_tokens
        sampled: list[torch.Tensor] = []
        prenorms: list[torch.Tensor] = []
        index: dict[str, int] = {}
        offset = 0
        pending = []
        for seq, last in targets:
            if not sample:  # blocks for rows without a draft (a draft allocates its own before)
                need = last + 1 - seq.num_computed_tokens
                if need <= 0 or not self._allocate(seq, need):
                    continue
            pending.append((seq, last))
        while pending:
            items: list[ScheduledRequest] = []
            streams: list[torch.Tensor] = []
            left = budget
            rest = []
            for seq, last in pending:
                missing = last + 1 - seq.num_computed_tokens
                n = min(missing, left)
                if n <= 0:
                    rest.append((seq, last))
                    continue
                first = seq.num_computed_tokens
                items.append(self._item(seq, first, n, samples=sample and n == missing))
                streams.extend(self._aux_rows(seq, first, first + n - 1))
                seq.num_computed_tokens += n
                left -= n
                if n < missing:
                    rest.append((seq, last))
            # fc is replicated (no collective); MtpDrafter shares this catch-up, its layer split over ranks
            hidden = self.head.fc.forward(torch.cat(streams) if len(streams) > 1 else streams[0])
            result = self._forward_rows(items, None, hidden)
            if result is not None:
                tokens, prenorm = result
                sampling = [item for item in items if item.samples]
                for row, item in enumerate(sampling):
                    index[item.request.request_id] = offset + row
                offset += len(sampling)
                sampled.append(tokens)
                prenorms.append(prenorm)
            pending = rest
        for seq, _ in targets:  # streams the head holds now are not needed again (but the last one's)
            keep_from = seq.num_computed_tokens - 1
            seq.pending = [
                (max(s, keep_from), t[max(0, keep_from - s) :])
                for s, t in seq.pending
                if s + t.shape[0] > keep_from
            ]
        if not sample:
            return None, None, {}  # type: ignore[return-value]
        tokens = torch.cat(sampled) if len(sampled) > 1 else sampled[0]
        prenorm = torch.cat(prenorms) if len(prenorms) > 1 else prenorms[0]
        return tokens, prenorm, index

    def _step(
        self,
        items: list[ScheduledRequest],
        previous: tuple[torch.Tensor, dict[str, int]],
        prenorm: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One recurrent step: each row's token is the draft of its request's row before and its hidden
        that row's output before the final norm (both read on the device)."""
        tokens, prenorm_out = self._forward_rows(items, previous, prenorm)
        return tokens, prenorm_out

    def _forward_rows(
        self,
        items: list[ScheduledRequest],
        previous: tuple[torch.Tensor, dict[str, int]] | None,
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One forward of the head over `items`; the draft (target id) and the output before the final norm
        of each sampling row. `previous`: the step before's drafts and each request's row among them
        (rows past the known tokens read their token there, and their hidden from `hidden` at that row)."""
        index = previous[1] if previous is not None else {}
        host, _ = build_host_inputs(items, self.block_size, self.table_rows, None, index.__getitem__)
        inputs = upload_inputs(host, self.staging, self.layer_group)
        if inputs.fill is not None:
            rows, sources = inputs.fill
            inputs.input_ids[rows] = previous[0][sources]
            hidden = hidden[sources]  # every row of a recurrent step reads the row before
        with single_rank():  # the head alone: no collectives beside a tensor-parallel target
            with forward_context(inputs.metadata, self.kv_caches):
                normed, prenorm = self.head.forward(self.embed(inputs.input_ids), hidden, inputs.positions)
            if not any(item.samples for item in items):
                return None
            if inputs.sample_rows is not None:
                normed, prenorm = normed[inputs.sample_rows], prenorm[inputs.sample_rows]
            return self.head.draft_ids(normed), prenorm
