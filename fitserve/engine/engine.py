"""The synchronous engine: add requests, call step() until done. Not thread-safe by design."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fitserve.config import EngineConfig
from fitserve.core.kv_cache_groups import make_kv_cache_manager
from fitserve.core.outputs import RequestMetrics, RequestOutput
from fitserve.core.request import Request, RequestStatus
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import Scheduler, SchedulerOutput
from fitserve.core.state_slots import with_state_slots
from fitserve.engine.detokenizer import IncrementalDetokenizer
from fitserve.engine.output_processor import OutputProcessor, ParentRequest
from fitserve.engine.step_failures import StepFailures
from fitserve.kv_groups import group_num_blocks
from fitserve.logger import configure_default_logging
from fitserve.models.loader import (
    load_generation_defaults,
    load_tokenizer,
    read_generation_config,
    resolve_tokenizer_path,
)
from fitserve.planner.resolve import create_engine_config
from fitserve.spec_decode.config import check_speculative_model
from fitserve.spec_decode.draft_model import DraftModel, draft_model_config
from fitserve.spec_decode.eagle3 import (
    Eagle3Checkpoint,
    Eagle3Drafter,
    check_eagle3_target,
    read_eagle3_checkpoint,
)
from fitserve.spec_decode.mtp import MtpCheckpoint, MtpDrafter, read_mtp_checkpoint
from fitserve.spec_decode.speculator import Speculator
from fitserve.structured.manager import StructuredOutputManager
from fitserve.token_bytes import token_byte_table
from fitserve.worker.executor import create_executor
from fitserve.worker.model_runner import LaunchedStep, RequestsFailedError
from fitserve.worker.rank_failure import RankFailedError

if TYPE_CHECKING:
    from fitserve.args import EngineArgs

logger = logging.getLogger("fitserve")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1: blocks held by live requests
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # tokens found there
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_preemptions: int
    num_kv_blocks: int
    block_size: int
    # Engine steps by tokens computed (prompt + generated), per ITERATION_TOKENS_BUCKETS bucket, then above
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # Speculative decoding (vLLM's vllm:spec_decode_* counters); all 0 / () when it is off.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


# Upper bounds of vLLM's `vllm:iteration_tokens_total` histogram buckets (tokens per engine step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    launched: LaunchedStep


def _load_tokenizer_and_table(folder: str, trust_remote_code: bool, use_fast: bool) -> Any:
    """The tokenizer and its token byte table (~0.1 s of Python for a 49k vocabulary, built now so the
    first request does not), both made on the tokenizer thread while the weights load."""
    tokenizer = load_tokenizer(folder, trust_remote_code, use_fast)
    token_byte_table(tokenizer)
    return tokenizer


class Engine:
    def __init__(self, config: EngineConfig, preload_grammar_backend: bool = True) -> None:
        """`preload_grammar_backend` False: xgrammar is not imported now but by the first constrained
        request (or by whoever calls `self.structured.preload()`): `fitserve serve` imports it once the
        server is up, not during its start."""
        configure_default_logging()
        self.config = config
        mc = config.model
        started = time.perf_counter()
        # A folder without a tokenizer is refused now, before any weight loads; the tokenizer itself
        # (importing transformers: ~10 s from a cold disk) then loads while the model does.
        tokenizer_folder = resolve_tokenizer_path(mc.tokenizer, mc.tokenizer_revision)
        tokenizer_loader = ThreadPoolExecutor(1, thread_name_prefix="fitserve-tokenizer")
        use_fast = mc.tokenizer_mode != "slow"  # --tokenizer-mode
        draft_config = None
        if config.speculative is not None:  # refused before any weight loads
            check_speculative_model(config.speculative, config.kv_groups)
            if config.speculative.method == "draft_model":
                draft_config = draft_model_config(config)
            elif config.speculative.method == "eagle3":
                check_eagle3_target(config)
                draft_config = read_eagle3_checkpoint(
                    config, mc.trust_remote_code, dummy=mc.load_format == "dummy"
                )
            elif config.speculative.method == "mtp":
                draft_config = read_mtp_checkpoint(config, dummy=mc.load_format == "dummy")
            logger.info("Speculative decoding: %s", config.speculative.describe())
        draft = None
        tokenizer = tokenizer_loader.submit(
            _load_tokenizer_and_table, tokenizer_folder, mc.trust_remote_code, use_fast
        )
        try:
            self.executor = create_executor(config)
            if isinstance(draft_config, Eagle3Checkpoint):  # reads the target's layers, so built after it
                draft = Eagle3Drafter(config, draft_config, self.executor.runner.model)
                self.executor.runner.draft_weight_bytes = draft.weight_bytes
            elif isinstance(draft_config, MtpCheckpoint):  # the target's MTP layer, reading its rows
                channel = getattr(self.executor, "draft_channel", None)  # tensor parallel: every rank
                draft = MtpDrafter(config, draft_config, self.executor.runner.model, channel)
                self.executor.runner.draft_weight_bytes = draft.weight_bytes
                self.executor.runner.draft_kv_bytes_per_token = draft.kv_bytes_per_token
            elif draft_config is not None:  # loaded before the KV cache is sized, which counts it
                draft = DraftModel(config, draft_config)
                self.executor.runner.draft_weight_bytes = draft.weight_bytes
            if tokenizer.done() and tokenizer.exception() is not None:
                raise tokenizer.exception()  # a bad tokenizer stops the start before the profiling
            # the one memory model: every report of the KV cache's bytes, blocks and tokens reads it
            self.memory_plan = self.executor.initialize_kv_cache()
            if draft is not None:  # as many blocks as the target's: the plan counted both per token
                draft.allocate_kv_cache(self.memory_plan.num_kv_blocks)
            self.tokenizer = tokenizer.result()
        finally:
            tokenizer_loader.shutdown(wait=False, cancel_futures=True)
        groups = config.kv_groups
        full_need = -(-mc.max_model_len // config.cache.block_size)
        num_blocks = group_num_blocks(groups, self.memory_plan.num_kv_blocks, full_need)
        self.kv_manager = make_kv_cache_manager(
            groups, num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.kv_manager = with_state_slots(self.kv_manager, config.model, config.scheduler.max_num_seqs)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.speculator = Speculator(config.speculative, draft) if config.speculative is not None else None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.failures = StepFailures(
            config, self.memory_plan.kv_cache_bytes, self.scheduler, self.output_processor, self.kv_manager
        )
        self.eos_token_ids = self._eos_token_ids()
        # structured outputs: grammars compiled off the step path; constrained requests wait for theirs
        self.structured = StructuredOutputManager(
            self.tokenizer, mc.vocab_size, self.eos_token_ids, preload=preload_grammar_backend
        )
        self._generation_defaults = self._load_generation_defaults()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        # The step on the device whose tokens have not been taken yet (see step()).
        self._in_flight: InFlightStep | None = None
        logger.info(
            "Engine ready in %.1f s: max_model_len %d, KV cache %d tokens, "
            "max concurrency %.1fx at full length",
            time.perf_counter() - started,
            mc.max_model_len,
            self.memory_plan.kv_cache_tokens,
            self.memory_plan.max_concurrency,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs, serving: bool = False) -> Engine:
        """The engine for `args`, resolved by the planner (fitserve/planner/resolve.py); `serving`: with
        `fitserve serve`'s defaults (and its server imports the grammar backend once it is up)."""
        return cls(create_engine_config(args, serving=serving), preload_grammar_backend=not serving)

    # ---- configuration views ------------------------------------------------------------------------
    def _eos_token_ids(self) -> frozenset[int]:
        """eos ids from config.json, generation_config.json and the tokenizer, together."""
        ids: set[int] = set()
        try:
            from_generation_config = read_generation_config(self.config.model.model_path).get("eos_token_id")
        except ValueError:  # a broken file is reported where its sampling defaults are read
            from_generation_config = None
        for value in (getattr(self.config.model.hf_config, "eos_token_id", None), from_generation_config):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def _load_generation_defaults(self) -> dict:
        overrides = self.config.model.override_generation_config  # --override-generation-config wins
        if overrides:
            logger.info("Default sampling parameters from --override-generation-config: %s", overrides)
        return {**self._model_generation_defaults(), **overrides}

    def _model_generation_defaults(self) -> dict:
        setting = self.config.model.generation_config
        if setting == "vllm":
            return {}
        model = self.config.model
        folder = model.model_path if setting == "auto" else setting
        defaults = load_generation_defaults(folder)
        if defaults:
            logger.info("Default sampling parameters from the model's generation_config.json: %s", defaults)
        if setting != "auto":
            return defaults
        from_card = {name: value for name, value in model.card_sampling.items() if name not in defaults}
        if from_card:
            logger.info(
                "Default sampling parameters from %s: %s (a request's own values win; "
                "--generation-config vllm turns them off)",
                model.card_sampling_source,
                ", ".join(f"{name}={value}" for name, value in from_card.items()),
            )
        return {**from_card, **defaults}

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams.from_optional(**self._generation_defaults)

    @property
    def generation_defaults(self) -> dict:
        return dict(self._generation_defaults)

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in flight: use a unique id per request")
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("a request needs a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        prompt_token_ids = list(prompt_token_ids)
        self.validate_prompt(prompt_token_ids)
        params.check_token_ids(self.config.model.vocab_size)
        if params.bad_words:
            params.update_from_tokenizer(self.tokenizer)  # the words as token ids, for the sampler
        grammar = None
        if params.structured_outputs is not None:
            # compiles in the background; a grammar no output of which fits the room is refused now
            grammar = self.structured.submit(
                params.structured_outputs, **self._output_room(params, len(prompt_token_ids))
            )
        arrival_time = arrival_time if arrival_time is not None else time.time()
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone()
                child_params.seed = params.seed + index
            child = Request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                request_id,
                index,
                prompt_token_ids,
                child_params,
                self.eos_token_ids,
                arrival_time,
            )
            if index > 0 and self.config.cache.enable_prefix_caching:
                child.waits_for = children[0]
            children.append(child)
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.params)
            if params.detokenize
            else None
            for child in children
        ]
        self.output_processor.add(
            ParentRequest(
                request_id=request_id,
                prompt=prompt,
                prompt_token_ids=prompt_token_ids,
                params=params,
                children=children,
                detokenizers=detokenizers,
                metrics=RequestMetrics(arrival_time=arrival_time),
            )
        )
        if grammar is not None:
            self.structured.hold(request_id, children, grammar)  # scheduled once the grammar is compiled
            return
        for child in children:
            self.scheduler.add_request(child)

    def _output_room(self, params: SamplingParams, prompt_len: int) -> dict[str, Any]:
        """The most tokens a request may generate (max_tokens, or what max_model_len leaves after the
        prompt when less or unset), with the wording of its limit for a structured output's check."""
        max_model_len = self.config.model.max_model_len
        room = max_model_len - prompt_len
        if params.max_tokens is not None and params.max_tokens <= room:
            return {"max_tokens": params.max_tokens}
        return {
            "max_tokens": room,
            "limit": f"max_model_len {max_model_len} leaves {room} tokens after the prompt's {prompt_len}"
            + ("" if params.max_tokens is None else f" (less than max_tokens={params.max_tokens})"),
            "fix": "shorten the prompt or raise max_model_len so that at least {needed} tokens are left",
        }

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        max_model_len = self.config.model.max_model_len
        if not prompt_token_ids:
            raise ValueError("the prompt is empty (0 tokens): send at least one token of text")
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {max_model_len}, "
                "which must leave room for at least one generated token: shorten the prompt or raise "
                "--max-model-len"
            )
        vocab_size = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size}): "
                "send ids the model's tokenizer produced"
            )

    def abort_request(self, request_ids: Iterable[str]) -> None:
        for parent_id in request_ids:
            self.structured.drop(parent_id)
            child_ids = self.output_processor.child_ids(parent_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(parent_id)

    def has_unfinished_requests(self) -> bool:
        """True while step() has work: a request to schedule, or tokens in flight that someone awaits
        (a step whose requests were all aborted or stopped meanwhile is not waited for)."""
        if self.scheduler.has_unfinished_requests() or self.structured.has_held:
            return True
        step = self._in_flight
        return step is not None and any(not s.request.is_finished for s in step.scheduler_output.scheduled)

    # ---- the step loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plans and launches step N+1 while step N still runs on the device, then takes step N's
        tokens (updating the requests, detokenizing, finding stop strings) while N+1 runs. So the
        host's work hides behind the device's, and the device never waits for the host.

        Step N+1 is planned with step N's tokens as placeholders (see Scheduler). When step N sampled
        with penalties or a grammar (they read the exact output tokens; a grammar's matcher must have
        taken them before the next mask), step N+1's forward is queued, step N's tokens are taken, and
        only then is N+1's sampling queued. After a speculative step (the next drafts continue its
        tokens) its tokens are taken before anything is planned."""
        outputs: list[RequestOutput] = []
        if self.structured.has_held:
            outputs.extend(self._admit_structured())
        previous, self._in_flight = self._in_flight, None
        speculate = self.speculator is not None and self.speculator.wants_drafts(self.scheduler.running)
        if previous is not None and (previous.launched.must_sync or speculate):
            outputs.extend(self._take_tokens(previous))
            previous = None
        if speculate:
            self.speculator.propose(self.scheduler.running)  # drafts continue the tokens just taken
        # Rows with penalties or a grammar read the last step's tokens: this step's forward is queued
        # first and its sampling once they are taken.
        defer = previous is not None and previous.launched.needs_token_history
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.unservable:
            outputs.extend(self.failures.end_unservable(scheduler_output.unservable))
        if self.speculator is not None and scheduler_output.finished_req_ids:
            self.speculator.release(scheduler_output.finished_req_ids)  # a draft model's state
        if not scheduler_output.is_empty:
            self._in_flight = self._launch_or_fail(scheduler_output, outputs, defer)
        elif scheduler_output.finished_req_ids:
            self.executor.launch(scheduler_output)  # lets the runner drop finished requests' state
        if previous is not None:
            outputs.extend(self._take_tokens_or_fail(previous))
        if defer and self._in_flight is not None:
            self._sample_or_fail(self._in_flight, outputs)
        return outputs

    def _sample_or_fail(self, step: InFlightStep, outputs: list[RequestOutput]) -> None:
        """Queues a deferred sampling; a failure ends that step's requests, as a launch's does."""
        try:
            step.launched.sample()
        except RankFailedError:
            raise
        except Exception as error:
            self._in_flight = None
            live = [item for item in step.scheduler_output.scheduled if not item.request.is_finished]
            outputs.extend(
                self.failures.fail_step(dataclasses.replace(step.scheduler_output, scheduled=live), error)
            )

    def _admit_structured(self) -> list[RequestOutput]:
        """Hands the scheduler the constrained requests whose grammar is compiled; one whose grammar
        failed to compile ends with that error. With nothing else to run, waits a few ms for a compile."""
        idle = not self.scheduler.has_unfinished_requests() and self._in_flight is None
        failed = []
        for parent_id, children, error in self.structured.take_ready(wait_s=0.005 if idle else 0.0):
            if error is None:
                for child in children:
                    self.scheduler.add_request(child)
                continue
            for child in children:
                child.status = RequestStatus.FINISHED_ERROR
            self.output_processor.fail(parent_id, str(error))
            failed.append(parent_id)
        return self.output_processor.make_outputs(failed)

    def _launch_or_fail(
        self, scheduler_output: SchedulerOutput, outputs: list[RequestOutput], defer_sampling: bool = False
    ) -> InFlightStep | None:
        """Launches the step. A request whose own work raised is ended alone (finish_reason "error") and
        the step runs without it; a step that fails as a whole ends its requests, never the engine."""
        while True:
            try:
                return self._launch(scheduler_output, defer_sampling)
            except RequestsFailedError as error:
                failed = {
                    child_id: e
                    for child_id, e in error.failures.items()
                    if child_id in _ids(scheduler_output)
                }
                if not failed:
                    outputs.extend(self.failures.fail_step(scheduler_output, error))
                    return None
                outputs.extend(self.failures.fail_requests(scheduler_output, failed))
                remaining = [item for item in scheduler_output.scheduled if not item.request.is_finished]
                if not remaining:
                    return None
                scheduler_output = dataclasses.replace(
                    scheduler_output,
                    scheduled=remaining,
                    num_batched_tokens=sum(item.num_new_tokens for item in remaining),
                )
            except RankFailedError:
                raise  # the engine cannot go on without a rank (EngineLoop stops)
            except Exception as error:
                outputs.extend(self.failures.fail_step(scheduler_output, error))
                return None

    def _take_tokens_or_fail(self, step: InFlightStep) -> list[RequestOutput]:
        try:
            return self._take_tokens(step)
        except RankFailedError:
            raise
        except Exception as error:
            live = [item for item in step.scheduler_output.scheduled if not item.request.is_finished]
            return self.failures.fail_step(dataclasses.replace(step.scheduler_output, scheduled=live), error)

    def _launch(self, scheduler_output: SchedulerOutput, defer_sampling: bool = False) -> InFlightStep:
        launched = self.executor.launch(scheduler_output, defer_sampling)
        if self.speculator is not None:  # an EAGLE-3 head keeps the step's hidden states
            self.speculator.after_launch(scheduler_output)
        now = time.time()
        self._count_tokens(scheduler_output)
        self.output_processor.mark_scheduled((s.request.request_id for s in scheduler_output.scheduled), now)
        return InFlightStep(scheduler_output, launched)

    def _take_tokens(self, step: InFlightStep) -> list[RequestOutput]:
        runner_output = step.launched.result()
        now = time.time()
        self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        progressed = self.scheduler.update_from_output(step.scheduler_output, runner_output.sampled)
        self._apply_tokens(progressed, runner_output.logprobs, now)
        if runner_output.verified:
            progressed += self._take_verified(step.scheduler_output, runner_output.verified, now)
        parent_ids = list(dict.fromkeys(child.parent_id for child in progressed))
        return self.output_processor.make_outputs(parent_ids)

    def _apply_tokens(self, progressed: list[Request], logprobs: dict, now: float) -> None:
        """The requests' newest tokens through their grammars, detokenizers and stop strings."""
        self._advance_grammars(progressed)
        stopped = self.output_processor.apply_tokens(progressed, logprobs, now)
        for child, stop_string in stopped:
            child.stop_reason = stop_string
            self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED)

    def _take_verified(self, scheduler_output: SchedulerOutput, verified: dict, now: float) -> list[Request]:
        """Speculative decoding: the accepted drafts' tokens, one position at a time, each through the same
        checks as any token (a stop ends the request there and drops the rest); then the counters."""
        progressed: list[Request] = []
        for position in range(max(len(tokens) for tokens in verified.values())):
            tokens = {rid: t[position][0] for rid, t in verified.items() if len(t) > position}
            logprobs = {
                rid: t[position][1]
                for rid, t in verified.items()
                if len(t) > position and t[position][1] is not None
            }
            taken = self.scheduler.append_tokens(tokens)
            self._apply_tokens(taken, logprobs, now)
            progressed += taken
        if self.speculator is not None:
            results = [
                (len(item.draft_token_ids), len(verified.get(item.request.request_id, ())))
                for item in scheduler_output.scheduled
                if item.draft_token_ids
            ]
            self.speculator.record_step(results, len(scheduler_output.scheduled))
        self.num_generation_tokens_total += len(progressed)
        return progressed

    def _advance_grammars(self, progressed: list[Request]) -> None:
        """Structured outputs: each constrained request's matcher takes its new token; a request whose
        grammar is complete stops (finish_reason "stop"), one whose token it refused ends with an error."""
        terminated, rejected = self.structured.advance(progressed)
        self.scheduler.finish_requests([r.request_id for r in terminated], RequestStatus.FINISHED_STOPPED)
        for rejection in rejected:
            self.scheduler.finish_requests([rejection.request.request_id], RequestStatus.FINISHED_ERROR)
            self.output_processor.fail(rejection.request.parent_id, rejection.message)

    def _count_tokens(self, scheduler_output: SchedulerOutput) -> None:
        prompt_tokens = samples = 0
        for item in scheduler_output.scheduled:
            start = item.start
            prompt_len = len(item.request.prompt_token_ids)
            if start < prompt_len:  # a decoding request's rows are past its prompt
                prompt_tokens += min(start + item.num_new_tokens, prompt_len) - start
            if item.samples:
                samples += 1
        step_tokens = prompt_tokens + samples
        self.num_prompt_tokens_total += prompt_tokens
        self.num_generation_tokens_total += samples
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, step_tokens)] += 1
        self.iteration_tokens_sum += step_tokens

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks' processes (nothing to do with one rank)."""
        self.structured.shutdown()
        self.executor.shutdown()

    def get_stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv_manager.usage(),
            prefix_cache_queries=self.kv_manager.prefix_cache_queries,
            prefix_cache_hits=self.kv_manager.prefix_cache_hits,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_preemptions=self.scheduler.num_preemptions_total,
            num_kv_blocks=self.kv_manager.pool.num_blocks,
            block_size=self.config.cache.block_size,
            iteration_tokens_counts=tuple(self.iteration_tokens_counts),
            iteration_tokens_sum=self.iteration_tokens_sum,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {
            "spec_num_drafts": stats.num_drafts,
            "spec_num_draft_tokens": stats.num_draft_tokens,
            "spec_num_accepted_tokens": stats.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(stats.accepted_per_pos),
        }


def _ids(scheduler_output: SchedulerOutput) -> set[str]:
    return {item.request.request_id for item in scheduler_output.scheduled}
