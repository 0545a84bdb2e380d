"""Ending the requests of a step that failed: the whole step (running out of device memory, an error of
the step), or only the requests whose own work raised, with any request of the step that reads a block one
of them was to write. The engine goes on with the others; blocks that were never written leave the prefix
cache."""

from __future__ import annotations

import logging
from typing import Any

import torch

from fitserve.config import EngineConfig
from fitserve.core.outputs import RequestOutput
from fitserve.core.request import RequestStatus
from fitserve.core.scheduler import Scheduler, SchedulerOutput
from fitserve.engine.out_of_memory import out_of_memory_message, request_failure_message, step_failure_message
from fitserve.engine.output_processor import OutputProcessor

logger = logging.getLogger("fitserve")


class StepFailures:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_bytes: int,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        kv_manager: Any,
    ) -> None:
        self.config = config
        self.kv_cache_bytes = kv_cache_bytes  # named by the out-of-memory message
        self.scheduler = scheduler
        self.output_processor = output_processor
        self.kv_manager = kv_manager

    def fail_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> list[RequestOutput]:
        """The step could not run: end that step's requests with an error (for running out of memory,
        one naming the knob to turn), free their blocks, and go on with the others."""
        num_tokens, num_seqs = scheduler_output.num_batched_tokens, len(scheduler_output.scheduled)
        if isinstance(error, torch.OutOfMemoryError):
            message = out_of_memory_message(self.config, num_tokens, num_seqs, error, self.kv_cache_bytes)
            logger.error(message)
        else:
            message = step_failure_message(error, num_seqs)
            logger.error(
                "An engine step of %d tokens over %d sequences failed; its requests were ended",
                num_tokens,
                num_seqs,
                exc_info=error,
            )
        parent_ids = self.end_with_error(scheduler_output.scheduled, {}, message)
        if torch.cuda.is_available() and isinstance(error, torch.OutOfMemoryError):
            torch.cuda.empty_cache()
        return self.output_processor.make_outputs(parent_ids)

    def fail_requests(
        self, scheduler_output: SchedulerOutput, failures: dict[str, BaseException]
    ) -> list[RequestOutput]:
        """End the requests whose own work raised (each with its own message), and any other request of
        the step that reads a block one of them was to write this step."""
        by_id = {item.request.request_id: item for item in scheduler_output.scheduled}
        failed_parents = {by_id[child_id].request.parent_id for child_id in failures}
        failed_items = [
            item for item in scheduler_output.scheduled if item.request.parent_id in failed_parents
        ]
        unwritten = self.unwritten_blocks(failed_items)
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
        parent_ids = self.end_with_error(failed_items, messages, "")
        if readers:
            shared = (
                "a request of the same step that shared this request's prompt blocks failed, so their "
                'contents were never computed: this request was ended (finish_reason "error") and can be '
                "retried; the server goes on"
            )
            parent_ids += self.end_with_error(readers, {}, shared)
        return self.output_processor.make_outputs(parent_ids)

    def end_unservable(self, requests: list) -> list[RequestOutput]:
        """End the requests the KV cache cannot hold even alone (the scheduler found each preempting
        itself, or not admitted, with no other request holding a block), naming both sizes and the fix,
        rather than retry them forever."""
        block_size = self.config.cache.block_size
        capacity = self.kv_manager.pool.num_usable_blocks * block_size
        override = self.config.cache.num_gpu_blocks_override
        messages: dict[str, str] = {}
        for request in requests:
            message = (
                f"the KV cache holds {capacity:,} tokens ({capacity // block_size:,} blocks of {block_size}"
                + (f", --num-gpu-blocks-override {override}" if override is not None else "")
                + f"), fewer than this request alone needs: it has {request.num_tokens:,} (a prompt of "
                f"{request.num_prompt_tokens:,} and {request.num_output_tokens:,} generated) and needs "
                "room for the next: lower its max_tokens, or give the cache more blocks (raise "
                "--num-gpu-blocks-override or leave it unset)"
            )
            logger.error("Request %s was ended: %s", request.parent_id, message)
            messages.setdefault(request.parent_id, message)
        parent_ids = list(messages)
        self._end_parents(parent_ids, messages, "")
        return self.output_processor.make_outputs(parent_ids)

    def unwritten_blocks(self, items: list) -> set[int]:
        """The blocks these scheduled requests were to fill this step: they leave the prefix cache."""
        block_size = self.config.cache.block_size
        unwritten: set[int] = set()
        for item in items:
            unwritten.update(
                self.kv_manager.uncache_unwritten(item.request.request_id, item.start // block_size)
            )
        return unwritten

    def end_with_error(self, items: list, messages: dict[str, str], default: str) -> list[str]:
        self.unwritten_blocks(items)
        parent_ids = list(dict.fromkeys(item.request.parent_id for item in items))
        self._end_parents(parent_ids, messages, default)
        return parent_ids

    def _end_parents(self, parent_ids: list[str], messages: dict[str, str], default: str) -> None:
        """Every child of these parents finishes with an error; each parent's output carries its message."""
        for parent_id in parent_ids:
            children = self.output_processor.child_ids(parent_id)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ERROR)
            self.output_processor.fail(parent_id, messages.get(parent_id, default))
