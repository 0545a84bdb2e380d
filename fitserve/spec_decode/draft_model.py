"""`draft_model` speculation: a smaller model of the target's vocabulary drafts k tokens per request.

Drafts are the draft model's greedy (argmax) tokens: a point-mass proposal, so the target's verify step
(fitserve/spec_decode/verify.py: draw the target's own token at each position, accept while it equals the
draft) keeps the target's distribution exactly, at any temperature, with no change to it.

The draft is loaded by fitserve's own loader and registry (any architecture fitserve runs; dummy weights
when the target's are) on the target's device, and keeps its own paged KV cache: a KVCacheManager over a
pool of as many blocks as the target's (prefix caching off: the draft recomputes what the target found in
its prefix cache), its own block table rows, and the runner's step inputs (build_host_inputs,
upload_inputs, forward_context). Per step, for the requests that are decoding:

1. catch up: each computes the tokens it has not seen (first the prompt, later what the verify step
   accepted since its last draft, the target's bonus or correction token included), all requests in one
   forward (split at max_num_batched_tokens); the last row gives the first draft;
2. k - 1 more decode steps, one forward per draft position for the whole batch, each row's token taken on
   the device from the step before (no host round trip between them).

What the draft keeps is checked against the request's tokens at the next draft: drafts the target
refused are not counted (the draft's computed length goes back to the accepted ones, their slots are
written over), so a step without drafts (the speculator's back-off), a grammar that cut the drafts, a stop
mid-draft or max_tokens leave nothing to undo. A request that finished gives its blocks back at the next
schedule, one that was preempted at the next draft (recomputed then, as the target recomputes it).

With a tensor-parallel target the draft lives on rank 0's device only (the engine's process, where the
speculator runs), built and run inside single_rank (distributed/parallel_state.py): whole, without
collectives, as at tensor_parallel_size 1; the other ranks see only the target's verify steps.
draft_tensor_parallel_size must be 1. CUDA graphs are not captured for the draft's steps (they run
eagerly, one host sync per draft: the tokens' copy).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from fitserve.core.kv_cache import KVCacheManager
from fitserve.core.scheduler import ScheduledRequest
from fitserve.distributed.parallel_state import single_rank
from fitserve.kv_groups import kv_cache_groups
from fitserve.kv_layers import LINEAR, kv_layer_specs
from fitserve.layers.attention.metadata import forward_context
from fitserve.planner.draft_checkpoint import resolve_draft
from fitserve.spec_decode.draft_slots import DraftSequence, DraftSlots
from fitserve.worker.block_table_rows import BlockTableRows
from fitserve.worker.kv_allocation import layer_caches
from fitserve.worker.step_inputs import build_host_inputs, upload_inputs
from fitserve.worker.transfer import PinnedStagingRing

if TYPE_CHECKING:
    from fitserve.config import EngineConfig, ModelConfig
    from fitserve.core.request import Request

logger = logging.getLogger("fitserve")

GiB = 1 << 30


# ---- checks and the draft's configuration (before any weight loads) ---------------------------------
def check_one_device(config: EngineConfig, method: str, drafter: str) -> None:
    """Refuses a draft_tensor_parallel_size other than 1: the `drafter` ("draft", "head") of `method`
    runs whole on rank 0's device beside a tensor-parallel target (single_rank), never split."""
    tp = config.parallel.tensor_parallel_size
    draft_tp = config.speculative.draft_tensor_parallel_size
    if draft_tp is not None and draft_tp != 1:
        raise ValueError(
            f"--speculative-config method {method} with draft_tensor_parallel_size {draft_tp} (target "
            f"--tensor-parallel-size {tp}) is not built: fitserve runs the {drafter} whole on the first "
            "GPU beside the target's ranks, so set draft_tensor_parallel_size 1 or drop the key"
        )


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft's ModelConfig (the target's dtype, max_model_len, load format when dummy, seed), after
    refusing what cannot run: tensor parallelism, a vocabulary other than the target's, a context shorter
    than max_model_len, a hybrid or sliding-window draft. Warns when the draft is not smaller."""
    from fitserve.config import ModelConfig
    from fitserve.models.loader import load_hf_config, model_max_length

    spec = config.speculative
    assert spec is not None and spec.model is not None
    check_one_device(config, "draft_model", "draft")
    path, source = resolve_draft(spec.model, spec.revision)
    hf_config = load_hf_config(path, trust_remote_code=config.model.trust_remote_code)
    _check_vocab(config, spec.model, path, hf_config)
    context = model_max_length(hf_config)
    if spec.max_model_len is not None:
        context = min(context, spec.max_model_len)
    target_len = config.model.max_model_len
    if context < target_len:
        raise ValueError(
            f"the draft model {spec.model} reads at most {context} tokens, fewer than max_model_len "
            f"{target_len}: set --max-model-len {context} or less, or pick a draft with a longer context"
        )
    specs = kv_layer_specs(hf_config)
    if any(s.layer_type == LINEAR for s in specs):
        raise ValueError(
            f"the draft model {spec.model} is a hybrid (layers with recurrent state), which a draft cannot "
            "roll back yet: pick an attention-only draft (e.g. a Llama, Qwen3 or SmolLM2 checkpoint)"
        )
    batched, block_size = config.scheduler.max_num_batched_tokens, config.cache.block_size
    groups = kv_cache_groups(specs, target_len, batched, block_size, 1)
    if len(groups) > 1:
        raise ValueError(
            f"the draft model {spec.model} has sliding-window layers at max_model_len {target_len}, not "
            "built for a draft yet: pick a draft without sliding windows, or lower --max-model-len to "
            "its window"
        )
    _warn_if_not_smaller(spec.model, hf_config, config.model.hf_config)
    load_format = "dummy" if config.model.load_format == "dummy" else "auto"
    return ModelConfig(
        model=spec.model,
        model_path=path,
        model_source=source,
        tokenizer=path,
        hf_config=hf_config,
        dtype=config.model.dtype,
        max_model_len=target_len,
        load_format=load_format,
        seed=config.model.seed,
        trust_remote_code=config.model.trust_remote_code,
        revision=spec.revision,
        quantization=spec.quantization,
    )


def _check_vocab(config: EngineConfig, name: str, path: str, hf_config: Any) -> None:
    """The draft's vocabulary must be the target's. Config vocab sizes may differ by padded embedding rows
    (Qwen2.5's 0.5B and 7B: 151,936 and 152,064 rows over one tokenizer): then the tokenizers decide."""
    target = config.model.vocab_size
    draft = int(hf_config.vocab_size)
    if draft == target:
        return
    from fitserve.models.loader import load_tokenizer

    use_fast = config.model.tokenizer_mode != "slow"
    trust = config.model.trust_remote_code
    target_tokens = len(load_tokenizer(config.model.tokenizer, trust, use_fast))
    try:
        draft_tokens = len(load_tokenizer(path, trust, use_fast))
    except Exception:  # noqa: BLE001 - a draft folder without a tokenizer: the sizes decide alone
        draft_tokens = None
    if draft_tokens == target_tokens and min(draft, target) >= target_tokens:
        return
    raise ValueError(
        f"the draft model {name} has a vocabulary of {draft} tokens, the target {config.model.model} "
        f"{target}: a draft must use the target's tokenizer; pick a smaller model of the same family "
        "(e.g. Llama-3.2-1B for Llama-3.1-8B, Qwen3-0.6B for Qwen3-8B)"
    )


def _warn_if_not_smaller(name: str, draft_config: Any, target_config: Any) -> None:
    from fitserve.planner.model_shape import ModelShape

    try:
        draft = ModelShape.from_hf_config(draft_config).parameter_counts().total
        target = ModelShape.from_hf_config(target_config).parameter_counts().total
    except Exception:  # noqa: BLE001 - a shape the planner does not model: no comparison
        return
    if draft >= target:
        logger.warning(
            "The draft model %s has %.2fB parameters, not fewer than the target's %.2fB: a draft step "
            "then costs as much as a target step and speculation is slower than none; pick a smaller draft",
            name,
            draft / 1e9,
            target / 1e9,
        )


def draft_kv_bytes_per_token(config: EngineConfig) -> int:
    """The draft's KV cache bytes per token (every layer's K and V in the cache's element type); 0 without
    a draft. The target's pool is sized with this added, and the draft's pool has as many blocks."""
    spec = config.speculative
    if spec is None or spec.method not in ("draft_model", "eagle3"):
        return 0
    element = config.cache.torch_kv_cache_dtype(config.model.dtype).itemsize
    if spec.method == "eagle3":  # the head's one layer (fitserve/spec_decode/eagle3/)
        from fitserve.spec_decode.eagle3.checkpoint import eagle3_kv_elements

        return eagle3_kv_elements(config) * element
    return _draft_kv_elements(spec.model, spec.revision, config.model.trust_remote_code) * element


_KV_ELEMENTS: dict[tuple[str, str | None], int] = {}


def _draft_kv_elements(model: str, revision: str | None, trust_remote_code: bool) -> int:
    key = (model, revision)
    if key not in _KV_ELEMENTS:
        from fitserve.models.loader import load_hf_config

        path, _ = resolve_draft(model, revision)
        specs = kv_layer_specs(load_hf_config(path, trust_remote_code=trust_remote_code))
        owned = [spec for index, spec in enumerate(specs) if spec.owns_cache(index)]
        _KV_ELEMENTS[key] = sum(2 * spec.num_kv_heads * spec.head_dim for spec in owned)
    return _KV_ELEMENTS[key]


# ---- the draft at run time ---------------------------------------------------------------------------
class DraftModel(DraftSlots):
    """The draft model, its KV pool and its forwards; DraftSlots keeps each request's state and slots."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        from fitserve.models.loader import load_model
        from fitserve.worker.model_runner import loaded_model_bytes

        self.config = config
        self.model_config = model_config
        self.k = config.speculative.num_speculative_tokens
        self.device = config.device.torch_device
        self.block_size = config.cache.block_size
        started = time.perf_counter()
        with single_rank():  # whole on this rank's device beside a tensor-parallel target
            self.model = load_model(model_config, self.device)
        self.weight_bytes = loaded_model_bytes(self.model)
        logger.info(
            "Draft model %s loaded: %.2f GiB in %.1f s",
            model_config.model,
            self.weight_bytes / GiB,
            time.perf_counter() - started,
        )
        # drafts are argmax over the vocabulary both models share (padded rows of either are never drafted)
        self.vocab_size = min(int(model_config.hf_config.vocab_size), config.model.vocab_size)
        self.specs = kv_layer_specs(model_config.hf_config)
        self.layer_group = [0] * len(self.specs)
        self.staging = PinnedStagingRing(self.device)
        # positions reach max_model_len + k - 2 (drafts past a request's last token)
        self.table_rows = BlockTableRows(-(-(model_config.max_model_len + self.k) // self.block_size))
        self.kv_manager: KVCacheManager | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.sequences: dict[str, DraftSequence] = {}

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The draft's pool: as many blocks as the target's (the plan sized both with one per-token cost)."""
        dtype = self.config.cache.torch_kv_cache_dtype(self.model_config.dtype)
        self.kv_caches = layer_caches(
            self.specs, self.layer_group, num_blocks, self.block_size, dtype, self.device
        )
        self.kv_manager = KVCacheManager(num_blocks, self.block_size, enable_prefix_caching=False)
        allocated = sum(t.numel() * t.element_size() for t in self.kv_caches)
        logger.info(
            "Draft model KV cache: %d blocks of %d (%.2f GiB)", num_blocks, self.block_size, allocated / GiB
        )
        self._warm_up()

    def _warm_up(self) -> None:
        """One draft of a 2-token request, given back at once: the draft's kernels (a prompt forward,
        the decode steps) compile at startup, not at the first request."""
        from fitserve.core.request import Request
        from fitserve.core.sampling_params import SamplingParams

        request = Request("draft-warm-up", "draft-warm-up", 0, [0, 0], SamplingParams(), frozenset())
        self.propose([request], {request.request_id})
        self._free(request.request_id)

    # ---- DraftSlots' hooks -------------------------------------------------------------------------
    def _sequence(self, request: Request) -> DraftSequence:
        """The request's draft state, its computed length set back to what the request's tokens confirm."""
        seq = self.sequences.get(request.request_id)
        if seq is not None and seq.num_preemptions != request.num_preemptions:
            self._free(request.request_id)  # preempted since: recomputed, as the target is
            seq = None
        if seq is None:
            seq = DraftSequence(
                request.request_id, request.all_token_ids, request.num_prompt_tokens, request.num_preemptions
            )
            self.sequences[request.request_id] = seq
            return seq
        tokens = request.all_token_ids
        seq.all_token_ids = tokens
        if seq.drafted:
            kept = 0
            for j, draft in enumerate(seq.drafted):
                position = seq.drafted_at + j
                if position >= len(tokens) or tokens[position] != draft:
                    break
                kept += 1
            seq.num_computed_tokens = seq.drafted_at + kept
            seq.drafted = ()
        # the draft computes the last known token itself (its logits give the first draft)
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(tokens) - 1)
        return seq

    def _slots_needed(self, request: Request, seq: DraftSequence, count: int) -> int:
        """Slots for the tokens to catch up and the count - 1 drafts fed back."""
        return len(request.all_token_ids) + count - 1 - seq.num_computed_tokens

    # ---- drafting -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _draft(self, wanted: list[tuple[DraftSequence, int]]) -> dict[str, list[int]]:
        """The drafts of each (sequence, how many to draft), by request id; blocks already allocated."""
        budget = self.config.scheduler.max_num_batched_tokens
        # 1. catch up, in forwards of at most `budget` tokens; each request's last row drafts its first
        sampled: list[torch.Tensor] = []
        first_index: dict[str, int] = {}
        offset = 0
        pending = list(wanted)
        while pending:
            items: list[ScheduledRequest] = []
            left = budget
            rest: list[tuple[DraftSequence, int]] = []
            for seq, count in pending:
                missing = len(seq.all_token_ids) - seq.num_computed_tokens
                n = min(missing, left)
                if n <= 0:
                    rest.append((seq, count))
                    continue
                items.append(self._item(seq, seq.num_computed_tokens, n, samples=n == missing))
                seq.num_computed_tokens += n
                left -= n
                if n < missing:
                    rest.append((seq, count))
            sampling = [item for item in items if item.samples]
            if sampling:
                sampled.append(self._forward(items, None))
                for row, item in enumerate(sampling):
                    first_index[item.request.request_id] = offset + row
                offset += len(sampling)
            else:  # only partial prompt chunks: keys and values, no logits
                self._forward(items, None, logits=False)
            pending = rest
        # 2. k - 1 decode steps, each row's token the one the step before drafted (on the device)
        first = torch.cat(sampled) if len(sampled) > 1 else sampled[0]
        drafts = self._recurrent_drafts(wanted, (first, first_index), self._forward)
        for seq, _ in wanted:
            # the drafts fed back (all but the last) have keys and values after the known tokens
            seq.drafted_at = len(seq.all_token_ids)
            seq.drafted = tuple(drafts[seq.request_id][:-1])
        return drafts

    def _recurrent_drafts(
        self,
        wanted: list[tuple[DraftSequence, int]],
        first: tuple[torch.Tensor, dict[str, int]],
        step: Any,
    ) -> dict[str, list[int]]:
        """Each request's drafts by id: `first` (the first drafts, each request's row among them), then
        `step(items, previous)` for the next position of every request that wants more, whose row reads its
        token from the step before's drafts on the device; one copy to the host for the whole draft."""
        tokens, index = first
        steps = [(tokens, dict(index))]
        for j in range(1, max(count for _, count in wanted)):
            active = [seq for seq, count in wanted if count > j]
            items = [self._item(seq, len(seq.all_token_ids) + j - 1, 1, samples=True) for seq in active]
            tokens = step(items, (tokens, index))
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

    def _item(self, seq: DraftSequence, start: int, n: int, samples: bool) -> ScheduledRequest:
        block_ids = self.kv_manager.block_ids(seq.request_id)
        return ScheduledRequest(seq, start, n, block_ids, samples)  # type: ignore[arg-type]

    def _forward(
        self,
        items: list[ScheduledRequest],
        previous: tuple[torch.Tensor, dict[str, int]] | None,
        logits: bool = True,
    ) -> torch.Tensor | None:
        """One forward of the draft over `items`; the argmax token of each sampling row, on the device.
        `previous`: the tokens of the draft step before and each request's row among them, read for the
        rows whose token is past the request's known ones."""
        index = previous[1] if previous is not None else {}
        host, _ = build_host_inputs(items, self.block_size, self.table_rows, None, index.__getitem__)
        inputs = upload_inputs(host, self.staging, self.layer_group)
        if inputs.fill is not None:
            rows, sources = inputs.fill
            inputs.input_ids[rows] = previous[0][sources]
        with single_rank():  # the draft alone: no collectives beside a tensor-parallel target
            with forward_context(inputs.metadata, self.kv_caches):
                hidden = self.model(inputs.input_ids, inputs.positions)
            if not logits:
                return None
            if inputs.sample_rows is not None:
                hidden = hidden[inputs.sample_rows]
            return self.model.compute_logits(hidden)[:, : self.vocab_size].argmax(dim=-1)
