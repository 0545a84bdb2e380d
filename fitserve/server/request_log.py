"""One log line per finished request (off with --disable-log-requests)."""

from __future__ import annotations

import logging
import time

from fitserve.core.outputs import RequestOutput

logger = logging.getLogger(__name__)


def log_finished_request(output: RequestOutput, max_log_len: int | None = None) -> None:
    """An output observer: logs the request when its final output arrives. With `max_log_len`
    (--max-log-len), the line also shows the prompt's first max_log_len characters and token ids."""
    if not output.finished:
        return
    timing = output.metrics
    generated = sum(len(choice.token_ids) for choice in output.outputs)
    reasons = ",".join(sorted({choice.finish_reason or "abort" for choice in output.outputs})) or "abort"
    ttft = ""
    if timing is not None and timing.first_token_time is not None:
        ttft = f", first token after {timing.first_token_time - timing.arrival_time:.2f} s"
    total = ""
    if timing is not None:
        total = f", {((timing.finished_time or time.time()) - timing.arrival_time):.2f} s in all"
    # A request the engine ended with an error is a warning (the engine logged the message itself).
    level = logging.WARNING if output.error is not None else logging.INFO
    logger.log(
        level,
        "Finished request %s: %d prompt tokens, %d generated, finish_reason=%s%s%s%s",
        output.request_id,
        len(output.prompt_token_ids),
        generated,
        reasons,
        ttft,
        total,
        _prompt_part(output, max_log_len),
    )


def _prompt_part(output: RequestOutput, max_log_len: int | None) -> str:
    """`, prompt: '...', prompt_token_ids: [...]`, each cut to max_log_len, as vLLM's request log shows
    them; "" without --max-log-len (fitserve's log leaves prompts out by default)."""
    if max_log_len is None:
        return ""
    text = output.prompt
    if text is not None and len(text) > max_log_len:
        text = text[:max_log_len] + "..."
    ids = output.prompt_token_ids
    shown_ids = f"{ids[:max_log_len]}"[:-1] + (", ...]" if len(ids) > max_log_len else "]")
    if max_log_len == 0 or not ids:
        shown_ids = "[...]" if ids else "[]"
    return f", prompt: {text!r}, prompt_token_ids: {shown_ids}"
