"""Request validation messages and the JSON shapes of responses and stream chunks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fitserve.server.errors import APIError, describe_validation_error
from fitserve.server.protocol import ChatCompletionRequest, CompletionRequest
from fitserve.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
)


def first_error(model: type, body: object) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    return describe_validation_error(caught.value.errors())


def test_validation_messages_name_the_field() -> None:
    message, param = first_error(ChatCompletionRequest, {"messages": [{"role": "user", "content": 3}]})
    assert param == "messages[0].content" and message.startswith("messages[0].content: ")
    message, param = first_error(CompletionRequest, {"prompt": [[1], "a"]})
    assert param == "prompt" and message.startswith("prompt must be a string, a list of strings")
    message, param = first_error(
        ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "n": "two"}
    )
    assert param == "n" and "valid integer" in message and '(got "two")' in message
    message, param = first_error(ChatCompletionRequest, {})
    assert (message, param) == ("messages is required: add it to the request body", "messages")


def test_unknown_top_level_fields_are_kept_for_the_route_to_judge() -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "foo": 1})
    assert request.model_extra == {"foo": 1}


def test_error_shape() -> None:
    error = APIError("n=9 is above the limit 8", param="n")
    assert error.to_dict() == {
        "error": {"message": "n=9 is above the limit 8", "type": "BadRequestError", "param": "n", "code": 400}
    }
    assert error.to_sse().startswith('data: {"error": ')


def test_message_keeps_null_content_and_drops_empty_extras() -> None:
    message = ChatResponseMessage(content=None)
    assert message.model_dump() == {"role": "assistant", "content": None}
    choice = ChatChoice(index=0, message=ChatResponseMessage(content="hi"), finish_reason="stop")
    assert choice.model_dump() == {
        "index": 0,
        "message": {"role": "assistant", "content": "hi"},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,
    }


def test_stream_deltas_carry_only_what_changed() -> None:
    call = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a"'))
    chunk = ChatCompletionChunk(
        id="chatcmpl-1",
        model="m",
        created=1,
        choices=[ChatStreamChoice(index=0, delta=DeltaMessage(tool_calls=[call]))],
    )
    assert chunk.model_dump() == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
            }
        ],
    }
