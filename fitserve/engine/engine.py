"""The synchronous engine: add requests, call step() until done. Not thread-safe by design."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fitserve.config import EngineConfig
from fitserve.engine.detokenizer import IncrementalDetokenizer
from fitserve.engine.kv_cache import KVCacheManager
from fitserve.engine.output_processor import OutputProcessor, ParentRequest
from fitserve.engine.outputs import RequestMetrics, RequestOutput
from fitserve.engine.request import Request, RequestStatus
from fitserve.engine.sampling_params import SamplingParams
from fitserve.engine.scheduler import Scheduler
from fitserve.engine.token_bytes import token_byte_table
from fitserve.logger import configure_default_logging
from fitserve.models.loader import load_generation_defaults, load_tokenizer
from fitserve.worker.executor import create_executor

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


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        configure_default_logging()
        self.config = config
        mc = config.model
        started = time.perf_counter()
        self.tokenizer = load_tokenizer(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        self.executor = create_executor(config)
        num_blocks = self.executor.initialize_kv_cache()
        self.kv_manager = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        token_byte_table(self.tokenizer)  # built once now, not on the first request
        self.eos_token_ids = self._eos_token_ids()
        self._generation_defaults = self._load_generation_defaults()
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # The last step's new tokens, detokenized while the next step runs: (requests, logprobs, time).
        self._pending: tuple[list[Request], dict, float] | None = None
        logger.info(
            "Engine ready in %.1f s: max_model_len %d, KV cache %d tokens, "
            "max concurrency %.1fx at full length",
            time.perf_counter() - started,
            mc.max_model_len,
            (num_blocks - 1) * config.cache.block_size,
            (num_blocks - 1) * config.cache.block_size / mc.max_model_len,
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> Engine:
        return cls(args.create_engine_config())

    # ---- configuration views ------------------------------------------------------------------------
    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.config.model.hf_config, self._generation_config_obj()):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    def _generation_config_obj(self):
        try:
            from transformers import GenerationConfig

            return GenerationConfig.from_pretrained(self.config.model.model_path)
        except (OSError, ValueError):
            return None

    def _load_generation_defaults(self) -> dict:
        setting = self.config.model.generation_config
        if setting == "vllm":
            return {}
        folder = self.config.model.model_path if setting == "auto" else setting
        defaults = load_generation_defaults(folder)
        if defaults:
            logger.info("Default sampling parameters from the model's generation_config.json: %s", defaults)
        return defaults

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
            if self._pending is not None:
                progressed, token_logprobs, token_time = self._pending
                kept = [child for child in progressed if child.parent_id != parent_id]
                self._pending = (kept, token_logprobs, token_time) if kept else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._pending is not None

    # ---- the step loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and starts a step, then, while the device computes it, detokenizes the tokens of
        the step before (finding stop strings) and builds their outputs; then takes this step's
        tokens. A request ended by a stop string may so compute one token more, which is dropped."""
        scheduler_output = self.scheduler.schedule()
        finish_step = self.executor.launch(scheduler_output)
        outputs = self._process_pending()
        runner_output = finish_step()
        if scheduler_output.is_empty:
            return outputs
        self._count_tokens(scheduler_output)
        now = time.time()
        self.output_processor.mark_scheduled([s.request.request_id for s in scheduler_output.scheduled], now)
        self.output_processor.add_prompt_logprobs(runner_output.prompt_logprobs)
        progressed = self.scheduler.update_from_output(scheduler_output, runner_output.sampled)
        self._pending = (progressed, runner_output.logprobs, now)
        return outputs

    def _process_pending(self) -> list[RequestOutput]:
        if self._pending is None:
            return []
        progressed, token_logprobs, token_time = self._pending
        self._pending = None
        stopped = self.output_processor.apply_tokens(progressed, token_logprobs, token_time)
        for child, stop_string in stopped:
            child.stop_reason = stop_string
            self.scheduler.finish_requests([child.request_id], RequestStatus.FINISHED_STOPPED)
        parent_ids = list(dict.fromkeys(child.parent_id for child in progressed))
        return self.output_processor.make_outputs(parent_ids)

    def _count_tokens(self, scheduler_output) -> None:
        for item in scheduler_output.scheduled:
            prompt_len = item.request.num_prompt_tokens
            self.num_prompt_tokens_total += max(
                0, min(item.start + item.num_new_tokens, prompt_len) - item.start
            )
            if item.samples:
                self.num_generation_tokens_total += 1

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
        )
