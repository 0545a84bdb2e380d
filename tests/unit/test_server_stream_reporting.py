"""What both streaming endpoints report beside the text (fitserve/server/stream_reporting.py): the usage
stream_options ask for, and the event that ends a broken stream."""

from __future__ import annotations

import json
import logging

import pytest

from fitserve.server.errors import APIError
from fitserve.server.protocol import StreamOptions
from fitserve.server.stream_reporting import StreamUsage, stream_error_event


@pytest.mark.parametrize(
    ("options", "force", "include", "continuous"),
    [
        (None, False, False, False),
        (None, True, True, False),
        (StreamOptions(include_usage=True), False, True, False),
        (StreamOptions(include_usage=True, continuous_usage_stats=True), False, True, True),
        (StreamOptions(continuous_usage_stats=True), False, False, False),  # needs include_usage
        (StreamOptions(continuous_usage_stats=True), True, True, True),  # which the flag gives
    ],
)
def test_the_usage_a_stream_reports(options, force, include, continuous) -> None:
    usage = StreamUsage.requested(options, force)
    assert (usage.include, usage.continuous) == (include, continuous)
    so_far = usage.so_far(7, 3)
    if continuous:
        assert so_far is not None
        assert (so_far.prompt_tokens, so_far.completion_tokens, so_far.total_tokens) == (7, 3, 10)
    else:
        assert so_far is None


def _payload(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event.removeprefix("data: "))


def test_an_api_error_ends_the_stream_as_it_is(caplog) -> None:
    error = APIError("n=9 is above the limit 8", param="n")
    logger = logging.getLogger("tests.stream_reporting")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        event = stream_error_event(error, "chat", "chatcmpl-1", logger)
    assert event == error.to_sse()
    assert not caplog.records


def test_any_other_failure_is_logged_and_sent_as_a_500(caplog) -> None:
    logger = logging.getLogger("tests.stream_reporting")
    with caplog.at_level(logging.ERROR, logger=logger.name):
        try:
            raise RuntimeError("the engine died")
        except RuntimeError as exc:
            event = stream_error_event(exc, "completion", "cmpl-7", logger)
    error = _payload(event)["error"]
    assert error["message"] == "generation failed: the engine died"
    assert error["code"] == 500
    [record] = caplog.records
    assert record.name == logger.name and record.getMessage() == "completion stream cmpl-7 failed"
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
