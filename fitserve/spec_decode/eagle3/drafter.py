"""The EAGLE-3 drafter at run time (fitserve/spec_decode/eagle3/): the target's streams kept per request
after each of its steps (`after_launch`), computed into the head's own paged KV cache eagerly or at the
next draft, and the drafts: a catch-up forward whose last rows give the first drafts, then k - 1
recurrent steps (EAGLE's: token = the draft before, hidden = the head's output before the final norm).
DraftModel's pool and block tables, DraftSlots' request state and propose loop around the head.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fitserve.core.scheduler import ScheduledRequest
from fitserve.distributed.parallel_state import single_rank
from fitserve.layers.attention.metadata import forward_context
from fitserve.spec_decode.draft_model import DraftModel
from fitserve.spec_decode.draft_slots import DraftSequence
from fitserve.spec_decode.eagle3.checkpoint import (
    Eagle3Checkpoint,
    checkpoint_tensors,
    whole_target_embedding,
)
from fitserve.spec_decode.eagle3.head import Eagle3Head
from fitserve.worker.step_inputs import build_host_inputs, upload_inputs

if TYPE_CHECKING:
    from fitserve.config import EngineConfig
    from fitserve.core.request import Request
    from fitserve.core.scheduler import SchedulerOutput

logger = logging.getLogger("fitserve")

GiB = 1 << 30
# rows of target streams a request keeps before they are computed into the head's cache without a draft
EAGER_ROWS = 32
# a step of more rows than this copies out the rows still waiting after it (few: a prompt's last one)
COMPACT_ROWS = 256


def aux_buffer_rows(config: EngineConfig) -> int:
    """Rows of the target's stream buffer: the most tokens one step computes (a prefill chunk, a verify
    step of every sequence with k drafts, a CUDA graph's padded batch)."""
    k = config.speculative.num_speculative_tokens
    scheduler = config.scheduler
    return max(scheduler.max_num_batched_tokens, scheduler.max_num_seqs * (k + 1))


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
class _HeadSequence(DraftSequence):
    # the target's streams not yet computed into the head's cache: (first position, rows [n, 3 x H])
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class Eagle3Drafter(DraftModel):
    """DraftModel's pool and block tables and DraftSlots' bookkeeping (room, propose, release) around the
    head: it is a DraftModel whose `_sequence`, `_slots_needed` and `_draft` follow EAGLE's recurrence."""

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
                loaded = self.head.load_weights(checkpoint_tensors(checkpoint.files))
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
            self.embed = whole_target_embedding(config)  # the target's own is split over the ranks
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

    # ---- DraftSlots' hooks ---------------------------------------------------------------------------
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

    def _slots_needed(self, request: Request, seq: DraftSequence, count: int) -> int:
        """Slots up to the last draft fed back: position N - 2 + count - 1."""
        return len(request.all_token_ids) - 2 + count - seq.num_computed_tokens

    @torch.inference_mode()
    def _draft(self, wanted: list[tuple[_HeadSequence, int]]) -> dict[str, list[int]]:
        """Catch-up forwards whose last rows give the first drafts, then k - 1 recurrent steps."""
        tokens, prenorm, index = self._catch_up(
            [(seq, len(seq.all_token_ids.tokens) - 2) for seq, _ in wanted],
            sample=True,  # type: ignore
        )

        def step(
            items: list[ScheduledRequest], previous: tuple[torch.Tensor, dict[str, int]]
        ) -> torch.Tensor:
            nonlocal prenorm  # each step's hidden input is the step before's output
            drafted, prenorm = self._step(items, previous, prenorm)
            return drafted

        return self._recurrent_drafts(wanted, (tokens, index), step)

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
        _, inputs, hidden = self._prepare_rows(items, previous, hidden)
        with single_rank():  # the head alone: no collectives beside a tensor-parallel target
            return self._head_rows(inputs, hidden, any(item.samples for item in items))

    def _prepare_rows(
        self,
        items: list[ScheduledRequest],
        previous: tuple[torch.Tensor, dict[str, int]] | None,
        hidden: torch.Tensor,
    ) -> tuple[Any, Any, torch.Tensor]:
        """The host inputs of `items`, uploaded, with the rows of a recurrent step given the previous
        step's drafts as ids and the hidden rows they came from: (host, device inputs, hidden)."""
        index = previous[1] if previous is not None else {}
        host, _ = build_host_inputs(items, self.block_size, self.table_rows, None, index.__getitem__)
        self._before_upload(host)
        inputs = upload_inputs(host, self.staging, self.layer_group)
        if inputs.fill is not None:
            rows, sources = inputs.fill
            inputs.input_ids[rows] = previous[0][sources]
            hidden = hidden[sources]  # every row of a recurrent step reads the row before
        return host, inputs, hidden

    def _before_upload(self, host: Any) -> None:
        """Called with each forward's host inputs before they are uploaded (MtpDrafter sends them to the
        other tensor-parallel ranks there)."""

    def _head_rows(
        self, inputs: Any, hidden: torch.Tensor, samples: bool
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The head's forward over uploaded inputs; the drafts and pre-norm outputs of the sampling rows
        (None when no row samples)."""
        with forward_context(inputs.metadata, self.kv_caches):
            normed, prenorm = self.head.forward(self.embed(inputs.input_ids), hidden, inputs.positions)
        if not samples:
            return None
        if inputs.sample_rows is not None:
            normed, prenorm = normed[inputs.sample_rows], prenorm[inputs.sample_rows]
        return self.head.draft_ids(normed), prenorm
