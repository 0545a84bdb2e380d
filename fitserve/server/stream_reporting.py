"""What both streaming endpoints (/v1/chat/completions, /v1/completions) report beside the generated text:
the usage a request's stream_options ask for, and the event a failure ends the stream with."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from http import HTTPStatus

from fitserve.server.errors import APIError
from fitserve.server.protocol import StreamOptions
from fitserve.server.responses import UsageInfo


@dataclass(frozen=True)
class StreamUsage:
    include: bool  # a last chunk with the whole request's usage (stream_options.include_usage)
    continuous: bool  # every chunk with the usage so far too (stream_options.continuous_usage_stats)

    @classmethod
    def requested(cls, options: StreamOptions | None, force_include: bool) -> StreamUsage:
        """force_include: --enable-force-include-usage, as if every stream asked for include_usage (vLLM).
        Continuous usage (vLLM) needs include_usage as well."""
        include = force_include or bool(options and options.include_usage)
        return cls(include, include and bool(options and options.continuous_usage_stats))

    def so_far(self, prompt_tokens: int, completion_tokens: int) -> UsageInfo | None:
        """A chunk's usage when continuous: its prompt's tokens and its choice's tokens so far; else None."""
        if not self.continuous:
            return None
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


def stream_error_event(exc: Exception, stream: str, request_id: str, logger: logging.Logger) -> str:
    """The event that ends a stream `exc` broke (`data: [DONE]` follows it): an APIError as it is,
    anything else logged to `logger` with its traceback (call it from the `except` block) and sent as a
    500 "generation failed". stream: what the log line calls the stream (chat, completion)."""
    if isinstance(exc, APIError):
        return exc.to_sse()
    logger.exception("%s stream %s failed", stream, request_id)
    return APIError(f"generation failed: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR).to_sse()
