"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, samples.

Contract: launch() computes exactly the tokens the scheduler listed; a request whose last known
token is computed this step gets one sampled token (and its logprobs when asked); a request that
asked for prompt logprobs gets them for every prompt position this step computed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fitserve.config import EngineConfig
from fitserve.core.outputs import TokenLogprobs
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import ScheduledRequest, SchedulerOutput
from fitserve.distributed.collectives import broadcast_from_first
from fitserve.distributed.parallel_state import pp
from fitserve.kv_groups import group_num_blocks
from fitserve.layers.attention.metadata import AttentionMetadata, forward_context
from fitserve.models.loader import load_model
from fitserve.planner.memory import MemoryPlan
from fitserve.spec_decode.draft_model import draft_kv_bytes_per_token
from fitserve.spec_decode.verify import num_accepted, verify_rows
from fitserve.worker.block_table_rows import BlockTableRows
from fitserve.worker.cuda_graphs import CudaGraphRunner
from fitserve.worker.group_tables import GroupTables
from fitserve.worker.kv_allocation import layer_caches, log_kv_cache
from fitserve.worker.piecewise_graphs import PiecewiseGraphRunner
from fitserve.worker.pipeline_stage import PipelineStage
from fitserve.worker.platforms import make_platform
from fitserve.worker.recurrent_state import allocate_recurrent_state
from fitserve.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs
from fitserve.worker.state_rings import state_rings_for
from fitserve.worker.step_inputs import HostInputs, StepInputs, build_host_inputs, upload_inputs
from fitserve.worker.transfer import PinnedStagingRing

logger = logging.getLogger("fitserve")

GiB = 1 << 30


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Speculative decoding: per request that verified drafts, the tokens after `sampled` it gained (one
    # per accepted draft), each with its logprobs (None unless asked); [] when the first draft missed.
    verified: dict[str, list[tuple[int, TokenLogprobs | None]]] = field(default_factory=dict)
    # Prompt logprobs computed this step, in prompt order, for positions start+1 .. (see launch()).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def loaded_model_bytes(model: torch.nn.Module) -> int:
    """Bytes a loaded model holds: each storage behind its parameters and buffers once (tied weights,
    CPU-offload views of one buffer), plus the prepacked copies CPU layers keep outside them
    (`packed_copy_bytes`: the float16 copies of int4 layers and of the LM head)."""
    storages: dict[int, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    packed = sum(getattr(module, "packed_copy_bytes", 0) for module in model.modules())
    return sum(storages.values()) + packed


class RequestsFailedError(Exception):
    """Per-request work of a step (seeding a request's generator, preparing its sampling row) raised for
    these requests, before anything was queued on the device: the engine ends them alone and runs the
    step again without them. `failures` maps each child request id to its exception."""

    def __init__(self, failures: dict[str, BaseException]) -> None:
        super().__init__(f"{len(failures)} request(s) failed: {', '.join(failures)}")
        self.failures = failures


class LaunchedStep:
    """A step queued on the device. result() waits for it and returns its tokens.

    needs_token_history: a request of this step samples with penalties, a grammar or bad words, which
    read its exact output tokens: the next step's sampling must wait for this step's tokens (the next
    step is then launched with `defer_sampling`: its forward queued, its sampling queued by sample() once
    the engine has taken these tokens). must_sync: the next step may not even be planned before this
    one's tokens are on the host (speculative drafts continue them).
    """

    def __init__(
        self,
        finish: Callable[[], ModelRunnerOutput],
        needs_token_history: bool = False,
        must_sync: bool = False,
        sample: Callable[[], None] | None = None,
    ) -> None:
        self._finish = finish
        self.needs_token_history = needs_token_history or must_sync
        self.must_sync = must_sync
        self._sample = sample

    def sample(self) -> None:
        """Queues a deferred sampling (once); nothing for a step that sampled at launch."""
        sample, self._sample = self._sample, None
        if sample is not None:
            sample()

    def result(self) -> ModelRunnerOutput:
        self.sample()
        return self._finish()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device.torch_device
        self.block_size = config.cache.block_size
        self.platform = make_platform(self.device)
        started = time.perf_counter()
        self.model = load_model(config.model, self.device)
        self.weight_bytes = loaded_model_bytes(self.model)
        # a draft model of speculative decoding loaded beside this one (set by the engine), and its
        # keys and values per token: counted with this model's when the KV cache is sized
        self.draft_weight_bytes = 0
        self.draft_kv_bytes_per_token = draft_kv_bytes_per_token(config)
        logger.info(
            "Model loading took %.2f GiB and %.1f seconds",
            self.weight_bytes / GiB,
            time.perf_counter() - started,
        )
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        # Each request's sampling row, kept across its steps (_sampling_rows)
        self._rows: dict[str, SamplingRow] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise_runner: PiecewiseGraphRunner | None = None
        # The last step's sampled ids on the device, and each sampled request's row among them.
        self._last_sampled: torch.Tensor | None = None
        self._last_sample_index: dict[str, int] = {}
        self.staging = PinnedStagingRing(self.device)
        # Set by a tensor-parallel executor: hands each step's host inputs to the other ranks.
        self.step_sender: Callable[[HostInputs], None] | None = None
        mc = config.model
        max_blocks_per_seq = -(-mc.max_model_len // self.block_size)
        self.block_table_rows = BlockTableRows(max_blocks_per_seq)
        # KV cache groups (fitserve/kv_groups.py): each layer's group (that of the layer whose cache it
        # reads); with several, groups 1.. have their own tables (worker/group_tables.py).
        self.kv_groups = config.kv_groups
        group_of = {layer: index for index, group in enumerate(self.kv_groups) for layer in group.layers}
        self.layer_group = [group_of.get(spec.cache_layer, 0) for spec in mc.kv_layers]
        self.group_tables: GroupTables | None = None
        if len(self.kv_groups) > 1:
            self.group_tables = GroupTables(self.kv_groups, max_blocks_per_seq, self.block_size)
        # pipeline parallel (worker/pipeline_stage.py): this rank's stage; None without stages
        self.stage = PipelineStage(config, self.device) if pp().size > 1 else None
        # a hybrid model under speculative decoding: the state's pool rows per verified token
        self.state_rings = state_rings_for(config)

    # ---- KV cache sizing and allocation -------------------------------------------------------
    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The model dtype, or float8 for --kv-cache-dtype fp8 (one byte per element, as the plan counts)."""
        return self.config.cache.torch_kv_cache_dtype(self.config.model.dtype)

    def kv_bytes_per_block(self) -> int:
        return (self.config.kv_bytes_per_token + self.draft_kv_bytes_per_token) * self.block_size

    def size_kv_cache(self) -> MemoryPlan:
        """The memory plan with the KV cache sized from what this process measured (the planner's
        formula): its num_kv_blocks is the pool `allocate_kv_cache` takes. A pipeline stage's pool is
        re-sized for the KV of its own layers."""
        plan = self.platform.size_kv_cache(self)
        return plan if self.stage is None else self.stage.resize_plan(plan)

    def allocate_kv_cache(self, plan: MemoryPlan) -> None:
        full_need = -(-self.config.model.max_model_len // self.block_size)
        self.group_num_blocks = group_num_blocks(self.kv_groups, plan.num_kv_blocks, full_need)
        self.kv_caches = self._layer_caches(self.group_num_blocks)
        allocate_recurrent_state(self.model, self.config, self.device)  # hybrid models only
        log_kv_cache(plan, self.kv_groups, self.group_num_blocks, self.kv_caches, self.kv_cache_dtype)
        if self.stage is None:  # a stage's step runs eagerly (worker/pipeline_stage.py says why)
            self.graph_runner = self.platform.make_graph_runner(self)
            self.piecewise_runner = self.platform.make_piecewise_runner(self)
        if self.device.type == "cuda":
            self._warm_up_decode_tail()

    def release_graphs(self) -> None:
        """Drops the CUDA graphs (and their memory pools) once no step runs any more."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.graph_runner = None
        self.piecewise_runner = None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    def _layer_caches(self, num_blocks: int | tuple[int, ...]) -> list[torch.Tensor]:
        specs, dtype = self.config.rank_kv_layers, self.kv_cache_dtype
        if self.stage is not None:  # this stage's layers only
            specs = self.stage.kv_layers(specs)
        return layer_caches(specs, self.layer_group, num_blocks, self.block_size, dtype, self.device)

    @torch.inference_mode()
    def _warm_up_decode_tail(self) -> None:
        """Runs once what a batch-1 decode step runs around its graph (the input copy, the LM head for
        one row, the sampler's kernels), so they compile at startup, not at the first request. The
        sampler reads the LM head's logits as they are unless a row edits them (penalties, min_tokens),
        then a float32 copy: greedy and random sampling over each of the two are four kernel variants."""
        if self.graph_runner is not None:
            sources = tuple(buffer[:1] for buffer in self.graph_runner.static_inputs())
            self.graph_runner.copy_inputs(sources, 1)
        hidden = torch.zeros(
            (1, self.config.model.hf_config.hidden_size), dtype=self.config.model.dtype, device=self.device
        )
        if self.stage is not None:  # the LM head is the last stage's, the sampler global rank 0's
            logits = self.stage.warm_up_logits(self.model, hidden)
        else:
            logits = self.model.compute_logits(hidden)
        if logits is None:  # a tensor-parallel rank other than the first: it samples nothing
            return
        for temperature in (0.0, 1.0):
            for repetition_penalty in (1.0, 1.1):
                params = SamplingParams(temperature=temperature, repetition_penalty=repetition_penalty)
                self.sampler(logits, [SamplingRow(params, [0], [], None, frozenset())])

    @torch.inference_mode()
    def profile_run(self) -> int:
        """A dummy step at the worst case: max_num_batched_tokens prompt tokens, max_num_seqs samples.

        Attention runs over a small scratch KV cache that every dummy sequence shares; only the
        activation peak matters here. Returns the scratch cache's bytes, which are not activations.
        """
        sc = self.config.scheduler
        mc = self.config.model
        num_tokens = sc.max_num_batched_tokens
        seq_len = min(mc.max_model_len, num_tokens)
        num_seqs = -(-num_tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        scratch = self._layer_caches(blocks_per_seq + 1)
        query_lens = [seq_len] * (num_seqs - 1) + [num_tokens - seq_len * (num_seqs - 1)]
        positions = torch.cat([torch.arange(q, device=self.device) for q in query_lens])
        table = torch.arange(1, blocks_per_seq + 1, dtype=torch.int32, device=self.device)
        slots = positions + self.block_size  # block 1 onwards: one distinct slot per position
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        metadata = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(query_lens, dtype=torch.int32, device=self.device),
            block_tables=table.unsqueeze(0).expand(num_seqs, -1).contiguous(),
            max_query_len=max(query_lens),
            max_seq_len=max(query_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=query_lens,
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        with forward_context(metadata, scratch):
            hidden = self._alone_forward(input_ids, positions)
        if self.device.type == "cuda":
            for small in (1, 2):
                if num_tokens > small:
                    self._small_step_forward(scratch, small)
        rows = min(sc.max_num_seqs, num_tokens)
        logits = None
        if self.stage is None or self.stage.is_last:
            logits = self.model.compute_logits(hidden[:rows])
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        if logits is not None:  # None on a tensor-parallel rank other than the first
            self.sampler(logits, [SamplingRow(params, [0], [], None, frozenset())] * rows)
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
        del scratch, hidden, logits
        return scratch_bytes

    def _small_step_forward(self, scratch: list[torch.Tensor], num_tokens: int) -> None:
        """One sequence of `num_tokens` tokens through the model over the scratch cache, so that kernels
        with a small-step variant compile here, at startup, not at the first request: 1 token, a decode
        (the decode attention, the skinny GEMMs, the fused MoE's small-batch tiles; also when no CUDA graph
        is captured, --enforce-eager); 2 tokens, a step of short prompts (prefill attention's short-query
        config: the profile step above has the long queries)."""
        slots = torch.arange(num_tokens, dtype=torch.int64, device=self.device) + self.block_size
        metadata = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.ones((1, 1), dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[num_tokens],
        )
        positions = torch.arange(num_tokens, dtype=torch.long, device=self.device)
        with forward_context(metadata, scratch):
            self._alone_forward(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions)

    def _alone_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward with no other rank's part in it (profiling, kernel warm-up): a pipeline
        stage after the first starts from zeros, and nothing is sent on."""
        if self.stage is None:
            return self.model(input_ids, positions)
        return self.stage.forward_alone(self.model, input_ids, positions)

    # ---- one step ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> LaunchedStep:
        """Queues the step's forward and sampling on the device and returns without waiting; the
        result waits for this step alone. The engine does host work (and plans the next step) between.

        A token still in flight (scheduled before the last step's tokens reached the host) is read on
        the device from the last step's sampled ids. defer_sampling: the forward and the logits are
        queued now, the sampling when the engine calls the step's sample() (after taking the last step's
        tokens, which rows with penalties or a grammar read)."""
        for request_id in scheduler_output.finished_req_ids:
            self.generators.pop(request_id, None)
            self._rows.pop(request_id, None)
            self.block_table_rows.release(request_id)
            if self.group_tables is not None:
                self.group_tables.release(request_id)
        output = ModelRunnerOutput()
        if scheduler_output.is_empty:
            return LaunchedStep(lambda: output)
        scheduled = scheduler_output.scheduled
        drafts = {item.request.request_id: item.draft_token_ids for item in scheduled if item.draft_token_ids}
        if drafts:
            scheduled = verify_rows(scheduled)  # k + 1 one-token rows per request with drafts
        rows = self._sampling_rows(scheduled)
        host, sample_items = self._host_inputs(scheduled)
        if self.step_sender is not None:
            self.step_sender(host)  # the other tensor-parallel ranks run the same step
        inputs = upload_inputs(host, self.staging, self.layer_group)
        hidden = self._forward(inputs)  # None on the first of several pipeline stages: it sent them on
        if inputs.prompt_logprob_rows:
            self._prompt_logprobs(hidden, inputs, output)
        if not sample_items:
            return LaunchedStep(lambda: output)
        logits = self._sample_logits(hidden, inputs)
        needs_history = any(row.needs_token_history for row in rows)
        launched: list = []

        def sample() -> None:
            if defer_sampling:  # rebuilt: the last step's tokens have reached their requests since
                for i, item in enumerate(sample_items):
                    if rows[i].needs_token_history:
                        rows[i] = self._sampling_row(item)
            pending = self.sampler.launch(logits, rows)
            # every rank reads the tokens in flight from its own copy (run_host_inputs)
            self._last_sampled = broadcast_from_first(pending.sampled)
            self._last_sample_index = {item.request.request_id: i for i, item in enumerate(sample_items)}
            launched.append(pending)

        if not defer_sampling:
            sample()

        def finish() -> ModelRunnerOutput:
            result = launched[0].result()
            for item, token_id, token_logprobs in zip(
                sample_items, result.sampled_token_ids, result.logprobs
            ):
                request_id = item.request.request_id
                if request_id in output.sampled:  # a verify row past the first
                    output.verified[request_id].append((token_id, token_logprobs))
                    continue
                output.sampled[request_id] = token_id
                if token_logprobs is not None:
                    output.logprobs[request_id] = token_logprobs
                if request_id in drafts:
                    output.verified[request_id] = []
            for request_id, request_drafts in drafts.items():
                samples = [output.sampled[request_id]] + [t for t, _ in output.verified[request_id]]
                accepted = num_accepted(samples, request_drafts)
                output.verified[request_id] = output.verified[request_id][:accepted]
            return output

        # the next step's drafts continue this one's tokens: it waits for them
        return LaunchedStep(finish, needs_history, bool(drafts), sample if defer_sampling else None)

    @torch.inference_mode()
    def run_host_inputs(self, host: HostInputs) -> None:
        """A step on a tensor-parallel rank other than the first: the same forward over the first rank's
        host inputs, the same collectives (the LM head's gather, the sampled ids' broadcast), no sampling
        and no output."""
        inputs = upload_inputs(host, self.staging, self.layer_group)
        hidden = self._forward(inputs)
        if self.stage is not None and not self.stage.is_last:
            hidden = None  # sent on: the last stage computes the logits
        if hidden is not None:
            for rows, _, _ in inputs.prompt_logprob_rows.values():
                self._logits(hidden[rows])
            if inputs.num_samples:
                self._sample_logits(hidden, inputs)
        if inputs.num_samples and (self.stage is None or self.stage.reads_sampled_ids):
            sampled = torch.empty(inputs.num_samples, dtype=torch.long, device=self.device)
            self._last_sampled = broadcast_from_first(sampled)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """The model's forward over the step, and a hybrid model's prefix-cache snapshot copies around it
        (restores before, saves after: outside any captured graph)."""
        if inputs.state_restores is not None:
            self.model.copy_states(*inputs.state_restores)
        hidden = self._model_forward(inputs)
        if inputs.state_saves is not None:
            self.model.copy_states(*inputs.state_saves)
        return hidden

    def _model_forward(self, inputs: StepInputs) -> torch.Tensor | None:
        if self.stage is not None:  # eager, the stages in turn; None on a stage before the last
            return self.stage.forward(self.model, inputs, self.kv_caches, self._last_sampled)
        meta = inputs.metadata
        fill = None
        if inputs.fill is not None:
            fill = (*inputs.fill, self._last_sampled)
        # a hybrid's step with a one-token prompt (from zeros) runs eagerly: the graphs only decode
        graphable = meta.state_slots is None or meta.state_slots.is_decode_only
        if (
            self.graph_runner is not None
            and graphable
            and self.graph_runner.can_run(meta.num_seqs, meta.max_query_len)
        ):
            return self.graph_runner.run(
                inputs.input_ids, inputs.positions, meta, fill, inputs.layer_metadata
            )
        if fill is not None:
            rows, indices, last_sampled = fill
            inputs.input_ids[rows] = last_sampled[indices]
        with forward_context(meta, self.kv_caches, inputs.layer_metadata):
            piecewise = self.piecewise_runner
            if piecewise is not None and piecewise.can_run(inputs.input_ids.shape[0]):
                return piecewise.run(inputs.input_ids, inputs.positions, meta)
            return self.model(inputs.input_ids, inputs.positions)

    def _sample_logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The sampled rows' logits (None on a tensor-parallel rank other than the first). Every index
        tensor was built before the forward: a host-to-device copy made now would wait for the whole
        step and leave nothing to overlap."""
        if hidden is None:  # the first of several pipeline stages: the last one sends them
            return self.stage.receive_logits(inputs.num_samples)
        if inputs.sample_rows is not None:
            hidden = hidden[inputs.sample_rows]
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """compute_logits; on the last of several pipeline stages its first rank sends them to global
        rank 0 (which samples) and every rank of it gets None."""
        logits = self.model.compute_logits(hidden)
        if self.stage is not None:
            return self.stage.send_logits(logits)
        return logits

    def _prompt_logprobs(
        self, hidden: torch.Tensor | None, inputs: StepInputs, output: ModelRunnerOutput
    ) -> None:
        for request_id, (rows, next_ids, num_top) in inputs.prompt_logprob_rows.items():
            if hidden is None:  # the first of several pipeline stages: the last one sends them
                logits = self.stage.receive_logits(len(rows))
            else:
                logits = self.model.compute_logits(hidden[rows])
            output.prompt_logprobs[request_id] = compute_prompt_logprobs(logits, next_ids, num_top)

    def _sampling_rows(self, scheduled: list[ScheduledRequest]) -> list[SamplingRow]:
        """The sampling row of every request that samples this step, in the order of the scheduled rows
        (that of build_host_inputs' sampled items). A request's row is kept across its steps (its lists
        are the request's own, which grow in place) and only its count of tokens in flight is brought up
        to date. A request whose row cannot be made fails alone: RequestsFailedError names it (and every
        other one that failed), nothing is queued."""
        rows: list[SamplingRow] = []
        failures: dict[str, BaseException] = {}
        kept = self._rows
        for item in scheduled:
            if not item.samples:
                continue
            request = item.request
            if not item.draft_token_ids:
                row = kept.get(request.request_id)
                if (
                    row is not None
                    and row.output_token_ids is request.output_token_ids
                    and row.grammar is request.grammar
                    and row.params is request.params
                ):
                    row.num_pending_outputs = request.num_output_placeholders - 1
                    rows.append(row)
                    continue
            try:
                row = self._sampling_row(item)
            except Exception as error:  # noqa: BLE001 - attributed to its request, logged by the engine
                self.generators.pop(request.request_id, None)
                failures[request.request_id] = error
                continue
            if not item.draft_token_ids:
                kept[request.request_id] = row
            rows.append(row)
        if failures:
            raise RequestsFailedError(failures)
        return rows

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        request = item.request
        params = request.params
        generator = None
        if params.seed is not None:
            generator = self.generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)  # before it is kept: a seed torch refuses leaves none
                self.generators[request.request_id] = generator
        outputs = request.output_token_ids
        grammar = request.grammar  # structured outputs (fitserve/structured); None = unconstrained
        if item.draft_token_ids:  # a verify row: the drafts before it count as output (penalties)
            outputs = outputs + list(item.draft_token_ids)
            if grammar is not None:  # and its grammar has taken them (the speculator kept valid ones)
                grammar = grammar.after(list(item.draft_token_ids))
        return SamplingRow(
            params=params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=outputs,
            generator=generator,
            eos_token_ids=request.eos_token_ids,
            num_pending_outputs=request.num_output_placeholders - 1,
            grammar=grammar,
        )

    def _prepare_inputs(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        host, _ = self._host_inputs(scheduled)
        return upload_inputs(host, self.staging, self.layer_group)

    def _host_inputs(self, scheduled: list[ScheduledRequest]) -> tuple[HostInputs, list[ScheduledRequest]]:
        return build_host_inputs(
            scheduled,
            self.block_size,
            self.block_table_rows,
            self.group_tables,
            self._in_flight_index,
            self.state_rings,
        )

    def _in_flight_index(self, request_id: str) -> int:
        index = self._last_sample_index.get(request_id)
        if index is None:
            raise RuntimeError(
                f"request {request_id} was scheduled with a token in flight, but the last step did not "
                "sample it: the scheduler and the model runner disagree (a bug; please report it)"
            )
        return index
