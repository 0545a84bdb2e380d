"""The synchronous engine: add requests, call step() until done. Not thread-safe by design."""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fitserve.config import EngineConfig
from fitserve.core.kv_cache_groups import make_kv_cache_manager
from fitserve.core.outputs import RequestMetrics, RequestOutput
from fitserve.core.request import Request, RequestStatus
from fitserve.core.sampling_params import SamplingParams
from fitserve.core.scheduler import Scheduler, SchedulerOutput
from fitserve.engine.detokenizer import IncrementalDetokenizer
from fitserve.engine.out_of_memory import out_of_memory_message, request_failure_message, step_failure_message
from fitserve.engine.output_processor import OutputProcessor, ParentRequest
from fitserve.engine.token_bytes import token_byte_table
from fitserve.kv_groups import group_num_blocks
from fitserve.logger import configure_default_logging
from fitserve.models.loader import (
    load_generation_defaults,
    load_tokenizer,
    read_generation_config,
    resolve_tokenizer_path,
)
from fitserve.planner.resolve import create_engine_config
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


# Upper bounds of vLLM's `vllm:iteration_tokens_total` histogram buckets (tokens per engine step).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    launched: LaunchedStep


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        configure_default_logging()
        self.config = config
        mc = config.model
        started = time.perf_counter()
        # A folder without a tokenizer is refused now, before any weight loads; the tokenizer itself
        # (importing transformers: ~10 s from a cold disk) then loads while the model does.
        tokenizer_folder = resolve_tokenizer_path(mc.tokenizer, mc.tokenizer_revision)
        tokenizer_loader = ThreadPoolExecutor(1, thread_name_prefix="fitserve-tokenizer")
        use_fast = mc.tokenizer_mode != "slow"  # --tokenizer-mode
        tokenizer = tokenizer_loader.submit(load_tokenizer, tokenizer_folder, mc.trust_remote_code, use_fast)
        try:
            self.executor = create_executor(config)
            if tokenizer.done() and tokenizer.exception() is not None:
                raise tokenizer.exception()  # a bad tokenizer stops the start before the profiling
            # the one memory model: every report of the KV cache's bytes, blocks and tokens reads it
            self.memory_plan = self.executor.initialize_kv_cache()
            self.tokenizer = tokenizer.result()
        finally:
            tokenizer_loader.shutdown(wait=False, cancel_futures=True)
        groups = config.kv_groups
        full_need = -(-mc.max_model_len // config.cache.block_size)
        num_blocks = group_num_blocks(groups, self.memory_plan.num_kv_blocks, full_need)
        self.kv_manager = make_kv_cache_manager(
            groups, num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        token_byte_table(self.tokenizer)  # built once now, not on the first request
        self.eos_token_ids = self._eos_token_ids()
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
        `fitserve serve`'s defaults."""
        return cls(create_engine_config(args, serving=serving))

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
        for child in children:
            self.scheduler.add_request(child)

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
            child_ids = self.output_processor.child_ids(parent_id)
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            self.output_processor.abort(parent_id)

    def has_unfinished_requests(self) -> bool:
        """True while step() has work: a request to schedule, or tokens in flight that someone awaits
        (a step whose requests were all aborted or stopped meanwhile is not waited for)."""
        if self.scheduler.has_unfinished_requests():
            return True
        step = self._in_flight
        return step is not None and any(not s.request.is_finished for s in step.scheduler_output.scheduled)

    # ---- the step loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plans and launches step N+1 while step N still runs on the device, then takes step N's
        tokens (updating the requests, detokenizing, finding stop strings) while N+1 runs. So the
        host's work hides behind the device's, and the device never waits for the host.

        Step N+1 is planned with step N's tokens as placeholders (see Scheduler). When step N sampled
        with penalties (they read the exact output tokens), its tokens are taken first instead."""
        outputs: list[RequestOutput] = []
        previous, self._in_flight = self._in_flight, None
        if previous is not None and previous.launched.needs_token_history:
            outputs.extend(self._take_tokens(previous))
            previous = None
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.is_empty:
            self._in_flight = self._launch_or_fail(scheduler_output, outputs)
        elif scheduler_output.finished_req_ids:
            self.executor.launch(scheduler_output)  # lets the runner drop finished requests' state
        if previous is not None:
            outputs.extend(self._take_tokens_or_fail(previous))
        return outputs

    def _launch_or_fail(
        self, scheduler_output: SchedulerOutput, outputs: list[RequestOutput]
    ) -> InFlightStep | None:
        """Launches the step. A request whose own work raised is ended alone (finish_reason "error") and
        the step runs without it; a step that fails as a whole ends its requests, never the engine."""
        while True:
            try:
                return self._launch(scheduler_output)
            except RequestsFailedError as error:
                failed = {
                    child_id: e
                    for child_id, e in error.failures.items()
                    if child_id in _ids(scheduler_output)
                }
                if not failed:
                    outputs.extend(self._fail_step(scheduler_output, error))
                    return None
                outputs.extend(self._fail_requests(scheduler_output, failed))
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
                outputs.extend(self._fail_step(scheduler_output, error))
                return None

    def _take_tokens_or_fail(self, step: InFlightStep) -> list[RequestOutput]:
        try:
            return self._take_tokens(step)
        except RankFailedError:
            raise
        except Exception as error:
            live = [item for item in step.scheduler_output.scheduled if not item.request.is_finished]
            return self._fail_step(dataclasses.replace(step.scheduler_output, scheduled=live), error)

    def _launch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        launched = self.executor.launch(scheduler_output)
        now = time.time()
        self._count_tokens(scheduler_output)
        self.output_processor.mark_scheduled([s.request.request_id for s in scheduler_output.scheduled], now)
        return InFlightStep(scheduler_output, launched)

    def _fail_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """The step could not run: end that step's requests with an error (for running out of memory,
        one naming the knob to turn), free their blocks, and go on with the others."""
        num_tokens, num_seqs = scheduler_output.num_batched_tokens, len(scheduler_output.scheduled)
        if isinstance(error, torch.OutOfMemoryError):
            message = out_of_memory_message(
                self.config, num_tokens, num_seqs, error, self.memory_plan.kv_cache_bytes
            )
            logger.error(message)
        else:
            message = step_failure_message(error, num_seqs)
            logger.error(
                "An engine step of %d tokens over %d sequences failed; its requests were ended",
                num_tokens,
                num_seqs,
                exc_info=error,
            )
        parent_ids = self._end_with_error(scheduler_output.scheduled, {}, message)
        if torch.cuda.is_available() and isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        return self.output_processor.make_outputs(parent_ids)

    def _fail_requests(
        self, scheduler_output: SchedulerOutput, failures: dict[str, BaseException]
    ) -> list[RequestOutput]:
        """End the requests whose own work raised (each with its own message), and any other request of
        the step that reads a block one of them was to write this step."""
        by_id = {item.request.request_id: item for item in scheduler_output.scheduled}
        failed_parents = {by_id[child_id].request.parent_id for child_id in failures}
        failed_items = [
            item for item in scheduler_output.scheduled if item.request.parent_id in failed_parents
        ]
        unwritten = self._unwritten_blocks(failed_items)
        readers = [
            item
            for item in scheduler_output.scheduled
            if item.request.parent_id not in failed_parents and unwritten.intersection(item.block_ids)
        ]
        messages: dict[str, str] = {}
        for child_id, error in failures.items():
            parent_id = by_id[child_id].request.parent_id
            logger.error("Request %s failed in the engine and was ended", parent_id, exc_info=error)
            messages.setdefault(parent_id, request_failure_message(error))
        parent_ids = self._end_with_error(failed_items, messages, "")
        if readers:
            shared = (
                "a request of the same step that shared this request's prompt blocks failed, so their "
                'contents were never computed: this request was ended (finish_reason "error") and can be '
                "retried; the server goes on"
            )
            parent_ids += self._end_with_error(readers, {}, shared)
        return self.output_processor.make_outputs(parent_ids)

    def _unwritten_blocks(self, items: list) -> set[int]:
        """The blocks these scheduled requests were to fill this step: they leave the prefix cache."""
        block_size = self.config.cache.block_size
        unwritten: set[int] = set()
        for item in items:
            unwritten.update(
                self.kv_manager.uncache_unwritten(item.request.request_id, item.start // block_size)
            )
        return unwritten

    def _end_with_error(self, items: list, messages: dict[str, str], default: str) -> list[str]:
        self._unwritten_blocks(items)
        parent_ids = list(dict.fromkeys(item.request.parent_id for item in items))
        for parent_id in parent_ids:
            children = self.output_processor.child_ids(parent_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
            self.output_processor.fail(parent_id, messages.get(parent_id, default))
        return parent_ids

    def _take_tokens(self, step: InFlightStep) -> list[RequestOutput]:
        runner_output = step.launched.result()
        now = time.time()
        self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        progressed = self.scheduler.update_from_output(step.scheduler_output, runner_output.sampled)
        stopped = self.output_processor.apply_tokens(progressed, runner_output.logprobs, now)
        for child, stop_string in stopped:
            child.stop_reason = stop_string
            self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED)
        parent_ids = list(dict.fromkeys(child.parent_id for child in progressed))
        return self.output_processor.make_outputs(parent_ids)

    def _count_tokens(self, scheduler_output: SchedulerOutput) -> None:
        step_tokens = 0
        for item in scheduler_output.scheduled:
            prompt_len = item.request.num_prompt_tokens
            prompt_tokens = max(0, min(item.start + item.num_new_tokens, prompt_len) - item.start)
            step_tokens += prompt_tokens + (1 if item.samples else 0)
            self.num_prompt_tokens_total += prompt_tokens
            if item.samples:
                self.num_generation_tokens_total += 1
        self.iteration_tokens_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, step_tokens)] += 1
        self.iteration_tokens_sum += step_tokens

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks' processes (nothing to do with one rank)."""
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
        )


def _ids(scheduler_output: SchedulerOutput) -> set[str]:
    return {item.request.request_id for item in scheduler_output.scheduled}
